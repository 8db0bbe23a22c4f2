"""The conversation of a run, rebuilt from its step log exactly as it was sent before.

The messages are kept as JSON text, never re-serialised: a model turn contributes the
provider's own ``content`` text, cut out of the stored body at the span recorded when it was
committed; the task and tool results contribute their stored payload. So the request body of a
resumed call is byte for byte the body of the call that was interrupted (thinking signatures
bind values *and* key order), and no turn is parsed or serialised again to be sent: at step 2,000
only the bytes copied and sent have grown. Nothing here normalises, strips or merges anything.

Server-side compaction. When the model's turn holds a ``compaction`` block,
the API drops every message block before the last such block on every later call, and checks
thinking signatures only from that block on. So a request whose ``messages`` start with the task
and then go straight to the assistant message that holds the last compaction block is, for the
server, the same request as the whole history: the same tokens are read and billed, the same
signatures are checked. ``Conversation`` sends exactly that, once a compaction block exists,
so the bytes sent (and copied here) per call stay bounded however long the run.

This is not a client-side edit of the history: every message sent is still the stored text
byte for byte, in its place; what is left out is only what the server would drop anyway, and
no signature binds it (signatures bind from the last compaction block on). The task is kept
so that the array still starts with a user message. A compaction block whose ``content`` is
null (a failed compaction) is a no-op for the server, so it is not a cut here either. The run's
transcript (``rebuild_messages``, ``api.messages_for``) is always the whole log.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

from durable_agents._internal.deepjson import loads_deep, value_end
from durable_agents.models import StepKind
from durable_agents.store import Store, current
from durable_agents.store.base import RunId

_USER_OPEN = '{"role":"user","content":'
_ASSISTANT_OPEN = '{"role":"assistant","content":'
_ASSISTANT_OPEN_BYTES = _ASSISTANT_OPEN.encode()
_MODEL_TURN = StepKind.MODEL_TURN.value  # a plain str compares faster than the enum member
_MESSAGE = StepKind.MESSAGE.value

# Cheap first test for a compaction block: a JSON string "compaction" somewhere in the turn's
# content (the provider may or may not put spaces around the colon of ``"type": ...``). Only a
# turn that has it is parsed, to see whether a block's type really is compaction.
_COMPACTION = '"compaction"'
_COMPACTION_BYTES = _COMPACTION.encode()


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


def folded_message(previous: str | None, payload: str) -> str:
    """The message a ``message`` step (``payload``: a JSON array of text blocks, the messages a
    user sent while the run worked) makes of the message before it, ``previous``.

    The Messages API wants one user turn after the model's: so after a user message (the task,
    tool results, or messages folded before) the text blocks join that message's content, after
    its blocks (tool_result blocks first, as the API requires); a task given as a string becomes
    one text block first. After an assistant message (or none) they are a user message of their
    own. The same bytes whether the conversation is built live or rebuilt from the log."""
    if previous is None or not previous.startswith(_USER_OPEN):
        return _USER_OPEN + payload + "}"
    content = previous[len(_USER_OPEN) : -1]
    if content.startswith("["):
        joined = content[:-1] + ("" if content == "[]" else ",") + payload[1:]
    else:
        joined = '[{"type":"text","text":' + content + "}," + payload[1:]
    return _USER_OPEN + joined + "}"


def step_message(kind: str, payload: str, span: tuple[int, int] | None = None) -> bytes:
    return message_text(kind, payload, *(span or ())).encode("utf-8")


def user_message(payload: str) -> bytes:
    return step_message(StepKind.TOOL_RESULT, payload)


def assistant_message(body: str, span: tuple[int, int] | None) -> bytes:
    return step_message(StepKind.MODEL_TURN, body, span)


def has_compaction(content: Any) -> bool:
    """Whether a turn's content (parsed) holds a compaction block that compacted: one whose
    ``content`` is not null (a null one is a failed compaction, a no-op for the server)."""
    return isinstance(content, list) and any(
        isinstance(block, dict)
        and block.get("type") == "compaction"
        and block.get("content") is not None
        for block in content
    )


def _content_compacts(text: str | bytes) -> bool:
    """Whether ``text``, the JSON text of a turn's content array, holds a compaction block.
    Parsed only when the cheap substring test matches."""
    if isinstance(text, bytes):
        if _COMPACTION_BYTES not in text:
            return False
    elif _COMPACTION not in text:
        return False
    try:
        return has_compaction(loads_deep(text))
    except ValueError:
        return False


def _message_compacts(message: bytes) -> bool:
    """Whether ``message`` (the JSON text of one message, as ``assistant_message`` builds it)
    is an assistant message holding a compaction block."""
    if not message.startswith(_ASSISTANT_OPEN_BYTES) or _COMPACTION_BYTES not in message:
        return False
    # The content array: what follows the fixed opening, up to the closing brace.
    return _content_compacts(message[len(_ASSISTANT_OPEN_BYTES) : -1])


def _row_compacts(payload: str, start: int | None, end: int | None) -> bool:
    """Whether a model turn's stored body holds a compaction block in its content. With a
    span, only the content is searched (``usage.iterations`` names compaction passes too)."""
    if start is None:
        if _COMPACTION not in payload:
            return False
        try:
            body = loads_deep(payload)
        except ValueError:
            return False
        return isinstance(body, dict) and has_compaction(body.get("content"))
    if payload.find(_COMPACTION, start, end) < 0:
        return False
    return _content_compacts(payload[start:end])


class Conversation:
    """The ``messages`` array of a run's next request, as JSON text.

    Appending copies only the new message; ``json()`` copies the array once per call. With
    ``trim`` (the runner's conversation, from ``load_log`` or ``task_log``), appending an
    assistant message that holds a compaction block drops everything between the first
    message and it: the array sent is then the task, that message and what follows (see the
    module docstring). Without ``trim`` it is the whole conversation, a transcript.

    ``chunk`` holds ``count`` comma-separated messages already (a rebuild); ``head`` is the
    length in bytes of the first of them, when the caller knows it (else it is found when
    first needed); ``total`` the number of steps the conversation stands for, when ``chunk``
    holds fewer (a trimmed rebuild).
    """

    def __init__(
        self,
        chunk: bytes = b"",
        count: int = 0,
        *,
        trim: bool = False,
        head: int | None = None,
        total: int | None = None,
        last: int | None = None,
    ) -> None:
        self.buffer = bytearray(chunk)
        self.sent = count  # messages in ``buffer``: what the next request sends
        self.count = count if total is None else total  # messages appended in all
        self.trim = trim
        self._head = head
        # Where the last message of ``buffer`` starts (a fold rewrites it); None: not known
        # (a chunk given without it), found when first needed.
        self._last: int | None = 0 if count <= 1 else last

    def append_step(self, kind: str, payload: str, span: tuple[int, int] | None = None) -> None:
        """Append the message a step contributes (a ``message`` step is folded into the
        message before it, ``folded_message``)."""
        if kind == _MESSAGE:
            self.fold(payload)
        else:
            self.append(step_message(kind, payload, span))

    def fold(self, payload: str) -> None:
        """Fold a ``message`` step's text blocks into the last message (``folded_message``)."""
        if not self.sent:
            self.append(folded_message(None, payload).encode("utf-8"))
            return
        start = self._last_start()
        previous = bytes(self.buffer[start:]).decode("utf-8")
        merged = folded_message(previous, payload).encode("utf-8")
        if not previous.startswith(_USER_OPEN):
            self.append(merged)
            return
        del self.buffer[start:]
        self.buffer += merged
        if self.sent == 1:
            self._head = len(merged)
        self.count += 1

    def _last_start(self) -> int:
        if self._last is None:
            text = self.buffer.decode("utf-8")
            position, start = 0, 0
            while position < len(text):
                start = position
                position = value_end(text, position) + 1  # past the comma
            self._last = len(text[:start].encode("utf-8"))
        return self._last

    def append(self, message: bytes) -> None:
        if self.trim and self.sent and _message_compacts(message):
            # Keep the first message (the task); what the server would drop goes.
            del self.buffer[self._head_end() :]
            self.sent = 1
        if self.sent:
            self.buffer += b","
        else:
            self._head = len(message)
        self._last = len(self.buffer)
        self.buffer += message
        self.sent += 1
        self.count += 1

    def _head_end(self) -> int:
        """Bytes of the first message in ``buffer``."""
        if self._head is None:
            # A chunk given without its head's length: find where its first value ends.
            text = self.buffer.decode("utf-8")
            self._head = len(text[: value_end(text, 0)].encode("utf-8"))
        return self._head

    def json(self) -> bytes:
        return b"".join((b"[", self.buffer, b"]"))

    def messages(self) -> list[dict[str, Any]]:
        """Parsed, for reading (the API, tests); requests are built from ``json()``."""
        messages: list[dict[str, Any]] = loads_deep(self.json())
        return messages

    def __len__(self) -> int:
        """The number of messages appended (steps), whether or not all are sent."""
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


def load_steps(run_id: RunId, after_seq: int = -1, store: Store | None = None) -> list[StepRow]:
    """The log of a run from ``after_seq`` on, as plain rows (no model instances)."""
    return [StepRow(*row) for row in (store or current()).load_steps(run_id, after_seq)]


def _last_compaction(rows: list[Any]) -> int | None:
    """The index of the last row that is a model turn holding a compaction block (never the
    first row), or None. Scans from the end; each turn's content is searched, not parsed,
    unless it names a compaction."""
    for index in range(len(rows) - 1, 0, -1):
        _, kind, payload, start, end = rows[index]
        if kind == _MODEL_TURN and _row_compacts(payload, start, end):
            return index
    return None


def load_log(
    run_id: RunId | str, store: Store | None = None, *, trim: bool = True, shares: bool = True
) -> RunLog:
    """Rebuild a run's conversation from its log (a claim does this once, then appends).

    One SELECT (``Store.load_log_rows``); each turn's content is cut out of its body at the
    recorded span, never parsed, and the messages are encoded as one chunk of the array
    (measured: the rows plus this loop cost about 1.3x the bare SELECT of them at 2,000 steps;
    assembling the text in SQL was slower). With ``trim`` (the default: what a claim sends),
    the messages before the turn holding the last compaction block are left out, but the
    first (see the module docstring); ``trim=False`` gives the whole transcript.
    ``shares=False`` for a run known to be no fork (``Store.load_log_rows``)."""
    return log_of_rows((store or current()).load_log_rows(run_id, shares=shares), trim=trim)


def log_of_rows(rows: list[Any], *, trim: bool = True) -> RunLog:
    """``load_log`` of rows read already (``Store.load_log_rows``'s, or a claim's
    ``ahead.log``)."""
    cut = _last_compaction(rows) if trim else None
    if cut is None:
        kept = rows
    else:
        # The first message is kept whole: the task and the messages folded into it.
        head_rows = 1
        while head_rows < cut and rows[head_rows][1] == _MESSAGE:
            head_rows += 1
        kept = [*rows[:head_rows], *rows[cut:]]
    texts: list[str] = []
    for _, kind, payload, start, end in kept:
        if kind == _MESSAGE:
            # Folded into the message before it, as the live conversation did (``fold``).
            merged = folded_message(texts[-1] if texts else None, payload)
            if texts and texts[-1].startswith(_USER_OPEN):
                texts[-1] = merged
                continue
            texts.append(merged)
        else:
            texts.append(message_text(kind, payload, start, end))
    turns = sum(1 for row in rows if row[1] == _MODEL_TURN)
    first_kind = rows[0][1] if rows and rows[0][0] == 0 else None
    last = StepRow(*rows[-1][:3]) if rows else None
    # Encoded once, as one chunk of the array.
    chunk = ",".join(texts).encode("utf-8")
    head = len(texts[0].encode("utf-8")) if texts and trim else None
    last_start = len(chunk) - len(texts[-1].encode("utf-8")) if texts else 0
    conversation = Conversation(
        chunk, len(texts), trim=trim, head=head, total=len(rows), last=last_start
    )
    return RunLog(conversation, turns, first_kind, last)


def task_log(payload: str) -> RunLog:
    """The log of a run whose only step is its task (the claim returned that payload)."""
    conversation = Conversation(trim=True)
    conversation.append(user_message(payload))
    return RunLog(conversation, 0, StepKind.TASK, StepRow(0, StepKind.TASK, payload))


def rebuild_messages(run_id: RunId | str) -> list[dict[str, Any]]:
    """The run's whole conversation, parsed: every message of its log, in order (a transcript;
    after a compaction the next request sends only part of it, see ``load_log``)."""
    return load_log(run_id, trim=False).conversation.messages()
