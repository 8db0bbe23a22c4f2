"""Every statement that locks or fences a run row lives here.

A worker *claims* a run (``claim_runs``), keeps it by renewing a short lease
(``renew_lease``), and changes it only through fenced statements: each one matches the run on
(id, lease_owner, attempt, status='running'). A claim increments ``attempt``, so a worker whose
lease expired and was taken over can never commit anything again, even if it wakes up later.

Lease times come from the database clock (``now()``), never from a worker's clock.

``append_step`` is the hot path: on PostgreSQL it is one statement (one round trip) that checks
the fence, renews the lease, inserts the step and records the tool effects that go with it.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
from collections.abc import Callable, Sequence

from django.db import connection, transaction
from django.db.models import DateTimeField, ExpressionWrapper, F, QuerySet
from django.db.models.functions import Coalesce, Greatest, Now

from durable_agents.models import (
    AgentRun,
    AgentStep,
    IntentStatus,
    RunStatus,
    ToolEffect,
    ToolIntent,
)
from durable_agents.text import storable_text

# A reason (error) longer than this is cut with a note: it is shown on pages and in e-mails.
MAX_REASON_CHARS = 20_000


@dataclasses.dataclass(frozen=True)
class Claim:
    """A run leased to one worker for one attempt; the (owner, attempt) pair is the fence."""

    run: AgentRun
    owner: str
    attempt: int
    lease_seconds: float
    # The payload of the task step when it is the run's only step (PostgreSQL claims).
    task_payload: str | None = None

    @property
    def run_id(self):  # noqa: ANN201 - a UUID
        return self.run.pk


def _lease_expiry(seconds: float) -> ExpressionWrapper:
    return ExpressionWrapper(
        Now() + datetime.timedelta(seconds=seconds), output_field=DateTimeField()
    )


def _fenced(claim: Claim):  # noqa: ANN202 - a QuerySet
    return AgentRun.objects.filter(
        pk=claim.run_id,
        lease_owner=claim.owner,
        attempt=claim.attempt,
        status=RunStatus.RUNNING,
    )


# The PostgreSQL claim: the subquery is ``AgentRun.objects.claimable()`` locked with
# select_for_update(skip_locked=True, no_key=True), as in the portable path below; written out
# so that lock, lease and counters are taken in a single statement. The predicate on status
# matches the partial index agent_run_claim.
_CLAIMABLE_SQL = """
SELECT id FROM agent_run
 WHERE status IN ('pending', 'running')
   AND (lease_until IS NULL OR lease_until < now())
 ORDER BY created_at
 LIMIT %(limit)s
   FOR NO KEY UPDATE SKIP LOCKED"""

_TAKE_SQL = """
UPDATE agent_run AS run
   SET status = 'running',
       lease_owner = %(owner)s,
       lease_until = now() + make_interval(secs => %(lease)s),
       attempt = run.attempt + 1,
       stalled_claims = run.stalled_claims + 1,
       started_at = coalesce(run.started_at, now()),
       updated_at = now()
 WHERE run.id IN ({candidates})
