"""The conversation of a run, rebuilt from its step log exactly as it was sent before.

The messages are kept as JSON text, never re-serialised: a model turn contributes the
provider's own ``content`` text, cut out of the stored body at the span recorded when it was
committed; the task and tool results contribute their stored payload. So the request body of a
resumed call is byte for byte the body of the call that was interrupted (thinking signatures
bind values *and* key order), no turn is parsed again to be sent, and a call costs the same at
step 2,000 as at step 10 on the client side. Nothing here normalises, strips or merges anything.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

from django.db import connection

from durable_agents.models import AgentRun, AgentStep, StepKind

_USER_OPEN = b'{"role":"user","content":'
_ASSISTANT_OPEN = b'{"role":"assistant","content":'
_USER_OPEN_TEXT = _USER_OPEN.decode()
_ASSISTANT_OPEN_TEXT = _ASSISTANT_OPEN.decode()


def user_message(payload: str) -> bytes:
    """The message of a task or tool_result step: its payload is the content that was sent."""
    return _USER_OPEN + payload.encode("utf-8") + b"}"


def assistant_message(body: str, span: tuple[int, int] | None) -> bytes:
    """The message of a model turn: the content text of the provider's body, as received."""
    if span is None:
        # A body stored before spans were recorded (or without a content key): parsed once.
        content = json.loads(body).get("content", [])
        text = json.dumps(content, ensure_ascii=False, separators=(",", ":"))
    else:
        text = body[span[0] : span[1]]
    return _ASSISTANT_OPEN + text.encode("utf-8") + b"}"


def step_message(kind: str, payload: str, span: tuple[int, int] | None = None) -> bytes:
    if kind == StepKind.MODEL_TURN:
        return assistant_message(payload, span)
    return user_message(payload)


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
        return json.loads(self.json())

    def __len__(self) -> int:
        return self.count


class StepRow(NamedTuple):
    seq: int
    kind: str
    payload: str


class RunLog(NamedTuple):
    """What a claim needs from the log: the conversation, the number of model turns and the
    last step (the only one parsed)."""

    conversation: Conversation
    turns: int
    steps: int
    first_kind: str | None
    last: StepRow | None


def load_steps(run_id: Any, after_seq: int = -1) -> list[StepRow]:
    """The log of a run from ``after_seq`` on, as plain rows (no model instances)."""
    rows = (
        AgentStep.objects.filter(run_id=run_id, seq__gt=after_seq)
        .order_by("seq")
        .values_list("seq", "kind", "payload")
    )
    return [StepRow(*row) for row in rows]


_LOG_SQL = (
    "SELECT seq, kind, payload, content_start, content_end FROM agent_step"
    " WHERE run_id = %s ORDER BY seq"
)


def load_log(run_id: Any) -> RunLog:
    """Rebuild a run's conversation from its log (a claim does this once, then appends).

    One SELECT; each turn's content is cut out of its body at the recorded span, never parsed,
    and the messages are encoded as one chunk of the array (measured: the rows plus this loop
    cost about 1.3x the bare SELECT of them at 2,000 steps; assembling the text in SQL was
    slower)."""
    with connection.cursor() as cursor:
        # Plain SQL: the ORM's row iteration costs more than the rest of the rebuild.
        cursor.execute(_LOG_SQL, [AgentRun._meta.pk.get_db_prep_value(run_id, connection)])
        rows = cursor.fetchall()
    texts: list[str] = []
    turns = 0
    first_kind = None
    row = None
    for row in rows:
        seq, kind, payload, start, end = row
        if kind == StepKind.MODEL_TURN:
            turns += 1
            if start is None:
                texts.append(assistant_message(payload, None).decode("utf-8"))
            else:
                texts.append(_ASSISTANT_OPEN_TEXT + payload[start:end] + "}")
        else:
            texts.append(_USER_OPEN_TEXT + payload + "}")
        if seq == 0:
            first_kind = kind
    last = StepRow(*row[:3]) if row is not None else None
    conversation = Conversation(",".join(texts).encode("utf-8"), len(texts))
    return RunLog(conversation, turns, len(texts), first_kind, last)


def task_log(payload: str) -> RunLog:
    """The log of a run whose only step is its task (the claim returned that payload)."""
    last = StepRow(0, StepKind.TASK, payload)
    return RunLog(Conversation(user_message(payload), 1), 0, 1, StepKind.TASK, last)


def rebuild_messages(run_id: Any) -> list[dict[str, Any]]:
    """The messages the run's next model call will send, parsed."""
    return load_log(run_id).conversation.messages()
