"""The offline scripted model, driven through the real anthropic SDK (no mocks of our code).

No database: the module must not need Django at all.
"""

from __future__ import annotations

import copy
import json
import re
import time
from typing import Any

import anthropic
import pytest
from anthropic.types import MessageParam

from durable_agents.offline import (
    DEFAULT_SECRET,
    RETIRED_MODELS,
    OfflineServer,
    ScriptedModel,
    dumps_deep,
    final_directive,
    loads_deep,
    offline_client,
    sign,
    turn_directive,
)

MODEL = "claude-sonnet-4-6"
PHRASE = "Invalid `signature` in `thinking` block"
THINKING = {"type": "enabled", "budget_tokens": 1024}
TASK = (
    "Migrate the orders table.\n"
    '@get_schema {"table": "orders"}\n'
    '@get_schema {"table": "orders"} && set_status {"ticket": "T-1", "status": "done"}\n'
    '@drop_table {"table": "orders_old"}\n'
)
TOOLS = [
    {
        "name": "get_schema",
        "description": "Read a table's schema.",
        "input_schema": {"type": "object", "properties": {"table": {"type": "string"}}},
    },
    {
        "name": "set_status",
        "description": "Set a ticket's status.",
        "input_schema": {"type": "object", "properties": {"ticket": {"type": "string"}}},
    },
]


@pytest.fixture
def client() -> anthropic.Anthropic:
    return offline_client(max_retries=0)


def call(client: anthropic.Anthropic, messages: list[Any], **params: Any) -> Any:
    params.setdefault("model", MODEL)
    params.setdefault("max_tokens", 2048)
    return client.messages.with_raw_response.create(messages=messages, **params)


def tool_results(content: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {"type": "tool_result", "tool_use_id": b["id"], "content": f"ok {b['name']}"}
        for b in content
        if b["type"] == "tool_use"
    ]


def run_turns(
    client: anthropic.Anthropic, task: str, turns: int, **params: Any
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Play ``turns`` model turns, sending back the raw content verbatim as a durable store
    would. Returns (messages ready for the next request, parsed raw bodies)."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": task}]
    bodies = []
    for _ in range(turns):
        body = json.loads(call(client, messages, **params).http_response.text)
        bodies.append(body)
        messages.append({"role": "assistant", "content": body["content"]})
        if body["stop_reason"] != "tool_use":
            break
        messages.append({"role": "user", "content": tool_results(body["content"])})
    return messages, bodies


def expect_400(client: anthropic.Anthropic, messages: list[Any], **params: Any) -> Any:
    with pytest.raises(anthropic.BadRequestError) as info:
        call(client, messages, **params)
    e = info.value
    assert e.status_code == 400
    assert e.type == "invalid_request_error"
    assert re.fullmatch(r"req_offline_[0-9a-f]{24}", e.request_id or "")
    return e


# --- the script -------------------------------------------------------------------------


def test_three_planned_turns_then_end_turn(client: anthropic.Anthropic) -> None:
    messages, bodies = run_turns(client, TASK, 10, tools=TOOLS)

    assert [b["stop_reason"] for b in bodies] == ["tool_use"] * 3 + ["end_turn"]
    assert [b["offline_script"] for b in bodies] == [{"turn": k, "plan_lines": 3} for k in range(4)]
    names = [[c["name"] for c in b["content"] if c["type"] == "tool_use"] for b in bodies]
    assert names == [["get_schema"], ["get_schema", "set_status"], ["drop_table"], []]
    assert bodies[1]["content"][0] == {
        "type": "text",
        "text": "Step 2: calling get_schema, set_status.",
    }
    assert bodies[1]["content"][2]["input"] == {"ticket": "T-1", "status": "done"}
    assert bodies[3]["content"] == [{"type": "text", "text": "Done. 3 planned turns completed."}]
    ids = [c["id"] for b in bodies for c in b["content"] if c["type"] == "tool_use"]
    assert len(set(ids)) == 4
    assert all(re.fullmatch(r"toolu_[0-9a-f]{24}", i) for i in ids)
    assert len(messages) == 8


