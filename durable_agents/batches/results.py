"""A batch's results, one line at a time: which request it answers, and the answer as the text
the API sent.

A line is ``{"custom_id": ..., "result": {"type": "succeeded", "message": {...}}}`` (or
``errored`` with an ``error``, ``expired``, ``canceled``). The ``message`` value is cut out of
the line as it is (``llm.body.member_spans``), never decoded and encoded again: the run sends it
back byte for byte with its next request, as it does a direct call's answer.

A line that cannot be read (not UTF-8, not JSON, a raw NUL, no ``custom_id`` of ours, a
``message`` that is not a Messages API message) is a ``Problem``: the poller logs it, and the
request it may have answered, getting no result, is sent again when the batch ends.
"""

from __future__ import annotations

import dataclasses
import json
import time

from durable_agents._internal.deepjson import loads_deep
from durable_agents._internal.text import storable_text
from durable_agents.engine.runner import tokens_of
from durable_agents.exceptions import ModelError
from durable_agents.flow.pricing import usage_of
from durable_agents.llm.body import member_spans, read_turn
from durable_agents.store.batches import Answer

RESULT_KINDS = frozenset({"succeeded", "errored", "expired", "canceled"})


@dataclasses.dataclass(frozen=True)
class Problem:
    """A line that was not used, and why."""

    reason: str
    custom_id: str | None = None


def _request_id(custom_id: object) -> int | None:
    """The request row a ``custom_id`` names (its id, in decimal), or None: not one of ours."""
    if isinstance(custom_id, str) and custom_id.isdigit() and len(custom_id) <= 18:
        return int(custom_id)
    return None


def read_line(raw: bytes, batch_id: str) -> Answer | Problem:
    """One line of a batch's results as an ``Answer`` for its request, or a ``Problem``."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return Problem(f"a results line is not UTF-8: {exc}")
    spans = member_spans(line)
    if spans is None or "custom_id" not in spans or "result" not in spans:
        return Problem(f"a results line is not a result: {storable_text(line, 200)!r}")
    try:
        custom_id = json.loads(line[slice(*spans["custom_id"])])
    except ValueError:
        return Problem("a results line has an unreadable custom_id")
    request_id = _request_id(custom_id)
    if request_id is None:
        return Problem(f"a result for a custom_id that is not ours: {custom_id!r}", str(custom_id))
    result_start = spans["result"][0]
    result = member_spans(line, result_start)
    if result is None or "type" not in result:
        return Problem("a result without a type", custom_id)
    try:
        kind = json.loads(line[slice(*result["type"])])
    except ValueError:
        return Problem("a result with an unreadable type", custom_id)
    if kind not in RESULT_KINDS:
        return Problem(f"a result of an unknown type {kind!r}", custom_id)
    if kind == "succeeded":
        return _succeeded(line, result, request_id, custom_id, batch_id)
    if kind == "errored":
        return _errored(line, result, request_id, custom_id)
    return Answer(request_id=request_id, kind=kind)


def _succeeded(
    line: str, result: dict[str, tuple[int, int]], request_id: int, custom_id: str, batch_id: str
) -> Answer | Problem:
    if "message" not in result:
        return Problem("a succeeded result without a message", custom_id)
    body = line[slice(*result["message"])]
    try:
        turn = read_turn(body, f"{batch_id}/{custom_id}", time.monotonic())
    except (ValueError, ModelError) as exc:
        return Problem(f"the message of a succeeded result is unusable: {exc}", custom_id)
    return Answer(
        request_id=request_id,
        kind="succeeded",
        body=body,
        content_span=turn.content_span,
        tokens=tokens_of(turn.message),
        usage=usage_of(turn.message),
    )


def _errored(
    line: str, result: dict[str, tuple[int, int]], request_id: int, custom_id: str
) -> Answer:
    """An errored result: ``{"type": "errored", "error": {"type": "error", "error": {"type":
    ..., "message": ...}}}`` (the API's error body); anything else reads as an API error."""
    error_type, message = "api_error", "an errored result without an error"
    if "error" in result:
        try:
            error = loads_deep(line[slice(*result["error"])])
        except ValueError:
            error = None
        inner = error.get("error") if isinstance(error, dict) else None
        if isinstance(inner, dict):
            error_type = str(inner.get("type") or error_type)
            message = str(inner.get("message") or "")
        elif isinstance(error, dict) and error.get("type"):
            error_type = str(error.get("type"))
            message = str(error.get("message") or "")
    return Answer(
        request_id=request_id,
        kind="errored",
        error_type=storable_text(error_type, 100),
        error=storable_text(message, 2000),
    )
