"""The step loop end to end: an in-process worker, the real SDK over HTTP to a fake API.

Every test here runs a worker, whose threads use their own database connections, hence
``transaction=True``. The fake API (``tests/fakeserver.py``) is the offline scripted model: the
task's ``@`` lines are the model's turns, so each test reads as its own script.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from django.conf import settings
from django.contrib.auth import get_user_model
from django.db.models.functions import Now
from django.utils import timezone

from durable_agents import llm, store
from durable_agents._internal.interrupt import Interrupt
from durable_agents.api import approve_intent, cancel_run, messages_for, requeue_run, start_run
from durable_agents.declare.agents import Agent, registry
from durable_agents.declare.tools import tool
from durable_agents.engine import effects
from durable_agents.engine.runner import Disposition, advance_run
from durable_agents.engine.worker import Worker
from durable_agents.housekeeping import serving
from durable_agents.models import AgentRun, AgentStep, AgentWorker, ToolEffect, ToolIntent
from durable_agents.store import StepWrite
from tests.conftest import own_steps, run_worker, wait_for
from tests.fakeserver import FakeAnthropic, Recorded, api_error

pytestmark = pytest.mark.django_db(transaction=True)

ON_POSTGRES = settings.DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql"


# The key order of a response body of the offline model, extras included.
RESPONSE_KEYS = [
    "id",
    "type",
    "role",
    "model",
    "content",
    "stop_reason",
    "stop_sequence",
    "usage",
    "container",
    "offline_script",
]


# --------------------------------------------------------------------------- helpers


def step_data(run: AgentRun, seq: int) -> Any:
    return json.loads(AgentStep.objects.get(run_id=run.pk, seq=seq).payload)


def reload(run: AgentRun) -> AgentRun:
    return AgentRun.objects.get(pk=run.pk)


def replay(fake_api: FakeAnthropic, recorded: Recorded) -> tuple[str, str]:
    """The body and request id the fake API answered to ``recorded`` (it is deterministic)."""
    status, headers, body = fake_api.model.respond(
        "POST", "/v1/messages", recorded.headers, recorded.body
    )
    assert status == 200
    return body.decode("utf-8"), headers["request-id"]


def tool_uses(run: AgentRun, seq: int) -> list[dict[str, Any]]:
    return [b for b in step_data(run, seq)["content"] if b["type"] == "tool_use"]


def start_thread(worker: Worker) -> threading.Thread:
    thread = threading.Thread(target=worker.run, name="test-worker", daemon=True)
    thread.start()
    return thread


def background_worker(**options: Any) -> tuple[Worker, threading.Thread]:
    options.setdefault("burst", True)
    options.setdefault("handle_signals", False)
    worker = Worker(**options)
    return worker, start_thread(worker)


@pytest.fixture
def superuser() -> Any:
    return get_user_model().objects.create_superuser("boss", "boss@example.com", "pw")


# --------------------------------------------------------------------------- a full run

FULL_TASK = (
    "Exercise every effect class.\n"
    '@lookup {"key": "a"} && set_flag {"name": "x", "value": true}\n'
    '@charge {"customer": "cus_1", "cents": 1250}\n'
    '@drop_table {"table": "orders"}'
)


def test_full_run_with_every_effect_class(
    fake_api: FakeAnthropic, receiver: Any, superuser: Any
) -> None:
    run = start_run("tester", FULL_TASK)

    first = run_worker(worker_id="w-one")
    assert first.stats.dispositions == {"waiting": 1}
    run = reload(run)
    assert run.status == "waiting"
    assert (run.lease_owner, run.lease_until, run.last_seq) == (None, None, 5)
    intent = ToolIntent.objects.get(run_id=run.pk)
    drop_key = effects.idempotency_key(run.pk, 5, 0, "drop_table", {"table": "orders"})
    assert (intent.status, intent.tool, intent.input, intent.seq, intent.call_index) == (
        "pending",
        "drop_table",
        {"table": "orders"},
        5,
        0,
    )
    assert intent.key == drop_key
    assert receiver.attempts("drop") == []

    approve_intent(intent.pk, user=superuser)
    second = run_worker(worker_id="w-two")
    assert second.stats.dispositions == {"succeeded": 1}

    run = reload(run)
    assert run.status == "succeeded"
    assert run.result == "Done. 3 planned turns completed."
    assert run.error == ""
    assert run.finished_at is not None
    assert (run.lease_owner, run.lease_until) == (None, None)
    assert (run.attempt, run.stalled_claims, run.last_seq) == (2, 0, 7)

    steps = own_steps(run)
    assert [s.seq for s in steps] == list(range(8))
    assert [s.kind for s in steps] == ["task"] + ["model_turn", "tool_result"] * 3 + ["model_turn"]
    assert [s.attempt for s in steps] == [0, 1, 1, 1, 1, 1, 2, 2]
    assert [s.worker for s in steps] == ["", *["w-one"] * 5, "w-two", "w-two"]
    assert steps[0].payload == json.dumps(FULL_TASK)

    # Each model turn is the response body byte for byte, with its request id.
    ok = fake_api.ok_requests()
    assert len(fake_api.requests) == len(ok) == 4
    turns = [s for s in steps if s.kind == "model_turn"]
    for step, recorded in zip(turns, ok, strict=True):
        body, request_id = replay(fake_api, recorded)
        assert step.payload == body
        assert step.request_id == request_id
        assert request_id.startswith("req_offline_")
        assert list(json.loads(step.payload)) == RESPONSE_KEYS
        assert '"type": "message", "role": "assistant"' in step.payload  # separators kept
    assert [json.loads(s.payload)["offline_script"] for s in turns] == [
        {"turn": t, "plan_lines": 3} for t in range(4)
    ]
    for step in steps:
        if step.kind != "model_turn":
            assert step.request_id is None

    # One ledger row per call, keyed by position and canonical input.
    charge_input = {"customer": "cus_1", "cents": 1250}
    charge_key = effects.idempotency_key(run.pk, 3, 0, "charge", charge_input)
    charge_result = {"kind": "charge", "key": charge_key, "applied": True}
    expected_effects = [
        (
            effects.idempotency_key(run.pk, 1, 0, "lookup", {"key": "a"}),
            1,
            0,
            "lookup",
            "value-of-a",
        ),
        (
            effects.idempotency_key(run.pk, 1, 1, "set_flag", {"name": "x", "value": True}),
            1,
            1,
            "set_flag",
            "x=True",
        ),
        (charge_key, 3, 0, "charge", json.dumps(charge_result)),
        (drop_key, 5, 0, "drop_table", "dropped orders"),
    ]
    rows = ToolEffect.objects.filter(run_id=run.pk).order_by("seq", "call_index")
    assert [(e.key, e.seq, e.call_index, e.tool, e.result) for e in rows] == expected_effects
    assert [e.is_error for e in rows] == [False] * 4

    # The non-idempotent and the irreversible tool got their keys, once each.
    assert receiver.attempts("charge") == [
        {"kind": "charge", "key": charge_key, "payload": charge_input, "pid": os.getpid()}
    ]
    assert [a["key"] for a in receiver.attempts("drop")] == [drop_key]
    assert [a["key"] for a in receiver.applied()] == sorted([charge_key, drop_key])

    # The tool_result steps answer the tool_use ids of the turn before, in order.
    for seq, texts in ((2, ["value-of-a", "x=True"]), (4, [json.dumps(charge_result)])):
        ids = [b["id"] for b in tool_uses(run, seq - 1)]
        assert step_data(run, seq) == [
            {"type": "tool_result", "tool_use_id": i, "content": t}
            for i, t in zip(ids, texts, strict=True)
        ]
    intent.refresh_from_db()
    assert (intent.status, intent.decided_by_id) == ("done", superuser.pk)


def test_messages_for_is_what_was_sent_plus_the_final_turn(fake_api: FakeAnthropic) -> None:
    # The thinker's signed thinking blocks make the fake API reject any history that is not
    # sent back byte-identical, so the run succeeding is itself part of the check.
    task = 'Think, then look.\n@lookup {"key": "a"}\n@lookup {"key": "b"} && lookup {"key": "c"}'
    run = start_run("thinker", task)
    run_worker()
    run = reload(run)
    assert (run.status, run.result) == ("succeeded", "Done. 2 planned turns completed.")
    assert [r.status for r in fake_api.requests] == [200, 200, 200]

    sent = fake_api.requests[-1].json()["messages"]
    final = json.loads(own_steps(run)[-1].payload)
    assert final["content"][0]["type"] == "thinking"
    expected = [*sent, {"role": "assistant", "content": final["content"]}]
    rebuilt = messages_for(run.pk)
    assert rebuilt == expected
    assert json.dumps(rebuilt, ensure_ascii=False) == json.dumps(expected, ensure_ascii=False)
    assert len(rebuilt) == 6
    assert rebuilt[0] == {"role": "user", "content": task}
    # Every request's messages are a prefix of the rebuilt list.
    for n, recorded in enumerate(fake_api.requests):
        assert recorded.json()["messages"] == rebuilt[: 2 * n + 1]


# --------------------------------------------------------------------------- bad input

TOOL_NAMES = "big, charge, drop_table, explode, lookup, not_json, poison, set_flag, slow, weird"

BAD_INPUT = [
    pytest.param(
        '@charge {"customer": 5}',
        "Invalid input for tool 'charge':\n"
        "- input: 'cents' is a required property\n"
        "- input.customer: 5 is not of type 'string'",
        True,
        id="schema-violation",
    ),
    pytest.param(
        '@refund {"customer": "c"}',
        f"unknown tool 'refund'; the tools are: {TOOL_NAMES}",
        True,
        id="unknown-tool",
    ),
    pytest.param(
        "@lookup {not json",
        "Invalid input for tool 'lookup':\n"
        "- input: 'key' is a required property\n"
        "- input: Additional properties are not allowed ('_raw' was unexpected)",
        True,
        id="malformed-json",
    ),
    pytest.param(
        "@lookup [1, 2]",
        "Invalid input for tool 'lookup': input must be a JSON object, got list",
        True,
        id="input-not-an-object",
    ),
    pytest.param(
        '@explode {"message": "boom"}',
        "explode raised RuntimeError: boom",
        True,
        id="tool-raises",
    ),
    pytest.param(
        "@not_json {}",
        "the tool returned a value that is not JSON-serialisable: "
        "Object of type object is not JSON serializable",
        True,
        id="not-json",
    ),
    pytest.param(
        '@weird {"kind": "surrogate"}',
        "lone \ufffd surrogate",
        False,
        id="lone-surrogate",
    ),
    pytest.param(
        '@weird {"kind": "unicode"}',
        "emoji \U0001f600, rtl \u202eabc, combining e\u0301, zero-width \u200b.",
        False,
        id="odd-unicode",
    ),
    pytest.param(
        '@weird {"kind": "nul"}',
        "before\u2400after",  # NUL becomes the visible marker (durable_agents/_internal/text.py)
        False,
        id="nul-byte",
    ),
]


@pytest.mark.parametrize(("line", "text", "is_error"), BAD_INPUT)
def test_bad_input_becomes_a_tool_result_and_the_run_goes_on(
    fake_api: FakeAnthropic, receiver: Any, line: str, text: str, is_error: bool
) -> None:
    run = start_run("tester", f"Survive this.\n{line}")
    worker = run_worker()
    run = reload(run)
    assert worker.stats.dispositions == {"succeeded": 1}
    assert (run.status, run.result, run.error) == (
        "succeeded",
        "Done. 1 planned turns completed.",
        "",
    )
    assert [s.kind for s in own_steps(run)] == ["task", "model_turn", "tool_result", "model_turn"]

    (call,) = tool_uses(run, 1)
    block = {"type": "tool_result", "tool_use_id": call["id"], "content": text}
    if is_error:
        block["is_error"] = True
    # Stored in the step log and read back intact ...
    assert step_data(run, 2) == [block]
    # ... in the ledger ...
    effect = ToolEffect.objects.get(run_id=run.pk)
    assert (effect.result, effect.is_error, effect.seq, effect.call_index) == (
        text,
        is_error,
        1,
        0,
    )
    assert effect.key == effects.idempotency_key(run.pk, 1, 0, call["name"], call["input"])
    # ... and what the model received.
    assert len(fake_api.requests) == 2
    assert fake_api.requests[1].json()["messages"][-1] == {"role": "user", "content": [block]}
    assert receiver.attempts() == []


def test_nul_byte_from_a_tool_becomes_a_visible_marker(fake_api: FakeAnthropic) -> None:
    run = start_run("tester", '@weird {"kind": "nul"}')
    run_worker()
    assert reload(run).status == "succeeded"
    payload = AgentStep.objects.get(run_id=run.pk, seq=2).payload
    assert "before\u2400after" in payload
    assert "\x00" not in payload
    assert "\\u0000" not in payload
    assert ToolEffect.objects.get(run_id=run.pk).result == "before\u2400after"


def test_nul_byte_in_an_irreversible_call_input_parks_the_run(fake_api: FakeAnthropic) -> None:
    run = start_run("tester", '@drop_table {"table": "a\\u0000b"}')
    worker = run_worker()
    assert worker.stats.dispositions == {"waiting": 1}
    assert reload(run).status == "waiting"
    assert ToolIntent.objects.get(run_id=run.pk).input == {"table": "a\x00b"}


def test_unicode_is_stored_unescaped_in_the_step_payload(fake_api: FakeAnthropic) -> None:
    run = start_run("tester", '@weird {"kind": "unicode"}')
    run_worker()
    payload = AgentStep.objects.get(run_id=run.pk, seq=2).payload
    assert "emoji \U0001f600, rtl \u202eabc, combining e\u0301, zero-width \u200b." in payload


def test_huge_result_is_kept_whole_and_capped_for_the_model(
    fake_api: FakeAnthropic, da_settings: Any
) -> None:
    da_settings(MAX_RESULT_CHARS=1000)
    run = start_run("tester", '@big {"chars": 3000000} && big {"chars": 1000}')
    run_worker()
    run = reload(run)
    assert run.status == "succeeded"

    rows = list(ToolEffect.objects.filter(run_id=run.pk).order_by("call_index"))
    assert [len(e.result) for e in rows] == [3_000_000, 1000]
    assert rows[0].result == "x" * 3_000_000
    assert [e.is_error for e in rows] == [False, False]

    ids = [b["id"] for b in tool_uses(run, 1)]
    expected = [
        {
            "type": "tool_result",
            "tool_use_id": ids[0],
            "content": "x" * 1000
            + "\n[truncated: the result has 3000000 characters; the first 1000 are shown]",
        },
        # Exactly at the limit: untouched.
        {"type": "tool_result", "tool_use_id": ids[1], "content": "x" * 1000},
    ]
    assert step_data(run, 2) == expected
    assert fake_api.requests[1].json()["messages"][-1] == {"role": "user", "content": expected}
    assert len(fake_api.requests[1].body) < 10_000


# --------------------------------------------------------------------------- recorded calls


def test_a_recorded_call_in_the_middle_of_a_turn_is_not_run_again(
    fake_api: FakeAnthropic, receiver: Any
) -> None:
    charge_input = {"customer": "cus_9", "cents": 300}
    run = start_run(
        "tester",
        '@lookup {"key": "a"} && charge {"customer": "cus_9", "cents": 300} '
        '&& charge {"customer": "cus_9", "cents": 301}',
    )
    # An earlier worker committed the model turn (seq 1), completed the turn's middle call,
    # and died before the turn's results were committed; its lease then expired.
    crashed = store.current().claim_run(run.pk, "crashed-worker", 30)
    assert crashed is not None
    turn = llm.create_turn(
        registry.get("tester").request_params(run.model),
        messages_for(run.pk),
        interrupt=Interrupt(),
    )
    assert store.current().append_step(
        crashed, StepWrite(1, "model_turn", turn.body, turn.request_id)
    )
    key = effects.idempotency_key(run.pk, 1, 1, "charge", charge_input)
    ToolEffect.objects.create(
        key=key,
        run_id=run.pk,
        seq=1,
        call_index=1,
        tool="charge",
        result='{"recorded": "earlier"}',
        is_error=False,
    )
    AgentRun.objects.filter(pk=run.pk).update(lease_until=Now() - datetime.timedelta(seconds=1))
    run_worker()
    run = reload(run)
    assert run.status == "succeeded"

    last_key = effects.idempotency_key(run.pk, 1, 2, "charge", {"customer": "cus_9", "cents": 301})
    # Only the last charge reached the receiver.
    assert [a["key"] for a in receiver.attempts("charge")] == [last_key]
    ids = [b["id"] for b in tool_uses(run, 1)]
    assert [b["content"] for b in step_data(run, 2)] == [
        "value-of-a",
        '{"recorded": "earlier"}',
        json.dumps({"kind": "charge", "key": last_key, "applied": True}),
    ]
    assert [b["tool_use_id"] for b in step_data(run, 2)] == ids
    assert ToolEffect.objects.filter(run_id=run.pk).count() == 3
    assert ToolEffect.objects.get(key=key).result == '{"recorded": "earlier"}'


# --------------------------------------------------------------------------- limits and pins


def test_max_turns_exceeded_fails_the_run(fake_api: FakeAnthropic) -> None:
    run = start_run("short", '@lookup {"key": "a"}\n@lookup {"key": "b"}\n@lookup {"key": "c"}')
    worker = run_worker()
    run = reload(run)
    assert worker.stats.dispositions == {"failed": 1}
    assert run.status == "failed"
    assert run.error.endswith("max_turns (2) reached")
    assert run.result is None
    assert [s.kind for s in own_steps(run)] == [
        "task",
        "model_turn",
        "tool_result",
        "model_turn",
        "tool_result",
    ]
    assert len(fake_api.requests) == 2


def test_max_turns_reached_exactly_by_the_final_turn_succeeds(fake_api: FakeAnthropic) -> None:
    run = start_run("short", '@lookup {"key": "a"}')
    run_worker()
    run = reload(run)
    assert (run.status, run.error) == ("succeeded", "")
    assert len(fake_api.requests) == 2


def test_a_run_started_with_another_definition_waits_without_a_model_call_or_attempt(
    fake_api: FakeAnthropic,
) -> None:
    run = start_run("tester", '@lookup {"key": "a"}')
    AgentRun.objects.filter(pk=run.pk).update(fingerprint="0" * 64)
    worker = run_worker()
    run = reload(run)
    current = registry.get("tester", "v1").fingerprint("claude-test-1")
    assert worker.stats.dispositions == {"waiting": 1}
    assert (run.status, run.waiting_for, run.stalled_claims) == ("waiting", "worker", 0)
    assert run.error.startswith(
        "waiting for a worker whose tester@v1 has fingerprint 000000000000 (the run's): "
        f"worker {worker.worker_id} has {current[:12]}"
    )
    assert fake_api.requests == []
    assert len(own_steps(run)) == 1
    # Out of every claim's way until a worker that serves its definition wakes it.
    assert run.lease_until is None
    assert store.current().claim_runs("same-code", 5) == []
    assert store.current().wake_served_runs(serving.can_serve) == 0  # not this code's
    registry.forget_refusals()
    assert store.current().wake_served_runs(lambda *pinned: pinned[3] == "0" * 64) == 1
    [claim] = store.current().claim_runs("old-code", 5)
    assert claim.run_id == run.pk


@pytest.fixture
def tester_v2() -> Iterator[Agent]:
    agent = Agent(
        name="tester",
        version="v2-drifted",
        model="claude-test-1",
        system="You are the test agent, reworded.",
        tools=list(registry.get("tester", "v1").tools),
        max_tokens=1024,
        max_turns=40,
    )
    yield agent
    registry.unregister("tester", "v2-drifted")


def test_a_run_moved_to_another_version_by_hand_is_not_sent_with_its_definition(
    fake_api: FakeAnthropic, tester_v2: Agent
) -> None:
    run = start_run("tester", '@lookup {"key": "a"}', version="v1")
    assert run.prompt_version == "v1"
    AgentRun.objects.filter(pk=run.pk).update(prompt_version="v2-drifted")
    run_worker()
    run = reload(run)
    assert (run.status, run.waiting_for) == ("waiting", "worker")
    assert run.error.startswith("waiting for a worker whose tester@v2-drifted has fingerprint")
    assert fake_api.requests == []


def test_a_run_of_a_version_this_worker_lacks_is_never_claimed_and_costs_no_attempt(
    fake_api: FakeAnthropic,
) -> None:
    """A rolling deploy: the run's version is not defined here. The claims skip it and the
    worker's pass parks it, waiting for a worker that defines it; a claim by its id ("run
    now") of such a run parks it too, at no attempt."""
    run = start_run("tester", '@lookup {"key": "a"}')
    AgentRun.objects.filter(pk=run.pk).update(prompt_version="v0-gone")
    for _ in range(3):
        worker = run_worker(worker_id="new-worker")
        assert worker.stats.claims == 0
    run = reload(run)
    assert (run.attempt, run.status, run.waiting_for) == (0, "waiting", "worker")  # parked
    AgentRun.objects.filter(pk=run.pk).update(status="pending", waiting_for="")
    claim = store.current().claim_run(run.pk, "run-now", 60)
    assert claim is not None
    assert advance_run(claim) is Disposition.WAITING
    run = reload(run)
    assert (run.status, run.lease_owner, run.stalled_claims) == ("waiting", None, 0)
    assert run.waiting_for == "worker"
    assert run.error.startswith(
        "waiting for a worker that defines tester@v0-gone: worker run-now does not ("
    )
    assert fake_api.requests == []


