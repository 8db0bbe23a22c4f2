"""Run priorities: the column ``agent_run.priority`` and the claim index in priority order.

- ``priority``: smallint NOT NULL with the database default 0. On PostgreSQL 11 and later,
  adding a column with a constant default rewrites nothing (a brief exclusive lock, no scan),
  and code deployed before the column existed keeps inserting runs (at 0): a rolling deploy.
  No CHECK constraint on purpose: validating one would scan the table under that lock;
  ``start_run`` checks the range (0 to 100).
- ``agent_run_priority`` on ``(priority, created_at)``: the admin's runs list filtered by
  priority, newest first, and the filter's values found by a skip scan.
- ``agent_run_claim`` becomes ``(priority DESC, created_at) WHERE status IN ('pending',
  'running')``, so that the claim still reads one index in its order and stops at its LIMIT.

On PostgreSQL the new index is built with CREATE INDEX CONCURRENTLY under a temporary name,
then the old one is dropped CONCURRENTLY and the new one renamed: workers go on claiming
meanwhile (with the old index, then the new). Hence ``atomic = False``. The migration can be
interrupted and run again: the column is added only if missing, an index that a previous
attempt left INVALID is dropped and built again, and a claim index already in priority order
is kept.
"""

from __future__ import annotations

from typing import Any

from django.db import migrations, models

CLAIM_CONDITION = models.Q(status__in=["pending", "running"])
# The claim index before and after, and the name the new one is built under on PostgreSQL.
OLD_CLAIM_INDEX = models.Index(
    fields=["created_at"], name="agent_run_claim", condition=CLAIM_CONDITION
)
NEW_CLAIM_INDEX = models.Index(
    fields=["-priority", "created_at"], name="agent_run_claim", condition=CLAIM_CONDITION
)
BUILDING = "agent_run_claim_building"
PRIORITY_INDEX = models.Index(fields=["priority", "created_at"], name="agent_run_priority")


def _has_priority(schema_editor: Any) -> bool:
    with schema_editor.connection.cursor() as cursor:
        columns = schema_editor.connection.introspection.get_table_description(
            cursor, "agent_run"
        )
    return any(column.name == "priority" for column in columns)


def add_priority(apps: Any, schema_editor: Any) -> None:
    if not _has_priority(schema_editor):
        schema_editor.execute(
            "ALTER TABLE agent_run ADD COLUMN priority smallint DEFAULT 0 NOT NULL"
        )


def remove_priority(apps: Any, schema_editor: Any) -> None:
    if _has_priority(schema_editor):
        schema_editor.execute("ALTER TABLE agent_run DROP COLUMN priority")


def _index_state(cursor: Any, name: str) -> tuple[bool, str] | None:
    """(valid, definition) of the index ``name``, or None when there is none."""
    cursor.execute(
        "SELECT i.indisvalid, pg_get_indexdef(i.indexrelid) FROM pg_index i"
        " JOIN pg_class c ON c.oid = i.indexrelid"
        " WHERE c.relname = %s AND pg_catalog.pg_table_is_visible(c.oid)",
        [name],
    )
    row = cursor.fetchone()
    return None if row is None else (bool(row[0]), str(row[1]))


def _swap_concurrently(apps: Any, schema_editor: Any, index: models.Index) -> None:
    """Make ``agent_run_claim`` the index ``index`` without blocking writes: build it under
    another name, drop the old one, rename."""
    by_priority = index is NEW_CLAIM_INDEX
    model = apps.get_model("durable_agents", "AgentRun")
    with schema_editor.connection.cursor() as cursor:
        current = _index_state(cursor, index.name)
        if current is not None and current[0] and ("priority" in current[1]) == by_priority:
            return  # done already (a run of this migration that was interrupted at the end)
        building = _index_state(cursor, BUILDING)
        if building is not None and not building[0]:
            cursor.execute(f'DROP INDEX CONCURRENTLY IF EXISTS "{BUILDING}"')
        if building is None or not building[0]:
            temporary = models.Index(
                fields=index.fields, name=BUILDING, condition=index.condition
            )
            cursor.execute(str(temporary.create_sql(model, schema_editor, concurrently=True)))
        cursor.execute(f'DROP INDEX CONCURRENTLY IF EXISTS "{index.name}"')
        cursor.execute(f'ALTER INDEX "{BUILDING}" RENAME TO "{index.name}"')


def _swap(apps: Any, schema_editor: Any, old: models.Index, new: models.Index) -> None:
    if schema_editor.connection.vendor == "postgresql":
        _swap_concurrently(apps, schema_editor, new)
        return
    model = apps.get_model("durable_agents", "AgentRun")
    schema_editor.remove_index(model, old)
    schema_editor.add_index(model, new)


def add_priority_index(apps: Any, schema_editor: Any) -> None:
    model = apps.get_model("durable_agents", "AgentRun")
    if schema_editor.connection.vendor != "postgresql":
        schema_editor.add_index(model, PRIORITY_INDEX)
        return
    with schema_editor.connection.cursor() as cursor:
        state = _index_state(cursor, PRIORITY_INDEX.name)
        if state is not None and state[0]:
            return
        if state is not None:  # left INVALID by an interrupted build
            cursor.execute(f'DROP INDEX CONCURRENTLY IF EXISTS "{PRIORITY_INDEX.name}"')
        cursor.execute(str(PRIORITY_INDEX.create_sql(model, schema_editor, concurrently=True)))


def remove_priority_index(apps: Any, schema_editor: Any) -> None:
    schema_editor.remove_index(apps.get_model("durable_agents", "AgentRun"), PRIORITY_INDEX)


def claim_index_by_priority(apps: Any, schema_editor: Any) -> None:
    _swap(apps, schema_editor, OLD_CLAIM_INDEX, NEW_CLAIM_INDEX)


def claim_index_by_age(apps: Any, schema_editor: Any) -> None:
    _swap(apps, schema_editor, NEW_CLAIM_INDEX, OLD_CLAIM_INDEX)


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
                migrations.RemoveIndex(model_name="agentrun", name="agent_run_claim"),
                migrations.AddIndex(model_name="agentrun", index=NEW_CLAIM_INDEX),
            ],
            database_operations=[
                migrations.RunPython(claim_index_by_priority, claim_index_by_age, atomic=False),
            ],
        ),
        migrations.SeparateDatabaseAndState(
            state_operations=[migrations.AddIndex(model_name="agentrun", index=PRIORITY_INDEX)],
            database_operations=[
                migrations.RunPython(add_priority_index, remove_priority_index, atomic=False),
            ],
        ),
    ]
