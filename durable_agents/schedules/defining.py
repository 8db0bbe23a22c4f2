"""Agents on a clock: schedules, their slots and the runs the slots start.

    schedule(name, agent, task, cron=|every=, ...)   create or update the row named ``name``
    check_timing(cron, every, timezone)              ValueError unless exactly one is sound
    next_slot(schedule, after)                       the first slot strictly after ``after``
    slot_key(name, slot)                             the start key of a slot's run
    due_slots(schedule, now)                         the slots to fire now (catch_up decides)
    run_now(schedule)                                a run of the schedule now, outside its slots

A slot's run is started with ``key = slot_key(name, slot)``: start keys are unique per agent,
so whichever worker fires a slot, and however often (a worker that died between taking the
slot and recording it), the slot starts one run.

A cron expression has five fields (minute, hour, day of the month, month, day of the week), or
is one of the macros ``@hourly``, ``@daily`` (``@midnight``), ``@weekly``, ``@monthly`` and
``@yearly`` (``@annually``), stored as written and read as their five fields (``cron_slots``,
the one place that hands an expression to cronsim). ``schedule()`` refuses six fields
(seconds), which cronsim would read; rows an earlier version stored with six go on firing as
they did (system check W006 names them).

Slots are instants in UTC. A cron expression is read in the schedule's time zone by cronsim,
which follows Debian cron across daylight-saving changes: a time skipped by the clock moving
forward fires once, when the clock has moved (02:30 on the spring-forward night fires at
03:00); a time repeated when the clock moves back fires once, the first time. ``every`` slots
are the multiples of the interval since the Unix epoch (UTC), so that a schedule's slots do not
move when its row is saved again.
"""

from __future__ import annotations

import datetime as dt
import math
import zoneinfo
from typing import Any

from cronsim import CronSim, CronSimError
from django.db import IntegrityError, transaction
from django.utils import timezone as django_timezone

from durable_agents._internal.migration_state import explains_missing_tables
from durable_agents._internal.text import has_unstorable
from durable_agents.exceptions import CronExpressionError
from durable_agents.models import MAX_SCHEDULE_NAME, AgentRun, AgentSchedule

# The longest cron expression (the column's width).
MAX_CRON = 200
# An ``every`` below this is refused: a slot a second is what a loop is for, not a schedule.
MIN_EVERY = dt.timedelta(seconds=1)
MAX_EVERY = dt.timedelta(days=366)
# After an outage, a schedule with ``catch_up=True`` fires at most this many missed slots per
# firing (oldest first); the next firing, a moment later, takes the next ones.
MAX_CATCH_UP = 100
# Where the newest missed slot of a cron schedule is looked for first, widening until one is
# found: a minutely cron expression after a month-long outage walks an hour of slots, not a
# month of them.
_NEWEST_WINDOWS = (
    dt.timedelta(hours=1),
    dt.timedelta(days=1),
    dt.timedelta(days=32),
    dt.timedelta(days=400),
)
# How far ahead a cron expression's next slot is looked for: an expression that matches no
# day in five years (31 February is refused by the parser; "0 0 29 2 1" is a Monday
# 29 February, which comes every few decades) is refused as never firing.
_HORIZON = dt.timedelta(days=5 * 366)
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
# The macros of Vixie cron that name a time (not ``@reboot``), as their five fields: cronsim
# reads none of them.
CRON_MACROS = {
    "@hourly": "0 * * * *",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@weekly": "0 0 * * 0",
    "@monthly": "0 0 1 * *",
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
}
CRON_FIELDS = "minute hour day-of-month month day-of-week"


def check_name(name: object) -> None:
    if not isinstance(name, str) or not name.strip():
        raise ValueError("a schedule name must be a non-empty string")
    if len(name) > MAX_SCHEDULE_NAME:
        raise ValueError(
            f"a schedule name has at most {MAX_SCHEDULE_NAME} characters; this one has {len(name)}"
        )
    if has_unstorable(name):
        raise ValueError("a schedule name cannot contain NUL characters or lone surrogates")


