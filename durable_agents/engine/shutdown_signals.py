"""SIGTERM and SIGINT for a worker, handled on a thread of their own.

Python runs a signal handler on the main thread between two bytecodes, possibly while that
thread holds a lock the handler would take: the lock of the event the claim loop waits on
(``Event.wait`` holds it around each check), a logging handler's. A handler that set that
event itself waited forever for a lock its own thread held: the worker never stopped. So the
handler here only writes the signal's number to a pipe, which takes no lock, and the relay
thread reads it and does the work (logs, sets the events) like any other thread.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("durable_agents.worker")

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class SignalRelay:
    """``on_signal(signum)`` on the relay thread for each SIGTERM or SIGINT between
    ``install()`` and ``uninstall()`` (which puts the previous handlers back)."""

    def __init__(self, on_signal: Callable[[int], None]) -> None:
        self._on_signal = on_signal
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        self._previous: dict[int, Any] = {}
        self._thread = threading.Thread(target=self._relay, name="da-signals", daemon=True)

    def install(self) -> None:
        """Start the relay thread and handle the signals (from the main thread only)."""
        self._thread.start()
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self.handle)

    def handle(self, signum: int, frame: object = None) -> None:
        """The handler itself: a byte into the pipe, nothing that takes a lock."""
        with contextlib.suppress(OSError):  # a full pipe: signals enough are waiting already
            os.write(self._write, bytes([signum]))

    def uninstall(self) -> None:
        """The previous handlers back; the relay thread ends once it has read what is left."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
        os.close(self._write)
        if self._thread.ident is None:  # never started: nobody else closes the read end
            os.close(self._read)

    def _relay(self) -> None:
        try:
            while data := os.read(self._read, 1):  # b"" once the write end is closed
                try:
                    self._on_signal(data[0])
                except Exception:  # the next signal must still be relayed
                    logger.exception("handling signal %d failed", data[0])
        finally:
            os.close(self._read)
