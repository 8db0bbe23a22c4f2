"""A user's second message while the agent works (``send_message``): queued in the run's
inbox, folded by the worker that holds the run at its next turn boundary (after the tool
results, in the same user turn), committed as a step and sent again byte for byte from then on.
Real workers in process, the real SDK over the fake API (which refuses a malformed request)."""

from __future__ import annotations

import base64
import json
import threading
import uuid
from typing import Any

import pytest
from django.contrib.auth.models import AnonymousUser
from django.core.exceptions import PermissionDenied
from django.db import connection
from django.test import Client

import durable_agents
from durable_agents import api
from durable_agents.engine.history import load_log
from durable_agents.exceptions import (
    ForkRefused,
    InvalidArgument,
    RunBusy,
    RunFinished,
    RunNotFound,
)
from durable_agents.models import AgentMessage, AgentRun, AgentStep, RunStatus, StepKind
from durable_agents.testing import plan
from tests.conftest import run_worker
from tests.fakeserver import FakeAnthropic
from tests.integration.test_admin import ESCAPED, SCRIPT, run_url

pytestmark = pytest.mark.django_db(transaction=True)


def user_texts(message: dict[str, Any]) -> list[str]:
    content = message["content"]
    if isinstance(content, str):
        return [content]
    return [b["text"] for b in content if b["type"] == "text"]


def block_types(message: dict[str, Any]) -> list[str]:
    return [b["type"] for b in message["content"]]


def finished(run: AgentRun) -> AgentRun:
    run = AgentRun.objects.get(pk=run.pk)
    assert run.status == RunStatus.SUCCEEDED, run.error
    return run


def test_messages_sent_during_a_tool_call_follow_its_results_in_order(
    fake_api: FakeAnthropic,
) -> None:
    run = durable_agents.start_run(
        "messenger", plan(("tell", {"text": "first"}), ("tell", {"text": "second"}))
    )
    run_worker()
    finished(run)
    bodies = [r.json() for r in fake_api.requests]
    assert all(r.status == 200 for r in fake_api.requests)
    # Request 2 follows the first call: its last user turn is the tool result, then the text.
    last = bodies[1]["messages"][-1]
    assert block_types(last) == ["tool_result", "text"]
    assert user_texts(last) == ["first"]
    last = bodies[2]["messages"][-1]
    assert block_types(last) == ["tool_result", "text"]
    assert user_texts(last) == ["second"]
    steps = list(AgentStep.objects.filter(run_id=run.pk).values_list("seq", "kind"))
    assert [kind for _, kind in steps] == [
        "task", "model_turn", "tool_result", "message", "model_turn", "tool_result", "message",
        "model_turn",
    ]  # fmt: skip
    folded = list(AgentMessage.objects.filter(run_id=run.pk).values_list("text", "folded_seq"))
    assert folded == [("first", 3), ("second", 6)]
    # The transcript rebuilt from the log is what the last request sent, plus the answer.
    assert api.messages_for(run.pk)[: len(bodies[-1]["messages"])] == bodies[-1]["messages"]


def test_two_messages_queued_before_the_first_call_join_the_task_in_order(
    fake_api: FakeAnthropic,
) -> None:
    run = durable_agents.start_run("messenger", "Answer me.")
    api.send_message(run.pk, "one")
    api.send_message(str(run.pk), "two")
    run_worker()
    finished(run)
    first = fake_api.requests[0].json()["messages"]
    assert len(first) == 1
    assert first[0]["content"] == [
        {"type": "text", "text": "Answer me."},
        {"type": "text", "text": "one"},
        {"type": "text", "text": "two"},
    ]
    assert AgentMessage.objects.filter(run_id=run.pk, folded_seq=1).count() == 2


def test_a_retry_with_the_same_key_queues_once_and_returns_the_same_row() -> None:
    run = durable_agents.start_run("messenger", "Answer me.")
    first = api.send_message(run.pk, "check March", key="client-1")
    again = api.send_message(run.pk, "check March (retry)", key="client-1")
    assert again.pk == first.pk
    assert again.text == "check March"
    other = api.send_message(run.pk, "check April", key="client-2")
    assert other.pk != first.pk
    assert AgentMessage.objects.filter(run_id=run.pk).count() == 2


