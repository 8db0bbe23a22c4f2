"""``PostgresStore``: the hot paths of the store as single statements, on the database clock.

The life of a run, and what moves it along on PostgreSQL:

    claim        CLAIM_SQL              lock the claimable runs, admit them within their
                                        concurrency keys' limits, lease them, attempt + 1
    renew        RENEW_ALL_SQL          the heartbeat: every lease of a worker, one statement
    append_step  APPEND_STEP_SQL        fence, renewed lease and the step, one statement
                                        (its tool effects too: APPEND_STEP_WITH_EFFECTS_SQL;
                                        a model turn counted in the rollup: APPEND_TURN_SQL)
    finish       APPEND_LAST_STEP_SQL   the last step ends the run (and _WITH_EFFECTS_SQL,
                                        APPEND_LAST_TURN_SQL);
                 FINISH_AND_CLAIM_SQL   the same, and the claim of the worker's next run
                                        (FINISH_TURN_AND_CLAIM_SQL for a model turn)
    unstored     UNSTORED_TURN_SQL      a paid turn whose commit failed still counts
    debounce     DEBOUNCE_SQL           a later start of a debounced run: its quiet window
                                        starts again, with the call's task (the first
                                        start, or a late one: PortableStore)
    release      PortableStore          the claim given back, the run pending again
    park         PortableStore          the run waits: on an approval, a timer, an event, an
                                        answer or its children; START_INTENT_SQL starts an
                                        approved tool call under the fence
    wake         CLAIM_SQL (due)        a due timer or timeout, or the end of a debounced
                                        start's quiet window: the claim takes the run;
                 PortableStore          an event, an answer, a child's end: pending again

The statements are composed from the named fragments below: ``FENCE`` (what every write of a
claim carries), ``CLAIMABLE_RUNS`` (the runs a claim may take), ``ADMITTED`` (those of them
their concurrency keys leave room for, race-free: store/concurrency.py),
``TAKE_CLAIMABLE_RUNS`` (the lease a claim sets), ``FENCED_STEP`` and ``FENCED_LAST_STEP``
(what a step does to its run), ``RECORD_EFFECTS``, ``RECORD_USAGE`` (the daily rollup of
model turns) and ``STEP_INSERT``. The full text of every statement, exactly as it is sent,
is in tests/sql/<NAME>.sql, one file per statement; tests/unit/test_postgres_statements.py
fails when what runs differs from those files by a byte (``UPDATE_SQL_SNAPSHOTS=1`` rewrites
them after a deliberate change). The only formatting at run time is the VALUES list of the
effects (``{rows}``: one placeholder tuple per effect).

The other operations (release, park, wake, decisions, a finish without a step) are the ORM
updates of ``PortableStore``, which this class inherits: one UPDATE each on PostgreSQL too.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import textwrap
from collections.abc import Iterator, Mapping, Sequence
from decimal import Decimal
from typing import Any

from django.db import DataError, connection
from django.db.backends.base.base import BaseDatabaseWrapper

from durable_agents._internal import encryption
from durable_agents._internal.text import storable_text
from durable_agents.exceptions import StoredValueError
from durable_agents.flow.pricing import Usage
from durable_agents.models import (
    STEP_PAYLOAD,
    AgentEvent,
    AgentQuestion,
    AgentRun,
    AgentSchedule,
    IntentStatus,
    ToolEffect,
    ToolIntent,
    WaitKind,
)
from durable_agents.store import (
    concurrency,
    key_rows,
    portable_batch,
    portable_logs,
    portable_runs,
    portable_trees,
    postgres_debounce,
    postgres_schedules,
)
from durable_agents.store.base import (
    AuthUser,
    Claim,
    ForkWrite,
    LeaseLoss,
    LogRow,
    NextClaim,
    Parked,
    RunId,
    StepTuple,
    StepWrite,
    Store,
    WaitSpec,
    lease_losses,
)
from durable_agents.store.portable import PortableStore
from durable_agents.store.postgres_debounce import (
    DEBOUNCE_SQL as DEBOUNCE_SQL,  # one of this store's statements, pinned in tests/sql/ too
)
from durable_agents.store.postgres_schedules import (  # pinned in tests/sql/ too
    FIRE_SQL as FIRE_SQL,
)
from durable_agents.store.postgres_schedules import (
    MOVE_ON_SQL as MOVE_ON_SQL,
)
from durable_agents.store.postgres_schedules import (
    TAKE_DUE_SQL as TAKE_DUE_SQL,
)
from durable_agents.store.rows import DueSchedules, SlotStart, usage_shard

# -- Fragments -------------------------------------------------------------------------------

# The fence: the run is still this claim's (owner and attempt) and still running. Every write a
# worker makes for a claim carries it, so a worker whose lease expired and was taken over (the
# claim that took it incremented attempt), or whose run was cancelled, changes nothing: its
# UPDATE finds no row, and the rest of the statement, which reads that row, does nothing.
FENCE = """\
     WHERE id = %(run_id)s
       AND lease_owner = %(owner)s
       AND attempt = %(attempt)s
       AND status = 'running'"""

# A step commits only as the next one in the log (seq = last_seq + 1): no gap, and a step
# committed twice (a retried commit whose first try landed) is refused the second time; the
# store then finds it in the log as the claim's own (``committed_by``) and reports it committed.
STEP_FENCE = f"""\
{FENCE}
       AND last_seq = %(seq)s - 1"""

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
        and_also=and_also, key_limit=KEY_LIMIT, held=held, has_room=has_room
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
          (SELECT payload FROM agent_step
            WHERE run_id = run.id AND seq = 0 AND kind = 'task' AND run.last_seq = 0
          ) AS task_payload"""

