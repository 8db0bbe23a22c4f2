"""Rate limits as the Messages API enforces them, for the offline model and the fake servers.

The API limits an organisation per model on three measures: requests per minute (RPM), input
tokens per minute (ITPM) and output tokens per minute (OTPM). Each is a token bucket that
refills continuously, ``limit / 60`` per second, up to its capacity: a burst may spend the
whole bucket at once, after which capacity comes back gradually (it is not reset each
minute). ``burst_seconds`` sets the capacity to ``limit * burst_seconds / 60`` (60 by default:
a minute's worth).

A request is admitted only if every bucket holds what it needs when it starts: one request,
its input tokens (what it is billed for, cache reads excluded: ``billed_input_tokens``) and
its ``max_tokens`` of output. At its end ``settle`` corrects the output bucket to the output
tokens it really produced. A request some bucket cannot serve is rejected (a 429) with the
whole seconds to wait (``retry-after``) until every bucket it lacked would hold enough.

Every answer carries the ``anthropic-ratelimit-*`` headers (``headers``): for each limited
measure its limit, what remains now and when the bucket would be full again (RFC 3339);
``anthropic-ratelimit-tokens-*`` repeat the input or output figures, whichever bucket is
emptier (the most restrictive now). Unlike the API, which rounds token figures to the nearest
thousand, the figures are exact, so that tests can check them. A measure left at ``None`` is
not limited and has no headers.

Thread-safe: the fakes call it from many threads at once. It also counts what happened
(answered, rejected, in flight and the peak of it), in all and per concurrency key (a
``[key:NAME]`` marker in the task text, ``key_of``), so that a benchmark can prove how many
requests a client kept in flight.
"""

from __future__ import annotations

import dataclasses
import datetime
import enum
import functools
import math
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

# Float rounding must not turn "exactly enough" into "not enough": a bucket holding this much
# less than a request needs still serves it.
_EPSILON = 1e-6

_KEY = re.compile(r"\[key:([^\]\s]+)\]")


class Measure(enum.Enum):
    """What a bucket limits; the value is the measure's name in the ``anthropic-ratelimit-``
    headers."""

    REQUESTS = "requests"
    INPUT_TOKENS = "input-tokens"
    OUTPUT_TOKENS = "output-tokens"


_UNITS = {
    Measure.REQUESTS: "requests",
    Measure.INPUT_TOKENS: "input tokens",
    Measure.OUTPUT_TOKENS: "output tokens",
}


def key_of(task: str) -> str | None:
    """The concurrency key of a task: ``NAME`` of its first ``[key:NAME]`` marker, if any."""
    if "[key:" not in task:  # the common case, without the pattern
        return None
    m = _KEY.search(task)
    return m.group(1) if m else None


def billed_input_tokens(usage: Mapping[str, Any]) -> int:
    """The input tokens an answer's ``usage`` counts against ITPM: ``input_tokens`` plus
    ``cache_creation_input_tokens`` (cache reads do not count), summed over
    ``usage["iterations"]`` when the answer ran several passes (a compaction, then the
    message), as they are billed."""
    entries: Iterable[Mapping[str, Any]] = usage.get("iterations") or [usage]
    return sum(
        int(e.get("input_tokens") or 0) + int(e.get("cache_creation_input_tokens") or 0)
        for e in entries
    )


def billed_output_tokens(usage: Mapping[str, Any]) -> int:
    """The output tokens an answer's ``usage`` counts against OTPM, summed over its
    ``iterations`` when it ran several passes."""
    entries: Iterable[Mapping[str, Any]] = usage.get("iterations") or [usage]
    return sum(int(e.get("output_tokens") or 0) for e in entries)


def rfc3339(at: float) -> str:
    """``at`` (seconds since the epoch) as an RFC 3339 UTC time, rounded up to the second."""
    return _second(math.ceil(at - _EPSILON))


