"""Long transcripts, without a database: the offline model's compaction,
context editing and caching; the history sent after a compaction; ``Agent(betas=, cache=)`` in
the request, its headers and its fingerprint. Runs go through the real runner against an
``InMemoryStore``."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from collections.abc import Iterator
from typing import Any

import httpx2
import pytest
from django.core.exceptions import ImproperlyConfigured

from durable_agents import llm
from durable_agents._internal.interrupt import Interrupt
from durable_agents.declare.agents import Agent, _canonical_json, registry
from durable_agents.engine.history import (
    Conversation,
    _row_compacts,
    assistant_message,
    load_log,
    step_message,
    user_message,
)
from durable_agents.engine.runner import Disposition, advance_run, tokens_of
from durable_agents.models import StepKind
from durable_agents.offline import (
    COMPACT_BETA,
    CONTEXT_EDITING_BETA,
    DEFAULT_SECRET,
    ScriptedModel,
    canonical_bytes,
    offline_client,
    parse_script,
    sign,
)
from durable_agents.store import InMemoryStore
from tests.testapp.compaction_agents import compaction_params, compactor
from tests.unit.conftest import claimed, start

MODEL = "claude-test-1"
THINKING = {"type": "enabled", "budget_tokens": 1024}
BETA_HEADER = {"anthropic-beta": COMPACT_BETA}
TASK = "Compact as you go.\n" + "\n".join(f'@note {{"key": "k{t}"}}' for t in range(16))
RESULT = "result " + "x" * 200


# --------------------------------------------------------------------------- helpers


def post(
    request: dict[str, Any],
    headers: dict[str, str] | None = None,
    model: ScriptedModel | None = None,
) -> tuple[int, dict[str, Any]]:
    body = json.dumps(request, ensure_ascii=False, separators=(",", ":")).encode()
    status, _, out = (model or ScriptedModel()).respond(
        "POST", "/v1/messages", BETA_HEADER if headers is None else headers, body
    )
    return status, json.loads(out)


def error_of(request: dict[str, Any], headers: dict[str, str] | None = None) -> str:
    status, out = post(request, headers)
    assert status == 400, out
    assert out["error"]["type"] == "invalid_request_error"
    return out["error"]["message"]


def request(messages: list[Any], *, pause: bool = False, trigger: int = 800, **extra: Any) -> Any:
    return {
        "model": MODEL,
        "max_tokens": 2048,
        "system": "sys",
        "thinking": THINKING,
        **compaction_params(pause, trigger),
        **extra,
        "messages": messages,
    }


def has_compaction(content: list[dict[str, Any]]) -> bool:
    return any(b["type"] == "compaction" and b.get("content") is not None for b in content)


def play(
    task: str = TASK, *, pause: bool = False, trigger: int = 800, turns: int = 60, **extra: Any
) -> tuple[list[Any], list[Any], list[Any]]:
    """Play a run as durable_agents does (each turn sent back verbatim, the request trimmed
    to the task and the turn holding the last compaction block). Returns the whole
    transcript, the answers and the requests' messages."""
    full: list[dict[str, Any]] = [{"role": "user", "content": task}]
    sent: list[dict[str, Any]] = list(full)
    answers, requests = [], []
    for _ in range(turns):
        requests.append(list(sent))
        status, answer = post(request(sent, pause=pause, trigger=trigger, **extra))
        assert status == 200, answer
        answers.append(answer)
        turn = {"role": "assistant", "content": answer["content"]}
        full.append(turn)
        sent = [sent[0], turn] if has_compaction(answer["content"]) else [*sent, turn]
        if answer["stop_reason"] == "tool_use":
            results = [
                {"type": "tool_result", "tool_use_id": b["id"], "content": RESULT}
                for b in answer["content"]
                if b["type"] == "tool_use"
            ]
            full.append({"role": "user", "content": results})
            sent.append(full[-1])
        elif answer["stop_reason"] != "compaction":
            break
    return full, answers, requests


# --------------------------------------------------------------------------- Agent(betas, cache)


