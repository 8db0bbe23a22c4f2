"""Firing schedules on PostgreSQL: a look, and one statement per batch of due schedules
(``PostgresStore``'s ``ScheduleStore`` part: plain functions it calls).

    look and take   TAKE_DUE_SQL   the earliest next slot of the schedules that fire, the
                                   clock, and up to a batch of the due ones, locked (FOR
                                   UPDATE SKIP LOCKED: two firers take different schedules);
                                   with nothing due, it is the whole cost of a look
    fire            FIRE_SQL       for every slot of the batch: its concurrency key's turn,
                                   its run (ON CONFLICT DO NOTHING on the start key: a slot
                                   fired twice starts one run), its task step; every
                                   schedule moved on to its next slot with its last run
    move            MOVE_ON_SQL    the schedules alone, after runs started one by one (the
                                   fallback when FIRE_SQL fails: schedules/firing.py)

Both statements run in the firing's transaction: the row locks of the take hold until the
runs and the moves commit together, so a worker that dies between them commits neither.

FIRE_SQL takes three JSON arrays: one object per slot (its run's id, key, task, priority,
concurrency key, template number and sealed task step), one per agent template (the run
columns the agent's version decides, each value prepared once per firing by its field,
read as an ``agent_run`` row), one per schedule (its move). Its column list is every
concrete column of ``agent_run`` but those only the database fills, so a field added to
``AgentRun`` is filled from the template, as ``start_run`` fills it.
"""

from __future__ import annotations

import datetime as dt
import json
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from django.db import connection
from django.db.models import JSONField

from durable_agents._internal import encryption
from durable_agents.models import STEP_PAYLOAD, AgentRun, AgentSchedule
from durable_agents.models.step_partitions import part_of_run
from durable_agents.store.concurrency import FAIR_SPACING
from durable_agents.store.rows import DueSchedules, SlotStart

# The columns of agent_schedule a firing reads, in the model's order (a taken row is built
# from them; the others are deferred: ``updated_at`` is read only for an agent this process
# does not know, and a timestamp costs more Python to read than any other column).
_SCHEDULE_FIELDS = [
    f for f in AgentSchedule._meta.concrete_fields if f.name not in {"created_at", "updated_at"}
]
# The run columns each slot sets itself (the rest come from its agent's template).
_SLOT_COLUMNS = {"id", "task", "start_key", "priority", "concurrency_key", "fair_at"}
# Every column of agent_run but those only the database fills (a database default and no
# default of the model's: created_at, updated_at), as the ORM inserts a new run.
_RUN_FIELDS = [
    f
    for f in AgentRun._meta.concrete_fields
    if getattr(f, "column", None) is not None
    and (f.column in _SLOT_COLUMNS or not f.has_db_default() or f.has_default())
]
_TEMPLATE_FIELDS = [f for f in _RUN_FIELDS if f.column not in _SLOT_COLUMNS]
_RUN_COLUMNS = [str(f.column) for f in _RUN_FIELDS]


def _slot_value(column: str) -> str:
    if column == "id":
        return "s.run_id"
    if column == "fair_at":  # a keyed run's turn; the others' is their creation (its default)
        return "COALESCE(f.fair_at, now())"
    return f"s.{column}"


TAKE_DUE_SQL = """\
SELECT e.earliest, e.clock, {columns}
  FROM (SELECT (SELECT next_slot
                  FROM agent_schedule
                 WHERE enabled AND broken = '' AND next_slot IS NOT NULL
                 ORDER BY next_slot
                 LIMIT 1) AS earliest,
               COALESCE(%(now)s::timestamptz, now()) AS clock) AS e
  LEFT JOIN LATERAL (
       SELECT *
         FROM agent_schedule
        WHERE enabled AND broken = '' AND next_slot <= e.clock
        ORDER BY next_slot
        LIMIT %(limit)s
          FOR UPDATE SKIP LOCKED) AS s ON true
 ORDER BY s.next_slot""".format(columns=", ".join(f"s.{f.column}" for f in _SCHEDULE_FIELDS))