@functools.lru_cache(maxsize=1024)
def _second(at: int) -> str:
    # Cached: every answer carries up to four of these, and they change once a second.
    return datetime.datetime.fromtimestamp(at, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclasses.dataclass
class _Bucket:
    measure: Measure
    limit: int  # per minute
    capacity: float
    rate: float  # per second
    level: float
    at: float  # when ``level`` was last brought up to date

    def refill(self, now: float) -> None:
        # A clock that steps back (wall time) refills nothing rather than draining the bucket.
        elapsed = max(0.0, now - self.at)
        self.level = min(self.capacity, self.level + elapsed * self.rate)
        self.at = max(self.at, now)

    def wait_for(self, need: float) -> int:
        """Whole seconds until the bucket holds ``need`` (0: it does now). A need beyond its
        capacity is never met: then until it is full, at least a second."""
        if self.exceeded_by(need):
            return max(1, math.ceil((self.capacity - self.level) / self.rate - _EPSILON))
        missing = need - _EPSILON - self.level
        return 0 if missing <= 0 else math.ceil(missing / self.rate)

    def exceeded_by(self, need: float) -> bool:
        return need > self.capacity + _EPSILON

    def full_at(self) -> float:
        return self.at + max(0.0, self.capacity - self.level) / self.rate

    def remaining(self) -> int:
        return max(0, math.floor(self.level + _EPSILON))

    def state(self) -> dict[str, Any]:
        return {
            "limit": self.limit,
            "capacity": self.capacity,
            "level": self.level,
            "remaining": self.remaining(),
            "reset": rfc3339(self.full_at()),
        }


@dataclasses.dataclass(frozen=True)
class Admission:
    """A request let through: what it was charged, for ``settle`` at its end."""

    input_tokens: int
    max_tokens: int
    key: str | None


@dataclasses.dataclass(frozen=True)
class Rejection:
    """A request refused (a 429): the whole seconds to wait before it would be let through
    (``retry_after``), the measure that lacked the most, and every header of the answer
    (``retry-after`` and the ``anthropic-ratelimit-*`` ones)."""

    retry_after: int
    measure: Measure
    message: str
    headers: dict[str, str]

    def body(self) -> dict[str, Any]:
        """The API's error body for it."""
        return {"type": "error", "error": {"type": "rate_limit_error", "message": self.message}}


@dataclasses.dataclass
class _Tally:
    answered: int = 0
    rejected_429: int = 0
    in_flight: int = 0
    peak_in_flight: int = 0

    def enter(self) -> None:
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)

    def leave(self) -> None:
        self.in_flight -= 1
        self.answered += 1

    def reset(self) -> None:
        self.answered = self.rejected_429 = 0
        self.peak_in_flight = self.in_flight


