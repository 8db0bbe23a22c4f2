"""The arithmetic of a model's buckets, on a ``ModelCapacity`` row: refill, grant, settle,
learn, pause. Pure functions of the row and the time; the gates (``gate.py``) call them with
the row locked, and save what they changed.

A bucket of a limit L per minute holds ``L * burst_seconds / 60`` at most and refills at L/60
per second, continuously: the API's own model. A call takes one request, its estimated input
tokens and its ``max_tokens`` of output (as the API charges output when a request starts);
when it answers, its ``usage`` gives back what the estimate took too much (or takes what it
took too little). A call larger than a bucket goes out when the bucket is full and leaves it
in debt, so no call waits forever.
"""

from __future__ import annotations

import datetime
import enum
import math
from dataclasses import dataclass

from durable_agents.flow.capacity import limits as limits_module
from durable_agents.flow.capacity.headers import Observed
from durable_agents.flow.capacity.limits import LIMIT_FIELDS, ModelLimits
from durable_agents.models import ModelCapacity

# The three buckets of a row: (limit column, level column).
BUCKETS = (
    ("requests_per_minute", "requests_level"),
    ("input_tokens_per_minute", "input_level"),
    ("output_tokens_per_minute", "output_level"),
)
# Weight of the newest call in the moving averages of what a call charges.
AVERAGE_WEIGHT = 0.1
# What ``calls_available`` answers for a model without limits.
UNLIMITED = 1_000_000
# How long a run refused for a higher priority's sake waits before it asks again.
PRIORITY_HOLD_SECONDS = 1.0


@dataclass(frozen=True)
class Estimate:
    """What one call takes before it goes out: one request, its input tokens (estimated from
    the request's size) and its ``max_tokens``."""

    input_tokens: int
    output_tokens: int

    def needs(self) -> tuple[float, float, float]:
        return (1.0, float(self.input_tokens), float(self.output_tokens))


class RefusalKind(enum.Enum):
    PAUSED = "paused"  # after a 429
    PRIORITY = "priority"  # a higher priority waits
    BUCKET = "bucket"  # a bucket is short


@dataclass(frozen=True)
class Refusal:
    """Why a call may not go out now, and how long until it may."""

    seconds: float
    reason: str
    kind: RefusalKind = RefusalKind.BUCKET


def capacity_of(row: ModelCapacity, limit_field: str) -> float | None:
    limit: float | None = getattr(row, limit_field)
    return None if limit is None else limit * row.burst_seconds / 60.0


def refill(row: ModelCapacity, now: datetime.datetime) -> None:
    """Bring the levels up to ``now``: each bucket refills at its limit per minute, up to its
    capacity. A clock that went back (another host's) refills nothing."""
    elapsed = max((now - row.refilled_at).total_seconds(), 0.0)
    for limit_field, level_field in BUCKETS:
        capacity = capacity_of(row, limit_field)
        if capacity is None:
            continue
        rate = getattr(row, limit_field) / 60.0
        level = getattr(row, level_field) + elapsed * rate
        setattr(row, level_field, min(level, capacity))
    row.refilled_at = max(now, row.refilled_at)


def refusal(
    row: ModelCapacity, estimate: Estimate, priority: int, now: datetime.datetime
) -> Refusal | None:
    """Why ``estimate`` may not go out now (the row refilled to ``now``), or None."""
    if row.paused_until is not None and row.paused_until > now:
        seconds = (row.paused_until - now).total_seconds()
        return Refusal(seconds, f"paused after a 429 for {seconds:.1f}s more", RefusalKind.PAUSED)
    if (
        row.waiting_priority is not None
        and row.waiting_priority > priority
        and row.waiting_priority_until is not None
        and row.waiting_priority_until > now
    ):
        seconds = min((row.waiting_priority_until - now).total_seconds(), PRIORITY_HOLD_SECONDS)
        return Refusal(
            seconds, f"runs of priority {row.waiting_priority} wait first", RefusalKind.PRIORITY
        )
    worst: Refusal | None = None
    for (limit_field, level_field), need in zip(BUCKETS, estimate.needs(), strict=True):
        capacity = capacity_of(row, limit_field)
        if capacity is None:
            continue
        need = min(need, capacity)  # a call larger than the bucket goes when it is full
        level = getattr(row, level_field)
        if level >= need:
            continue
        seconds = (need - level) / (getattr(row, limit_field) / 60.0)
        if worst is None or seconds > worst.seconds:
            worst = Refusal(seconds, limit_field.replace("_", " "))
    return worst


def take(row: ModelCapacity, estimate: Estimate) -> None:
    for (limit_field, level_field), need in zip(BUCKETS, estimate.needs(), strict=True):
        if getattr(row, limit_field) is not None:
            setattr(row, level_field, getattr(row, level_field) - need)
    row.calls += 1


def give_back(row: ModelCapacity, estimate: Estimate, used: tuple[int, int] | None) -> None:
    """Settle a call: ``used`` is what it charged (input without cache reads, output), or None
    for a call the API refused or never answered (it charged nothing: all of it comes back)."""
    charged = (0.0, 0.0, 0.0) if used is None else (1.0, float(used[0]), float(used[1]))
    for (limit_field, level_field), took, paid in zip(
        BUCKETS, estimate.needs(), charged, strict=True
    ):
        capacity = capacity_of(row, limit_field)
        if capacity is None:
            continue
        setattr(row, level_field, min(getattr(row, level_field) + took - paid, capacity))
    if used is not None:
        row.input_per_call += AVERAGE_WEIGHT * (used[0] - row.input_per_call)
        row.output_per_call += AVERAGE_WEIGHT * (used[1] - row.output_per_call)