def test_a_workers_pass_parks_runs_no_live_worker_defines_and_wakes_its_own(
    fake_api: FakeAnthropic,
) -> None:
    gone = start_run("tester", "Say hello.")
    AgentRun.objects.filter(pk=gone.pk).update(prompt_version="v0-gone")
    elsewhere = start_run("tester", "Say hello.")
    AgentRun.objects.filter(pk=elsewhere.pk).update(prompt_version="v-old-code")
    AgentWorker.objects.create(
        id="old-code", instance=uuid.uuid4(), host="h", pid=1, concurrency=1,
        alive_until=timezone.now() + datetime.timedelta(minutes=1),
        versions=[{"agent": "tester", "version": "v-old-code", "model": "m", "fingerprint": "f"}],
    )  # fmt: skip
    mine = start_run("tester", "Say hello.")
    assert serving.serve_pass(store.current()) == (0, 1)
    status = dict(AgentRun.objects.values_list("pk", "status"))
    assert status[gone.pk] == "waiting"  # out of the claims' way
    assert status[elsewhere.pk] == status[mine.pk] == "pending"
    assert "no live worker does" in reload(gone).error
    # The version is deployed again: the next pass of a worker that defines it wakes the run.
    AgentRun.objects.filter(pk=gone.pk).update(prompt_version="v1")
    assert serving.serve_pass(store.current()) == (1, 0)
    assert reload(gone).status == "pending"