def test_no_plan_lines_answers_with_the_first_line(client: anthropic.Anthropic) -> None:
    raw = call(client, [{"role": "user", "content": "\nWhat is the capital of France?\nThanks"}])
    body = json.loads(raw.http_response.text)
    assert body["stop_reason"] == "end_turn"
    assert body["offline_script"] == {"turn": 0, "plan_lines": 0}
    assert "What is the capital of France?" in body["content"][0]["text"]


def test_stop_on_error_ends_the_run_at_an_error_result(client: anthropic.Anthropic) -> None:
    task = 'Pay, then record.\n@@stop_on_error\n@pay {"cents": 5}\n@record {}'
    first = json.loads(call(client, [{"role": "user", "content": task}]).http_response.text)
    use = first["content"][1]  # after the text block
    history: list[Any] = [
        {"role": "user", "content": task},
        {"role": "assistant", "content": first["content"]},
    ]
    failed = {"type": "tool_result", "tool_use_id": use["id"], "content": "card declined"}
    stopped = json.loads(
        call(
            client, [*history, {"role": "user", "content": [{**failed, "is_error": True}]}]
        ).http_response.text
    )
    assert stopped["stop_reason"] == "end_turn"
    assert stopped["content"] == [
        {"type": "text", "text": "Stopped: a tool call failed: card declined"}
    ]
    # The same turn with the result no longer an error (a fork with an edited result): the
    # plan goes on.
    going_on = json.loads(
        call(client, [*history, {"role": "user", "content": [failed]}]).http_response.text
    )
    assert going_on["stop_reason"] == "tool_use"
    assert going_on["content"][1]["name"] == "record"


def test_task_from_text_blocks_of_the_first_message(client: anthropic.Anthropic) -> None:
    content = [{"type": "text", "text": "Do it."}, {"type": "text", "text": "@ping {}"}]
    body = json.loads(call(client, [{"role": "user", "content": content}]).http_response.text)
    assert body["stop_reason"] == "tool_use"
    assert body["content"][1]["name"] == "ping"


def test_unknown_tool_and_malformed_arguments_emitted_as_written(
    client: anthropic.Anthropic,
) -> None:
    task = (
        "Misbehave.\n"
        "@no_such_tool {not json && get_schema [1, 2]\n"
        '@get_schema "just a string" && set_status {"ticket": "a && b"}\n'
    )
    _messages, bodies = run_turns(client, task, 2, tools=TOOLS)
    uses = [[c for c in b["content"] if c["type"] == "tool_use"] for b in bodies]
    assert [(u["name"], u["input"]) for u in uses[0]] == [
        ("no_such_tool", {"_raw": "{not json"}),
        ("get_schema", [1, 2]),
    ]
    assert [(u["name"], u["input"]) for u in uses[1]] == [
        ("get_schema", "just a string"),
        ("set_status", {"ticket": "a && b"}),
    ]


def test_latency_directive_sleeps_and_is_not_a_plan_line(client: anthropic.Anthropic) -> None:
    task = "Slow.\n@@latency 0.25\n@ping\n"
    started = time.monotonic()
    body = json.loads(call(client, [{"role": "user", "content": task}]).http_response.text)
    assert time.monotonic() - started >= 0.2
    assert body["offline_script"] == {"turn": 0, "plan_lines": 1}
    assert body["content"][1]["name"] == "ping"
    assert body["content"][1]["input"] == {}


def test_unknown_directive_is_rejected(client: anthropic.Anthropic) -> None:
    e = expect_400(client, [{"role": "user", "content": "x\n@@speed 3"}])
    assert "@@speed" in (e.api_message or "")


# --- determinism and the raw body -------------------------------------------------------


def test_same_request_same_bytes_and_request_id(client: anthropic.Anthropic) -> None:
    messages, _ = run_turns(client, TASK, 1, tools=TOOLS, thinking=THINKING)
    a = call(client, messages, tools=TOOLS, thinking=THINKING)
    b = call(offline_client(), messages, tools=TOOLS, thinking=THINKING)  # a fresh model
    assert a.http_response.content == b.http_response.content
    assert a.request_id == b.request_id
    assert re.fullmatch(r"req_offline_[0-9a-f]{24}", a.request_id or "")

    other = call(client, messages, tools=TOOLS, thinking=THINKING, max_tokens=4096)
    assert other.request_id != a.request_id


