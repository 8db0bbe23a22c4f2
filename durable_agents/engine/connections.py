"""What a worker must do with connections besides calling its store.

A worker on a database store looks after its threads' connections: it refreshes them between
idle claims (``CONN_MAX_AGE``, ``CONN_HEALTH_CHECKS``), hands them back to the pool before
every wait (``db.release``), closes them when a thread ends, gives the heartbeat its own
connection and LISTENs for notifications (PostgreSQL). A store without a database (the
in-memory store of unit tests) needs none of that. ``Store.holds_connections`` says which: the
worker picks one of the two objects here (the store, below the engine, never imports this
module) and calls it at each of those points, never asking what store it has.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

from django.db import close_old_connections, connection

from durable_agents._internal import db
from durable_agents.conf import app_settings


class WorkerConnections:
    """A store that holds no database connection: every duty is a no-op, nothing listens."""

    def refresh(self) -> None:
        """Before a claim after an idle poll (or a beat on the thread's own connection)."""

    def release(self) -> None:
        """Before a wait: hand this thread's connection back to the pool."""

    def close(self) -> None:
        """This thread's connection is done with (the thread ends, or it failed)."""

    def pool_note(self) -> str:
        """What the start-up line says about the connection pool ('' when there is none)."""
        return ""

    @contextlib.contextmanager
    def heartbeat(self) -> Iterator[Any]:
        """The heartbeat thread's connection for its whole life: what ``renew_leases`` gets
        as ``using`` (None: the thread's default connection)."""
        yield None

    def close_heartbeat(self, using: Any) -> None:
        """A beat failed: close its connection, the next beat opens a fresh one."""

    def listener(
        self,
        on_run: Callable[[], None],
        on_cancel: Callable[[str], None],
        stopping: threading.Event,
        on_message: Callable[[str], None] | None = None,
        on_inbox: Callable[[str], None] | None = None,
    ) -> db.Listener | None:
        """A LISTEN listener to serve on its own thread, or None (nothing to listen to)."""
        return None


class DatabaseConnections(WorkerConnections):
    """The Django connections of a worker's threads (PostgreSQL, SQLite)."""

    def refresh(self) -> None:
        close_old_connections()

    def release(self) -> None:
        db.release()

    def close(self) -> None:
        connection.close()

    def pool_note(self) -> str:
        return f" pool={app_settings.DB_POOL_SIZE}" if db.pooled() else ""

    @contextlib.contextmanager
    def heartbeat(self) -> Iterator[Any]:
        """On PostgreSQL its own connection, outside the pool: slow tool code holding every
        pooled connection never delays a renewal."""
        own = db.dedicated() if connection.vendor == "postgresql" else None
        try:
            yield own
        finally:
            if own is not None:
                own.close()
            connection.close()

    def close_heartbeat(self, using: Any) -> None:
        (using or connection).close()

    def listener(
        self,
        on_run: Callable[[], None],
        on_cancel: Callable[[str], None],
        stopping: threading.Event,
        on_message: Callable[[str], None] | None = None,
        on_inbox: Callable[[str], None] | None = None,
    ) -> db.Listener | None:
        """PostgreSQL only: wakes the claimer, interrupts a cancelled run at once."""
        if connection.vendor != "postgresql":
            return None
        setting = app_settings.LISTEN
        overrides = setting if isinstance(setting, dict) else {}
        return db.Listener(
            on_run=on_run,
            on_cancel=on_cancel,
            stopping=stopping,
            on_message=on_message,
            on_inbox=on_inbox,
            overrides=overrides,
        )
