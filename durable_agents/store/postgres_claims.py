"""Claiming runs on PostgreSQL: one statement takes a worker's next runs, one renews every
lease it holds (``PostgresStore``'s claim and heartbeat: plain functions it calls).

    claim   CLAIM_SQL         lock the claimable runs (``CLAIMABLE_RUNS``: pending runs,
                              expired leases and due waits, of the agent versions this
                              process defines: ``ROUTED``), admit them within their
                              concurrency keys' limits (``ADMITTED``, race-free:
                              store/concurrency.py), lease them, attempt + 1
                              (``TAKE_CLAIMABLE_RUNS``)
    wake    CLAIM_SQL (due)   a due timer or timeout, or the end of a debounced start's
                              quiet window: the claim takes the run and says what ended
                              its wait (``woken_by``)
    next    NEXT_WAKE_SQL     how soon the first timer or timeout comes due: an idle
                              worker claims again then, not a whole poll later
    renew   RENEW_ALL_SQL     the heartbeat: every lease of a worker, one statement, and
                              the runs it held that are no longer its own; with the
                              worker's row (RENEW_ALL_AND_BEAT_SQL: ``WORKER_BEAT``), or
                              that row alone when it holds no run (BEAT_SQL)

``CLAIMABLE_SQL`` is the claim's look without the take (the tests EXPLAIN it). The same
fragments claim a worker's next run in the statement of a run's last step
(``CLAIMABLE_RUNS_IF_FENCED``: FINISH_AND_CLAIM_SQL, store/postgres_steps.py). A row just
claimed becomes a ``Claim`` here (``read_claim``), or, when it cannot be decoded, its run is
dead-lettered as poison rather than failing the claim.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Sequence
from typing import Any

from django.db import connection
from django.db.backends.base.base import BaseDatabaseWrapper

from durable_agents._internal import encryption
from durable_agents.declare.agents import registry
from durable_agents.exceptions import StoredValueError
from durable_agents.models import STEP_PAYLOAD, AgentRun
from durable_agents.models.ids import part_of_day
from durable_agents.models.step_partitions import part_of_run
from durable_agents.store import concurrency, key_rows, portable_trees
from durable_agents.store.base import Claim, LeaseLoss, Presence, RunId, lease_losses
from durable_agents.store.postgres_cursor import binding_cursor

# -- Fragments -------------------------------------------------------------------------------

# The limit of a run's concurrency key: CONCURRENCY_LIMITS[key] (the parallel arrays
# %(limit_keys)s and %(limit_values)s), else the limit its agent had when it started, else none
# (NULL), as for a run without a key.
KEY_LIMIT = (
    "coalesce((%(limit_values)s::integer[])[array_position(%(limit_keys)s::text[],"
    " run.concurrency_key)], run.concurrency_limit)"
)

# The runs of a run's key that hold a slot, counted on the statement's snapshot (a STABLE
# function: migration 0010 says why not a subquery): the cheap filter of the candidates
# (store/concurrency.py; ADMITTED decides, race-free). ``{freed}``: less the run of the key
# this statement ends (FINISH_AND_CLAIM_SQL), or nothing.
_HELD = "agent_concurrency_holders(run.concurrency_key){freed}"

# The runs a claim may take, as the CTEs ``due`` and ``ready`` ({and_also}: an extra condition
# on both, or nothing; filled in by str.format, so no other brace may appear here), each with
# its concurrency key, the key's limit, its holders and the run's place in the claim's order.
# ``due``: waiting runs whose timer or timeout is past (late by definition), in wake_at order;
# ``ready``: pending runs and runs whose lease expired, highest priority first, then by turn
# (fair_at: fair across concurrency keys), then oldest, read in that order from
# agent_run_claim_fair (priority DESC, fair_at, created_at); %(limit)s in all. Both skip the
# runs whose key has no slot free.
# ``due`` ignores priority on purpose: a due timer is late already, and ordering it by
# priority costs either a sort of every due run on each claim (agent_run_wake is on wake_at
# alone: with a backlog of 20,000 due timers among 100,000 waiting runs, 23 ms a claim instead
# of 0.1 ms) or an index led by priority, which reads every waiting run's entry when none is
# due (0.6 ms instead of 0.04 ms at 100,000, growing with them). Events, answers and
# children's ends wake a run to pending, where ``ready`` orders it by its priority. The
# predicates on status must imply those of the partial indexes agent_run_wake (status =
# 'waiting', wake_at not null) and agent_run_claim_fair (status in pending, running), or
# the planner cannot use them and scans the table (tests/integration/test_leases.py EXPLAINs
# CLAIMABLE_SQL).
# Both lock FOR NO KEY UPDATE SKIP LOCKED: workers skip each other's runs instead of queueing,
# and a step's foreign key does not conflict with the lock.
_CLAIMABLE_RUNS = """\
due AS (
SELECT id, concurrency_key, {key_limit} AS key_limit,
       CASE WHEN concurrency_key IS NULL THEN 0 ELSE {held} END AS held,
       0 AS part, wake_at AS due_at, priority, fair_at, created_at
  FROM agent_run AS run
 WHERE status = 'waiting'
   AND wake_at <= now(){and_also}
   AND {has_room}
   AND {routed}
 ORDER BY wake_at
 LIMIT %(limit)s
   FOR NO KEY UPDATE SKIP LOCKED
), ready AS (
SELECT id, concurrency_key, {key_limit} AS key_limit,
       CASE WHEN concurrency_key IS NULL THEN 0 ELSE {held} END AS held,
       1 AS part, NULL::timestamptz AS due_at, priority, fair_at, created_at
  FROM agent_run AS run
 WHERE status IN ('pending', 'running')
   AND (lease_until IS NULL OR lease_until < now()){and_also}
   AND {has_room}
   AND {routed}
 ORDER BY priority DESC, fair_at, created_at
 LIMIT greatest(%(limit)s - (SELECT count(*) FROM due), 0)
   FOR NO KEY UPDATE SKIP LOCKED
)"""

# The candidates within their keys' limits on the snapshot (the n-th of a key only while its
# holders leave room for n more), %(limit)s at most, and of their concurrency keys those the
# claim may take runs of (store/concurrency.py says why this is race-free): ``wanted``, each
# key's candidates and its lowest limit among them; ``admitted``, the keys whose row this
# statement locks, in key order, waiting for a claim that holds one, and whose holders,
# counted by agent_concurrency_held on a fresh snapshot (again after such a wait:
# EvalPlanQual), leave room for them all; ``served``, the update of their rows that a claim
# waiting for one of them sees. The function's snapshot has a command id of its own, so it
# sees what this statement did before it: the run FINISH_AND_CLAIM_SQL ended (its ``fence``,
# which ``ready`` read first) no longer counts there.
ADMITTED = """\
claimable AS (
SELECT id, concurrency_key, key_limit
  FROM (SELECT *, row_number() OVER (PARTITION BY concurrency_key
                                     ORDER BY part, due_at, priority DESC, fair_at, created_at
                                    ) AS nth
          FROM (SELECT * FROM due UNION ALL SELECT * FROM ready) AS locked) AS ranked
 WHERE concurrency_key IS NULL OR key_limit IS NULL OR held + nth <= key_limit
 LIMIT %(limit)s
), wanted AS (
SELECT concurrency_key, count(*) AS runs, min(key_limit) AS key_limit
  FROM claimable
 WHERE concurrency_key IS NOT NULL
 GROUP BY concurrency_key
), admitted AS (
SELECT k.key
  FROM agent_concurrency_key AS k JOIN wanted ON wanted.concurrency_key = k.key
 WHERE wanted.key_limit IS NULL
    OR agent_concurrency_held(k.key) + wanted.runs <= wanted.key_limit
 ORDER BY k.key
   FOR NO KEY UPDATE OF k
), served AS (
UPDATE agent_concurrency_key SET claimed_at = now() WHERE key IN (SELECT key FROM admitted)
)"""

# Routing: only runs of the agent versions this process defines (%(serves)s: route keys,
# agent and version joined by chr(31)), less those started with a definition of them it
# cannot serve (%(refuses)s: agent, version and fingerprint): ``AgentRegistry.routing``. A run
# no live worker serves stays pending, untouched, and costs no attempt. Plain filters on the
# rows the indexes give, in their order: the claim's plan does not change.
ROUTED = (
    "(run.agent || chr(31) || run.prompt_version) = ANY(%(serves)s::text[])\n"
    "   AND NOT (run.agent || chr(31) || run.prompt_version || chr(31) || run.fingerprint)"
    " = ANY(%(refuses)s::text[])"
)

# The run ending in this statement (FINISH_AND_CLAIM_SQL's ``fence``) frees its key's slot:
# the filter's count, on the statement's snapshot, still sees it running.
_FREED = " - (SELECT count(*) FROM fence WHERE fence.concurrency_key = run.concurrency_key)"


def _claimable_runs(and_also: str, freed: str) -> str:
    held = _HELD.format(freed=freed)
    has_room = (
        f"(run.concurrency_key IS NULL\n        OR {KEY_LIMIT} IS NULL\n"
        f"        OR {KEY_LIMIT} > {held})"
    )
    return _CLAIMABLE_RUNS.format(
        and_also=and_also, key_limit=KEY_LIMIT, held=held, has_room=has_room, routed=ROUTED
    )


CLAIMABLE_RUNS = _claimable_runs("", "")
# The same runs, taken only if the fence of the statement's step held.
CLAIMABLE_RUNS_IF_FENCED = _claimable_runs("\n   AND EXISTS (SELECT 1 FROM fence)", _FREED)

# The claim of the admitted candidates: lease, attempt + 1 (what fences out the previous
# holder) and counters. ``claimable`` has a constant LIMIT, which lets the planner use a nested
# loop on the primary key rather than a hash join over the table.
TAKE_CLAIMABLE_RUNS = """\
UPDATE agent_run AS run
   SET status = 'running',
       lease_owner = %(owner)s,
       lease_until = now() + make_interval(secs => %(lease)s),
       attempt = run.attempt + 1,
       stalled_claims = run.stalled_claims + 1,
       started_at = coalesce(run.started_at, now()),
       -- A due wait: what ended it. Any other run keeps its own (a crash after a wake).
       -- A debounced start (its quiet window is over) is no wake of a call: NULL.
       woken_by = CASE WHEN run.status <> 'waiting' THEN run.woken_by
                       WHEN run.waiting_for = 'debounce' THEN NULL
                       WHEN run.waiting_for = 'timer' THEN '{"timer": true}'
                       ELSE '{"timeout": true}' END,
       wake_at = NULL,
       updated_at = now()
 WHERE run.id IN (SELECT id FROM claimable
                   WHERE concurrency_key IS NULL
                      OR concurrency_key IN (SELECT key FROM admitted))
