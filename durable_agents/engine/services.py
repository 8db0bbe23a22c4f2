"""What a worker does besides advancing runs, registered with it rather than imported by it.

The worker (``worker.py``) sits below the services it runs: firing agent schedules
(``schedule_firing``), waking the parent runs a dead worker stranded (``housekeeping``). Each
registers a ``WorkerService`` here when it is imported (the app's ``ready`` imports them), and
every worker runs whatever is registered, knowing none of them by name:

    ``starting(worker)``  once, as the worker starts: before its heartbeat, listener and slots
    ``start(worker)``     after its listener, before its slots: a thread of the service's own
                          (started), or None; the worker joins it, a second at most, once its
                          slots are done (the thread watches ``worker.stopping``)

Services run in the order they were registered. A service must not raise from ``starting``
for a failure of its own: it logs it, and the worker goes on.
"""

from __future__ import annotations

import threading
from typing import Any


class WorkerService:
    """Override what the service does; each default does nothing."""

    def starting(self, worker: Any) -> None:
        """Once, as ``worker`` starts (before its heartbeat)."""

    def start(self, worker: Any) -> threading.Thread | None:
        """The service's own thread, started, or None."""
        return None


# By name: registering a name again (the app's ready run twice) replaces its service.
_services: dict[str, WorkerService] = {}
_lock = threading.Lock()


def register(name: str, service: WorkerService) -> None:
    """Have every worker that starts from now on run ``service``."""
    with _lock:
        _services[name] = service


def unregister(name: str) -> None:
    with _lock:
        _services.pop(name, None)


def registered() -> tuple[WorkerService, ...]:
    """The services a worker starting now runs, in the order they were registered."""
    with _lock:
        return tuple(_services.values())
