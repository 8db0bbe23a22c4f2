"""Retry policies of tools, through a real in-process worker and the real SDK over the fake
API: a failure the policy names is tried again before the model is told, and the model reads
only what the last attempt came to; each attempt is reported (observers, log)."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from durable_agents import Agent, Retry, RunContext, Wait, observers, tool
from durable_agents.api import cancel_run, start_run
from durable_agents.engine import effects
from durable_agents.engine.worker import Worker
from durable_agents.models import AgentRun, AgentStep, ToolEffect
from tests.conftest import run_worker
from tests.fakeserver import FakeAnthropic
from tests.integration.conftest import agents_registered

pytestmark = pytest.mark.django_db(transaction=True)

# What each tool got, attempt by attempt (cleared before each test).
CALLS: dict[str, list[Any]] = {}
# Set at the end of each test: a hung attempt's thread returns then.
RELEASE = threading.Event()
FAILED_ONCE = threading.Event()


def called(name: str, value: Any = None) -> int:
    """Note a call of ``name``; its number (1 for the first)."""
    CALLS.setdefault(name, []).append(value)
    return len(CALLS[name])


@tool(effect="pure", retry=Retry(attempts=3, backoff=0))
def flaky_lookup(key: str) -> str:
    """Times out twice, then answers."""
    if called("flaky_lookup") < 3:
        raise TimeoutError(f"upstream slow (attempt {len(CALLS['flaky_lookup'])})")
    return f"value of {key}"


@tool(effect="pure", retry=Retry(attempts=3, backoff=0))
def bad_input(key: str) -> str:
    """Fails with an error no retry can help."""
    called("bad_input")
    raise ValueError(f"no such key {key!r}")


@tool(effect="idempotent", retry=Retry(attempts=3, backoff=(0, 0.01)))
def always_down(key: str) -> str:
    """Never reaches its server."""
    raise ConnectionError(f"connection refused (attempt {called('always_down')})")


@tool(effect="non_idempotent", retry=Retry(attempts=4, backoff=0, on=(ConnectionError,)))
def charge(cents: int, *, idempotency_key: str) -> str:
    """A payment whose first two attempts lose their connection."""
    if called("charge", idempotency_key) < 3:
        raise ConnectionResetError("the payment server hung up")
    return f"charged {cents}"


@tool(effect="idempotent", retry=Retry(attempts=3, backoff=0, on=(Exception,)))
def waits_once(key: str, woken_by: dict[str, Any] | None = None) -> str:
    """Waits a second on its first call (``on`` would match a Wait: it is no failure)."""
    if called("waits_once", woken_by) == 1:
        raise Wait(seconds=60)
    return f"woken by {woken_by}"


@tool(effect="pure", timeout=0.3, retry=Retry(attempts=2, backoff=0))
def hangs_once(key: str) -> str:
    """Hangs past its timeout on its first attempt."""
    if called("hangs_once") == 1:
        RELEASE.wait(30)
        return "too late"
    return f"answered {key}"


@tool(effect="pure", retry=Retry(attempts=3, backoff=300))
def slow_retry(key: str) -> str:
    """Fails, and its policy would wait five minutes before trying again."""
    called("slow_retry")
    FAILED_ONCE.set()
    raise TimeoutError("upstream slow")


@tool(effect="non_idempotent", retry=Retry(attempts=3, backoff=300))
def slow_charge(cents: int, *, idempotency_key: str) -> str:
    """A payment that times out; its policy would wait five minutes before trying again."""
    called("slow_charge", idempotency_key)
    FAILED_ONCE.set()
    raise TimeoutError("the payment server is slow")


@tool(effect="idempotent", retry=Retry(attempts=3, backoff=0))
def cancelled_meanwhile(key: str, run: RunContext) -> str:
    """Its run is cancelled while its first attempt fails (a person, from elsewhere)."""
    if called("cancelled_meanwhile") == 1:
        cancel_run(run.id)
        raise ConnectionError("the server went away")
    return "set"


retrier = Agent(
    name="retrier",
    version="v1",
    model="claude-test-1",
    system="Your tools fail now and then.",
    tools=[
        flaky_lookup,
        bad_input,
        always_down,
        charge,
        waits_once,
        hangs_once,
        slow_retry,
        slow_charge,
        cancelled_meanwhile,
    ],
    max_tokens=512,
    max_turns=10,
    register=False,
)


class Attempts(observers.Observer):
    """Every attempt of every tool call, as the engine reports it."""

    def __init__(self) -> None:
        self.events: list[observers.ToolCallEnd] = []

    def tool_call(self, event: observers.ToolCallEnd) -> None:
        self.events.append(event)

    def of(self, tool_name: str) -> list[tuple[int, str, str | None]]:
        return [
            (e.attempt, e.outcome.value, e.error_type) for e in self.events if e.tool == tool_name
        ]


@pytest.fixture(autouse=True)
def _retrier() -> Iterator[None]:
    CALLS.clear()
    RELEASE.clear()
    FAILED_ONCE.clear()
    with agents_registered(retrier):
        yield
    RELEASE.set()


@pytest.fixture
def attempts() -> Iterator[Attempts]:
    watcher = Attempts()
    observers.subscribe(watcher)
    yield watcher
    observers.unsubscribe(watcher)


def reload(run: AgentRun) -> AgentRun:
    return AgentRun.objects.get(pk=run.pk)


def results_sent(run: AgentRun) -> list[dict[str, Any]]:
    """The tool_result blocks of the run's first tool_result step."""
    step = AgentStep.objects.filter(run_id=run.pk, kind="tool_result").order_by("seq").first()
    assert step is not None
    return json.loads(step.payload)