def time_zone(name: object) -> zoneinfo.ZoneInfo:
    """The IANA time zone ``name``; ValueError for one that does not exist."""
    if not isinstance(name, str) or not name or len(name) > 64 or has_unstorable(name):
        raise ValueError(f"not a time zone name: {name!r}")
    try:
        return zoneinfo.ZoneInfo(name)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError) as exc:
        raise ValueError(f"no such time zone: {name!r}") from exc


def check_timing(cron: object, every: object, timezone: object = "UTC") -> None:
    """ValueError unless exactly one of ``cron`` (five fields or a macro that cronsim
    parses, firing at least once in five years; ``CronExpressionError`` otherwise) and
    ``every`` (a timedelta of a second to a year) is given, in an existing ``timezone``."""
    zone = time_zone(timezone)
    if cron in (None, "") and every is None:
        raise ValueError("a schedule needs cron= or every=")
    if cron not in (None, "") and every is not None:
        raise ValueError("a schedule has cron= or every=, not both")
    if every is not None:
        _check_every(every)
        return
    if not isinstance(cron, str) or len(cron) > MAX_CRON or has_unstorable(cron):
        raise CronExpressionError(
            f"a cron expression is a string of at most {MAX_CRON} characters", "not_text"
        )
    _check_fields(cron)
    try:
        slots = cron_slots(cron, django_timezone.now().astimezone(zone))
    except CronSimError as exc:
        raise CronExpressionError(
            f"not a cron expression cronsim reads: {cron!r} ({exc})", "unreadable"
        ) from exc
    if _first_slot(slots, django_timezone.now() + _HORIZON) is None:
        raise CronExpressionError(
            f"the cron expression {cron!r} fires on no day of the next five years", "never_fires"
        )


def five_fields(cron: str) -> str:
    """``cron`` as cronsim reads it: a macro (``@daily``) as its five fields, whatever its
    case and the spaces around it; any other expression as it is."""
    return CRON_MACROS.get(cron.strip().lower(), cron)


def cron_slots(cron: str, start: dt.datetime) -> CronSim:
    """The slots of ``cron`` after ``start`` (an aware datetime in the schedule's time zone).
    Every slot of a schedule is computed here, so that a macro reads the same everywhere.
    Six fields are read too (seconds first): rows stored by an earlier version keep firing."""
    return CronSim(five_fields(cron), start)


def _check_fields(cron: str) -> None:
    """Five fields or a known macro, as crontab(5) has them; six (seconds first, which cronsim
    would read and fire every few seconds) and any other count are refused."""
    read = five_fields(cron)
    if read.lstrip().startswith("@"):
        raise CronExpressionError(
            f"{cron!r} is not a cron macro schedules know: use one of "
            f"{', '.join(CRON_MACROS)}, or five fields ({CRON_FIELDS})",
            "unknown_macro",
        )
    count = len(read.split())
    if count == 6:
        raise CronExpressionError(
            f"the cron expression {cron!r} has six fields; schedules take five fields "
            f'({CRON_FIELDS}), without seconds: "*/5 * * * *" is every five minutes. For '
            "slots seconds apart, give every=datetime.timedelta(seconds=...) instead",
            "six_fields",
        )
    if count != 5:
        raise CronExpressionError(
            f"the cron expression {cron!r} has {count} fields; a cron expression has five "
            f'({CRON_FIELDS}), such as "0 6 * * *" (at 06:00 every day)',
            "field_count",
        )


def _check_every(every: object) -> None:
    if not isinstance(every, dt.timedelta):
        raise ValueError(f"every= is a datetime.timedelta, not {type(every).__name__}")
    if not MIN_EVERY <= every <= MAX_EVERY:
        raise ValueError(f"every= is between {MIN_EVERY} and {MAX_EVERY.days} days, not {every}")


