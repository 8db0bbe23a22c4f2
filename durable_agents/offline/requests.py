"""A request read and checked as the real API checks it: the body's fields, the roles and tool
results of the messages, the thinking signatures and automatic prompt caching. Every refusal is
the 400 the API would send (``invalid``)."""

from __future__ import annotations

import hmac
from typing import Any

from durable_agents._internal.deepjson import loads_deep
from durable_agents.offline.compaction import View
from durable_agents.offline.signatures import SIGNATURE_ERROR, Signer, canonical_bytes, sign
from durable_agents.offline.wire import blocks_of, compaction_only, invalid


def parse_body(body: bytes, streamed: bool = False) -> dict[str, Any]:
    try:
        req = loads_deep(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise invalid(f"request body is not valid JSON: {e}") from None
    if not isinstance(req, dict):
        raise invalid("request body must be a JSON object")
    if not isinstance(req.get("model"), str):
        raise invalid("model: Field required (a string)")
    max_tokens = req.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise invalid("max_tokens: Field required (a positive integer)")
    if not isinstance(req.get("messages"), list) or not req["messages"]:
        raise invalid("messages: Field required (a non-empty list)")
    if req.get("stream") and not streamed:
        raise invalid("stream: use respond_stream for streamed requests")
    return req


def check_structure(messages: list[Any]) -> None:
    """What the API checks of the messages: each an object of blocks, the roles alternating
    from ``user`` to a last ``user`` turn, and every tool call answered in the next message."""
    for i, m in enumerate(messages):
        _check_blocks(i, m)
        _check_role(i, m, messages)
    last = messages[-1]
    if last["role"] != "user" and not compaction_only(last["content"]):
        # The script keys on the number of assistant turns; a prefill would skew it.
        raise invalid(
            f"messages.{len(messages) - 1}: the last message must have role `user` "
            "(the offline model does not support prefill)"
        )
    _check_tool_results(messages)


def _check_blocks(i: int, m: Any) -> None:
    """Message ``i`` is an object whose content is a string or a list of typed blocks."""
    if not isinstance(m, dict):
        raise invalid(f"messages.{i}: must be an object")
    content = m.get("content")
    if not isinstance(content, str | list):
        raise invalid(f"messages.{i}.content: must be a string or a list of blocks")
    for j, b in enumerate(blocks_of(content)):
        if not isinstance(b, dict) or not isinstance(b.get("type"), str):
            raise invalid(f"messages.{i}.content.{j}: must be a block with a `type`")


def _check_role(i: int, m: dict[str, Any], messages: list[Any]) -> None:
    """Message ``i`` has the role that alternation asks for after the one before it."""
    expected = "user" if i % 2 == 0 else "assistant"
    if i and messages[i - 1].get("role") == "assistant":
        expected = "user"
        if compaction_only(messages[i - 1].get("content")):
            # A turn paused after its compaction is continued by the next turn.
            expected = "assistant" if m.get("role") == "assistant" else "user"
    elif i:
        expected = "assistant"
    if m.get("role") != expected:
        raise invalid(
            f"messages.{i}.role: roles must alternate between `user` and `assistant`, "
            f"starting with `user`; expected `{expected}`, got {m.get('role')!r}"
        )


def _check_tool_results(messages: list[Any]) -> None:
    """Every ``tool_use`` of an assistant message has its ``tool_result`` in the next message,
    and no ``tool_result`` answers a call that was not made there."""
    previous_ids: list[str] = []
    for i, m in enumerate(messages):
        blocks = blocks_of(m["content"])
        if m["role"] == "assistant":
            previous_ids = [b.get("id") for b in blocks if b["type"] == "tool_use"]
            continue
        answered: set[str] = set()
        other_before: int | None = None
        for j, b in enumerate(blocks):
            if b["type"] != "tool_result":
                other_before = j if other_before is None else other_before
                continue
            if other_before is not None:
                raise invalid(
                    f"messages.{i}.content.{j}: `tool_result` blocks must come first in the "
                    f"content of a user message; block {other_before} is not one"
                )
            ref = b.get("tool_use_id")
            if ref not in previous_ids:
                raise invalid(
                    f"messages.{i}.content.{j}: unexpected `tool_use_id` found in "
                    f"`tool_result` blocks: {ref}. Each `tool_result` block must have a "
                    "corresponding `tool_use` block in the previous message."
                )
            answered.add(ref)
        missing = [t for t in previous_ids if t not in answered]
        if missing:
            raise invalid(
                f"messages.{i}: `tool_use` ids were found without `tool_result` blocks "
                f"immediately after: {', '.join(map(str, missing))}. Each `tool_use` block "
                "must have a corresponding `tool_result` block in the next message."
            )
        previous_ids = []


def check_signatures(
    secret: bytes, model: str, system: Any, tools: Any, view: View
) -> tuple[Signer, list[bytes]]:
    """Check every thinking block the model reads (from the last compaction block on).
    Returns the signer over all of them (for the answer's own thinking block) and each
    message's canonical bytes."""
    signer = Signer(secret, model, system, tools)
    parts: list[bytes] = []
    for i, m in enumerate(view.messages):
        if m["role"] == "assistant":
            for j, b in enumerate(blocks_of(m["content"])):
                if b["type"] != "thinking":
                    continue  # redacted_thinking is opaque and left unchecked
                if i == 0 and view.cut is not None:
                    # After the compaction block of its own turn: signed over the blocks
                    # before it in that turn (the compaction block) alone.
                    head = {**m, "content": m["content"][:j]}
                    expected = sign(secret, model, system, tools, [head], b["thinking"])
                else:
                    expected = signer.sign(b.get("thinking"))
                given = b.get("signature")
                if not isinstance(given, str) or not hmac.compare_digest(given, expected):
                    # Where the block is in the request (the view may start mid-turn).
                    at, block = i, j
                    if view.cut is not None:
                        at += view.cut[0]
                        block += view.cut[1] if i == 0 else 0
                    raise invalid(f"messages.{at}.content.{block}: {SIGNATURE_ERROR}")
        part = canonical_bytes(m)
        parts.append(part)
        signer.add(part)
    return signer, parts


def cache_control(value: Any) -> bool:
    """Whether the request asks for automatic prompt caching (checked as the API does)."""
    if value is None:
        return False
    if (
        not isinstance(value, dict)
        or value.get("type") != "ephemeral"
        or value.get("ttl", "5m") not in ("5m", "1h")
        or set(value) - {"type", "ttl"}
    ):
        raise invalid('cache_control: must be {"type": "ephemeral"} (with an optional "ttl")')
    return True


def check_output_config(value: Any) -> None:
    """``output_config`` checked as the API checks its shape: an object whose ``format``, if
    given, is ``{"type": "json_schema", "schema": {...}}`` (structured outputs). The offline
    model plays the script's text whatever the format, so that a test can script an answer
    that does not match and see what the runtime does with it."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise invalid("output_config: must be an object")
    fmt = value.get("format")
    if fmt is None:
        return
    if (
        not isinstance(fmt, dict)
        or fmt.get("type") != "json_schema"
        or not isinstance(fmt.get("schema"), dict)
        or set(fmt) - {"type", "schema"}
    ):
        raise invalid('output_config.format: must be {"type": "json_schema", "schema": {...}}')