# What a turn adds to its run's cost: NULL ("no price") stays NULL until a turn has a price.
# coalesce(total + cost, cost, total): both known, the sum; no total yet, the cost; no cost
# (an unpriced turn, or not a model turn), the total as it was.
ADD_COST = "coalesce(cost_usd + %(cost)s::numeric, %(cost)s::numeric, cost_usd)"

# A step that keeps the run going, on the run's row: the step's seq, tokens and cost, the
# claim counted as progress (stalled_claims = 0) and the lease renewed. ``fence`` holds the
# run's id (with the agent, model and concurrency key the rollup is keyed by) only if the
# step fence held.
FENCED_STEP = f"""\
WITH fence AS (
    UPDATE agent_run
       SET last_seq = %(seq)s,
           stalled_claims = 0,
           tokens_used = tokens_used + %(tokens)s,
           cost_usd = {ADD_COST},
           lease_until = now() + make_interval(secs => %(lease)s),
           updated_at = now()
{STEP_FENCE}
 RETURNING id, agent, model, concurrency_key
)"""

# The last step of a run, on the run's row: the run ends instead of renewing its lease, with
# the columns ``finish_run`` sets (error '', no lease, finished_at).
FENCED_LAST_STEP = f"""\
WITH fence AS (
    UPDATE agent_run
       SET last_seq = %(seq)s,
           stalled_claims = 0,
           tokens_used = tokens_used + %(tokens)s,
           cost_usd = {ADD_COST},
           status = %(status)s,
           result = %(result)s,
           error = '',
           lease_owner = NULL,
           lease_until = NULL,
           finished_at = now(),
           updated_at = now()
{STEP_FENCE}
 RETURNING id, agent, model, concurrency_key
)"""

# The tool effects of a step, recorded whatever the fence says (the CTE does not read it): they
# describe calls that happened. ``{rows}`` is the VALUES list, one placeholder tuple per effect
# (``_effect_rows``); a key already recorded is kept as it is.
RECORD_EFFECTS = """\
recorded AS (
    INSERT INTO tool_effect (key, run_id, seq, call_index, tool, result, is_error)
    VALUES {rows}
    ON CONFLICT (key) DO NOTHING
)"""

