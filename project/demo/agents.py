"""The demo: a database migration agent with one tool of each effect class.

The tools act on an in-memory stand-in for a database so the demo runs anywhere; what matters
is what each effect class means on resume:
- get_schema: pure, simply runs again;
- record_progress: idempotent, running it twice leaves the same state;
- apply_migration_step: non-idempotent, receives a key derived from its position in the run;
- drop_table: irreversible, runs only after a person approved its intent.

A second agent, ``coordinator``, shows runs that wait without a worker: a durable timer
(``wait_for_replica``), child runs it waits for (``survey_tables``) and a question to a person
(the built-in ``ask_person``).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from durable_agents import Agent, Wait, ask_person, progress, spawn_run, tool

logger = logging.getLogger("project.demo")

SCHEMA = {
    "orders": "CREATE TABLE orders (id bigint PRIMARY KEY, customer text, total_cents int)",
    "orders_old": "CREATE TABLE orders_old (id bigint PRIMARY KEY, payload text)",
}


@tool(effect="pure")
def get_schema(table: str) -> str:
    """Return the CREATE TABLE statement of one table."""
    return SCHEMA.get(table, f"-- no table named {table}")


@tool(effect="idempotent")
def record_progress(ticket: str, status: str) -> str:
    """Set the status of the migration ticket."""
    return f"ticket {ticket} is now {status}"


@tool(effect="non_idempotent")
def apply_migration_step(statement: str, *, idempotency_key: str) -> dict:
    """Apply one DDL statement; the key makes a retried call a no-op on the server side."""
    if "orders_archive" in statement:
        # The stand-in database has no archive table: the demo's fork starts from this failure.
        raise LookupError('relation "orders_archive" does not exist')
    logger.info("applying %r with key %s", statement, idempotency_key[:12])
    return {"applied": statement, "idempotency_key": idempotency_key[:12]}


# Quick, so its timeout fits in the shutdown grace (SHUTDOWN_GRACE_SECONDS, 10 s): a worker
# stopped mid-call lets it finish rather than leave its outcome for a person to find out.
@tool(effect="irreversible", timeout=5)
def drop_table(table: str) -> str:
    """Drop a table for good. A staff member approves this in the admin first."""
    logger.info("dropping table %s", table)
    return f"table {table} dropped"


migrator = Agent(
    name="migrator",
    version="2026-12-01",
    model="claude-fable-5-1",
    system=(
        "You are a careful database migration agent. Read the schema before changing it, "
        "apply one statement at a time, record progress on the ticket, and never drop a table "
        "without a person's approval."
    ),
    tools=[get_schema, record_progress, apply_migration_step, drop_table],
    max_tokens=8000,
    thinking={"type": "enabled", "budget_tokens": 4000},
    max_turns=50,
)


# -- long-running runs ----------------------------------------------------------------------


@tool(effect="pure")
def wait_for_replica(seconds: float, *, woken_by: dict | None = None) -> str:
    """Give the read replica ``seconds`` to catch up before going on. No worker waits
    meanwhile: the run is parked on a durable timer."""
    if woken_by is None:
        raise Wait(seconds=seconds)
    return f"waited {seconds:g}s; the replica has caught up"


@tool(effect="idempotent")
def survey_tables(
    tables: list[str], *, idempotency_key: str, woken_by: dict | None = None
) -> list[dict[str, Any]]:
    """Read the schema of several tables in parallel (one child run per table) and report
    what each found."""
    if woken_by is None:
        children = [
            spawn_run(
                "migrator",
                # The second line is the offline model's plan; a real model reads the first.
                f"Read the schema of the {table} table.\n"
                f"@get_schema {json.dumps({'table': table})}",
                key=f"{idempotency_key}:{i}",
            )
            for i, table in enumerate(tables)
        ]
        raise Wait(runs=[child.id for child in children], timeout=600)
    return [
        {"task": o["task"].splitlines()[0], "status": o["status"], "result": o["result"]}
        for o in woken_by["runs"].values()
    ]


coordinator = Agent(
    name="coordinator",
    version="2026-12-03",
    model="claude-fable-5-1",
    system=(
        "You coordinate database maintenance. You wait for replicas instead of hurrying them, "
        "survey tables in parallel, and ask a person whenever a decision is theirs."
    ),
    tools=[wait_for_replica, survey_tables, record_progress, ask_person],
    max_tokens=4000,
    max_turns=20,
)


# -- watched live ---------------------------------------------------------------------------


@tool(effect="pure")
def check_table(table: str) -> str:
    """Check one table, telling whoever watches the run how it goes."""
    for part in ("indexes", "constraints", "row counts"):
        progress(f"{table}: checking {part}")
    return SCHEMA.get(table, f"-- no table named {table}")


narrator = Agent(
    name="narrator",
    version="2026-12-04",
    model="claude-fable-5-1",
    system="You check tables and say what you found, as you go.",
    tools=[check_table, record_progress],
    max_tokens=4000,
    thinking={"type": "enabled", "budget_tokens": 2000},
    # Each turn's text reaches the people watching the run while it comes.
    stream=True,
    max_turns=20,
)
