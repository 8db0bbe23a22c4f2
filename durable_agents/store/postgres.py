"""``PostgresStore``: the hot paths of the store as single statements, on the database clock.

Each statement is written out in full below, as a named constant: what runs is what you read.
The claim is one statement (lock, lease and counters), a step commit is one statement (fence,
lease, step and the effects that go with it), the last step of a run and the claim of the
worker's next run are one statement, and the heartbeat of a worker is one statement. The only
formatting is the VALUES list of the effects (``{rows}``: one placeholder tuple per effect).

The claimable runs (the CTEs ``due``: waiting runs whose timer or timeout is past, and
``ready``: pending runs and expired leases, oldest first; FOR NO KEY UPDATE SKIP LOCKED)
appear in ``CLAIMABLE_SQL``, ``CLAIM_SQL`` and ``FINISH_AND_CLAIM_SQL``;
tests/unit/test_postgres_statements.py keeps the three in step. The predicates on status match
the partial indexes agent_run_wake and agent_run_claim.

The other operations (finish, release, park, wake, decisions) are the ORM updates of
``PortableStore``, which this class inherits: one UPDATE each on PostgreSQL too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from django.db import connection
from django.db.backends.base.base import BaseDatabaseWrapper

from durable_agents.models import AgentRun, IntentStatus, ToolEffect, ToolIntent
from durable_agents.store.base import (
    Claim,
    LeaseLoss,
    NextClaim,
    RunId,
    StepWrite,
    lease_losses,
)
from durable_agents.store.portable import PortableStore
from durable_agents.text import storable_text

# The runs a claim may take (for EXPLAIN in tests; CLAIM_SQL holds the same CTEs): first waiting
# runs whose timer or timeout is due (late by definition), in wake_at order, through the
# partial index agent_run_wake; then pending runs and runs whose lease expired, oldest first,
# through agent_run_claim; %(limit)s in all. Both lock FOR NO KEY UPDATE SKIP LOCKED (the
# lock a step's foreign key does not conflict with).
CLAIMABLE_SQL = """
WITH due AS (
SELECT id FROM agent_run
 WHERE status = 'waiting'
   AND wake_at <= now()
 ORDER BY wake_at
 LIMIT %(limit)s
   FOR NO KEY UPDATE SKIP LOCKED
), ready AS (
SELECT id FROM agent_run
 WHERE status IN ('pending', 'running')
   AND (lease_until IS NULL OR lease_until < now())
 ORDER BY created_at
 LIMIT greatest(%(limit)s - (SELECT count(*) FROM due), 0)
   FOR NO KEY UPDATE SKIP LOCKED
)
SELECT id FROM due UNION ALL SELECT id FROM ready"""

# Claim: lock, lease and counters in one statement. A run with nothing but its task gets its
# log with the claim (no second read).
CLAIM_SQL = """
WITH due AS (
SELECT id FROM agent_run
 WHERE status = 'waiting'
   AND wake_at <= now()
 ORDER BY wake_at
 LIMIT %(limit)s
   FOR NO KEY UPDATE SKIP LOCKED
), ready AS (
SELECT id FROM agent_run
 WHERE status IN ('pending', 'running')
   AND (lease_until IS NULL OR lease_until < now())
 ORDER BY created_at
 LIMIT greatest(%(limit)s - (SELECT count(*) FROM due), 0)
   FOR NO KEY UPDATE SKIP LOCKED
)
UPDATE agent_run AS run
   SET status = 'running',
       lease_owner = %(owner)s,
       lease_until = now() + make_interval(secs => %(lease)s),
       attempt = run.attempt + 1,
       stalled_claims = run.stalled_claims + 1,
       started_at = coalesce(run.started_at, now()),
       -- A due wait: what ended it. Any other run keeps its own (a crash after a wake).
       woken_by = CASE WHEN run.status <> 'waiting' THEN run.woken_by
                       WHEN run.waiting_for = 'timer' THEN '{"timer": true}'
                       ELSE '{"timeout": true}' END,
       wake_at = NULL,
       updated_at = now()
 WHERE run.id IN (SELECT id FROM (SELECT id FROM due UNION ALL SELECT id FROM ready) AS claimable
                   LIMIT %(limit)s)
