"""The demo: a database migration agent with one tool of each effect class.

The tools act on an in-memory stand-in for a database so the demo runs anywhere; what matters
is what each effect class means on resume:
- get_schema: pure, simply runs again;
- record_progress: idempotent, running it twice leaves the same state;
- apply_migration_step: non-idempotent, receives a key derived from its position in the run;
- drop_table: irreversible, runs only after a person approved its intent.
"""

from __future__ import annotations

import logging

from durable_agents import Agent, tool

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
    logger.info("applying %r with key %s", statement, idempotency_key[:12])
    return {"applied": statement, "idempotency_key": idempotency_key[:12]}


@tool(effect="irreversible")
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
