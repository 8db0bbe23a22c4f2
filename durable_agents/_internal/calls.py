"""Calls a worker slot can walk away from: model calls and tool calls.

The slot hands each call to its *caller thread* and waits for whichever comes first: the
call's outcome, the run's interrupt (cancelled, lease lost, shutdown), or the call's timeout.
A call that is walked away from is told so (its ``abort`` event, which streamed model calls
check) and left to finish on its own; the slot gets a fresh caller thread and is free at once.
That is what bounds a hung tool by its timeout and lets a cancellation free the slot within a
heartbeat, whatever the call is doing.

The caller thread is reused across calls (starting a thread per call costs more than a local
round trip). Whatever the call raises, ``BaseException`` included, is handed to the slot:
``SystemExit`` in tool code ends neither the caller thread silently nor the worker.

Before waiting, the slot gives its database connection back to the pool (``db.release``): a
connection is never held across a model or tool call. Plain ``def`` tools take one of
``TOOL_THREADS`` permits for as long as they really run (an abandoned call keeps its permit
until it ends), and the caller thread gives back whatever connection the tool's ORM code
took. ``async def`` tools are awaited on one event loop thread (``await_abortable``); walking
away from one cancels it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import logging
import queue
import threading
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

from durable_agents._internal import db
from durable_agents._internal.interrupt import Interrupt
from durable_agents.conf import app_settings

logger = logging.getLogger("durable_agents.calls")

T = TypeVar("T")


# CallInterrupted and CallTimedOut are not DurableAgentsErrors: they are the call thread's
# news to the dispatcher, which turns them into the run's interruption or the tool's error
# result; no caller of ours ever sees them.
class CallInterrupted(Exception):
    """The run was interrupted while the call was in flight; the call was walked away from."""


class CallTimedOut(Exception):
    """The call took longer than its timeout; it was walked away from."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"no answer within {seconds:g}s")
        self.seconds = seconds


class _Caller:
    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self.abandoned = False
        threading.Thread(target=self._serve, name="da-caller", daemon=True).start()

    def _serve(self) -> None:
        try:
            while (job := self.jobs.get()) is not None:
                job()
                # Tool code may have used the ORM: its connection goes back to the pool now,
                # not when this thread next runs a tool.
                db.release()
                if self.abandoned:
                    return  # its slot has a new caller; this thread was only finishing a call
        finally:
            _close_database_connections()


def _close_database_connections() -> None:
    # Tool code may have used the ORM on this thread; its connections are this thread's own.
    try:
        from django.db import connections

        connections.close_all()
    except Exception:  # a thread that ends must not fail on its way out
        logger.debug("closing a caller thread's database connections failed", exc_info=True)


_callers = threading.local()


@contextlib.contextmanager
def inline_calls() -> Iterator[None]:
    """Inside, calls run on the calling thread itself, with its database connection: for
    ``durable_agents.testing``, where tool code must see the test's open transaction (a
    thread of its own would have a connection of its own). Timeouts and interrupts are not
    enforced there: a call simply runs to its end."""
    previous = getattr(_callers, "inline", False)
    _callers.inline = True
    try:
        yield
    finally:
        _callers.inline = previous


def _inline() -> bool:
    return bool(getattr(_callers, "inline", False))


def close_caller() -> None:
    """End this thread's caller thread (a worker slot calls it when it stops)."""
    caller: _Caller | None = getattr(_callers, "caller", None)
    if caller is not None:
        caller.jobs.put(None)
        _callers.caller = None


def run_abortable(
    call: Callable[[threading.Event], T],
    interrupt: Interrupt,
    *,
    timeout: float | None = None,
    meanwhile: Callable[[], None] | None = None,
    permits: threading.Semaphore | None = None,
    meanwhile_after: float | None = None,
) -> T:
    """Run ``call(abort)`` on this thread's caller thread and return its value or raise what it
    raised. Raises ``CallInterrupted`` as soon as ``interrupt`` triggers and ``CallTimedOut``
    after ``timeout`` seconds; either way ``abort`` is set and the call is left to finish on
    its own. ``meanwhile`` runs on this thread while the call is in flight; if it raises, the
    call is walked away from and its exception propagates. With ``meanwhile_after``
    (seconds), ``meanwhile`` runs only if the call is still in flight that long after it was
    handed over (not at all when it ended, or the run was interrupted, first). With
    ``permits``, the call starts once it holds one (waiting is interruptible) and gives it
    back when it really ends."""
    if _inline():
        if meanwhile is not None:
            meanwhile()
        return call(threading.Event())
    # A commit to run meanwhile takes a connection at once: the one this thread holds (the
    # inbox's probe before a model call took it) is kept for it rather than handed back to the
    # pool and taken again, and handed back once the commit is done, before the wait.
    waited = _prepare_start(
        interrupt,
        permits,
        keep_connection=meanwhile is not None and permits is None,
        # What must not wait for the call must not wait for its permit either.
        before_waiting=meanwhile if meanwhile_after is not None else None,
    )
    if waited:
        meanwhile = None  # it ran while no permit was free
    caller = _this_caller()
    outcome: dict[str, Any] = {}
    wake = threading.Event()
    abort = threading.Event()
    # The caller thread runs the call in this thread's context: the run id bound for logging
    # (and any other context variable) is the slot's.
    context = contextvars.copy_context()

    def job() -> None:
        try:
            outcome["value"] = context.run(call, abort)
        except BaseException as exc:  # noqa: BLE001 - everything: handed to the waiting thread
            outcome["error"] = exc
        finally:
            if permits is not None:
                permits.release()
            wake.set()

    def abandon() -> None:
        abort.set()
        caller.abandoned = True
        caller.jobs.put(None)  # ends the thread even if its call finished in the meantime
        _callers.caller = None

    interrupt.wakes(wake)
    try:
        caller.jobs.put(job)
        if meanwhile is not None and (meanwhile_after is None or not wake.wait(meanwhile_after)):
            try:
                meanwhile()
            except BaseException:
                abandon()
                raise
            # The commit that ran meanwhile took a connection: not kept across the wait.
            db.release()
        finished = wake.wait(timeout)
    finally:
        interrupt.forget(wake)
    if "value" in outcome:
        return outcome["value"]  # type: ignore[no-any-return]  # what make() returned: a T
    if "error" in outcome:
        raise outcome["error"]
    abandon()
    if not finished:
        raise CallTimedOut(timeout or 0.0)
    raise CallInterrupted(f"call abandoned: {interrupt.reason or 'interrupted'}")