RETURNING run.*,
          -- A run with nothing but its task: its log comes with the claim (no second read).
          (SELECT payload FROM agent_step
            WHERE run_id = run.id AND seq = 0 AND kind = 'task' AND run.last_seq = 0
          ) AS task_payload"""

# The heartbeat of a whole worker: one statement renews every lease it holds, whatever their
# number, and names the runs it held that are no longer its own, with their status. The outer
# SELECT locks those rows FOR SHARE: under READ COMMITTED that waits for a transaction that is
# changing one (its slot finishing or parking it, a cancel) and reads the row as committed,
# where the statement's own snapshot would still say 'running' and call a finished run lost.
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
APPEND_STEP_SQL = """WITH fence AS (
    UPDATE agent_run
       SET last_seq = %(seq)s,
           stalled_claims = 0,
           tokens_used = tokens_used + %(tokens)s,
           lease_until = now() + make_interval(secs => %(lease)s),
           updated_at = now()
     WHERE id = %(run_id)s
       AND lease_owner = %(owner)s
       AND attempt = %(attempt)s
       AND status = 'running'
       AND last_seq = %(seq)s - 1
 RETURNING id
)
INSERT INTO agent_step (run_id, seq, kind, payload, content_start, content_end, request_id,
                        attempt, worker)
SELECT id, %(seq)s, %(kind)s, %(payload)s, %(content_start)s, %(content_end)s, %(request_id)s,
       %(attempt)s, %(owner)s
  FROM fence"""

# The last step of a run: the same fence, and the run ends instead of renewing its lease.
APPEND_LAST_STEP_SQL = """WITH fence AS (
    UPDATE agent_run
       SET last_seq = %(seq)s,
           stalled_claims = 0,
           tokens_used = tokens_used + %(tokens)s,
           status = %(status)s,
           result = %(result)s,
           error = '',
           lease_owner = NULL,
           lease_until = NULL,
           finished_at = now(),
           updated_at = now()
     WHERE id = %(run_id)s
       AND lease_owner = %(owner)s
       AND attempt = %(attempt)s
       AND status = 'running'
       AND last_seq = %(seq)s - 1
 RETURNING id
)
INSERT INTO agent_step (run_id, seq, kind, payload, content_start, content_end, request_id,
                        attempt, worker)
SELECT id, %(seq)s, %(kind)s, %(payload)s, %(content_start)s, %(content_end)s, %(request_id)s,
       %(attempt)s, %(owner)s
  FROM fence"""

# APPEND_STEP_SQL with the tool effects of the step. The effects are recorded whatever the
# fence says (the CTE does not read it): they describe calls that happened. ``{rows}`` is the
# VALUES list, one placeholder tuple per effect (``_effect_rows``).
APPEND_STEP_WITH_EFFECTS_SQL = """WITH fence AS (
    UPDATE agent_run
       SET last_seq = %(seq)s,
           stalled_claims = 0,
           tokens_used = tokens_used + %(tokens)s,
           lease_until = now() + make_interval(secs => %(lease)s),
           updated_at = now()
     WHERE id = %(run_id)s
       AND lease_owner = %(owner)s
       AND attempt = %(attempt)s
       AND status = 'running'
       AND last_seq = %(seq)s - 1
 RETURNING id
),
recorded AS (
    INSERT INTO tool_effect (key, run_id, seq, call_index, tool, result, is_error)
    VALUES {rows}
    ON CONFLICT (key) DO NOTHING
)
INSERT INTO agent_step (run_id, seq, kind, payload, content_start, content_end, request_id,
                        attempt, worker)