def make(**options: Any) -> Agent:
    defaults: dict[str, Any] = {
        "name": "unit-compaction",
        "version": "v1",
        "model": MODEL,
        "system": "s",
        "max_tokens": 256,
        "register": False,
    }
    return Agent(**{**defaults, **options})


@pytest.mark.parametrize(
    "betas", ["compact-2026-01-12", [1], [""], ["a,b"], ["a b"], [None], {"a": 1}]
)
def test_betas_must_be_a_list_of_header_values(betas: Any) -> None:
    with pytest.raises(ImproperlyConfigured, match="beta"):
        make(betas=betas)


def test_betas_are_deduplicated_in_order_and_sent_last_in_the_request() -> None:
    agent = make(betas=["b-2", "a-1", "b-2"], params={"metadata": {"user_id": "u"}})
    assert agent.betas == ("b-2", "a-1")
    params = agent.request_params()
    assert list(params) == ["model", "max_tokens", "system", "metadata", "betas"]
    assert params["betas"] == ["b-2", "a-1"]


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"params": {"betas": ["x"]}}, "betas"),
        ({"cache": "yes"}, "cache"),
        ({"cache": True, "params": {"cache_control": {"type": "ephemeral"}}}, "cache_control"),
    ],
)
def test_betas_and_cache_are_agent_arguments(options: dict[str, Any], match: str) -> None:
    with pytest.raises(ImproperlyConfigured, match=match):
        make(**options)


def test_an_agent_without_betas_or_cache_keeps_its_fingerprint() -> None:
    # Runs started before betas and cache existed must not drift.
    agent = make()
    params = {"model": MODEL, "max_tokens": 256, "system": "s"}
    assert agent.request_params() == params
    assert agent.fingerprint() == hashlib.sha256(_canonical_json(params).encode()).hexdigest()


def test_betas_cache_and_context_management_are_pinned() -> None:
    agents = [
        make(),
        make(betas=[COMPACT_BETA]),
        make(betas=[COMPACT_BETA, "other-beta"]),
        make(cache=True),
        make(params=compaction_params(False)),
        make(params=compaction_params(True)),
        make(params=compaction_params(False, 5000)),
    ]
    assert len({agent.fingerprint() for agent in agents}) == len(agents)
    assert make(cache=True).request_params()["cache_control"] == {"type": "ephemeral"}
    assert "context_management" in make(params=compaction_params(False)).request_params()
    # A changed beta list under the same version is refused at registration.
    registry.register(make(name="unit-compaction-pinned", betas=["one"]))
    try:
        with pytest.raises(ImproperlyConfigured, match="different definitions"):
            registry.register(make(name="unit-compaction-pinned", betas=["two"]))
    finally:
        registry.unregister("unit-compaction-pinned", "v1")


class Recording(ScriptedModel):
    """The offline model, keeping each request's headers and body."""

    def __init__(self) -> None:
        super().__init__()
        self.requests: list[tuple[str | None, bytes]] = []

    def handle(self, request: httpx2.Request) -> httpx2.Response:
        self.requests.append((request.headers.get("anthropic-beta"), request.read()))
        return super().handle(request)


RECORDING = Recording()


def recording_client() -> Any:
    """CLIENT_FACTORY of the runs below: the offline model, recording."""
    return offline_client(scripted=RECORDING)


@pytest.fixture
def recording(settings: Any) -> Iterator[Recording]:
    RECORDING.requests.clear()
    settings.DURABLE_AGENTS = {
        **settings.DURABLE_AGENTS,
        "CLIENT_FACTORY": f"{__name__}.recording_client",
    }
    llm.reset_clients()
    yield RECORDING
    llm.reset_clients()