# A model turn counted in the day's rollup (UTC, on the database clock), one row per (day,
# concurrency key, agent, model, shard) of the runs in ``{source}`` (none: nothing counted).
# The shard (``usage_shard``: fixed per run) spreads one agent's turns over USAGE_SHARDS rows,
# so that concurrent commits of different runs rarely wait for the same row lock; readers
# sum the shards. A run without a concurrency key (NULL) is counted under ''.
_RECORD_USAGE = """\
INSERT INTO agent_usage_day AS used (day, concurrency_key, agent, model, shard, turns,
                                     input_tokens, output_tokens, cache_read_tokens,
                                     cache_write_tokens, cost_usd)
SELECT (now() AT TIME ZONE 'UTC')::date, coalesce(concurrency_key, ''), agent, model,
       %(shard)s, 1,
       %(input_tokens)s, %(output_tokens)s, %(cache_read_tokens)s, %(cache_write_tokens)s,
       %(cost)s::numeric
  FROM {source}
    ON CONFLICT (day, concurrency_key, agent, model, shard) DO UPDATE
   SET turns = used.turns + 1,
       input_tokens = used.input_tokens + EXCLUDED.input_tokens,
       output_tokens = used.output_tokens + EXCLUDED.output_tokens,
       cache_read_tokens = used.cache_read_tokens + EXCLUDED.cache_read_tokens,
       cache_write_tokens = used.cache_write_tokens + EXCLUDED.cache_write_tokens,
       cost_usd = coalesce(used.cost_usd + EXCLUDED.cost_usd, EXCLUDED.cost_usd, used.cost_usd)"""

# The rollup of a committed turn: counted only if the fence held (it selects from ``fence``),
# in the step's own statement, so a turn is counted exactly once with its commit.
RECORD_USAGE = f"""\
usage AS (
{textwrap.indent(_RECORD_USAGE.format(source="fence"), "    ")}
)"""

# The step itself, one row if the fence held (it selects from ``fence``), none otherwise.
STEP_INSERT = """\
INSERT INTO agent_step (run_id, seq, kind, payload, content_start, content_end, request_id,
                        attempt, worker)
SELECT id, %(seq)s, %(kind)s, %(payload)s, %(content_start)s, %(content_end)s, %(request_id)s,
       %(attempt)s, %(owner)s
  FROM fence"""

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

# A step that keeps the run going: fence, renewed lease and the step, in one statement.
APPEND_STEP_SQL = f"{FENCED_STEP}\n{STEP_INSERT}"

# The last step of a run: the same fence, and the run ends instead of renewing its lease.
APPEND_LAST_STEP_SQL = f"{FENCED_LAST_STEP}\n{STEP_INSERT}"

# The same two for a model turn, which is also counted in the day's rollup.
APPEND_TURN_SQL = f"{FENCED_STEP},\n{RECORD_USAGE}\n{STEP_INSERT}"
APPEND_LAST_TURN_SQL = f"{FENCED_LAST_STEP},\n{RECORD_USAGE}\n{STEP_INSERT}"

# The same two with the tool effects of the step (``{rows}`` filled in by ``_append``).
APPEND_STEP_WITH_EFFECTS_SQL = f"{FENCED_STEP},\n{RECORD_EFFECTS}\n{STEP_INSERT}"
APPEND_LAST_STEP_WITH_EFFECTS_SQL = f"{FENCED_LAST_STEP},\n{RECORD_EFFECTS}\n{STEP_INSERT}"

# The last step of a run and the claim of the worker's next run, in one statement: a busy
# worker saves a round trip and a flushed commit per run. The claim happens only if the fence
# held (CLAIMABLE_RUNS_IF_FENCED); the finished run is not claimable in the statement's
# snapshot (its lease is still held there). One row: whether the step was appended, then the
# next run's columns, or NULLs when there was none.
FINISH_AND_CLAIM_SQL = f"""\
{FENCED_LAST_STEP}, appended AS (
{STEP_INSERT}
 RETURNING run_id
), {CLAIMABLE_RUNS_IF_FENCED},
{ADMITTED}, taken AS (
{TAKE_CLAIMABLE_RUNS}
)
SELECT (SELECT count(*) FROM appended) AS appended, taken.*
  FROM (SELECT 1) AS one LEFT JOIN taken ON true"""

