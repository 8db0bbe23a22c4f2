"""The conversation a run sends: kept as JSON text, rebuilt from the log without parsing turns.

Requests are built from stored text (llm.request_body + history.Conversation), so these tests
compare bytes: what the fake API received against what the log rebuilds.
"""

from __future__ import annotations

import importlib
import json
import threading

import pytest
from django.apps import apps as django_apps

from durable_agents import llm, store
from durable_agents._internal.interrupt import Interrupt
from durable_agents.api import messages_for, start_run
from durable_agents.declare.agents import registry
from durable_agents.engine.history import load_log, user_message
from durable_agents.engine.runner import advance_run, tokens_of
from durable_agents.models import AgentRun, AgentStep
from durable_agents.store import StepWrite
from tests.conftest import before_commit_of, own_steps, run_worker
from tests.fakeserver import FakeAnthropic
from tests.integration.conftest import conversation_of

THREE_TURNS = 'Think, then look.\n@lookup {"key": "a"}\n@lookup {"key": "b"} && lookup {"key": "c"}'

# --------------------------------------------------------------------------- content_span

SPAN_CASES = [
    '{"id":"m","content":[{"type":"text","text":"hi"}],"stop_reason":"end_turn"}',
    '{ "content" : [ {"type": "text", "text": "a \\"content\\": [1]"} ] , "usage": {} }',
    '{"id": "m", "usage": {"content": "not this one"}, "content": []}',
    '\n{\n  "role": "assistant",\n  "content": [{"type": "text", "text": "\\u00e9t ☃"}]\n}\n',
    '{"content": [1], "content": [2]}',  # duplicate keys: the last wins, as in json.loads
    '{"content": "a string", "x": {"content": [3]}}',
]


@pytest.mark.parametrize("body", SPAN_CASES)
def test_content_span_cuts_exactly_the_content_value(body: str) -> None:
    span = llm.content_span(body)
    assert span is not None
    assert json.loads(body[span[0] : span[1]]) == json.loads(body)["content"]


@pytest.mark.parametrize(
    "body", ['{"id": "m"}', "[1, 2]", "", "not json", '{"content": [1,', '{"a" 1}']
)
def test_content_span_is_none_without_a_content_value(body: str) -> None:
    assert llm.content_span(body) is None


def test_request_body_is_the_params_then_the_messages_verbatim() -> None:
    messages = b'[{"role":"user","content":"caf\xc3\xa9"}]'
    body = llm.request_body({"model": "m", "max_tokens": 5}, messages)
    assert body == b'{"model":"m","max_tokens":5,"messages":' + messages + b"}"
    streamed = llm.request_body({"model": "m"}, messages, stream=True)
    assert json.loads(streamed) == {"model": "m", "stream": True, "messages": json.loads(messages)}
    assert json.loads(llm.request_body({}, b"[]")) == {"messages": []}


# --------------------------------------------------------------------------- the log


@pytest.mark.django_db(transaction=True)
def test_every_request_body_is_rebuilt_byte_for_byte_from_the_log(
    fake_api: FakeAnthropic,
) -> None:
    run = start_run("thinker", THREE_TURNS)
    run_worker()
    run = AgentRun.objects.get(pk=run.pk)
    assert run.status == "succeeded"
    steps = own_steps(run.pk)
    assert [s.content_span is not None for s in steps] == [False, True, False, True, False, True]
    params = registry.get("thinker").request_for(run.model)
    assert len(fake_api.requests) == 3
    for n, recorded in enumerate(fake_api.requests):
        before = conversation_of(steps[: 2 * n + 1])
        assert recorded.body == llm.request_body(params, before.json())
    # load_log (one SELECT, one chunk) gives the same bytes as the step-by-step conversation.
    log = load_log(run.pk)
    assert log.conversation.json() == conversation_of(steps).json()
    assert log.last is not None
    assert (len(log.conversation), log.turns, log.first_kind, log.last.seq) == (6, 3, "task", 5)
    # A turn's content is the provider's text, cut out of the stored body.
    turn = steps[1]
    span = turn.content_span
    assert span is not None
    start, end = span
    assert f'"content":{turn.payload[start:end]}}}'.encode() in recorded.body


@pytest.mark.django_db(transaction=True)
def test_a_turn_stored_without_a_span_is_parsed_and_the_run_goes_on(
    fake_api: FakeAnthropic,
) -> None:
    # A run claimed, its first turn committed, then the worker went away. The turn is stored
    # as before migration 0002 (no span): the next claim parses it, and the signed thinking
    # block it holds is still accepted by the API.
    run = start_run("thinker", THREE_TURNS)
    claim = store.current().claim_run(run.pk, "w1", 30)
    assert claim is not None
    turn = llm.create_turn(
        registry.get("thinker").request_for(run.model), messages_for(run.pk), interrupt=Interrupt()
    )
    assert store.current().append_step(
        claim, StepWrite(1, "model_turn", turn.body, turn.request_id)
    )
    assert AgentStep.objects.get(run_id=run.pk, seq=1).content_span is None
    assert load_log(run.pk).conversation.messages() == [
        {"role": "user", "content": THREE_TURNS},
        {"role": "assistant", "content": turn.message["content"]},
    ]
    assert store.current().release_lease(claim)
    run_worker()
    run = AgentRun.objects.get(pk=run.pk)
    assert run.status == "succeeded", run.error
    assert messages_for(run.pk)[1]["content"] == turn.message["content"]


