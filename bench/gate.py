"""What the bench's fake Messages APIs (``bench.fakeapi``, ``bench.slowapi``) put in front of
their model: the API's rate limits, injected 529s, the answers' latency and the counts a
benchmark reads back, with the command-line flags both share.

Flags: ``--rpm``, ``--itpm``, ``--otpm`` (limits per minute, unlimited unless given),
``--burst-seconds`` (a bucket holds that many seconds of its limit, 60 by default),
``--latency MIN-MAX`` (seconds, uniform; or one figure), ``--overloaded-rate`` (the fraction of
requests answered 529 ``overloaded_error`` before any limit is charged), ``--seed``.

Endpoints: ``GET /stats`` (JSON: answered, rejected_429, overloaded_529, in_flight and
peak_in_flight, the buckets' levels, and the same counts per concurrency key, read from a
``[key:NAME]`` marker in the task) and ``POST /stats/reset`` (counts back to zero, buckets
full).

The limits are those of ``durable_agents.offline.RateLimits``; a request is charged
``len(body) // 4`` input tokens (what the fake's usage reports), so a long transcript costs
ITPM by its size while the fake never parses it, and its ``max_tokens`` of output, settled to
the answer's output tokens when it is sent.
"""

from __future__ import annotations

import argparse
import json
import random
import threading
from typing import Any

from durable_agents.offline import Admission, RateLimits, Rejection

Response = tuple[int, dict[str, str], bytes]

JSON = {"content-type": "application/json"}
OVERLOADED = json.dumps(
    {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
).encode()


def latency_range(text: str) -> tuple[float, float]:
    """``"0.5-1.5"`` -> (0.5, 1.5); ``"2"`` -> (2.0, 2.0)."""
    low, _, high = text.partition("-")
    try:
        bounds = (float(low), float(high or low))
    except ValueError:
        raise argparse.ArgumentTypeError(f"latency: MIN-MAX seconds, not {text!r}") from None
    if not 0 <= bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"latency: 0 <= MIN <= MAX, not {text!r}")
    return bounds


def fraction(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"a fraction from 0 to 1, not {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser, latency: str) -> None:
    """The flags of both fakes; ``latency``: the default of ``--latency``."""
    parser.add_argument("--rpm", type=int, default=None, help="requests per minute")
    parser.add_argument("--itpm", type=int, default=None, help="input tokens per minute")
    parser.add_argument("--otpm", type=int, default=None, help="output tokens per minute")
    parser.add_argument(
        "--burst-seconds", type=float, default=60.0, help="a bucket holds this many seconds"
    )
    parser.add_argument(
        "--latency", type=latency_range, default=latency_range(latency), help="MIN-MAX seconds"
    )
    parser.add_argument("--overloaded-rate", type=fraction, default=0.0, help="fraction of 529s")
    parser.add_argument("--seed", type=int, default=None)


class Gate:
    """Limits, faults, latency and counts of one fake server (thread-safe)."""

    def __init__(
        self,
        limits: RateLimits | None = None,
        latency: tuple[float, float] = (0.0, 0.0),
        overloaded_rate: float = 0.0,
        seed: int | None = None,
    ) -> None:
        self.limits = limits or RateLimits()
        self.min_latency, self.max_latency = latency
        self.overloaded_rate = overloaded_rate
        # Two generators: the latencies stay the same sequence whatever the rate of 529s.
        self._latency_rng = random.Random(seed)
        self._fault_rng = random.Random(None if seed is None else seed + 1)
        self._lock = threading.Lock()
        self.overloaded_529 = 0

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Gate:
        limits = RateLimits(
            requests_per_minute=args.rpm,
            input_tokens_per_minute=args.itpm,
            output_tokens_per_minute=args.otpm,
            burst_seconds=args.burst_seconds,
        )
        return cls(limits, args.latency, args.overloaded_rate, args.seed)

    def latency(self) -> float:
        if self.max_latency <= self.min_latency:
            return self.min_latency
        return self._latency_rng.uniform(self.min_latency, self.max_latency)

    def overloaded(self) -> Response | None:
        """A 529 for this request, at ``overloaded_rate`` (the API busy for everyone)."""
        if not self.overloaded_rate or self._fault_rng.random() >= self.overloaded_rate:
            return None
        with self._lock:
            self.overloaded_529 += 1
        return 529, dict(JSON), OVERLOADED

    def enter(self, input_tokens: int, max_tokens: int, key: str | None) -> Admission | Response:
        """A request starts: admitted, or the 529 or 429 to answer at once."""
        early = self.overloaded()
        if early is not None:
            return early
        outcome = self.limits.admit(input_tokens, max_tokens, key)
        if isinstance(outcome, Rejection):
            return 429, {**JSON, **outcome.headers}, json.dumps(outcome.body()).encode()
        return outcome

    def leave(self, admission: Admission, output_tokens: int) -> dict[str, str]:
        """A request's answer is complete: settled; the rate-limit headers to send with it."""
        self.limits.settle(admission, output_tokens)
        return self.limits.headers() if self.limits.limited else {}

    def stats(self) -> dict[str, Any]:
        return {**self.limits.stats(), "overloaded_529": self.overloaded_529}

    def reset(self) -> None:
        self.limits.reset()
        with self._lock:
            self.overloaded_529 = 0

    def endpoint(self, method: str, path: str) -> Response | None:
        """``GET /stats`` and ``POST /stats/reset``; None for any other request."""
        path = path.split("?", 1)[0]
        if path == "/stats/reset" and method == "POST":
            self.reset()
        elif not (path == "/stats" and method == "GET"):
            return None
        return 200, dict(JSON), json.dumps(self.stats()).encode()