# The same for a run's last model turn, counted in the day's rollup too: what a busy worker
# sends at the end of every run.
FINISH_TURN_AND_CLAIM_SQL = f"""\
{FENCED_LAST_STEP}, {RECORD_USAGE}, appended AS (
{STEP_INSERT}
 RETURNING run_id
), {CLAIMABLE_RUNS_IF_FENCED},
{ADMITTED}, taken AS (
{TAKE_CLAIMABLE_RUNS}
)
SELECT (SELECT count(*) FROM appended) AS appended, taken.*
  FROM (SELECT 1) AS one LEFT JOIN taken ON true"""

# A model turn that was paid for but not committed (its fence failed: the run was taken over
# or cancelled meanwhile; or the step was refused): its tokens and cost still count, on the
# run and in the rollup. Unfenced, and counters only: no status, lease, seq or log changes.
UNSTORED_TURN_SQL = f"""
WITH run AS (
    UPDATE agent_run
       SET tokens_used = tokens_used + %(tokens)s,
           cost_usd = {ADD_COST}
     WHERE id = %(run_id)s
 RETURNING id, agent, model, concurrency_key
)
{_RECORD_USAGE.format(source="run")}"""

# approved -> executing and a renewed lease, only while the run is still this claim's and
# running: a cancel that committed first makes the fence fail and the call never starts. The
# run row stays locked until the intent row is updated.
START_INTENT_SQL = f"""
WITH fence AS (
    UPDATE agent_run
       SET lease_until = now() + make_interval(secs => %(lease)s),
           updated_at = now()
{FENCE}
 RETURNING id
)
UPDATE tool_intent
   SET status = 'executing', updated_at = now()
 WHERE id = %(intent_id)s
   AND status = 'approved'
   AND EXISTS (SELECT 1 FROM fence)
RETURNING id"""

# How a tool result is written (JSON text, encrypted under ENCRYPTION_KEYS), as the ORM
# writes it.
RESULT_FIELD = ToolEffect._meta.get_field("result")


def _effect_rows(effects: Sequence[ToolEffect], params: dict[str, Any]) -> str:
    """The VALUES list for ``{rows}``: one placeholder tuple per effect, its values added to
    ``params``."""
    rows = []
    for i, effect in enumerate(effects):
        rows.append(f"(%(k{i})s, %(run_id)s, %(s{i})s, %(c{i})s, %(t{i})s, %(r{i})s, %(e{i})s)")
        params.update(
            {
                f"k{i}": effect.key,
                f"s{i}": effect.seq,
                f"c{i}": effect.call_index,
                f"t{i}": effect.tool,
                f"r{i}": RESULT_FIELD.get_prep_value(effect.result),
                f"e{i}": effect.is_error,
            }
        )
    return ", ".join(rows)


def _usage_params(claim: Claim, usage: Usage) -> dict[str, Any]:
    """The parameters of the rollup's upsert (``RECORD_USAGE``) for one model turn."""
    return {
        "shard": usage_shard(claim.run_id),
        "input_tokens": usage.input_tokens,
        "output_tokens": usage.output_tokens,
        "cache_read_tokens": usage.cache_read_tokens,
        "cache_write_tokens": usage.cache_write_tokens,
    }


# Claims in a row of one ``claim_runs`` while concurrency keys were lost to other claims.
CLAIM_TRIES = 4


def key_limits() -> dict[str, Any]:
    """The parameters of the keys' limits in the claim (CONCURRENCY_LIMITS, and the limits
    staff set in the admin, which win): two parallel arrays."""
    limits = {**concurrency.overrides(), **key_rows.limit_overrides()}
    return {"limit_keys": list(limits), "limit_values": list(limits.values())}


