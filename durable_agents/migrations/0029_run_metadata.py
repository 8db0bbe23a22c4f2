"""``agent_run.metadata``: the JSON object a product attaches to a run (a tenant, a user, an
order), and ``agent_run_metadata``, a GIN index (``jsonb_path_ops``) on it for containment
queries (``AgentRun.objects.with_metadata(tenant="acme")``, the admin's metadata filter).

The column has a database default (``{}``), so code deployed before it existed (a rolling
deploy) and raw INSERTs still create runs; on PostgreSQL 11 and later, adding a column with a
constant default rewrites nothing and holds its lock for an instant. The ALTER waits at most
LOCK_TIMEOUT for that lock and is tried again, so that a long transaction holding ``agent_run``
never queues every claim, heartbeat and commit behind the migration. The column is added only
if it is missing: a migration interrupted after it was added finishes when run again.

The index is PostgreSQL's alone (SQLite has no containment of JSON and gets no index), built
CONCURRENTLY (hence ``atomic = False``), so a deployment with millions of runs goes on claiming
and committing meanwhile; an INVALID index left by an interrupted build is dropped and built
again. Metadata never changes once a run has started, so the index costs no HOT update.
"""

from __future__ import annotations

import time
from typing import Any

from django.db import OperationalError, migrations, models

# How long the ALTER waits for its lock on agent_run before it gives up and tries again, and
# how many times it tries.
LOCK_TIMEOUT = "3s"
LOCK_ATTEMPTS = 20
LOCK_NOT_AVAILABLE = "55P03"  # PostgreSQL's SQLSTATE for lock_not_available

METADATA_FIELD = models.JSONField(
    blank=True,
    db_default=models.Value({}, output_field=models.JSONField()),
    default=dict,
    editable=False,
    help_text="what the product attached to the run (a tenant, a user, an order)",
)

# Left out of the model's state (no GinIndex: that would require django.contrib.postgres in
# every project's INSTALLED_APPS, which Django 6 checks): SQL of its own, PostgreSQL only.
METADATA_INDEX_NAME = "agent_run_metadata"
CREATE_METADATA_INDEX = (
    f'CREATE INDEX CONCURRENTLY "{METADATA_INDEX_NAME}" ON "agent_run" '
    'USING gin ("metadata" jsonb_path_ops)'
)


def _with_metadata(apps: Any) -> Any:
    """The historical AgentRun with the field: a database operation sees the state before
    this migration's state operations."""
    model = apps.get_model("durable_agents", "AgentRun")
    try:
        model._meta.get_field("metadata")
    except Exception:  # noqa: BLE001 - FieldDoesNotExist
        METADATA_FIELD.clone().contribute_to_class(model, "metadata")
    return model


def _has_metadata(schema_editor: Any) -> bool:
    connection = schema_editor.connection
    with connection.cursor() as cursor:
        columns = connection.introspection.get_table_description(cursor, "agent_run")
    return any(column.name == "metadata" for column in columns)


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


def add_metadata(apps: Any, schema_editor: Any) -> None:
    model = _with_metadata(apps)
    if schema_editor.connection.vendor != "postgresql":
        if not _has_metadata(schema_editor):
            schema_editor.add_field(model, model._meta.get_field("metadata"))
        return
    if not _has_metadata(schema_editor):
        _alter_briefly(
            schema_editor,
            """ALTER TABLE "agent_run" ADD COLUMN "metadata" jsonb DEFAULT '{}'::jsonb NOT NULL""",
        )
    name = METADATA_INDEX_NAME
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
        cursor.execute(CREATE_METADATA_INDEX)


def remove_metadata(apps: Any, schema_editor: Any) -> None:
    model = _with_metadata(apps)
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(f'DROP INDEX CONCURRENTLY IF EXISTS "{METADATA_INDEX_NAME}"')
    schema_editor.remove_field(model, model._meta.get_field("metadata"))


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY cannot run inside a transaction

    dependencies = [
        ("durable_agents", "0028_in_flight_versions"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AddField(model_name="agentrun", name="metadata", field=METADATA_FIELD),
            ],
            database_operations=[
                migrations.RunPython(add_metadata, remove_metadata, atomic=False),
            ],
        ),
    ]
