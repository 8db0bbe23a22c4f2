"""Waiting for a run to end: ``get_result`` and ``aget_result``, one service per process.

    a waiter arrives         -> registered for its run, then one read of the run: if it has
                                ended already, it is returned at once
    PostgreSQL               -> one LISTEN connection per process on ``durable_agents_end``:
                                the trigger of migration 0033 sends the run's id when a run
                                ends (at commit); the ids that arrive together are read in one
                                query and handed to their waiters; after each (re)connection,
                                one query for every run waited on (an end sent while nobody
                                listened is lost)
    other databases          -> one query every POLL_SECONDS for every run waited on
    a waiter wakes           -> with the run the service read for it, and returns it; on
                                timeout it leaves and raises ``ResultTimeout``, and the run is
                                left alone

However many waiters, the service costs one connection and, on PostgreSQL, no query while
nothing ends and one per batch of ends, never one per waiter. A waiter holds no connection
while it waits: a sync caller's is closed before the wait unless a transaction holds it, an
async caller's reads go through Django's executor. The service's thread starts with the
first waiter and stops, closing its connections, once nobody has waited for IDLE_SECONDS.

A run "ends" when it reaches one of ``ENDED_STATUSES``: succeeded, failed, cancelled, or the
dead letter (a dead run may be requeued later: wait for it again after a requeue).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import math
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from django.db import DEFAULT_DB_ALIAS, close_old_connections, connection, connections

from durable_agents.conf import app_settings
from durable_agents.exceptions import InvalidArgument, ResultTimeout, RunNotFound
from durable_agents.models import AgentRun
from durable_agents.models.runs import ENDED_STATUSES

logger = logging.getLogger("durable_agents.results")

__all__ = [
    "END_CHANNEL",
    "ResultService",
    "aget_result",
    "close_services",
    "get_result",
    "service",
]

# The channel the end trigger notifies on (migration 0033), apart from the workers' channel so
# that no worker wakes because a run ended.
END_CHANNEL = "durable_agents_end"
# Seconds between two polls where the database cannot notify (SQLite), and while the
# PostgreSQL listener is down.
POLL_SECONDS = 0.05
# Seconds the service keeps its thread and connection after its last waiter left.
IDLE_SECONDS = 30.0
# Seconds between attempts to listen again after the LISTEN connection failed.
RETRY_SECONDS = 1.0
# Run ids per query of the runs waited on (bound parameters of one statement).
IDS_PER_QUERY = 2000


# -- waiters ---------------------------------------------------------------------------------


class _Waiter:
    """One caller waiting for one run: a thread's event, or an event loop's future."""

    __slots__ = ("event", "future", "loop", "run")

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.loop = loop
        self.run: AgentRun | None = None  # the ended run, read by the service for its waiters
        self.event = threading.Event() if loop is None else None
        self.future: asyncio.Future[None] | None = None if loop is None else loop.create_future()

    def wake(self, run: AgentRun) -> None:
        self.run = copy.copy(run)  # each waiter its own instance of the one row read
        if self.event is not None:
            self.event.set()
        elif self.loop is not None and self.future is not None:
            with contextlib.suppress(RuntimeError):  # its loop closed: nobody waits any more
                self.loop.call_soon_threadsafe(_resolve, self.future)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


# -- what tells the service that runs ended --------------------------------------------------


class _EndSource(Protocol):
    """How one database tells the service which runs may have ended."""

    def open(self) -> None:
        """Get ready (connect, listen); raises on failure."""

    def next_ends(self, timeout: float) -> Iterable[uuid.UUID] | None:
        """Waits up to ``timeout`` seconds: the ids of runs that ended, or None for "any may
        have ended: look at every run waited on"."""

    def close(self) -> None: ...


class _Notified:
    """PostgreSQL: ``LISTEN durable_agents_end`` on a connection of its own."""

    def __init__(self, alias: str) -> None:
        self.alias = alias
        self.wrapper: Any = None
        self.fresh = False

    def open(self) -> None:
        from durable_agents._internal.db import dedicated

        # The LISTEN setting's overrides, as for the workers' listener (e.g. around PgBouncer
        # in transaction mode, which cannot LISTEN).
        setting = app_settings.LISTEN
        self.wrapper = dedicated(self.alias, **(setting if isinstance(setting, dict) else {}))
        self.wrapper.ensure_connection()
        self.wrapper.connection.execute(f"LISTEN {END_CHANNEL}")
        self.fresh = True  # ends sent before LISTEN were not heard: look at every run once

    def next_ends(self, timeout: float) -> Iterable[uuid.UUID] | None:
        if self.fresh:
            self.fresh = False
            return None
        ends = []
        # Consumed whole: the generator stops after the packet that holds the first
        # notification, having given every notification of that packet.
        for notify in list(self.wrapper.connection.notifies(timeout=timeout, stop_after=1)):
            with contextlib.suppress(ValueError):
                ends.append(uuid.UUID(notify.payload))
        return ends

    def close(self) -> None:
        if self.wrapper is not None:
            with contextlib.suppress(Exception):
                self.wrapper.close()
            self.wrapper = None