def _claim_from(columns: dict[str | None, Any], owner: str, lease_seconds: float) -> Claim:
    """The claim of a row of ``agent_run``'s columns as the driver returned them (and the
    ``task_payload``), each column through its field's own conversion as the ORM would (JSON
    text columns such as woken_by are parsed, encrypted ones decrypted). A value that does not
    decrypt does not fail the claim, which may take other runs: the claim says why
    (``unreadable``) and the runner dead-letters the run."""
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
    return Claim(run, owner, run.attempt, lease_seconds, task_payload, unreadable)


@contextlib.contextmanager
def binding_cursor() -> Iterator[Any]:
    """The cursor of the step commit: a server-side-binding psycopg cursor (Django's own binds
    on the client), so that psycopg can prepare the statement once the database OPTIONS set a
    ``prepare_threshold`` (that saves the parse and plan of every step; Django leaves it off by
    default for poolers that cannot keep prepared statements), wrapped as Django wraps its
    own cursors: ``connection.execute_wrapper`` hooks (Sentry, OpenTelemetry's Django
    instrumentation), ``connection.queries`` under DEBUG and Django's error classes all see
    the commit. The wrapper costs about a microsecond (docs/howto/database.md)."""
    import psycopg  # only on PostgreSQL: SQLite installs need not have it

    connection.ensure_connection()
    # The stubs type these as taking Django's own wrapper; at run time they take the driver's
    # cursor, which is what Django passes them itself (BaseDatabaseWrapper._prepare_cursor).
    raw: Any = psycopg.Cursor(connection.connection)
    wrapped = (
        connection.make_debug_cursor(raw)
        if connection.queries_logged
        else connection.make_cursor(raw)
    )
    with wrapped as cursor:
        yield cursor


