"""Concurrency keys: at most a key's limit of runs with that key running at once, fleet-wide,
and the claim fair across keys within a priority.

- ``agent_run.concurrency_key`` (varchar(200) NULL) and ``agent_run.concurrency_limit``
  (integer NULL, the agent's limit pinned at start): nullable without a default, so adding
  them changes only the catalogue.
- ``agent_run.fair_at`` (timestamptz NOT NULL DEFAULT statement_timestamp(), as
  ``created_at``): a run's turn among the runs of its priority. On PostgreSQL 11 and later a
  column with a non-volatile default rewrites nothing: the existing runs all get the
  migration's instant, so among them the claim's tie-break, ``created_at``, keeps their order,
  and every run started later comes after them, as before. Code deployed before the column
  existed keeps inserting runs (a rolling deploy).
- ``agent_concurrency_key``: one row per key (its fair-share clock; claims of the key's runs
  lock it to count the key's running runs race-free).
- ``agent_concurrency_held(key)`` and ``agent_concurrency_holders(key)``, PostgreSQL: the key's
  running runs with a live lease, counted on a fresh snapshot when the claim evaluates it
  (VOLATILE; store/concurrency.py explains why the claim needs that), and on the claim
  statement's own (STABLE, the cheap filter of its candidates).
- ``agent_run_notify_key_freed``, PostgreSQL: a keyed run that stops running (it ends or
  parks) notifies the workers, as a new run does: one of its key's pending runs may now be
  claimable.
- Indexes: ``agent_run_claim_fair`` on ``(priority DESC, fair_at, created_at) WHERE status IN
  ('pending', 'running')``, which the claim reads in order and stops at its LIMIT;
  ``agent_run_key_running`` on ``(concurrency_key) WHERE status = 'running'`` (a claim counts
  a key's holders from it); ``agent_run_key`` on ``(concurrency_key, created_at)`` for the
  admin's runs list filtered by key. The claim indexes of the previous releases stay: their
  workers read them during a rolling deploy, and do not enforce limits (upgrade every worker
  before relying on a limit).

Every ALTER and CREATE TRIGGER on agent_run waits at most LOCK_TIMEOUT for its lock and is
tried again, so that a long transaction holding ``agent_run`` never queues every claim,
heartbeat and commit behind the migration. On PostgreSQL the indexes are built with CREATE
INDEX CONCURRENTLY: workers go on claiming meanwhile. Hence ``atomic = False``. The migration
can be interrupted and run again, on every database: a column or table is added only if
missing, the function and trigger are replaced, an index that exists is kept, and one that a
previous attempt left INVALID is dropped and built again.
"""

from __future__ import annotations

import time
from typing import Any

from django.db import OperationalError, migrations, models
from django.db.models.functions import Now

CLAIM_FAIR = models.Index(
    fields=["-priority", "fair_at", "created_at"],
    name="agent_run_claim_fair",
    condition=models.Q(status__in=["pending", "running"]),
)
KEY_RUNNING = models.Index(
    fields=["concurrency_key"],
    name="agent_run_key_running",
    condition=models.Q(status="running", concurrency_key__isnull=False),
)
KEY_INDEX = models.Index(
    fields=["concurrency_key", "created_at"],
    name="agent_run_key",
    condition=models.Q(concurrency_key__isnull=False),
)

# The new columns, as the state has them. SQLite adds them through the schema editor, in this
# order: fair_at rebuilds the table (a default that is not a constant) from the model as it
# was, which would drop a column added before it; the nullable ones are plain ALTERs.
FIELDS: dict[str, models.Field[Any, Any]] = {
    "fair_at": models.DateTimeField(
        db_default=Now(), editable=False, help_text="its turn among the runs of its priority"
    ),
    "concurrency_key": models.CharField(blank=True, editable=False, max_length=200, null=True),
    "concurrency_limit": models.IntegerField(blank=True, editable=False, null=True),
}
# The same on PostgreSQL, spelled out (no CHECK constraint: validating one would scan the
# table under the ALTER's lock; ``Agent`` checks the limit).
COLUMNS = {
    "concurrency_key": 'ALTER TABLE "agent_run" ADD COLUMN "concurrency_key" varchar(200) NULL',
    "concurrency_limit": 'ALTER TABLE "agent_run" ADD COLUMN "concurrency_limit" integer NULL',
    "fair_at": 'ALTER TABLE "agent_run" ADD COLUMN "fair_at" timestamp with time zone'
    " DEFAULT STATEMENT_TIMESTAMP() NOT NULL",
}

