"""Runs claimed again resume from what was read for their whole claim batch
(``Store.read_ahead``): their logs, the calls recorded at their last steps, whether a message
waits. On the test database (PostgreSQL, or SQLite through the portable store), with the real
SDK against the fake API."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from django.db import DatabaseError

from durable_agents.api import start_run
from durable_agents.engine.runner import Disposition, advance_run
from durable_agents.models import AgentMessage, AgentRun, RunStatus, StepKind, ToolEffect
from durable_agents.store import Claim, StepWrite, current, read_ahead
from durable_agents.testing import plan
from tests.conftest import own_steps, run_worker
from tests.fakeserver import FakeAnthropic

pytestmark = pytest.mark.django_db(transaction=True)

TURN = (
    '{"id": "msg_1", "type": "message", "role": "assistant", "model": "claude-test-1", '
    '"content": [{"type": "tool_use", "id": "toolu_1", "name": "lookup", '
    '"input": {"key": "a"}}], "stop_reason": "tool_use", "stop_sequence": null, '
    '"usage": {"input_tokens": 10, "output_tokens": 5}}'
)


def handed_back(
    task: str = '@lookup {"key": "a"}',
    agent: str = "tester",
    turn_json: str = TURN,
    result: str | None = None,
) -> AgentRun:
    """A run whose first turn (asking for lookup) is committed, handed back: claimable again
    with two steps in its log, as a woken or handed-back run is; with ``result``, its call's
    result committed too (the run goes on with a model call)."""
    run = start_run(agent, task)
    store = current()
    claim = store.claim_run(run.pk, "w0", 30)
    assert claim is not None
    span = (turn_json.index("["), turn_json.index(', "stop_reason"'))
    turn = StepWrite(1, StepKind.MODEL_TURN, turn_json, "req_1", content_span=span)
    assert store.append_step(claim, turn)
    if result is not None:
        block = {"type": "tool_result", "tool_use_id": "toolu_1", "content": result}
        assert store.append_step(claim, StepWrite(2, StepKind.TOOL_RESULT, json.dumps([block])))
    store.release_lease(claim, count_claim=False)
    return AgentRun.objects.get(pk=run.pk)


def claim_all(n: int) -> list[Claim]:
    claims = current().claim_runs("w1", 30, n)
    assert len(claims) == n
    return current().read_ahead(claims)


def test_a_batch_reads_what_each_resume_would_read_itself() -> None:
    quiet, told = handed_back(), handed_back()
    fresh = start_run("tester", "Say hello.")
    store = current()
    # A call of the quiet run's turn completed before the hand-back; the other has a message.
    effect = ToolEffect(key="k-quiet", run_id=quiet.pk, seq=1, call_index=0, tool="lookup")
    effect.result, effect.is_error = "value-of-a", False
    store.record_effect(effect)
    store.queue_message(told.pk, "one more thing", None)
    by_run = {claim.run_id: claim for claim in claim_all(3)}
    for run in (quiet, told):
        ahead = by_run[run.pk].ahead
        assert ahead is not None
        assert ahead.log == [tuple(row) for row in store.load_log_rows(run.pk, shares=False)]
        assert ahead.last_seq == 1
        assert ahead.effects.keys() == store.recorded_effects(run.pk, 1).keys()
        assert ahead.messages_waiting == store.has_waiting_messages(run.pk)
    assert by_run[quiet.pk].ahead.effects["k-quiet"].result == "value-of-a"  # type: ignore[union-attr]
    assert by_run[told.pk].ahead.messages_waiting is True  # type: ignore[union-attr]
    # A run whose only step is its task: the claim carries that already (PostgreSQL), or
    # its slot reads it; nothing is read ahead for it.
    assert by_run[fresh.pk].ahead is None


def test_a_resume_with_its_reads_done_reads_neither_its_log_nor_its_calls_again(
    fake_api: FakeAnthropic, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = handed_back('@lookup {"key": "a"}')
    [claim] = claim_all(1)
    assert claim.ahead is not None
    store = current()

    def not_again(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("read again although read with the batch")

    for name in ("load_log_rows", "recorded_effects"):
        monkeypatch.setattr(store, name, not_again)
    looks: list[Any] = []
    has_waiting = store.has_waiting_messages

    def look(run_id: Any) -> bool:
        looks.append(run_id)
        return has_waiting(run_id)

    monkeypatch.setattr(store, "has_waiting_messages", look)
    assert advance_run(claim, store=store) is Disposition.SUCCEEDED
    # The inbox is looked into again once, after the tool call the resume began with.
    assert looks == [run.pk]
    run = AgentRun.objects.get(pk=run.pk)
    assert run.status == RunStatus.SUCCEEDED
    assert [step.kind for step in own_steps(run)] == [
        StepKind.TASK,
        StepKind.MODEL_TURN,
        StepKind.TOOL_RESULT,
        StepKind.MODEL_TURN,
    ]
    # The conversation sent is the log's: the turn read ahead, then its call's result.
    sent = fake_api.requests[-1].json()["messages"]
    assert [m["role"] for m in sent] == ["user", "assistant", "user"]
    assert sent[1]["content"][0]["id"] == "toolu_1"


def test_a_recorded_call_read_ahead_is_not_made_again(fake_api: FakeAnthropic) -> None:
    run = handed_back('@lookup {"key": "a"}')
    from durable_agents.engine import effects

    key = effects.idempotency_key(run.pk, 1, 0, "lookup", {"key": "a"})
    effect = ToolEffect(key=key, run_id=run.pk, seq=1, call_index=0, tool="lookup")
    effect.result, effect.is_error = "recorded before the crash", False
    current().record_effect(effect)
    [claim] = claim_all(1)
    assert claim.ahead is not None
    assert advance_run(claim, store=current()) is Disposition.SUCCEEDED
    # The model read the recorded result: the call did not run again.
    [result] = fake_api.requests[-1].json()["messages"][-1]["content"]
    assert result["content"] == "recorded before the crash"


def test_a_message_seen_by_the_batch_is_folded_before_the_next_call(
    fake_api: FakeAnthropic, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A resume that begins with a model call takes the batch's look as its own."""
    run = handed_back('@lookup {"key": "a"}', result="value-of-a")
    store = current()
    store.queue_message(run.pk, "also check b", None)
    [claim] = claim_all(1)
    assert claim.ahead is not None
    assert claim.ahead.messages_waiting is True

    def not_again(run_id: Any) -> bool:
        raise AssertionError("looked into the inbox again although the batch did")

    monkeypatch.setattr(store, "has_waiting_messages", not_again)
    assert advance_run(claim, store=store) is Disposition.SUCCEEDED
    first_call = fake_api.requests[0].json()["messages"]
    assert [block["type"] for block in first_call[-1]["content"]] == ["tool_result", "text"]
    assert first_call[-1]["content"][1]["text"] == "also check b"


