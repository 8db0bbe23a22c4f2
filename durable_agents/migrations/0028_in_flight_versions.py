"""``agent_run_in_flight_version``: (agent, prompt_version, status, created_at) of the runs in
flight.

The fleet's view of versions reads it: which agent versions pending and waiting runs need (the
operations page, ``durable_agents_deploycheck``, the housekeeping sweep) and which runs an
upgrade moves, without reading the finished runs of an agent; the operations page counts them
by version and status, with the oldest, from the index alone. A partial index: only pending,
running and waiting runs are in it, a small share of the table in production.

Built CONCURRENTLY on PostgreSQL (hence ``atomic = False``), so a deployment with millions of
runs goes on claiming and committing meanwhile; an INVALID index left by an interrupted build
is dropped and built again.
"""

from __future__ import annotations

from typing import Any

from django.db import migrations, models

IN_FLIGHT_VERSION_INDEX = models.Index(
    fields=["agent", "prompt_version", "status", "created_at"],
    name="agent_run_in_flight_version",
    condition=models.Q(status__in=["pending", "running", "waiting"]),
)


def create_index(apps: Any, schema_editor: Any) -> None:
    model = apps.get_model("durable_agents", "AgentRun")
    if schema_editor.connection.vendor != "postgresql":
        schema_editor.add_index(model, IN_FLIGHT_VERSION_INDEX)
        return
    name = IN_FLIGHT_VERSION_INDEX.name
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
        sql = IN_FLIGHT_VERSION_INDEX.create_sql(model, schema_editor, concurrently=True)
        cursor.execute(str(sql))


def drop_index(apps: Any, schema_editor: Any) -> None:
    schema_editor.remove_index(
        apps.get_model("durable_agents", "AgentRun"), IN_FLIGHT_VERSION_INDEX
    )


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY cannot run inside a transaction

    dependencies = [
        ("durable_agents", "0027_workers"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AddIndex(model_name="agentrun", index=IN_FLIGHT_VERSION_INDEX)
            ],
            database_operations=[migrations.RunPython(create_index, drop_index)],
        ),
    ]
