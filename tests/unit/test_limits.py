"""The rate limiter of the offline model and the fakes: token-bucket arithmetic on a fake clock."""

from __future__ import annotations

import threading

import pytest

from durable_agents.offline.limits import (
    Admission,
    Measure,
    RateLimits,
    Rejection,
    billed_input_tokens,
    key_of,
    rfc3339,
)

T0 = 1_700_000_000.0  # 2023-11-14T22:13:20Z


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def admitted(outcome: Admission | Rejection) -> Admission:
    assert isinstance(outcome, Admission), outcome
    return outcome


def rejected(outcome: Admission | Rejection) -> Rejection:
    assert isinstance(outcome, Rejection), outcome
    return outcome


def test_a_burst_spends_the_whole_bucket_then_capacity_returns_gradually(clock: Clock) -> None:
    limits = RateLimits(requests_per_minute=60, clock=clock)
    for _ in range(60):
        admitted(limits.admit(0, 0))
    assert rejected(limits.admit(0, 0)).retry_after == 1
    clock.now += 0.5  # half a request back: not enough
    rejected(limits.admit(0, 0))
    clock.now += 0.5
    admitted(limits.admit(0, 0))
    clock.now += 30  # 30 back, not a full bucket: it refills, it is not reset each minute
    for _ in range(30):
        admitted(limits.admit(0, 0))
    assert rejected(limits.admit(0, 0)).measure is Measure.REQUESTS


def test_refill_stops_at_capacity(clock: Clock) -> None:
    limits = RateLimits(requests_per_minute=60, clock=clock)
    admitted(limits.admit(0, 0))
    clock.now += 3600
    for _ in range(60):
        admitted(limits.admit(0, 0))
    rejected(limits.admit(0, 0))


def test_burst_seconds_sets_the_capacity_not_the_rate(clock: Clock) -> None:
    limits = RateLimits(requests_per_minute=60, burst_seconds=10, clock=clock)
    for _ in range(10):
        admitted(limits.admit(0, 0))
    assert rejected(limits.admit(0, 0)).retry_after == 1  # still 1 per second
    assert limits.headers()["anthropic-ratelimit-requests-limit"] == "60"


def test_retry_after_is_exact_in_whole_seconds(clock: Clock) -> None:
    limits = RateLimits(requests_per_minute=7, clock=clock)  # one every 60/7 = 8.57 s
    for _ in range(7):
        admitted(limits.admit(0, 0))
    rejection = rejected(limits.admit(0, 0))
    assert rejection.retry_after == 9
    assert rejection.headers["retry-after"] == "9"
    clock.now += 8
    assert rejected(limits.admit(0, 0)).retry_after == 1  # 0.57 s still missing, rounded up
    clock.now += 1
    admitted(limits.admit(0, 0))


def test_input_tokens_wait_for_what_the_request_needs(clock: Clock) -> None:
    limits = RateLimits(input_tokens_per_minute=6000, clock=clock)  # 100 a second
    admitted(limits.admit(5000, 0))
    rejection = rejected(limits.admit(3000, 0))
    assert rejection.measure is Measure.INPUT_TOKENS
    assert rejection.retry_after == 20  # 2,000 missing at 100 a second
    clock.now += 19
    rejected(limits.admit(3000, 0))
    clock.now += 1
    admitted(limits.admit(3000, 0))


def test_output_held_at_max_tokens_then_settled_to_what_was_produced(clock: Clock) -> None:
    limits = RateLimits(output_tokens_per_minute=1000, clock=clock)
    first = admitted(limits.admit(0, 800))
    assert limits.headers()["anthropic-ratelimit-output-tokens-remaining"] == "200"
    assert rejected(limits.admit(0, 800)).measure is Measure.OUTPUT_TOKENS
    limits.settle(first, 100)  # 700 of the 800 held come back
    assert limits.headers()["anthropic-ratelimit-output-tokens-remaining"] == "900"
    admitted(limits.admit(0, 800))


def test_output_beyond_max_tokens_is_a_debt(clock: Clock) -> None:
    limits = RateLimits(output_tokens_per_minute=600, clock=clock)  # 10 a second
    limits.settle(admitted(limits.admit(0, 100)), 700)  # 600 more than held: level -100
    assert limits.headers()["anthropic-ratelimit-output-tokens-remaining"] == "0"
    assert rejected(limits.admit(0, 1)).retry_after == 11  # from -100 to 1


def test_settling_never_fills_beyond_capacity(clock: Clock) -> None:
    limits = RateLimits(output_tokens_per_minute=600, clock=clock)
    held = admitted(limits.admit(0, 600))
    clock.now += 60  # full again while the request ran
    limits.settle(held, 0)
    for _ in range(6):
        admitted(limits.admit(0, 100))
    rejected(limits.admit(0, 100))


def test_every_bucket_must_hold_enough_and_a_rejection_charges_nothing(clock: Clock) -> None:
    limits = RateLimits(
        requests_per_minute=60, input_tokens_per_minute=600, output_tokens_per_minute=60,
        clock=clock,
    )  # fmt: skip
    admitted(limits.admit(600, 0))
    rejection = rejected(limits.admit(100, 120))  # input: 10 s; output: beyond capacity
    assert rejection.retry_after == 10
    assert rejection.measure is Measure.OUTPUT_TOKENS
    assert "more than your rate limit of 60 output tokens per minute" in rejection.message
    headers = limits.headers()
    assert headers["anthropic-ratelimit-requests-remaining"] == "59"  # not charged
    assert headers["anthropic-ratelimit-output-tokens-remaining"] == "60"


