r"""A deterministic, offline, scripted stand-in for the Anthropic Messages API.

``POST /v1/messages``, as JSON or, with ``"stream": true``, as server-sent events. Used behind
the real SDK through ``httpx2.MockTransport`` when no API key is configured
(``offline_client()``), and by tests behind a real local HTTP server (``OfflineServer``).

The script lives in the task (the text of the first user message). Lines starting with ``@`` are
plan lines, one per model turn; the calls of one turn are separated by `` && ``::

    Migrate the orders table.
    @get_schema {"table": "orders"}
    @get_schema {"table": "orders"} && set_status {"ticket": "T-1", "status": "done"}
    @@latency 0.25          (seconds before each answer)
    @@chunk_latency 0.1     (seconds between the events of a streamed answer)

Turn k (= number of assistant messages already sent) plays plan line k; past the last plan line
the model ends the run with ``end_turn``.

Two directives let a script play a hostile provider, whatever the names, inputs and texts (the
values are JSON, so NUL and lone surrogates are written as the escapes ``\u0000``, ``\ud800``)::

    @@turn [{"name": "lookup", "input": {"key": "a\u0000"}}, {"name": "\ud800", "input": []}]
    @@final "Done \u0000 \udfff"

``@@turn`` is a plan line (one turn, in order with the ``@`` lines) whose calls are a JSON array
of objects with a string ``name`` and any JSON ``input`` (``{}`` when left out). ``@@final``
sets the text of the final (``end_turn``) turn; the last one given wins. ``turn_directive`` and
``final_directive`` write these lines. Inputs may nest deeper than Python's recursion limit
(``loads_deep`` / ``dumps_deep`` handle any depth), and a response whose values hold lone
surrogates is sent with those escaped (``\ud800``), as valid UTF-8 JSON text: what a real
hostile provider response would contain.

``@@repeat N <plan line>`` is N plan lines at once (``@@repeat 4999 @noop {"key": "k"}``): a
long run's script stays short.

Thinking signatures are the point of this module: like the real API, a thinking block is only
accepted back if everything it was produced from (model, system, tools, earlier messages, its
text) is sent back byte-identical in value and key order. This is what lets tests prove that a
durable store replays history verbatim. It deliberately imports neither Django nor the database.

Long transcripts (API.md section 9), as the real API documents them:

- Server-side compaction: ``context_management.edits`` with ``{"type": "compact_20260112",
  "trigger": {"type": "input_tokens", "value": N}, "pause_after_compaction": bool}`` and the
  ``compact-2026-01-12`` beta in the ``anthropic-beta`` header (without it: a 400). When the
  estimated input (``len(JSON) // 4`` of the messages the model reads, i.e. from the last
  compaction block on) reaches N, the answer starts with ``{"type": "compaction", "content":
  <summary>, "encrypted_content": <state>}``: the state is what the model needs to go on (the
  turns done, the task's script), signed like a thinking block, so a changed block is a 400.
  Then come the turn's usual blocks, or, with ``pause_after_compaction``, nothing more and
  ``stop_reason: "compaction"`` (the next request ends with that turn; the answer continues
  it). ``usage.iterations`` lists the compaction pass and the message pass; the top-level
  ``usage`` is the message pass alone. The real API wants N >= 50,000; this model takes any
  N >= ``OFFLINE_MIN_COMPACTION_TRIGGER`` (100) so tests compact after a few turns.
- Reading a request, everything before the last compaction block is dropped, as the API does:
  the script and turn count come from that block's state, the input tokens billed count only
  what follows it, and thinking signatures are checked from it on (a thinking block after the
  compaction block in the same turn is signed over that block alone). A compaction block
  whose content is null (a failed compaction) is a no-op.
- Context editing (beta ``context-management-2025-06-27``; ``clear_tool_uses_20250919``,
  ``clear_thinking_20251015``): validated (beta, types, clear_thinking first) but not applied.
- Automatic prompt caching: a top-level ``cache_control`` (``{"type": "ephemeral"}``, ``ttl``
  optional) is accepted. The model stays a pure function of the request, so it assumes the
  conversation's previous call was made within the cache's lifetime: the input up to the last
  two messages (the previous request) is billed as ``cache_read_input_tokens``, the rest as
  ``cache_creation_input_tokens``; a conversation's first call (and the first after a
  compaction) reads nothing from the cache.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import threading
import time
from collections.abc import Iterator, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, NamedTuple

import anthropic
import httpx2

from durable_agents.deepjson import dumps_deep, loads_deep, raw_decode_deep

__all__ = [
    "COMPACT_BETA",
    "CONTEXT_EDITING_BETA",
    "OFFLINE_MIN_COMPACTION_TRIGGER",
    "RETIRED_MODELS",
    "DEFAULT_SECRET",
    "ScriptedModel",
    "PlanCall",
    "Script",
    "parse_script",
    "sign",
    "canonical_bytes",
    "offline_client",
    "OfflineServer",
    "turn_directive",
    "final_directive",
    "loads_deep",
    "dumps_deep",
]

DEFAULT_SECRET = b"durable-agents-offline"

# Real ids the API no longer serves; requests for them get the same 404 the real API gives.
RETIRED_MODELS = frozenset(
    {"claude-2.0", "claude-2.1", "claude-instant-1.2", "claude-3-sonnet-20240229"}
)

MESSAGES_PATH = "/v1/messages"
SIGNATURE_ERROR = "Invalid `signature` in `thinking` block"
LATENCY_DIRECTIVE = "latency"
# Seconds between two events of a streamed answer (``@@chunk_latency 0.2``).
CHUNK_LATENCY_DIRECTIVE = "chunk_latency"
# A plan line given as JSON (``@@turn [{"name": ..., "input": ...}]``) and the final text.
TURN_DIRECTIVE = "turn"
FINAL_DIRECTIVE = "final"
CALL_SEPARATOR = " && "
# ``@@repeat N <plan line>``: N plan lines at once.
REPEAT_DIRECTIVE = "repeat"
MAX_REPEAT = 1_000_000

# Long transcripts (see the module docstring).
COMPACT_EDIT = "compact_20260112"
COMPACT_BETA = "compact-2026-01-12"
CONTEXT_EDITING_BETA = "context-management-2025-06-27"
CLEAR_TOOL_USES_EDIT = "clear_tool_uses_20250919"
CLEAR_THINKING_EDIT = "clear_thinking_20251015"
DEFAULT_COMPACTION_TRIGGER = 150_000
# The real API refuses triggers below 50,000 input tokens; the offline model takes small ones
# so that a test compacts after a few turns.
API_MIN_COMPACTION_TRIGGER = 50_000
OFFLINE_MIN_COMPACTION_TRIGGER = 100
COMPACTION_ERROR = "Invalid compaction block"

Response = tuple[int, dict[str, str], bytes]


class _RequestError(Exception):
    """An error answer; carries what the real API would send."""

    def __init__(self, status: int, error_type: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.error_type = error_type
        self.message = message


def _invalid(message: str) -> _RequestError:
    return _RequestError(400, "invalid_request_error", message)


def _hex24(*parts: object) -> str:
    h = hashlib.sha256()
    for part in parts:
        # Length-prefix every part so that ("ab", "c") and ("a", "bc") hash differently.
        # surrogatepass: a hostile name or text may hold a lone surrogate; still hashable.
        data = part if isinstance(part, bytes) else str(part).encode("utf-8", "surrogatepass")
        h.update(len(data).to_bytes(8, "big"))
        h.update(data)
    return h.hexdigest()[:24]


def canonical_bytes(obj: Any) -> bytes:
    """Canonical bytes for signing: compact JSON that keeps key order (no sort_keys), so a
    reordered dict anywhere in the history counts as a change, as it does for the real API."""
    try:
        text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    except RecursionError:
        # Deeper than the json module can walk (a hostile input): same value, same bytes.
        text = dumps_deep(obj, separators=(",", ":"))
    # surrogatepass: a lone surrogate still signs (deterministically) instead of crashing.
    return text.encode("utf-8", "surrogatepass")


def sign(
    secret: bytes,
    model: str,
    system: Any,
    tools: Any,
    earlier_messages: list[Any],
    thinking_text: Any,
) -> str:
    """Signature of a thinking block: base64(HMAC-SHA256(secret, canonical([model, system,
    tools, earlier_messages, thinking_text]))), each element (and each earlier message)
    encoded on its own by ``canonical_bytes``. ``system`` and ``tools`` are as sent (``None``
    when absent); ``earlier_messages`` are what the model read before the block's turn."""
    signer = _Signer(secret, model, system, tools)
    for message in earlier_messages:
        signer.add(canonical_bytes(message))
    return signer.sign(thinking_text)