# --------------------------------------------------------------------------- model errors


@pytest.mark.filterwarnings("ignore:The model 'claude-2.1' is deprecated:DeprecationWarning")
def test_retired_model_is_dead_lettered_naming_the_model(fake_api: FakeAnthropic) -> None:
    run = start_run("tester", '@lookup {"key": "a"}', model="claude-2.1")
    assert run.model == "claude-2.1"
    worker = run_worker()
    run = reload(run)
    assert worker.stats.dispositions == {"dead": 1}
    assert run.status == "dead"
    (recorded,) = fake_api.requests  # no retry
    assert recorded.status == 404
    assert recorded.json()["model"] == "claude-2.1"
    _, _, body = fake_api.model.respond("POST", "/v1/messages", {}, recorded.body)
    request_id = json.loads(body)["request_id"]
    assert run.error == (
        "model 'claude-2.1' is not available (retired or unknown): "
        f"not_found_error: model: claude-2.1 (request id {request_id})"
    )
    assert len(own_steps(run)) == 1


def test_bad_request_is_dead_lettered_with_its_message(fake_api: FakeAnthropic) -> None:
    fake_api.fail_next(api_error(400, "invalid_request_error", "bad thing"))
    run = start_run("tester", '@lookup {"key": "a"}')
    run_worker()
    run = reload(run)
    assert run.status == "dead"
    assert run.error == (
        "the API rejected the request (400): invalid_request_error: bad thing "
        "(request id req_fault)"
    )
    assert [r.status for r in fake_api.requests] == [400]
    assert len(own_steps(run)) == 1