RETURNING run.*,
          -- A run with nothing but its task: its log comes with the claim (no second read).
          (SELECT payload FROM agent_step
            WHERE run_id = run.id AND seq = 0 AND kind = 'task' AND run.last_seq = 0
          ) AS task_payload"""
_CLAIM_SQL = _TAKE_SQL.format(candidates=_CLAIMABLE_SQL)


def claim_runs(owner: str, lease_seconds: float, limit: int = 1) -> list[Claim]:
    """Lease up to ``limit`` claimable runs, oldest first, skipping rows others hold.

    FOR NO KEY UPDATE (``no_key=True``) rather than FOR UPDATE: the latter would conflict with
    the FOR KEY SHARE lock that inserting a step takes on its run through the foreign key.
    On PostgreSQL the claim is one statement (one round trip); on SQLite the IMMEDIATE
    transaction mode makes the whole claim exclusive instead.
    """
    if connection.vendor == "postgresql" and not connection.in_atomic_block:
        params = {"owner": owner, "lease": float(lease_seconds), "limit": limit}
        runs = sorted(AgentRun.objects.raw(_CLAIM_SQL, params), key=lambda run: run.created_at)
        return [
            Claim(run, owner, run.attempt, lease_seconds, getattr(run, "task_payload", None))
            for run in runs
        ]
    return _lock_and_take(
        AgentRun.objects.claimable().order_by("created_at")[:limit], owner, lease_seconds
    )


def claim_run(run_id: object, owner: str, lease_seconds: float) -> Claim | None:
    """Lease one given run if it is claimable now (tests, "run now" operations)."""
    claims = _lock_and_take(AgentRun.objects.claimable().filter(pk=run_id), owner, lease_seconds)
    return claims[0] if claims else None


def _lock_and_take(candidates: QuerySet, owner: str, lease_seconds: float) -> list[Claim]:
    with transaction.atomic():
        ids = list(
            candidates.select_for_update(skip_locked=True, no_key=True).values_list("pk", flat=True)
        )
        if not ids:
            return []
        AgentRun.objects.filter(pk__in=ids).update(
            status=RunStatus.RUNNING,
            lease_owner=owner,
            lease_until=_lease_expiry(lease_seconds),
            attempt=F("attempt") + 1,
            stalled_claims=F("stalled_claims") + 1,
            started_at=Coalesce(F("started_at"), Now()),
            updated_at=Now(),
        )
        runs = AgentRun.objects.filter(pk__in=ids).order_by("created_at")
        return [Claim(run, owner, run.attempt, lease_seconds) for run in runs]


# The heartbeat of a whole worker: one statement renews every lease it holds, whatever their
# number, and names the runs it held that are no longer its own (the outer SELECT reads the
# statement's snapshot, from before the UPDATE: the status a run had when its renewal failed).
_RENEW_ALL_SQL = """
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
SELECT held.id, run.status
  FROM held LEFT JOIN agent_run AS run ON run.id = held.id
 WHERE held.id NOT IN (SELECT id FROM renewed)"""


class LeaseLoss(enum.Enum):
    """Why a held run was not renewed and its work must stop."""

    CANCELLED = "cancelled"
    LOST = "lost"  # another worker holds it now (or it was handed back)


def renew_leases(
    owner: str, claims: Sequence[Claim], lease_seconds: float, using: object = None
) -> dict[object, LeaseLoss]:
    """Renew the leases of ``claims`` (all of one worker, ``owner``) and return the runs whose
    work must stop: cancelled, or no longer this worker's. A run that was not renewed because
    its own slot just finished, parked or released it is not in the answer.

    On PostgreSQL this is one statement, on ``using`` (a connection wrapper) if given."""
    if not claims:
        return {}
    conn = using or connection
    if conn.vendor == "postgresql":
        params = {
            "ids": [c.run_id for c in claims],
            "attempts": [c.attempt for c in claims],
            "owner": owner,
            "lease": float(lease_seconds),
        }
        with conn.cursor() as cursor:
            cursor.execute(_RENEW_ALL_SQL, params)
            missed = cursor.fetchall()
    else:
        # SQLite: the same outcome in one IMMEDIATE transaction (a single writer anyway).
        with transaction.atomic():
            by_id = {c.run_id: c for c in claims}
            rows = list(
                AgentRun.objects.filter(pk__in=list(by_id)).values_list(
                    "pk", "status", "lease_owner", "attempt"
                )
            )
            ours, missed = [], []
            for run_id, status, lease_owner, attempt in rows:
                mine = lease_owner == owner and attempt == by_id[run_id].attempt
                if mine and status == RunStatus.RUNNING:
                    ours.append(run_id)
                else:
                    missed.append((run_id, status))
            AgentRun.objects.filter(pk__in=ours).update(
                lease_until=_lease_expiry(lease_seconds), updated_at=Now()
            )
    lost: dict[object, LeaseLoss] = {}
    for run_id, status in missed:
        if status == RunStatus.CANCELLED:
            lost[run_id] = LeaseLoss.CANCELLED
        elif status == RunStatus.RUNNING:
            lost[run_id] = LeaseLoss.LOST
    return lost


def renew_lease(claim: Claim) -> bool:
    """Extend the lease; False when the run was cancelled or taken over (stop working on it)."""
    return bool(
        _fenced(claim).update(lease_until=_lease_expiry(claim.lease_seconds), updated_at=Now())
    )


_FENCE_SQL = """
    UPDATE agent_run
       SET last_seq = %(seq)s,
           stalled_claims = 0,
           tokens_used = tokens_used + %(tokens)s,
           {run_changes}
           updated_at = now()
     WHERE id = %(run_id)s
       AND lease_owner = %(owner)s
       AND attempt = %(attempt)s
       AND status = 'running'
       AND last_seq = %(seq)s - 1
 RETURNING id"""
_INSERT_STEP_SQL = """
INSERT INTO agent_step (run_id, seq, kind, payload, content_start, content_end, request_id,
                        attempt, worker)