FIRE_SQL = """\
WITH slot AS (
    SELECT *
      FROM jsonb_to_recordset(%(slots)s::jsonb)
           AS s(n int, run_id uuid, template int, task text, start_key text, priority smallint,
                concurrency_key text, payload text)
), template AS (
    SELECT * FROM jsonb_populate_recordset(NULL::agent_run, %(templates)s::jsonb)
           WITH ORDINALITY AS t
), wanted AS (
    SELECT concurrency_key AS key, count(*) AS runs
      FROM slot
     WHERE concurrency_key IS NOT NULL
     GROUP BY concurrency_key
), turn AS (
    -- As for one run at a time: a key's runs take its turns one after the other.
    INSERT INTO agent_concurrency_key AS k (key, next_fair_at)
    SELECT key, now() + runs * %(spacing)s FROM wanted
        ON CONFLICT (key) DO UPDATE
       SET next_fair_at = GREATEST(k.next_fair_at, now()) + (excluded.next_fair_at - now())
    RETURNING k.key, k.next_fair_at
), fair AS (
    SELECT s.n,
           turn.next_fair_at - (wanted.runs + 1
               - row_number() OVER (PARTITION BY s.concurrency_key ORDER BY s.n))
               * %(spacing)s AS fair_at
      FROM slot AS s
      JOIN turn ON turn.key = s.concurrency_key
      JOIN wanted ON wanted.key = s.concurrency_key
), started AS (
    INSERT INTO agent_run ({run_columns})
    SELECT {run_values}
      FROM slot AS s
      JOIN template AS t ON t.ordinality = s.template
      LEFT JOIN fair AS f ON f.n = s.n
     ORDER BY s.n
        ON CONFLICT DO NOTHING
    RETURNING id
), task_step AS (
    INSERT INTO agent_step (run_id, seq, part, kind, payload, attempt, worker)
    SELECT s.run_id, 0, {slot_part}, 'task', s.payload, 0, ''
      FROM slot AS s
      JOIN started ON started.id = s.run_id
), stored AS (
    -- The slot's run: the one just started, or the one that had its key already.
    SELECT s.n, s.start_key, COALESCE(started.id, had.id) AS run_id
      FROM slot AS s
      JOIN template AS t ON t.ordinality = s.template
      LEFT JOIN started ON started.id = s.run_id
      LEFT JOIN agent_run AS had ON had.agent = t.agent AND had.start_key = s.start_key
), moved AS (
    UPDATE agent_schedule AS sc
       SET next_slot = m.next_slot,
           last_slot = COALESCE(m.last_slot, sc.last_slot),
           last_run_id = CASE WHEN m.last_key IS NULL THEN sc.last_run_id
                              ELSE (SELECT run_id FROM stored WHERE start_key = m.last_key)
                         END,
           broken = m.broken,
           updated_at = now()
      FROM jsonb_to_recordset(%(moves)s::jsonb)
           AS m(id bigint, next_slot timestamptz, last_slot timestamptz, last_key text,
                broken text)
     WHERE sc.id = m.id
)
SELECT start_key, run_id FROM stored ORDER BY n""".format(
    slot_part=part_of_run("s.run_id"),
    run_columns=",\n                           ".join(_RUN_COLUMNS),
    run_values=",\n           ".join(
        _slot_value(column) if column in _SLOT_COLUMNS else f"t.{column}" for column in _RUN_COLUMNS
    ),
)

# The rows of a batch moved on, in one statement whatever their number: the ORM's
# bulk_update builds a CASE per column and row, which costs more Python than the firing.
MOVE_ON_SQL = """\
UPDATE agent_schedule AS s
   SET next_slot = v.next_slot, last_slot = v.last_slot, last_run_id = v.last_run_id,
       broken = v.broken, updated_at = now()
  FROM unnest(%s::bigint[], %s::timestamptz[], %s::timestamptz[], %s::uuid[], %s::text[])
       AS v(id, next_slot, last_slot, last_run_id, broken)
 WHERE s.id = v.id"""


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=str)


def _iso(moment: dt.datetime | None) -> str | None:
    return None if moment is None else moment.isoformat()


def _template_row(template: AgentRun) -> dict[str, Any]:
    """The template's columns as JSON values (each prepared by its field, as for a save)."""
    return {str(field.column): _template_value(field, template) for field in _TEMPLATE_FIELDS}


