"""PRICES: what a turn costs from its usage, and a run's cost through the state machine."""

from __future__ import annotations

import json
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import pytest

from durable_agents import observers
from durable_agents.declare.agents import Agent
from durable_agents.engine.runner import Disposition, advance_run, tokens_of
from durable_agents.flow import pricing
from durable_agents.flow.pricing import Usage, cost_of, format_usd, usage_of
from durable_agents.models import AgentRun, StepKind
from durable_agents.store import InMemoryStore
from tests.unit.conftest import RegisterAgent, claimed, start

FABLE = {"input": 3.0, "output": 15.0}


def test_a_turn_is_priced_per_million_tokens(da_settings: Any) -> None:
    da_settings(PRICES={"claude-x": {**FABLE, "cache_read": 0.3, "cache_write": 3.75}})
    usage = Usage(
        input_tokens=1_000, output_tokens=200, cache_read_tokens=10_000, cache_write_5m_tokens=400
    )
    # 1000*3 + 200*15 + 10000*0.3 + 400*3.75 = 10500 micro-dollars.
    assert cost_of("claude-x", usage) == Decimal("0.0105")


def test_cache_prices_default_to_the_api_multipliers_of_the_input_price(da_settings: Any) -> None:
    da_settings(PRICES={"claude-x": {"input": 2, "output": 10}})
    million = 1_000_000
    assert cost_of("claude-x", Usage(cache_read_tokens=million)) == Decimal("0.2")  # 0.1x
    assert cost_of("claude-x", Usage(cache_write_5m_tokens=million)) == Decimal("2.5")  # 1.25x
    assert cost_of("claude-x", Usage(cache_write_1h_tokens=million)) == Decimal(4)  # 2x


def test_cache_writes_are_split_by_lifetime_when_the_usage_says() -> None:
    message = {
        "usage": {
            "input_tokens": 5,
            "output_tokens": 6,
            "cache_read_input_tokens": 7,
            "cache_creation_input_tokens": 100,
            "cache_creation": {"ephemeral_5m_input_tokens": 30, "ephemeral_1h_input_tokens": 70},
        }
    }
    assert usage_of(message) == Usage(5, 6, 7, 30, 70)
    # Without the split every write is a 5-minute one, the API's default.
    del message["usage"]["cache_creation"]
    assert usage_of(message) == Usage(5, 6, 7, 100, 0)


def test_an_explicit_cache_write_prices_the_5_minute_writes_only(da_settings: Any) -> None:
    usage = Usage(cache_write_5m_tokens=1_000_000, cache_write_1h_tokens=1_000_000)
    da_settings(PRICES={"claude-x": {**FABLE, "cache_write": 4}})
    assert cost_of("claude-x", usage) == Decimal(4 + 6)  # the 1-hour ones: 2x input
    da_settings(PRICES={"claude-x": {**FABLE, "cache_write": 4, "cache_write_1h": 5}})
    assert cost_of("claude-x", usage) == Decimal(9)


def test_the_passes_of_a_turn_are_summed_as_its_tokens_are(da_settings: Any) -> None:
    """A compaction pass, then the message: the top-level figures are the last pass only."""
    da_settings(PRICES={"claude-x": FABLE})
    message = {
        "usage": {
            "input_tokens": 10,
            "output_tokens": 20,
            "iterations": [
                {"type": "compaction", "input_tokens": 1000, "output_tokens": 300},
                {"type": "message", "input_tokens": 10, "output_tokens": 20},
            ],
        }
    }
    usage = usage_of(message)
    assert usage == Usage(input_tokens=1010, output_tokens=320)
    assert usage.total == tokens_of(message)
    assert cost_of("claude-x", usage) == Decimal("0.00783")  # 1010*3 + 320*15 micro-dollars


def test_garbage_in_the_usage_counts_nothing() -> None:
    assert usage_of({}) == Usage()
    assert usage_of({"usage": {"input_tokens": "12", "output_tokens": True}}) == Usage()
    assert usage_of({"usage": {"input_tokens": -3, "cache_creation": "x"}}) == Usage()