SELECT id, %(seq)s, %(kind)s, %(payload)s, %(content_start)s, %(content_end)s, %(request_id)s,
       %(attempt)s, %(owner)s
  FROM fence"""

# APPEND_LAST_STEP_SQL with the tool effects of the step (``{rows}`` as above).
APPEND_LAST_STEP_WITH_EFFECTS_SQL = """WITH fence AS (
    UPDATE agent_run
       SET last_seq = %(seq)s,
           stalled_claims = 0,
           tokens_used = tokens_used + %(tokens)s,
           status = %(status)s,
           result = %(result)s,
           error = '',
           lease_owner = NULL,
           lease_until = NULL,
           finished_at = now(),
           updated_at = now()
     WHERE id = %(run_id)s
       AND lease_owner = %(owner)s
       AND attempt = %(attempt)s
       AND status = 'running'
       AND last_seq = %(seq)s - 1
 RETURNING id
),
recorded AS (
    INSERT INTO tool_effect (key, run_id, seq, call_index, tool, result, is_error)
    VALUES {rows}
    ON CONFLICT (key) DO NOTHING
)
INSERT INTO agent_step (run_id, seq, kind, payload, content_start, content_end, request_id,
                        attempt, worker)
SELECT id, %(seq)s, %(kind)s, %(payload)s, %(content_start)s, %(content_end)s, %(request_id)s,
       %(attempt)s, %(owner)s
  FROM fence"""

# The last step of a run and the claim of the worker's next run, in one statement: a busy
# worker saves a round trip and a flushed commit per run. The claim happens only if the fence
# held (``AND EXISTS (SELECT 1 FROM fence)``); the finished run is not claimable in the
# statement's snapshot (its lease is still held there). One row: whether the step was
# appended, then the next run's columns, or NULLs when there was none.
FINISH_AND_CLAIM_SQL = """WITH fence AS (
    UPDATE agent_run
       SET last_seq = %(seq)s,
           stalled_claims = 0,
           tokens_used = tokens_used + %(tokens)s,
           status = %(status)s,
           result = %(result)s,
           error = '',
           lease_owner = NULL,
           lease_until = NULL,
           finished_at = now(),
           updated_at = now()
     WHERE id = %(run_id)s
       AND lease_owner = %(owner)s
       AND attempt = %(attempt)s
       AND status = 'running'
       AND last_seq = %(seq)s - 1
 RETURNING id
), appended AS (
INSERT INTO agent_step (run_id, seq, kind, payload, content_start, content_end, request_id,
                        attempt, worker)
SELECT id, %(seq)s, %(kind)s, %(payload)s, %(content_start)s, %(content_end)s, %(request_id)s,
       %(attempt)s, %(owner)s
  FROM fence
 RETURNING run_id
), due AS (
SELECT id FROM agent_run
 WHERE status = 'waiting'
   AND wake_at <= now()
   AND EXISTS (SELECT 1 FROM fence)
 ORDER BY wake_at
 LIMIT %(limit)s
   FOR NO KEY UPDATE SKIP LOCKED
), ready AS (
SELECT id FROM agent_run
 WHERE status IN ('pending', 'running')
   AND (lease_until IS NULL OR lease_until < now())
   AND EXISTS (SELECT 1 FROM fence)
 ORDER BY created_at
 LIMIT greatest(%(limit)s - (SELECT count(*) FROM due), 0)
   FOR NO KEY UPDATE SKIP LOCKED
), taken AS (
UPDATE agent_run AS run
   SET status = 'running',
       lease_owner = %(owner)s,
       lease_until = now() + make_interval(secs => %(lease)s),
       attempt = run.attempt + 1,
       stalled_claims = run.stalled_claims + 1,
       started_at = coalesce(run.started_at, now()),
       -- A due wait: what ended it. Any other run keeps its own (a crash after a wake).
       woken_by = CASE WHEN run.status <> 'waiting' THEN run.woken_by
                       WHEN run.waiting_for = 'timer' THEN '{"timer": true}'
                       ELSE '{"timeout": true}' END,
       wake_at = NULL,
       updated_at = now()
 WHERE run.id IN (SELECT id FROM (SELECT id FROM due UNION ALL SELECT id FROM ready) AS claimable
                   LIMIT %(limit)s)
RETURNING run.*,
          -- A run with nothing but its task: its log comes with the claim (no second read).
          (SELECT payload FROM agent_step
            WHERE run_id = run.id AND seq = 0 AND kind = 'task' AND run.last_seq = 0
          ) AS task_payload
)
SELECT (SELECT count(*) FROM appended) AS appended, taken.*
  FROM (SELECT 1) AS one LEFT JOIN taken ON true"""

# approved -> executing and a renewed lease, only while the run is still this claim's and
# running: a cancel that committed first makes the fence fail and the call never starts. The
# run row stays locked until the intent row is updated.
START_INTENT_SQL = """
WITH fence AS (
    UPDATE agent_run
       SET lease_until = now() + make_interval(secs => %(lease)s),
           updated_at = now()
     WHERE id = %(run_id)s
       AND lease_owner = %(owner)s
       AND attempt = %(attempt)s
       AND status = 'running'
 RETURNING id
)
UPDATE tool_intent
   SET status = 'executing', updated_at = now()
 WHERE id = %(intent_id)s
   AND status = 'approved'
   AND EXISTS (SELECT 1 FROM fence)