def test_raw_body_key_order_and_extra_field(client: anthropic.Anthropic) -> None:
    raw = call(client, [{"role": "user", "content": TASK}], thinking=THINKING)
    assert raw.http_response.headers["content-type"] == "application/json"
    body = json.loads(raw.http_response.text)
    assert list(body) == [
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
    assert list(body["usage"]) == [
        "input_tokens",
        "cache_creation_input_tokens",
        "cache_read_input_tokens",
        "output_tokens",
        "service_tier",
    ]
    assert re.fullmatch(r"msg_offline_[0-9a-f]{24}", body["id"])
    assert [c["type"] for c in body["content"]] == ["thinking", "text", "tool_use"]
    assert list(body["content"][2]) == ["type", "id", "name", "input"]
    assert '"offline_script": {"turn": 0, "plan_lines": 3}' in raw.http_response.text
    # The SDK still parses it; the extra field is what only the raw text keeps in order.
    message = raw.parse()
    assert message.stop_reason == "tool_use"
    assert message.content[0].type == "thinking"


# --- thinking signatures ----------------------------------------------------------------


def test_signature_is_sign_over_the_request(client: anthropic.Anthropic) -> None:
    messages = [{"role": "user", "content": TASK}]
    body = json.loads(
        call(client, messages, system="Be careful.", thinking=THINKING).http_response.text
    )
    block = body["content"][0]
    expected = sign(DEFAULT_SECRET, MODEL, "Be careful.", None, messages, block["thinking"])
    assert block["signature"] == expected
    assert sign(b"another secret", MODEL, "Be careful.", None, messages, block["thinking"]) != (
        expected
    )


def test_verbatim_history_with_thinking_is_accepted(client: anthropic.Anthropic) -> None:
    system = [{"type": "text", "text": "You migrate databases."}]
    messages, bodies = run_turns(client, TASK, 10, tools=TOOLS, system=system, thinking=THINKING)
    assert [b["stop_reason"] for b in bodies][-1] == "end_turn"
    assert all(b["content"][0]["type"] == "thinking" for b in bodies)
    # The full history, three signed assistant turns and the final one, is accepted again.
    messages.append({"role": "user", "content": "Anything else?"})
    assert call(client, messages, tools=TOOLS, system=system, thinking=THINKING).http_response


def test_other_secret_rejects_the_history(client: anthropic.Anthropic) -> None:
    messages, _ = run_turns(client, TASK, 1, thinking=THINKING)
    other = offline_client(scripted=ScriptedModel(secret=b"someone else"), max_retries=0)
    e = expect_400(other, messages, thinking=THINKING)
    assert e.api_message == f"messages.1.content.0: {PHRASE}"


def _reverse_keys(block: dict[str, Any]) -> dict[str, Any]:
    return dict(reversed(list(block.items())))


def _edit_thinking(messages: list[Any]) -> None:
    messages[1]["content"][0]["thinking"] += " "


def _drop_signature(messages: list[Any]) -> None:
    del messages[1]["content"][0]["signature"]


def _reorder_tool_use(messages: list[Any]) -> None:
    content = messages[1]["content"]
    content[2] = _reverse_keys(content[2])  # same values, other key order


@pytest.mark.parametrize(
    ("mutate", "where"),
    [
        (_edit_thinking, "messages.1.content.0"),
        (_drop_signature, "messages.1.content.0"),
        # The reordered tool_use is in message 1; the first signature covering it is message 3's.
        (_reorder_tool_use, "messages.3.content.0"),
    ],
)
def test_changed_history_is_rejected(client: anthropic.Anthropic, mutate: Any, where: str) -> None:
    messages, _ = run_turns(client, TASK, 2, tools=TOOLS, thinking=THINKING)
    call(client, messages, tools=TOOLS, thinking=THINKING)  # control: verbatim is accepted
    changed = copy.deepcopy(messages)
    mutate(changed)
    assert changed != messages or list(changed[1]["content"][2]) != list(messages[1]["content"][2])
    e = expect_400(client, changed, tools=TOOLS, thinking=THINKING)
    assert e.api_message == f"{where}: {PHRASE}"


@pytest.mark.parametrize(
    "change",
    [
        {"system": "Be reckless."},
        {"tools": [TOOLS[0], {**TOOLS[1], "description": "Set a ticket's status!"}]},
        {"tools": [TOOLS[0], _reverse_keys(TOOLS[1])]},
        {"model": "claude-opus-4-5"},
    ],
    ids=["system", "tool-definition", "tool-key-order", "model"],
)
def test_changed_context_is_rejected(client: anthropic.Anthropic, change: dict[str, Any]) -> None:
    params = {"system": "Be careful.", "tools": TOOLS, "thinking": THINKING}
    messages, _ = run_turns(client, TASK, 1, **params)
    call(client, messages, **params)  # control: the unchanged context is accepted
    e = expect_400(client, messages, **{**params, **change})
    assert e.api_message == f"messages.1.content.0: {PHRASE}"


def test_redacted_thinking_is_not_checked(client: anthropic.Anthropic) -> None:
    messages, _ = run_turns(client, TASK, 1)
    messages[1]["content"].insert(0, {"type": "redacted_thinking", "data": "opaque"})
    assert call(client, messages).http_response.status_code == 200


# --- errors -----------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:The model .* is deprecated:DeprecationWarning")
@pytest.mark.parametrize("model", [*sorted(RETIRED_MODELS), "gpt-4o"])
def test_retired_or_unknown_model_is_404(client: anthropic.Anthropic, model: str) -> None:
    with pytest.raises(anthropic.NotFoundError) as info:
        call(client, [{"role": "user", "content": "hi"}], model=model)
    e = info.value
    assert e.status_code == 404
    assert e.type == "not_found_error"  # APIStatusError.type is body["error"]["type"]
    assert e.api_message == f"model: {model}"
    assert e.body == {
        "type": "error",
        "error": {"type": "not_found_error", "message": f"model: {model}"},
        "request_id": e.request_id,
    }


def test_tool_use_without_tool_result_is_400(client: anthropic.Anthropic) -> None:
    messages, _ = run_turns(client, TASK, 2)
    # Turn 2 called two tools; answer only the first one.
    messages[-1]["content"] = messages[-1]["content"][:1]
    e = expect_400(client, messages)
    assert (e.api_message or "").startswith("messages.4: `tool_use` ids were found without")


def test_tool_result_for_unknown_id_is_400(client: anthropic.Anthropic) -> None:
    messages, _ = run_turns(client, TASK, 1)
    messages[-1]["content"].append(
        {"type": "tool_result", "tool_use_id": "toolu_nope", "content": "?"}
    )
    e = expect_400(client, messages)
    assert "messages.2.content.1: unexpected `tool_use_id`" in (e.api_message or "")
    assert "toolu_nope" in (e.api_message or "")


def test_roles_must_alternate_from_user(client: anthropic.Anthropic) -> None:
    e = expect_400(client, [{"role": "assistant", "content": "hi"}])
    assert (e.api_message or "").startswith("messages.0.role")
    e = expect_400(client, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    assert (e.api_message or "").startswith("messages.1.role")


def test_a_streamed_answer_assembles_into_the_plain_one(client: anthropic.Anthropic) -> None:
    request: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 512,
        "thinking": {"type": "enabled", "budget_tokens": 256},
        "messages": [{"role": "user", "content": 'Go.\n@lookup {"key": "k", "n": [1, 2]}'}],
    }
    plain = client.messages.create(**request)
    with client.messages.stream(**request) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start"
    assert kinds[-1] == "message_stop"
    assert "content_block_delta" in kinds
    assert [b.to_dict() for b in final.content] == [b.to_dict() for b in plain.content]
    assert final.stop_reason == plain.stop_reason == "tool_use"
    assert final.usage.output_tokens == plain.usage.output_tokens


def test_other_endpoints_are_404(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as info:
        client.models.list()
    assert info.value.type == "not_found_error"


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        (b"{not json", "not valid JSON"),
        (b'{"max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}', "model"),
        (b'{"model": "claude-x", "messages": [{"role": "user", "content": "x"}]}', "max_tokens"),
        (b'{"model": "claude-x", "max_tokens": 5, "messages": []}', "messages"),
    ],
)
def test_malformed_request_is_400_with_error_shape(body: bytes, fragment: str) -> None:
    status, headers, out = ScriptedModel().respond("POST", "/v1/messages", {}, body)
    assert status == 400
    assert headers["content-type"] == "application/json"
    error = json.loads(out)
    assert list(error) == ["type", "error", "request_id"]
    assert error["type"] == "error"
    assert error["error"]["type"] == "invalid_request_error"
    assert fragment in error["error"]["message"]
    assert error["request_id"] == headers["request-id"]


