"""PostgreSQL notifies ``durable_agents_end`` with a run's id when the run ends.

``get_result`` and ``aget_result`` wait on it: one LISTEN connection per process wakes every
caller waiting for that run, with no query while nothing ends. A trigger, as for the workers'
notifications (migration 0003), so that every way a run ends notifies (a worker's commit, a
cancel from the admin or the API, housekeeping's dead letter, a hand-written UPDATE), and at
commit, so that a waiter woken by it reads the ended run. A channel of its own: no worker
wakes because a run ended. "Ended" is a change of status into succeeded, failed, cancelled or
dead. SQLite has no notifications: waiters there are served by one poll per process.

The trigger is created with a short lock_timeout, tried again until it gets its lock, so that
a long transaction holding agent_run never queues every claim and commit behind it.
"""

from __future__ import annotations

import time
from typing import Any

from django.db import OperationalError, migrations

FUNCTION = """
CREATE OR REPLACE FUNCTION durable_agents_notify_end() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('durable_agents_end', NEW.id::text);
    RETURN NULL;
END
$$
"""

TRIGGER = """
CREATE TRIGGER agent_run_notify_end
    AFTER UPDATE OF status ON agent_run
    FOR EACH ROW WHEN (
        NEW.status IN ('succeeded', 'failed', 'cancelled', 'dead')
        AND OLD.status IS DISTINCT FROM NEW.status
    )
    EXECUTE FUNCTION durable_agents_notify_end()
"""

LOCK_TIMEOUT = "3s"
LOCK_ATTEMPTS = 20
LOCK_NOT_AVAILABLE = "55P03"  # PostgreSQL's SQLSTATE for lock_not_available


def _briefly(schema_editor: Any, *statements: str) -> None:
    """``statements`` in one transaction with a short lock_timeout, again until they get
    their lock."""
    connection = schema_editor.connection
    for attempt in range(1, LOCK_ATTEMPTS + 1):
        try:
            with connection.cursor() as cursor:
                cursor.execute("BEGIN")
                try:
                    cursor.execute(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'")
                    for statement in statements:
                        cursor.execute(statement)
                except BaseException:
                    cursor.execute("ROLLBACK")
                    raise
                cursor.execute("COMMIT")
            return
        except OperationalError as exc:
            lost = getattr(exc.__cause__, "sqlstate", None) == LOCK_NOT_AVAILABLE
            if not lost or attempt == LOCK_ATTEMPTS:
                raise
            time.sleep(1.0)


def create(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor != "postgresql":
        return
    _briefly(
        schema_editor,
        FUNCTION,
        "DROP TRIGGER IF EXISTS agent_run_notify_end ON agent_run",
        TRIGGER,
    )


def drop(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor != "postgresql":
        return
    _briefly(
        schema_editor,
        "DROP TRIGGER IF EXISTS agent_run_notify_end ON agent_run",
        "DROP FUNCTION IF EXISTS durable_agents_notify_end()",
    )


class Migration(migrations.Migration):
    atomic = False  # _briefly commits its own transaction

    dependencies = [("durable_agents", "0032_callbacks")]

    operations = [migrations.RunPython(create, drop, elidable=False)]
