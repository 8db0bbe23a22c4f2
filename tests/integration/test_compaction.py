"""Long transcripts end to end: runs of agents with server-side compaction,
thinking and automatic caching, through an in-process worker, the real SDK over HTTP and the
offline model behind ``FakeAnthropic``, which checks every thinking signature it reads and
drops what precedes the last compaction block, as the API does.

The agents are in ``tests/testapp/compaction_agents.py`` (trigger: 800 input tokens, so the
16-turn script below compacts several times).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from durable_agents import llm
from durable_agents.api import messages_for, start_run
from durable_agents.declare.agents import Agent, registry
from durable_agents.engine.history import Conversation, step_message
from durable_agents.engine.runner import tokens_of
from durable_agents.models import AgentRun, StepKind
from tests.conftest import own_steps, run_worker
from tests.fakeserver import FakeAnthropic, api_error
from tests.testapp.compaction_agents import COMPACT_BETA, COMPACTORS, compaction_params, compactor

pytestmark = pytest.mark.django_db(transaction=True)

TASK = "Read the notes, compacting as you go.\n" + "\n".join(
    f'@note {{"key": "n{t}"}}' for t in range(16)
)
TOP_LEVEL = (
    "input_tokens",
    "cache_creation_input_tokens",
    "cache_read_input_tokens",
    "output_tokens",
)


def compacts(content: Any) -> bool:
    return any(b.get("type") == "compaction" and b.get("content") for b in content)


def body_params(agent: Agent, model: str) -> dict[str, Any]:
    """The request parameters as sent in the body (the betas go in the header)."""
    return {k: v for k, v in agent.request_for(model).items() if k != "betas"}


def sse_data(chunks: Iterator[bytes]) -> list[dict[str, Any]]:
    text = b"".join(chunks).decode()
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]


@pytest.mark.parametrize(
    ("pause", "stream"),
    [(False, False), (True, False), (False, True), (True, True)],
    ids=["whole", "paused", "streamed", "paused-streamed"],
)
def test_a_run_compacts_several_times_and_each_request_starts_at_the_compaction(
    fake_api: FakeAnthropic, pause: bool, stream: bool
) -> None:
    agent = COMPACTORS[(pause, stream)]
    run = start_run(agent.name, TASK)
    run_worker()
    run = AgentRun.objects.get(pk=run.pk)
    assert (run.status, run.error) == ("succeeded", "")

    steps = own_steps(run)
    turns = [(s, json.loads(s.payload)) for s in steps if s.kind == StepKind.MODEL_TURN]
    compaction_turns = [(s, t) for s, t in turns if compacts(t["content"])]
    assert len(compaction_turns) >= 3
    assert turns[-1][1]["stop_reason"] == "end_turn"
    assert turns[-1][1]["offline_script"] == {"turn": 16, "plan_lines": 16}
    assert sum(t["stop_reason"] == "compaction" for _, t in turns) == (
        len(compaction_turns) if pause else 0
    )
    assert run.result == "Done. 16 planned turns completed."

    # Every request: the betas header, and exactly the task followed by the stored turn
    # holding the last compaction block and every step after it, byte for byte.
    requests = fake_api.ok_requests()
    assert len(requests) == len(turns)
    assert {r.headers.get("anthropic-beta") for r in requests} == {COMPACT_BETA}
    params = body_params(agent, run.model)
    conversation = Conversation(trim=True)
    sent = 0
    for step in steps:
        if step.kind == StepKind.MODEL_TURN:
            assert requests[sent].body == llm.request_body(
                params, conversation.json(), stream=stream
            )
            sent += 1
        conversation.append(step_message(step.kind, step.payload, step.content_span))
    for recorded in requests:
        messages = recorded.json()["messages"]
        assert messages[0] == {"role": "user", "content": TASK}
    for step, _ in compaction_turns:
        # The request after a compaction turn starts with the task and that turn, as stored.
        span = step.content_span
        assert span is not None
        start, end = span
        opening = (
            f'"messages":[{{"role":"user","content":{json.dumps(TASK)}}},'
            f'{{"role":"assistant","content":{step.payload[start:end]}}}'
        ).encode()
        assert any(opening in r.body for r in requests), step.seq

    # Compaction turns are stored verbatim: the bytes the API sent (JSON), or the turn
    # assembled from its events with the summary block exactly as streamed.
    for step, turn in compaction_turns:
        recorded = requests[[s.seq for s, _ in turns].index(step.seq)]
        if not stream:
            status, _, body = fake_api.model.respond(
                "POST", "/v1/messages", recorded.headers, recorded.body
            )
            assert status == 200
            assert step.payload == body.decode()
        else:
            _, _, chunks = fake_api.model.respond_stream(
                "POST", "/v1/messages", recorded.headers, recorded.body
            )
            events = sse_data(chunks)
            delta = next(
                e["delta"]
                for e in events
                if e["type"] == "content_block_delta" and e["delta"]["type"] == "compaction_delta"
            )
            block = turn["content"][0]
            assert list(block) == ["type", "content", "encrypted_content"]
            assert block == {
                "type": "compaction",
                **{k: v for k, v in delta.items() if k != "type"},
            }
        assert list(turn["usage"])[-1] == "iterations"

    # Tokens: each turn's usage, its compaction pass included (top-level figures leave it out).
    assert run.tokens_used == sum(tokens_of(t) for _, t in turns)
    top_level = sum(int(t["usage"][k]) for _, t in turns for k in TOP_LEVEL)
    assert run.tokens_used > top_level
    # Caching: later calls read the prefix of the call before.
    assert any(t["usage"]["cache_read_input_tokens"] > 0 for _, t in turns)

    # The transcript is the whole log; only requests are trimmed.
    transcript = messages_for(run.pk)
    assert len(transcript) == len(steps)
    assert [m["content"] for m in transcript if m["role"] == "assistant"] == [
        t["content"] for _, t in turns
    ]
    assert max(len(r.body) for r in requests) * 2 < len(json.dumps(transcript))


def test_global_betas_go_first_then_the_agents(fake_api: FakeAnthropic, da_settings: Any) -> None:
    da_settings(BETAS=["global-beta-1", COMPACT_BETA])
    run = start_run(COMPACTORS[(False, False)].name, TASK)
    run_worker()
    assert AgentRun.objects.get(pk=run.pk).status == "succeeded"
    assert {r.headers.get("anthropic-beta") for r in fake_api.ok_requests()} == {
        f"global-beta-1,{COMPACT_BETA}"
    }


def test_a_rebuilt_claim_sends_the_same_trimmed_bytes(
    fake_api: FakeAnthropic, da_settings: Any
) -> None:
    # The model fails once right after a compaction; the run is handed back, claimed again,
    # and the conversation is rebuilt from the log (load_log): the request must be the one
    # that failed, byte for byte, starting at the compaction.
    # No retry within the claim, and no wait before the next claim (a 529 whose retries ran
    # out hands the run back to wait as long as the next retry would have).
    da_settings(MODEL_RETRIES=0, MAX_BACKOFF_SECONDS=0)
    agent = COMPACTORS[(False, False)]
    armed = {"done": False}

    def fail_after_first_compaction(body: dict[str, Any]) -> None:
        messages = body["messages"]
        if not armed["done"] and len(messages) > 2 and compacts(messages[1]["content"]):
            armed["done"] = True
            fake_api.fail_next(api_error(529, "overloaded_error", "Overloaded"))

    fake_api.before_answer = fail_after_first_compaction
    run = start_run(agent.name, TASK)
    run_worker()
    run = AgentRun.objects.get(pk=run.pk)
    assert run.status == "succeeded", run.error
    assert run.attempt >= 2
    failed = [n for n, r in enumerate(fake_api.requests) if r.status == 529]
    assert len(failed) == 1
    retried = fake_api.requests[failed[0] + 1]
    assert retried.status == 200
    assert retried.body == fake_api.requests[failed[0]].body
    assert compacts(retried.json()["messages"][1]["content"])


@pytest.fixture
def swap_agent() -> Iterator[Any]:
    """Replace a registered agent by another definition under the same name and version
    (a deploy that changed it without a new version); the original comes back afterwards."""
    swapped: list[Agent] = []

    def swap(original: Agent, changed: Agent) -> None:
        registry.unregister(original.name, original.version)
        registry.register(changed)
        swapped.append(original)

    yield swap
    for original in swapped:
        registry.unregister(original.name, original.version)
        registry.register(original)


@pytest.mark.parametrize(
    "change",
    [
        {"betas": [COMPACT_BETA, "another-beta"]},
        {"betas": []},
        {"cache": False},
        {"params": compaction_params(False, 5000)},
    ],
    ids=["more-betas", "no-betas", "no-cache", "other-trigger"],
)
def test_changed_betas_cache_or_context_management_is_prompt_drift(
    fake_api: FakeAnthropic, swap_agent: Any, change: dict[str, Any]
) -> None:
    original = COMPACTORS[(False, False)]
    run = start_run(original.name, TASK)
    changed = compactor(original.name, pause=False, stream=False, register=False, **change)
    assert changed.fingerprint() != original.fingerprint()
    swap_agent(original, changed)
    run_worker()
    run = AgentRun.objects.get(pk=run.pk)
    assert (run.status, run.waiting_for) == ("waiting", "worker")
    assert "changed without a new version" in run.error
    assert fake_api.requests == []
