"""The hub: one per ASGI process (per event loop), it follows every run someone is watching.

    a reader joins a run     -> its own catch-up from the database (``events_after``, read
                                in one batch with every other reader's catching up at the
                                time), then what the hub broadcasts, each event given once
                                (by cursor)
    every POLL seconds       -> one query for every watched run's (last_seq, newest progress,
                                status); for those that moved, one read of what is new in
                                all of them (three statements), broadcast to their readers
    a delta notification     -> (PostgreSQL, streamed agents) broadcast at once, and kept as
                                the text so far of the turn in flight, for readers who join

All the hub's reads go through one thread, so through one database connection whatever the
number of readers, plus one LISTEN connection for deltas. Steps are polled, not notified: a
NOTIFY in every step commit would serialise the workers' commits on PostgreSQL's notification
queue, and a poll every 0.1 s of a few hundred ids costs the database next to nothing.

A reader that does not keep up (its queue is full: a client that stopped reading) is dropped:
the hub never waits for a reader, and no reader ever slows a worker.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, ClassVar, TypeVar

from django.db import DatabaseError, close_old_connections, connection
from django.db.models import Max, OuterRef, Subquery

from durable_agents.live.events import (
    Cursor,
    Event,
    Read,
    RunState,
    delta_event,
    events_after_many,
    within_run,
)
from durable_agents.models import AgentProgress, AgentRun

logger = logging.getLogger("durable_agents.live")

T = TypeVar("T")

# Seconds between two polls of the watched runs.
POLL_SECONDS = 0.1
# Events queued for one reader before it counts as not reading (and is dropped).
QUEUE_SIZE = 2000
# Runs read in one batch of catch-up reads (joining readers), so one statement's rows stay few.
CATCH_UP_RUNS = 25
# The channel workers send deltas on (PostgreSQL).
DELTA_CHANNEL = "durable_agents_live"


# Not a DurableAgentsError: it ends a stream, as StopAsyncIteration would, rather than report a
# failed call (the reader resumes from its last event id); a `except DurableAgentsError` around
# a stream must not take it for one.
class ReaderDropped(Exception):
    """The reader fell too far behind (it stopped reading): its stream ends."""


@dataclasses.dataclass
class _Turn:
    """The text so far of the turn in flight of one run, as its deltas came."""

    seq: int
    attempt: int
    chunks: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Position:
    """A reader's cursor, and whether its stream is over."""

    cursor: Cursor
    over: bool = False


class _Reader:
    def __init__(self) -> None:
        self.queue: asyncio.Queue[Event | None] = asyncio.Queue(QUEUE_SIZE)
        self.dropped = False

    def give(self, event: Event | None) -> bool:
        try:
            self.queue.put_nowait(event)
        except asyncio.QueueFull:
            self.dropped = True
            return False
        return True


class _Watch:
    """A run at least one reader watches: its readers and what the hub has broadcast."""

    def __init__(self) -> None:
        self.readers: set[_Reader] = set()
        self.cursor: Cursor | None = None  # None until a reader's catch-up sets it
        self.turn: _Turn | None = None


