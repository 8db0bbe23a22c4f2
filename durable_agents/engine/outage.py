"""A database that goes away for a moment (a restart, a failover to a standby) without the
worker throwing away what it paid for.

A step carries a model turn that was paid for, or the results of tool calls that happened. When
its commit is cut by a lost connection, the worker does not hand the run back (the next claim
would pay for the turn again): it discards the broken connection and commits again on a fresh
one, with a short backoff, for as long as the run's lease can still hold (``LeaseClock``).
That is safe whether or not the first try reached the disk: the fence admits a step only as
``last_seq + 1`` of this claim, and a store recognises its own step when the first try did land
(``Store.append_step`` returns True for it). Only the errors of a lost or unusable connection
are retried (``connection_lost``); a database that refuses what it was given (``DataError``,
``IntegrityError``) would refuse it again.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from django.db import (
    DEFAULT_DB_ALIAS,
    DatabaseError,
    DataError,
    IntegrityError,
    InterfaceError,
    OperationalError,
    connections,
)

logger = logging.getLogger("durable_agents.outage")

T = TypeVar("T")

# SQLSTATEs that say the connection is to a host that can no longer take writes (a primary
# demoted to a standby): the connection is discarded and the next one finds the new primary
# (with target_session_attrs=read-write). read_only_sql_transaction, admin_shutdown,
# crash_shutdown, cannot_connect_now.
READ_ONLY_OR_GOING = frozenset({"25006", "57P01", "57P02", "57P03"})

# The first retry follows at once (the pool may hand out another dead connection), then the
# wait doubles up to MAX_BACKOFF.
FIRST_BACKOFF = 0.05
MAX_BACKOFF = 2.0


def connection_lost(exc: BaseException) -> bool:
    """Whether ``exc`` says the connection was lost or is unusable (a retry on a fresh one may
    succeed), as opposed to the database refusing the statement itself."""
    if isinstance(exc, DataError | IntegrityError):
        return False
    if isinstance(exc, OperationalError | InterfaceError):
        return True
    sqlstate = getattr(exc.__cause__, "sqlstate", None)
    return isinstance(exc, DatabaseError) and sqlstate in READ_ONLY_OR_GOING


def discard_connection(alias: str = DEFAULT_DB_ALIAS) -> None:
    """Drop this thread's connection so that the next statement opens a fresh one. The
    driver's connection is closed first: a pool then discards it instead of handing it out
    again (a connection to a host that went away, or that is read-only now)."""
    wrapper = connections[alias]
    raw = wrapper.connection
    if raw is not None:
        with contextlib.suppress(Exception):  # it is broken already: closing may fail too
            raw.close()
    with contextlib.suppress(Exception):
        wrapper.close()


class LeaseClock:
    """Until when, at the latest, the lease of one claim holds, as this worker knows it: the
    monotonic time at which its last renewal (the claim, a committed step, a heartbeat) was
    sent, plus the lease. Sent, not answered: the database's clock starts the lease when the
    statement runs, which is never earlier."""

    def __init__(self, lease_seconds: float, renewed_at: float | None = None) -> None:
        self.lease_seconds = float(lease_seconds)
        self._renewed_at = time.monotonic() if renewed_at is None else renewed_at
        self._lock = threading.Lock()

    def renewed(self, sent_at: float) -> None:
        """A renewal sent at ``sent_at`` (monotonic) succeeded."""
        with self._lock:
            self._renewed_at = max(self._renewed_at, sent_at)

    @property
    def margin(self) -> float:
        """What is kept in hand before the lease runs out: a quarter of it, at most 5 s."""
        return min(5.0, self.lease_seconds / 4)

    def seconds_left(self) -> float:
        """How long a retry may still go on: until the lease ends, less the margin."""
        with self._lock:
            return self._renewed_at + self.lease_seconds - self.margin - time.monotonic()


def retry_while_leased(
    operation: Callable[[], T],
    *,
    lease: LeaseClock,
    what: str,
    interrupt: threading.Event | None = None,
) -> T:
    """``operation()``, again on a fresh connection each time it fails for a lost connection,
    until it succeeds, the lease is about to run out or ``interrupt`` is set (then the last
    error is raised). ``operation`` must be safe to repeat whether or not a failed try was
    committed: a fenced statement of the claim is."""
    failures = 0
    started = time.monotonic()
    while True:
        try:
            result = operation()
        except DatabaseError as exc:
            if not connection_lost(exc):
                raise
            discard_connection()
            delay = 0.0 if failures == 0 else min(FIRST_BACKOFF * 2 ** (failures - 1), MAX_BACKOFF)
            left = lease.seconds_left()
            if left <= delay or (interrupt is not None and interrupt.is_set()):
                logger.warning(
                    "%s: the database did not come back while the lease held (%d tries in "
                    "%.1fs); giving up",
                    what,
                    failures + 1,
                    time.monotonic() - started,
                )
                raise
            if failures == 0:
                logger.warning(
                    "%s: database connection lost (%s: %s); retrying on a fresh connection "
                    "for up to %.1fs while the lease holds",
                    what,
                    type(exc).__name__,
                    " ".join(str(exc).split())[:300],
                    left,
                )
            failures += 1
            if delay:
                if interrupt is not None:
                    interrupt.wait(delay)
                else:
                    time.sleep(delay)
            continue
        if failures:
            logger.info(
                "%s: done after %d retries (%.1fs without the database)",
                what,
                failures,
                time.monotonic() - started,
            )
        return result
