"""What the API says about its buckets: the ``anthropic-ratelimit-*`` headers of an answer.

Every answer (429s too) carries, for requests, input tokens and output tokens, the limit per
minute, what remains in the bucket now, and when it would be full again. The fleet uses the
limit when ``RATE_LIMITS`` names none, and what remains to correct its own bucket downwards
(other clients of the same organisation, or a bucket smaller than assumed).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

PREFIX = "anthropic-ratelimit-"
_KINDS = {"requests": "requests", "input": "input-tokens", "output": "output-tokens"}


@dataclass(frozen=True)
class BucketReport:
    limit: float
    remaining: float


@dataclass(frozen=True)
class Observed:
    """The API's own view of its buckets at one answer; None where it said nothing."""

    requests: BucketReport | None = None
    input: BucketReport | None = None
    output: BucketReport | None = None

    @property
    def any(self) -> bool:
        return self.requests is not None or self.input is not None or self.output is not None


def _number(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        number = float(value)
    except ValueError:
        return None
    return number if number >= 0 and number == number and number != float("inf") else None


def _report(headers: Mapping[str, str], name: str) -> BucketReport | None:
    limit = _number(headers.get(f"{PREFIX}{name}-limit"))
    remaining = _number(headers.get(f"{PREFIX}{name}-remaining"))
    if limit is None or remaining is None or limit <= 0:
        return None
    return BucketReport(limit, min(remaining, limit))


def observed(headers: Mapping[str, str] | None) -> Observed | None:
    """The buckets an answer's headers describe, or None if they describe none (hostile or
    missing values are ignored, never trusted)."""
    if not headers:
        return None
    found = Observed(**{field: _report(headers, name) for field, name in _KINDS.items()})
    return found if found.any else None
