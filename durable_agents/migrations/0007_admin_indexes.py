"""The indexes of the admin at production size (docs/howto/admin-at-scale.md, "The admin at ten million
runs").

- Six B-tree indexes on agent_run: the list newest first, by agent, by model, finished runs
  by time, the dead letter by cause, waiting runs by kind and age. None of their columns
  changes while a worker claims, renews or commits, so those updates stay HOT. Two on
  tool_intent: newest first, and by tool.
- On PostgreSQL only: the pg_trgm extension and three indexes of the admin's search: words of
  tasks (a trigram GIN index on the task step, which is written once and never updated, unlike
  the run row that every claim rewrites), reasons of dead and failed runs (trigram GIN,
  partial), request id prefixes (varchar_pattern_ops).

On PostgreSQL every index is built with CREATE INDEX CONCURRENTLY, so that a deployment with
millions of runs goes on claiming and committing meanwhile; hence ``atomic = False``. The
migration can be interrupted and run again: an index that a previous attempt left INVALID is
dropped and built again, a valid one is kept. Without the right to create pg_trgm it says so
and goes on without the two trigram indexes: search still works, by scanning.
"""

from __future__ import annotations

import sys
from typing import Any

from django.db import migrations, models

RUN_INDEXES = [
    models.Index(fields=["created_at"], name="agent_run_created"),
    models.Index(fields=["agent", "created_at"], name="agent_run_agent"),
    models.Index(fields=["model", "created_at"], name="agent_run_model"),
    models.Index(
        fields=["finished_at"],
        name="agent_run_finished",
        condition=models.Q(finished_at__isnull=False),
    ),
    models.Index(
        fields=["dead_cause", "created_at"],
        name="agent_run_dead_cause",
        condition=models.Q(status="dead"),
    ),
    models.Index(
        fields=["waiting_for", "waiting_since"],
        name="agent_run_waiting",
        condition=models.Q(status="waiting"),
    ),
]

INTENT_INDEXES = [
    models.Index(fields=["created_at"], name="tool_intent_created"),
    models.Index(fields=["tool", "created_at"], name="tool_intent_tool"),
]

# (model name, index): what create_model_indexes builds.
MODEL_INDEXES = [("AgentRun", index) for index in RUN_INDEXES] + [
    ("ToolIntent", index) for index in INTENT_INDEXES
]

# (name, statement, needs pg_trgm): PostgreSQL only.
SEARCH_INDEXES = (
    (
        "agent_step_task_trgm",
        "CREATE INDEX CONCURRENTLY agent_step_task_trgm ON agent_step"
        " USING gin (payload gin_trgm_ops) WHERE kind = 'task'",
        True,
    ),
    (
        "agent_run_error_trgm",
        "CREATE INDEX CONCURRENTLY agent_run_error_trgm ON agent_run"
        " USING gin (error gin_trgm_ops) WHERE status IN ('dead', 'failed')",
        True,
    ),
    (
        "agent_step_request_id_prefix",
        "CREATE INDEX CONCURRENTLY agent_step_request_id_prefix ON agent_step"
        " (request_id varchar_pattern_ops) WHERE request_id IS NOT NULL",
        False,
    ),
)


def _is_postgres(schema_editor: Any) -> bool:
    return bool(schema_editor.connection.vendor == "postgresql")


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


def create_model_indexes(apps: Any, schema_editor: Any) -> None:
    for model_name, index in MODEL_INDEXES:
        model = apps.get_model("durable_agents", model_name)
        if _is_postgres(schema_editor):
            sql = str(index.create_sql(model, schema_editor, concurrently=True))
            _build_concurrently(schema_editor, index.name, sql)
        else:
            schema_editor.add_index(model, index)


def drop_model_indexes(apps: Any, schema_editor: Any) -> None:
    for model_name, index in MODEL_INDEXES:
        schema_editor.remove_index(apps.get_model("durable_agents", model_name), index)


def create_search_indexes(apps: Any, schema_editor: Any) -> None:
    if not _is_postgres(schema_editor):
        return  # SQLite: search scans, and says nothing about speed
    with schema_editor.connection.cursor() as cursor:
        try:
            cursor.execute("CREATE EXTENSION IF NOT EXISTS pg_trgm")
            trigrams = True
        except Exception as exc:  # noqa: BLE001 - any refusal (privilege, not installed)
            trigrams = False
            sys.stderr.write(
                "durable_agents 0007: could not create the pg_trgm extension "
                f"({exc.__class__.__name__}: {str(exc).strip()}). The admin's search by words "
                "of a task or an error scans instead of using an index; docs/howto/admin-at-scale.md "
                "('The admin at ten million runs') says how to add it later.\n"
            )
    for name, statement, needs_trigrams in SEARCH_INDEXES:
        if trigrams or not needs_trigrams:
            _build_concurrently(schema_editor, name, statement)


def drop_search_indexes(apps: Any, schema_editor: Any) -> None:
    if not _is_postgres(schema_editor):
        return
    with schema_editor.connection.cursor() as cursor:
        for name, _statement, _needs_trigrams in SEARCH_INDEXES:
            cursor.execute(f'DROP INDEX CONCURRENTLY IF EXISTS "{name}"')
    # pg_trgm stays: other apps of the database may use it.


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY cannot run inside a transaction

    dependencies = [
        ("durable_agents", "0006_run_dead_cause"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AddIndex(model_name=model_name.lower(), index=index)
                for model_name, index in MODEL_INDEXES
            ],
            database_operations=[
                migrations.RunPython(create_model_indexes, drop_model_indexes, atomic=False),
            ],
        ),
        migrations.RunPython(create_search_indexes, drop_search_indexes, atomic=False),
    ]