def _template_value(field: Any, template: AgentRun) -> Any:
    value = field.pre_save(template, True)
    if isinstance(field, JSONField):  # a JSON column (metadata) is its value, not its adapter
        return value
    return field.get_db_prep_save(value, connection)


def take_due_schedules(now: dt.datetime | None, limit: int) -> DueSchedules:
    """TAKE_DUE_SQL: one statement, due or not."""
    with connection.cursor() as cursor:
        cursor.execute(TAKE_DUE_SQL, {"now": now, "limit": limit})
        found = cursor.fetchall()
    earliest, clock = found[0][0], found[0][1]
    names = [f.attname for f in _SCHEDULE_FIELDS]
    rows = [
        AgentSchedule.from_db(connection.alias, names, row[2:])
        for row in found
        if row[2] is not None
    ]
    return DueSchedules(earliest, clock, rows)


def fire_slots(
    starts: Sequence[SlotStart],
    rows: Sequence[AgentSchedule],
    last_keys: Mapping[int, str],
) -> dict[str, uuid.UUID]:
    """FIRE_SQL: the runs, their task steps and the moves, one statement."""
    # JSON rather than arrays: psycopg adapts a list element by element in Python, and
    # the json module does a firing's slots in a fraction of the time.
    numbers: dict[int, int] = {}  # id(template) -> its number in the statement (from 1)
    templates = []
    for start in starts:
        if id(start.template) not in numbers:
            numbers[id(start.template)] = len(numbers) + 1
            templates.append(_template_row(start.template))
    params: dict[str, Any] = {
        "slots": _json(
            [
                {
                    "n": n,
                    "run_id": start.run_id.hex,
                    "template": numbers[id(start.template)],
                    "task": start.task,
                    "start_key": start.key,
                    "priority": start.priority,
                    "concurrency_key": start.concurrency_key,
                    "payload": encryption.seal(start.payload, STEP_PAYLOAD),
                }
                for n, start in enumerate(starts, 1)
            ]
        ),
        "templates": _json(templates),
        "spacing": FAIR_SPACING,
        "moves": _json(
            [
                {
                    "id": row.pk,
                    "next_slot": _iso(row.next_slot),
                    "last_slot": _iso(row.last_slot),
                    "last_key": last_keys.get(row.pk),
                    "broken": row.broken,
                }
                for row in rows
            ]
        ),
    }
    with connection.cursor() as cursor:
        cursor.execute(FIRE_SQL, params)
        ids: dict[str, uuid.UUID] = dict(cursor.fetchall())
    missing = [key for key, run_id in ids.items() if run_id is None]
    if missing:
        _find_runs_started_meanwhile(starts, rows, last_keys, ids, missing)
    for row in rows:
        key = last_keys.get(row.pk)
        if key is not None:
            row.last_run_id = ids[key]
    return ids


def _find_runs_started_meanwhile(
    starts: Sequence[SlotStart],
    rows: Sequence[AgentSchedule],
    last_keys: Mapping[int, str],
    ids: dict[str, uuid.UUID],
    missing: list[str],
) -> None:
    """A slot's key was taken by a run that committed while FIRE_SQL ran (a start_run
    with the same key): the statement's snapshot did not see it. Read those runs now,
    and point the schedules whose last run they are at them."""
    agents = {start.key: start.template.agent for start in starts}
    for run_id, agent, found in AgentRun.objects.filter(start_key__in=missing).values_list(
        "id", "agent", "start_key"
    ):
        if found is not None and agents[found] == agent:
            ids[found] = run_id
    for row in rows:
        key = last_keys.get(row.pk)
        if key is not None and key in missing:
            AgentSchedule.objects.filter(pk=row.pk).update(last_run_id=ids[key])


def move_schedules(rows: Sequence[AgentSchedule]) -> None:
    """MOVE_ON_SQL."""
    if not rows:
        return
    with connection.cursor() as cursor:
        cursor.execute(
            MOVE_ON_SQL,
            [
                [row.pk for row in rows],
                [row.next_slot for row in rows],
                [row.last_slot for row in rows],
                [row.last_run_id for row in rows],
                [row.broken for row in rows],
            ],
        )
