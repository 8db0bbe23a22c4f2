"""Streamed turns: committed only after message_stop, partial text to a callback, and a
cancellation that stops the stream (and the tokens) once the heartbeat notices it."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest

import durable_agents
from durable_agents.models import AgentRun, AgentStep, RunStatus, StepKind
from durable_agents.offline import ScriptedModel
from tests.conftest import run_worker, wait_for
from tests.testapp.agents import STREAMED_TEXT

pytestmark = pytest.mark.django_db(transaction=True)

PLAN = (
    'Stream.\n@lookup {"key": "a"} && set_flag {"name": "n", "value": true}\n@lookup {"key": "b"}'
)


def _turns(run: AgentRun) -> list[dict[str, Any]]:
    return [
        json.loads(s.payload)
        for s in AgentStep.objects.filter(run=run, kind=StepKind.MODEL_TURN).order_by("seq")
    ]


def test_a_streamed_run_assembles_each_turn_exactly(fake_api: Any) -> None:
    STREAMED_TEXT.clear()
    run = durable_agents.start_run("streamer", PLAN)
    run_worker()
    run.refresh_from_db()
    assert run.status == RunStatus.SUCCEEDED, run.error
    requests = fake_api.ok_requests()
    assert len(requests) == 3
    assert all(r.json()["stream"] is True for r in requests)
    # Each assembled turn equals, value for value and key for key, what the same request
    # answered without streaming; the signatures of the next requests verified it too.
    model = ScriptedModel()
    for turn, request in zip(_turns(run), requests, strict=True):
        plain = dict(request.json())
        del plain["stream"]
        _, _, body = model.respond("POST", "/v1/messages", {}, json.dumps(plain).encode())
        expected = json.loads(body)
        assert json.dumps(turn["content"]) == json.dumps(expected["content"])
        assert list(turn) == list(expected)
        assert turn["stop_reason"] == expected["stop_reason"]
        assert turn["usage"]["output_tokens"] == expected["usage"]["output_tokens"]
        assert turn["offline_script"] == expected["offline_script"]
    # The request id of each streamed turn is kept (from the response headers).
    stored = list(
        AgentStep.objects.filter(run=run, kind=StepKind.MODEL_TURN)
        .order_by("seq")
        .values_list("request_id", flat=True)
    )
    expected_ids = [
        model.respond_stream("POST", "/v1/messages", {}, r.body)[1]["request-id"] for r in requests
    ]
    assert stored == expected_ids
    # Partial text reached the callback, tagged with the run.
    texts = [t for run_id, t in STREAMED_TEXT if run_id == str(run.id)]
    assert "".join(texts).startswith("Step 1: calling lookup, set_flag.")
    assert len(texts) > 3


def test_a_cut_stream_commits_nothing_and_is_retried(fake_api: Any, da_settings: Any) -> None:
    da_settings(MAX_BACKOFF_SECONDS=0.05)
    fake_api.cut_next_stream(after_events=5)  # inside the first content block
    run = durable_agents.start_run("streamer", PLAN)
    run_worker()
    run.refresh_from_db()
    assert run.status == RunStatus.SUCCEEDED, run.error
    first, second = fake_api.requests[:2]
    assert first.cut
    assert first.events_sent == 5
    assert first.body == second.body  # the same request again, byte for byte
    turns = _turns(run)
    assert len(turns) == 3
    thinking = turns[0]["content"][0]
    assert thinking["type"] == "thinking"
    assert thinking["signature"]  # never the cut one
    assert list(AgentStep.objects.filter(run=run).values_list("seq", flat=True)) == list(range(6))


@pytest.mark.parametrize("agent", ["streamer", "thinker"])
def test_cancel_noticed_by_the_heartbeat_stops_an_inflight_model_call(
    fake_api: Any, agent: str
) -> None:
    """A slow stream (or a plain answer the fake API holds) is abandoned once the heartbeat
    sees the cancellation; a stream is closed, so the server stops sending."""
    # The stream's 18 events come 2 s apart: the whole answer takes over half a minute.
    directive = "\n@@chunk_latency 2" if agent == "streamer" else ""
    arrived, answer = threading.Event(), threading.Event()

    def hold(body: dict[str, Any]) -> None:
        arrived.set()
        answer.wait(60)  # bounded: a failing test must not hang the server thread

    fake_api.before_answer = hold  # plain answers only
    run = durable_agents.start_run(agent, f'Slow.{directive}\n@lookup {{"key": "a"}}')
    # Not LISTENing: the heartbeat, not a notification, is what notices the cancel here.
    worker = threading.Thread(
        target=run_worker,
        kwargs={"lease_seconds": 3, "heartbeat_seconds": 0.3, "listen": False},
    )
    worker.start()
    if agent == "streamer":  # the stream has begun
        wait_for(lambda: fake_api.requests and fake_api.requests[0].events_sent, timeout=30)
    else:
        assert arrived.wait(30)
    assert durable_agents.cancel_run(run.id)
    worker.join(60)
    assert not worker.is_alive()
    assert AgentRun.objects.get(pk=run.id).status == RunStatus.CANCELLED
    assert list(AgentStep.objects.filter(run=run).values_list("seq", flat=True)) == [0]
    if agent == "streamer":
        # The worker hung up: the server's next write failed, before the end of the answer.
        record = fake_api.requests[0]
        wait_for(lambda: record.client_closed, timeout=60)
        assert not record.cut
    else:
        # The worker ended while the fake API still held the call: no answer was waited for.
        assert fake_api.requests == []
        answer.set()
