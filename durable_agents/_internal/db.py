"""Database connections of a worker process: the small shared pool, and the two connections
that live outside it (the heartbeat's and the listener's).

A run spends its life waiting on the model; a commit takes a millisecond. So a worker never
keeps a connection across a model or tool call: ``release()`` hands the thread's connection
back to the pool before every such wait, and the next statement takes one again. On
PostgreSQL ``runagents`` turns on Django's own connection pool (``OPTIONS["pool"]``, psycopg's
``ConnectionPool``) with at most ``DB_POOL_SIZE`` connections, so one process holding a
thousand runs in flight uses at most ``DB_POOL_SIZE`` (default 8) connections in all:

    the heartbeat (1)                    one statement per beat for every run held
    the listener (1)                     LISTEN for new runs, wake-ups and cancellations
    the pool (the rest: 6 by default)    claims, step commits, tool code's ORM queries

The heartbeat has its own connection so that a pool drained by slow tool code can never
delay the renewal of the leases. Without a pool (SQLite, or a worker inside a test's process)
``release()`` does nothing and each thread keeps its connection, as Django always does.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from django.db import DEFAULT_DB_ALIAS, connections

logger = logging.getLogger("durable_agents.db")

# The channel of every notification durable_agents sends (see migration 0003's trigger).
CHANNEL = "durable_agents"


def pooled(alias: str = DEFAULT_DB_ALIAS) -> bool:
    """Whether connections of ``alias`` come from a pool in this process."""
    return connections[alias].vendor == "postgresql" and bool(
        connections.settings[alias].get("OPTIONS", {}).get("pool")
    )


def statement_pool_size(total: int, listening: bool) -> int:
    """The pool's share of a worker's ``total`` connections: what the heartbeat and the
    listener do not hold (at least one)."""
    return max(1, total - 1 - (1 if listening else 0))


def use_pool(size: int, alias: str = DEFAULT_DB_ALIAS) -> bool:
    """Make every thread of this process take its ``alias`` connections from one pool of at
    most ``size`` (PostgreSQL only; returns False elsewhere). Call it before any worker thread
    connects. Pool options the project already set are kept, but ``max_size``."""
    settings_dict = connections.settings[alias]
    if not settings_dict["ENGINE"].endswith("postgresql"):
        return False
    try:
        import psycopg_pool  # noqa: F401 - only whether it is installed
    except ImportError:
        logger.warning(
            "psycopg_pool is not installed (pip install 'psycopg[pool]'): every worker thread "
            "keeps its own database connection"
        )
        return False
    options = settings_dict.setdefault("OPTIONS", {})
    pool = options.get("pool")
    pool = dict(pool) if isinstance(pool, dict) else {}
    pool["max_size"] = size
    # The project's min_size is kept unless it is over the pool's size (which psycopg refuses).
    pool["min_size"] = min(pool.get("min_size", 2), size)
    # How long a statement may wait for a free connection before it fails like any database
    # error (the run is handed back, the worker goes on).
    pool.setdefault("timeout", 60.0)
    options["pool"] = pool
    # Django refuses persistent connections with a pool: the pool is what persists them.
    settings_dict["CONN_MAX_AGE"] = 0
    # The main thread's connection was opened before (the start-up checks): close it so the
    # next one comes from the pool.
    existing = connections[alias]
    if existing.connection is not None and not existing.in_atomic_block:
        existing.close()
    skip_check_when_just_released(getattr(existing, "pool", None))
    return True


# A connection that ``release()`` handed back less than this long ago goes out again without
# the pool's health check (CONN_HEALTH_CHECKS). A busy worker hands its few connections back
# and forth between slots every few milliseconds, and the check is a round trip each time (it
# was a quarter of the statements of a resumed run). A connection that died within that
# moment fails its next statement like any connection lost mid-use: the commit is tried again
# on a fresh one (engine/outage.py), a failed claim again at the next poll or notification.
# Longer pauses (a worker waiting on the model, a database back from a restart) keep the check.
JUST_RELEASED_SECONDS = 0.5


class _CheckUnlessJustReleased:
    """The pool's ``check``, skipped for a connection ``release()`` handed back within
    JUST_RELEASED_SECONDS that is idle and not known to be broken."""

    def __init__(self, check: Any) -> None:
        from psycopg.pq import TransactionStatus  # a pool is PostgreSQL's: psycopg is there

        self.check = check
        self.idle = TransactionStatus.IDLE
        self.released: dict[int, float] = {}  # id(driver connection) -> when release() gave it

    def __call__(self, conn: Any) -> None:
        released = self.released.pop(id(conn), None)
        if (
            released is not None
            and time.monotonic() - released < JUST_RELEASED_SECONDS
            and not conn.broken
            and conn.info.transaction_status == self.idle
        ):
            return
        self.check(conn)


def skip_check_when_just_released(pool: Any) -> None:
    """Wrap the health check of Django's pool (psycopg_pool keeps it as ``_check``; when it
    has none, CONN_HEALTH_CHECKS is off and there is nothing to skip)."""
    check = getattr(pool, "_check", None)
    if callable(check) and not isinstance(check, _CheckUnlessJustReleased):
        pool._check = _CheckUnlessJustReleased(check)


def _note_release(conn: Any) -> None:
    """Before ``conn`` (Django's wrapper) hands its driver connection back to the pool."""
    check = getattr(getattr(conn, "pool", None), "_check", None)
    if isinstance(check, _CheckUnlessJustReleased):
        check.released[id(conn.connection)] = time.monotonic()


def release(alias: str = DEFAULT_DB_ALIAS) -> None:
    """Give this thread's connection back to the pool, if there is one and no transaction is
    open on it. Cheap: no round trip."""
    conn = connections[alias]
    if conn.connection is None or conn.in_atomic_block:
        return
    if conn.vendor == "postgresql" and conn.settings_dict.get("OPTIONS", {}).get("pool"):
        _note_release(conn)
        conn.close()


def dedicated(alias: str = DEFAULT_DB_ALIAS, **overrides: Any) -> Any:
    """A new Django ``DatabaseWrapper`` for ``alias`` outside the pool (its own connection, for
    one thread), with ``overrides`` of the DATABASES entry (e.g. {"PORT": 5432} to go
    around a transaction pooler)."""
    base = connections.settings[alias]
    settings_dict = {**base, **overrides, "CONN_MAX_AGE": 0}
    options = {k: v for k, v in (base.get("OPTIONS") or {}).items() if k != "pool"}
    options.update(overrides.get("OPTIONS") or {})
    settings_dict["OPTIONS"] = options
    backend = type(connections[alias])
    return backend(settings_dict, alias)


class Listener:
    """The one LISTEN connection of a worker (PostgreSQL). ``on_run`` is called when a run may
    have become claimable (created, woken, handed back); ``on_cancel(run_id)`` when a run was
    cancelled; ``on_inbox(run_id)`` when a message was queued for a run. Polling stays the
    fallback: while the listener is down (database restart, a transaction pooler that cannot
    LISTEN) the worker still claims every POLL_INTERVAL, and after a reconnection it calls
    ``on_run`` once, for what it may have missed. ``generation`` counts the connections that
    listened: what was heard on one says nothing of what was sent before the next listened."""

    def __init__(
        self,
        on_run: Any,
        on_cancel: Any,
        stopping: Any,
        *,
        on_message: Any = None,
        on_inbox: Any = None,
        alias: str = DEFAULT_DB_ALIAS,
        overrides: dict[str, Any] | None = None,
        retry_seconds: float = 2.0,
    ) -> None:
        self.on_run = on_run
        self.on_cancel = on_cancel
        # ``on_message(run_id)``: a message asks to interrupt the run's model call.
        self.on_message = on_message
        # ``on_inbox(run_id)``: a message was queued for the run (any policy).
        self.on_inbox = on_inbox
        self.stopping = stopping
        self.alias = alias
        self.overrides = overrides or {}
        self.retry_seconds = retry_seconds
        # Set once LISTEN has been executed (tests and the bench wait for it).
        self.listening = threading.Event()
        # Incremented before ``listening`` is set, on every connection that listens.
        self.generation = 0

    def serve(self) -> None:
        failures = 0
        while not self.stopping.is_set():
            wrapper = dedicated(self.alias, **self.overrides)
            try:
                wrapper.ensure_connection()
                raw = wrapper.connection
                raw.execute(f"LISTEN {CHANNEL}")
                if failures:
                    logger.info("listening for notifications again")
                    self.on_run()  # a run may have been created while we were deaf
                failures = 0
                self.generation += 1
                self.listening.set()
                while not self.stopping.is_set():
                    for notify in raw.notifies(timeout=0.5):
                        self._dispatch(notify.payload)
            except Exception as exc:  # noqa: BLE001 - the listener must never end the worker
                self.listening.clear()
                failures += 1
                (logger.warning if failures == 1 else logger.debug)(
                    "LISTEN connection failed (%s: %s); polling meanwhile, reconnecting",
                    type(exc).__name__,
                    " ".join(str(exc).split()),
                )
                self.stopping.wait(self.retry_seconds)
            finally:
                try:
                    wrapper.close()
                except Exception:  # a failed close is only worth a debug line
                    logger.debug("closing the LISTEN connection failed", exc_info=True)

    def _dispatch(self, payload: str) -> None:
        kind, _, run_id = payload.partition(":")
        if kind == "cancel" and run_id:
            self.on_cancel(run_id)
        elif kind == "inbox" and run_id:
            if self.on_inbox is not None:
                self.on_inbox(run_id)
        elif kind == "message" and run_id:
            # An interrupt is sent after its message, which the trigger announced already;
            # heard here too, in case this process's listener connected in between.
            if self.on_inbox is not None:
                self.on_inbox(run_id)
            if self.on_message is not None:
                self.on_message(run_id)
        else:
            self.on_run()