class _Signer:
    """``sign`` over a growing list of earlier messages: each message is encoded and hashed
    once, so checking every thinking block of a request costs one pass over it."""

    def __init__(self, secret: bytes, model: str, system: Any, tools: Any) -> None:
        self._mac = hmac.new(secret, digestmod=hashlib.sha256)
        for part in (
            b"[",
            canonical_bytes(model),
            b",",
            canonical_bytes(system),
            b",",
            canonical_bytes(tools),
            b",[",
        ):
            self._mac.update(part)
        self._first = True

    def add(self, message_bytes: bytes) -> None:
        if not self._first:
            self._mac.update(b",")
        self._first = False
        self._mac.update(message_bytes)

    def sign(self, thinking_text: Any) -> str:
        mac = self._mac.copy()
        mac.update(b"],")
        mac.update(canonical_bytes(thinking_text))
        mac.update(b"]")
        return base64.b64encode(mac.digest()).decode("ascii")


# ---------------------------------------------------------------------------------------------
# JSON of any depth. A hostile provider may nest a tool input thousands of levels deep; the
# json module recurses and gives up past ``sys.getrecursionlimit()``. These walk with an explicit
# stack, and are used only when the json module cannot (the common case stays on its C code).


def _json_bytes(value: Any, separators: tuple[str, str] = (", ", ": ")) -> bytes:
    """JSON text as UTF-8 bytes; when a value holds a lone surrogate (which UTF-8 cannot
    encode) or nests too deep for the json module, the text is all ASCII, escapes included."""
    try:
        return json.dumps(value, ensure_ascii=False, separators=separators).encode("utf-8")
    except (RecursionError, UnicodeEncodeError):
        return dumps_deep(value, separators=separators).encode("ascii")


