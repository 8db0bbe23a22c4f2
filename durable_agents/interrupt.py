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
        self._lock = threading.Lock()

    def trigger(self, reason: str) -> None:
        with self._lock:
            if self.is_set():
                return
            self.reason = reason
            self.set()
            wakers = list(self._wakers)
        for waker in wakers:
            waker.set()

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