def check_stored_every(every: dt.timedelta) -> None:
    """ValueError for a stored ``every`` that ``schedule()`` refuses. A row written past the
    app (raw SQL, a fixture) may hold one: zero divides by zero at every firing, a negative
    interval moves the next slot backwards so that each firing finds it due again (a flood of
    runs with ``catch_up``), a microsecond makes a million slots a second. The firing marks
    such a schedule broken, and resuming it is refused, as for a cron that does not parse."""
    if not MIN_EVERY <= every <= MAX_EVERY:
        raise ValueError(
            f"its interval (every) is {every}, not between {MIN_EVERY} and {MAX_EVERY.days} days"
        )


def _first_slot(slots: CronSim, before: dt.datetime) -> dt.datetime | None:
    try:
        slot = next(slots)
    except (StopIteration, CronSimError):
        return None
    return slot if slot <= before else None


def next_slot(schedule: AgentSchedule, after: dt.datetime) -> dt.datetime | None:
    """The schedule's first slot strictly after ``after``, in UTC; None when a cron
    expression fires in none of the next five years. ValueError for an ``every`` that
    ``schedule()`` would refuse (a row written by hand)."""
    if schedule.every is not None:
        check_stored_every(schedule.every)
        step = schedule.every.total_seconds()
        passed = (after - _EPOCH).total_seconds()
        n = math.floor(passed / step) + 1
        return _EPOCH + dt.timedelta(seconds=n * step)
    zone = time_zone(schedule.timezone)
    slot = _first_slot(cron_slots(schedule.cron, after.astimezone(zone)), after + _HORIZON)
    return None if slot is None else slot.astimezone(dt.UTC)


def due_slots(
    schedule: AgentSchedule, now: dt.datetime, limit: int = MAX_CATCH_UP
) -> list[dt.datetime]:
    """The slots of ``schedule`` to fire at ``now``: none before its ``next_slot``; else, with
    ``catch_up``, each slot from ``next_slot`` to ``now``, oldest first, at most ``limit``;
    without, only the newest of them (the ones an outage skipped are not started).
    ValueError (or cronsim's ``CronSimError``) for a cron expression or a time zone that no
    longer parses, or an ``every`` out of range."""
    if schedule.every is not None:
        check_stored_every(schedule.every)
    first = schedule.next_slot
    if first is None or first > now:
        return []
    if not schedule.catch_up:
        return [_newest_slot(schedule, first, now)]
    slots = [first]
    while len(slots) < limit:
        following = next_slot(schedule, slots[-1])
        if following is None or following > now:
            break
        slots.append(following)
    return slots


