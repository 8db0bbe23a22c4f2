"""A run's log through the ORM (and one raw statement, ``LOG_SQL``): reading it, a fork's
shared stretches included, and creating a fork. Plain functions; ``PortableStore`` and
``PostgresStore`` call them.

    create_fork     agent_run (pending, last_seq = the fork point) + agent_step_share + its
                    edited step + the inherited effects; a child's fork joins its tree
    load_log_rows   LOG_SQL: the run's own rows and the stretches it shares, one snapshot
    load_steps      the run's own steps after a seq
"""

from __future__ import annotations

from django.db import connection, transaction

from durable_agents.models import AgentRun, AgentStep, SharedSteps, ToolEffect, step_part, steps_of
from durable_agents.store.base import (
    ForkWrite,
    LogRow,
    RunId,
    StepTuple,
    refuse_fork_in_tree,
    unsealed_log,
)
from durable_agents.store.key_rows import take_turn
from durable_agents.store.portable_trees import lock_tree_root

# The log of a run as the rebuild reads it: plain SQL, because the ORM's row iteration costs
# more than the rest of the rebuild. Its own rows, from its own partition (part: its id's day),
# and for a fork the stretches of other runs' logs it shares (agent_step_share). One statement,
# so one snapshot: a retention that copies shared steps into the fork and deletes their source
# is seen entirely or not at all. A run that is no fork shares nothing and reads OWN_LOG_SQL:
# the join of LOG_SQL names no partition, so PostgreSQL would plan a scan of each one even for
# a run with no stretch to read (a millisecond more per rebuild at fifty days of partitions).
_OWN_ROWS = """\
SELECT seq, kind, payload, content_start, content_end
  FROM agent_step
 WHERE run_id = %(run)s AND part = %(part)s"""
OWN_LOG_SQL = f"""\
{_OWN_ROWS}
 ORDER BY 1"""
LOG_SQL = f"""\
{_OWN_ROWS}
UNION ALL
SELECT s.seq, s.kind, s.payload, s.content_start, s.content_end
  FROM agent_step_share h
  JOIN agent_step s ON s.run_id = h.source_id AND s.seq >= h.lo AND s.seq < h.hi
 WHERE h.fork_id = %(run)s
 ORDER BY 1"""


def create_fork(run: AgentRun, write: ForkWrite) -> AgentRun:
    """``Store.create_fork``: the run, its shared stretches, its own step, its effects."""
    with transaction.atomic():
        if run.parent_id is not None:
            run.root_id = _join_tree(run, write)
        if run.concurrency_key is not None:
            run.fair_at = take_turn(run.concurrency_key)
        run.save(force_insert=True)
        SharedSteps.objects.bulk_create(
            SharedSteps(fork=run, source_id=source, lo=lo, hi=hi) for source, lo, hi in write.shares
        )
        if write.own_step is not None:
            seq, kind, payload = write.own_step
            AgentStep.objects.create(run=run, seq=seq, kind=kind, payload=payload)
        ToolEffect.objects.bulk_create(write.effects)
    run.refresh_from_db()
    return run


def load_log_rows(run_id: RunId | str, *, shares: bool = True) -> list[LogRow]:
    """``Store.load_log_rows``: LOG_SQL (OWN_LOG_SQL for a run that is no fork), the
    payloads decrypted."""
    with connection.cursor() as cursor:
        run = AgentRun._meta.pk.get_db_prep_value(run_id, connection)
        cursor.execute(
            LOG_SQL if shares else OWN_LOG_SQL,
            {"run": run, "part": step_part(run_id)},
        )
        rows: list[LogRow] = cursor.fetchall()
    return unsealed_log(rows)


def load_steps(run_id: RunId, after_seq: int = -1) -> list[StepTuple]:
    """``Store.load_steps``: the run's own steps after ``after_seq``."""
    return list(
        steps_of(run_id)
        .filter(seq__gt=after_seq)
        .order_by("seq")
        .values_list("seq", "kind", "payload")
    )


def _join_tree(run: AgentRun, write: ForkWrite) -> RunId | None:
    """The root of the tree a fork of a child run joins, counted as a spawn counts: the root's
    row locked, then the parent's (a spawn's order: no deadlock with spawns or cancels)."""
    parent_id = run.parent_id
    root_id = lock_tree_root(parent_id)
    assert parent_id is not None  # the caller checked it
    assert root_id is not None  # the parent's root, or the parent
    parent_status = (
        AgentRun.objects.select_for_update(no_key=True)
        .filter(pk=parent_id)
        .values_list("status", flat=True)
        .first()
    )
    root_status = AgentRun.objects.filter(pk=root_id).values_list("status", flat=True).first()
    refuse_fork_in_tree(
        parent_status,
        root_status,
        AgentRun.objects.filter(parent_id=parent_id).count(),
        1 + AgentRun.objects.filter(root_id=root_id).count(),
        write,
    )
    return root_id
