"""The request body sent, and the answer read back.

The request body is built here as JSON text: the pinned parameters, then the run's messages
exactly as history.Conversation keeps them. The SDK would otherwise walk and re-serialise the
whole history on every call, which grows with the run. An answer becomes a ``ModelTurn`` only
if it is a usable Messages API message; where its ``content`` lies in the body is found by a
scan of the top level, so the history can reuse the stored text without re-encoding it.
"""

from __future__ import annotations

import json
import json.scanner
import time
from typing import Any

from durable_agents._internal.deepjson import loads_deep, value_end
from durable_agents._internal.text import storable_text
from durable_agents.llm.errors import ModelTurn, PermanentModelError

# typeshed types the context as a make_scanner; the C scanner takes any JSONDecoder.
_scan_once = json.scanner.make_scanner(json.JSONDecoder())  # type: ignore[arg-type]


def request_body(params: dict[str, Any], messages: bytes, *, stream: bool = False) -> bytes:
    """The JSON body of a Messages API call: the pinned ``params``, then ``messages`` (a JSON
    array, as sent before: never re-serialised here)."""
    members = json.dumps(params, ensure_ascii=False, separators=(",", ":"))[1:-1].encode()
    if stream:
        members += b',"stream":true' if members else b'"stream":true'
    # One copy of the (possibly large) messages text.
    return b"".join((b"{", members, b"," if members else b"", b'"messages":', messages, b"}"))


def content_span(body: str) -> tuple[int, int] | None:
    """Where the value of the top-level ``content`` key lies in ``body``, a JSON object, as
    character offsets; None if it has none. Scans the top level only (each value once, by the
    C scanner); with duplicate keys the last wins, as for ``json.loads``."""
    spans = member_spans(body)
    return None if spans is None else spans.get("content")


def member_spans(body: str, start: int = 0) -> dict[str, tuple[int, int]] | None:
    """Where the value of each member of the JSON object at ``start`` in ``body`` lies, as
    character offsets (with duplicate keys the last wins, as for ``json.loads``); None when
    there is no well-formed object there. Scans that object's level only."""
    # json.decoder.scanstring (the C one, or Python's) is not in typeshed.
    scan, scanstring, size = _scan_once, json.decoder.scanstring, len(body)  # type: ignore[attr-defined]

    def skip(i: int) -> int:
        while i < size and body[i] in " \t\n\r":
            i += 1
        return i

    spans: dict[str, tuple[int, int]] = {}
    try:
        i = skip(start)
        if body[i : i + 1] != "{":
            return None
        i = skip(i + 1)
        while body[i : i + 1] == '"':
            key, i = scanstring(body, i + 1)
            i = skip(i)
            if body[i : i + 1] != ":":
                return None
            i = skip(i + 1)
            try:
                end = scan(body, i)[1]
            except RecursionError:  # nested past the C scanner's limit
                end = value_end(body, i)
            spans[key] = (i, end)
            i = skip(end)
            if body[i : i + 1] != ",":
                break
            i = skip(i + 1)
        if body[i : i + 1] != "}":
            return None
        return spans
    except (ValueError, StopIteration):
        return None


def read_turn(
    text: str,
    request_id: str | None,
    started: float,
    rate_headers: dict[str, str] | None = None,
) -> ModelTurn:
    """The answer as a ModelTurn. Raises ValueError for a body that is not JSON (a proxy's
    error page: worth a retry) and PermanentModelError for JSON that is not a message: asking
    again would pay for another answer that cannot be used, so the run ends at once."""
    where = f" (request id {request_id})" if request_id else ""
    # At any depth: a tool input nested past Python's recursion limit is the model's mistake,
    # which it is told about like any invalid input (runner), not a reason to end the run.
    message = loads_deep(text)
    problem = _not_a_turn(message)
    if problem:
        raise PermanentModelError(
            f"the model's answer{where} is not a Messages API message: {problem}; it was not stored"
        )
    return ModelTurn(
        body=text,
        request_id=None if request_id is None else storable_text(request_id)[:200],
        message=message,
        elapsed_ms=(time.monotonic() - started) * 1000,
        content_span=content_span(text),
        rate_headers=rate_headers or {},
    )


def _not_a_turn(message: Any) -> str:
    """What makes ``message`` unusable as a model turn, or "" (unknown fields and block types
    are fine: they are stored and sent back as received)."""
    if not isinstance(message, dict):
        return f"a JSON {type(message).__name__}, not an object"
    content = message.get("content")
    if not isinstance(content, list):
        return "its content is not a list"
    for block in content:
        if not isinstance(block, dict):
            return "a content block is not an object"
        if block.get("type") == "tool_use" and not isinstance(block.get("id"), str):
            return "a tool_use block has no string id"
    stop_reason = message.get("stop_reason")
    if stop_reason is not None and not isinstance(stop_reason, str):
        return "its stop_reason is not a string"
    return ""