def _prepare_start(
    interrupt: Interrupt,
    permits: threading.Semaphore | None,
    *,
    keep_connection: bool = False,
    before_waiting: Callable[[], None] | None = None,
) -> bool:
    """Before a call is handed over: no connection kept while it runs (unless
    ``keep_connection``: the caller releases it before it waits), a permit taken (with
    ``permits``; ``before_waiting`` runs if none is free at once), and ``CallInterrupted`` if
    the run was interrupted meanwhile. Whether ``before_waiting`` ran."""
    if not keep_connection:
        db.release()
    waited = False
    if permits is not None:
        waited = _acquire(permits, interrupt, before_waiting)
    if interrupt.is_set():
        # Not even started: a call handed over now would begin while nobody waits for it.
        if permits is not None:
            permits.release()
        raise CallInterrupted(f"not started: {interrupt.reason or 'interrupted'}")
    return waited


def _this_caller() -> _Caller:
    """This thread's caller thread, started on first use."""
    caller: _Caller | None = getattr(_callers, "caller", None)
    if caller is None:
        caller = _callers.caller = _Caller()
    return caller


def _acquire(
    permits: threading.Semaphore,
    interrupt: Interrupt,
    before_waiting: Callable[[], None] | None = None,
) -> bool:
    """Take a permit, or raise ``CallInterrupted`` if the run is interrupted first. When none
    is free at once, ``before_waiting`` runs first (its connection handed back before the
    wait): whether it ran."""
    if permits.acquire(blocking=False):
        return False
    if before_waiting is not None:
        before_waiting()
        db.release()
    while not permits.acquire(timeout=0.25):
        if interrupt.is_set():
            raise CallInterrupted(f"not started: {interrupt.reason or 'interrupted'}")
    return before_waiting is not None


_tool_permits: threading.BoundedSemaphore | None = None
_tool_permits_size = 0
_permits_lock = threading.Lock()


def tool_permits() -> threading.Semaphore:
    """The process's permits for plain tool calls: ``TOOL_THREADS`` of them."""
    global _tool_permits, _tool_permits_size
    size = max(1, int(app_settings.TOOL_THREADS))
    with _permits_lock:
        if _tool_permits is None or size != _tool_permits_size:
            _tool_permits, _tool_permits_size = threading.BoundedSemaphore(size), size
        return _tool_permits


_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


def event_loop() -> asyncio.AbstractEventLoop:
    """The process's event loop for ``async def`` tools, on its own daemon thread."""
    global _loop
    with _loop_lock:
        if _loop is None or _loop.is_closed():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="da-async-tools", daemon=True).start()
            _loop = loop
        return _loop


def await_abortable(
    make: Callable[[], Awaitable[T]],
    interrupt: Interrupt,
    *,
    timeout: float | None = None,
) -> T:
    """Await ``make()`` on the event loop thread and return its value or raise what it raised;
    ``CallInterrupted`` / ``CallTimedOut`` as ``run_abortable``, after cancelling it. The
    coroutine is created in this thread's context (the run id bound for logging)."""
    if _inline():
        loop = asyncio.new_event_loop()
        try:
            return loop.run_until_complete(make())
        finally:
            loop.close()
    if interrupt.is_set():
        raise CallInterrupted(f"not started: {interrupt.reason or 'interrupted'}")
    db.release()
    loop = event_loop()
    wake = threading.Event()

    async def call() -> tuple[bool, Any]:
        # Whatever the tool raises is handed over: a SystemExit escaping a task would stop
        # the loop and every async tool call of the worker with it.
        try:
            return True, await make()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - everything: handed to the waiting thread
            return False, exc

    # run_coroutine_threadsafe schedules in a copy of this thread's context.
    future: concurrent.futures.Future[tuple[bool, Any]] = asyncio.run_coroutine_threadsafe(
        call(), loop
    )
    future.add_done_callback(lambda _: wake.set())
    interrupt.wakes(wake)
    try:
        finished = wake.wait(timeout)
    finally:
        interrupt.forget(wake)
    if future.done() and not future.cancelled():
        ok, value = future.result()
        if ok:
            return value  # type: ignore[no-any-return]  # what call() returned: a T
        raise value
    future.cancel()
    if not finished:
        raise CallTimedOut(timeout or 0.0)
    raise CallInterrupted(f"call abandoned: {interrupt.reason or 'interrupted'}")