def test_a_need_beyond_capacity_waits_until_the_bucket_is_full(clock: Clock) -> None:
    limits = RateLimits(output_tokens_per_minute=60, clock=clock)
    assert rejected(limits.admit(0, 61)).retry_after == 1  # full now: never enough
    admitted(limits.admit(0, 30))
    assert rejected(limits.admit(0, 61)).retry_after == 30


def test_headers_values(clock: Clock) -> None:
    limits = RateLimits(
        requests_per_minute=60, input_tokens_per_minute=6000, output_tokens_per_minute=600,
        clock=clock,
    )  # fmt: skip
    admitted(limits.admit(1200, 300))
    clock.now += 0.25
    assert limits.headers() == {
        "anthropic-ratelimit-requests-limit": "60",
        "anthropic-ratelimit-requests-remaining": "59",  # 59.25
        "anthropic-ratelimit-requests-reset": "2023-11-14T22:13:21Z",  # full at +1 s
        "anthropic-ratelimit-input-tokens-limit": "6000",
        "anthropic-ratelimit-input-tokens-remaining": "4825",
        "anthropic-ratelimit-input-tokens-reset": "2023-11-14T22:13:32Z",  # +12 s
        "anthropic-ratelimit-output-tokens-limit": "600",
        "anthropic-ratelimit-output-tokens-remaining": "302",  # 302.5
        "anthropic-ratelimit-output-tokens-reset": "2023-11-14T22:13:50Z",  # +30 s
        # The output bucket is the emptier (half full, the input one 80 %): it restricts most.
        "anthropic-ratelimit-tokens-limit": "600",
        "anthropic-ratelimit-tokens-remaining": "302",
        "anthropic-ratelimit-tokens-reset": "2023-11-14T22:13:50Z",
    }


def test_reset_rounds_up_to_the_second() -> None:
    assert rfc3339(T0) == "2023-11-14T22:13:20Z"
    assert rfc3339(T0 + 0.001) == "2023-11-14T22:13:21Z"


def test_a_measure_left_unlimited_has_no_headers(clock: Clock) -> None:
    limits = RateLimits(requests_per_minute=5, clock=clock)
    assert sorted(limits.headers()) == [
        "anthropic-ratelimit-requests-limit",
        "anthropic-ratelimit-requests-remaining",
        "anthropic-ratelimit-requests-reset",
    ]
    unlimited = RateLimits(clock=clock)
    assert not unlimited.limited
    for _ in range(1000):
        admitted(unlimited.admit(10**9, 10**9))
    assert unlimited.headers() == {}


def test_counts_in_all_and_per_key(clock: Clock) -> None:
    limits = RateLimits(requests_per_minute=3, clock=clock)
    a1, a2 = admitted(limits.admit(0, 0, "a")), admitted(limits.admit(0, 0, "a"))
    b1 = admitted(limits.admit(0, 0, "b"))
    rejected(limits.admit(0, 0, "b"))
    limits.settle(a1, 0)
    stats = limits.stats()
    assert (stats["answered"], stats["rejected_429"]) == (1, 1)
    assert (stats["in_flight"], stats["peak_in_flight"]) == (2, 3)
    assert stats["keys"] == {
        "a": {"answered": 1, "rejected_429": 0, "in_flight": 1, "peak_in_flight": 2},
        "b": {"answered": 0, "rejected_429": 1, "in_flight": 1, "peak_in_flight": 1},
    }
    assert stats["buckets"]["requests"]["remaining"] == 0
    limits.reset()
    stats = limits.stats()
    assert (stats["answered"], stats["rejected_429"], stats["peak_in_flight"]) == (0, 0, 2)
    assert stats["buckets"]["requests"]["remaining"] == 3
    limits.settle(a2, 0)
    limits.settle(b1, 0)
    assert limits.stats()["in_flight"] == 0


def test_threads_never_admit_more_than_the_bucket_holds(clock: Clock) -> None:
    limits = RateLimits(requests_per_minute=500, clock=clock)
    outcomes: list[Admission | Rejection] = []
    lock = threading.Lock()

    def hammer() -> None:
        for _ in range(100):
            outcome = limits.admit(0, 0)
            with lock:
                outcomes.append(outcome)

    threads = [threading.Thread(target=hammer) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(isinstance(o, Admission) for o in outcomes) == 500
    assert limits.stats()["rejected_429"] == 300


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"requests_per_minute": 0}, "requests per minute must be a positive integer"),
        ({"input_tokens_per_minute": 1.5}, "input tokens per minute"),
        ({"output_tokens_per_minute": True}, "output tokens per minute"),
        ({"burst_seconds": 0}, "burst_seconds must be a positive number"),
    ],
)
def test_bad_limits_are_a_value_error(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RateLimits(**kwargs)  # type: ignore[arg-type]


def test_negative_tokens_are_a_value_error() -> None:
    with pytest.raises(ValueError, match="must not be negative"):
        RateLimits(requests_per_minute=1).admit(-1, 0)


def test_billed_input_tokens_leaves_out_cache_reads_and_sums_iterations() -> None:
    usage = {"input_tokens": 10, "cache_creation_input_tokens": 5, "cache_read_input_tokens": 99}
    assert billed_input_tokens(usage) == 15
    compacted = {
        "input_tokens": 10,
        "iterations": [
            {"type": "compaction", "input_tokens": 1000, "cache_read_input_tokens": 7},
            {"type": "message", "input_tokens": 10, "cache_creation_input_tokens": 0},
        ],
    }
    assert billed_input_tokens(compacted) == 1010


@pytest.mark.parametrize(
    ("task", "key"),
    [
        ("Summarise [key:tenant-7] the report", "tenant-7"),
        ("[key:a] then [key:b]", "a"),
        ("no marker", None),
        ("[key:] empty", None),
    ],
)
def test_key_of(task: str, key: str | None) -> None:
    assert key_of(task) == key
