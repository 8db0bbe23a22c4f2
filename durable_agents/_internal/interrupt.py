"""The flag that stops work on a run: set by the heartbeat (the run was cancelled or its lease
lost) or by a stopping worker. Waiters registered with ``wakes`` are woken at once, so a slot
blocked on an in-flight model call returns within a heartbeat of a cancellation.

A worker that starts to drain (its first SIGTERM/SIGINT) does not interrupt what is in flight:
a call gets the shutdown grace to finish. It ``drain``s instead, which ends only the waits that
hold no work (``wait_unless_draining``: the pause before a retried model call), so that a run
whose only work is such a wait is handed back at once rather than at the end of the grace."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

# The reason a model call's own interrupt triggers when a user's message asks for it
# (``send_message(..., policy="interrupt")``): the call is abandoned, the run goes on.
MESSAGE = "message"


class Interrupt(threading.Event):
    def __init__(self) -> None:
        super().__init__()
        self.reason = ""
        # What a person reads of it (the worker's shutdown: whether its grace ran out), or "".
        self.detail = ""
        self._wakers: list[threading.Event] = []
        self._narrowed: list[tuple[Interrupt, frozenset[str]]] = []
        self._draining = False
        self._drain_wakers: list[threading.Event] = []
        # The interrupts of the model calls in flight (``model_call``).
        self._calls: list[Interrupt] = []
        self._lock = threading.Lock()

    def trigger(self, reason: str, detail: str = "") -> None:
        with self._lock:
            if self.is_set():
                return
            self.reason = reason
            self.detail = detail
            self.set()
            wakers = list(self._wakers)
            narrowed = [child for child, reasons in self._narrowed if reason in reasons]
            narrowed += self._calls
        for waker in wakers:
            waker.set()
        for child in narrowed:
            child.trigger(reason, detail)

    @contextlib.contextmanager
    def model_call(self) -> Iterator[Interrupt]:
        """The interrupt of one model call: it triggers when this one does (for any reason),
        and when a user's message asks to cut the call short (``message_arrived``), which
        leaves this one unset: the run goes on."""
        child = Interrupt()
        with self._lock:
            self._calls.append(child)
            already = self.is_set()
            reason, detail = self.reason, self.detail
            draining = self._draining
        if already:
            child.trigger(reason, detail)
        if draining:
            child.drain()
        try:
            yield child
        finally:
            with self._lock:
                self._calls = [c for c in self._calls if c is not child]

    def message_arrived(self) -> None:
        """A message for the run asks to interrupt its model call: the calls in flight are
        interrupted (reason ``MESSAGE``); nothing else is, and a tool never."""
        with self._lock:
            calls = list(self._calls)
        for call in calls:
            call.trigger(MESSAGE)

    def narrowed(self, *reasons: str) -> Interrupt:
        """An interrupt that triggers when this one does for one of ``reasons`` only (at once
        if it already has). A call with a side effect waits out a cancellation: it started
        behind the fence, so it happens, and its outcome must be recorded, not walked away
        from; only a worker that stops for good abandons it."""
        child = Interrupt()
        with self._lock:
            self._narrowed.append((child, frozenset(reasons)))
            already = self.is_set() and self.reason in reasons
            reason, detail = self.reason, self.detail
        if already:
            child.trigger(reason, detail)
        return child

    def drop(self, child: Interrupt) -> None:
        """Forget an interrupt made by ``narrowed`` (its call is over)."""
        with self._lock:
            self._narrowed = [(c, r) for c, r in self._narrowed if c is not child]

    def wakes(self, waker: threading.Event) -> None:
        """Set ``waker`` when this interrupt triggers (at once if it already has)."""
        with self._lock:
            self._wakers.append(waker)
            if self.is_set():
                waker.set()

    def forget(self, waker: threading.Event) -> None:
        with self._lock:
            if waker in self._wakers:
                self._wakers.remove(waker)
            if waker in self._drain_wakers:
                self._drain_wakers.remove(waker)

    def drain(self) -> None:
        """The worker drains: end the waits of ``wait_unless_draining`` now, and from now on
        at once. What is in flight goes on (the interrupt itself is not set)."""
        with self._lock:
            self._draining = True
            wakers = list(self._drain_wakers)
            calls = list(self._calls)
        for waker in wakers:
            waker.set()
        for call in calls:
            call.drain()

    @property
    def draining(self) -> bool:
        return self._draining

    def wait_unless_draining(self, seconds: float) -> bool:
        """Wait up to ``seconds`` for nothing but time: True when the wait was cut short by
        this interrupt or by a drain (the caller stops what it waited to do), False when the
        time passed. For a pause that holds no work, such as the one before a retry."""
        waker = threading.Event()
        with self._lock:
            if self.is_set() or self._draining:
                return True
            self._wakers.append(waker)
            self._drain_wakers.append(waker)
        try:
            waker.wait(seconds)
        finally:
            self.forget(waker)
        return self.is_set() or self._draining
