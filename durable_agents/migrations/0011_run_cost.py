"""What runs cost: the column ``agent_run.cost_usd`` and the daily rollup ``agent_usage_day``.

- ``cost_usd``: numeric(20, 9), nullable, no default. Adding it changes only PostgreSQL's
  catalogue (no rewrite, no scan), at once whatever the size of ``agent_run``; existing runs
  keep NULL ("no price": their turns were committed before costs were counted). Workers of the
  previous release, which do not know the column, go on committing: a rolling deploy works,
  and their turns are not priced. The ALTER waits at most LOCK_TIMEOUT for its lock and is
  tried again, so that a long transaction holding ``agent_run`` never queues every claim,
  heartbeat and commit behind the migration.
- ``agent_usage_day``: a new, empty table (model turns, tokens and cost by UTC day,
  concurrency key, agent, model and shard) with its unique index ``agent_usage_day_key``,
  which the statement that commits a model turn upserts into. Nothing existing is locked.

Not one transaction, and re-runnable on every database: the column is added only if it is
missing and the table created only if it does not exist, so an interrupted run is finished by
running ``migrate`` again.
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

COST_FIELD = models.DecimalField(
    blank=True,
    decimal_places=9,
    help_text="what its model turns cost, in USD, at the PRICES setting",
    max_digits=20,
    null=True,
)
USAGE_KEY = models.UniqueConstraint(
    fields=["day", "concurrency_key", "agent", "model", "shard"], name="agent_usage_day_key"
)


def _is_postgres(schema_editor: Any) -> bool:
    return bool(schema_editor.connection.vendor == "postgresql")


def _has_cost(schema_editor: Any) -> bool:
    connection = schema_editor.connection
    with connection.cursor() as cursor:
        columns = connection.introspection.get_table_description(cursor, "agent_run")
    return any(column.name == "cost_usd" for column in columns)


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


def add_cost(apps: Any, schema_editor: Any) -> None:
    if _has_cost(schema_editor):
        return
    column_type = COST_FIELD.db_type(schema_editor.connection)  # numeric(20, 9) / decimal
    statement = f'ALTER TABLE "agent_run" ADD COLUMN "cost_usd" {column_type} NULL'
    if _is_postgres(schema_editor):
        _alter_briefly(schema_editor, statement)
    else:
        schema_editor.execute(statement)


def remove_cost(apps: Any, schema_editor: Any) -> None:
    if _has_cost(schema_editor):
        schema_editor.execute('ALTER TABLE "agent_run" DROP COLUMN "cost_usd"')


def create_usage_day(apps: Any, schema_editor: Any) -> None:
    tables = schema_editor.connection.introspection.table_names()
    if "agent_usage_day" not in tables:
        schema_editor.create_model(apps.get_model("durable_agents", "AgentUsageDay"))


def drop_usage_day(apps: Any, schema_editor: Any) -> None:
    schema_editor.execute('DROP TABLE IF EXISTS "agent_usage_day"')


class Migration(migrations.Migration):
    atomic = False  # the ALTER's lock is retried statement by statement

    dependencies = [
        ("durable_agents", "0010_model_capacity"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AddField(model_name="agentrun", name="cost_usd", field=COST_FIELD),
            ],
            database_operations=[
                migrations.RunPython(add_cost, remove_cost, atomic=False),
            ],
        ),
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.CreateModel(
                    name="AgentUsageDay",
                    fields=[
                        (
                            "id",
                            models.BigAutoField(
                                auto_created=True,
                                primary_key=True,
                                serialize=False,
                                verbose_name="ID",
                            ),
                        ),
                        ("day", models.DateField()),
                        (
                            "concurrency_key",
                            models.CharField(blank=True, db_default="", default="", max_length=200),
                        ),
                        ("agent", models.CharField(max_length=200)),
                        ("model", models.CharField(max_length=200)),
                        ("shard", models.SmallIntegerField(default=0)),
                        ("turns", models.BigIntegerField(default=0)),
                        ("input_tokens", models.BigIntegerField(default=0)),
                        ("output_tokens", models.BigIntegerField(default=0)),
                        ("cache_read_tokens", models.BigIntegerField(default=0)),
                        ("cache_write_tokens", models.BigIntegerField(default=0)),
                        (
                            "cost_usd",
                            models.DecimalField(
                                blank=True, decimal_places=9, max_digits=20, null=True
                            ),
                        ),
                    ],
                    options={
                        "db_table": "agent_usage_day",
                        "constraints": [USAGE_KEY],
                    },
                ),
            ],
            # Created by the RunPython below, which sees the model in the state it leaves.
            database_operations=[],
        ),
        migrations.RunPython(create_usage_day, drop_usage_day, atomic=False),
    ]
