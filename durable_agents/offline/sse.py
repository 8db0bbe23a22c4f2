"""A message as the streaming API sends it: server-sent events that assemble into exactly the
message the plain answer would have been."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from durable_agents.offline.wire import json_bytes


def _chunks(text: str, size: int = 12) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)] or [""]


def _sse(event: str, data: dict[str, Any]) -> bytes:
    return b"event: %s\ndata: %s\n\n" % (event.encode(), json_bytes(data, (", ", ": ")))


def sse_events(payload: dict[str, Any], chunk_latency: float) -> Iterator[bytes]:
    """The message as the streaming API sends it: start, blocks as deltas, delta, stop."""
    start = {key: value for key, value in payload.items()}
    start["content"] = []
    start["stop_reason"] = None
    start["usage"] = {**payload["usage"], "output_tokens": 1}
    events: list[bytes] = [
        _sse("message_start", {"type": "message_start", "message": start}),
        _sse("ping", {"type": "ping"}),
    ]
    for index, block in enumerate(payload["content"]):
        kind = block["type"]
        opening: dict[str, Any]
        if kind == "thinking":
            opening = {"type": "thinking", "thinking": "", "signature": ""}
            deltas = [
                {"type": "thinking_delta", "thinking": part} for part in _chunks(block["thinking"])
            ]
            deltas.append({"type": "signature_delta", "signature": block["signature"]})
        elif kind == "text":
            opening = {"type": "text", "text": ""}
            deltas = [{"type": "text_delta", "text": part} for part in _chunks(block["text"])]
        elif kind == "compaction":
            # As the API streams it: a block of nulls, then one delta with the whole summary.
            opening = {key: (value if key == "type" else None) for key, value in block.items()}
            deltas = [
                {"type": "compaction_delta", **{k: v for k, v in block.items() if k != "type"}}
            ]
        else:  # tool_use
            opening = {key: ({} if key == "input" else value) for key, value in block.items()}
            deltas = [
                {"type": "input_json_delta", "partial_json": part}
                for part in _chunks(json_bytes(block["input"]).decode("utf-8"), 16)
            ]
        events.append(
            _sse(
                "content_block_start",
                {"type": "content_block_start", "index": index, "content_block": opening},
            )
        )
        events.extend(
            _sse(
                "content_block_delta",
                {"type": "content_block_delta", "index": index, "delta": delta},
            )
            for delta in deltas
        )
        events.append(_sse("content_block_stop", {"type": "content_block_stop", "index": index}))
    events.append(
        _sse(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": payload["stop_reason"], "stop_sequence": None},
                "usage": {
                    key: value
                    for key, value in payload["usage"].items()
                    if key in ("output_tokens", "iterations")
                },
            },
        )
    )
    events.append(_sse("message_stop", {"type": "message_stop"}))
    for number, event in enumerate(events):
        if chunk_latency and number:
            time.sleep(chunk_latency)
        yield event