# --- behind a real HTTP server ----------------------------------------------------------


def test_real_http_server_gives_the_same_bytes(client: anthropic.Anthropic) -> None:
    messages = [{"role": "user", "content": TASK}]
    in_process = call(client, messages, tools=TOOLS, thinking=THINKING)
    with OfflineServer() as server:
        remote = anthropic.Anthropic(api_key="x", base_url=server.base_url, max_retries=0)
        try:
            over_http = call(remote, messages, tools=TOOLS, thinking=THINKING)
            with pytest.raises(anthropic.NotFoundError):
                call(remote, messages, model="gpt-4o")
        finally:
            remote.close()
    assert over_http.http_response.content == in_process.http_response.content
    assert over_http.request_id == in_process.request_id


# --- hostile turns: @@turn, @@final, any depth (the fuzz suite) -----------------------


def respond_raw(task: str, messages: list[Any] | None = None, **params: Any) -> tuple[int, bytes]:
    """One answer of the model as bytes, without the SDK (which would recurse on deep JSON)."""
    request = {"model": MODEL, "max_tokens": 64, **params}
    request["messages"] = messages or [{"role": "user", "content": task}]
    status, _, out = ScriptedModel().respond(
        "POST", "/v1/messages", {}, dumps_deep(request).encode()
    )
    return status, out