def test_transient_errors_are_retried_within_the_claim(
    fake_api: FakeAnthropic, da_settings: Any
) -> None:
    # A 429 is not retried by the run alone: see test_capacity.py (the fleet pauses).
    da_settings(MAX_BACKOFF_SECONDS=0.05)
    fake_api.fail_next(api_error(408, "timeout_error", "Request timed out"))
    fake_api.fail_next(api_error(529, "overloaded_error", "Overloaded"))
    fake_api.fail_next(api_error(500, "api_error", "Internal server error"))
    run = start_run("tester", '@lookup {"key": "a"}')
    worker = run_worker()
    run = reload(run)
    assert worker.stats.dispositions == {"succeeded": 1}
    assert (run.status, run.error, run.attempt, run.stalled_claims) == ("succeeded", "", 1, 0)
    assert [r.status for r in fake_api.requests] == [408, 529, 500, 200, 200]
    # The retried request is the same request.
    assert len({r.body for r in fake_api.requests[:4]}) == 1
    assert [s.attempt for s in own_steps(run)] == [0, 1, 1, 1]


@pytest.mark.postgres
def test_retry_after_longer_than_the_lease_keeps_the_run(fake_api: FakeAnthropic) -> None:
    # A 529's retry-after is waited for within the claim (a 429 hands the run back instead).
    fake_api.fail_next(api_error(529, "overloaded_error", "Overloaded", **{"retry-after": "4"}))
    run = start_run("tester", '@lookup {"key": "a"}')
    worker, thread = background_worker(worker_id="holder", lease_seconds=1.5, heartbeat_seconds=0.3)
    wait_for(lambda: len(fake_api.requests) == 1, timeout=10)
    # Unless the holder renews it, the lease ends at this moment (on the database's clock).
    lease_until = reload(run).lease_until
    assert lease_until is not None

    # Thieves try until the retry goes out, whatever the pace of this machine; some of their
    # tries come after the lease would have ended, while the holder still waits to retry.
    stolen: list[Any] = []
    thieves = 0
    tries_past_the_lease = 0

    def steal() -> bool:
        nonlocal thieves, tries_past_the_lease
        past = (
            AgentRun.objects.filter(pk=run.pk).alias(now=Now()).filter(now__gt=lease_until).exists()
        )
        stolen.extend(store.current().claim_runs("thief", 1.5))
        if thieves % 5 == 0:
            other = run_worker(worker_id="thief-worker", lease_seconds=1.5)
            assert other.stats.claims == 0
        thieves += 1
        waiting = len(fake_api.requests) == 1  # the holder had not retried yet
        tries_past_the_lease += past and waiting
        return not waiting

    wait_for(steal, timeout=60, interval=0.1)
    assert stolen == []
    assert tries_past_the_lease >= 1  # else this test could not have caught a theft

    thread.join(15)
    assert not thread.is_alive()
    run = reload(run)
    assert worker.stats.dispositions == {"succeeded": 1}
    assert (run.status, run.attempt) == ("succeeded", 1)
    assert [r.status for r in fake_api.requests] == [529, 200, 200]
    assert fake_api.requests[1].at - fake_api.requests[0].at >= 3.9
    steps = own_steps(run)
    assert [s.attempt for s in steps[1:]] == [1, 1, 1]
    assert {s.worker for s in steps[1:]} == {"holder"}


