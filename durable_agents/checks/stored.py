"""What the database holds, read only when a command asks for the checks of the database
(``manage.py check --database default``, ``migrate``, ``runagents``): runs in flight that the
registered agents would dead-letter for prompt drift (W040), schedules stored with six cron
fields (W006)."""

from __future__ import annotations

from typing import Any

from django.core.checks import CheckMessage, Tags, Warning, register
from django.db import DatabaseError

PROMPT_DRIFT = "durable_agents.W040"


@register(Tags.database)
def check_prompt_drift(
    app_configs: Any = None, databases: Any = None, **kwargs: Any
) -> list[CheckMessage]:
    """Runs in flight that the registered agents would dead-letter for prompt drift. Reads
    the database, so only when asked: ``manage.py check --database default``, and
    ``runagents`` at start."""
    if not databases or "default" not in databases:
        return []
    from durable_agents.engine.inflight import prompt_drift

    try:
        drifted = prompt_drift("default")
    except DatabaseError:  # not migrated yet: nothing is in flight
        return []
    return [
        Warning(
            drift.describe() + ".",
            hint="Give the changed agent a new version (Agent(version=...)) and keep the old "
            "definition registered until its runs end; or restore the old definition.",
            obj=f"{drift.agent}@{drift.version}",
            id=PROMPT_DRIFT,
        )
        for drift in drifted
    ]


SIX_FIELD_SCHEDULES = "durable_agents.W006"
# The schedules W006 names in its message; the rest are counted.
MAX_NAMED_SCHEDULES = 20


@register(Tags.database)
def check_six_field_schedules(
    app_configs: Any = None, databases: Any = None, **kwargs: Any
) -> list[CheckMessage]:
    """Schedules an earlier version stored with six cron fields (seconds first), which
    ``schedule()`` and the admin now refuse: they fire as before until saved again. Reads the
    database, so only when asked: ``manage.py check --database default``, and ``migrate``."""
    if not databases or "default" not in databases:
        return []
    from durable_agents.models import AgentSchedule
    from durable_agents.schedules.defining import five_fields

    try:
        stored = list(
            AgentSchedule.objects.using("default")
            .exclude(cron="")
            .order_by("name")
            .values_list("name", "cron")
        )
    except DatabaseError:  # not migrated yet: no schedule is stored
        return []
    names = [name for name, cron in stored if len(five_fields(cron).split()) == 6]
    if not names:
        return []
    listed = ", ".join(map(repr, names[:MAX_NAMED_SCHEDULES]))
    if len(names) > MAX_NAMED_SCHEDULES:
        listed += f" and {len(names) - MAX_NAMED_SCHEDULES} more"
    return [
        Warning(
            f"{len(names)} schedule(s) have a cron expression of six fields (seconds first), "
            f"which schedule() and the admin no longer take: {listed}.",
            hint="They fire as before. Save each again with five fields (minute hour "
            'day-of-month month day-of-week), such as "*/5 * * * *", or with every= for slots '
            "seconds apart: on its admin page or with durable_agents.schedule().",
            id=SIX_FIELD_SCHEDULES,
        )
    ]


STEP_PARTITIONS = "durable_agents.W060"


@register(Tags.database)
def check_step_partitions(
    app_configs: Any = None, databases: Any = None, **kwargs: Any
) -> list[CheckMessage]:
    """PostgreSQL's step log: days whose steps are kept in the default partition (their day
    had no partition when they were written), and today or tomorrow without a partition.
    Reads the database, so only when asked: ``manage.py check --database default``,
    ``migrate`` and ``runagents``."""
    if not databases or "default" not in databases:
        return []
    from django.db import connections

    from durable_agents.models import step_partitions
    from durable_agents.models.ids import day_of_part

    connection = connections["default"]
    if connection.vendor != "postgresql":
        return []
    try:
        with connection.cursor() as cursor:
            if not step_partitions.is_partitioned(cursor):
                return []
            kept = step_partitions.default_days(cursor)
            missing = step_partitions.missing_days_ahead(cursor)
            lost = step_partitions.days_of_active_runs_without_partition(cursor)
    except DatabaseError:  # not migrated yet
        return []
    messages: list[CheckMessage] = []
    if kept:
        days = ", ".join(f"{day_of_part(part)} ({count} steps)" for part, count in kept[:20])
        messages.append(
            Warning(
                f"agent_step_default holds the steps of days that had no partition: {days}. "
                "They are read and kept like any other, but retention cannot drop them "
                "with a day.",
                hint="Housekeeping's sweep moves them into partitions of their own (from "
                "django-q2, or durable_agents.housekeeping.sweep() from a shell). Steps of "
                "days far from today mean a clock was wrong where those runs were started.",
                obj="agent_step",
                id=STEP_PARTITIONS,
            )
        )
    if lost:
        days = ", ".join(f"{day_of_part(part)} ({count} runs)" for part, count in lost[:20])
        messages.append(
            Warning(
                f"Runs not ended were started on days whose step partition is gone: {days}. "
                "Their steps were dropped with it (by hand: retention drops a day only when "
                "none of its runs is left), and a worker cannot resume them.",
                hint="Restore the partition (agent_step_pNNNNN, NNNNN the day's number since "
                "1970-01-01) from a backup and attach it again (ALTER TABLE agent_step ATTACH "
                "PARTITION ... FOR VALUES FROM (NNNNN) TO (NNNNN + 1)), or cancel those runs.",
                obj="agent_step",
                id=STEP_PARTITIONS,
            )
        )
    if missing:
        days = ", ".join(str(day_of_part(part)) for part in missing)
        messages.append(
            Warning(
                f"The step log has no partition for {days}: new runs' steps go to the "
                "default partition.",
                hint="Workers make the days ahead when they start, and housekeeping's sweep "
                "every five minutes: schedule it (django-q2), or restart a worker.",
                obj="agent_step",
                id=STEP_PARTITIONS,
            )
        )
    return messages