RETURNING run.*,
          -- A run with nothing but its task: its log comes with the claim (no second read).
          -- Read only from the partitions of yesterday to tomorrow (bounds PostgreSQL prunes
          -- before it runs the statement, where the run's own day it cannot): the task of a
          -- run started earlier is read with its log instead (NULL here).
          (SELECT payload FROM agent_step
            WHERE run_id = run.id AND seq = 0 AND kind = 'task' AND run.last_seq = 0
              AND part = {RUN_PART}
              AND part BETWEEN %(recent_from)s AND %(recent_to)s
          ) AS task_payload,
          -- Whether a message waits in its inbox: the look before its first model call,
          -- made by the claim (an index probe of agent_message_waiting) instead of a
          -- statement of its own.
          EXISTS (SELECT 1 FROM agent_message AS message
                   WHERE message.run_id = run.id AND message.folded_seq IS NULL
          ) AS messages_waiting""".replace("{RUN_PART}", part_of_run("run.id"))

# -- Statements ------------------------------------------------------------------------------

# The runs a claim may take, without taking them (tests EXPLAIN it: the partial indexes).
CLAIMABLE_SQL = f"""
WITH {CLAIMABLE_RUNS}
SELECT id FROM due UNION ALL SELECT id FROM ready"""

# Claim: lock, admit, lease and counters in one statement. One row per run taken, or one row
# of NULLs when none was; ``candidates``: how many the statement locked (more than it took:
# a concurrency key had fewer slots than candidates, or its last slot went to another claim
# meanwhile, and a claim again may take other runs).
CLAIM_SQL = f"""
WITH {CLAIMABLE_RUNS},
{ADMITTED}, taken AS (
{TAKE_CLAIMABLE_RUNS}
)
SELECT (SELECT count(*) FROM due) + (SELECT count(*) FROM ready) AS candidates, taken.*
  FROM (SELECT 1) AS one LEFT JOIN taken ON true"""

# The heartbeat of a whole worker: one statement renews every lease it holds, whatever their
# number, and names the runs it held that are no longer its own, with their status. The outer
# SELECT locks those rows FOR SHARE: under READ COMMITTED that waits for a transaction that is
# changing one (its slot finishing or parking it, a cancel) and reads the row as committed,
# where the statement's own snapshot would still say 'running' and call a finished run lost.
# Written out: its fence is FENCE over a list of (id, attempt) pairs, not one claim.
RENEW_ALL_SQL = """
WITH held AS (
    SELECT * FROM unnest(%(ids)s::uuid[], %(attempts)s::integer[]) AS held(id, attempt)
), renewed AS (
    UPDATE agent_run AS run
       SET lease_until = now() + make_interval(secs => %(lease)s),
           updated_at = now()
      FROM held
     WHERE run.id = held.id
       AND run.attempt = held.attempt
       AND run.lease_owner = %(owner)s
       AND run.status = 'running'
 RETURNING run.id
)
SELECT run.id, run.status
  FROM agent_run AS run
 WHERE run.id = ANY(%(ids)s::uuid[])
   AND run.id NOT IN (SELECT id FROM renewed)
   FOR SHARE OF run"""

# The worker's row (agent_worker) beaten in the same statement: its heartbeat, and its count
# of runs held, or the row again if housekeeping removed it meanwhile (a long outage). Only its
# own process's row (``instance``): a second process started with the same id never beats it.
# A data-modifying CTE runs whether or not the rest reads it.
WORKER_BEAT = """
present AS (
    INSERT INTO agent_worker AS worker
           (id, instance, host, pid, started_at, beat_at, alive_until, concurrency,
            runs_held, draining, versions)
    VALUES (%(owner)s, %(instance)s, %(host)s, %(pid)s, now(), now(),
            now() + make_interval(secs => %(alive)s), %(concurrency)s, %(runs_held)s,
            %(draining)s, %(versions)s::jsonb)
    ON CONFLICT (id) DO UPDATE
       SET beat_at = now(),
           alive_until = EXCLUDED.alive_until,
           runs_held = EXCLUDED.runs_held,
           draining = EXCLUDED.draining
     WHERE worker.instance = EXCLUDED.instance
)"""

# RENEW_ALL_SQL with the worker's row: still one statement per beat.
RENEW_ALL_AND_BEAT_SQL = RENEW_ALL_SQL.replace(
    "\nWITH held AS (", "\nWITH" + WORKER_BEAT + ", held AS (", 1
)
# The beat of a worker that holds no run.
BEAT_SQL = "WITH" + WORKER_BEAT + "\nSELECT 1"

# Seconds until the first wake_at of a waiting run, by the clock the claim compares it with
# (the database's): the first entry of agent_run_wake, one index probe.
NEXT_WAKE_SQL = """
SELECT EXTRACT(EPOCH FROM wake_at - now())::float8
  FROM agent_run
 WHERE status = 'waiting' AND wake_at IS NOT NULL
 ORDER BY wake_at
 LIMIT 1"""

# Claims in a row of one ``claim_runs`` while concurrency keys were lost to other claims.
CLAIM_TRIES = 4


def claim_runs(
    owner: str, lease_seconds: float, limit: int
) -> tuple[list[Claim], list[RunId | None]]:
    """CLAIM_SQL, again while a concurrency key's last slot went to another claim in the
    middle of it (it then took fewer runs than it had candidates) and room is left. Returns
    the claims, in the claim's order, and the parents of the runs dead-lettered as poison:
    the caller tells them (``child_ended``)."""
    claims: list[Claim] = []
    poisoned: list[RunId | None] = []
    for _ in range(CLAIM_TRIES):
        taken, lost = _claim_once(owner, lease_seconds, limit - len(claims), poisoned)
        claims += taken
        if not lost or len(claims) >= limit:
            break
    claims.sort(key=lambda claim: (-claim.run.priority, claim.run.fair_at, claim.run.created_at))
    return claims, poisoned


def _claim_once(
    owner: str, lease_seconds: float, limit: int, poisoned: list[RunId | None]
) -> tuple[list[Claim], bool]:
    """One CLAIM_SQL: the claims, and whether it locked candidates it did not take (a run
    dead-lettered as poison is one it did not take; its parent is added to ``poisoned``)."""
    params = {**key_limits(), "owner": owner, "lease": float(lease_seconds), "limit": limit}
    with binding_cursor() as cursor:
        cursor.execute(CLAIM_SQL, params)
        rows = cursor.fetchall()
        names = cursor.column_names()
    claims = []
    for row in rows:
        taken: dict[str | None, Any] = dict(zip(names[1:], row[1:], strict=True))
        if taken["id"] is None:
            continue
        claim, parent_id = read_claim(taken, owner, lease_seconds)
        if claim is not None:
            claims.append(claim)
        elif parent_id is not None:
            poisoned.append(parent_id)
    candidates = rows[0][0] if rows else 0
    return claims, candidates > len(claims)


def renew_leases(
    owner: str,
    claims: Sequence[Claim],
    lease_seconds: float,
    using: BaseDatabaseWrapper | None = None,
    presence: Presence | None = None,
) -> dict[RunId, LeaseLoss]:
    """RENEW_ALL_SQL (with ``presence``: RENEW_ALL_AND_BEAT_SQL, or BEAT_SQL when it holds
    no run), on ``using`` (the heartbeat's own connection) if given."""
    if not claims and presence is None:
        return {}
    params: dict[str, Any] = {
        "ids": [c.run_id for c in claims],
        "attempts": [c.attempt for c in claims],
        "owner": owner,
        "lease": float(lease_seconds),
    }
    if presence is None:
        sql = RENEW_ALL_SQL
    else:
        params.update(presence_params(presence))
        sql = RENEW_ALL_AND_BEAT_SQL if claims else BEAT_SQL
    with (using or connection).cursor() as cursor:
        cursor.execute(sql, params)
        missed = cursor.fetchall() if claims else []
    return lease_losses(missed)


def presence_params(presence: Presence) -> dict[str, Any]:
    """WORKER_BEAT's parameters (``owner`` is the worker id)."""
    return {
        "owner": presence.worker_id,
        "instance": presence.instance,
        "host": presence.host,
        "pid": presence.pid,
        "alive": float(presence.alive_seconds),
        "concurrency": presence.concurrency,
        "runs_held": presence.runs_held,
        "draining": presence.draining,
        "versions": json.dumps(list(presence.versions)),
    }


def key_limits() -> dict[str, Any]:
    """The parameters every claim statement takes: the keys' limits (CONCURRENCY_LIMITS, and
    the limits staff set in the admin, which win), two parallel arrays; the days whose
    partitions a claim reads a fresh run's task from (yesterday to tomorrow, UTC); and the
    agent versions this process serves (``ROUTED``)."""
    limits = {**concurrency.overrides(), **key_rows.limit_overrides()}
    today = part_of_day(datetime.datetime.now(datetime.UTC).date())
    routing = registry.routing()
    return {
        "limit_keys": list(limits),
        "limit_values": list(limits.values()),
        "recent_from": today - 1,
        "recent_to": today + 1,
        "serves": list(routing.serves),
        "refuses": list(routing.refuses),
    }


def read_claim(
    columns: dict[str | None, Any], owner: str, lease_seconds: float
) -> tuple[Claim | None, RunId | None]:
    """The claim of a row just claimed (by CLAIM_SQL or FINISH_AND_CLAIM_SQL), and None; or,
    when the row cannot be decoded, no claim and the parent of its run, which is
    dead-lettered as poison (fenced on this claim) rather than failing the claim, which would
    fail every claim of every worker that takes it: the caller tells the parent
    (``child_ended``) once the run is dead. (A value that does not decrypt is the claim's
    ``unreadable`` reason instead: the runner dead-letters it.)"""
    try:
        return _claim_from(columns, owner, lease_seconds), None
    except StoredValueError as exc:
        dead, parent_id = portable_trees.dead_letter_poison(
            columns["id"], owner, columns["attempt"], exc
        )
    return None, parent_id if dead else None


def _claim_from(columns: dict[str | None, Any], owner: str, lease_seconds: float) -> Claim:
    """The claim of a row of ``agent_run``'s columns as the driver returned them (and the
    ``task_payload`` and ``messages_waiting``), each column through its field's own
    conversion as the ORM would (JSON text columns such as woken_by are parsed, encrypted ones
    decrypted). A value that does not decrypt does not fail the claim, which may take other
    runs: the claim says why (``unreadable``) and the runner dead-letters the run."""
    fields = AgentRun._meta.concrete_fields
    with encryption.lenient() as problems:
        values = [
            f.from_db_value(columns[f.column], None, connection)
            if hasattr(f, "from_db_value")
            else columns[f.column]
            for f in fields
        ]
        task_payload = columns["task_payload"]
        if task_payload is not None:
            task_payload = encryption.unseal_field(task_payload, STEP_PAYLOAD)
    run = AgentRun.from_db(connection.alias, [f.attname for f in fields], values)
    unreadable = problems[0] if problems else None
    return Claim(
        run,
        owner,
        run.attempt,
        lease_seconds,
        task_payload,
        unreadable,
        messages_waiting=columns.get("messages_waiting"),
    )