class Hub:
    """See the module docstring. ``Hub.current()`` is the hub of the running event loop."""

    _hubs: ClassVar[dict[asyncio.AbstractEventLoop, Hub]] = {}
    _hubs_lock = threading.Lock()

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.watches: dict[uuid.UUID, _Watch] = {}
        # The one thread, so the one connection, the hub reads through.
        self.executor = concurrent.futures.ThreadPoolExecutor(1, "durable_agents-live")
        self.changed = asyncio.Event()
        self.poller: asyncio.Task[None] | None = None
        self.stopping = threading.Event()
        self.listener: threading.Thread | None = None
        # Set while the LISTEN for deltas is in place (tests wait for it).
        self.listening = threading.Event()
        # The catch-up reads joining readers wait for, and the task that reads them.
        self._wanted: dict[tuple[uuid.UUID, Cursor], asyncio.Future[Read | None]] = {}
        self._catching_up: asyncio.Task[None] | None = None

    @classmethod
    def current(cls) -> Hub:
        loop = asyncio.get_running_loop()
        with cls._hubs_lock:
            # The hubs of loops that ended (asyncio.run in a script or a test) stop, so that
            # their thread and connections do not outlive them.
            for ended in [other for other in cls._hubs if other.is_closed()]:
                cls._hubs.pop(ended).close(wait=False)
            hub = cls._hubs.get(loop)
            if hub is None:
                hub = cls._hubs[loop] = Hub(loop)
            return hub

    @classmethod
    def close_all(cls) -> None:
        """Stop every hub (tests; a process exits without it)."""
        with cls._hubs_lock:
            hubs = list(cls._hubs.values())
            cls._hubs.clear()
        for hub in hubs:
            hub.close()

    def close(self, wait: bool = True) -> None:
        """Stop polling and listening, and close both connections (``wait``: before
        returning)."""
        self.stopping.set()
        if self.poller is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.poller.cancel)
        # Looked up on the hub's thread: ``connection`` is that thread's own there.
        self.executor.submit(lambda: connection.close())
        self.executor.shutdown(wait=wait)
        if self.listener is not None and wait:
            self.listener.join(5)

    @property
    def readers(self) -> int:
        return sum(len(w.readers) for w in self.watches.values())

    # -- reading -----------------------------------------------------------------------------

    async def read(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the hub's thread (its database connection)."""
        return await self.loop.run_in_executor(self.executor, _with_fresh_connection, fn, args)

    async def follow(self, run_id: uuid.UUID, cursor: Cursor) -> AsyncIterator[Event]:
        """The run's events after ``cursor`` until it is over; ``LookupError`` for a run that
        does not exist; ``ReaderDropped`` when the reader stopped keeping up."""
        if cursor.progress:
            # Before joining: the first reader's cursor is where the hub's watch starts.
            cursor = await self.read(within_run, run_id, cursor)
        reader = _Reader()
        watch = self._join(run_id, reader)
        at = _Position(cursor)
        try:
            async for event in self._from_database(run_id, at, LookupError, watch):
                yield event
            if at.over:
                return
            # The text so far of the turn in flight, whole; the deltas queued while the reader
            # caught up are part of it, and ``_new_to`` passes them over.
            for event in self._turn_so_far(run_id, watch, at.cursor):
                at.cursor = event.cursor
                yield event
            while not at.over:
                given = await reader.queue.get()
                if reader.dropped:
                    raise ReaderDropped(f"a reader of run {run_id} fell behind")
                if given is None:
                    # The hub lost track (an error): catch up from the database again.
                    async for caught in self._from_database(run_id, at, None, watch):
                        yield caught
                elif _new_to(given, at.cursor):
                    at.cursor = _advanced(at.cursor, given)
                    at.over = given.type == "end"
                    yield given
        finally:
            self._leave(run_id, reader)

    async def _from_database(
        self,
        run_id: uuid.UUID,
        at: _Position,
        missing: type[Exception] | None,
        watch: _Watch,
    ) -> AsyncIterator[Event]:
        """Catch ``at`` up from the database, in batches; a run that is gone raises
        ``missing``, or ends the stream when that is None. The first reader of a run sets
        where the hub's broadcasts start, as soon as it is caught up (before it has read
        what it caught up with, however slowly it reads)."""
        while True:
            read = await self._catch_up(run_id, at.cursor)
            if read is None:
                if missing is not None:
                    raise missing(f"no run {run_id}")
                at.over = True
                return
            at.cursor, at.over = read.cursor, read.over
            if not read.more and watch.cursor is None:
                watch.cursor = read.cursor
            for event in read.events:
                yield event
            if not read.more:
                return

    async def _catch_up(self, run_id: uuid.UUID, cursor: Cursor) -> Read | None:
        """``events_after(run_id, cursor)``, read together with the other readers' catch-ups
        waiting at the same time: one batch of statements for all the runs being caught up
        (``events_after_many``), and one read for all the readers of a run at one cursor (ten
        thousand readers joining one run from its start read it once)."""
        wanted = (run_id, cursor)
        future = self._wanted.get(wanted)
        if future is None:
            future = self._wanted[wanted] = self.loop.create_future()
            # A reader that went away leaves the read to the others; nobody else need look.
            future.add_done_callback(_retrieve)
            if self._catching_up is None or self._catching_up.done():
                self._catching_up = self.loop.create_task(self._read_wanted())
        return await asyncio.shield(future)

    async def _read_wanted(self) -> None:
        """Read what the joining readers wait for, a batch of runs at a time (one cursor per
        run in a batch; a run wanted at two cursors waits for the next batch)."""
        while self._wanted:
            batch: dict[uuid.UUID, Cursor] = {}
            for run_id, cursor in self._wanted:
                if run_id not in batch and len(batch) < CATCH_UP_RUNS:
                    batch[run_id] = cursor
            futures = {run_id: self._wanted.pop((run_id, c)) for run_id, c in batch.items()}
            try:
                reads = await self.read(events_after_many, batch)
            except Exception as exc:  # noqa: BLE001 - each waiting reader gets the error
                for future in futures.values():
                    if not future.done():
                        future.set_exception(exc)
                continue
            for run_id, future in futures.items():
                if not future.done():
                    future.set_result(reads[run_id])

    def _join(self, run_id: uuid.UUID, reader: _Reader) -> _Watch:
        watch = self.watches.get(run_id)
        if watch is None:
            watch = self.watches[run_id] = _Watch()
        watch.readers.add(reader)
        if self.poller is None or self.poller.done():
            self.poller = self.loop.create_task(self._poll())
        self._listen()
        self.changed.set()
        return watch

    def _leave(self, run_id: uuid.UUID, reader: _Reader) -> None:
        watch = self.watches.get(run_id)
        if watch is None:
            return
        watch.readers.discard(reader)
        if not watch.readers:
            del self.watches[run_id]

    @staticmethod
    def _turn_so_far(run_id: uuid.UUID, watch: _Watch, cursor: Cursor) -> list[Event]:
        """The deltas of the turn in flight a joining reader has not had."""
        turn = watch.turn
        if turn is None or turn.seq != cursor.seq + 1:
            return []
        start = cursor.chunks if turn.attempt == cursor.attempt else 0
        at = cursor
        out = []
        for n in range(start, len(turn.chunks)):
            event = delta_event(run_id, at, turn.seq, turn.attempt, n, turn.chunks[n])
            at = event.cursor
            out.append(event)
        return out

    # -- the poll ----------------------------------------------------------------------------

    async def _poll(self) -> None:
        while not self.stopping.is_set():
            # Polls start POLL_SECONDS apart (not POLL_SECONDS after the previous one ended):
            # a step waits at most one interval for the poll that finds it.
            started = self.loop.time()
            try:
                await self._poll_once()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.warning("live: polling the watched runs failed", exc_info=True)
                for watch in self.watches.values():
                    for reader in watch.readers:
                        reader.give(None)  # each reader catches up on its own
            if not self.watches:
                return
            idle = POLL_SECONDS - (self.loop.time() - started)
            if idle > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.changed.wait(), idle)
            self.changed.clear()

    async def _poll_once(self) -> None:
        watched = {run_id: w for run_id, w in self.watches.items() if w.cursor is not None}
        if not watched:
            return
        states = await self.read(_states, list(watched))
        moved: dict[uuid.UUID, Cursor] = {}
        for run_id, watch in watched.items():
            state = states.get(run_id)
            cursor = watch.cursor
            if cursor is not None and (state is None or state.ahead_of(cursor)):
                moved[run_id] = cursor
        if not moved:
            return
        # What is new in every run that moved: three statements, however many moved.
        reads = await self.read(events_after_many, moved)
        for run_id, cursor in moved.items():
            watch = watched[run_id]
            read = reads[run_id]
            if read is None:
                events, over = [Event("end", {"status": "deleted"}, cursor, run_id)], True
            else:
                events, watch.cursor, over = read.events, read.cursor, read.over
            if watch.turn is not None and watch.cursor and watch.turn.seq <= watch.cursor.seq:
                watch.turn = None  # committed: its step supersedes the deltas
            self._broadcast(run_id, watch, events)
            if over:
                watch.readers.clear()
                if self.watches.get(run_id) is watch:
                    del self.watches[run_id]

    def _broadcast(self, run_id: uuid.UUID, watch: _Watch, events: list[Event]) -> None:
        for reader in list(watch.readers):
            for event in events:
                if not reader.give(event):
                    watch.readers.discard(reader)
                    logger.info("live: dropped a reader of run %s that stopped reading", run_id)
                    break

    # -- deltas ------------------------------------------------------------------------------

    def _listen(self) -> None:
        if self.listener is not None or connection.vendor != "postgresql":
            return
        self.listener = threading.Thread(
            target=self._serve_deltas, name="durable_agents-live-listen", daemon=True
        )
        self.listener.start()

    def _serve_deltas(self) -> None:
        from durable_agents._internal.db import dedicated

        while not self.stopping.is_set():
            wrapper = dedicated()
            try:
                wrapper.ensure_connection()
                raw = wrapper.connection
                raw.execute(f"LISTEN {DELTA_CHANNEL}")
                self.listening.set()
                while not self.stopping.is_set():
                    for notify in raw.notifies(timeout=0.5):
                        self.loop.call_soon_threadsafe(self._on_delta, notify.payload)
            except Exception as exc:  # noqa: BLE001 - deltas are best effort; steps still come
                self.listening.clear()
                logger.warning("live: LISTEN for deltas failed (%s); retrying", exc)
                self.stopping.wait(2)
            finally:
                with contextlib.suppress(Exception):
                    wrapper.close()

    def _on_delta(self, payload: str) -> None:
        try:
            data = json.loads(payload)
            run_id = uuid.UUID(data["r"])
            seq, attempt, n, text = int(data["s"]), int(data["a"]), int(data["n"]), data["t"]
        except (ValueError, KeyError, TypeError):
            return
        watch = self.watches.get(run_id)
        if watch is None or watch.cursor is None or seq != watch.cursor.seq + 1:
            return
        turn = watch.turn
        if turn is None or (turn.seq, turn.attempt) != (seq, attempt) or n == 0:
            if n != 0:
                return  # the start of this attempt's text was missed: wait for its step
            turn = watch.turn = _Turn(seq, attempt)
        if n != len(turn.chunks):
            return  # out of order or repeated
        turn.chunks.append(str(text))
        event = delta_event(
            run_id,
            dataclasses.replace(watch.cursor, attempt=attempt, chunks=n),
            seq,
            attempt,
            n,
            turn.chunks[-1],
        )
        self._broadcast(run_id, watch, [event])


