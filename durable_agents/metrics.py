"""The operational figures of the seed article's dashboard, computed from the tables.

``collect()`` is what the operations page shows; ``housekeeping.snapshot_metrics`` stores it
periodically in ``agent_metrics`` so that a dashboard or an alert can read history cheaply.
Every query uses an index (status, created_at) or is bounded.
"""

from __future__ import annotations

import datetime
from typing import Any

from django.db.models import Count, Min
from django.utils import timezone

from durable_agents.models import FINISHED_STATUSES, AgentRun, RunStatus, ToolIntent

# Percentiles are computed over the most recent finished runs, not the whole history.
PERCENTILE_SAMPLE = 10_000


def percentile(sorted_values: list[int], fraction: float) -> float | None:
    if not sorted_values:
        return None
    position = (len(sorted_values) - 1) * fraction
    low = int(position)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)


def collect(now: datetime.datetime | None = None) -> dict[str, Any]:
    now = now or timezone.now()
    by_status = dict(
        AgentRun.objects.order_by()
        .values_list("status")
        .annotate(n=Count("pk"))
        .values_list("status", "n")
    )
    oldest_pending = (
        AgentRun.objects.filter(status=RunStatus.PENDING).aggregate(oldest=Min("created_at"))
    )["oldest"]
    recent_finished = list(
        AgentRun.objects.filter(status__in=FINISHED_STATUSES)
        .order_by("-created_at")
        .values_list("last_seq", "attempt")[:PERCENTILE_SAMPLE]
    )
    steps = sorted(last_seq + 1 for last_seq, _ in recent_finished)
    attempts: dict[int, int] = {}
    for _, attempt in recent_finished:
        attempts[attempt] = attempts.get(attempt, 0) + 1
    waiting = ToolIntent.objects.awaiting_person()
    oldest_intent = waiting.aggregate(oldest=Min("created_at"))["oldest"]
    since = now - datetime.timedelta(hours=24)
    finished = AgentRun.objects.filter(
        finished_at__gte=since, status__in=FINISHED_STATUSES
    ).values_list("finished_at", flat=True)
    per_hour = [0] * 24
    for finished_at in finished:
        hours_ago = int((now - finished_at).total_seconds() // 3600)
        if 0 <= hours_ago < 24:
            per_hour[23 - hours_ago] += 1
    return {
        "taken_at": now.isoformat(),
        "runs_by_status": {status: by_status.get(status, 0) for status in RunStatus.values},
        "oldest_pending_created_at": oldest_pending.isoformat() if oldest_pending else None,
        "oldest_pending_age_seconds": (now - oldest_pending).total_seconds()
        if oldest_pending
        else None,
        "steps_per_run_p50": percentile(steps, 0.5),
        "steps_per_run_p95": percentile(steps, 0.95),
        "attempts_distribution": {str(k): attempts[k] for k in sorted(attempts)},
        "intents_waiting": waiting.count(),
        "oldest_intent_age_seconds": (now - oldest_intent).total_seconds()
        if oldest_intent
        else None,
        "finished_per_hour": per_hour,
    }