class RateLimits:
    """The RPM, ITPM and OTPM buckets of one organisation and model, full at the start.

    ``RateLimits(requests_per_minute=50, output_tokens_per_minute=8000)``; a limit left at
    ``None`` is not enforced. ``clock`` returns seconds since the epoch (``time.time``; tests
    pass their own)."""

    def __init__(
        self,
        *,
        requests_per_minute: int | None = None,
        input_tokens_per_minute: int | None = None,
        output_tokens_per_minute: int | None = None,
        burst_seconds: float = 60.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not (isinstance(burst_seconds, int | float) and burst_seconds > 0):
            raise ValueError(f"burst_seconds must be a positive number, not {burst_seconds!r}")
        self.burst_seconds = float(burst_seconds)
        self._clock = clock
        self._lock = threading.Lock()
        self._buckets: dict[Measure, _Bucket] = {}
        limits = {
            Measure.REQUESTS: requests_per_minute,
            Measure.INPUT_TOKENS: input_tokens_per_minute,
            Measure.OUTPUT_TOKENS: output_tokens_per_minute,
        }
        now = clock()
        for measure, limit in limits.items():
            if limit is None:
                continue
            if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
                raise ValueError(
                    f"{_UNITS[measure]} per minute must be a positive integer or None, "
                    f"not {limit!r}"
                )
            capacity = limit * self.burst_seconds / 60
            self._buckets[measure] = _Bucket(measure, limit, capacity, limit / 60, capacity, now)
        self._all = _Tally()
        self._keys: dict[str, _Tally] = {}

    @property
    def limited(self) -> bool:
        """Whether any measure is limited (else only the counting is done)."""
        return bool(self._buckets)

    def admit(
        self, input_tokens: int, max_tokens: int, key: str | None = None
    ) -> Admission | Rejection:
        """Charge a request that starts now, or refuse it if any bucket lacks what it needs.

        ``input_tokens``: what it is billed for (cache reads excluded); ``max_tokens``: the
        output it may produce, held until ``settle``; ``key``: its concurrency key."""
        if input_tokens < 0 or max_tokens < 0:
            raise ValueError("input_tokens and max_tokens must not be negative")
        needs = {
            Measure.REQUESTS: 1.0,
            Measure.INPUT_TOKENS: float(input_tokens),
            Measure.OUTPUT_TOKENS: float(max_tokens),
        }
        with self._lock:
            now = self._clock()
            waits: dict[Measure, int] = {}
            for measure, bucket in self._buckets.items():
                bucket.refill(now)
                wait = bucket.wait_for(needs[measure])
                if wait:
                    waits[measure] = wait
            tally = self._tally(key)
            if waits:
                self._all.rejected_429 += 1
                if tally is not None:
                    tally.rejected_429 += 1
                return self._rejection(waits, needs)
            for measure, bucket in self._buckets.items():
                bucket.level -= needs[measure]
            self._all.enter()
            if tally is not None:
                tally.enter()
        return Admission(input_tokens, max_tokens, key)

    def settle(self, admission: Admission, output_tokens: int) -> None:
        """The end of an admitted request that produced ``output_tokens``: the output bucket
        gets back what was held beyond them (or gives more, if it produced more than its
        ``max_tokens``)."""
        with self._lock:
            bucket = self._buckets.get(Measure.OUTPUT_TOKENS)
            if bucket is not None:
                bucket.refill(self._clock())
                # Never above capacity: what was held may have been refilled meanwhile.
                bucket.level = min(
                    bucket.capacity, bucket.level + admission.max_tokens - output_tokens
                )
            self._all.leave()
            tally = self._tally(admission.key)
            if tally is not None:
                tally.leave()

    def headers(self) -> dict[str, str]:
        """The ``anthropic-ratelimit-*`` headers as of now."""
        with self._lock:
            now = self._clock()
            for bucket in self._buckets.values():
                bucket.refill(now)
            return self._headers()

    def stats(self) -> dict[str, Any]:
        """What happened since the start (or ``reset``) and the buckets now, as JSON values."""
        with self._lock:
            now = self._clock()
            for bucket in self._buckets.values():
                bucket.refill(now)
            return {
                **dataclasses.asdict(self._all),
                "buckets": {m.value: b.state() for m, b in self._buckets.items()},
                "keys": {k: dataclasses.asdict(t) for k, t in sorted(self._keys.items())},
            }

    def reset(self) -> None:
        """Fill every bucket and start the counts again (requests in flight stay counted)."""
        with self._lock:
            now = self._clock()
            for bucket in self._buckets.values():
                bucket.level, bucket.at = bucket.capacity, now
            self._all.reset()
            for tally in self._keys.values():
                tally.reset()

    # -- under the lock ----------------------------------------------------------------

    def _tally(self, key: str | None) -> _Tally | None:
        if key is None:
            return None
        tally = self._keys.get(key)
        if tally is None:
            tally = self._keys[key] = _Tally()
        return tally

    def _rejection(self, waits: dict[Measure, int], needs: dict[Measure, float]) -> Rejection:
        retry_after = max(waits.values())
        # The message names a need no wait can meet, else the bucket that makes it wait longest.
        never = [m for m in waits if self._buckets[m].exceeded_by(needs[m])]
        measure = never[0] if never else max(waits, key=lambda m: waits[m])
        bucket = self._buckets[measure]
        if never:
            message = (
                f"This request needs {needs[measure]:.0f} {_UNITS[measure]}, more than your "
                f"rate limit of {bucket.limit} {_UNITS[measure]} per minute allows at once "
                f"(offline model)."
            )
        else:
            message = (
                f"This request would exceed your rate limit of {bucket.limit} "
                f"{_UNITS[measure]} per minute (offline model). Retry after {retry_after}s."
            )
        headers = {"retry-after": str(retry_after), **self._headers()}
        return Rejection(retry_after, measure, message, headers)

    def _headers(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for measure, bucket in self._buckets.items():
            _put(out, measure.value, bucket)
        tokens = [
            b
            for m, b in self._buckets.items()
            if m in (Measure.INPUT_TOKENS, Measure.OUTPUT_TOKENS)
        ]
        if tokens:
            # The emptier bucket is the one that takes the longest to be full again.
            _put(out, "tokens", min(tokens, key=lambda b: b.level / b.capacity))
        return out


def _put(headers: dict[str, str], name: str, bucket: _Bucket) -> None:
    prefix = f"anthropic-ratelimit-{name}-"
    headers[prefix + "limit"] = str(bucket.limit)
    headers[prefix + "remaining"] = str(bucket.remaining())
    headers[prefix + "reset"] = rfc3339(bucket.full_at())
