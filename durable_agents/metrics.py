"""The operational figures (the operations page, metrics snapshots), computed in one place.

The admin's operations page renders them as charts; ``housekeeping.snapshot_metrics`` stores
``collect()`` in ``agent_metrics`` so that a dashboard or an alert can read history cheaply.
Every query aggregates in the database or is bounded; none reads a row per run.
"""

from __future__ import annotations

import datetime
from collections import Counter
from typing import Any

from django.db.models import Count, Min, QuerySet
from django.db.models.functions import TruncHour
from django.utils import timezone

from durable_agents.models import (
    FINISHED_STATUSES,
    AgentQuestion,
    AgentRun,
    QuestionStatus,
    RunStatus,
    ToolIntent,
)

# How many finished runs the steps percentiles look at: bounded so that the figure stays cheap
# on a table of millions, and portable (no percentile_cont on SQLite).
PERCENTILE_SAMPLE = 10_000
# Claims of a run from which on the attempts distribution has a single "N+" bucket.
ATTEMPTS_CAP = 10


def percentile(sorted_values: list[int], fraction: float) -> float | None:
    """Linear interpolation between closest ranks, as PostgreSQL's percentile_cont does."""
    if not sorted_values:
        return None
    position = (len(sorted_values) - 1) * fraction
    low = int(position)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)


def runs_by_status() -> dict[str, int]:
    # COUNT(*): an index-only scan of agent_run_status, not a read of every row.
    counts = dict(AgentRun.objects.order_by().values_list("status").annotate(n=Count("*")))
    return {status: counts.get(status, 0) for status in RunStatus.values}


def oldest_pending() -> AgentRun | None:
    return AgentRun.objects.filter(status=RunStatus.PENDING).order_by("created_at").first()


def steps_of_recent_finished_runs() -> list[int]:
    """Steps per run (``last_seq + 1``: seq 0 is the task) of the newest finished runs, sorted."""
    return sorted(
        last_seq + 1
        # finished_at IS NOT NULL lets the partial index agent_run_finished serve the order.
        for last_seq in AgentRun.objects.filter(
            status__in=FINISHED_STATUSES, finished_at__isnull=False
        )
        .order_by("-finished_at")
        .values_list("last_seq", flat=True)[:PERCENTILE_SAMPLE]
    )


def attempts_distribution(runs: QuerySet[AgentRun]) -> list[tuple[str, int]]:
    """(claims, runs) pairs, aggregated in the database, the long tail in one bucket."""
    buckets: Counter[int] = Counter()
    for attempt, n in runs.order_by().values_list("attempt").annotate(n=Count("pk")):
        buckets[min(attempt, ATTEMPTS_CAP)] += n
    return [(f"{k}+" if k == ATTEMPTS_CAP else str(k), buckets[k]) for k in sorted(buckets)]


def waiting_intents() -> tuple[int, ToolIntent | None]:
    """How many intents wait for a person, and the oldest of them."""
    waiting = ToolIntent.objects.awaiting_person()
    return waiting.count(), waiting.order_by("created_at").select_related("run").first()


def waits_by_kind(now: datetime.datetime) -> dict[str, dict[str, Any]]:
    """Waiting runs by what they wait for: how many, and the age of the oldest wait."""
    rows = (
        AgentRun.objects.filter(status=RunStatus.WAITING)
        .order_by()
        .values("waiting_for")
        .annotate(runs=Count("pk"), since=Min("waiting_since"))
    )
    return {
        row["waiting_for"] or "unknown": {
            "runs": row["runs"],
            "oldest_age_seconds": (now - row["since"]).total_seconds() if row["since"] else None,
        }
        for row in rows
    }


def finished_per_hour(now: datetime.datetime) -> list[tuple[datetime.datetime, int]]:
    """Runs finished in each of the last 24 clock hours (UTC), oldest first, the current last."""
    since = (now - datetime.timedelta(hours=23)).replace(minute=0, second=0, microsecond=0)
    rows = (
        AgentRun.objects.filter(finished_at__gte=since)
        .annotate(hour=TruncHour("finished_at", tzinfo=datetime.UTC))
        .order_by()
        .values_list("hour")
        .annotate(n=Count("pk"))
    )
    # Keyed by naive UTC hours so that the backends' aware/naive results compare equal.
    counts: Counter[datetime.datetime] = Counter()
    for hour, n in rows:
        if hour is not None:
            counts[hour.astimezone(datetime.UTC).replace(tzinfo=None)] += n
    start = since.astimezone(datetime.UTC)
    hours = [start + datetime.timedelta(hours=h) for h in range(24)]
    return [(hour, counts.get(hour.replace(tzinfo=None), 0)) for hour in hours]


def collect(now: datetime.datetime | None = None) -> dict[str, Any]:
    """The figures as JSON-ready values, for snapshots."""
    now = now or timezone.now()
    pending = oldest_pending()
    steps = steps_of_recent_finished_runs()
    waiting, oldest_intent = waiting_intents()
    finished = AgentRun.objects.filter(status__in=FINISHED_STATUSES)
    return {
        "taken_at": now.isoformat(),
        "runs_by_status": runs_by_status(),
        "oldest_pending_created_at": pending.created_at.isoformat() if pending else None,
        "oldest_pending_age_seconds": (now - pending.created_at).total_seconds()
        if pending
        else None,
        "steps_per_run_p50": percentile(steps, 0.5),
        "steps_per_run_p95": percentile(steps, 0.95),
        "attempts_distribution": dict(attempts_distribution(finished)),
        "intents_waiting": waiting,
        "oldest_intent_age_seconds": (now - oldest_intent.created_at).total_seconds()
        if oldest_intent
        else None,
        "finished_per_hour": [n for _, n in finished_per_hour(now)],
        "waits_by_kind": waits_by_kind(now),
        "questions_open": AgentQuestion.objects.filter(status=QuestionStatus.OPEN).count(),
    }