SELECT id, %(seq)s, %(kind)s, %(payload)s, %(content_start)s, %(content_end)s, %(request_id)s,
       %(attempt)s, %(owner)s
  FROM fence"""
_APPEND_SQL = "WITH fence AS (" + _FENCE_SQL + "\n){effects_cte}" + _INSERT_STEP_SQL

# A step that keeps the run going renews the lease; the last step of a run ends it in the same
# statement (one round trip less per run).
_RENEW = "lease_until = now() + make_interval(secs => %(lease)s),"
_FINISH = """status = %(status)s,
           result = %(result)s,
           error = '',
           lease_owner = NULL,
           lease_until = NULL,
           finished_at = now(),"""
_APPEND_SQL_PLAIN = _APPEND_SQL.format(run_changes=_RENEW, effects_cte="")
_APPEND_SQL_FINISH = _APPEND_SQL.format(run_changes=_FINISH, effects_cte="")

# The last step of a run and the claim of the worker's next run, in one statement: a busy
# worker saves a round trip and a flushed commit per run. The claim happens only if the fence
# held (it reads the fence's output); the finished run is not claimable in the statement's
# snapshot (its lease is still held there). One row: whether the step was appended, then the
# next run's columns, or NULLs when there was none.
_FINISH_AND_CLAIM_SQL = (
    "WITH fence AS ("
    + _FENCE_SQL.format(run_changes=_FINISH)
    + "\n), appended AS ("
    + _INSERT_STEP_SQL
    + "\n RETURNING run_id\n), taken AS ("
    + _TAKE_SQL.format(
        candidates=_CLAIMABLE_SQL.replace(
            "\n ORDER BY", "\n   AND EXISTS (SELECT 1 FROM fence)\n ORDER BY", 1
        )
    )
    + "\n)\nSELECT (SELECT count(*) FROM appended) AS appended, taken.*"
    + "\n  FROM (SELECT 1) AS one LEFT JOIN taken ON true"
)


@dataclasses.dataclass
class NextClaim:
    """A worker slot's offer to take its next run with the last step of the current one.

    ``take`` reserves the right to claim (False: the slot must not, e.g. it is stopping);
    ``give_back`` returns it when no run was claimable. ``claim`` is the run taken, if any."""

    owner: str
    lease_seconds: float
    take: Callable[[], bool]
    give_back: Callable[[], None]
    claim: Claim | None = None


_EFFECTS_CTE = """,
recorded AS (
    INSERT INTO tool_effect (key, run_id, seq, call_index, tool, result, is_error)
    VALUES {rows}
    ON CONFLICT (key) DO NOTHING
)"""


_RESULT_FIELD = ToolEffect._meta.get_field("result")


def append_step(
    claim: Claim,
    seq: int,
    kind: str,
    payload: str,
    request_id: str | None = None,
    effects: Sequence[ToolEffect] = (),
    finish: tuple[str, str | None] | None = None,
    content_span: tuple[int, int] | None = None,
    tokens: int = 0,
    then_claim: NextClaim | None = None,
) -> bool:
    """Commit one step if, and only if, this claim still holds the run. This is where a step
    gets committed. Renews the lease and resets the no-progress count in the same statement;
    with ``finish=(status, result)`` it ends the run instead of renewing (its last step).
    A model turn brings the span of its content in ``payload`` and the tokens it billed.
    With ``finish`` and ``then_claim``, the same statement claims the worker's next run (on
    PostgreSQL; ``then_claim.claim`` is set, or left None).

    ``effects`` are recorded whatever the fence says: they describe calls that happened, and a
    recorded call never runs again. Returns False when the fence failed (nothing appended).
    """
    if connection.vendor == "postgresql" and not connection.in_atomic_block:
        params: dict[str, object] = {
            "run_id": claim.run_id,
            "owner": claim.owner,
            "attempt": claim.attempt,
            "lease": float(claim.lease_seconds),
            "seq": seq,
            "kind": kind,
            "payload": payload,
            "content_start": content_span[0] if content_span else None,
            "content_end": content_span[1] if content_span else None,
            "request_id": request_id,
            "tokens": tokens,
        }
        effects_cte = ""
        if effects:
            rows = []
            for i, effect in enumerate(effects):
                rows.append(
                    f"(%(k{i})s, %(run_id)s, %(s{i})s, %(c{i})s, %(t{i})s, %(r{i})s, %(e{i})s)"
                )
                params.update(
                    {
                        f"k{i}": effect.key,
                        f"s{i}": effect.seq,
                        f"c{i}": effect.call_index,
                        f"t{i}": effect.tool,
                        f"r{i}": _RESULT_FIELD.get_prep_value(effect.result),
                        f"e{i}": effect.is_error,
                    }
                )
            effects_cte = _EFFECTS_CTE.format(rows=", ".join(rows))
        if finish is not None:
            params["status"] = finish[0]
            params["result"] = None if finish[1] is None else storable_text(finish[1])
        if finish is not None and then_claim is not None and not effects:
            return _finish_and_claim(params, then_claim)
        if effects:
            sql = _APPEND_SQL.format(
                run_changes=_RENEW if finish is None else _FINISH, effects_cte=effects_cte
            )
        else:
            sql = _APPEND_SQL_PLAIN if finish is None else _APPEND_SQL_FINISH
        return _execute_append(sql, params)

    # Portable path (SQLite, or a caller's open transaction): the same checks, in one
    # transaction. On SQLite the IMMEDIATE mode makes check-then-insert atomic.
    with transaction.atomic():
        if effects:
            ToolEffect.objects.bulk_create(effects, ignore_conflicts=True)
        fenced = _fenced(claim).filter(last_seq=seq - 1)
        changes: dict[str, object] = {"lease_until": _lease_expiry(claim.lease_seconds)}
        if finish is not None:
            changes = _ending(finish[0], finish[1], "")
        if not fenced.update(
            last_seq=seq,
            stalled_claims=0,
            tokens_used=F("tokens_used") + tokens,
            updated_at=Now(),
            **changes,
        ):
            return False
        AgentStep.objects.create(
            run_id=claim.run_id,
            seq=seq,
            kind=kind,
            payload=payload,
            content_start=content_span[0] if content_span else None,
            content_end=content_span[1] if content_span else None,
            request_id=request_id,
            attempt=claim.attempt,
            worker=claim.owner,
        )
    return True


def _execute_append(sql: str, params: dict[str, object]) -> bool:
    # A server-side-binding cursor of the driver (Django's binds on the client), so that
    # psycopg can prepare this statement once the database OPTIONS set a prepare_threshold:
    # that saves the parse and plan of every step. Django leaves it off by default for poolers
    # that cannot keep prepared statements. Errors stay Django's.
    import psycopg  # only on PostgreSQL: SQLite installs need not have it

    connection.ensure_connection()
    with connection.wrap_database_errors, psycopg.Cursor(connection.connection) as cursor:
        cursor.execute(sql, params)
        return cursor.rowcount == 1


def _finish_and_claim(params: dict[str, object], then_claim: NextClaim) -> bool:
    """``append_step`` of a run's last step that also claims the next run, if the slot may."""
    import psycopg

    if not then_claim.take():
        return _execute_append(_APPEND_SQL_FINISH, params)
    params = {**params, "lease": float(then_claim.lease_seconds), "limit": 1}
    connection.ensure_connection()
    with connection.wrap_database_errors, psycopg.Cursor(connection.connection) as cursor:
        try:
            cursor.execute(_FINISH_AND_CLAIM_SQL, params)
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
    run = AgentRun.from_db(
        connection.alias, [f.attname for f in fields], [taken[f.column] for f in fields]
    )
    then_claim.claim = Claim(
        run, then_claim.owner, run.attempt, then_claim.lease_seconds, task_payload
    )
    return appended


