"""The metrics snapshot that ``housekeeping.snapshot_metrics`` stores in ``agent_metrics``.

The figures themselves are read in ``durable_agents.observe.figures`` (the same ones the operations
page and the Prometheus collector show); this module turns its part of them into JSON-ready
values, so that a dashboard or an alert can read their history cheaply.
"""

from __future__ import annotations

import datetime
from typing import Any

from durable_agents.observe.figures import (
    SNAPSHOT,
    Figures,
    attempts_label,
    percentile,
    read_figures,
)


def collect(now: datetime.datetime | None = None) -> dict[str, Any]:
    """The figures as JSON-ready values, for snapshots."""
    figures = read_figures(SNAPSHOT, now)
    pending = figures.pending.oldest_at if figures.pending else None
    intents = figures.intents
    return {
        "taken_at": figures.taken_at.isoformat(),
        "runs_by_status": dict(figures.runs_by_status),
        "oldest_pending_created_at": pending.isoformat() if pending else None,
        "oldest_pending_age_seconds": figures.age_seconds(pending),
        "steps_per_run_p50": percentile(figures.steps, 0.5),
        "steps_per_run_p95": percentile(figures.steps, 0.95),
        "attempts_distribution": {
            attempts_label(bucket): figures.attempts[bucket] for bucket in sorted(figures.attempts)
        },
        "intents_waiting": intents.count if intents else 0,
        "oldest_intent_age_seconds": figures.age_seconds(intents.oldest_at) if intents else None,
        "finished_per_hour": [n for _, n in figures.per_hour],
        "waits_by_kind": waits_by_kind(figures),
        "questions_open": figures.questions.count if figures.questions else 0,
    }


def waits_by_kind(figures: Figures) -> dict[str, dict[str, Any]]:
    """Waiting runs by what they wait for: how many, and the age of the oldest wait."""
    return {
        wait.kind or "unknown": {
            "runs": wait.runs,
            "oldest_age_seconds": figures.age_seconds(wait.oldest_since),
        }
        for wait in figures.waits
    }
