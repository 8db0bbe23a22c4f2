"""How many readers one process serves: ``LIVE_MAX_READERS`` in all, ``LIVE_MAX_READERS_PER_RUN``
of one run. Past either, ``runs/<id>/events`` answers 503 with ``Retry-After``.

Under ASGI a reader costs the process a socket, a task and a queue (the hub reads for all of
them on one connection); under WSGI it costs a thread and a database connection for as long
as it reads. Either way an unbounded number of them, all opened with one leaked token, takes
the server (or the database) from everyone else: the caps bound what one process gives.

A reader is counted from the moment it is admitted until its stream ends, however it ends
(the run is over, the client went away, an error, a cancelled task): ``Admission.release`` is
idempotent and called from every way out.
"""

from __future__ import annotations

import threading
import uuid

from durable_agents.conf import app_settings

__all__ = ["Admission", "ReaderSlots", "slots"]


class Admission:
    """One admitted reader's place; ``release()`` gives it back (once, whoever calls it)."""

    def __init__(self, owner: ReaderSlots, run_id: uuid.UUID) -> None:
        self._owner = owner
        self.run_id = run_id
        self._released = False

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        self._owner._release(self)


class ReaderSlots:
    """The count of readers of one process, in all and per run. Thread-safe: under WSGI
    readers come from many threads, under ASGI from the event loop."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._total = 0
        self._per_run: dict[uuid.UUID, int] = {}

    @property
    def total(self) -> int:
        return self._total

    def of_run(self, run_id: uuid.UUID) -> int:
        return self._per_run.get(run_id, 0)

    def admit(self, run_id: uuid.UUID) -> Admission | None:
        """A place for one more reader of ``run_id``, or None when the process or the run has
        as many as the settings allow."""
        most = int(app_settings.LIVE_MAX_READERS)
        most_of_run = int(app_settings.LIVE_MAX_READERS_PER_RUN)
        with self._lock:
            of_run = self._per_run.get(run_id, 0)
            if self._total >= most or of_run >= most_of_run:
                return None
            self._total += 1
            self._per_run[run_id] = of_run + 1
        return Admission(self, run_id)

    def _release(self, admission: Admission) -> None:
        with self._lock:
            if admission._released:
                return
            admission._released = True
            self._total -= 1
            left = self._per_run[admission.run_id] - 1
            if left:
                self._per_run[admission.run_id] = left
            else:
                del self._per_run[admission.run_id]


# The process's count (every event loop and every thread of it).
slots = ReaderSlots()
