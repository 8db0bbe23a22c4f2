"""The flag that stops work on a run: set by the heartbeat (the run was cancelled or its lease
lost) or by a stopping worker. Waiters registered with ``wakes`` are woken at once, so a slot
blocked on an in-flight model call returns within a heartbeat of a cancellation."""

from __future__ import annotations

import threading


class Interrupt(threading.Event):
    def __init__(self) -> None:
        super().__init__()
        self.reason = ""
        self._wakers: list[threading.Event] = []
        self._narrowed: list[tuple[Interrupt, frozenset[str]]] = []
        self._lock = threading.Lock()

    def trigger(self, reason: str) -> None:
        with self._lock:
            if self.is_set():
                return
            self.reason = reason
            self.set()
            wakers = list(self._wakers)
            narrowed = [child for child, reasons in self._narrowed if reason in reasons]
        for waker in wakers:
            waker.set()
        for child in narrowed:
            child.trigger(reason)

    def narrowed(self, *reasons: str) -> Interrupt:
        """An interrupt that triggers when this one does for one of ``reasons`` only (at once
        if it already has). A call with a side effect waits out a cancellation: it started
        behind the fence, so it happens, and its outcome must be recorded, not walked away
        from; only a worker that stops for good abandons it."""
        child = Interrupt()
        with self._lock:
            self._narrowed.append((child, frozenset(reasons)))
            already = self.reason if self.is_set() and self.reason in reasons else None
        if already is not None:
            child.trigger(already)
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
