"""The runner's waits against an ``InMemoryStore`` and the offline model, no database: a tool
raising ``Wait`` parks the run without recording the call, the same call (same key) is invoked
again with ``woken_by``, calls recorded before the wait are not run again, and a wait that is
over already does not park."""

from __future__ import annotations

import datetime
import json
import uuid
from typing import Any

import pytest

from durable_agents import Wait, ask_person, callback_url
from durable_agents.callbacks import callback_target
from durable_agents.declare.agents import Agent
from durable_agents.declare.tools import tool
from durable_agents.declare.waits import AskPerson
from durable_agents.engine.runner import Disposition, advance_run
from durable_agents.models import RunStatus, WaitKind
from durable_agents.store import Claim, InMemoryStore
from durable_agents.store.base import CallbackReceipt
from durable_agents.store.memory import ManualClock
from tests.unit.conftest import RegisterAgent, start

CALLS: list[tuple[str, str | None, Any]] = []


@tool(effect="pure")
def count(label: str) -> str:
    """Count a call."""
    CALLS.append(("count", None, label))
    return f"counted {label}"


@tool(effect="non_idempotent")
def snooze(seconds: float, *, idempotency_key: str, woken_by: dict[str, Any] | None = None) -> Any:
    """Wait on a timer."""
    CALLS.append(("snooze", idempotency_key, woken_by))
    if woken_by is None:
        raise Wait(seconds=seconds)
    return woken_by


@tool(effect="pure")
def listen(name: str, *, woken_by: dict[str, Any] | None = None) -> Any:
    """Wait on an event."""
    CALLS.append(("listen", None, woken_by))
    if woken_by is None:
        raise Wait(event=name, timeout=60)
    return woken_by


@tool(effect="pure")
def hear_back(timeout: float = 60, *, woken_by: dict[str, Any] | None = None) -> Any:
    """Wait on a callback."""
    CALLS.append(("hear_back", callback_url(), woken_by))
    if woken_by is None:
        raise Wait(callback=True, timeout=timeout)
    return woken_by


@pytest.fixture
def agent(register_agent: RegisterAgent) -> Agent:
    made = register_agent(
        name="unit-waits",
        system="You wait.",
        tools=[count, snooze, listen, ask_person, hear_back],
    )
    CALLS.clear()
    return made


def claim(store: InMemoryStore) -> Claim:
    """The one run the store has to give now, claimed by w1 (whichever run it is)."""
    [taken] = store.claim_runs("w1", 30)
    return taken


def results(store: InMemoryStore, run_id: Any) -> list[dict[str, Any]]:
    return [
        block
        for step in store.steps_of(run_id)
        if step.kind == "tool_result"
        for block in json.loads(step.payload)
    ]


def test_a_timer_parks_then_the_same_call_resumes(
    store: InMemoryStore, clock: ManualClock, agent: Agent
) -> None:
    run_id = start(
        store, agent, 'Count, then wait.\n@count {"label": "a"} && snooze {"seconds": 90}'
    )
    assert advance_run(claim(store), store=store) is Disposition.WAITING
    run = store.run(run_id)
    assert (run.status, run.waiting_for, run.lease_owner) == (RunStatus.WAITING, "timer", None)
    assert run.wake_at == clock() + datetime.timedelta(seconds=90)
    # The first call of the turn is recorded; the waiting one is not.
    assert [e.tool for e in store.effects.values()] == ["count"]
    assert store.claim_runs("w1", 30) == []  # not due

    clock.advance(91)
    assert advance_run(claim(store), store=store) is Disposition.SUCCEEDED
    assert [c[0] for c in CALLS] == ["count", "snooze", "snooze"]  # count did not run again
    (_, first_key, first_woken), (_, second_key, second_woken) = CALLS[1], CALLS[2]
    assert first_key == second_key
    assert first_woken is None
    assert second_woken == {"timer": True}
    assert json.loads(results(store, run_id)[1]["content"]) == {"timer": True}


def test_an_event_that_arrived_first_never_parks(store: InMemoryStore, agent: Agent) -> None:
    store.send_event("go", {"ok": 1})
    run_id = start(store, agent, 'Listen.\n@listen {"name": "go"}')
    assert advance_run(claim(store), store=store) is Disposition.SUCCEEDED
    assert store.run(run_id).attempt == 1
    assert [c[2] for c in CALLS] == [None, store.events["go"].woken_by()]


def test_an_event_timeout(store: InMemoryStore, clock: ManualClock, agent: Agent) -> None:
    run_id = start(store, agent, 'Listen.\n@listen {"name": "late"}')
    assert advance_run(claim(store), store=store) is Disposition.WAITING
    clock.advance(61)
    assert advance_run(claim(store), store=store) is Disposition.SUCCEEDED
    assert CALLS[-1][2] == {"timeout": True}
    assert store.send_event("late", None)[1] == 0
    assert store.run(run_id).status == RunStatus.SUCCEEDED