def deep_list(depth: int, leaf: Any) -> Any:
    value = leaf
    for _ in range(depth):
        value = [value]
    return value


def test_turn_directive_plays_any_name_and_input_as_valid_utf8_json(
    client: anthropic.Anthropic,
) -> None:
    calls = [("get\x00schema", {"table": "a\ud800b"}), ("\udfff", [1, "x"]), ("", "str")]
    task = "Be hostile.\n" + turn_directive(calls) + "\n@get_schema {}"
    assert task.isascii()  # escapes only: the task itself is plain text
    raw = call(client, [{"role": "user", "content": task}], tools=TOOLS).http_response.content
    text = raw.decode("utf-8")  # valid UTF-8: the lone surrogate is the escape \ud800
    assert "\\ud800" in text
    assert "\\u0000" in text
    first = json.loads(text)
    uses = [c for c in first["content"] if c["type"] == "tool_use"]
    assert [(u["name"], u["input"]) for u in uses] == calls
    # The next turn plays the @ line after it (the SDK cannot encode a lone surrogate in a
    # request, so the hostile history goes back as bytes).
    results = [{"type": "tool_result", "tool_use_id": u["id"], "content": "ok"} for u in uses]
    messages = [
        {"role": "user", "content": task},
        {"role": "assistant", "content": first["content"]},
        {"role": "user", "content": results},
    ]
    status, out = respond_raw(task, messages, tools=TOOLS)
    assert status == 200
    second = json.loads(out)
    assert [c["name"] for c in second["content"] if c["type"] == "tool_use"] == ["get_schema"]


def test_final_directive_sets_the_final_text(client: anthropic.Anthropic) -> None:
    task = "Finish.\n" + final_directive("first") + "\n" + final_directive("end \x00 \ud800 done")
    body = json.loads(call(client, [{"role": "user", "content": task}]).http_response.text)
    assert body["stop_reason"] == "end_turn"
    assert body["content"] == [{"type": "text", "text": "end \x00 \ud800 done"}]  # the last wins


