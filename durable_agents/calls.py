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
"""

from __future__ import annotations

import contextvars
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from durable_agents.interrupt import Interrupt

logger = logging.getLogger("durable_agents.calls")

T = TypeVar("T")


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
                if self.abandoned:
                    return  # its slot has a new caller; this thread was only finishing a call
        finally:
            _close_database_connections()


def _close_database_connections() -> None:
    # Tool code may have used the ORM on this thread; its connections are this thread's own.
    try:
        from django.db import connections

        connections.close_all()
    except Exception:  # noqa: BLE001 - a thread that ends must not fail on its way out
        logger.debug("closing a caller thread's database connections failed", exc_info=True)


_callers = threading.local()


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
) -> T:
    """Run ``call(abort)`` on this thread's caller thread and return its value or raise what it
    raised. Raises ``CallInterrupted`` as soon as ``interrupt`` triggers and ``CallTimedOut``
    after ``timeout`` seconds; either way ``abort`` is set and the call is left to finish on
    its own. ``meanwhile`` runs on this thread while the call is in flight; if it raises, the
    call is walked away from and its exception propagates."""
    if interrupt.is_set():
        # Not even started: a call handed over now would begin while nobody waits for it.
        raise CallInterrupted(f"not started: {interrupt.reason or 'interrupted'}")
    caller: _Caller | None = getattr(_callers, "caller", None)
    if caller is None:
        caller = _callers.caller = _Caller()
    outcome: dict[str, Any] = {}
    wake = threading.Event()
    abort = threading.Event()
    # The caller thread runs the call in this thread's context: the run id bound for logging
    # (and any other context variable) is the slot's.
    context = contextvars.copy_context()

    def job() -> None:
        try:
            outcome["value"] = context.run(call, abort)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            outcome["error"] = exc
        finally:
            wake.set()

    def abandon() -> None:
        abort.set()
        caller.abandoned = True
        caller.jobs.put(None)  # ends the thread even if its call finished in the meantime
        _callers.caller = None

    interrupt.wakes(wake)
    try:
        caller.jobs.put(job)
        if meanwhile is not None:
            try:
                meanwhile()
            except BaseException:
                abandon()
                raise
        finished = wake.wait(timeout)
    finally:
        interrupt.forget(wake)
    if "value" in outcome:
        return outcome["value"]  # type: ignore[no-any-return]
    if "error" in outcome:
        raise outcome["error"]
    abandon()
    if not finished:
        raise CallTimedOut(timeout or 0.0)
    raise CallInterrupted(f"call abandoned: {interrupt.reason or 'interrupted'}")
