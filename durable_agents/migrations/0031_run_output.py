"""``agent_run.output``: the final answer of a run whose agent has an ``output_schema``, as
JSON text (parsed and validated against the schema); NULL for every other run.

A nullable column without a default: on PostgreSQL the ALTER rewrites nothing and holds its
lock for an instant. It waits at most LOCK_TIMEOUT for that lock and is tried again, so that a
long transaction holding ``agent_run`` never queues every claim, heartbeat and commit behind
the migration. The column is added only if it is missing: a migration interrupted after it was
added finishes when run again. Where the server has lz4 (as ``0023`` set for ``result``), the
column is compressed with it: an answer can be as long as a result.
"""

from __future__ import annotations

import time
from typing import Any

from django.db import OperationalError, migrations

import durable_agents.models

# How long the ALTER waits for its lock on agent_run before it gives up and tries again, and
# how many times it tries.
LOCK_TIMEOUT = "3s"
LOCK_ATTEMPTS = 20
LOCK_NOT_AVAILABLE = "55P03"  # PostgreSQL's SQLSTATE for lock_not_available


def output_field() -> Any:
    return durable_agents.models.JSONTextField(
        blank=True,
        editable=False,
        help_text="the final answer as JSON, validated against the agent's output schema",
        null=True,
    )


def _with_output(apps: Any) -> Any:
    """The historical AgentRun with the field: a database operation sees the state before
    this migration's state operations."""
    model = apps.get_model("durable_agents", "AgentRun")
    try:
        model._meta.get_field("output")
    except Exception:  # noqa: BLE001 - FieldDoesNotExist
        output_field().contribute_to_class(model, "output")
    return model


def _has_output(schema_editor: Any) -> bool:
    connection = schema_editor.connection
    with connection.cursor() as cursor:
        columns = connection.introspection.get_table_description(cursor, "agent_run")
    return any(column.name == "output" for column in columns)


def _has_lz4(schema_editor: Any) -> bool:
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(
            "SELECT 'lz4' = ANY(enumvals) FROM pg_settings"
            " WHERE name = 'default_toast_compression'"
        )
        row = cursor.fetchone()
    return bool(row and row[0])


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


def add_output(apps: Any, schema_editor: Any) -> None:
    model = _with_output(apps)
    if _has_output(schema_editor):
        return
    if schema_editor.connection.vendor != "postgresql":
        schema_editor.add_field(model, model._meta.get_field("output"))
        return
    compression = " COMPRESSION lz4" if _has_lz4(schema_editor) else ""
    _alter_briefly(
        schema_editor, f'ALTER TABLE "agent_run" ADD COLUMN "output" text{compression} NULL'
    )


def remove_output(apps: Any, schema_editor: Any) -> None:
    model = _with_output(apps)
    schema_editor.remove_field(model, model._meta.get_field("output"))


class Migration(migrations.Migration):
    # Each ALTER in a transaction of its own: one that ran out of lock_timeout is tried again
    # (inside the migration's transaction the failure would have aborted it).
    atomic = False

    dependencies = [
        ("durable_agents", "0030_webhook_deliveries"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AddField(model_name="agentrun", name="output", field=output_field()),
            ],
            database_operations=[
                migrations.RunPython(add_output, remove_output),
            ],
        ),
    ]