def test_a_finished_run_refuses_messages_and_a_retry_of_a_delivered_one_still_returns_it(
    fake_api: FakeAnthropic,
) -> None:
    run = durable_agents.start_run("messenger", "Answer me.")
    sent = api.send_message(run.pk, "hello", key="k")
    run_worker()
    finished(run)
    with pytest.raises(RunFinished, match=r"has ended \(succeeded\); start a new run or fork it"):
        api.send_message(run.pk, "too late")
    assert api.send_message(run.pk, "hello", key="k").pk == sent.pk
    assert AgentMessage.objects.filter(run_id=run.pk).count() == 1


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("", "non-empty"),
        ("   ", "non-empty"),
        (None, "non-empty"),
        ("a\x00b", "NUL"),
        ("a\ud800b", "lone surrogates"),
        ("x" * (10 * 1024 * 1024), "MAX_MESSAGE_BYTES"),
    ],
)
def test_bad_text_is_refused_and_nothing_is_queued(text: Any, says: str) -> None:
    run = durable_agents.start_run("messenger", "Answer me.")
    with pytest.raises(InvalidArgument, match=says):
        api.send_message(run.pk, text)
    assert not AgentMessage.objects.exists()


def test_bad_arguments_are_refused() -> None:
    run = durable_agents.start_run("messenger", "Answer me.")
    with pytest.raises(InvalidArgument, match="policy"):
        api.send_message(run.pk, "hi", policy="shout")
    with pytest.raises(InvalidArgument, match="not a run id"):
        api.send_message("not-a-uuid", "hi")
    with pytest.raises(RunNotFound):
        api.send_message(uuid.uuid4(), "hi")
    with pytest.raises(InvalidArgument, match="key"):
        api.send_message(run.pk, "hi", key="")
    with pytest.raises(PermissionDenied):
        api.send_message(run.pk, "hi", user=AnonymousUser())
    assert not AgentMessage.objects.exists()


def test_reject_refuses_a_working_run_and_queues_for_a_waiting_one() -> None:
    run = durable_agents.start_run("messenger", "Answer me.")
    with pytest.raises(RunBusy, match="working"):
        api.send_message(run.pk, "hi", policy="reject")
    AgentRun.objects.filter(pk=run.pk).update(status=RunStatus.WAITING)
    assert api.send_message(run.pk, "hi", policy="reject").folded_seq is None
    assert api.send_message(run.pk, "again", policy="interrupt").folded_seq is None


def test_a_message_after_the_final_answer_was_asked_for_keeps_the_run_going(
    fake_api: FakeAnthropic,
) -> None:
    """The model answers while a message arrives: the answer is committed as a turn, the run
    goes on, and the model reads the message after its answer."""
    run = durable_agents.start_run("messenger", "Answer me.")
    sent: list[int] = []

    def meanwhile(body: dict[str, Any]) -> None:
        if not sent:
            sent.append(api.send_message(run.pk, "one more thing").pk)

    fake_api.before_answer = meanwhile
    run_worker()
    finished(run)
    second = fake_api.requests[1].json()["messages"]
    assert [m["role"] for m in second] == ["user", "assistant", "user"]
    assert second[2]["content"] == [{"type": "text", "text": "one more thing"}]


def test_a_fork_after_a_folded_message_includes_it(fake_api: FakeAnthropic) -> None:
    run = durable_agents.start_run("messenger", plan(("tell", {"text": "remember me"})))
    run_worker()
    finished(run)
    # Steps: 0 task, 1 turn, 2 tool result, 3 the message, 4 the answer.
    fork = durable_agents.fork_run(run.pk, 3)
    run_worker()
    finished(fork)
    assert len(fake_api.requests) == 3
    forked = fake_api.requests[2].json()["messages"]
    assert block_types(forked[2]) == ["tool_result", "text"]
    assert user_texts(forked[2]) == ["remember me"]
    # The fork's request is the original's after the fold, byte for byte.
    assert sent_messages(fake_api.requests[2].body) == sent_messages(fake_api.requests[1].body)


def sent_messages(body: bytes) -> bytes:
    """The raw ``messages`` array of a request body (its last member, never re-encoded)."""
    return body[body.index(b',"messages":[') + len(b',"messages":') : -1]


