"""Model capacity without a database: the buckets' arithmetic, the gate in memory on a manual
clock, and a run that waits for capacity (handed back, uncounted, claimed again later)."""

from __future__ import annotations

import contextlib
import datetime
import threading
import time
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import pytest

from durable_agents.declare.agents import Agent
from durable_agents.declare.tools import tool
from durable_agents.engine.runner import Disposition, advance_run
from durable_agents.flow.capacity import Estimate, Outlook, buckets, limit_problems, observed
from durable_agents.flow.capacity import gate as gate_module
from durable_agents.flow.capacity.headers import BucketReport, Observed
from durable_agents.flow.capacity.limits import ModelLimits
from durable_agents.flow.capacity.memory import InMemoryCapacity
from durable_agents.models import ModelCapacity, RunStatus, WaitKind
from durable_agents.store import InMemoryStore
from durable_agents.store.memory import ManualClock
from tests.unit.conftest import RegisterAgent, claimed, start

T0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
MODEL = "claude-capacity-1"


def row_with(**limits: Any) -> ModelCapacity:
    row = ModelCapacity(model=MODEL, refilled_at=T0, updated_at=T0)
    buckets.configure(row, ModelLimits(**limits))
    return row


def at(seconds: float) -> datetime.datetime:
    return T0 + datetime.timedelta(seconds=seconds)


# -- the arithmetic ---------------------------------------------------------------------------


def test_a_bucket_holds_its_burst_and_refills_continuously() -> None:
    row = row_with(requests_per_minute=600, burst_seconds=10)  # 10 a second, 100 at most
    assert row.requests_level == 100
    for _ in range(100):
        assert buckets.refusal(row, Estimate(0, 0), 0, T0) is None
        buckets.take(row, Estimate(0, 0))
    refused = buckets.refusal(row, Estimate(0, 0), 0, T0)
    assert refused is not None
    assert refused.seconds == pytest.approx(0.1)  # one request refills in a tenth of a second
    buckets.refill(row, at(2.5))
    assert row.requests_level == pytest.approx(25)
    buckets.refill(row, at(60))
    assert row.requests_level == 100  # never above the burst


def test_tokens_are_estimated_then_settled_by_usage() -> None:
    row = row_with(input_tokens_per_minute=60_000, output_tokens_per_minute=6_000, burst_seconds=60)
    estimate = Estimate(input_tokens=10_000, output_tokens=4_000)  # output: max_tokens
    buckets.take(row, estimate)
    assert (row.input_level, row.output_level) == (50_000, 2_000)
    # The answer used 8,000 input tokens (cache reads excluded) and 500 output tokens.
    buckets.give_back(row, estimate, (8_000, 500))
    assert (row.input_level, row.output_level) == (52_000, 5_500)
    assert row.output_per_call == pytest.approx(50)  # the average moves towards 500
    # A call refused by the API charged nothing: all of it comes back.
    buckets.take(row, estimate)
    buckets.give_back(row, estimate, None)
    assert (row.input_level, row.output_level) == (52_000, 5_500)


def test_a_call_larger_than_the_bucket_waits_for_a_full_bucket_then_goes_into_debt() -> None:
    row = row_with(input_tokens_per_minute=6_000, burst_seconds=10)  # holds 1,000
    huge = Estimate(input_tokens=5_000, output_tokens=0)
    buckets.take(row, Estimate(500, 0))
    refused = buckets.refusal(row, huge, 0, T0)
    assert refused is not None
    assert refused.seconds == pytest.approx(5)
    buckets.refill(row, at(5))
    assert buckets.refusal(row, huge, 0, at(5)) is None
    buckets.take(row, huge)
    assert row.input_level == -4_000
    refused = buckets.refusal(row, Estimate(100, 0), 0, at(5))
    assert refused is not None
    assert refused.seconds == pytest.approx(41)


def test_the_api_headers_lower_the_buckets_and_teach_limits_never_raise_them() -> None:
    learned = ModelCapacity(model=MODEL, refilled_at=T0, updated_at=T0)
    buckets.learn(learned, Observed(requests=BucketReport(limit=1200, remaining=150)))
    assert learned.requests_per_minute == 1200
    assert learned.requests_level == 150  # a 10 s bucket holds 200; the API says 150 remain
    buckets.learn(learned, Observed(requests=BucketReport(limit=1200, remaining=1199)))
    assert learned.requests_level == 150
    configured = row_with(requests_per_minute=600)
    buckets.learn(configured, Observed(requests=BucketReport(limit=4000, remaining=20)))
    assert configured.requests_per_minute == 600  # RATE_LIMITS wins over the headers
    assert configured.requests_level == 20


