"""``agent_run.root_id``: the root of a child run's tree (NULL for a root), which spawn_run
counts a tree's runs by (MAX_TREE_RUNS), and its partial index ``agent_run_root``.

A nullable column without a default: PostgreSQL changes its catalogue only. The index is
built CONCURRENTLY on PostgreSQL (hence ``atomic = False``), so a deployment with millions of
runs goes on claiming and committing meanwhile; an INVALID index left by an interrupted build
is dropped and built again. Child runs created before this migration have no root_id: they do
not count toward their tree's MAX_TREE_RUNS.
"""

from __future__ import annotations

from typing import Any

from django.db import migrations, models

ROOT_INDEX = models.Index(
    fields=["root_id"], name="agent_run_root", condition=models.Q(root_id__isnull=False)
)


def create_root_index(apps: Any, schema_editor: Any) -> None:
    model = apps.get_model("durable_agents", "AgentRun")
    if schema_editor.connection.vendor != "postgresql":
        schema_editor.add_index(model, ROOT_INDEX)
        return
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(
            "SELECT i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid"
            " WHERE c.relname = %s AND pg_catalog.pg_table_is_visible(c.oid)",
            [ROOT_INDEX.name],
        )
        row = cursor.fetchone()
        if row is not None and row[0]:
            return
        if row is not None:
            cursor.execute(f'DROP INDEX CONCURRENTLY IF EXISTS "{ROOT_INDEX.name}"')
        cursor.execute(str(ROOT_INDEX.create_sql(model, schema_editor, concurrently=True)))


def drop_root_index(apps: Any, schema_editor: Any) -> None:
    schema_editor.remove_index(apps.get_model("durable_agents", "AgentRun"), ROOT_INDEX)


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY cannot run inside a transaction

    dependencies = [
        ("durable_agents", "0013_key_budget"),
    ]

    operations = [
        migrations.AddField(
            model_name="agentrun",
            name="root_id",
            field=models.UUIDField(blank=True, editable=False, null=True),
        ),
        migrations.SeparateDatabaseAndState(
            state_operations=[migrations.AddIndex(model_name="agentrun", index=ROOT_INDEX)],
            database_operations=[
                migrations.RunPython(create_root_index, drop_root_index, atomic=False),
            ],
        ),
    ]