def test_exhausted_retries_hand_back_then_dead_letter(
    fake_api: FakeAnthropic, da_settings: Any
) -> None:
    da_settings(MODEL_RETRIES=1, MAX_ATTEMPTS=2, MAX_BACKOFF_SECONDS=0.05)
    # An outage (500s), not a rate limit or an overload: those never dead-letter a run.
    fake_api.fail_next(api_error(500, "api_error", "Internal server error"), times=4)
    run = start_run("tester", '@lookup {"key": "a"}')

    first = run_worker(max_runs=1)
    assert first.stats.dispositions == {"released": 1}
    run = reload(run)
    assert run.status == "pending"
    assert (run.lease_owner, run.lease_until) == (None, None)
    assert (run.attempt, run.stalled_claims, run.last_seq) == (1, 1, 0)
    assert run.error == "model call failed: api_error: Internal server error"
    assert [r.status for r in fake_api.requests] == [500, 500]

    second = run_worker()
    assert second.stats.dispositions == {"released": 1, "dead": 1}
    run = reload(run)
    assert run.status == "dead"
    assert (run.attempt, run.stalled_claims) == (3, 3)
    assert run.error.startswith(
        "2 claims in a row ended without committing a step (MAX_ATTEMPTS=2); "
        "last committed step: seq 0;"
    )
    assert run.error.endswith("; last error: model call failed: api_error: Internal server error")
    # The claim that dead-letters makes no model call.
    assert [r.status for r in fake_api.requests] == [500] * 4
    assert len(own_steps(run)) == 1

    # A person requeues it; the model is back, the run finishes.
    assert requeue_run(run.pk) is True
    run = reload(run)
    assert (run.status, run.stalled_claims, run.finished_at) == ("pending", 0, None)
    run_worker()
    run = reload(run)
    assert (run.status, run.error, run.stalled_claims) == ("succeeded", "", 0)
    assert [r.status for r in fake_api.requests] == [500] * 4 + [200, 200]


