"""Run priorities: the column ``agent_run.priority`` and a claim index in priority order.

- ``priority``: smallint NOT NULL with the database default 0. On PostgreSQL 11 and later,
  adding a column with a constant default rewrites nothing (a brief exclusive lock, no scan),
  and code deployed before the column existed keeps inserting runs (at 0): a rolling deploy.
  No CHECK constraint on purpose: validating one would scan the table under that lock;
  ``start_run`` checks the range (0 to 100). The ALTER waits at most LOCK_TIMEOUT for its lock
  and is tried again, so that a long transaction holding ``agent_run`` never queues every
  claim, heartbeat and commit behind the migration.
- ``agent_run_claim_priority`` on ``(priority DESC, created_at) WHERE status IN ('pending',
  'running')``: the claim reads it in its order and stops at its LIMIT.
- ``agent_run_claim`` (``created_at``, the same condition) stays: workers of the previous
  release, still claiming oldest first during a rolling deploy, read it. A later release drops
  it, once no such worker can be running.
- ``agent_run_priority`` on ``(priority, created_at)``: the admin's runs list filtered by
  priority, newest first, and the filter's values found by a skip scan.

On PostgreSQL the indexes are built with CREATE INDEX CONCURRENTLY: workers go on claiming
meanwhile. Hence ``atomic = False``. The migration can be interrupted and run again, on every
database: the column is added only if missing, an index that exists is kept, and one that a
previous attempt left INVALID is dropped and built again.
"""

from __future__ import annotations

import time
from typing import Any

from django.db import OperationalError, migrations, models

CLAIM_BY_PRIORITY = models.Index(
    fields=["-priority", "created_at"],
    name="agent_run_claim_priority",
    condition=models.Q(status__in=["pending", "running"]),
)
PRIORITY_INDEX = models.Index(fields=["priority", "created_at"], name="agent_run_priority")

# How long the ALTER waits for its lock on agent_run before it gives up and tries again, and
# how many times it tries.
LOCK_TIMEOUT = "3s"
LOCK_ATTEMPTS = 20
# PostgreSQL's SQLSTATE for lock_not_available.
LOCK_NOT_AVAILABLE = "55P03"


def _has_priority(schema_editor: Any) -> bool:
    with schema_editor.connection.cursor() as cursor:
        columns = schema_editor.connection.introspection.get_table_description(cursor, "agent_run")
    return any(column.name == "priority" for column in columns)


def _alter_briefly(schema_editor: Any, statement: str) -> None:
    """Run an ALTER TABLE on PostgreSQL with a short lock_timeout, again until it gets its
    lock: while it waits, every statement on agent_run would queue behind it."""
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


def add_priority(apps: Any, schema_editor: Any) -> None:
    if _has_priority(schema_editor):
        return
    statement = "ALTER TABLE agent_run ADD COLUMN priority smallint DEFAULT 0 NOT NULL"
    if schema_editor.connection.vendor == "postgresql":
        _alter_briefly(schema_editor, statement)
    else:
        schema_editor.execute(statement)


def remove_priority(apps: Any, schema_editor: Any) -> None:
    if _has_priority(schema_editor):
        schema_editor.execute("ALTER TABLE agent_run DROP COLUMN priority")


def _valid(schema_editor: Any, name: str) -> bool | None:
    """Whether the index ``name`` is valid on PostgreSQL (True elsewhere), None if absent."""
    with schema_editor.connection.cursor() as cursor:
        if schema_editor.connection.vendor != "postgresql":
            found = schema_editor.connection.introspection.get_constraints(cursor, "agent_run")
            return True if name in found else None
        cursor.execute(
            "SELECT i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid"
            " WHERE c.relname = %s AND pg_catalog.pg_table_is_visible(c.oid)",
            [name],
        )
        row = cursor.fetchone()
    return None if row is None else bool(row[0])


def _build(apps: Any, schema_editor: Any, index: models.Index) -> None:
    """Build ``index`` unless it exists and is valid; on PostgreSQL without blocking writes."""
    valid = _valid(schema_editor, index.name)
    if valid:
        return
    model = apps.get_model("durable_agents", "AgentRun")
    if schema_editor.connection.vendor != "postgresql":
        schema_editor.add_index(model, index)
        return
    if valid is False:  # left INVALID by an interrupted build
        schema_editor.execute(f'DROP INDEX CONCURRENTLY IF EXISTS "{index.name}"')
    schema_editor.execute(str(index.create_sql(model, schema_editor, concurrently=True)))


def _drop(schema_editor: Any, index: models.Index) -> None:
    concurrently = " CONCURRENTLY" if schema_editor.connection.vendor == "postgresql" else ""
    schema_editor.execute(f'DROP INDEX{concurrently} IF EXISTS "{index.name}"')


def add_indexes(apps: Any, schema_editor: Any) -> None:
    _build(apps, schema_editor, CLAIM_BY_PRIORITY)
    _build(apps, schema_editor, PRIORITY_INDEX)


def remove_indexes(apps: Any, schema_editor: Any) -> None:
    _drop(schema_editor, PRIORITY_INDEX)
    _drop(schema_editor, CLAIM_BY_PRIORITY)


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY cannot run inside a transaction

    dependencies = [
        ("durable_agents", "0008_run_start_key"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AddField(
                    model_name="agentrun",
                    name="priority",
                    field=models.SmallIntegerField(
                        db_default=0,
                        default=0,
                        help_text="0 to 100: a claim takes the highest first, then the oldest",
                    ),
                ),
            ],
            database_operations=[
                migrations.RunPython(add_priority, remove_priority, atomic=False),
            ],
        ),
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AddIndex(model_name="agentrun", index=CLAIM_BY_PRIORITY),
                migrations.AddIndex(model_name="agentrun", index=PRIORITY_INDEX),
            ],
            database_operations=[
                migrations.RunPython(add_indexes, remove_indexes, atomic=False),
            ],
        ),
    ]
