"""``agent_step_share``: the steps a fork reads from the runs it descends from, and
``steps_of``, a run's whole log read through them.

A fork's log up to its fork point is the original's, byte for byte; rather than copy those rows
(a 2,000-step run with 20 MB of payloads would take half a second to copy), the fork holds one
row here per stretch of another run's log it reads: steps ``lo`` to ``hi - 1`` of ``source``.
Its own steps (from the fork point on, and any copied in later) are ordinary ``agent_step`` rows
of its own. ``durable_agents.forks.planning`` writes these rows and says how the log is read."""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, ClassVar

from django.db import models

from durable_agents.models.ids import step_part
from durable_agents.models.steps import AgentStep

if TYPE_CHECKING:
    from durable_agents.models.runs import AgentRun


class SharedSteps(models.Model):
    """Steps ``lo`` (inclusive) to ``hi`` (exclusive) of ``source``'s log are also ``fork``'s.

    Never updated: written with the fork, deleted with it, or replaced by copies of the steps
    when retention deletes ``source`` (``forks.keep_shared_steps``). ``source`` is RESTRICTed:
    a run whose steps a fork still reads cannot be deleted by anything else."""

    pk = models.CompositePrimaryKey("fork_id", "lo")
    # The primary key (fork_id, lo) already indexes fork_id.
    fork = models.ForeignKey(
        "durable_agents.AgentRun", on_delete=models.CASCADE, related_name="+", db_index=False
    )
    source = models.ForeignKey(
        "durable_agents.AgentRun", on_delete=models.RESTRICT, related_name="+"
    )
    lo = models.IntegerField()
    hi = models.IntegerField()

    class Meta:
        db_table = "agent_step_share"
        ordering: ClassVar[list[str]] = ["fork_id", "lo"]

    def __str__(self) -> str:
        return f"{self.fork_id} reads {self.source_id}#{self.lo}..{self.hi - 1}"


def steps_of(run_id: uuid.UUID) -> models.QuerySet[AgentStep]:
    """A run's whole log as a queryset of ``AgentStep``: its own rows, and for a fork the
    stretches of other runs' logs it shares. Filter, order and slice it like any queryset;
    this is what the admin, replay, the tests and an archiver read a transcript through.

    Two statements (the stretches, then the steps), yet never a step missing or twice: the
    fork's own rows are taken at any seq, so steps that retention copied into the fork between
    the two statements are its own rows by then, and the copies and the deletion of their
    source commit together."""
    # Each run's rows are in the partition of its id's day (part): naming it lets PostgreSQL
    # read that partition only.
    own = models.Q(run_id=run_id, part=step_part(run_id))
    for source, lo, hi in SharedSteps.objects.filter(fork_id=run_id).values_list(
        "source_id", "lo", "hi"
    ):
        own |= models.Q(run_id=source, part=step_part(source), seq__gte=lo, seq__lt=hi)
    return AgentStep.objects.filter(own)


def log_of(run: AgentRun) -> models.QuerySet[AgentStep]:
    """The run's whole log: through ``steps_of`` for a fork (its shared steps are other runs'
    rows), and without looking for shared stretches for any other run (one query less). What
    the admin's transcript and the command line's ``show`` read."""
    if run.fork_seq is not None:
        return steps_of(run.pk)
    return AgentStep.objects.filter(run_id=run.pk)