def turn_directive(calls: list[tuple[str, Any]]) -> str:
    """The ``@@turn`` line of one turn making ``calls`` ((name, input) pairs), all ASCII."""
    return f"@@{TURN_DIRECTIVE} " + dumps_deep(
        [{"name": name, "input": tool_input} for name, tool_input in calls]
    )


def final_directive(text: str) -> str:
    """The ``@@final`` line that makes ``text`` the final turn's text, all ASCII."""
    return f"@@{FINAL_DIRECTIVE} " + dumps_deep(text)


# ---------------------------------------------------------------------------------------------
# The script


class PlanCall:
    """One tool call of a plan line: the name as written and the input as written."""

    __slots__ = ("name", "input")

    def __init__(self, name: str, input: Any) -> None:  # noqa: A002 - mirrors the API field
        self.name = name
        self.input = input

    def __repr__(self) -> str:
        return f"PlanCall({self.name!r}, {self.input!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PlanCall) and (self.name, self.input) == (other.name, other.input)

    __hash__ = None  # type: ignore[assignment]  # input may be unhashable


class Script:
    """The parsed task: plan lines (one list of calls per turn), latency, first line, and the
    final turn's text when ``@@final`` sets it."""

    def __init__(
        self,
        first_line: str,
        plan: list[list[PlanCall]],
        latency: float,
        chunk_latency: float = 0.0,
        final_text: str | None = None,
    ) -> None:
        self.first_line = first_line
        self.plan = plan
        self.latency = latency
        self.chunk_latency = chunk_latency
        self.final_text = final_text


def _parse_call_args(text: str) -> tuple[Any, str | None]:
    """Parse the arguments at the start of ``text`` (what follows a tool name).

    Returns (input, rest): rest is the text after the next `` && ``, or None at the end of the
    line. A JSON value is read with raw_decode so that a JSON string may itself contain
    `` && ``; text that is not valid JSON (up to the next separator) becomes ``{"_raw": text}``.
    """
    stripped = text.strip()
    if not stripped:
        return {}, None
    if stripped.startswith("&&"):
        return {}, stripped[2:]
    try:
        value, end = raw_decode_deep(stripped)  # at any depth
    except ValueError:
        pass
    else:
        tail = stripped[end:]
        if not tail.strip():
            return value, None
        if tail.startswith(CALL_SEPARATOR):
            return value, tail[len(CALL_SEPARATOR) :]
    raw, sep, rest = stripped.partition(CALL_SEPARATOR)
    return {"_raw": raw.strip()}, (rest if sep else None)


def _parse_plan_line(line: str, number: int) -> list[PlanCall]:
    calls: list[PlanCall] = []
    rest: str | None = line[1:]
    while rest is not None:
        rest = rest.lstrip()
        name_end = next((i for i, ch in enumerate(rest) if ch.isspace()), len(rest))
        name = rest[:name_end]
        if not name or name == "&&":
            raise _invalid(f"offline script: plan line {number} has a call without a tool name")
        tool_input, rest = _parse_call_args(rest[name_end:])
        calls.append(PlanCall(name, tool_input))
    return calls


def parse_script(task: str) -> Script:
    """Parse a task into its script. Raises ValueError on a malformed directive or plan line."""
    try:
        return _parse_script(task)
    except _RequestError as e:
        raise ValueError(e.message) from None


def _parse_turn_directive(value: str, number: int) -> list[PlanCall]:
    """The calls of a ``@@turn`` line: a JSON array of {"name": str, "input": any}."""
    where = f"offline script: @@{TURN_DIRECTIVE} (plan line {number})"
    try:
        calls = loads_deep(value)
    except ValueError as e:
        raise _invalid(f"{where} needs a JSON array of calls: {e}") from None
    if not isinstance(calls, list) or not calls:
        raise _invalid(f"{where} needs a non-empty JSON array of calls")
    plan_calls = []
    for call in calls:
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            raise _invalid(f"{where}: each call is an object with a string `name`")
        plan_calls.append(PlanCall(call["name"], call.get("input", {})))
    return plan_calls


def _parse_final_directive(value: str) -> str:
    try:
        text = loads_deep(value)
    except ValueError as e:
        raise _invalid(f"offline script: @@{FINAL_DIRECTIVE} needs a JSON string: {e}") from None
    if not isinstance(text, str):
        raise _invalid(f"offline script: @@{FINAL_DIRECTIVE} needs a JSON string")
    return text