def test_hostile_headers_are_ignored() -> None:
    assert observed(None) is None
    assert observed({"anthropic-ratelimit-requests-limit": "nan"}) is None
    assert (
        observed(
            {
                "anthropic-ratelimit-requests-limit": "-5",
                "anthropic-ratelimit-requests-remaining": "1",
            }
        )
        is None
    )
    seen = observed(
        {
            "anthropic-ratelimit-input-tokens-limit": "1000",
            "anthropic-ratelimit-input-tokens-remaining": "5000",
        }
    )
    assert seen is not None
    assert seen.input == BucketReport(1000, 1000)


def test_a_pause_empties_the_buckets_and_they_refill_from_its_end() -> None:
    row = row_with(requests_per_minute=600, burst_seconds=10)
    buckets.pause(row, 30, T0)
    assert row.paused_until == at(30)
    refused = buckets.refusal(row, Estimate(0, 0), 0, at(10))
    assert refused is not None
    assert refused.seconds == pytest.approx(20)
    buckets.refill(row, at(31))
    assert row.requests_level == pytest.approx(10)
    assert (row.rate_limited, row.pauses) == (1, 1)


def test_runs_of_a_higher_priority_waiting_are_served_first_for_a_bounded_time() -> None:
    row = row_with(requests_per_minute=600)
    buckets.note_waiting(row, priority=10, seconds=2, now=T0)
    refused = buckets.refusal(row, Estimate(0, 0), 0, T0)
    assert refused is not None
    assert refused.seconds == buckets.PRIORITY_HOLD_SECONDS
    assert buckets.refusal(row, Estimate(0, 0), 10, T0) is None
    assert buckets.refusal(row, Estimate(0, 0), 50, T0) is None
    # Once nobody of that priority was handed back for a while, everyone is served again.
    assert buckets.refusal(row, Estimate(0, 0), 0, at(2 + buckets.PRIORITY_HOLD_SECONDS)) is None


def test_bad_rate_limits_are_named_one_by_one() -> None:
    assert limit_problems({MODEL: {"requests_per_minute": 100}, "*": {}}) == []
    problems = limit_problems(
        {
            "a": {"requests_per_minute": "lots"},
            "b": {"requests_per_minute": 0},
            "c": {"requests_per_minutes": 5},
            "d": {"input_tokens_per_minute": True},
            "e": {"burst_seconds": 600},
            "": {},
            "f": 5,
        }
    )
    assert len(problems) == 7
    assert "must be a number" in problems[0]
    assert "positive" in problems[1]
    assert "unknown keys ['requests_per_minutes']" in problems[2]
    assert limit_problems([1]) == ["RATE_LIMITS must be a dict of model name to limits, not list"]


# -- the gate, in memory ----------------------------------------------------------------------


@pytest.fixture
def limits(settings: Any) -> Any:
    def set_limits(**by_model: dict[str, Any]) -> None:
        settings.DURABLE_AGENTS = {**settings.DURABLE_AGENTS, "RATE_LIMITS": by_model}

    return set_limits


def test_a_model_never_called_ramps_up_until_its_first_answer(clock: ManualClock) -> None:
    gate = InMemoryCapacity(clock)
    # No RATE_LIMITS, no answer yet: ten calls at once, then one a second.
    grants = [gate.acquire(MODEL, Estimate(100, 100), 0) for _ in range(11)]
    assert [g.granted for g in grants] == [True] * 10 + [False]
    assert grants[-1].wait_seconds == pytest.approx(1.0)
    assert gate.rows[MODEL].probing
    # The first answer's headers say the real limits.
    gate.settle(
        grants[0],
        (100, 10),
        observed(
            {
                "anthropic-ratelimit-requests-limit": "1200",
                "anthropic-ratelimit-requests-remaining": "1100",
            }
        ),
    )
    row = gate.rows[MODEL]
    assert (row.probing, row.requests_per_minute) == (False, 1200)
    clock.advance(1)
    assert gate.acquire(MODEL, Estimate(100, 100), 0).granted  # 20 a second now


