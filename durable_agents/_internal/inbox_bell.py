"""Who in this process hears at once that a message was queued for a run.

A worker learns of messages from the database's notifications, which reach its listener a
moment after the message commits. A message queued by this very process (a tool of the run
sending it one, the admin of a worker process) rings here as soon as its transaction commits,
so that the run's next model call, on this process, folds it for certain. Each ring calls the
hearers registered now; a hearer never raises (it only notes the run).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

_lock = threading.Lock()
_hearers: list[Callable[[Any], None]] = []


def listen(hearer: Callable[[Any], None]) -> None:
    with _lock:
        _hearers.append(hearer)


def stop_listening(hearer: Callable[[Any], None]) -> None:
    with _lock:
        if hearer in _hearers:
            _hearers.remove(hearer)


def ring(run_id: Any) -> None:
    """A message for ``run_id`` was committed by this process."""
    with _lock:
        hearers = list(_hearers)
    for hearer in hearers:
        hearer(run_id)