# --------------------------------------------------------------------------- cancellation


def test_cancelled_pending_run_is_never_claimed(fake_api: FakeAnthropic) -> None:
    run = start_run("tester", '@lookup {"key": "a"}')
    assert cancel_run(run.pk) is True
    worker = run_worker()
    run = reload(run)
    assert worker.stats.claims == 0
    assert run.status == "cancelled"
    assert run.attempt == 0
    assert fake_api.requests == []
    assert len(own_steps(run)) == 1


def test_cancel_while_a_tool_runs_commits_nothing_more(
    fake_api: FakeAnthropic, receiver: Any
) -> None:
    # An hour-long tool: a worker that ends within the minute below walked away from it.
    run = start_run("tester", '@slow {"seconds": 3600}\n@lookup {"key": "a"}\n@lookup {"key": "b"}')
    worker, thread = background_worker(heartbeat_seconds=0.3)
    wait_for(lambda: receiver.marker("slow-started"), timeout=10)
    # The turn that asked for the call is committed while it runs (it did not end at once).
    wait_for(lambda: len(own_steps(run)) == 2, timeout=10)
    before = len(own_steps(run))
    assert cancel_run(run.pk) is True

    thread.join(60)
    assert not thread.is_alive()
    assert worker.stats.dispositions == {"cancelled": 1}
    run = reload(run)
    assert run.status == "cancelled"
    assert (run.lease_owner, run.lease_until, run.last_seq) == (None, None, 1)
    assert len(own_steps(run)) == before
    assert len(fake_api.requests) == 1
    # The cancel walked away from the call in flight (the slot is free at once): nothing is
    # recorded for it and no step follows it.
    assert list(ToolEffect.objects.filter(run_id=run.pk)) == []

    # Nobody picks it up again.
    assert run_worker().stats.claims == 0
    assert reload(run).status == "cancelled"
    assert len(own_steps(run)) == before
    (receiver.directory / "slow-release").touch()  # the abandoned tool may end now