def _parse_repeat_directive(value: str, number: int) -> tuple[int, list[PlanCall]]:
    """``@@repeat N <plan line>``: how many times, and the calls of the plan line."""
    where = f"offline script: @@{REPEAT_DIRECTIVE} (plan line {number})"
    count, _, line = value.strip().partition(" ")
    try:
        times = int(count)
    except ValueError:
        times = 0
    if not 1 <= times <= MAX_REPEAT:
        raise _invalid(f"{where} needs a count from 1 to {MAX_REPEAT}, got {count!r}")
    line = line.strip()
    if line.startswith(f"@@{TURN_DIRECTIVE} "):
        return times, _parse_turn_directive(line[len(TURN_DIRECTIVE) + 3 :], number)
    if not line.startswith("@") or line.startswith("@@"):
        raise _invalid(f"{where} needs a plan line after the count (@tool {{...}})")
    return times, _parse_plan_line(line, number)


def _parse_script(task: str) -> Script:
    lines = task.splitlines()
    first_line = next((ln.strip() for ln in lines if ln.strip()), "")
    plan: list[list[PlanCall]] = []
    delays = {LATENCY_DIRECTIVE: 0.0, CHUNK_LATENCY_DIRECTIVE: 0.0}
    final_text: str | None = None
    for raw_line in lines:
        line = raw_line.strip()
        if line.startswith("@@"):
            directive, _, value = line[2:].partition(" ")
            if directive == TURN_DIRECTIVE:
                plan.append(_parse_turn_directive(value, len(plan)))
                continue
            if directive == FINAL_DIRECTIVE:
                final_text = _parse_final_directive(value)
                continue
            if directive == REPEAT_DIRECTIVE:
                times, calls = _parse_repeat_directive(value, len(plan))
                plan.extend([calls] * times)
                continue
            if directive not in delays:
                raise _invalid(f"offline script: unknown directive @@{directive}")
            try:
                seconds = float(value)
            except ValueError:
                raise _invalid(
                    f"offline script: @@{directive} needs seconds, got {value!r}"
                ) from None
            if not seconds >= 0:  # also rejects nan
                raise _invalid(f"offline script: @@{directive} must be >= 0")
            delays[directive] = seconds
        elif line.startswith("@"):
            plan.append(_parse_plan_line(line, len(plan)))
    return Script(
        first_line,
        plan,
        delays[LATENCY_DIRECTIVE],
        delays[CHUNK_LATENCY_DIRECTIVE],
        final_text,
    )


# ---------------------------------------------------------------------------------------------
# The model


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "\n".join(
        b["text"]
        for b in content
        if isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str)
    )


def _blocks(content: Any) -> list[Any]:
    return content if isinstance(content, list) else []


def _compaction_only(content: Any) -> bool:
    """A turn that holds compaction blocks and nothing else (paused after a compaction)."""
    return (
        isinstance(content, list)
        and bool(content)
        and all(isinstance(b, dict) and b.get("type") == "compaction" for b in content)
    )


def _header(headers: Mapping[str, str], name: str) -> str:
    value = headers.get(name)
    if value is None and isinstance(headers, dict):
        value = next((v for k, v in headers.items() if k.lower() == name), None)
    return value or ""


def _betas(headers: Mapping[str, str]) -> frozenset[str]:
    return frozenset(b.strip() for b in _header(headers, "anthropic-beta").split(",") if b.strip())


class _Compaction(NamedTuple):
    """The request's compaction edit."""

    trigger: int
    pause: bool
    instructions: str | None


class _View(NamedTuple):
    """What the model reads of a request's messages: from the last compaction block on."""

    messages: list[dict[str, Any]]  # the first one starts at the compaction block when cut
    cut: tuple[int, int] | None  # (message, block) of the last compaction block
    dropped: list[dict[str, Any]]  # messages before it (their bytes are not billed)
    turns_before: int  # turns done before the compaction block (its state), else 0
    task: str  # the script: the first message's text, or the compaction state's