def model_saw(fake_api: FakeAnthropic) -> list[dict[str, Any]]:
    """The tool_result blocks of the second model request: what the model was told."""
    content: list[dict[str, Any]] = fake_api.requests[1].json()["messages"][-1]["content"]
    return content


def test_a_transient_failure_is_retried_and_the_model_sees_only_the_success(
    fake_api: FakeAnthropic, attempts: Attempts, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="durable_agents.runner")
    run = start_run("retrier", '@flaky_lookup {"key": "a"}')
    worker = run_worker()
    assert worker.stats.dispositions == {"succeeded": 1}
    [block] = results_sent(reload(run))
    assert block["content"] == "value of a"
    assert "is_error" not in block
    assert model_saw(fake_api) == [block]
    effect = ToolEffect.objects.get(run_id=run.pk)
    assert (effect.result, effect.is_error) == ("value of a", False)
    assert len(CALLS["flaky_lookup"]) == 3
    # Each attempt is reported: two retried, the third ok.
    assert attempts.of("flaky_lookup") == [
        (1, "retried", "TimeoutError"),
        (2, "retried", "TimeoutError"),
        (3, "ok", None),
    ]
    logged = [r.getMessage() for r in caplog.records]
    assert any(
        "flaky_lookup attempt 1 of 3 failed (TimeoutError: upstream slow (attempt 1))" in line
        for line in logged
    )
    assert any("flaky_lookup call 0 of turn 1: ok after 3 attempts" in line for line in logged)
    # No retried attempt is a WARNING "raised" line of a failed call.
    assert not any("tool flaky_lookup raised" in line for line in logged)


def test_an_error_the_policy_does_not_name_is_not_retried(
    fake_api: FakeAnthropic, attempts: Attempts
) -> None:
    run = start_run("retrier", '@bad_input {"key": "zz"}')
    run_worker()
    [block] = results_sent(reload(run))
    assert block["is_error"] is True
    assert block["content"] == "bad_input raised ValueError: no such key 'zz'"
    assert len(CALLS["bad_input"]) == 1
    assert attempts.of("bad_input") == [(1, "error", "ValueError")]


def test_when_the_attempts_run_out_the_model_sees_the_last_error_once(
    fake_api: FakeAnthropic, attempts: Attempts
) -> None:
    run = start_run("retrier", '@always_down {"key": "a"}')
    run_worker()
    assert reload(run).status == "succeeded"
    [block] = results_sent(reload(run))
    assert block == {
        "type": "tool_result",
        "tool_use_id": block["tool_use_id"],
        "content": "always_down raised ConnectionError: connection refused (attempt 3)",
        "is_error": True,
    }
    assert model_saw(fake_api) == [block]
    assert len(CALLS["always_down"]) == 3
    assert [outcome for _, outcome, _ in attempts.of("always_down")] == [
        "retried",
        "retried",
        "error",
    ]


def test_a_non_idempotent_call_is_retried_with_the_same_idempotency_key(
    fake_api: FakeAnthropic, attempts: Attempts
) -> None:
    run = start_run("retrier", '@charge {"cents": 250}')
    run_worker()
    [block] = results_sent(reload(run))
    assert block["content"] == "charged 250"
    keys = CALLS["charge"]
    assert len(keys) == 3
    # One call, three attempts: the key the call's place, tool and input make, every time.
    expected = effects.idempotency_key(run.pk, 1, 0, "charge", {"cents": 250})
    assert keys == [expected] * 3
    assert ToolEffect.objects.get(run_id=run.pk).key == expected
    # A subclass of a class in ``on`` is retried too (ConnectionResetError).
    assert [error for _, _, error in attempts.of("charge")] == [
        "ConnectionResetError",
        "ConnectionResetError",
        None,
    ]


