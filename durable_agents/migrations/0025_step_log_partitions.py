"""The step log in day partitions on PostgreSQL; a ``part`` column everywhere.

On PostgreSQL the plain ``agent_step`` becomes the legacy partition of a new ``agent_step``
partitioned by day (``store/step_partitions.py`` names each step of ``convert``): nothing
is rewritten, the only exclusive locks are catalogue changes of a few milliseconds (each
waiting at most two seconds for its lock, then tried again), and workers go on committing
throughout. Building the new primary key and validating two CHECKs read the whole table, under
locks that let commits go on: on a large log, expect minutes. Re-runnable if killed.

Elsewhere (SQLite) the table gains the column and loses its foreign key to ``agent_run`` like
any other field change.
"""

from __future__ import annotations

from typing import Any

import django.db.models.deletion
from django.db import migrations, models

import durable_agents.models
from durable_agents.models import step_partitions

FIELD_CHANGES = [
    migrations.AddField(
        model_name="agentstep",
        name="part",
        field=durable_agents.models.StepPartField(default=0, editable=False),
    ),
    migrations.AlterField(
        model_name="agentstep",
        name="run",
        field=models.ForeignKey(
            db_constraint=False,
            db_index=False,
            on_delete=django.db.models.deletion.DO_NOTHING,
            related_name="steps",
            to="durable_agents.agentrun",
        ),
    ),
]


class PartitionStepLog(migrations.operations.base.Operation):
    """FIELD_CHANGES in the state; in the database, PostgreSQL's partitions or the plain field
    changes."""

    reversible = True
    reduces_to_sql = False

    def state_forwards(self, app_label: str, state: Any) -> None:
        for change in FIELD_CHANGES:
            change.state_forwards(app_label, state)

    def database_forwards(
        self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any
    ) -> None:
        if schema_editor.connection.vendor == "postgresql":
            step_partitions.convert(schema_editor.connection)
            return
        self._each(app_label, schema_editor, from_state, backwards=False)

    def database_backwards(
        self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any
    ) -> None:
        if schema_editor.connection.vendor == "postgresql":
            step_partitions.unconvert(schema_editor.connection)
            return
        self._each(app_label, schema_editor, to_state, backwards=True)

    @staticmethod
    def _each(app_label: str, schema_editor: Any, start: Any, backwards: bool) -> None:
        """The field changes one after the other, each between its own states (as
        SeparateDatabaseAndState applies its database operations)."""
        states = [start]
        for change in FIELD_CHANGES:
            state = states[-1].clone()
            change.state_forwards(app_label, state)
            states.append(state)
        steps = list(zip(FIELD_CHANGES, states[:-1], states[1:], strict=True))
        for change, before, after in reversed(steps) if backwards else steps:
            if backwards:
                change.database_backwards(app_label, schema_editor, after, before)
            else:
                change.database_forwards(app_label, schema_editor, before, after)

    def describe(self) -> str:
        return "Partition agent_step by day on PostgreSQL (a part column elsewhere)"


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY; each step commits on its own

    dependencies = [
        ("durable_agents", "0024_run_ids_by_time"),
    ]

    operations = [PartitionStepLog()]
