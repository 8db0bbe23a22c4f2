"""Claims, leases and fenced commits: module-level functions over the chosen store.

Each function delegates to ``durable_agents.store.current()`` (the store of this thread's
default connection: ``PostgresStore`` outside a transaction on PostgreSQL, ``PortableStore``
on SQLite or inside a caller's transaction). The statements themselves, and the flow they make
(claim -> renew -> append_step -> finish/release/park -> wake), are in ``durable_agents/store/``:
a step is committed by ``PostgresStore.append_step`` (store/postgres.py, one statement) or
``PortableStore.append_step`` (store/portable.py).

A worker *claims* a run (``claim_runs``), keeps it by renewing a short lease (``renew_leases``,
the heartbeat), and changes it only through fenced statements: each one matches the run on
(id, lease_owner, attempt, status='running'). A claim increments ``attempt``, so a worker whose
lease expired and was taken over can never commit anything again, even if it wakes up later.
Lease times come from the database clock (``now()``), never from a worker's clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.db import connection

from durable_agents.models import ToolEffect, ToolIntent
from durable_agents.store import current, dialect_store, postgres
from durable_agents.store.base import (
    MAX_REASON_CHARS,
    Claim,
    LeaseLoss,
    NextClaim,
    Parked,
    RunId,
)

__all__ = [
    "MAX_REASON_CHARS",
    "Claim",
    "LeaseLoss",
    "NextClaim",
    "Parked",
    "append_step",
    "claim_run",
    "claim_runs",
    "current_status",
    "finish_run",
    "park_on_intent",
    "release_lease",
    "renew_lease",
    "renew_leases",
    "start_intent_execution",
    "wake_run",
]

# The PostgreSQL statements under their former names (benchmarks and tests read them).
_CLAIMABLE_SQL = postgres.CLAIMABLE_SQL
_CLAIM_SQL = postgres.CLAIM_SQL
_RENEW_ALL_SQL = postgres.RENEW_ALL_SQL
_APPEND_SQL_PLAIN = postgres.APPEND_STEP_SQL
_APPEND_SQL_FINISH = postgres.APPEND_LAST_STEP_SQL
_FINISH_AND_CLAIM_SQL = postgres.FINISH_AND_CLAIM_SQL
_START_INTENT_SQL = postgres.START_INTENT_SQL
_RESULT_FIELD = postgres.RESULT_FIELD


def claim_runs(owner: str, lease_seconds: float, limit: int = 1) -> list[Claim]:
    """Lease up to ``limit`` claimable runs, oldest first, skipping rows others hold
    (``Store.claim_runs``; one statement on PostgreSQL)."""
    return current().claim_runs(owner, lease_seconds, limit)


def claim_run(run_id: RunId, owner: str, lease_seconds: float) -> Claim | None:
    """Lease one given run if it is claimable now (tests, "run now" operations)."""
    return current().claim_run(run_id, owner, lease_seconds)


def renew_leases(
    owner: str, claims: Sequence[Claim], lease_seconds: float, using: object = None
) -> dict[RunId, LeaseLoss]:
    """Renew the leases of ``claims`` (all of one worker, ``owner``) and return the runs whose
    work must stop: cancelled, or no longer this worker's. A run that was not renewed because
    its own slot just finished, parked or released it is not in the answer.

    The store of ``using``'s vendor (a connection wrapper, else the default connection): on
    PostgreSQL this is one statement, even inside a transaction (the heartbeat's)."""
    conn: Any = using or connection
    return dialect_store(conn.vendor).renew_leases(owner, claims, lease_seconds, using)


def renew_lease(claim: Claim) -> bool:
    """Extend the lease; False when the run was cancelled or taken over (stop working on it)."""
    return current().renew_lease(claim)


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
    """Commit one step if, and only if, this claim still holds the run (``Store.append_step``:
    the commit itself is ``PostgresStore.append_step`` or ``PortableStore.append_step``).
    Returns False when the fence failed (nothing appended); ``effects`` are recorded anyway."""
    return current().append_step(
        claim,
        seq,
        kind,
        payload,
        request_id,
        effects,
        finish=finish,
        content_span=content_span,
        tokens=tokens,
        then_claim=then_claim,
    )


def finish_run(claim: Claim, status: str, *, result: str | None = None, error: str = "") -> bool:
    """End the run (succeeded, failed or dead) and free its lease; fenced."""
    return current().finish_run(claim, status, result=result, error=error)


def park_on_intent(
    claim: Claim, intent: ToolIntent, *, new: bool = False, crashed: bool = False
) -> Parked:
    """Park the run as ``waiting`` on ``intent`` (``Store.park_on_intent``)."""
    return current().park_on_intent(claim, intent, new=new, crashed=crashed)


def start_intent_execution(claim: Claim, intent: ToolIntent) -> bool:
    """Mark an approved intent ``executing``, fenced (``Store.start_intent_execution``)."""
    return current().start_intent_execution(claim, intent)


def wake_run(run_id: RunId) -> bool:
    """A parked run becomes claimable again (``Store.wake_run``)."""
    return current().wake_run(run_id)


def release_lease(
    claim: Claim,
    *,
    error: str | None = None,
    count_claim: bool = True,
    hold_seconds: float | None = None,
) -> bool:
    """Hand the run back (pending); fenced (``Store.release_lease``)."""
    return current().release_lease(
        claim, error=error, count_claim=count_claim, hold_seconds=hold_seconds
    )


def current_status(run_id: RunId) -> str | None:
    return current().current_status(run_id)