RETURNING id"""

# How a tool result is written (JSON text), as the ORM writes it.
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


@contextlib.contextmanager
def binding_cursor() -> Iterator[Any]:
    """The cursor of the step commit: a server-side-binding psycopg cursor (Django's own binds
    on the client), so that psycopg can prepare the statement once the database OPTIONS set a
    ``prepare_threshold`` (that saves the parse and plan of every step; Django leaves it off by
    default for poolers that cannot keep prepared statements), wrapped as Django wraps its
    own cursors: ``connection.execute_wrapper`` hooks (Sentry, OpenTelemetry's Django
    instrumentation), ``connection.queries`` under DEBUG and Django's error classes all see
    the commit. The wrapper costs about a microsecond (docs/operating.md)."""
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


class PostgresStore(PortableStore):
    """PostgreSQL outside a caller's transaction: one statement (one round trip) per claim,
    per step commit, per finish-and-claim and per heartbeat."""

    def claim_runs(self, owner: str, lease_seconds: float, limit: int = 1) -> list[Claim]:
        params = {"owner": owner, "lease": float(lease_seconds), "limit": limit}
        runs = sorted(AgentRun.objects.raw(CLAIM_SQL, params), key=lambda run: run.created_at)
        return [
            Claim(run, owner, run.attempt, lease_seconds, getattr(run, "task_payload", None))
            for run in runs
        ]

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
            "payload": step.payload,
            "content_start": step.content_span[0] if step.content_span else None,
            "content_end": step.content_span[1] if step.content_span else None,
            "request_id": step.request_id,
            "tokens": step.tokens,
        }
        finish = step.finish
        if finish is not None:
            params["status"] = finish[0]
            params["result"] = None if finish[1] is None else storable_text(finish[1])
        if finish is not None:
            appended = self._append(params, step.effects, finish, then_claim)
            if appended:
                self.child_ended(claim.run.parent_id)
            return appended
        return self._append(params, step.effects, finish, then_claim)

    def _append(
        self,
        params: dict[str, Any],
        effects: Sequence[ToolEffect],
        finish: tuple[str, str | None] | None,
        then_claim: NextClaim | None,
    ) -> bool:
        if finish is not None and then_claim is not None and not effects:
            return self._finish_and_claim(params, then_claim)
        if effects:
            if finish is None:
                template = APPEND_STEP_WITH_EFFECTS_SQL
            else:
                template = APPEND_LAST_STEP_WITH_EFFECTS_SQL
            sql = template.format(rows=_effect_rows(effects, params))
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
        may (``then_claim.take()``)."""
        if not then_claim.take():
            return self._execute_append(APPEND_LAST_STEP_SQL, params)
        params = {**params, "lease": float(then_claim.lease_seconds), "limit": 1}
        with binding_cursor() as cursor:
            try:
                cursor.execute(FINISH_AND_CLAIM_SQL, params)
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
        task_payload = taken.pop("task_payload")
        fields = AgentRun._meta.concrete_fields
        # The driver's values, through each field's own conversion (JSON text columns such as
        # woken_by are parsed), as the ORM would.
        values = [
            f.from_db_value(taken[f.column], None, connection)
            if hasattr(f, "from_db_value")
            else taken[f.column]
            for f in fields
        ]
        run = AgentRun.from_db(connection.alias, [f.attname for f in fields], values)
        then_claim.claim = Claim(
            run, then_claim.owner, run.attempt, then_claim.lease_seconds, task_payload
        )
        return appended

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
