"""Firing schedules, the store's part: take the due schedules, start their slots' runs, move
the schedules on, through the ORM. Plain functions: ``PortableStore``'s ``ScheduleStore``
part; ``postgres_schedules`` does each step in one statement.

    take_due_schedules   the earliest next slot, the clock, and the due schedules, locked
                         (SKIP LOCKED) until the caller's transaction ends
    fire_slots           the runs of the slots (``SlotStart``) and the schedules' moves, all
                         together: ``portable_batch.create_runs`` and one UPDATE here
    move_schedules       the schedules' moves alone (after runs started one by one)

schedules/firing.py holds the flow: what is due, which slots fire, what a refusal does.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Mapping, Sequence

from django.db.models import Value
from django.db.models.expressions import Expression
from django.db.models.functions import Now
from django.utils import timezone

from durable_agents.models import AgentSchedule
from durable_agents.store.portable_batch import create_runs
from durable_agents.store.rows import DueSchedules, SlotStart

# The columns a firing moves on.
MOVED_FIELDS = ["next_slot", "last_slot", "last_run", "broken", "updated_at"]


def clock_of(now: dt.datetime | None) -> Expression:
    return Now() if now is None else Value(now)


def take_due_schedules(now: dt.datetime | None, limit: int) -> DueSchedules:
    """The earliest next slot, then (when it is due) up to ``limit`` due schedules with
    select_for_update(skip_locked=True): two statements when something is due. ``now``:
    fire at this time rather than the database's."""
    cutoff = clock_of(now)
    firing = AgentSchedule.objects.firing()
    first = (
        firing.filter(next_slot__isnull=False)
        .annotate(db_now=cutoff)
        .order_by("next_slot")
        .values_list("next_slot", "db_now")
        .first()
    )
    if first is None:
        return DueSchedules(None, now or timezone.now(), [])
    earliest, clock = first
    if earliest > clock:
        return DueSchedules(earliest, clock, [])
    rows = list(
        firing.filter(next_slot__lte=clock)
        .order_by("next_slot")
        .select_for_update(skip_locked=True)[:limit]
    )
    return DueSchedules(earliest, clock, rows)


def fire_slots(
    starts: Sequence[SlotStart],
    rows: Sequence[AgentSchedule],
    last_keys: Mapping[int, str],
) -> dict[str, uuid.UUID]:
    """Start the run of each slot in ``starts`` (a run whose key its agent has used
    already is not started again) and save ``rows`` (their next slot, last slot and
    broken as the caller set them; each ``last_keys[row.pk]`` run becomes its last run),
    together. Returns the stored run of each key: the new one, or the one that had it."""
    stored = create_runs([(start.new_run(), start.payload) for start in starts])
    ids = {start.key: run.pk for start, run in zip(starts, stored, strict=True)}
    for row in rows:
        key = last_keys.get(row.pk)
        if key is not None:
            row.last_run_id = ids[key]
    move_schedules(rows)
    return ids


def move_schedules(rows: Sequence[AgentSchedule]) -> None:
    """Save the next slot, last slot, last run and broken of ``rows``."""
    if not rows:
        return
    moved = timezone.now()
    for row in rows:
        row.updated_at = moved
    AgentSchedule.objects.bulk_update(rows, MOVED_FIELDS)