class PostgresStore(Store):
    """PostgreSQL outside a caller's transaction: one statement (one round trip) per claim,
    per step commit, per finish-and-claim, per heartbeat and per debounced start's push.

    What it does not write in SQL of its own it delegates, never inherits: to the concern
    modules (``portable_runs``, ``portable_logs``, ``portable_batch``, ``portable_trees``,
    ``postgres_debounce``, ``postgres_schedules``, ``key_rows``) and, for release, park,
    wake, decisions, waits and the operations on any run, to ``orm`` (a ``PortableStore``:
    the same ORM updates, one UPDATE each on PostgreSQL too)."""

    sends_live_text = True

    @functools.cached_property
    def orm(self) -> PortableStore:
        """The ORM's store, which does the operations this one has no statement of its own
        for (each is one transaction, as on SQLite)."""
        return PortableStore()

    def claim_runs(self, owner: str, lease_seconds: float, limit: int = 1) -> list[Claim]:
        """CLAIM_SQL, again while a concurrency key's last slot went to another claim in the
        middle of it (it then took fewer runs than it had candidates) and room is left."""
        claims: list[Claim] = []
        for _ in range(CLAIM_TRIES):
            taken, lost = self._claim_once(owner, lease_seconds, limit - len(claims))
            claims += taken
            if not lost or len(claims) >= limit:
                break
        claims.sort(
            key=lambda claim: (-claim.run.priority, claim.run.fair_at, claim.run.created_at)
        )
        return claims

    def _claim_once(self, owner: str, lease_seconds: float, limit: int) -> tuple[list[Claim], bool]:
        """One CLAIM_SQL: the claims, and whether it locked candidates it did not take."""
        params = {**key_limits(), "owner": owner, "lease": float(lease_seconds), "limit": limit}
        with binding_cursor() as cursor:
            cursor.execute(CLAIM_SQL, params)
            rows = cursor.fetchall()
            names = [column.name for column in cursor.description or ()]
        claims = []
        for row in rows:
            taken = dict(zip(names[1:], row[1:], strict=True))
            if taken["id"] is None:
                continue
            claim = self._readable(taken, owner, lease_seconds)
            if claim is not None:
                claims.append(claim)
        candidates = rows[0][0] if rows else 0
        return claims, candidates > len(claims)

    def renew_leases(
        self,
        owner: str,
        claims: Sequence[Claim],
        lease_seconds: float,
        using: BaseDatabaseWrapper | None = None,
    ) -> dict[RunId, LeaseLoss]:
        """One statement, on ``using`` (the heartbeat's own connection) if given."""
        if not claims:
            return {}
        params: dict[str, Any] = {
            "ids": [c.run_id for c in claims],
            "attempts": [c.attempt for c in claims],
            "owner": owner,
            "lease": float(lease_seconds),
        }
        with (using or connection).cursor() as cursor:
            cursor.execute(RENEW_ALL_SQL, params)
            missed = cursor.fetchall()
        return lease_losses(missed)

    def append_step(
        self, claim: Claim, step: StepWrite, then_claim: NextClaim | None = None
    ) -> bool:
        """This is where a step gets committed on PostgreSQL: one statement that checks the
        fence, renews the lease (or ends the run), inserts the step and records its effects."""
        params: dict[str, Any] = {
            "run_id": claim.run_id,
            "owner": claim.owner,
            "attempt": claim.attempt,
            "lease": float(claim.lease_seconds),
            "seq": step.seq,
            "kind": step.kind,
            "payload": encryption.seal(step.payload, STEP_PAYLOAD),
            "content_start": step.content_span[0] if step.content_span else None,
            "content_end": step.content_span[1] if step.content_span else None,
            "request_id": step.request_id,
            "tokens": step.tokens,
            "cost": step.cost,
        }
        if step.usage is not None:
            params.update(_usage_params(claim, step.usage))
        finish = step.finish
        if finish is not None:
            params["status"] = finish[0]
            params["result"] = None if finish[1] is None else storable_text(finish[1])
        try:
            appended = self._append(params, step.effects, finish, then_claim)
        except DataError:
            if step.usage is not None:
                self.count_unstored_turn(claim, step)
            raise
        if not appended and self.committed_by(claim, step.seq):
            # A retry whose first try landed (outage.py): this claim's own step, committed.
            appended = True
        elif not appended and step.usage is not None:
            self.count_unstored_turn(claim, step)
        if appended and finish is not None:
            self.child_ended(claim.run.parent_id)
        return appended

    def count_unstored_turn(self, claim: Claim, step: StepWrite) -> None:
        if step.usage is None:
            return
        params: dict[str, Any] = {
            "run_id": claim.run_id,
            "tokens": step.tokens,
            "cost": step.cost,
            **_usage_params(claim, step.usage),
        }
        with connection.cursor() as cursor:
            cursor.execute(UNSTORED_TURN_SQL, params)

    def _append(
        self,
        params: dict[str, Any],
        effects: Sequence[ToolEffect],
        finish: tuple[str, str | None] | None,
        then_claim: NextClaim | None,
    ) -> bool:
        turn = "shard" in params  # a model turn: counted in the rollup too
        if finish is not None and then_claim is not None and not effects:
            return self._finish_and_claim(params, then_claim)
        if effects:
            if finish is None:
                template = APPEND_STEP_WITH_EFFECTS_SQL
            else:
                template = APPEND_LAST_STEP_WITH_EFFECTS_SQL
            sql = template.format(rows=_effect_rows(effects, params))
        elif turn:
            sql = APPEND_TURN_SQL if finish is None else APPEND_LAST_TURN_SQL
        else:
            sql = APPEND_STEP_SQL if finish is None else APPEND_LAST_STEP_SQL
        return self._execute_append(sql, params)

    @staticmethod
    def _execute_append(sql: str, params: dict[str, Any]) -> bool:
        with binding_cursor() as cursor:
            cursor.execute(sql, params)
            return bool(cursor.rowcount == 1)

    def _finish_and_claim(self, params: dict[str, Any], then_claim: NextClaim) -> bool:
        """``append_step`` of a run's last step that also claims the next run, if the slot
        may (``then_claim.take()``); a model turn (its rollup parameters) is counted too."""
        turn = "shard" in params
        if not then_claim.take():
            return self._execute_append(
                APPEND_LAST_TURN_SQL if turn else APPEND_LAST_STEP_SQL, params
            )
        params = {**params, **key_limits(), "lease": float(then_claim.lease_seconds), "limit": 1}
        with binding_cursor() as cursor:
            try:
                cursor.execute(FINISH_TURN_AND_CLAIM_SQL if turn else FINISH_AND_CLAIM_SQL, params)
                row = cursor.fetchone()
            except BaseException:
                then_claim.give_back()
                raise
            names = [column.name for column in cursor.description or ()]
        assert row is not None
        appended, taken = bool(row[0]), dict(zip(names[1:], row[1:], strict=True))
        if taken["id"] is None:
            then_claim.give_back()
            return appended
        claim = self._readable(taken, then_claim.owner, then_claim.lease_seconds)
        if claim is None:
            then_claim.give_back()
            return appended
        then_claim.claim = claim
        return appended

    def _readable(
        self, columns: dict[str | None, Any], owner: str, lease_seconds: float
    ) -> Claim | None:
        """The claim of a row just claimed; None when its row cannot be decoded: it is
        dead-lettered as poison (fenced on this claim) rather than failing the claim, which
        would fail every claim of every worker that takes it. (A value that does not decrypt
        is the claim's ``unreadable`` reason instead: the runner dead-letters it.)"""
        try:
            return _claim_from(columns, owner, lease_seconds)
        except StoredValueError as exc:
            dead, parent_id = portable_trees.dead_letter_poison(
                columns["id"], owner, columns["attempt"], exc
            )
        if dead:
            self.child_ended(parent_id)
        return None

    def start_intent_execution(self, claim: Claim, intent: ToolIntent) -> bool:
        """One statement; the run row stays locked until the intent row is updated."""
        params: dict[str, Any] = {
            "run_id": claim.run_id,
            "owner": claim.owner,
            "attempt": claim.attempt,
            "lease": float(claim.lease_seconds),
            "intent_id": intent.pk,
        }
        with connection.cursor() as cursor:
            cursor.execute(START_INTENT_SQL, params)
            started = bool(cursor.rowcount == 1)
        if started:
            intent.status = IntentStatus.EXECUTING
        return started

    # -- what this store has no statement of its own for: the concern modules and the ORM's

    def create_runs(self, runs: Sequence[tuple[AgentRun, str]]) -> list[AgentRun]:
        return portable_batch.create_runs(runs)

    def take_due_schedules(self, now: datetime.datetime | None, limit: int) -> DueSchedules:
        return postgres_schedules.take_due_schedules(now, limit)

    def fire_slots(
        self,
        starts: Sequence[SlotStart],
        rows: Sequence[AgentSchedule],
        last_keys: Mapping[int, str],
    ) -> dict[str, RunId]:
        return postgres_schedules.fire_slots(starts, rows, last_keys)

    def move_schedules(self, rows: Sequence[AgentSchedule]) -> None:
        postgres_schedules.move_schedules(rows)

    def create_run(self, run: AgentRun, task_payload: str) -> AgentRun:
        return portable_runs.create_run(run, task_payload)

    def create_fork(self, run: AgentRun, write: ForkWrite) -> AgentRun:
        return portable_logs.create_fork(run, write)

    def debounce_run(self, run: AgentRun, task_payload: str, seconds: float) -> AgentRun:
        return postgres_debounce.debounce_run(run, task_payload, seconds)

    def claim_run(self, run_id: RunId, owner: str, lease_seconds: float) -> Claim | None:
        return self.orm.claim_run(run_id, owner, lease_seconds)

    def renew_lease(self, claim: Claim) -> bool:
        return self.orm.renew_lease(claim)

    def finish_run(
        self, claim: Claim, status: str, *, result: str | None = None, error: str = ""
    ) -> bool:
        return self.orm.finish_run(claim, status, result=result, error=error)

    def release_lease(
        self,
        claim: Claim,
        *,
        error: str | None = None,
        count_claim: bool = True,
        hold_seconds: float | None = None,
        waiting_for: WaitKind | None = None,
    ) -> bool:
        return self.orm.release_lease(
            claim,
            error=error,
            count_claim=count_claim,
            hold_seconds=hold_seconds,
            waiting_for=waiting_for,
        )

    def park_on_intent(
        self,
        claim: Claim,
        intent: ToolIntent,
        *,
        new: bool = False,
        unknown_because: str | None = None,
    ) -> Parked:
        return self.orm.park_on_intent(claim, intent, new=new, unknown_because=unknown_because)

    def complete_intent(self, intent: ToolIntent, effect: ToolEffect) -> None:
        self.orm.complete_intent(intent, effect)

    def wake_run(self, run_id: RunId) -> bool:
        return self.orm.wake_run(run_id)

    def decide_intent(
        self, intent_id: int, user: AuthUser, from_status: str, to_status: str, reason: str
    ) -> ToolIntent:
        return self.orm.decide_intent(intent_id, user, from_status, to_status, reason)

    def resolve_intent(
        self, intent_id: int, user: AuthUser, *, outcome: tuple[str, bool] | None, reason: str
    ) -> ToolIntent:
        return self.orm.resolve_intent(intent_id, user, outcome=outcome, reason=reason)

    def park_on_wait(self, claim: Claim, spec: WaitSpec) -> tuple[Parked, dict[str, Any] | None]:
        return self.orm.park_on_wait(claim, spec)

    def send_event(self, name: str, payload: Any, user: AuthUser = None) -> tuple[AgentEvent, int]:
        return self.orm.send_event(name, payload, user)

    def answer_question(
        self, run_id: RunId | str, user: AuthUser, text: str, question_id: int | None = None
    ) -> AgentQuestion | None:
        return self.orm.answer_question(run_id, user, text, question_id)

    def spawn_run(
        self,
        child: AgentRun,
        task_payload: str,
        max_children: int,
        max_tree_runs: int | None = None,
    ) -> tuple[AgentRun, bool]:
        return self.orm.spawn_run(child, task_payload, max_children, max_tree_runs)

    def wake_parent(self, parent_id: RunId) -> bool:
        return self.orm.wake_parent(parent_id)

    def stranded_parents(self, limit: int) -> list[RunId]:
        return self.orm.stranded_parents(limit)

    def sent_event(self, name: str) -> AgentEvent | None:
        return self.orm.sent_event(name)

    def question_for_key(self, key: str) -> AgentQuestion | None:
        return self.orm.question_for_key(key)

    def run_outcomes(self, run_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
        return self.orm.run_outcomes(run_ids)

    def cancel_run(self, run_id: RunId | str) -> bool:
        return self.orm.cancel_run(run_id)

    def requeue_run(self, run_id: RunId | str) -> bool:
        return self.orm.requeue_run(run_id)

    def dead_letter(self, run_id: RunId, reason: str) -> bool:
        return self.orm.dead_letter(run_id, reason)

    def current_status(self, run_id: RunId) -> str | None:
        return self.orm.current_status(run_id)

    def spent_today(self, key: str) -> tuple[Decimal, Decimal | None]:
        return key_rows.spent_today(key)

    def set_key_limit(self, key: str, limit: int | None) -> None:
        key_rows.set_limit(key, limit)

    def set_key_budget(self, key: str, usd_per_day: Decimal | None) -> int:
        return key_rows.set_budget(key, usd_per_day)

    def first_claimable(self) -> tuple[str, int] | None:
        return self.orm.first_claimable()

    def load_log_rows(self, run_id: RunId | str) -> list[LogRow]:
        return portable_logs.load_log_rows(run_id)

    def load_steps(self, run_id: RunId, after_seq: int = -1) -> list[StepTuple]:
        return portable_logs.load_steps(run_id, after_seq)

    def recorded_effects(self, run_id: RunId, seq: int) -> dict[str, ToolEffect]:
        return self.orm.recorded_effects(run_id, seq)

    def record_effect(self, effect: ToolEffect) -> None:
        self.orm.record_effect(effect)

    def intent_for_key(self, key: str) -> ToolIntent | None:
        return self.orm.intent_for_key(key)

    def reload_intent(self, intent: ToolIntent) -> None:
        self.orm.reload_intent(intent)
