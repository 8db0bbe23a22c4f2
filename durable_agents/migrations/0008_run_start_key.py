"""``agent_run.start_key``: the idempotency key of ``start_run(..., key=...)``, and the unique
index that makes it one run per (agent, key).

- The column is nullable with no default: adding it changes only the catalogue, at once,
  whatever the size of the table (runs started without a key keep NULL).
- ``agent_run_start_key`` is a partial unique index on (start_key, agent) WHERE start_key IS
  NOT NULL: only keyed runs are in it, and the key leads so that the admin's search by a key
  alone is served by it too.

On PostgreSQL the index is built with CREATE UNIQUE INDEX CONCURRENTLY, so that a deployment
with millions of runs goes on claiming and committing meanwhile; hence ``atomic = False``.
The migration can be interrupted and run again: the column is added only if it is missing,
an index that a previous attempt left INVALID is dropped and built again, a valid one is
kept.
"""

from __future__ import annotations

import time
from typing import Any

from django.db import OperationalError, migrations, models

INDEX_NAME = "agent_run_start_key"

START_KEY = models.UniqueConstraint(
    fields=["start_key", "agent"],
    name=INDEX_NAME,
    condition=models.Q(start_key__isnull=False),
)

# The column and the index as Django's schema editor writes them for the field and the
# constraint above (``makemigrations --check`` compares the state; the SQL is spelled out so
# that it can be made idempotent and CONCURRENTLY).
ADD_COLUMN = 'ALTER TABLE "agent_run" ADD COLUMN "start_key" varchar(200) NULL'

# How long the ALTER waits for its lock on agent_run before it gives up and tries again, and
# how many times it tries: while it waits, every claim, heartbeat and commit would queue
# behind it (a long transaction that holds agent_run would stall the whole fleet).
LOCK_TIMEOUT = "3s"
LOCK_ATTEMPTS = 20
LOCK_NOT_AVAILABLE = "55P03"  # PostgreSQL's SQLSTATE for lock_not_available


def create_index_sql(how: str) -> str:
    """``how``: "CONCURRENTLY" on PostgreSQL, "IF NOT EXISTS" on SQLite."""
    return (
        f'CREATE UNIQUE INDEX {how} "{INDEX_NAME}" ON "agent_run" ("start_key", "agent")'
        ' WHERE "start_key" IS NOT NULL'
    )


def _is_postgres(schema_editor: Any) -> bool:
    return bool(schema_editor.connection.vendor == "postgresql")


def _has_column(schema_editor: Any) -> bool:
    connection = schema_editor.connection
    with connection.cursor() as cursor:
        columns = connection.introspection.get_table_description(cursor, "agent_run")
    return any(column.name == "start_key" for column in columns)


def _build_concurrently(schema_editor: Any, name: str, statement: str) -> None:
    """CREATE INDEX CONCURRENTLY ``name`` unless a valid one exists; an INVALID one (left by
    an interrupted build) is dropped first."""
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(
            "SELECT i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid"
            " WHERE c.relname = %s AND pg_catalog.pg_table_is_visible(c.oid)",
            [name],
        )
        row = cursor.fetchone()
        if row is not None and row[0]:
            return
        if row is not None:
            cursor.execute(f'DROP INDEX CONCURRENTLY IF EXISTS "{name}"')
        cursor.execute(statement)


def _alter_briefly(schema_editor: Any, statement: str) -> None:
    """Run an ALTER TABLE on PostgreSQL with a short lock_timeout, again until it gets its
    lock."""
    for attempt in range(1, LOCK_ATTEMPTS + 1):
        try:
            with schema_editor.connection.cursor() as cursor:
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


def add_start_key(apps: Any, schema_editor: Any) -> None:
    if not _has_column(schema_editor):
        if _is_postgres(schema_editor):
            _alter_briefly(schema_editor, ADD_COLUMN)
        else:
            schema_editor.execute(ADD_COLUMN)
    if _is_postgres(schema_editor):
        _build_concurrently(schema_editor, INDEX_NAME, create_index_sql("CONCURRENTLY"))
    else:  # SQLite: no concurrent build (nor tables of that size)
        schema_editor.execute(create_index_sql("IF NOT EXISTS"))


def remove_start_key(apps: Any, schema_editor: Any) -> None:
    concurrently = " CONCURRENTLY" if _is_postgres(schema_editor) else ""
    schema_editor.execute(f'DROP INDEX{concurrently} IF EXISTS "{INDEX_NAME}"')
    if _has_column(schema_editor):
        schema_editor.execute('ALTER TABLE "agent_run" DROP COLUMN "start_key"')


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY cannot run inside a transaction

    dependencies = [
        ("durable_agents", "0007_admin_indexes"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AddField(
                    model_name="agentrun",
                    name="start_key",
                    field=models.CharField(blank=True, editable=False, max_length=200, null=True),
                ),
                migrations.AddConstraint(model_name="agentrun", constraint=START_KEY),
            ],
            database_operations=[
                migrations.RunPython(add_start_key, remove_start_key, atomic=False),
            ],
        ),
    ]