def test_a_message_sent_while_the_first_tool_of_the_resume_runs_goes_with_the_next_call(
    fake_api: FakeAnthropic,
) -> None:
    """The batch's look into the inbox stands for the slot's own look only until a tool runs:
    a message the person sends while the resumed run's tool runs (``tell`` sends it) follows
    that tool's result in the very next call, as at any turn boundary."""
    turn = TURN.replace('"name": "lookup", "input": {"key": "a"}', '"name": "tell", '
                        '"input": {"text": "sent during the tool"}')  # fmt: skip
    run = handed_back(
        plan(("tell", {"text": "sent during the tool"})), agent="messenger", turn_json=turn
    )
    [claim] = claim_all(1)
    assert claim.ahead is not None
    assert claim.ahead.messages_waiting is False  # nothing waited when the batch looked
    assert advance_run(claim, store=current()) is Disposition.SUCCEEDED
    first_call = fake_api.requests[0].json()["messages"]
    assert [block["type"] for block in first_call[-1]["content"]] == ["tool_result", "text"]
    assert first_call[-1]["content"][1]["text"] == "sent during the tool"
    assert AgentMessage.objects.get(run_id=run.pk).folded_seq == 3  # after the result (seq 2)


def test_a_batch_read_that_fails_leaves_each_slot_to_read_for_itself(
    monkeypatch: pytest.MonkeyPatch, fake_api: FakeAnthropic
) -> None:
    run = handed_back()

    def down(claims: Any) -> Any:
        raise DatabaseError("the connection went away")

    monkeypatch.setattr(read_ahead, "_read", down)
    [claim] = claim_all(1)
    assert claim.ahead is None
    assert advance_run(claim, store=current()) is Disposition.SUCCEEDED
    assert AgentRun.objects.get(pk=run.pk).status == RunStatus.SUCCEEDED


