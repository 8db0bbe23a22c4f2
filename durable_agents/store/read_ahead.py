"""What the resume of claimed runs reads first, read for a whole claim batch at once.

A run claimed again (woken from a wait, handed back by a draining worker, taken over after a
crash) begins by reading its log, then the effects its last turn's calls recorded, then
whether a message waits in its inbox: three round trips of its own, each taking a pooled
connection from a slot among hundreds. When a thousand runs wake together the worker claims
them by the hundred; right after each claim it reads all three for the whole batch, one
statement each, sent together (on PostgreSQL in one pipeline: one round trip):

    LOGS_SQL       the steps of every run of the batch whose log is not too big, in (run,
                   seq) order
    EFFECTS_SQL    the recorded calls of the batch's runs at their last step
    MESSAGES_SQL   which of the batch's runs have a message waiting (only for the runs whose
                   claim did not look already: on PostgreSQL the claim itself looks)

and hands each claim what is its own (``Claim.ahead``, used once by the runner). A run claimed
alone, by the last commit of another, reads for itself: for one run, the slot's plain reads
cost less (0.38-0.48 ms of CPU for the three of a log of six steps, against 0.44-0.65 ms in
this batch's form, pipelined or not); its inbox its claim looked into already. Only runs
that are no fork (a fork also reads stretches of other runs' logs) and whose log is short
(``MAX_STEPS``, ``MAX_CHARS``: a long log is read by its slot, which keeps the claimer free
and what a batch holds at once bounded). Nothing here can change what a run does: no other
worker writes a claimed run's log or its effects (the fence), and a message queued after the
look is folded at the next model call, or keeps the run going at its last commit (which looks
again, under the run's lock), as one queued just after the slot's own look would. The look
stands for the slot's own only at a first model call that no tool call precedes: a resume
that begins with its tools (a woken wait) looks again after them, so that a message sent
while they run follows their results. A worker whose listener heard no message for the run
since the batch's look knows that none came (engine/inbox_hint.py): it takes that look as the
run's last and skips the one after the tools.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections import defaultdict
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager

from django.db import DatabaseError, connection

from durable_agents._internal.encryption import UndecryptableValue
from durable_agents.models import AgentRun, ToolEffect, step_part
from durable_agents.store.base import Claim, LogRow, ReadAhead, unsealed_log
from durable_agents.store.effect_rows import EFFECT_COLUMNS, effects_from

logger = logging.getLogger("durable_agents.store")

# Runs whose log holds more steps, or more characters of payload, than this are left to their
# slots.
MAX_STEPS = 200
MAX_CHARS = 1_000_000

LOGS_SQL = """\
SELECT run_id, seq, kind, payload, content_start, content_end
  FROM (SELECT run_id, seq, kind, payload, content_start, content_end,
               sum(length(payload)) OVER (PARTITION BY run_id) AS chars
          FROM agent_step
         WHERE run_id IN ({runs}) AND part IN ({parts})) AS steps
 WHERE chars <= %s
 ORDER BY run_id, seq"""
EFFECTS_SQL = f"SELECT {EFFECT_COLUMNS} FROM tool_effect WHERE (run_id, seq) IN ({{pairs}})"
MESSAGES_SQL = (
    "SELECT DISTINCT run_id FROM agent_message WHERE run_id IN ({runs}) AND folded_seq IS NULL"
)


def wanted(claim: Claim) -> bool:
    """Whether the resume of ``claim`` is read ahead: a run claimed again (not one whose only
    step is its task, which the claim carries), no fork, a short log, readable."""
    run = claim.run
    return (
        claim.task_payload is None
        and claim.unreadable is None
        and run.fork_seq is None
        and 0 < run.last_seq <= MAX_STEPS
    )


def read_ahead(
    claims: Sequence[Claim],
    together: Callable[[], AbstractContextManager[object]] = contextlib.nullcontext,
) -> list[Claim]:
    """``claims``, those that qualify (``wanted``) with their ``ahead``; on a database error
    the claims as they were (each slot then reads for itself). The three statements are sent
    inside ``together()``: on PostgreSQL a pipeline, so that they take one round trip."""
    chosen = [claim for claim in claims if wanted(claim)]
    if not chosen:
        return list(claims)
    try:
        ahead = _read(chosen, together)
    except DatabaseError:
        logger.debug("reading ahead for %d claims failed", len(chosen), exc_info=True)
        return list(claims)
    except Exception:  # a saving, never a reason to lose claims just taken
        logger.exception("reading ahead for %d claims failed", len(chosen))
        return list(claims)
    return [
        dataclasses.replace(claim, ahead=ahead[claim.run_id]) if claim.run_id in ahead else claim
        for claim in claims
    ]


def _read(
    claims: Sequence[Claim], together: Callable[[], AbstractContextManager[object]]
) -> dict[object, ReadAhead]:
    prep = AgentRun._meta.pk.get_db_prep_value
    ids = [claim.run_id for claim in claims]
    runs = [prep(run_id, connection) for run_id in ids]
    keys = dict(zip(runs, ids, strict=True))  # the database's value of an id -> the id
    marks = ", ".join(["%s"] * len(runs))
    parts = sorted({step_part(run_id) for run_id in ids})
    # Each run's own last step only: (run, seq) pairs, not every seq of every run.
    pairs = [
        value
        for run, claim in zip(runs, claims, strict=True)
        for value in (run, claim.run.last_seq)
    ]
    # The inbox of the runs whose claim did not look into it already.
    unlooked = [
        run for run, claim in zip(runs, claims, strict=True) if claim.messages_waiting is None
    ]
    with connection.cursor() as logs, connection.cursor() as inbox, connection.cursor() as calls:
        with together():
            logs.execute(
                LOGS_SQL.format(runs=marks, parts=", ".join(["%s"] * len(parts))),
                [*runs, *parts, MAX_CHARS],
            )
            if unlooked:
                inbox.execute(MESSAGES_SQL.format(runs=", ".join(["%s"] * len(unlooked))), unlooked)
            calls.execute(EFFECTS_SQL.format(pairs=", ".join(["(%s, %s)"] * len(runs))), pairs)
        rows: dict[object, list[LogRow]] = defaultdict(list)
        for run, seq, kind, payload, start, end in logs.fetchall():
            rows[keys.get(run, run)].append((seq, kind, payload, start, end))
        waiting = {keys.get(run, run) for (run,) in inbox.fetchall()} if unlooked else set()
        effects: dict[object, dict[str, ToolEffect]] = defaultdict(dict)
        for effect in effects_from(calls.fetchall(), connection):
            effects[effect.run_id][effect.key] = effect
    ahead: dict[object, ReadAhead] = {}
    for claim in claims:
        run_id = claim.run_id
        own = rows.get(run_id, [])
        if not own or own[-1][0] != claim.run.last_seq:
            continue  # too big, or not the log the claim says (it cannot be): the slot reads it
        try:
            log = unsealed_log(own)
        except UndecryptableValue:
            continue  # the slot meets it, and dead-letters the run as it should
        looked = claim.messages_waiting
        ahead[run_id] = ReadAhead(
            log,
            claim.run.last_seq,
            effects.get(run_id, {}),
            run_id in waiting if looked is None else looked,
        )
    return ahead