@pytest.mark.parametrize(
    ("line", "fragment"),
    [
        ("@@turn not json", "@@turn (plan line 0) needs a JSON array"),
        ("@@turn []", "non-empty JSON array"),
        ('@@turn [{"input": {}}]', "string `name`"),
        ("@@final 42", "@@final needs a JSON string"),
        ("@@final", "@@final needs a JSON string"),
    ],
)
def test_malformed_directives_are_400(
    client: anthropic.Anthropic, line: str, fragment: str
) -> None:
    e = expect_400(client, [{"role": "user", "content": f"Bad.\n{line}"}])
    assert fragment in e.message


def test_inputs_deeper_than_the_recursion_limit() -> None:
    deep = deep_list(3000, "\ud800")
    task = "Deep.\n" + turn_directive([("get_schema", {"v": deep})]) + "\n@get_schema [[[1]]]"
    status, out = respond_raw(task)
    assert status == 200
    first = loads_deep(out.decode("utf-8"))
    use = next(c for c in first["content"] if c["type"] == "tool_use")
    assert dumps_deep(use["input"]) == dumps_deep({"v": deep})
    # The turn goes back verbatim in the next request (with thinking: signed and checked).
    messages = [
        {"role": "user", "content": task},
        {"role": "assistant", "content": first["content"]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"]}]},
    ]
    status, out = respond_raw(task, messages)
    assert status == 200
    assert loads_deep(out)["offline_script"] == {"turn": 1, "plan_lines": 2}


def test_deep_plan_line_and_signed_deep_history() -> None:
    deep = deep_list(2000, 0)
    task = "Deep.\n@get_schema " + dumps_deep({"v": deep}, separators=(",", ":"))
    status, out = respond_raw(task, thinking=THINKING)
    assert status == 200
    first = loads_deep(out)
    use = first["content"][-1]
    messages = [
        {"role": "user", "content": task},
        {"role": "assistant", "content": first["content"]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"]}]},
    ]
    status, out = respond_raw(task, messages, thinking=THINKING)
    assert status == 200, out[:300]
    assert loads_deep(out)["stop_reason"] == "end_turn"


@pytest.mark.parametrize(
    "value",
    [
        {"a": [1, 2.5, None, True, False, "x\x00\ud800\U0001f600"], "": {}},
        [[], {}, "", -0.0, 10**30, 1e-7],
        "\udfff",
    ],
)
def test_loads_deep_and_dumps_deep_agree_with_json(value: Any) -> None:
    assert dumps_deep(value) == json.dumps(value)
    assert loads_deep(dumps_deep(value)) == value
    deep = deep_list(5000, value)
    text = dumps_deep(deep)
    assert text.isascii()
    assert text == "[" * 5000 + json.dumps(value) + "]" * 5000
    assert dumps_deep(loads_deep(text)) == text
    assert dumps_deep({"b": 1, "a": deep_list(3000, 2)}, sort_keys=True).startswith('{"a": [')


@pytest.mark.parametrize(
    "text", ["[1,]", '{"a" 1}', "[1] x", '{"a": [1, 2}', "", '"\\ud800', "[" * 2000]
)
def test_loads_deep_rejects_what_json_rejects(text: str) -> None:
    with pytest.raises(json.JSONDecodeError):
        loads_deep(text)


def test_a_streamed_hostile_answer_is_valid_utf8(client: anthropic.Anthropic) -> None:
    task = "Stream.\n" + turn_directive([("n\ud800", {"t": "\x00\udfff"})]) + "\n"
    task += final_directive("\ud800")
    messages: list[MessageParam] = [{"role": "user", "content": task}]
    with client.messages.with_streaming_response.create(
        model=MODEL, max_tokens=64, messages=messages, stream=True
    ) as response:
        raw = b"".join(response.http_response.iter_bytes())
    text = raw.decode("utf-8")
    assert "n\\ud800" in text
    assert "message_stop" in text