def test_a_log_too_big_is_left_to_its_slot(monkeypatch: pytest.MonkeyPatch) -> None:
    small, big = handed_back(), handed_back('@lookup {"key": "%s"}' % ("x" * 300))
    # The task and turn of the small run fit; the big run's task does not.
    monkeypatch.setattr(read_ahead, "MAX_CHARS", len(TURN) + 100)
    by_run = {claim.run_id: claim for claim in claim_all(2)}
    assert by_run[small.pk].ahead is not None
    assert by_run[big.pk].ahead is None


@pytest.mark.parametrize(
    ("changes", "read"),
    [
        ({}, True),
        ({"fork_seq": 1}, False),  # a fork reads stretches of other logs: its slot reads it
        ({"last_seq": read_ahead.MAX_STEPS + 1}, False),  # a long log: its slot reads it
    ],
    ids=["handed-back", "fork", "long-log"],
)
def test_which_claims_are_read_ahead(changes: dict[str, Any], read: bool) -> None:
    handed_back()
    [claim] = current().claim_runs("w1", 30, 1)
    for name, value in changes.items():
        setattr(claim.run, name, value)
    assert read_ahead.wanted(claim) is read


def test_a_worker_reads_ahead_for_each_claim_batch(
    fake_api: FakeAnthropic, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs = [handed_back() for _ in range(3)]
    store = current()
    batches: list[list[Any]] = []
    read = store.read_ahead

    def kept(claims: Any) -> Any:
        done = read(claims)
        batches.append([claim.ahead is not None for claim in done])
        return done

    monkeypatch.setattr(store, "read_ahead", kept)
    run_worker(concurrency=3)
    assert [flag for batch in batches for flag in batch] == [True] * 3
    assert {AgentRun.objects.get(pk=run.pk).status for run in runs} == {RunStatus.SUCCEEDED}


@pytest.mark.postgres
def test_on_postgresql_the_reads_go_out_in_one_pipeline_and_the_claim_looks_for_them() -> None:
    """The claim statement looks into each run's inbox: the batch reads the log and the calls
    (two statements in one round trip, libpq 14 or later); for a claim that did not look, the
    inbox's statement goes in the same pipeline."""
    from django.db import connection

    from durable_agents.store import postgres_steps

    if not postgres_steps.pipelines():
        pytest.skip("libpq older than 14: no pipeline")
    quiet, told = handed_back(), handed_back()
    current().queue_message(told.pk, "one more thing", None)
    claims = current().claim_runs("w1", 30, 2)
    assert {claim.run_id: claim.messages_waiting for claim in claims} == {
        quiet.pk: False,
        told.pk: True,
    }
    sent: list[tuple[str, bool]] = []

    def seen(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        table = next(name for name in ("agent_step", "agent_message", "tool_effect") if name in sql)
        sent.append((table, bool(connection.connection.pgconn.pipeline_status)))
        return execute(sql, params, many, context)

    with connection.execute_wrapper(seen):
        done = current().read_ahead(claims)
    assert sent == [("agent_step", True), ("tool_effect", True)]
    assert {claim.run_id: claim.ahead.messages_waiting for claim in done if claim.ahead} == {
        quiet.pk: False,
        told.pk: True,
    }
    sent.clear()
    unlooked = [dataclasses.replace(claim, messages_waiting=None) for claim in claims]
    with connection.execute_wrapper(seen):
        done = current().read_ahead(unlooked)
    assert sent == [("agent_step", True), ("agent_message", True), ("tool_effect", True)]
    assert {claim.run_id: claim.ahead.messages_waiting for claim in done if claim.ahead} == {
        quiet.pk: False,
        told.pk: True,
    }
