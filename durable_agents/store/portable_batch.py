"""Many keyed runs created in a few statements (the slots of a firing of schedules, where the
database has no statement of its own for it: PostgreSQL fires a batch with FIRE_SQL):
``Store.create_runs`` of both database stores, and ``portable_schedules.fire_slots``.

On PostgreSQL the rows go in as one ``INSERT ... SELECT FROM unnest(<one array per column>)``
per table: the ORM's ``bulk_create`` spends a quarter of a millisecond of Python per run
preparing each value as an expression, which a worker's claimer (the same process) would feel.
The values are still the fields' own (``get_db_prep_save``: encryption of a step's payload,
JSON, UUIDs), and the columns every field the model has, so a new field cannot be missed."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.db import connection, models, transaction
from django.db.models.expressions import DatabaseDefault

from durable_agents.models import AgentRun, AgentStep, StepKind
from durable_agents.store.key_rows import take_turn


def create_runs(runs: Sequence[tuple[AgentRun, str]]) -> list[AgentRun]:
    """``create_run`` of each ``(run, task payload)``, every run with a start key: one
    INSERT of the runs that skips those whose key their agent has used already (ON
    CONFLICT DO NOTHING on ``agent_run_start_key``: race-free as ``create_run``), one read
    of the runs of those keys, one INSERT of the new runs' task steps. Returns the run of
    each key as stored, in order: the new one, or the one that had the key."""
    if not runs:
        return []
    if any(run.start_key is None for run, _ in runs):
        raise ValueError("create_runs creates keyed runs only")
    with transaction.atomic():
        for run, _ in runs:
            if run.concurrency_key is not None:
                run.fair_at = take_turn(run.concurrency_key)
        insert_rows([run for run, _ in runs], skip_conflicts=True)
        stored = {
            (row.agent, row.start_key): row
            for row in AgentRun.objects.filter(
                start_key__in={run.start_key for run, _ in runs},
                agent__in={run.agent for run, _ in runs},
            ).order_by()
        }
        insert_rows(
            [
                AgentStep(run_id=run.pk, seq=0, kind=StepKind.TASK, payload=payload)
                for run, payload in runs
                if stored[(run.agent, run.start_key)].pk == run.pk
            ]
        )
    return [stored[(run.agent, run.start_key)] for run, _ in runs]


def insert_rows(objs: Sequence[models.Model], *, skip_conflicts: bool = False) -> None:
    """Insert ``objs`` (unsaved instances of one model) in one statement; ``skip_conflicts``:
    rows a unique index refuses are left out (ON CONFLICT DO NOTHING)."""
    if not objs:
        return
    model = type(objs[0])
    fields = _columns(model, objs)
    if connection.vendor != "postgresql" or fields is None:
        model._default_manager.bulk_create(objs, ignore_conflicts=skip_conflicts)
        return
    ops = connection.ops
    columns = ", ".join(ops.quote_name(f.column) for f in fields)
    arrays = ", ".join(f"%s::{f.db_type(connection)}[]" for f in fields)
    sql = (
        f"INSERT INTO {ops.quote_name(model._meta.db_table)} ({columns})"
        f" SELECT * FROM unnest({arrays})" + (" ON CONFLICT DO NOTHING" if skip_conflicts else "")
    )
    params: list[list[Any]] = [
        [f.get_db_prep_save(f.pre_save(obj, True), connection) for obj in objs] for f in fields
    ]
    with connection.cursor() as cursor:
        cursor.execute(sql, params)


def _columns(model: type[models.Model], objs: Sequence[models.Model]) -> list[Any] | None:
    """The fields to insert: each concrete column but those every row leaves to its database
    default; None when some rows set a column that others leave to its default (the ORM then
    inserts them)."""
    fields = []
    for field in model._meta.concrete_fields:
        if getattr(field, "column", None) is None:
            continue
        defaulted = [isinstance(getattr(obj, field.attname), DatabaseDefault) for obj in objs]
        if all(defaulted):
            continue
        if any(defaulted):
            return None
        fields.append(field)
    return fields