@pytest.mark.parametrize("stream", [False, True])
def test_global_then_agent_betas_in_the_header_never_in_the_body(
    settings: Any, stream: bool
) -> None:
    settings.DURABLE_AGENTS = {**settings.DURABLE_AGENTS, "BETAS": ["global-1", COMPACT_BETA]}
    agent = make(betas=[COMPACT_BETA, "agent-2"], cache=True, params=compaction_params(False))
    model = Recording()
    llm.create_turn(
        agent.request_for(),
        [{"role": "user", "content": "Hi."}],
        interrupt=Interrupt(),
        client=offline_client(scripted=model),
        stream=stream,
    )
    header, body = model.requests[0]
    assert header == f"global-1,{COMPACT_BETA},agent-2"
    sent = json.loads(body)
    assert "betas" not in sent
    assert sent["cache_control"] == {"type": "ephemeral"}
    assert sent["context_management"] == compaction_params(False)["context_management"]
    params = {k: v for k, v in agent.request_for().items() if k != "betas"}
    assert body == llm.request_body(params, b'[{"role":"user","content":"Hi."}]', stream=stream)


def test_no_betas_no_header() -> None:
    model = Recording()
    llm.create_turn(
        make().request_for(),
        [{"role": "user", "content": "Hi."}],
        interrupt=Interrupt(),
        client=offline_client(scripted=model),
    )
    assert model.requests[0][0] is None


# --------------------------------------------------------------------------- the offline model


def test_the_script_repeat_directive() -> None:
    script = parse_script('Long.\n@@repeat 3 @a {"k": 1}\n@b\n@@repeat 2 @@turn [{"name": "c"}]')
    assert [[c.name for c in calls] for calls in script.plan] == [["a"], ["a"], ["a"], ["b"]] + [
        ["c"]
    ] * 2
    for bad in ("@@repeat 0 @a", "@@repeat x @a", "@@repeat 2", "@@repeat 2 a"):
        with pytest.raises(ValueError, match="repeat"):
            parse_script(bad)


def test_sign_is_the_hmac_of_the_canonical_context() -> None:
    messages = [{"role": "user", "content": "é"}, {"role": "assistant", "content": []}]
    payload = canonical_bytes([MODEL, "sys", None, messages, "thought"])
    digest = hmac.new(DEFAULT_SECRET, payload, hashlib.sha256).digest()
    assert sign(DEFAULT_SECRET, MODEL, "sys", None, messages, "thought") == (
        base64.b64encode(digest).decode()
    )


def test_compaction_and_context_editing_need_their_betas() -> None:
    task = [{"role": "user", "content": TASK}]
    assert COMPACT_BETA in error_of(request(task), headers={})
    assert COMPACT_BETA in error_of(request(task), headers={"anthropic-beta": "other"})
    assert post(request(task), {"Anthropic-Beta": f"other, {COMPACT_BETA}"})[0] == 200
    clear = {"edits": [{"type": "clear_tool_uses_20250919"}]}
    plain = {"model": MODEL, "max_tokens": 64, "messages": task}
    assert CONTEXT_EDITING_BETA in error_of({**plain, "context_management": clear}, {})
    status, _ = post(
        {**plain, "context_management": clear}, {"anthropic-beta": CONTEXT_EDITING_BETA}
    )
    assert status == 200
    # A turn holding a compaction block cannot be sent back without the beta either.
    _, _answers, requests = play(turns=8)
    later = requests[-1]
    assert has_compaction(later[1]["content"])
    assert COMPACT_BETA in error_of({**plain, "messages": later}, headers={})


@pytest.mark.parametrize(
    ("context_management", "fragment"),
    [
        (
            {
                "edits": [
                    {"type": "compact_20260112", "trigger": {"type": "input_tokens", "value": 99}}
                ]
            },
            "at least 100",
        ),
        ({"edits": [{"type": "compact_20260112", "trigger": {"value": 5000}}]}, "trigger"),
        ({"edits": [{"type": "compact_20260112", "pause_after_compaction": "yes"}]}, "pause"),
        ({"edits": [{"type": "compact_20260112"}, {"type": "compact_20260112"}]}, "only one"),
        ({"edits": [{"type": "compact_2099"}]}, "unknown"),
        ({"edits": "all"}, "list"),
        (
            {"edits": [{"type": "clear_tool_uses_20250919"}, {"type": "clear_thinking_20251015"}]},
            "first",
        ),
    ],
)
def test_context_management_is_checked(context_management: Any, fragment: str) -> None:
    headers = {"anthropic-beta": f"{COMPACT_BETA},{CONTEXT_EDITING_BETA}"}
    message = error_of(
        {
            "model": MODEL,
            "max_tokens": 64,
            "context_management": context_management,
            "messages": [{"role": "user", "content": "x"}],
        },
        headers,
    )
    assert fragment in message