# The running runs of a key whose lease is live, twice. agent_concurrency_held is VOLATILE: in
# READ COMMITTED each call counts on a snapshot of its own, taken when it is called; the claim
# calls it while holding, or after waiting for, the key's row. agent_concurrency_holders is
# STABLE: it counts on the calling statement's snapshot, as a subquery would, for the claim's
# cheap filter of its candidates; a function rather than a subquery because the planner then
# prices the filter at what it costs when runs have no key (nothing), not at an index scan
# per row, which priced the claim high enough to be compiled (JIT) on every call. PL/pgSQL
# keeps the plan of its query for the session (an SQL function plans it for every statement).
HELD_FUNCTIONS = """
CREATE OR REPLACE FUNCTION agent_concurrency_held(held_key text) RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    RETURN (SELECT count(*) FROM agent_run
             WHERE concurrency_key = held_key
               AND status = 'running'
               AND lease_until >= now());
END
$$;
CREATE OR REPLACE FUNCTION agent_concurrency_holders(held_key text) RETURNS bigint
LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN (SELECT count(*) FROM agent_run
             WHERE concurrency_key = held_key
               AND status = 'running'
               AND lease_until >= now());
END
$$;
"""

KEY_FREED_TRIGGER = """
CREATE TRIGGER agent_run_notify_key_freed
    AFTER UPDATE OF status ON agent_run
    FOR EACH ROW WHEN (
        OLD.status = 'running' AND NEW.status NOT IN ('running', 'pending', 'cancelled')
        AND NEW.concurrency_key IS NOT NULL
    )
    EXECUTE FUNCTION durable_agents_notify()
"""

# How long an ALTER or CREATE TRIGGER waits for its lock on agent_run before it gives up and
# tries again, and how many times it tries.
LOCK_TIMEOUT = "3s"
LOCK_ATTEMPTS = 20
LOCK_NOT_AVAILABLE = "55P03"  # PostgreSQL's SQLSTATE for lock_not_available


def _is_postgres(schema_editor: Any) -> bool:
    return bool(schema_editor.connection.vendor == "postgresql")


def _columns(schema_editor: Any) -> set[str]:
    connection = schema_editor.connection
    with connection.cursor() as cursor:
        return {c.name for c in connection.introspection.get_table_description(cursor, "agent_run")}