def test_the_log_rebuilds_every_request_byte_for_byte(fake_api: FakeAnthropic) -> None:
    """The requests were built live, a message folded into the task's turn and into two tool
    results' turns; the transcript rebuilt from the log (what a resumed worker sends) starts
    with each of them, byte for byte, and a fork resumed after a fold sends its original's."""
    run = durable_agents.start_run(
        "messenger", plan(("tell", {"text": "first"}), ("tell", {"text": "second"}))
    )
    api.send_message(run.pk, "before the start")
    run_worker()
    finished(run)
    transcript = load_log(run.pk, trim=False).conversation.json()
    sent = [sent_messages(r.body) for r in fake_api.requests]
    assert len(sent) == 3
    for messages in sent:
        assert transcript.startswith(messages[:-1])
    # A fork from the second fold (seq 7 is the turn after it) resumes from the log: its
    # first request is the original's third, byte for byte.
    fork = durable_agents.fork_run(run.pk, 7)
    run_worker()
    finished(fork)
    assert sent_messages(fake_api.requests[3].body) == sent[2]


@pytest.mark.postgres
def test_interrupt_abandons_the_model_call_in_flight_and_calls_again_with_the_message(
    fake_api: FakeAnthropic,
) -> None:
    """The first call is held at the fake API; the message (policy interrupt) makes the worker
    give it up (it is never committed) and call again with the message: the held answer is
    let go only once the second request arrived."""
    run = durable_agents.start_run("messenger", "Answer me.")
    second_request = threading.Event()
    seen: list[int] = []

    def hold_the_first(body: dict[str, Any]) -> None:
        seen.append(len(seen))
        if len(seen) == 1:
            api.send_message(run.pk, "stop, read this", policy="interrupt")
            connection.close()  # this thread's, opened by the call
            assert second_request.wait(15), "the worker never called again"
        else:
            second_request.set()

    fake_api.before_answer = hold_the_first
    run_worker()
    run = finished(run)
    # Recorded as answered: the held first request after the second.
    bodies = sorted((r.json()["messages"] for r in fake_api.requests), key=json.dumps)
    assert bodies == [
        [{"role": "user", "content": "Answer me."}],
        [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Answer me."},
                    {"type": "text", "text": "stop, read this"},
                ],
            }
        ],
    ]
    # One model turn committed: the abandoned call left nothing in the log.
    kinds = list(AgentStep.objects.filter(run_id=run.pk).values_list("kind", flat=True))
    assert kinds == [StepKind.TASK, StepKind.MESSAGE, StepKind.MODEL_TURN]


@pytest.mark.postgres
def test_interrupt_while_a_tool_runs_waits_for_its_result(fake_api: FakeAnthropic) -> None:
    """The tool itself sends the message with policy interrupt: no model call is in flight,
    so the tool finishes and the message follows its result."""
    run = durable_agents.start_run(
        "messenger", plan(("tell", {"text": "x", "policy": "interrupt"}))
    )
    run_worker()
    finished(run)
    assert [r.status for r in fake_api.requests] == [200, 200]
    assert block_types(fake_api.requests[1].json()["messages"][-1]) == ["tool_result", "text"]
    kinds = list(AgentStep.objects.filter(run_id=run.pk).values_list("kind", flat=True))
    assert kinds == ["task", "model_turn", "tool_result", "message", "model_turn"]


def test_the_run_page_lists_the_waiting_messages_escaped_until_they_are_folded(
    admin_client: Client, fake_api: FakeAnthropic
) -> None:
    run = durable_agents.start_run("messenger", "Answer me.")
    api.send_message(run.pk, f"look {SCRIPT}")
    page = admin_client.get(run_url(run)).content.decode()
    assert 'id="inbox"' in page
    assert f"look {ESCAPED}" in page
    assert SCRIPT not in page
    run_worker()
    finished(run)
    page = admin_client.get(run_url(run)).content.decode()
    assert 'id="inbox"' not in page
    assert f"look {ESCAPED}" in page  # a step of the transcript now


def test_messages_are_encrypted_at_rest(da_settings: Any) -> None:
    da_settings(ENCRYPTION_KEYS=[base64.urlsafe_b64encode(b"A" * 32).decode()])
    run = durable_agents.start_run("messenger", "Answer me.")
    api.send_message(run.pk, "the secret invoice number 4711")
    with connection.cursor() as cursor:
        cursor.execute("SELECT text FROM agent_message")
        (stored,) = cursor.fetchone()
    assert "4711" not in stored
    assert AgentMessage.objects.get().text == "the secret invoice number 4711"


def test_a_message_step_cannot_be_edited_by_a_fork(fake_api: FakeAnthropic) -> None:
    run = durable_agents.start_run("messenger", "Answer me.")
    api.send_message(run.pk, "one")
    run_worker()
    finished(run)
    with pytest.raises(ForkRefused, match="messages a user sent"):
        durable_agents.fork_run(run.pk, 1, edit=[{"type": "text", "text": "changed"}])