@pytest.mark.parametrize(
    "cache_control", [{"type": "persistent"}, "ephemeral", {"type": "ephemeral", "ttl": "2h"}]
)
def test_cache_control_is_checked(cache_control: Any) -> None:
    message = error_of(
        {
            "model": MODEL,
            "max_tokens": 64,
            "cache_control": cache_control,
            "messages": [{"role": "user", "content": "x"}],
        }
    )
    assert message.startswith("cache_control")


def test_the_default_trigger_does_not_fire_on_a_short_run() -> None:
    edit = {"edits": [{"type": "compact_20260112"}]}
    _, answers, _ = play(context_management=edit)
    assert answers[-1]["stop_reason"] == "end_turn"
    assert not any(has_compaction(a["content"]) for a in answers)


def test_compaction_fires_over_the_trigger_and_the_run_goes_on() -> None:
    full, answers, requests = play()
    assert answers[-1]["stop_reason"] == "end_turn"
    assert answers[-1]["offline_script"] == {"turn": 16, "plan_lines": 16}
    compacted = [a for a in answers if has_compaction(a["content"])]
    assert len(compacted) >= 3
    for answer in compacted:
        block = answer["content"][0]
        assert list(block) == ["type", "content", "encrypted_content"]
        assert [b["type"] for b in answer["content"]] == [
            "compaction",
            "thinking",
            "text",
            "tool_use",
        ]
        usage = answer["usage"]
        compaction_pass, message_pass = usage["iterations"]
        assert compaction_pass["type"] == "compaction"
        assert message_pass["type"] == "message"
        # The top-level figures are the message pass alone.
        assert {k: usage[k] for k in message_pass if k != "type"} == {
            k: v for k, v in message_pass.items() if k != "type"
        }
        assert compaction_pass["input_tokens"] >= 800
        assert tokens_of(answer) > sum(
            usage[k]
            for k in (
                "input_tokens",
                "cache_creation_input_tokens",
                "cache_read_input_tokens",
                "output_tokens",
            )
        )
    # The whole transcript, sent untrimmed, gets the same answer: the model drops what
    # precedes the last compaction block (only the request id differs).
    status, whole = post(request(full[:-1]))
    assert status == 200
    assert whole["content"] == answers[-1]["content"]
    assert whole["usage"] == answers[-1]["usage"]
    assert len(json.dumps(full[:-1])) > 2 * len(json.dumps(requests[-1]))


def test_pause_after_compaction_returns_the_block_alone_and_the_turn_continues() -> None:
    _full, answers, requests = play(pause=True)
    assert answers[-1]["stop_reason"] == "end_turn"
    assert answers[-1]["offline_script"]["turn"] == 16
    paused = [n for n, a in enumerate(answers) if a["stop_reason"] == "compaction"]
    assert len(paused) >= 3
    for n in paused:
        answer, after = answers[n], answers[n + 1]
        assert [b["type"] for b in answer["content"]] == ["compaction"]
        assert [i["type"] for i in answer["usage"]["iterations"]] == ["compaction"]
        assert answer["usage"]["input_tokens"] == answer["usage"]["output_tokens"] == 0
        assert tokens_of(answer) > 0
        # The next request ends with the paused turn; the answer is the same turn, going on.
        assert requests[n + 1][-1] == {"role": "assistant", "content": answer["content"]}
        assert after["offline_script"]["turn"] == answer["offline_script"]["turn"]
        assert after["stop_reason"] == "tool_use"