def _briefly(schema_editor: Any, *statements: str) -> None:
    """Run ``statements`` in one transaction on PostgreSQL with a short lock_timeout, again
    until they get their lock: while one waits, every statement on agent_run queues behind."""
    connection = schema_editor.connection
    for attempt in range(1, LOCK_ATTEMPTS + 1):
        try:
            with connection.cursor() as cursor:
                cursor.execute("BEGIN")
                try:
                    cursor.execute(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'")
                    for statement in statements:
                        cursor.execute(statement)
                except BaseException:
                    cursor.execute("ROLLBACK")
                    raise
                cursor.execute("COMMIT")
            return
        except OperationalError as exc:
            lost = getattr(exc.__cause__, "sqlstate", None) == LOCK_NOT_AVAILABLE
            if not lost or attempt == LOCK_ATTEMPTS:
                raise
            time.sleep(1.0)


def add_columns(apps: Any, schema_editor: Any) -> None:
    present = _columns(schema_editor)
    model = apps.get_model("durable_agents", "AgentRun")  # without the new columns
    for name in FIELDS:
        if name in present:
            continue
        if _is_postgres(schema_editor):
            _briefly(schema_editor, COLUMNS[name])
        else:  # SQLite: Django rebuilds the table for the database default
            field = FIELDS[name].clone()
            field.set_attributes_from_name(name)
            field.model = model
            schema_editor.add_field(model, field)


def remove_columns(apps: Any, schema_editor: Any) -> None:
    present = _columns(schema_editor)
    for name in reversed(list(FIELDS)):
        if name in present:
            schema_editor.execute(f'ALTER TABLE "agent_run" DROP COLUMN "{name}"')


def add_key_table(apps: Any, schema_editor: Any) -> None:
    connection = schema_editor.connection
    with connection.cursor() as cursor:
        tables = connection.introspection.table_names(cursor)
    if "agent_concurrency_key" not in tables:
        schema_editor.create_model(apps.get_model("durable_agents", "ConcurrencyKey"))


def remove_key_table(apps: Any, schema_editor: Any) -> None:
    schema_editor.execute('DROP TABLE IF EXISTS "agent_concurrency_key"')


def add_functions(apps: Any, schema_editor: Any) -> None:
    if not _is_postgres(schema_editor):
        return
    schema_editor.execute(HELD_FUNCTIONS)
    _briefly(
        schema_editor,
        "DROP TRIGGER IF EXISTS agent_run_notify_key_freed ON agent_run",
        KEY_FREED_TRIGGER,
    )


def remove_functions(apps: Any, schema_editor: Any) -> None:
    if not _is_postgres(schema_editor):
        return
    _briefly(schema_editor, "DROP TRIGGER IF EXISTS agent_run_notify_key_freed ON agent_run")
    schema_editor.execute("DROP FUNCTION IF EXISTS agent_concurrency_held(text)")
    schema_editor.execute("DROP FUNCTION IF EXISTS agent_concurrency_holders(text)")


def _valid(schema_editor: Any, name: str) -> bool | None:
    """Whether the index ``name`` is valid on PostgreSQL (True elsewhere), None if absent."""
    with schema_editor.connection.cursor() as cursor:
        if not _is_postgres(schema_editor):
            found = schema_editor.connection.introspection.get_constraints(cursor, "agent_run")
            return True if name in found else None
        cursor.execute(
            "SELECT i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid"
            " WHERE c.relname = %s AND pg_catalog.pg_table_is_visible(c.oid)",
            [name],
        )
        row = cursor.fetchone()
    return None if row is None else bool(row[0])


def _build(apps: Any, schema_editor: Any, index: models.Index) -> None:
    """Build ``index`` unless it exists and is valid; on PostgreSQL without blocking writes."""
    valid = _valid(schema_editor, index.name)
    if valid:
        return
    model = apps.get_model("durable_agents", "AgentRun")
    if not _is_postgres(schema_editor):
        schema_editor.add_index(model, index)
        return
    if valid is False:  # left INVALID by an interrupted build
        schema_editor.execute(f'DROP INDEX CONCURRENTLY IF EXISTS "{index.name}"')
    schema_editor.execute(str(index.create_sql(model, schema_editor, concurrently=True)))


def add_indexes(apps: Any, schema_editor: Any) -> None:
    for index in (CLAIM_FAIR, KEY_RUNNING, KEY_INDEX):
        _build(apps, schema_editor, index)


def remove_indexes(apps: Any, schema_editor: Any) -> None:
    concurrently = " CONCURRENTLY" if _is_postgres(schema_editor) else ""
    for index in (KEY_INDEX, KEY_RUNNING, CLAIM_FAIR):
        schema_editor.execute(f'DROP INDEX{concurrently} IF EXISTS "{index.name}"')


class Migration(migrations.Migration):
    atomic = False  # CREATE INDEX CONCURRENTLY cannot run inside a transaction

    dependencies = [
        ("durable_agents", "0011_run_cost"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AddField(model_name="agentrun", name=name, field=field.clone())
                for name, field in FIELDS.items()
            ],
            database_operations=[
                migrations.RunPython(add_columns, remove_columns, atomic=False),
            ],
        ),
        # The table in the state first: add_key_table creates it from the state's model.
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.CreateModel(
                    name="ConcurrencyKey",
                    fields=[
                        (
                            "key",
                            models.CharField(max_length=200, primary_key=True, serialize=False),
                        ),
                        ("next_fair_at", models.DateTimeField(db_default=Now())),
                        ("claimed_at", models.DateTimeField(blank=True, null=True)),
                    ],
                    options={"db_table": "agent_concurrency_key"},
                ),
            ],
        ),
        migrations.RunPython(add_key_table, remove_key_table, atomic=False),
        migrations.RunPython(add_functions, remove_functions, atomic=False),
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AddIndex(model_name="agentrun", index=CLAIM_FAIR),
                migrations.AddIndex(model_name="agentrun", index=KEY_RUNNING),
                migrations.AddIndex(model_name="agentrun", index=KEY_INDEX),
            ],
            database_operations=[
                migrations.RunPython(add_indexes, remove_indexes, atomic=False),
            ],
        ),
    ]