def _ending(status: str, result: str | None, error: str) -> dict[str, object]:
    """The columns a run's end sets (``_FINISH`` is the same in SQL)."""
    return {
        "status": status,
        "result": None if result is None else storable_text(result),
        "error": storable_text(error, MAX_REASON_CHARS),
        "lease_owner": None,
        "lease_until": None,
        "finished_at": Now(),
    }


def finish_run(claim: Claim, status: str, *, result: str | None = None, error: str = "") -> bool:
    """End the run (succeeded, failed or dead) and free its lease; fenced."""
    return bool(_fenced(claim).update(updated_at=Now(), **_ending(status, result, error)))


class Parked(enum.Enum):
    """What ``park_on_intent`` did."""

    PARKED = "parked"  # the run is waiting for a person
    DECIDED = "decided"  # the intent was decided meanwhile: go on, do not park
    FENCE_FAILED = "fence_failed"  # the run is no longer this claim's


_AWAITING_PERSON = (IntentStatus.PENDING, IntentStatus.UNKNOWN)


def park_on_intent(
    claim: Claim, intent: ToolIntent, *, new: bool = False, crashed: bool = False
) -> Parked:
    """Park the run as ``waiting`` on ``intent`` (lease freed, not claimable), in one
    transaction that also writes a ``new`` intent, or, for a ``crashed`` call (the intent was
    left ``executing`` by a worker that died), marks it ``unknown``.

    An existing intent is locked first and the run is parked only while the intent still
    waits for a person. Decisions lock the intent and then wake the run in one transaction
    (``api``), in the same order, so whichever commits first, no interleaving leaves a run
    waiting on an intent that was already decided."""
    with transaction.atomic():
        if new:
            intent.save(force_insert=True)
        else:
            status = (
                ToolIntent.objects.select_for_update()
                .filter(pk=intent.pk)
                .values_list("status", flat=True)
                .first()
            )
            if crashed and status == IntentStatus.EXECUTING:
                ToolIntent.objects.filter(pk=intent.pk).update(
                    status=IntentStatus.UNKNOWN, updated_at=Now()
                )
                status = IntentStatus.UNKNOWN
            if status not in _AWAITING_PERSON:
                return Parked.DECIDED
        # Parking is this claim's outcome, not a stall: the no-progress count starts again.
        if not _fenced(claim).update(
            status=RunStatus.WAITING,
            lease_owner=None,
            lease_until=None,
            stalled_claims=0,
            updated_at=Now(),
        ):
            transaction.set_rollback(True)
            return Parked.FENCE_FAILED
    return Parked.PARKED