def test_the_compaction_block_and_what_follows_are_checked_what_precedes_is_not() -> None:
    full, _answers, _ = play()
    last = max(
        i for i, m in enumerate(full) if m["role"] == "assistant" and has_compaction(m["content"])
    )
    history = full[:-1]  # the last request, untrimmed
    assert post(request(history))[0] == 200

    def changed(where: int, block: int, key: str, value: Any) -> list[Any]:
        copy = json.loads(json.dumps(history))
        copy[where]["content"][block][key] = value
        return copy

    # Before the last compaction block: dropped by the model, so never checked.
    earlier = next(i for i in range(1, last) if full[i]["role"] == "assistant")
    assert post(request(changed(earlier, 0, "thinking", "rewritten")))[0] == 200
    edited_task = [{"role": "user", "content": "Another task."}, *history[1:]]
    assert post(request(edited_task))[0] == 200
    # The compaction block itself, and every thinking block after it, must come back verbatim.
    assert "Invalid compaction block" in error_of(request(changed(last, 0, "content", "short")))
    assert "Invalid compaction block" in error_of(
        request(changed(last, 0, "encrypted_content", None))
    )
    signature = "Invalid `signature` in `thinking` block"
    assert f"messages.{last}.content.1: {signature}" in error_of(
        request(changed(last, 1, "thinking", "rewritten"))
    )
    later = max(i for i, m in enumerate(history) if m["role"] == "assistant")
    if later != last:
        assert signature in error_of(request(changed(later, 0, "thinking", "rewritten")))
    # Another model did not write this summary.
    assert "Invalid compaction block" in error_of({**request(history), "model": "claude-test-2"})


def test_a_failed_compaction_block_is_a_no_op() -> None:
    full, answers, _ = play(turns=3, trigger=50_000)
    history = json.loads(json.dumps(full[:-2]))  # the request of the last answer
    # At the end of the last turn (an edit anywhere before it would break a signature).
    history[-2]["content"].append({"type": "compaction", "content": None})
    status, answer = post(request(history, trigger=50_000))
    assert status == 200
    # Not a cut: the same turn of the same script (only the signature, over the changed
    # history, differs).
    assert (
        answer["offline_script"]
        == answers[-1]["offline_script"]
        == {
            "turn": 2,
            "plan_lines": 16,
        }
    )
    assert answer["content"][1:] == answers[-1]["content"][1:]
    assert answer["usage"]["input_tokens"] > answers[-1]["usage"]["input_tokens"]


def test_automatic_caching_reads_the_previous_calls_prefix() -> None:
    _, answers, _ = play(cache_control={"type": "ephemeral"})
    first, second = answers[0]["usage"], answers[1]["usage"]
    assert first["cache_read_input_tokens"] == 0
    assert first["cache_creation_input_tokens"] > 0
    assert second["cache_read_input_tokens"] >= first["cache_creation_input_tokens"] - 1
    assert second["cache_creation_input_tokens"] > 0
    for n, answer in enumerate(answers[:-1]):
        if has_compaction(answer["content"]):
            # The compacted context is new: nothing of it was cached.
            assert answer["usage"]["iterations"][1]["cache_read_input_tokens"] == 0
            assert answers[n + 1]["usage"]["cache_read_input_tokens"] == 0
            assert answers[n + 2]["usage"]["cache_read_input_tokens"] > 0
    # Without cache_control nothing is cached.
    _, plain, _ = play(turns=2)
    assert plain[1]["usage"]["cache_read_input_tokens"] == 0


def sse_events(chunks: Iterator[bytes]) -> list[dict[str, Any]]:
    text = b"".join(chunks).decode()
    return [
        json.loads(line[len("data: ") :]) for line in text.splitlines() if line.startswith("data: ")
    ]