def test_a_model_without_a_price_has_no_cost_not_zero(da_settings: Any) -> None:
    da_settings(PRICES={"claude-x": FABLE})
    assert cost_of("claude-y", Usage(input_tokens=1)) is None
    da_settings(PRICES={"claude-x": FABLE, "*": {"input": 1, "output": 1}})
    assert cost_of("claude-y", Usage(input_tokens=1)) == Decimal("0.000001")
    assert cost_of("claude-x", Usage(input_tokens=1)) == Decimal("0.000003")


def test_an_unusable_price_is_no_price_never_an_error(da_settings: Any) -> None:
    """The system checks name the problem; a worker never fails a run over it."""
    for entry in ({"input": "3"}, {"output": 1}, "3.0", {**FABLE, "input": float("nan")}):
        da_settings(PRICES={"claude-x": entry})
        assert cost_of("claude-x", Usage(input_tokens=1)) is None
    da_settings(PRICES="not a dict")
    assert cost_of("claude-x", Usage(input_tokens=1)) is None


def test_a_cost_is_exact_to_the_nano_dollar(da_settings: Any) -> None:
    da_settings(PRICES={"claude-x": {"input": 0.1, "output": 0.3}})
    # Floats through their shortest text: 0.1 * 3 is 0.3 exactly, not 0.30000000000000004.
    assert cost_of("claude-x", Usage(input_tokens=3, output_tokens=1)) == Decimal("0.0000006")
    assert cost_of("claude-x", Usage(input_tokens=1)) == Decimal("0.0000001")


def test_format_usd() -> None:
    assert format_usd(Decimal("0.012345")) == "$0.0123"
    assert format_usd(Decimal("0.01235")) == "$0.0124"
    assert format_usd(Decimal("1234.5")) == "$1,234.5000"
    assert format_usd(Decimal(0)) == "$0.0000"
    assert format_usd(Decimal("0.00001")) == "<$0.0001"
    assert format_usd(None) == ""


# -- through the state machine -------------------------------------------------------------


class Costs(observers.Observer):
    def __init__(self) -> None:
        self.seen: list[observers.TurnCost] = []

    def turn_cost(self, event: observers.TurnCost) -> None:
        self.seen.append(event)


@pytest.fixture
def agent(register_agent: RegisterAgent) -> Agent:
    # Agent's own default max_tokens, which this agent has always had (not the unit default).
    return register_agent(name="unit-pricing", model="claude-x", system="Priced.", max_tokens=4096)


@pytest.fixture
def costs() -> Iterator[Costs]:
    watcher = Costs()
    observers.subscribe(watcher)
    yield watcher
    observers.unsubscribe(watcher)


def run_once(store: InMemoryStore, agent: Agent, task: str) -> AgentRun:
    run_id = start(store, agent, task)
    assert advance_run(claimed(store, run_id), store=store) is Disposition.SUCCEEDED
    return store.run(run_id)


def test_a_run_costs_what_its_turns_cost(
    store: InMemoryStore, agent: Agent, costs: Costs, da_settings: Any
) -> None:
    da_settings(PRICES={"claude-x": FABLE})
    run = run_once(store, agent, "Two turns.\n@nope {}")
    turns = [
        json.loads(step.payload)
        for step in store.steps_of(run.pk)
        if step.kind == StepKind.MODEL_TURN
    ]
    expected = [cost_of("claude-x", usage_of(turn)) for turn in turns]
    assert len(expected) == 2
    assert all(cost is not None and cost > 0 for cost in expected)
    assert run.cost_usd == sum((cost or Decimal(0) for cost in expected), Decimal(0))
    assert [(e.agent, e.model, e.cost) for e in costs.seen] == [
        ("unit-pricing", "claude-x", cost) for cost in expected
    ]
    [row] = store.usage_days.values()
    assert (row.agent, row.model, row.turns, row.cost_usd) == (
        "unit-pricing",
        "claude-x",
        2,
        run.cost_usd,
    )
    cached = row.cache_read_tokens + row.cache_write_tokens
    assert row.input_tokens + row.output_tokens + cached == run.tokens_used


def test_a_run_of_a_model_without_a_price_has_no_cost(
    store: InMemoryStore, agent: Agent, costs: Costs, da_settings: Any
) -> None:
    da_settings(PRICES={"claude-other": FABLE})
    run = run_once(store, agent, "Say hello.")
    assert run.tokens_used > 0
    assert run.cost_usd is None
    assert [e.cost for e in costs.seen] == [None]
    assert pricing.price_for("claude-x") is None