def configure(row: ModelCapacity, limits: ModelLimits) -> bool:
    """Set the row's limits to ``RATE_LIMITS``'; True if they changed (a new limit starts with
    a full bucket, a lowered one clips its level)."""
    changed = not row.configured or row.burst_seconds != limits.burst_seconds
    row.configured = True
    row.probing = False
    row.burst_seconds = limits.burst_seconds
    for limit_field, level_field in BUCKETS:
        limit = getattr(limits, limit_field)
        if getattr(row, limit_field) != limit:
            changed = True
            if getattr(row, limit_field) is None and limit is not None:
                setattr(row, level_field, limit * limits.burst_seconds / 60.0)
            setattr(row, limit_field, limit)
        capacity = capacity_of(row, limit_field)
        if capacity is not None:
            setattr(row, level_field, min(getattr(row, level_field), capacity))
    return changed


def learn(row: ModelCapacity, observed: Observed) -> None:
    """What the API said: its limits (unless ``RATE_LIMITS`` sets them), and what remains in
    its buckets, which lowers ours (never raises them: the API's bucket is larger than ours,
    and what it has left may be other clients' to take)."""
    if row.probing:
        # The real limits replace the probe's, and the buckets hold what the API says remains
        # (up to their capacity): the burst the probe held back is there to be used.
        row.probing = False
        row.burst_seconds = limits_module.DEFAULT_BURST_SECONDS
        for (limit_field, level_field), report in zip(
            BUCKETS, (observed.requests, observed.input, observed.output), strict=True
        ):
            if report is not None:
                setattr(row, limit_field, report.limit)
                setattr(row, level_field, min(report.remaining, capacity_of(row, limit_field) or 0))
    for (limit_field, level_field), report in zip(
        BUCKETS, (observed.requests, observed.input, observed.output), strict=True
    ):
        if report is None:
            continue
        if not row.configured and getattr(row, limit_field) != report.limit:
            first = getattr(row, limit_field) is None
            setattr(row, limit_field, report.limit)
            if first:
                setattr(row, level_field, capacity_of(row, limit_field))
        if getattr(row, limit_field) is not None:
            setattr(row, level_field, min(getattr(row, level_field), report.remaining))


def pause(row: ModelCapacity, seconds: float, now: datetime.datetime) -> None:
    """A 429: no call to this model from any worker until ``seconds`` from now, and the
    buckets empty (they refill from the end of the pause, as the API's do)."""
    until = now + datetime.timedelta(seconds=seconds)
    if row.paused_until is None or row.paused_until < until:
        row.paused_until = until
    for limit_field, level_field in BUCKETS:
        if getattr(row, limit_field) is not None:
            setattr(row, level_field, min(getattr(row, level_field), 0.0))
    row.refilled_at = max(row.refilled_at, row.paused_until)
    row.rate_limited += 1
    row.pauses += 1


def note_waiting(
    row: ModelCapacity,
    priority: int,
    seconds: float,
    now: datetime.datetime,
    *,
    count: bool = True,
) -> None:
    """A run of ``priority`` was handed back to wait ``seconds`` for capacity (or is pending,
    ``count=False``): until it is claimed, runs of a lower priority are refused (grants go
    highest first)."""
    if count:
        row.capacity_waits += 1
    until = now + datetime.timedelta(seconds=seconds + PRIORITY_HOLD_SECONDS)
    current = row.waiting_priority
    expired = row.waiting_priority_until is None or row.waiting_priority_until <= now
    if current is None or expired or priority > current:
        row.waiting_priority, row.waiting_priority_until = priority, until
    elif priority == current and row.waiting_priority_until is not None:
        row.waiting_priority_until = max(row.waiting_priority_until, until)


# A model whose limits are not known yet: at most this many calls at once, then this many a
# minute, until an answer's headers say more (the API also refuses sharp increases).
PROBE_REQUESTS_PER_MINUTE = 60.0
PROBE_BURST_SECONDS = 10.0


def start_probing(row: ModelCapacity) -> None:
    """A model never called, without RATE_LIMITS: a modest request limit until the first
    answer (``learn``, or ``stop_probing`` when it carries no rate-limit headers)."""
    row.probing = True
    row.requests_per_minute = PROBE_REQUESTS_PER_MINUTE
    row.burst_seconds = PROBE_BURST_SECONDS
    row.requests_level = PROBE_REQUESTS_PER_MINUTE * PROBE_BURST_SECONDS / 60.0


def stop_probing(row: ModelCapacity) -> None:
    """An answer without rate-limit headers (a provider that sends none): no limits."""
    row.probing = False
    for limit_field, _ in BUCKETS:
        setattr(row, limit_field, None)


def calls_available(row: ModelCapacity, now: datetime.datetime) -> tuple[int, float]:
    """How many average calls the buckets have room for now (refilled to ``now`` first), and
    in how many seconds there is room for one more (0 if there is now)."""
    refill(row, now)
    if row.paused_until is not None and row.paused_until > now:
        return 0, (row.paused_until - now).total_seconds()
    per_call = (1.0, max(row.input_per_call, 1.0), max(row.output_per_call, 1.0))
    room = math.inf
    wait = 0.0
    for (limit_field, level_field), need in zip(BUCKETS, per_call, strict=True):
        limit = getattr(row, limit_field)
        if limit is None:
            continue
        level = getattr(row, level_field)
        room = min(room, max(level, 0.0) / need)
        if level < need:
            wait = max(wait, (need - level) / (limit / 60.0))
    calls = UNLIMITED if room == math.inf else min(int(room), UNLIMITED)
    return calls, wait


__all__ = [
    "BUCKETS",
    "LIMIT_FIELDS",
    "Estimate",
    "Refusal",
    "calls_available",
    "configure",
    "give_back",
    "learn",
    "note_waiting",
    "pause",
    "refill",
    "refusal",
    "take",
]