class _Polled:
    """Databases without notifications: every run waited on is looked at every POLL_SECONDS."""

    def __init__(self, alias: str) -> None:
        self.alias = alias

    def open(self) -> None:
        pass

    def next_ends(self, timeout: float) -> Iterable[uuid.UUID] | None:
        time.sleep(min(timeout, POLL_SECONDS))
        return None

    def close(self) -> None:
        pass


_SOURCES: dict[str, Callable[[str], _EndSource]] = {"postgresql": _Notified}


# -- the service -----------------------------------------------------------------------------


class ResultService:
    """The process's waiters by run, and the one thread that wakes them."""

    def __init__(self, alias: str = DEFAULT_DB_ALIAS) -> None:
        self.alias = alias
        self.lock = threading.Lock()
        self.waiting: dict[uuid.UUID, set[_Waiter]] = {}
        self.thread: threading.Thread | None = None
        self.idle_since = time.monotonic()
        # Queries the service itself sent (the runs waited on); tests and the bench read it.
        self.queries = 0
        # Set while the source is open (PostgreSQL: LISTEN executed); tests wait for it.
        self.ready = threading.Event()
        self.stopping = threading.Event()

    # -- the callers' side

    def join(self, run_id: uuid.UUID, waiter: _Waiter) -> None:
        with self.lock:
            self.waiting.setdefault(run_id, set()).add(waiter)
            if self.thread is None or not self.thread.is_alive():
                self.ready.clear()
                self.thread = threading.Thread(
                    target=self._serve, name="durable_agents-results", daemon=True
                )
                self.thread.start()

    def leave(self, run_id: uuid.UUID, waiter: _Waiter) -> None:
        with self.lock:
            waiters = self.waiting.get(run_id)
            if waiters is not None:
                waiters.discard(waiter)
                if not waiters:
                    del self.waiting[run_id]
            if not self.waiting:
                self.idle_since = time.monotonic()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread now and close its connections (tests, a process shutting down);
        the next waiter starts it again."""
        with self.lock:
            thread = self.thread
            self.stopping.set()
        if thread is not None:
            thread.join(timeout)
        with self.lock:
            self.stopping.clear()
            if self.thread is thread:
                self.thread = None

    def waiters(self) -> int:
        with self.lock:
            return sum(len(w) for w in self.waiting.values())

    # -- the thread's side

    def _wake(self, runs: Iterable[AgentRun]) -> None:
        with self.lock:
            for run in runs:
                for waiter in self.waiting.pop(run.pk, ()):
                    waiter.wake(run)
            if not self.waiting:
                self.idle_since = time.monotonic()

    def _ended(self, run_ids: Iterable[uuid.UUID] | None) -> list[AgentRun]:
        """Of ``run_ids`` (None: every run waited on), those waited on that have ended, read
        whole for their waiters: one query per IDS_PER_QUERY runs, whatever the number of
        waiters."""
        with self.lock:
            wanted = [
                r for r in (self.waiting if run_ids is None else run_ids) if r in self.waiting
            ]
        ended: list[AgentRun] = []
        for start in range(0, len(wanted), IDS_PER_QUERY):
            batch = wanted[start : start + IDS_PER_QUERY]
            self.queries += 1
            ended.extend(
                AgentRun.objects.using(self.alias).filter(pk__in=batch, status__in=ENDED_STATUSES)
            )
        return ended

    def _idle(self) -> bool:
        with self.lock:
            if self.stopping.is_set():
                return True
            if self.waiting or time.monotonic() - self.idle_since < IDLE_SECONDS:
                return False
            if self.thread is threading.current_thread():
                self.thread = None  # the next waiter starts a new thread
            return True

    def _serve(self) -> None:
        vendor = connections[self.alias].vendor if app_settings.LISTEN is not False else ""
        source = _SOURCES.get(vendor, _Polled)(self.alias)
        fallback = _Polled(self.alias)
        try:
            while not self._idle():
                try:
                    source.open()
                except Exception as exc:  # noqa: BLE001 - waiters are served by polling meanwhile
                    logger.warning("results: cannot listen for run ends (%s); polling", exc)
                    self._serve_with(fallback, until=time.monotonic() + RETRY_SECONDS)
                    continue
                self.ready.set()
                try:
                    self._serve_with(source, until=math.inf)
                    return
                except Exception as exc:  # noqa: BLE001 - a dead connection: listen again
                    logger.warning("results: lost the connection for run ends (%s)", exc)
                    self.ready.clear()
                finally:
                    source.close()
        finally:
            self.ready.clear()
            with contextlib.suppress(Exception):
                connection.close()  # this thread's ORM connection (the queries above)

    def _serve_with(self, source: _EndSource, until: float) -> None:
        while time.monotonic() < until:
            if self._idle():
                return
            ends = source.next_ends(timeout=0.5)
            if ends is None or ends:
                close_old_connections()
                self._wake(self._ended(ends))


_services: dict[tuple[int, str], ResultService] = {}
_services_lock = threading.Lock()


def service(alias: str = DEFAULT_DB_ALIAS) -> ResultService:
    """This process's service (a new one after a fork: threads do not survive it)."""
    key = (os.getpid(), alias)
    with _services_lock:
        found = _services.get(key)
        if found is None:
            found = _services[key] = ResultService(alias)
        return found


