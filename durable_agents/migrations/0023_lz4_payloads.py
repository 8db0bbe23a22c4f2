"""Large payloads compressed with lz4 on PostgreSQL servers that have it.

PostgreSQL compresses a text value only when its row would pass about 2 kB (TOAST); the
payloads that do (long model turns, big tool results, long tasks) are compressed with pglz
by default. lz4 compresses and decompresses several times faster at about the same size, and
a resumed run reads its whole log back: ``SET COMPRESSION lz4`` on the columns that hold
them. Only what is written afterwards is compressed with lz4 (nothing is rewritten); values
already stored stay as they are, and both are read back alike.

Each ALTER changes only PostgreSQL's catalogue, at once whatever the size of the table. It
waits at most LOCK_TIMEOUT for its lock and is tried again, so that a long transaction
holding a table never queues the workers' commits behind the migration. A server built
without lz4 (``default_toast_compression`` offers only pglz), and SQLite, keep what they
have. Re-runnable: a column already on lz4 is left alone.
"""

from __future__ import annotations

import time
from typing import Any

from django.db import OperationalError, migrations

LOCK_TIMEOUT = "3s"
LOCK_ATTEMPTS = 20
LOCK_NOT_AVAILABLE = "55P03"  # PostgreSQL's SQLSTATE for lock_not_available

# (table, column): the columns whose values can pass the TOAST threshold.
COLUMNS = (
    ("agent_step", "payload"),
    ("tool_effect", "result"),
    ("tool_intent", "input"),
    ("agent_run", "task"),
    ("agent_run", "result"),
)


def _has_lz4(connection: Any) -> bool:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT 'lz4' = ANY(enumvals) FROM pg_settings"
            " WHERE name = 'default_toast_compression'"
        )
        row = cursor.fetchone()
    return bool(row and row[0])


def _compression(connection: Any, table: str, column: str) -> str:
    """The column's compression method: 'p' (pglz), 'l' (lz4), '' (the server's default)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT attcompression FROM pg_attribute"
            " WHERE attrelid = %s::regclass AND attname = %s",
            [table, column],
        )
        row = cursor.fetchone()
    return str(row[0]) if row else ""


def _alter_briefly(connection: Any, statement: str) -> None:
    """Run an ALTER TABLE with a short lock_timeout, again until it gets its lock."""
    for attempt in range(1, LOCK_ATTEMPTS + 1):
        try:
            with connection.cursor() as cursor:
                cursor.execute(f"SET lock_timeout = '{LOCK_TIMEOUT}'")
                try:
                    cursor.execute(statement)
                finally:
                    cursor.execute("RESET lock_timeout")
            return
        except OperationalError as exc:
            lost = getattr(exc.__cause__, "sqlstate", None) == LOCK_NOT_AVAILABLE
            if not lost or attempt == LOCK_ATTEMPTS:
                raise
            time.sleep(1.0)


def _set_compression(schema_editor: Any, method: str, wanted: str) -> None:
    connection = schema_editor.connection
    if connection.vendor != "postgresql" or not _has_lz4(connection):
        return
    for table, column in COLUMNS:
        if _compression(connection, table, column) != wanted:
            _alter_briefly(
                connection,
                f'ALTER TABLE "{table}" ALTER COLUMN "{column}" SET COMPRESSION {method}',
            )


def to_lz4(apps: Any, schema_editor: Any) -> None:
    _set_compression(schema_editor, "lz4", "l")


def to_default(apps: Any, schema_editor: Any) -> None:
    _set_compression(schema_editor, "default", "")


class Migration(migrations.Migration):
    atomic = False  # each ALTER commits on its own: no lock held across the five

    dependencies = [
        ("durable_agents", "0022_schedule_every_positive"),
    ]

    operations = [migrations.RunPython(to_lz4, to_default, elidable=False)]