@pytest.mark.parametrize("pause", [False, True])
def test_a_streamed_compaction_turn_assembles_into_the_plain_one(pause: bool) -> None:
    _, answers, requests = play(pause=pause)
    n = next(n for n, a in enumerate(answers) if has_compaction(a["content"]))
    messages = requests[n]
    plain = answers[n]
    body = json.dumps(
        {**request(messages, pause=pause), "stream": True}, separators=(",", ":")
    ).encode()
    status, _, chunks = ScriptedModel().respond_stream("POST", "/v1/messages", BETA_HEADER, body)
    assert status == 200
    events = sse_events(chunks)
    start = next(e for e in events if e["type"] == "content_block_start")
    assert start["index"] == 0
    assert start["content_block"] == {
        "type": "compaction",
        "content": None,
        "encrypted_content": None,
    }
    deltas = [e for e in events if e["type"] == "content_block_delta" and e["index"] == 0]
    assert [d["delta"] for d in deltas] == [
        {
            "type": "compaction_delta",
            "content": plain["content"][0]["content"],
            "encrypted_content": plain["content"][0]["encrypted_content"],
        }
    ]
    assert {"type": "content_block_stop", "index": 0} in events
    # durable_agents' stream assembly gives the plain answer back, key order included.
    params = {k: v for k, v in request(messages, pause=pause).items() if k != "messages"}
    turn = llm.create_turn(
        {**params, "betas": [COMPACT_BETA]},
        messages,
        interrupt=Interrupt(),
        client=offline_client(),
        stream=True,
    )
    # (The streamed request's body has "stream": true: another id, a few more input tokens.)
    assert list(turn.message) == list(plain)
    assert {k: v for k, v in turn.message.items() if k not in ("id", "usage")} == {
        k: v for k, v in plain.items() if k not in ("id", "usage")
    }
    assert json.dumps(turn.message["content"]) == json.dumps(plain["content"])
    assert list(turn.message["usage"]) == list(plain["usage"])
    assert turn.message["usage"]["iterations"][0] == plain["usage"]["iterations"][0] | {
        "input_tokens": turn.message["usage"]["iterations"][0]["input_tokens"]
    }
    assert turn.message["stop_reason"] == ("compaction" if pause else "tool_use")


# --------------------------------------------------------------------------- the history


def turn_text(content: list[dict[str, Any]], **extra: Any) -> tuple[str, tuple[int, int]]:
    """A provider body holding ``content`` (with spaces, as the offline model writes it)."""
    body = json.dumps({"id": "msg", "content": content, "usage": extra})
    start = body.index("[")
    return body, (start, start + len(json.dumps(content)))


COMPACTION = {"type": "compaction", "content": "summary", "encrypted_content": "x"}


def test_the_request_starts_at_the_task_and_the_last_compaction() -> None:
    task = user_message(json.dumps("the task"))
    turns = [
        turn_text([{"type": "text", "text": "one"}]),
        turn_text([COMPACTION, {"type": "text", "text": "two"}]),
        turn_text([{"type": "text", "text": "three"}]),
        turn_text([COMPACTION, {"type": "text", "text": "four"}]),
        turn_text([{"type": "text", "text": "five"}]),
    ]
    results = [user_message(json.dumps([{"type": "text", "text": f"r{n}"}])) for n in range(5)]
    trimmed, whole = Conversation(trim=True), Conversation()
    expected: list[bytes] = [task]
    for conversation in (trimmed, whole):
        conversation.append(task)
    for (body, span), result in zip(turns, results, strict=True):
        message = assistant_message(body, span)
        if b"compaction" in message:
            expected = [task]
        expected += [message, result]
        for conversation in (trimmed, whole):
            conversation.append(message)
            conversation.append(result)
        # Byte for byte the stored text, cut at its span: never re-encoded.
        assert trimmed.json() == b"[" + b",".join(expected) + b"]"
    assert len(trimmed) == len(whole) == 11
    assert trimmed.json().startswith(b'[{"role":"user","content":"the task"},{"role":"assistant"')
    assert [m["content"][-1]["text"] for m in trimmed.messages()[1::2]] == ["four", "five"]
    assert len(whole.messages()) == 11