def test_cancel_during_a_retry_wait_stops_at_once(fake_api: FakeAnthropic) -> None:
    # An hour to wait: a worker that ends within the minute below did not wait it out.
    fake_api.fail_next(api_error(529, "overloaded_error", "Overloaded", **{"retry-after": "3600"}))
    run = start_run("tester", '@lookup {"key": "a"}')
    worker, thread = background_worker(heartbeat_seconds=0.3)
    wait_for(lambda: len(fake_api.requests) == 1, timeout=10)
    assert cancel_run(run.pk) is True
    thread.join(60)
    assert not thread.is_alive()
    assert worker.stats.dispositions == {"cancelled": 1}
    assert reload(run).status == "cancelled"
    assert [r.status for r in fake_api.requests] == [529]
    assert len(own_steps(run)) == 1


def _cancel_during_model_call(
    fake_api: FakeAnthropic,
) -> tuple[AgentRun, Worker, threading.Event]:
    """Cancel while the fake API holds the model call; returns once the worker has ended,
    with the event that lets the fake API answer."""
    arrived, answer = threading.Event(), threading.Event()

    def hold(body: dict[str, Any]) -> None:
        arrived.set()
        answer.wait(60)  # bounded: a failing test must not hang the server thread

    fake_api.before_answer = hold
    run = start_run("tester", '@lookup {"key": "a"}')
    worker, thread = background_worker(heartbeat_seconds=0.3)
    assert arrived.wait(10)
    assert len(own_steps(run)) == 1
    assert cancel_run(run.pk) is True
    thread.join(30)
    assert not thread.is_alive()
    return run, worker, answer


def _caller_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "da-caller"}