def _newest_slot(schedule: AgentSchedule, first: dt.datetime, now: dt.datetime) -> dt.datetime:
    """The newest slot from ``first`` (a slot, due) to ``now``."""
    if schedule.every is not None:
        # In whole microseconds: the slot is exact whatever the interval.
        step = schedule.every // dt.timedelta(microseconds=1)
        passed = (now - _EPOCH) // dt.timedelta(microseconds=1)
        return max(first, _EPOCH + dt.timedelta(microseconds=passed // step * step))
    zone = time_zone(schedule.timezone)
    for window in (*_NEWEST_WINDOWS, None):
        start = first if window is None else max(first, now - window)
        newest = None
        for slot in cron_slots(schedule.cron, start.astimezone(zone)):
            if slot > now:
                break
            newest = slot
        if newest is not None:
            return newest.astimezone(dt.UTC)
        if start == first:
            break
    return first


def slot_key(name: str, slot: dt.datetime) -> str:
    """The start key of the run of a slot: the schedule's name and the slot, in UTC to the
    microsecond."""
    return f"{name}@{slot.astimezone(dt.UTC).isoformat(timespec='microseconds')}"


@explains_missing_tables
def schedule(
    name: str,
    agent: str,
    task: str,
    *,
    cron: str | None = None,
    every: dt.timedelta | None = None,
    timezone: str = "UTC",
    priority: int = 0,
    concurrency_key: str | None = None,
    catch_up: bool = False,
    enabled: bool = True,
) -> AgentSchedule:
    """Create the schedule ``name``, or update it if it exists: every slot of ``cron`` (in
    ``timezone``) or of ``every`` starts one run of ``agent`` with ``task`` across the whole
    fleet. Idempotent: a data migration or an ``AppConfig.ready`` may call it on every start.

    The first slot is the first one after the call. Changing the timing (cron, every or time
    zone), enabling the schedule again or declaring a broken one again (which clears
    ``broken``) moves its next slot to the first one after the call; changing anything else
    keeps it. ``catch_up``: after an outage (no worker ran through some
    slots), False starts only the newest missed slot, True each of them, oldest first (at most
    ``MAX_CATCH_UP`` per firing). ``cron`` has five fields or is a macro (``@hourly``,
    ``@daily``, ``@midnight``, ``@weekly``, ``@monthly``, ``@yearly``, ``@annually``), stored
    as written. A bad argument (an unknown agent, a time zone that does not exist, ``every``
    not a positive timedelta) is a ``ValueError``, a cron expression that is not five fields
    or does not parse a ``CronExpressionError`` (a ``ValueError`` too), and nothing is
    saved."""
    from durable_agents.api import check_priority, check_task
    from durable_agents.declare.agents import get_agent
    from durable_agents.exceptions import AgentNotFound
    from durable_agents.store.concurrency import check_concurrency_key

    check_name(name)
    check_timing(cron, every, timezone)
    try:
        get_agent(agent)
    except AgentNotFound as exc:
        raise ValueError(f"no agent named {agent!r} is registered") from exc
    check_task(task)
    check_priority(priority)
    if concurrency_key is not None:
        check_concurrency_key(concurrency_key)
    if not isinstance(catch_up, bool) or not isinstance(enabled, bool):
        raise ValueError("catch_up= and enabled= are True or False")
    fields: dict[str, Any] = {
        "agent": agent,
        "task": task,
        "cron": cron or "",
        "every": every,
        "timezone": timezone,
        "priority": priority,
        "concurrency_key": concurrency_key,
        "catch_up": catch_up,
        "enabled": enabled,
        "broken": "",
    }
    # Two processes declaring the same schedule at once (two workers starting with it in their
    # AppConfig.ready): the one that loses the insert updates the winner's row instead.
    for _ in range(2):
        try:
            with transaction.atomic():
                return _save(name, fields)
        except IntegrityError:
            continue
    raise RuntimeError(f"could not save the schedule {name!r}")  # pragma: no cover


def _save(name: str, fields: dict[str, Any]) -> AgentSchedule:
    existing = AgentSchedule.objects.select_for_update().filter(name=name).first()
    now = django_timezone.now()
    if existing is None:
        row = AgentSchedule(name=name, **fields)
        row.next_slot = next_slot(row, now)
        row.save()
        return row
    timing = ("cron", "every", "timezone")
    retimed = any(getattr(existing, f) != fields[f] for f in timing)
    # Paused, or broken (it fired nothing): it starts again at its first slot after now,
    # without catching up on the slots it did not fire meanwhile.
    resumed = fields["enabled"] and (not existing.enabled or bool(existing.broken))
    for field, value in fields.items():
        setattr(existing, field, value)
    if retimed or resumed or existing.next_slot is None:
        existing.next_slot = next_slot(existing, now)
    existing.updated_at = now
    existing.save()
    return existing


@explains_missing_tables
def run_now(schedule: AgentSchedule) -> AgentRun:
    """A run of the schedule started now, outside its slots (the admin's "run now"): its
    agent, task, priority and concurrency key; the schedule's slots are unchanged."""
    from durable_agents.api import start_run

    return start_run(
        schedule.agent,
        schedule.task,
        key=f"{schedule.name}@now:{django_timezone.now().isoformat(timespec='microseconds')}",
        priority=schedule.priority,
        concurrency_key=schedule.concurrency_key,
    )