def test_a_wait_is_never_retried_even_when_on_matches_it(
    fake_api: FakeAnthropic, attempts: Attempts
) -> None:
    run = start_run("retrier", '@waits_once {"key": "a"}')
    run_worker()
    run = reload(run)
    assert (run.status, run.waiting_for) == ("waiting", "timer")
    assert len(CALLS["waits_once"]) == 1
    assert not ToolEffect.objects.filter(run_id=run.pk).exists()
    assert attempts.of("waits_once") == []  # parked: no attempt ended


def test_an_attempt_past_the_tools_timeout_is_retried(
    fake_api: FakeAnthropic, attempts: Attempts
) -> None:
    run = start_run("retrier", '@hangs_once {"key": "a"}')
    run_worker()
    [block] = results_sent(reload(run))
    assert block["content"] == "answered a"
    assert attempts.of("hangs_once") == [(1, "retried", "timeout"), (2, "ok", None)]


def test_a_cancel_during_the_pause_starts_no_other_attempt(fake_api: FakeAnthropic) -> None:
    run = start_run("retrier", '@slow_retry {"key": "a"}')
    worker = Worker(burst=True, handle_signals=False, heartbeat_seconds=0.2)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    assert FAILED_ONCE.wait(15)
    assert cancel_run(run.pk)
    # The pause is five minutes: a worker that ends at all was woken out of it.
    thread.join(15)
    assert not thread.is_alive(), "the slot slept out the pause"
    assert worker.stats.dispositions == {"cancelled": 1}
    assert len(CALLS["slow_retry"]) == 1
    assert not ToolEffect.objects.filter(run_id=run.pk).exists()


def test_a_drain_during_the_pause_hands_a_pure_call_back_unrecorded(
    fake_api: FakeAnthropic,
) -> None:
    run = start_run("retrier", '@slow_retry {"key": "a"}')
    worker = Worker(burst=True, handle_signals=False)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    assert FAILED_ONCE.wait(15)
    worker.stop()
    thread.join(15)
    assert not thread.is_alive(), "the slot slept out the pause"
    assert worker.stats.dispositions == {"released": 1}
    run = reload(run)
    assert (run.status, run.lease_owner) == ("pending", None)
    # Nothing recorded: the next claim calls the pure tool again, its attempts afresh.
    assert not ToolEffect.objects.filter(run_id=run.pk).exists()
    assert len(CALLS["slow_retry"]) == 1


def test_a_drain_during_the_pause_records_a_non_idempotent_calls_last_error(
    fake_api: FakeAnthropic,
) -> None:
    run = start_run("retrier", '@slow_charge {"cents": 5}')
    worker = Worker(burst=True, handle_signals=False)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    assert FAILED_ONCE.wait(15)
    worker.stop()
    thread.join(15)
    assert not thread.is_alive(), "the slot slept out the pause"
    assert len(CALLS["slow_charge"]) == 1
    # Its one attempt happened: what it came to is recorded, never tried again blindly.
    effect = ToolEffect.objects.get(run_id=run.pk)
    assert effect.is_error
    assert effect.result == "slow_charge raised TimeoutError: the payment server is slow"


def test_a_cancel_during_the_pause_records_a_non_idempotent_calls_last_error(
    fake_api: FakeAnthropic,
) -> None:
    run = start_run("retrier", '@slow_charge {"cents": 5}')
    worker = Worker(burst=True, handle_signals=False, heartbeat_seconds=0.2)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    assert FAILED_ONCE.wait(15)
    assert cancel_run(run.pk)
    thread.join(15)
    assert not thread.is_alive(), "the slot slept out the pause"
    assert worker.stats.dispositions == {"cancelled": 1}
    assert len(CALLS["slow_charge"]) == 1
    effect = ToolEffect.objects.get(run_id=run.pk)
    assert (effect.is_error, effect.result) == (
        True,
        "slow_charge raised TimeoutError: the payment server is slow",
    )
    assert reload(run).status == "cancelled"


def test_no_attempt_with_a_side_effect_starts_once_the_run_is_cancelled(
    fake_api: FakeAnthropic,
) -> None:
    """No pause to be woken from: the fenced renewal before the next attempt (or the cancel's
    notification, whichever comes first) stops it."""
    run = start_run("retrier", '@cancelled_meanwhile {"key": "a"}')
    worker = run_worker()
    assert worker.stats.dispositions == {"cancelled": 1}
    assert len(CALLS["cancelled_meanwhile"]) == 1
    # An idempotent call is free to make again: nothing recorded of it.
    assert not ToolEffect.objects.filter(run_id=run.pk).exists()
    assert reload(run).status == "cancelled"