def close_services() -> None:
    """Stop every service of this process (their threads and connections): for tests, whose
    database is dropped at the end, and for a process that shuts down."""
    with _services_lock:
        found = list(_services.values())
    for each in found:
        each.stop()


# -- the API ---------------------------------------------------------------------------------


def _run_id(run_id: object) -> uuid.UUID:
    if isinstance(run_id, uuid.UUID):
        return run_id
    if isinstance(run_id, str):
        with contextlib.suppress(ValueError):
            return uuid.UUID(run_id)
    raise InvalidArgument(f"{str(run_id)[:100]!r} is not a run id (a UUID)")


def _timeout(timeout: object) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or math.isnan(timeout):
        raise InvalidArgument(f"timeout is a number of seconds or None, not {timeout!r}")
    if timeout < 0:
        raise InvalidArgument(f"timeout cannot be negative ({timeout})")
    return float(timeout)


def _ended(run_id: uuid.UUID) -> AgentRun | None:
    """The run if it has ended, None if it has not; RunNotFound if there is no such run."""
    run = AgentRun.objects.filter(pk=run_id).first()
    if run is None:
        raise RunNotFound(f"there is no run {run_id}")
    return run if run.status in ENDED_STATUSES else None


def _let_go_of_the_connection() -> None:
    """Close this thread's connection before a wait that may be long (it opens again at the
    next query), unless a transaction holds it: a thousand threads waiting must not hold a
    thousand connections."""
    if not connection.in_atomic_block:
        connection.close()


def get_result(run_id: uuid.UUID | str, timeout: float | None = None) -> AgentRun:
    """Wait until the run has ended and return it (``.status``, ``.result``, ``.output``,
    ``.error``): succeeded, failed, cancelled, or dead-lettered. ``timeout`` (seconds; None:
    no limit) raises ``ResultTimeout`` when it passes first, leaving the run alone.
    ``InvalidArgument`` for an id that is not a UUID or a bad timeout, ``RunNotFound`` for no
    such run. The wait holds no database connection and sends no query: one service per
    process watches every run waited on (the calling thread's connection is closed before
    the wait, unless a transaction holds it; the next query opens it again)."""
    wanted, limit = _run_id(run_id), _timeout(timeout)
    watcher = service()
    waiter = _Waiter()
    watcher.join(wanted, waiter)  # before the read: an end right after it is not missed
    try:
        run = _ended(wanted)
        if run is not None:
            return run
        _let_go_of_the_connection()
        if not waiter.event.wait(limit):  # type: ignore[union-attr]
            raise ResultTimeout(f"run {wanted} had not ended after {limit:g} s")
    finally:
        watcher.leave(wanted, waiter)
    assert waiter.run is not None, "woken without its run"
    return waiter.run


async def aget_result(run_id: uuid.UUID | str, timeout: float | None = None) -> AgentRun:
    """``get_result`` for async code: the caller's event loop is free while it waits, and a
    cancelled task stops waiting."""
    from asgiref.sync import sync_to_async

    wanted, limit = _run_id(run_id), _timeout(timeout)
    watcher = service()
    waiter = _Waiter(asyncio.get_running_loop())
    watcher.join(wanted, waiter)
    try:
        run = await sync_to_async(_ended)(wanted)
        if run is not None:
            return run
        assert waiter.future is not None
        try:
            await asyncio.wait_for(waiter.future, limit)
        except TimeoutError:
            raise ResultTimeout(f"run {wanted} had not ended after {limit:g} s") from None
    finally:
        watcher.leave(wanted, waiter)
    assert waiter.run is not None, "woken without its run"
    return waiter.run