@pytest.mark.django_db(transaction=True)
def test_tokens_used_adds_up_the_usage_of_every_turn(fake_api: FakeAnthropic) -> None:
    run = start_run("tester", '@lookup {"key": "a"}\n@lookup {"key": "b"}')
    run_worker()
    run = AgentRun.objects.get(pk=run.pk)
    turns = [s.data() for s in own_steps(run.pk) if s.kind == "model_turn"]
    assert len(turns) == 3
    assert run.tokens_used == sum(tokens_of(t) for t in turns) > 0


@pytest.mark.django_db(transaction=True)
def test_clients_that_rewrite_requests_get_the_parameters_parsed(
    fake_api: FakeAnthropic, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Bedrock and Vertex clients build their path and body from parsed parameters; they go
    # through messages.create, which receives the same request.
    monkeypatch.setattr(llm.client, "sends_raw_bodies", lambda client: False)
    monkeypatch.setattr(llm.sse, "sends_raw_bodies", lambda client: False)
    run = start_run("thinker", THREE_TURNS)
    run_worker()
    run = AgentRun.objects.get(pk=run.pk)
    assert run.status == "succeeded", run.error
    steps = own_steps(run.pk)
    params = registry.get("thinker").request_for(run.model)
    last = fake_api.requests[-1].json()
    assert last == json.loads(llm.request_body(params, conversation_of(steps[:5]).json()))


@pytest.mark.django_db(transaction=True)
def test_a_claim_rebuilds_from_the_log_and_sends_the_same_bytes(
    fake_api: FakeAnthropic, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two claims of one run: the second rebuilds the conversation with load_log; the request
    # it sends must extend the first claim's last request by exactly the committed steps.
    run = start_run("thinker", THREE_TURNS)
    drain = threading.Event()
    # The worker stops before its next step once the tool results commit.
    before_commit_of(monkeypatch, 2, lambda claim: drain.set())
    first = store.current().claim_run(run.pk, "w1", 30)
    assert first is not None
    # Seq 2 commits while the second call is in flight: the claim ends after that turn.
    assert advance_run(first, drain=drain) == "released"
    assert len(fake_api.requests) == 2
    assert AgentRun.objects.get(pk=run.pk).last_seq == 3
    second = store.current().claim_run(run.pk, "w2", 30)
    assert second is not None
    assert advance_run(second) == "succeeded"
    steps = own_steps(run.pk)
    params = registry.get("thinker").request_for(run.model)
    assert fake_api.requests[2].body == llm.request_body(params, conversation_of(steps[:5]).json())
    assert fake_api.requests[2].body.startswith(fake_api.requests[1].body[: -len(b"]}")])


@pytest.mark.django_db
def test_migration_0002_counts_the_tokens_of_open_runs() -> None:
    migration = importlib.import_module(
        "durable_agents.migrations.0002_step_content_span_run_tokens"
    )
    usage = {"input_tokens": 10, "cache_read_input_tokens": 5, "output_tokens": 7}
    open_run = AgentRun.objects.create(agent="a", prompt_version="1", model="m", task="t")
    done_run = AgentRun.objects.create(
        agent="a", prompt_version="1", model="m", task="t", status="succeeded"
    )
    for run in (open_run, done_run):
        AgentStep.objects.create(run=run, seq=0, kind="task", payload='"t"')
        for seq in (1, 3):
            body = json.dumps({"content": [], "usage": usage})
            AgentStep.objects.create(run=run, seq=seq, kind="model_turn", payload=body)
        AgentStep.objects.create(run=run, seq=2, kind="tool_result", payload="[]")
    AgentStep.objects.create(run=open_run, seq=4, kind="model_turn", payload="{broken")
    migration.count_tokens_of_open_runs(django_apps, None)
    assert AgentRun.objects.get(pk=open_run.pk).tokens_used == 44
    assert AgentRun.objects.get(pk=done_run.pk).tokens_used == 0


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_claim_of_a_fresh_run_brings_its_task_step(fake_api: FakeAnthropic) -> None:
    run = start_run("tester", '@lookup {"key": "a"}')
    (claim,) = store.current().claim_runs("w1", 30, 1)
    task_step = AgentStep.objects.get(run_id=run.pk, seq=0)
    assert claim.task_payload == task_step.payload
    assert load_log(run.pk).conversation.json() == b"[" + user_message(task_step.payload) + b"]"
    turn = llm.create_turn(
        registry.get("tester").request_for(run.model), messages_for(run.pk), interrupt=Interrupt()
    )
    assert store.current().append_step(
        claim, StepWrite(1, "model_turn", turn.body, turn.request_id)
    )
    assert store.current().release_lease(claim)
    (again,) = store.current().claim_runs("w2", 30, 1)
    assert again.run_id == run.pk
    assert again.task_payload is None  # the log has more than the task: read by load_log