def _retrieve(future: asyncio.Future[Any]) -> None:
    """Mark a catch-up read's error as seen: its readers may all have gone away."""
    if not future.cancelled():
        future.exception()


def _new_to(event: Event, cursor: Cursor) -> bool:
    """Whether a broadcast event is one the reader has not had."""
    at = event.cursor
    if event.type == "step":
        return at.seq > cursor.seq
    if event.type == "progress":
        return at.progress > cursor.progress
    if event.type == "status":
        return at.status != cursor.status.lower()
    if event.type == "delta":
        seq = event.data["seq"]
        if seq != cursor.seq + 1:
            return False
        n, attempt = int(event.data["n"]), int(event.data["attempt"])
        if attempt != cursor.attempt:
            return n == 0 and attempt > cursor.attempt  # a new attempt's text starts over
        return n == cursor.chunks  # the next chunk, never one twice
    return not cursor.status.isupper()  # end, once


def _advanced(cursor: Cursor, event: Event) -> Cursor:
    """The reader's cursor after ``event`` (only the event's own dimension moves)."""
    at = event.cursor
    if event.type == "step":
        return dataclasses.replace(cursor, seq=at.seq, attempt=0, chunks=0)
    if event.type == "progress":
        return dataclasses.replace(cursor, progress=at.progress)
    if event.type == "status":
        return dataclasses.replace(cursor, status=at.status)
    if event.type == "delta":
        return dataclasses.replace(cursor, attempt=at.attempt, chunks=at.chunks)
    return dataclasses.replace(cursor, status=at.status)  # end


def _states(run_ids: list[uuid.UUID]) -> dict[uuid.UUID, RunState]:
    """Every watched run's (last_seq, newest progress message, status): one query."""
    newest = (
        AgentProgress.objects.filter(run_id=OuterRef("pk"))
        .order_by()
        .values("run_id")
        .annotate(newest=Max("id"))
        .values("newest")
    )
    rows = (
        AgentRun.objects.filter(pk__in=run_ids)
        .annotate(progress=Subquery(newest))
        .values_list("pk", "last_seq", "progress", "status")
    )
    return {
        pk: RunState(last_seq, progress or 0, status) for pk, last_seq, progress, status in rows
    }


def _with_fresh_connection(fn: Callable[..., T], args: tuple[Any, ...]) -> T:
    """``fn(*args)`` after dropping a connection that broke or outlived CONN_MAX_AGE; a
    database error closes it, so the next read starts on a new one."""
    close_old_connections()
    try:
        return fn(*args)
    except DatabaseError:
        connection.close()
        raise
