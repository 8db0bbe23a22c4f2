"""Debounced starts on PostgreSQL: a later call within the window is one statement.

``DEBOUNCE_SQL`` finds the run of the call's agent and start key through the unique index
``agent_run_start_key``, pushes its window back and gives it the call's task and settings,
only while it still waits for its quiet window (the guard), and rewrites its task step, in
one statement and so one transaction: the row lock that orders the push against a claim
(store/portable_debounce.py says how) is held for that statement and its commit alone, so
that calls with one key, which queue on it, follow each other quickly. No row: the run does
not exist yet, or it has started or ended; the ORM's path then creates it, or
returns it unchanged (``portable_debounce.debounce_run``, which ``debounce_run`` here calls).
"""

from __future__ import annotations

from typing import Any

from django.db import connection

from durable_agents._internal import encryption
from durable_agents.models import STEP_PAYLOAD, AgentRun, ConcurrencyKey
from durable_agents.store import portable_debounce
from durable_agents.store.portable_debounce import DEBOUNCED_FIELDS

# ``{fields}``: DEBOUNCED_FIELDS, each set from the parameter of its name.
DEBOUNCE_SQL = """\
WITH pushed AS (
UPDATE agent_run
   SET wake_at = now() + make_interval(secs => %(seconds)s),
       waiting_since = now(),
       updated_at = now(),
{fields}
 WHERE start_key = %(start_key)s
   AND agent = %(agent)s
   AND status = 'waiting'
   AND waiting_for = 'debounce'
RETURNING id
), task_step AS (
UPDATE agent_step
   SET payload = %(payload)s
 WHERE run_id = (SELECT id FROM pushed)
   AND seq = 0
   AND kind = 'task'
)
SELECT id FROM pushed""".format(
    fields=",\n".join(f"       {name} = %({name})s" for name in DEBOUNCED_FIELDS)
)


def debounce_run(run: AgentRun, task_payload: str, seconds: float) -> AgentRun:
    """``PostgresStore.debounce_run``: DEBOUNCE_SQL, else the ORM's path."""
    if connection.in_atomic_block:  # a caller's transaction: the portable path
        return portable_debounce.debounce_run(run, task_payload, seconds)
    if run.concurrency_key is not None:
        # A claim admits a keyed run only through its key's row.
        ConcurrencyKey.objects.get_or_create(key=run.concurrency_key)
    fields = {field.name: field for field in AgentRun._meta.concrete_fields}
    params: dict[str, Any] = {
        name: fields[name].get_db_prep_save(getattr(run, name), connection)
        for name in DEBOUNCED_FIELDS
    }
    params.update(
        seconds=float(seconds),
        start_key=run.start_key,
        agent=run.agent,
        payload=encryption.seal(task_payload, STEP_PAYLOAD),
    )
    with connection.cursor() as cursor:
        cursor.execute(DEBOUNCE_SQL, params)
        row = cursor.fetchone()
    if row is None:
        return portable_debounce.debounce_run(run, task_payload, seconds)
    return AgentRun.objects.get(pk=row[0])
