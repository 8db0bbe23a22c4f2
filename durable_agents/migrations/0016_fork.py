"""Forks: ``agent_run.forked_from`` and ``fork_seq`` (the run a fork was forked from, and the
step), the permission ``fork_agentrun``, and the table ``agent_step_share`` (the steps a fork
reads from the runs it descends from).

Two nullable columns without a default and without a foreign-key constraint (one would scan
agent_run under a lock that stops the workers' commits): PostgreSQL changes its catalogue only.
The partial index ``agent_run_forks`` is built CONCURRENTLY on PostgreSQL (hence ``atomic =
False``); an INVALID index left by an interrupted build is dropped and built again. The new
table is empty, so its constraints cost nothing.
"""

from __future__ import annotations

from typing import Any

import django.db.models.deletion
from django.db import migrations, models

FORKS_INDEX = models.Index(
    fields=["forked_from"],
    name="agent_run_forks",
    condition=models.Q(forked_from__isnull=False),
)


def create_forks_index(apps: Any, schema_editor: Any) -> None:
    model = apps.get_model("durable_agents", "AgentRun")
    if schema_editor.connection.vendor != "postgresql":
        schema_editor.add_index(model, FORKS_INDEX)
        return
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(
            "SELECT i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid"
            " WHERE c.relname = %s AND pg_catalog.pg_table_is_visible(c.oid)",
            [FORKS_INDEX.name],
        )
        row = cursor.fetchone()
        if row is not None and row[0]:
            return
        if row is not None:
            cursor.execute(f'DROP INDEX CONCURRENTLY IF EXISTS "{FORKS_INDEX.name}"')
        cursor.execute(str(FORKS_INDEX.create_sql(model, schema_editor, concurrently=True)))


def drop_forks_index(apps: Any, schema_editor: Any) -> None:
    schema_editor.remove_index(apps.get_model("durable_agents", "AgentRun"), FORKS_INDEX)


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY cannot run inside a transaction

    dependencies = [
        ("durable_agents", "0015_admin_entries"),
    ]

    operations = [
        migrations.AlterModelOptions(
            name="agentrun",
            options={
                "ordering": ["-created_at"],
                "permissions": [
                    (
                        "fork_agentrun",
                        "Can fork agent runs and rerun them with an edited step",
                    )
                ],
            },
        ),
        migrations.AddField(
            model_name="agentrun",
            name="fork_seq",
            field=models.IntegerField(
                blank=True, editable=False, help_text="the step it was forked at", null=True
            ),
        ),
        migrations.AddField(
            model_name="agentrun",
            name="forked_from",
            field=models.ForeignKey(
                blank=True,
                db_constraint=False,
                db_index=False,
                editable=False,
                null=True,
                on_delete=django.db.models.deletion.SET_NULL,
                related_name="forks",
                to="durable_agents.agentrun",
            ),
        ),
        migrations.SeparateDatabaseAndState(
            state_operations=[migrations.AddIndex(model_name="agentrun", index=FORKS_INDEX)],
            database_operations=[
                migrations.RunPython(create_forks_index, drop_forks_index, atomic=False),
            ],
        ),
        migrations.CreateModel(
            name="SharedSteps",
            fields=[
                (
                    "pk",
                    models.CompositePrimaryKey(
                        "fork_id",
                        "lo",
                        blank=True,
                        editable=False,
                        primary_key=True,
                        serialize=False,
                    ),
                ),
                (
                    "fork",
                    models.ForeignKey(
                        db_index=False,
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="+",
                        to="durable_agents.agentrun",
                    ),
                ),
                (
                    "source",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.RESTRICT,
                        related_name="+",
                        to="durable_agents.agentrun",
                    ),
                ),
                ("lo", models.IntegerField()),
                ("hi", models.IntegerField()),
            ],
            options={
                "db_table": "agent_step_share",
                "ordering": ["fork_id", "lo"],
            },
        ),
    ]