def test_a_rebuilt_chunk_is_trimmed_too() -> None:
    task, result = user_message('"the task \\u00e9 \u00e9"'), user_message('"ok"')
    one = assistant_message(*turn_text([{"type": "text", "text": "one"}]))
    conversation = Conversation(b",".join([task, one, result]), 3, trim=True)
    compacted = assistant_message(*turn_text([COMPACTION]))
    conversation.append(compacted)
    assert conversation.json() == b"[" + task + b"," + compacted + b"]"
    assert len(conversation) == 4


@pytest.mark.parametrize(
    ("content", "cuts"),
    [
        ([COMPACTION], True),
        ([{"type": "text", "text": 'the "compaction" word'}], False),
        ([{"type": "text", "text": "x"}, {"type": "compaction", "content": None}], False),
        (
            [
                {
                    "type": "tool_use",
                    "id": "t",
                    "name": "compaction",
                    "input": {"type": "compaction"},
                }
            ],
            False,
        ),
    ],
)
def test_what_counts_as_a_compaction(content: list[Any], cuts: bool) -> None:
    body, span = turn_text(content, iterations=[{"type": "compaction", "input_tokens": 1}])
    assert _row_compacts(body, *span) is cuts
    assert _row_compacts(body, None, None) is cuts  # stored before spans were recorded
    trimmed = Conversation(trim=True)
    for message in (user_message('"t"'), assistant_message(*turn_text([])), user_message('"r"')):
        trimmed.append(message)
    trimmed.append(assistant_message(body, span))
    assert len(trimmed.messages()) == (2 if cuts else 4)


# --------------------------------------------------------------------------- runs


@pytest.fixture
def store() -> InMemoryStore:
    return InMemoryStore()


def advance(store: InMemoryStore, run_id: Any) -> Disposition:
    return advance_run(claimed(store, run_id), store=store)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("pause", [False, True])
def test_a_run_compacts_again_and_again_and_each_request_starts_at_the_last_compaction(
    store: InMemoryStore, recording: Recording, pause: bool, stream: bool
) -> None:
    agent = compactor("unit-compactor", pause=pause, stream=stream, register=False)
    registry.register(agent)
    try:
        run_id = start(store, agent, TASK)
        assert advance(store, run_id) is Disposition.SUCCEEDED
    finally:
        registry.unregister(agent.name, agent.version)
    run = store.run(run_id)
    steps = store.steps_of(run_id)
    turns = [json.loads(s.payload) for s in steps if s.kind == StepKind.MODEL_TURN]
    compacted = [t for t in turns if has_compaction(t["content"])]
    assert len(compacted) >= 3
    assert (turns[-1]["stop_reason"], turns[-1]["offline_script"]["turn"]) == ("end_turn", 16)
    assert sum(t["stop_reason"] == "compaction" for t in turns) == (len(compacted) if pause else 0)
    assert run.tokens_used == sum(tokens_of(t) for t in turns)

    # Each request: the task, then (once there is one) the turn holding the last compaction
    # block and every step after it, each the stored text.
    params = {k: v for k, v in agent.request_for(run.model).items() if k != "betas"}
    assert len(recording.requests) == len(turns)
    conversation = Conversation(trim=True)
    model_turns = 0
    for step in steps:
        if step.kind == StepKind.MODEL_TURN:
            header, body = recording.requests[model_turns]
            assert header == COMPACT_BETA
            assert body == llm.request_body(params, conversation.json(), stream=stream)
            model_turns += 1
        conversation.append(step_message(step.kind, step.payload, step.content_span))
    last_request = json.loads(recording.requests[-1][1])["messages"]
    assert last_request[0] == {"role": "user", "content": TASK}
    assert last_request[1]["content"] == compacted[-1]["content"]

    # The rebuild of a claim sends the same bytes; the transcript keeps everything.
    rebuilt = load_log(run_id, store=store)
    assert rebuilt.conversation.json() == conversation.json()
    assert len(rebuilt.conversation) == len(steps)
    whole = load_log(run_id, store=store, trim=False).conversation.messages()
    assert len(whole) == len(steps)
    assert [m["content"] for m in whole if m["role"] == "assistant"] == [
        t["content"] for t in turns
    ]
