"""``agent_run_id_tail``: an index on the last 8 hex digits of a run's id, as text.

The admin shows a time-ordered run (migration 0024) by those digits, its short id: the first
ones are the millisecond it was made, the same for every run of a minute. The primary key is
ordered by the first digits, so finding a run by its last ones needs an index of its own.
``RIGHT(id::text, 8)`` on PostgreSQL, where the text has dashes but its last 12 characters are
one group without any; ``SUBSTR(CAST(id AS text), -8)`` on SQLite, which stores the 32 hex
digits: the same digits on both.

The index is built CONCURRENTLY on PostgreSQL (hence ``atomic = False``), so a deployment with
millions of runs goes on claiming and committing meanwhile; an INVALID index left by an
interrupted build is dropped and built again.
"""

from __future__ import annotations

from typing import Any

from django.db import migrations, models
from django.db.models.functions import Cast, Right

ID_TAIL_INDEX = models.Index(
    Right(Cast("id", output_field=models.TextField()), 8), name="agent_run_id_tail"
)


def create_id_tail_index(apps: Any, schema_editor: Any) -> None:
    model = apps.get_model("durable_agents", "AgentRun")
    if schema_editor.connection.vendor != "postgresql":
        schema_editor.add_index(model, ID_TAIL_INDEX)
        return
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(
            "SELECT i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid"
            " WHERE c.relname = %s AND pg_catalog.pg_table_is_visible(c.oid)",
            [ID_TAIL_INDEX.name],
        )
        row = cursor.fetchone()
        if row is not None and row[0]:
            return
        if row is not None:
            cursor.execute(f'DROP INDEX CONCURRENTLY IF EXISTS "{ID_TAIL_INDEX.name}"')
        cursor.execute(str(ID_TAIL_INDEX.create_sql(model, schema_editor, concurrently=True)))


def drop_id_tail_index(apps: Any, schema_editor: Any) -> None:
    schema_editor.remove_index(apps.get_model("durable_agents", "AgentRun"), ID_TAIL_INDEX)


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY cannot run inside a transaction

    dependencies = [
        ("durable_agents", "0025_step_log_partitions"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[migrations.AddIndex(model_name="agentrun", index=ID_TAIL_INDEX)],
            database_operations=[
                migrations.RunPython(create_id_tail_index, drop_id_tail_index, atomic=False),
            ],
        ),
    ]