class ScriptedModel:
    """The offline model. ``respond`` is a pure function of the request (plus a sleep when the
    task asks for latency): the same request bytes always give the same response bytes."""

    def __init__(self, secret: bytes = DEFAULT_SECRET) -> None:
        self.secret = secret

    # -- transport adapters --------------------------------------------------------------

    def handle(self, request: httpx2.Request) -> httpx2.Response:
        """Handler for ``httpx2.MockTransport``; streamed requests get a streamed body."""
        status, headers, chunks = self.respond_stream(
            request.method, request.url.path, request.headers, request.read()
        )
        return httpx2.Response(status, headers=headers, content=chunks)

    def respond_stream(
        self, method: str, path: str, headers: Mapping[str, str], body: bytes
    ) -> tuple[int, dict[str, str], Iterator[bytes]]:
        """Like ``respond``, but a request with ``"stream": true`` is answered with server-sent
        events (``@@chunk_latency`` seconds apart) that assemble into exactly the message
        ``respond`` would have returned."""
        try:
            streamed = loads_deep(body).get("stream") is True
        except (ValueError, AttributeError, UnicodeDecodeError):
            streamed = False
        if not streamed:
            status, out_headers, out = self.respond(method, path, headers, body)
            return status, out_headers, iter([out])
        request_id = "req_offline_" + _hex24("request", method, path, body)
        try:
            payload, latency, chunk_latency = self._answer(
                method, path, body, request_id, streamed=True, headers=headers
            )
        except _RequestError as e:
            error = {
                "type": "error",
                "error": {"type": e.error_type, "message": e.message},
                "request_id": request_id,
            }
            return e.status, self._headers(request_id), iter([self._dump(error)])
        if latency:
            time.sleep(latency)
        sse_headers = {"content-type": "text/event-stream", "request-id": request_id}
        return 200, sse_headers, _sse_events(payload, chunk_latency)

    # -- the API -------------------------------------------------------------------------

    def respond(self, method: str, path: str, headers: Mapping[str, str], body: bytes) -> Response:
        request_id = "req_offline_" + _hex24("request", method, path, body)
        try:
            payload, latency, _ = self._answer(method, path, body, request_id, headers=headers)
        except _RequestError as e:
            payload = {
                "type": "error",
                "error": {"type": e.error_type, "message": e.message},
                "request_id": request_id,
            }
            return e.status, self._headers(request_id), self._dump(payload)
        if latency:
            time.sleep(latency)
        return 200, self._headers(request_id), self._dump(payload)

    @staticmethod
    def _headers(request_id: str) -> dict[str, str]:
        return {"content-type": "application/json", "request-id": request_id}

    @staticmethod
    def _dump(payload: dict[str, Any]) -> bytes:
        return _json_bytes(payload, separators=(", ", ": "))

    def _answer(
        self,
        method: str,
        path: str,
        body: bytes,
        request_id: str,
        streamed: bool = False,
        headers: Mapping[str, str] | None = None,
    ) -> tuple[dict[str, Any], float, float]:
        path = path.split("?", 1)[0]
        if method.upper() != "POST" or path.rstrip("/") != MESSAGES_PATH:
            raise _RequestError(404, "not_found_error", f"{method.upper()} {path}: not found")
        req = self._parse_body(body, streamed)
        model: str = req["model"]
        if not model.startswith("claude-") or model in RETIRED_MODELS:
            raise _RequestError(404, "not_found_error", f"model: {model}")
        betas = _betas(headers or {})
        compaction = _compaction_edit(req.get("context_management"), betas)
        cached = _cache_control(req.get("cache_control"))
        messages: list[dict[str, Any]] = req["messages"]
        self._check_structure(messages)
        view = self._view(model, messages, betas)
        system, tools = req.get("system"), req.get("tools")
        signer, parts = self._check_signatures(model, system, tools, view)

        script = _parse_script(view.task)
        turn = view.turns_before + sum(
            1
            for m in view.messages
            if m["role"] == "assistant" and not _compaction_only(m["content"])
        )
        thinking = req.get("thinking")
        thinking_on = isinstance(thinking, dict) and thinking.get("type") == "enabled"

        # What the model reads: the body less what precedes the last compaction block.
        dropped = sum(len(canonical_bytes(m)) + 1 for m in view.dropped)  # and its comma
        read = max(1, (len(body) - dropped) // 4)
        read_before = len(body) - dropped - sum(len(p) for p in parts[-2:])
        cache_read = max(0, read_before // 4) if cached and len(parts) >= 3 else 0
        fired = (
            compaction is not None
            and view.messages[-1]["role"] == "user"
            and sum(len(p) for p in parts) // 4 >= compaction.trigger
        )

        content: list[dict[str, Any]] = []
        iterations: list[dict[str, Any]] = []
        if fired:
            assert compaction is not None
            block = self._compaction_block(model, turn, view, script, compaction)
            content.append(block)
            iterations.append(
                _usage_entry("compaction", read, 0, 0, max(1, len(canonical_bytes(block)) // 4))
            )
            # The message pass reads the summary instead of what it replaces.
            compacted = {"role": "assistant", "content": [block]}
            summary_bytes = canonical_bytes(compacted)
            read = max(1, (len(body) - dropped - sum(len(p) for p in parts)) // 4)
            read += len(summary_bytes) // 4
            cache_read = 0
            signer = _Signer(self.secret, model, system, tools)
            signer.add(summary_bytes)

        stop_reason: str
        if fired and compaction is not None and compaction.pause:
            stop_reason = "compaction"
            usage = _usage_entry(None, 0, 0, 0, 0)
        else:
            blocks, stop_reason = self._turn_blocks(
                model, turn, script, view.task, thinking_on, signer
            )
            content.extend(blocks)
            output = max(1, len(canonical_bytes(blocks)) // 4)
            if cached:
                usage = _usage_entry(None, 0, read - cache_read, cache_read, output)
            else:
                usage = _usage_entry(None, read, 0, 0, output)
            if iterations:
                iterations.append({"type": "message", **usage})
        usage["service_tier"] = "standard"
        if iterations:
            usage["iterations"] = iterations

        payload = {
            "id": "msg_offline_" + _hex24("message", body),
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": None,
            "usage": usage,
            "container": None,
            # Not modelled by the SDK: lets tests check that the raw body is stored verbatim.
            "offline_script": {"turn": turn, "plan_lines": len(script.plan)},
        }
        return payload, script.latency, script.chunk_latency

    def _turn_blocks(
        self,
        model: str,
        turn: int,
        script: Script,
        task_text: str,
        thinking_on: bool,
        signer: _Signer,
    ) -> tuple[list[dict[str, Any]], str]:
        """The blocks of turn ``turn`` of the script (a thinking block signed by ``signer``,
        the text, the calls) and its stop reason."""
        if turn < len(script.plan):
            calls = script.plan[turn]
            names = ", ".join(c.name for c in calls)
            thought = f"Turn {turn + 1} of {len(script.plan)}: the plan says to call {names}."
            text = f"Step {turn + 1}: calling {names}."
            stop_reason = "tool_use"
        else:
            calls = []
            if script.final_text is not None:
                text = script.final_text
            elif script.plan:
                text = f"Done. {len(script.plan)} planned turns completed."
            else:
                text = f"Offline model, no plan in the task: {script.first_line}"
            thought = f"Turn {turn + 1}: nothing left to call, so the run ends."
            stop_reason = "end_turn"
        content: list[dict[str, Any]] = []
        if thinking_on:
            content.append(
                {"type": "thinking", "thinking": thought, "signature": signer.sign(thought)}
            )
        content.append({"type": "text", "text": text})
        for index, call in enumerate(calls):
            content.append(
                {
                    "type": "tool_use",
                    "id": "toolu_" + _hex24("tool_use", model, turn, index, task_text),
                    "name": call.name,
                    "input": call.input,
                }
            )
        return content, stop_reason

    # -- compaction ----------------------------------------------------------------------

    def _state_mac(self, model: str, summary: Any, state: str) -> str:
        payload = canonical_bytes(["compaction", model, summary, state])
        digest = hmac.new(self.secret, payload, hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).decode("ascii").rstrip("=")

    def _compaction_block(
        self, model: str, turn: int, view: _View, script: Script, edit: _Compaction
    ) -> dict[str, Any]:
        """The summary of what the model read, and the state it goes on from (the turns done
        and the task), signed over the model and the summary."""
        summary = (
            f"Summary by the offline model: {turn} turn(s) of the task "
            f"{script.first_line!r} are done ({len(script.plan)} planned); the "
            f"{len(view.messages)} message(s) read so far are replaced by this summary."
        )
        if edit.instructions:
            summary += f" Instructions followed: {edit.instructions}"
        state = base64.urlsafe_b64encode(
            canonical_bytes({"turns": turn, "task": view.task})
        ).decode("ascii")
        return {
            "type": "compaction",
            "content": summary,
            "encrypted_content": f"{state}.{self._state_mac(model, summary, state)}",
        }

    def _view(self, model: str, messages: list[dict[str, Any]], betas: frozenset[str]) -> _View:
        """Drop every message block before the last compaction block, as the API does; the
        block's state must be the one this model signed (else a 400)."""
        cut: tuple[int, int] | None = None
        for i, m in enumerate(messages):
            for j, b in enumerate(_blocks(m["content"])):
                if b["type"] != "compaction":
                    continue
                if COMPACT_BETA not in betas:
                    raise _invalid(
                        f"messages.{i}.content.{j}: compaction blocks need the anthropic-beta "
                        f"header {COMPACT_BETA!r}"
                    )
                if m["role"] != "assistant":
                    raise _invalid(f"messages.{i}.content.{j}: compaction blocks are the model's")
                if b.get("content") is not None:
                    cut = (i, j)
        if cut is None:
            return _View(messages, None, [], 0, _text_of(messages[0]["content"]))
        i, j = cut
        block = messages[i]["content"][j]
        turns, task = self._state(model, block, f"messages.{i}.content.{j}")
        first = {**messages[i], "content": messages[i]["content"][j:]}
        dropped = messages[:i]
        if j:
            dropped = [*dropped, {**messages[i], "content": messages[i]["content"][:j]}]
        return _View([first, *messages[i + 1 :]], cut, dropped, turns, task)

    def _state(self, model: str, block: dict[str, Any], where: str) -> tuple[int, str]:
        summary, encrypted = block.get("content"), block.get("encrypted_content")
        error = _invalid(
            f"{where}: {COMPACTION_ERROR}: send compaction blocks back exactly as received, "
            "to the model that wrote them"
        )
        if not isinstance(encrypted, str) or encrypted.count(".") != 1:
            raise error
        state, mac = encrypted.split(".")
        if not hmac.compare_digest(mac, self._state_mac(model, summary, state)):
            raise error
        decoded = loads_deep(base64.urlsafe_b64decode(state.encode("ascii")))
        return int(decoded["turns"]), str(decoded["task"])

    # -- validation ----------------------------------------------------------------------

    @staticmethod
    def _parse_body(body: bytes, streamed: bool = False) -> dict[str, Any]:
        try:
            req = loads_deep(body)
        except (ValueError, UnicodeDecodeError) as e:
            raise _invalid(f"request body is not valid JSON: {e}") from None
        if not isinstance(req, dict):
            raise _invalid("request body must be a JSON object")
        if not isinstance(req.get("model"), str):
            raise _invalid("model: Field required (a string)")
        max_tokens = req.get("max_tokens")
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise _invalid("max_tokens: Field required (a positive integer)")
        if not isinstance(req.get("messages"), list) or not req["messages"]:
            raise _invalid("messages: Field required (a non-empty list)")
        if req.get("stream") and not streamed:
            raise _invalid("stream: use respond_stream for streamed requests")
        return req

    @staticmethod
    def _check_structure(messages: list[Any]) -> None:
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise _invalid(f"messages.{i}: must be an object")
            content = m.get("content")
            if not isinstance(content, str | list):
                raise _invalid(f"messages.{i}.content: must be a string or a list of blocks")
            for j, b in enumerate(_blocks(content)):
                if not isinstance(b, dict) or not isinstance(b.get("type"), str):
                    raise _invalid(f"messages.{i}.content.{j}: must be a block with a `type`")
            expected = "user" if i % 2 == 0 else "assistant"
            if i and messages[i - 1].get("role") == "assistant":
                expected = "user"
                if _compaction_only(messages[i - 1].get("content")):
                    # A turn paused after its compaction is continued by the next turn.
                    expected = "assistant" if m.get("role") == "assistant" else "user"
            elif i:
                expected = "assistant"
            if m.get("role") != expected:
                raise _invalid(
                    f"messages.{i}.role: roles must alternate between `user` and `assistant`, "
                    f"starting with `user`; expected `{expected}`, got {m.get('role')!r}"
                )
        last = messages[-1]
        if last["role"] != "user" and not _compaction_only(last["content"]):
            # The script keys on the number of assistant turns; a prefill would skew it.
            raise _invalid(
                f"messages.{len(messages) - 1}: the last message must have role `user` "
                "(the offline model does not support prefill)"
            )

        previous_ids: list[str] = []
        for i, m in enumerate(messages):
            blocks = _blocks(m["content"])
            if m["role"] == "assistant":
                previous_ids = [b.get("id") for b in blocks if b["type"] == "tool_use"]
                continue
            answered: set[str] = set()
            for j, b in enumerate(blocks):
                if b["type"] != "tool_result":
                    continue
                ref = b.get("tool_use_id")
                if ref not in previous_ids:
                    raise _invalid(
                        f"messages.{i}.content.{j}: unexpected `tool_use_id` found in "
                        f"`tool_result` blocks: {ref}. Each `tool_result` block must have a "
                        "corresponding `tool_use` block in the previous message."
                    )
                answered.add(ref)
            missing = [t for t in previous_ids if t not in answered]
            if missing:
                raise _invalid(
                    f"messages.{i}: `tool_use` ids were found without `tool_result` blocks "
                    f"immediately after: {', '.join(map(str, missing))}. Each `tool_use` block "
                    "must have a corresponding `tool_result` block in the next message."
                )
            previous_ids = []

    def _check_signatures(
        self, model: str, system: Any, tools: Any, view: _View
    ) -> tuple[_Signer, list[bytes]]:
        """Check every thinking block the model reads (from the last compaction block on).
        Returns the signer over all of them (for the answer's own thinking block) and each
        message's canonical bytes."""
        signer = _Signer(self.secret, model, system, tools)
        parts: list[bytes] = []
        for i, m in enumerate(view.messages):
            if m["role"] == "assistant":
                for j, b in enumerate(_blocks(m["content"])):
                    if b["type"] != "thinking":
                        continue  # redacted_thinking is opaque and left unchecked
                    if i == 0 and view.cut is not None:
                        # After the compaction block of its own turn: signed over the blocks
                        # before it in that turn (the compaction block) alone.
                        head = {**m, "content": m["content"][:j]}
                        expected = sign(self.secret, model, system, tools, [head], b["thinking"])
                    else:
                        expected = signer.sign(b.get("thinking"))
                    given = b.get("signature")
                    if not isinstance(given, str) or not hmac.compare_digest(given, expected):
                        # Where the block is in the request (the view may start mid-turn).
                        at, block = i, j
                        if view.cut is not None:
                            at += view.cut[0]
                            block += view.cut[1] if i == 0 else 0
                        raise _invalid(f"messages.{at}.content.{block}: {SIGNATURE_ERROR}")
            part = canonical_bytes(m)
            parts.append(part)
            signer.add(part)
        return signer, parts


def _usage_entry(
    kind: str | None, input_tokens: int, created: int, read: int, output: int
) -> dict[str, Any]:
    entry: dict[str, Any] = {} if kind is None else {"type": kind}
    entry.update(
        input_tokens=input_tokens,
        cache_creation_input_tokens=created,
        cache_read_input_tokens=read,
        output_tokens=output,
    )
    return entry


def _compaction_edit(value: Any, betas: frozenset[str]) -> _Compaction | None:
    """The compaction edit of ``context_management`` (None without one), after checking every
    edit as the API does."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _invalid("context_management: must be an object")
    edits = value.get("edits", [])
    if not isinstance(edits, list):
        raise _invalid("context_management.edits: must be a list")
    found: _Compaction | None = None
    for k, edit in enumerate(edits):
        where = f"context_management.edits.{k}"
        if not isinstance(edit, dict) or not isinstance(edit.get("type"), str):
            raise _invalid(f"{where}: must be an object with a `type`")
        kind = edit["type"]
        if kind == COMPACT_EDIT:
            if COMPACT_BETA not in betas:
                raise _invalid(
                    f"{where}: `{COMPACT_EDIT}` needs the anthropic-beta header {COMPACT_BETA!r}"
                )
            if found is not None:
                raise _invalid(f"{where}: only one `{COMPACT_EDIT}` edit is allowed")
            found = _compaction_config(edit, where)
        elif kind in (CLEAR_TOOL_USES_EDIT, CLEAR_THINKING_EDIT):
            if CONTEXT_EDITING_BETA not in betas:
                raise _invalid(
                    f"{where}: `{kind}` needs the anthropic-beta header {CONTEXT_EDITING_BETA!r}"
                )
            if kind == CLEAR_THINKING_EDIT and k != 0:
                raise _invalid(f"{where}: `{CLEAR_THINKING_EDIT}` must be the first edit")
        else:
            raise _invalid(f"{where}.type: unknown context management edit {kind!r}")
    return found


def _compaction_config(edit: dict[str, Any], where: str) -> _Compaction:
    trigger = edit.get("trigger")
    value = DEFAULT_COMPACTION_TRIGGER
    if trigger is not None:
        given = trigger.get("value") if isinstance(trigger, dict) else None
        if (
            not isinstance(trigger, dict)
            or trigger.get("type") != "input_tokens"
            or not isinstance(given, int)
            or isinstance(given, bool)
        ):
            raise _invalid(f'{where}.trigger: must be {{"type": "input_tokens", "value": <int>}}')
        value = given
        if value < OFFLINE_MIN_COMPACTION_TRIGGER:
            raise _invalid(
                f"{where}.trigger.value: must be at least {OFFLINE_MIN_COMPACTION_TRIGGER} "
                f"offline (the API wants at least {API_MIN_COMPACTION_TRIGGER})"
            )
    pause = edit.get("pause_after_compaction", False)
    if not isinstance(pause, bool):
        raise _invalid(f"{where}.pause_after_compaction: must be a boolean")
    instructions = edit.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise _invalid(f"{where}.instructions: must be a string or null")
    return _Compaction(value, pause, instructions)


def _cache_control(value: Any) -> bool:
    """Whether the request asks for automatic prompt caching (checked as the API does)."""
    if value is None:
        return False
    if (
        not isinstance(value, dict)
        or value.get("type") != "ephemeral"
        or value.get("ttl", "5m") not in ("5m", "1h")
        or set(value) - {"type", "ttl"}
    ):
        raise _invalid('cache_control: must be {"type": "ephemeral"} (with an optional "ttl")')
    return True


# ---------------------------------------------------------------------------------------------
# Ways to put the model behind the real SDK


def offline_client(*, scripted: ScriptedModel | None = None, **kwargs: Any) -> anthropic.Anthropic:
    """A real ``anthropic.Anthropic`` whose HTTP goes to a ``ScriptedModel`` in-process.

    ``kwargs`` go to ``anthropic.Anthropic`` and may override the defaults below."""
    model = scripted or ScriptedModel()
    options: dict[str, Any] = {
        "api_key": "offline",
        "base_url": "http://offline.invalid",
        "http_client": httpx2.Client(transport=httpx2.MockTransport(model.handle)),
    }
    options.update(kwargs)
    return anthropic.Anthropic(**options)


def _chunks(text: str, size: int = 12) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)] or [""]


def _sse(event: str, data: dict[str, Any]) -> bytes:
    return b"event: %s\ndata: %s\n\n" % (event.encode(), _json_bytes(data, (", ", ": ")))


def _sse_events(payload: dict[str, Any], chunk_latency: float) -> Iterator[bytes]:
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
                for part in _chunks(_json_bytes(block["input"]).decode("utf-8"), 16)
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


class OfflineServer:
    """The scripted model behind a real HTTP server on 127.0.0.1 (a daemon thread).

    ``with OfflineServer() as server: anthropic.Anthropic(api_key="x", base_url=server.base_url)``
    """

    def __init__(self, scripted: ScriptedModel | None = None, port: int = 0) -> None:
        self.scripted = scripted or ScriptedModel()
        scripted_model = self.scripted

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _serve(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length) if length else b""
                headers = {k.lower(): v for k, v in self.headers.items()}
                status, out_headers, out = scripted_model.respond(
                    self.command, self.path, headers, body
                )
                self.send_response(status)
                for k, v in out_headers.items():
                    self.send_header(k, v)
                self.send_header("content-length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _serve

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass  # keep test output quiet

        self._server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_port}"  # where it is bound

    def start(self) -> OfflineServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> OfflineServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
