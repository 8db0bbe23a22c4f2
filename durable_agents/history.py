"""The conversation of a run, rebuilt from its step log exactly as it was sent before.

The messages are kept as JSON text, never re-serialised: a model turn contributes the
provider's own ``content`` text, cut out of the stored body at the span recorded when it was
committed; the task and tool results contribute their stored payload. So the request body of a
resumed call is byte for byte the body of the call that was interrupted (thinking signatures
bind values *and* key order), and no turn is parsed or serialised again to be sent: at step 2,000
only the bytes copied and sent have grown. Nothing here normalises, strips or merges anything.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

from durable_agents.deepjson import loads_deep
from durable_agents.models import StepKind
from durable_agents.store import Store, current

_USER_OPEN = '{"role":"user","content":'
_ASSISTANT_OPEN = '{"role":"assistant","content":'
_MODEL_TURN = StepKind.MODEL_TURN.value  # a plain str compares faster than the enum member


def message_text(kind: str, payload: str, start: int | None = None, end: int | None = None) -> str:
    """The JSON text of the message a step contributes. A task or tool_result payload is the
    content that was sent; a model turn contributes the content text of the provider's body,
    as received, cut at its span (``start``, ``end``)."""
    if kind != _MODEL_TURN:
        return _USER_OPEN + payload + "}"
    if start is None:
        # A body stored before spans were recorded (or without a content key): parsed once.
        content = loads_deep(payload).get("content", [])
        return (
            _ASSISTANT_OPEN + json.dumps(content, ensure_ascii=False, separators=(",", ":")) + "}"
        )
    return _ASSISTANT_OPEN + payload[start:end] + "}"


def step_message(kind: str, payload: str, span: tuple[int, int] | None = None) -> bytes:
    return message_text(kind, payload, *(span or ())).encode("utf-8")


def user_message(payload: str) -> bytes:
    return step_message(StepKind.TOOL_RESULT, payload)


def assistant_message(body: str, span: tuple[int, int] | None) -> bytes:
    return step_message(StepKind.MODEL_TURN, body, span)


class Conversation:
    """The ``messages`` array of a run's next request, as JSON text that only grows.

    Appending copies only the new message; ``json()`` copies the array once per call.
    """

    def __init__(self, chunk: bytes = b"", count: int = 0) -> None:
        # Comma-separated messages: ``chunk`` holds ``count`` of them already (a rebuild).
        self.buffer = bytearray(chunk)
        self.count = count

    def append(self, message: bytes) -> None:
        if self.count:
            self.buffer += b","
        self.buffer += message
        self.count += 1

    def json(self) -> bytes:
        return b"".join((b"[", self.buffer, b"]"))

    def messages(self) -> list[dict[str, Any]]:
        """Parsed, for reading (the API, tests); requests are built from ``json()``."""
        return loads_deep(self.json())

    def __len__(self) -> int:
        return self.count


class StepRow(NamedTuple):
    seq: int
    kind: str
    payload: str


class RunLog(NamedTuple):
    """What a claim needs from the log: the conversation, the number of model turns and the
    last step (the only one parsed)."""

    conversation: Conversation  # len() is the number of steps
    turns: int
    first_kind: str | None
    last: StepRow | None


def load_steps(run_id: Any, after_seq: int = -1, store: Store | None = None) -> list[StepRow]:
    """The log of a run from ``after_seq`` on, as plain rows (no model instances)."""
    return [StepRow(*row) for row in (store or current()).load_steps(run_id, after_seq)]


def load_log(run_id: Any, store: Store | None = None) -> RunLog:
    """Rebuild a run's conversation from its log (a claim does this once, then appends).

    One SELECT (``Store.load_log_rows``); each turn's content is cut out of its body at the
    recorded span, never parsed, and the messages are encoded as one chunk of the array
    (measured: the rows plus this loop cost about 1.3x the bare SELECT of them at 2,000 steps;
    assembling the text in SQL was slower)."""
    rows = (store or current()).load_log_rows(run_id)
    texts = [message_text(kind, payload, start, end) for _, kind, payload, start, end in rows]
    turns = sum(1 for row in rows if row[1] == _MODEL_TURN)
    first_kind = rows[0][1] if rows and rows[0][0] == 0 else None
    last = StepRow(*rows[-1][:3]) if rows else None
    # Encoded once, as one chunk of the array.
    return RunLog(
        Conversation(",".join(texts).encode("utf-8"), len(texts)), turns, first_kind, last
    )


def task_log(payload: str) -> RunLog:
    """The log of a run whose only step is its task (the claim returned that payload)."""
    last = StepRow(0, StepKind.TASK, payload)
    return RunLog(Conversation(user_message(payload), 1), 0, StepKind.TASK, last)


def rebuild_messages(run_id: Any) -> list[dict[str, Any]]:
    """The messages the run's next model call will send, parsed."""
    return load_log(run_id).conversation.messages()