def test_cancel_during_a_model_call_commits_no_turn(fake_api: FakeAnthropic) -> None:
    earlier = _caller_threads()
    run, worker, answer = _cancel_during_model_call(fake_api)
    assert worker.stats.dispositions == {"cancelled": 1}
    # The thread the worker left its call on: the only one that could still act on the answer.
    abandoned = _caller_threads() - earlier
    assert abandoned
    # The answer still arrives, and that thread ends: nothing has committed it.
    answer.set()
    wait_for(lambda: len(fake_api.requests) == 1, timeout=10)
    for thread in abandoned:
        thread.join(30)
        assert not thread.is_alive()
    run = reload(run)
    assert run.status == "cancelled"
    assert len(own_steps(run)) == 1
    assert run.last_seq == 0
    assert len(fake_api.requests) == 1


def test_cancel_during_a_model_call_gives_up_promptly(fake_api: FakeAnthropic) -> None:
    run, worker, answer = _cancel_during_model_call(fake_api)
    # The worker ended while the fake API still held the call: it did not wait for the answer.
    assert fake_api.requests == []
    answer.set()
    assert worker.stats.dispositions == {"cancelled": 1}
    assert len(own_steps(run)) == 1


# --------------------------------------------------------------------------- logging

TOOL_LOGGER = "tests.toolcode"


@tool(effect="pure")
def chatty(word: str) -> str:
    """Log a line from inside tool code."""
    logging.getLogger(TOOL_LOGGER).warning("tool says %s", word)
    return word


@pytest.fixture
def chatty_agent() -> Iterator[Agent]:
    agent = Agent(
        name="test-runner-chatty",
        version="t1",
        model="claude-test-1",
        system="You log.",
        tools=[chatty],
        max_tokens=256,
    )
    yield agent
    registry.unregister("test-runner-chatty", "t1")


def test_log_records_inside_a_run_carry_its_id(
    fake_api: FakeAnthropic, chatty_agent: Agent, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="durable_agents")
    caplog.set_level(logging.INFO, logger=TOOL_LOGGER)
    run = start_run("test-runner-chatty", '@chatty {"word": "hello"}')
    run_worker()
    assert reload(run).status == "succeeded"

    from_tool = [r for r in caplog.records if r.name == TOOL_LOGGER]
    assert [(r.getMessage(), vars(r)["run_id"]) for r in from_tool] == [
        ("tool says hello", str(run.pk))
    ]

    from_runner = [r for r in caplog.records if r.name == "durable_agents.runner"]
    assert [vars(r)["run_id"] for r in from_runner] == [str(run.pk)] * 5
    messages = [r.getMessage() for r in from_runner]
    assert messages[0].startswith(f"run {run.pk} seq 1 model_turn committed (")
    assert messages[1].startswith(f"run {run.pk} tool chatty (pure) call 0 of turn 1: ok in ")
    assert messages[2].startswith(f"run {run.pk} seq 2 tool_result tool=chatty committed (")
    assert messages[3].startswith(f"run {run.pk} seq 3 model_turn committed (")
    assert messages[4] == f"run {run.pk} succeeded"

    # Outside a run, records say so.
    started = [r for r in caplog.records if r.getMessage().startswith("worker ")]
    assert started
    assert {vars(r)["run_id"] for r in started} == {"-"}


def test_every_record_about_a_run_carries_its_id(
    fake_api: FakeAnthropic, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="durable_agents")
    run = start_run("tester", '@lookup {"key": "a"}')
    run_worker()
    about = [r for r in caplog.records if str(run.pk) in r.getMessage()]
    # claimed, 3 commits, 1 tool call, succeeded
    assert len(about) == 6
    assert about[0].getMessage() == f"claimed run {run.pk} (attempt 1)"
    assert {vars(r)["run_id"] for r in about} == {str(run.pk)}


def test_heartbeat_records_about_a_run_carry_its_id(
    fake_api: FakeAnthropic, receiver: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="durable_agents")
    # An hour-long tool: only the heartbeat can end this run's claim within the test.
    run = start_run("tester", '@slow {"seconds": 3600}')
    # Not LISTENing: the heartbeat, not a notification, is what notices the cancel here.
    worker, thread = background_worker(heartbeat_seconds=0.3, listen=False)
    wait_for(lambda: receiver.marker("slow-started"), timeout=10)
    # The turn is committed while the call runs; then only the heartbeat hears of the cancel.
    wait_for(lambda: len(own_steps(run)) == 2, timeout=10)
    cancel_run(run.pk)
    thread.join(60)
    (receiver.directory / "slow-release").touch()  # the abandoned tool may end now
    assert worker.stats.dispositions == {"cancelled": 1}
    noticed = [r for r in caplog.records if "noticed by the heartbeat" in r.getMessage()]
    assert [r.getMessage() for r in noticed] == [
        f"run {run.pk}: cancelled (noticed by the heartbeat)"
    ]
    assert vars(noticed[0])["run_id"] == str(run.pk)