# approved -> executing and a renewed lease, only while the run is still this claim's and
# running: a cancel that committed first makes the fence fail and the call never starts. On
# PostgreSQL one statement; the run row stays locked until the intent row is updated.
_START_INTENT_SQL = """
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


def start_intent_execution(claim: Claim, intent: ToolIntent) -> bool:
    """Mark an approved intent ``executing`` (committed before the tool runs: after a crash,
    an ``executing`` intent without an effect is how we know its outcome is unknown), fenced
    on the run and renewing its lease. False: the run is no longer this claim's (cancelled,
    taken over) or the intent is no longer approved; the call must not run."""
    if connection.vendor == "postgresql" and not connection.in_atomic_block:
        params = {
            "run_id": claim.run_id,
            "owner": claim.owner,
            "attempt": claim.attempt,
            "lease": float(claim.lease_seconds),
            "intent_id": intent.pk,
        }
        with connection.cursor() as cursor:
            cursor.execute(_START_INTENT_SQL, params)
            started = cursor.rowcount == 1
    else:
        with transaction.atomic():
            started = bool(
                _fenced(claim).update(
                    lease_until=_lease_expiry(claim.lease_seconds), updated_at=Now()
                )
            ) and bool(
                ToolIntent.objects.filter(pk=intent.pk, status=IntentStatus.APPROVED).update(
                    status=IntentStatus.EXECUTING, updated_at=Now()
                )
            )
            if not started:
                transaction.set_rollback(True)
    if started:
        intent.status = IntentStatus.EXECUTING
    return started


def wake_run(run_id: object) -> bool:
    """A parked run becomes claimable again (what it waited for was decided). Callers hold
    the lock of what was decided (the intent row), so a park and a wake never cross."""
    return bool(
        AgentRun.objects.filter(pk=run_id, status=RunStatus.WAITING).update(
            status=RunStatus.PENDING, updated_at=Now()
        )
    )


def release_lease(
    claim: Claim,
    *,
    error: str | None = None,
    count_claim: bool = True,
    hold_seconds: float | None = None,
) -> bool:
    """Hand the run back (pending). ``count_claim=False`` takes back the no-progress count of
    this claim: a shutdown is not the run's fault. ``hold_seconds`` keeps it claimable by
    nobody for that long (the lease column doubles as a not-before time); otherwise it is
    claimable at once."""
    changes: dict[str, object] = {
        "status": RunStatus.PENDING,
        "lease_owner": None,
        "lease_until": None if hold_seconds is None else _lease_expiry(hold_seconds),
        "updated_at": Now(),
    }
    if error is not None:
        changes["error"] = storable_text(error, MAX_REASON_CHARS)
    if not count_claim:
        changes["stalled_claims"] = Greatest(F("stalled_claims") - 1, 0)
    return bool(_fenced(claim).update(**changes))


def current_status(run_id) -> str | None:  # noqa: ANN001 - a UUID or str
    return AgentRun.objects.filter(pk=run_id).values_list("status", flat=True).first()