def test_a_model_whose_answers_carry_no_limits_costs_nothing(clock: ManualClock) -> None:
    gate = InMemoryCapacity(clock)
    first = gate.acquire(MODEL, Estimate(100, 100), 0)
    gate.settle(first, (100, 10), None)  # an answer without rate-limit headers
    assert not gate.rows[MODEL].probing
    grant = gate.acquire(MODEL, Estimate(100, 100), 0)
    assert (grant.granted, grant.limited) == (True, False)
    assert gate._known_absent(MODEL)  # the next calls do not even read the row
    assert gate.outlook({MODEL}) == Outlook({MODEL: None}, 0.0)
    assert gate.outlook({MODEL}).room is None


def test_once_its_time_is_over_one_call_reads_the_row_while_the_others_go_on(
    clock: ManualClock,
) -> None:
    """Past ABSENT_TTL_SECONDS one call reads the row again; the calls that come while it
    reads are granted on what was known, without queueing on the row."""

    class SlowRow(InMemoryCapacity):
        def __init__(self) -> None:
            super().__init__(clock)
            self.reads = 0
            self.reading = threading.Event()
            self.release = threading.Event()

        @contextlib.contextmanager
        def _locked(self, model: str, create: bool) -> Iterator[Any]:
            self.reads += 1
            self.reading.set()
            assert self.release.wait(30)
            with super()._locked(model, create) as locked:
                yield locked

    gate = SlowRow()
    gate.release.set()
    gate.settle(gate.acquire(MODEL, Estimate(100, 100), 0), (100, 10), None)
    assert gate.acquire(MODEL, Estimate(100, 100), 0).granted
    assert gate._known_absent(MODEL)
    reads = gate.reads
    gate._absent[MODEL] = time.monotonic() - 1  # its time is over
    gate.release.clear()
    gate.reading.clear()
    rereader = threading.Thread(target=gate.acquire, args=(MODEL, Estimate(100, 100), 0))
    rereader.start()
    assert gate.reading.wait(30)
    others = [gate.acquire(MODEL, Estimate(100, 100), 0) for _ in range(5)]
    assert [(grant.granted, grant.limited) for grant in others] == [(True, False)] * 5
    assert gate.reads == reads + 1  # only the rereader's
    gate.release.set()
    rereader.join(30)
    assert gate._absent[MODEL] > time.monotonic()  # known again, for another while
    assert gate._rereading == set()


def test_a_short_wait_is_reserved_a_long_one_refused(clock: ManualClock, limits: Any) -> None:
    limits(**{MODEL: {"requests_per_minute": 60, "burst_seconds": 1}})  # one a second
    gate = InMemoryCapacity(clock)
    assert gate.acquire(MODEL, Estimate(1, 1), 0, max_wait=1.0).wait_seconds == 0
    reserved = gate.acquire(MODEL, Estimate(1, 1), 0, max_wait=1.0)
    assert reserved.granted
    assert reserved.wait_seconds == pytest.approx(1.0)
    refused = gate.acquire(MODEL, Estimate(1, 1), 0, max_wait=1.0)
    assert not refused.granted
    # Behind the reservation: two seconds away, so handed back; claimable again within a
    # second (the claimer takes runs in priority order as room returns).
    assert refused.wait_seconds == pytest.approx(gate_module.MAX_HOLD_SECONDS)
    gate.queued(MODEL, 5)
    assert not gate.acquire(MODEL, Estimate(1, 1), 0, max_wait=5.0).granted  # priority first


def test_the_gate_grants_what_the_limits_allow_and_says_how_long_to_wait(
    clock: ManualClock, limits: Any
) -> None:
    limits(**{MODEL: {"requests_per_minute": 60, "burst_seconds": 2}})  # two at once
    gate = InMemoryCapacity(clock)
    first, second, third = (gate.acquire(MODEL, Estimate(10, 10), 0) for _ in range(3))
    assert (first.granted, second.granted, third.granted) == (True, True, False)
    assert third.wait_seconds == pytest.approx(1.0)
    assert third.reason == "requests per minute"
    # A model never called has the room of its probe (a few calls until it answers).
    assert gate.outlook({MODEL, "other"}).calls == {MODEL: 0, "other": 10}
    assert gate.outlook({MODEL}).room == 0
    assert gate.outlook({MODEL}).next_in == pytest.approx(1.0)
    clock.advance(1)
    assert gate.acquire(MODEL, Estimate(10, 10), 0).granted