def test_ask_person_parks_until_answered(store: InMemoryStore, agent: Agent) -> None:
    run_id = start(store, agent, 'Ask.\n@ask_person {"question": "Deploy now?"}')
    assert advance_run(claim(store), store=store) is Disposition.WAITING
    assert store.run(run_id).waiting_for == WaitKind.QUESTION
    [question] = store.questions.values()
    assert question.question == "Deploy now?"
    store.answer_question(run_id, None, "Yes, after 6pm")
    assert advance_run(claim(store), store=store) is Disposition.SUCCEEDED
    value = json.loads(results(store, run_id)[0]["content"])
    assert value["answer"] == "Yes, after 6pm"
    assert value["answered_at"]


def test_a_cancel_while_waiting_ends_the_run(store: InMemoryStore, agent: Agent) -> None:
    run_id = start(store, agent, 'Listen.\n@listen {"name": "never"}')
    advance_run(claim(store), store=store)
    assert store.cancel_run(run_id)
    assert store.claim_runs("w1", 30) == []
    assert store.send_event("never", None)[1] == 0


def test_wait_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        Wait(seconds=1, event="x")
    with pytest.raises(ValueError, match="exactly one"):
        Wait()
    with pytest.raises(ValueError, match="timezone-aware"):
        Wait(until=datetime.datetime(2030, 1, 1))
    with pytest.raises(ValueError, match="timer has no timeout"):
        Wait(seconds=5, timeout=1)
    with pytest.raises(ValueError, match="not one"):
        Wait(runs=["not-a-uuid"])
    with pytest.raises(ValueError, match="valid event name: a name cannot be empty"):
        Wait(event="")
    with pytest.raises(ValueError, match="non-empty question"):
        AskPerson("  ")
    with pytest.raises(ValueError, match="exactly one"):
        Wait(callback=True, event="x")
    with pytest.raises(ValueError, match="True or False"):
        Wait(callback="yes")  # type: ignore[arg-type]
    assert Wait(callback=True, timeout=5).kind == "callback"
    run_id = uuid.uuid4()
    assert Wait(runs=[run_id, str(run_id).upper()]).runs == (str(run_id),)


def test_woken_by_is_never_part_of_the_schema() -> None:
    assert "woken_by" not in listen.input_schema["properties"]
    assert ask_person.input_schema["required"] == ["question"]
    assert "woken_by" not in ask_person.input_schema["properties"]


def _target_of(url: str | None) -> tuple[Any, str]:
    assert url is not None
    target = callback_target(url.rsplit("/", 1)[1])
    assert target is not None
    return target


def test_a_callback_resumes_the_call_once(store: InMemoryStore, agent: Agent) -> None:
    run_id = start(store, agent, "Hear back.\n@hear_back {}")
    assert advance_run(claim(store), store=store) is Disposition.WAITING
    assert store.run(run_id).waiting_for == WaitKind.CALLBACK
    url = CALLS[0][1]
    target_run, key = _target_of(url)
    assert target_run == run_id
    assert store.receive_callback(run_id, key, {"paid": True}) is CallbackReceipt.WOKEN
    assert store.receive_callback(run_id, key, {"paid": False}) is CallbackReceipt.USED
    assert store.run(run_id).status == RunStatus.PENDING
    assert advance_run(claim(store), store=store) is Disposition.SUCCEEDED
    (_, again_url, woken_by) = CALLS[1]
    assert again_url == url  # the call's own URL, every time it is made
    assert woken_by["callback"] == {"paid": True}
    assert woken_by["at"]
    assert store.receive_callback(run_id, key, {}) is CallbackReceipt.OVER


def test_a_callback_for_a_call_not_parked_is_kept(store: InMemoryStore, agent: Agent) -> None:
    run_id = start(store, agent, 'Count.\n@count {"label": "b"}')
    assert store.receive_callback(run_id, "ab" * 32, [1]) is CallbackReceipt.KEPT
    assert store.run(run_id).status == RunStatus.PENDING  # nothing to wake
    received = store.received_callback("ab" * 32)
    assert received is not None
    assert received.body == [1]
    assert store.receive_callback(run_id, "ab" * 32, [2]) is CallbackReceipt.USED
    assert store.receive_callback(uuid.uuid4(), "cd" * 32, [3]) is CallbackReceipt.OVER


def test_a_callback_timeout(store: InMemoryStore, clock: ManualClock, agent: Agent) -> None:
    run_id = start(store, agent, "Hear back.\n@hear_back {}")
    assert advance_run(claim(store), store=store) is Disposition.WAITING
    clock.advance(61)
    assert advance_run(claim(store), store=store) is Disposition.SUCCEEDED
    assert CALLS[-1][2] == {"timeout": True}
    _, key = _target_of(CALLS[0][1])
    assert store.receive_callback(run_id, key, {}) is CallbackReceipt.OVER
    assert store.received_callback(key) is None
