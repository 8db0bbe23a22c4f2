"""Events and model names from outside: a model-chosen event name the database cannot store, a
payload too large or too deep, a model name that is not one. Each is refused up front with a
``ValueError`` (or a tool error the model sees), and an event's payload is stored once however
many runs it wakes."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.db import connection

from durable_agents import api
from durable_agents.models import AgentEvent, AgentRun, AgentStep, RunStatus, WaitKind
from tests.conftest import run_worker
from tests.fakeserver import FakeAnthropic

pytestmark = pytest.mark.django_db(transaction=True)


def reload(run: AgentRun) -> AgentRun:
    return AgentRun.objects.get(pk=run.pk)


def stored_chars(table: str, column: str, run: AgentRun) -> int:
    """The length of a column's stored text (not of the value decoded from it)."""
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT length({column}) FROM {table} WHERE id = %s", [run.pk.hex])
        row = cursor.fetchone()
    assert row is not None
    return int(row[0])


def tool_results(run: AgentRun) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    for step in AgentStep.objects.filter(run_id=run.pk, kind="tool_result").order_by("seq"):
        blocks += json.loads(step.payload)
    return blocks


@pytest.mark.parametrize(
    "name", ["refund\u0000o-1", "refund\no-1", "x" * 201], ids=["nul", "newline", "too-long"]
)
def test_a_model_chosen_event_name_that_cannot_be_stored_is_a_tool_error_and_the_run_goes_on(
    fake_api: FakeAnthropic, receiver: Any, name: str
) -> None:
    task = "Wait for something.\n@await_event " + json.dumps({"name": name})
    run = api.start_run("waiter", task)
    run_worker()
    done = reload(run)
    assert done.status == RunStatus.SUCCEEDED, done.error
    [block] = tool_results(done)
    assert block["is_error"] is True
    assert "valid event name" in block["content"]
    # The non-idempotent call ran once: its side effect happened once.
    assert len(receiver.calls("await_event")) == 1
    assert len(receiver.attempts("request")) == 1
    assert not AgentEvent.objects.exists()


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("a\u0000b", "control characters"),
        ("a\ud800b", "lone surrogates"),
        ("", "cannot be empty"),
        ("x" * 201, "at most 200"),
        (17, "a name is a string"),
    ],
    ids=["nul", "surrogate", "empty", "too-long", "not-str"],
)
def test_send_event_refuses_a_bad_name_with_a_value_error(name: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        api.send_event(name, {"ok": True})
    assert not AgentEvent.objects.exists()


def test_send_event_refuses_a_payload_nested_too_deep() -> None:
    payload: Any = "bottom"
    for _ in range(100_000):
        payload = [payload]
    with pytest.raises(ValueError, match="nests deeper than 100 levels"):
        api.send_event("deep", payload)
    assert not AgentEvent.objects.exists()


def test_send_event_refuses_a_payload_over_max_event_bytes(da_settings: Any) -> None:
    da_settings(MAX_EVENT_BYTES=1000)
    with pytest.raises(ValueError, match=r"at most 1000 bytes .*MAX_EVENT_BYTES.*this one is 1002"):
        api.send_event("big", "x" * 1000)
    api.send_event("small", "x" * 998)  # 1000 bytes of JSON text, quotes included


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("claude\u0000x", "control characters"),
        ("claude\ud800", "control characters or lone surrogates"),
        ("m" * 201, "at most 200"),
        (42, "a model name is a string"),
        ("  ", "cannot be empty"),
    ],
    ids=["nul", "surrogate", "too-long", "not-str", "blank"],
)
def test_start_run_refuses_a_bad_model_name(model: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        api.start_run("tester", "Say hello.", model=model)
    assert not AgentRun.objects.exists()


def test_an_event_payload_is_stored_once_however_many_runs_it_wakes(
    fake_api: FakeAnthropic, receiver: Any
) -> None:
    runs = [
        api.start_run("waiter", 'Wait for something.\n@await_event {"name": "big"}')
        for _ in range(5)
    ]
    run_worker()
    assert all(reload(run).waiting_for == WaitKind.EVENT for run in runs)
    payload = {"blob": "p" * 50_000}
    api.send_event("big", payload)
    for run in runs:
        # The woken run holds a reference to the event, not a copy of its payload.
        assert stored_chars("agent_run", "woken_by", run) < 200
    run_worker()
    calls = receiver.calls("await_event")
    woken = [c["woken_by"] for c in calls if c["woken_by"] is not None]
    assert len(woken) == 5
    assert all(w["payload"] == payload and w["event"] == "big" for w in woken)
    for run in runs:
        done = reload(run)
        assert done.status == RunStatus.SUCCEEDED, done.error
        # What the model was sent (the tool's result, which holds the payload) is in the log.
        [*_, block] = tool_results(done)
        assert json.loads(block["content"])["payload"] == payload