def test_a_429_pauses_the_model_for_every_run(clock: ManualClock, limits: Any) -> None:
    gate = InMemoryCapacity(clock)
    gate.rate_limited(
        MODEL,
        7,
        observed(
            {
                "anthropic-ratelimit-requests-limit": "50",
                "anthropic-ratelimit-requests-remaining": "0",
            }
        ),
    )
    grant = gate.acquire(MODEL, Estimate(1, 1), 100)
    assert not grant.granted
    assert grant.wait_seconds == pytest.approx(7)
    assert [event.kind for event in gate.events] == ["rate_limited"]
    # After the pause the buckets refill at the limit the headers taught: 50 a minute.
    clock.advance(7 + 60 / 50 - 0.1)
    assert not gate.acquire(MODEL, Estimate(1, 1), 0).granted
    clock.advance(0.1)
    assert gate.acquire(MODEL, Estimate(1, 1), 0).granted


# -- a run that waits for capacity ------------------------------------------------------------


@tool(effect="pure")
def capacity_lookup(key: str) -> str:
    """Read a value by key."""
    return f"value-of-{key}"


@pytest.fixture
def agent(register_agent: RegisterAgent) -> Agent:
    return register_agent(
        name="unit-capacity",
        model=MODEL,
        system="You are the capacity test agent.",
        tools=[capacity_lookup],
    )


def test_a_run_without_capacity_is_handed_back_uncounted_and_goes_on_later(
    store: InMemoryStore, clock: ManualClock, agent: Agent, limits: Any, settings: Any
) -> None:
    settings.DURABLE_AGENTS = {**settings.DURABLE_AGENTS, "MAX_ATTEMPTS": 1}
    limits(**{MODEL: {"requests_per_minute": 6, "burst_seconds": 10}})  # one call per 10 s
    run_id = start(store, agent, '@capacity_lookup {"key": "a"}')
    claim = claimed(store, run_id)
    # The first call goes out; the second finds the bucket empty: the run goes back.
    assert advance_run(claim, store=store) is Disposition.THROTTLED
    run = store.run(run_id)
    assert (run.status, run.waiting_for, run.lease_owner) == (
        RunStatus.PENDING,
        WaitKind.CAPACITY,
        None,
    )
    assert run.last_seq == 2  # the turn and its tool result are committed
    assert run.stalled_claims == 0
    # Claimable again within a second (the claimer takes no more runs than there is room
    # for; a claim that comes too soon finds no room and hands it back again).
    assert run.lease_until == clock() + datetime.timedelta(seconds=1)
    assert store.claim_runs("w2", 30, 10) == []  # nobody takes it before then
    # However many times it is refused, the run is never dead-lettered for it.
    for _ in range(12):
        clock.advance(1)
        again = store.claim_runs("w2", 30, 10)
        if again:
            assert advance_run(again[0], store=store) in (
                Disposition.THROTTLED,
                Disposition.SUCCEEDED,
            )
    run = store.run(run_id)
    assert run.status == RunStatus.SUCCEEDED
    gate = store.capacity
    assert isinstance(gate, InMemoryCapacity)
    assert gate.rows[MODEL].capacity_waits >= 1


# -- budgets per concurrency key --------------------------------------------------------------


def test_a_key_over_its_budget_waits_for_the_next_day_or_a_raise(
    store: InMemoryStore, clock: ManualClock, agent: Agent, settings: Any
) -> None:
    # Each turn of the offline model costs something at this price; the key may spend nothing
    # more once one turn is paid.
    settings.DURABLE_AGENTS = {
        **settings.DURABLE_AGENTS,
        "MAX_ATTEMPTS": 1,
        "PRICES": {MODEL: {"input": 1000.0, "output": 1000.0}},
        "BUDGETS": {"tenant:a": {"usd_per_day": 0.001}},
    }
    run_id = start(store, agent, '@capacity_lookup {"key": "a"}', concurrency_key="tenant:a")
    claim = claimed(store, run_id)
    # The first turn is paid; before the second the key is over budget: the run waits.
    assert advance_run(claim, store=store) is Disposition.THROTTLED
    waiting = store.run(run_id)
    assert (waiting.status, waiting.waiting_for, waiting.stalled_claims) == (
        RunStatus.PENDING,
        WaitKind.BUDGET,
        0,
    )
    midnight = datetime.datetime(2026, 1, 2, tzinfo=datetime.UTC)  # the clock's next day
    assert waiting.lease_until == midnight
    spent, override = store.spent_today("tenant:a")
    assert spent > Decimal("0.001")
    assert override is None
    # Staff raise the budget: the run goes back to the queue at once and finishes.
    assert store.set_key_budget("tenant:a", Decimal(100)) == 1
    again = store.claim_run(run_id, "w2", 30)
    assert again is not None
    assert advance_run(again, store=store) is Disposition.SUCCEEDED
