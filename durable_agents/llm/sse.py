"""Streamed calls: one turn assembled from the server-sent events.

The turn is built from the raw events, keeping every field the server sent (the SDK's
accumulator drops extras on deltas), and is returned only once ``message_stop`` has arrived:
a stream cut short raises, the call is retried, and no partial turn is ever committed. An
interrupted call's stream is closed at its next event, so the model stops generating.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import anthropic
import httpx2

from durable_agents.llm.client import (
    MESSAGES_PATH,
    Answer,
    rate_limit_headers,
    sends_raw_bodies,
)
from durable_agents.llm.errors import (
    ModelCallInterrupted,
    PermanentModelError,
    TransientModelError,
)

logger = logging.getLogger("durable_agents.llm")


@contextlib.contextmanager
def _event_stream(
    client: anthropic.Anthropic, body: bytes, extra_headers: dict[str, str]
) -> Iterator[tuple[httpx2.Response, str | None]]:
    if not sends_raw_bodies(client):
        params = json.loads(body)
        with client.messages.with_streaming_response.create(
            **params, extra_headers=extra_headers or None
        ) as streaming:
            yield streaming.http_response, streaming.request_id
        return
    # With cast_to=httpx2.Response the SDK hands back the response unread (stream=True).
    response: Any = client.post(
        MESSAGES_PATH,
        cast_to=httpx2.Response,
        content=body,
        options={"headers": extra_headers} if extra_headers else {},
        stream=True,
        stream_cls=anthropic.Stream[object],
    )
    if isinstance(response, anthropic.Stream):
        response = response.response
    try:
        yield response, response.headers.get("request-id")
    finally:
        response.close()


def stream_message(
    client: anthropic.Anthropic,
    body: bytes,
    extra_headers: dict[str, str],
    abort: threading.Event,
    on_text: Callable[[str], None] | None,
) -> Answer:
    """Stream one turn and assemble it from the raw events, keeping every field the server sent
    (the SDK's accumulator drops extras on deltas). Nothing is returned unless message_stop
    arrived: a cut stream raises and the caller retries; no partial turn is ever committed."""
    with _event_stream(client, body, extra_headers) as (http_response, request_id):
        message: dict[str, Any] | None = None
        partial_json: dict[int, str] = {}
        for event in anthropic.Stream.raw_events(http_response):
            if abort.is_set():
                raise ModelCallInterrupted("stream closed: the run was interrupted")
            if not event.data:
                continue
            data = json.loads(event.data)
            kind = data.get("type") or event.event
            if kind == "message_start":
                message = data["message"]
            elif kind == "content_block_start":
                assert message is not None
                message["content"].append(data["content_block"])
            elif kind == "content_block_delta":
                assert message is not None
                _apply_delta(
                    message["content"][data["index"]],
                    data["index"],
                    data["delta"],
                    partial_json,
                    on_text,
                )
            elif kind == "content_block_stop":
                assert message is not None
                _close_block(message, data["index"], partial_json)
            elif kind == "message_delta":
                assert message is not None
                _apply_message_delta(message, data)
            elif kind == "message_stop":
                if message is None:
                    raise TransientModelError("stream ended without message_start")
                return (
                    json.dumps(message, ensure_ascii=False),
                    request_id,
                    rate_limit_headers(http_response.headers),
                )
            elif kind == "error":
                _raise_error_event(data)
        raise TransientModelError("the stream ended before message_stop; nothing was committed")


def _close_block(message: dict[str, Any], index: int, partial_json: dict[int, str]) -> None:
    """A content block ended: a tool call's input, streamed as JSON text, is parsed now."""
    if index in partial_json:
        text = partial_json.pop(index)
        message["content"][index]["input"] = json.loads(text) if text else {}


def _apply_message_delta(message: dict[str, Any], data: dict[str, Any]) -> None:
    """The final delta: the stop reason and the like, the usage, and any top-level extras."""
    for key, value in (data.get("delta") or {}).items():
        message[key] = value
    if "usage" in data:
        message.setdefault("usage", {}).update(data["usage"])
    for key, value in data.items():
        # Top-level extras of the final delta, such as the context_management
        # (applied_edits) of context editing: part of the message as sent.
        if key not in ("type", "delta", "usage"):
            message[key] = value


def _raise_error_event(data: dict[str, Any]) -> NoReturn:
    """An error event in the stream: transient (overloaded, api, rate limit) or not."""
    error = data.get("error") or {}
    text = f"{error.get('type', 'error')}: {error.get('message', '')}"
    if error.get("type") in ("overloaded_error", "api_error", "rate_limit_error"):
        raise TransientModelError(f"error event in the stream: {text}")
    raise PermanentModelError(f"error event in the stream: {text}")


def _apply_delta(
    block: dict[str, Any],
    index: int,
    delta: dict[str, Any],
    partial_json: dict[int, str],
    on_text: Callable[[str], None] | None,
) -> None:
    kind = delta.get("type")
    if kind == "text_delta":
        block["text"] = block.get("text", "") + delta["text"]
        logger.debug("partial text: %r", delta["text"])
        if on_text is not None:
            try:
                on_text(delta["text"])
            except Exception:  # a UI callback must not break the turn
                logger.exception("on_text callback failed")
    elif kind == "thinking_delta":
        block["thinking"] = block.get("thinking", "") + delta["thinking"]
    elif kind == "signature_delta":
        block["signature"] = delta["signature"]  # replaces, never appends
    elif kind == "input_json_delta":
        partial_json[index] = partial_json.get(index, "") + delta["partial_json"]
    elif kind == "citations_delta":
        block.setdefault("citations", []).append(delta["citation"])
    elif kind == "compaction_delta":
        # The whole summary (and its opaque state) in one delta, replacing the nulls of the
        # compaction block's content_block_start: fields the start had keep their place.
        for key, value in delta.items():
            if key != "type":
                block[key] = value
    else:
        # An unknown delta: keep its fields rather than lose them.
        for key, value in delta.items():
            if key != "type":
                block[key] = value
