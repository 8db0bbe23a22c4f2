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

Thinking signatures are the point of this module: like the real API, a thinking block is only
accepted back if everything it was produced from (model, system, tools, earlier messages, its
text) is sent back byte-identical in value and key order. This is what lets tests prove that a
durable store replays history verbatim. It deliberately imports neither Django nor the database.
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
from typing import Any

import anthropic
import httpx2

from durable_agents.deepjson import dumps_deep, loads_deep, raw_decode_deep

__all__ = [
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
    tools, earlier_messages, thinking_text]))). ``system`` and ``tools`` are as sent (``None``
    when absent); ``earlier_messages`` are the request's messages before the block's turn."""
    payload = canonical_bytes([model, system, tools, earlier_messages, thinking_text])
    return base64.b64encode(hmac.new(secret, payload, hashlib.sha256).digest()).decode("ascii")


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
                method, path, body, request_id, streamed=True
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
            payload, latency, _ = self._answer(method, path, body, request_id)
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
        self, method: str, path: str, body: bytes, request_id: str, streamed: bool = False
    ) -> tuple[dict[str, Any], float, float]:
        path = path.split("?", 1)[0]
        if method.upper() != "POST" or path.rstrip("/") != MESSAGES_PATH:
            raise _RequestError(404, "not_found_error", f"{method.upper()} {path}: not found")
        req = self._parse_body(body, streamed)
        model: str = req["model"]
        if not model.startswith("claude-") or model in RETIRED_MODELS:
            raise _RequestError(404, "not_found_error", f"model: {model}")
        messages: list[dict[str, Any]] = req["messages"]
        self._check_structure(messages)
        system, tools = req.get("system"), req.get("tools")
        self._check_signatures(model, system, tools, messages)

        script = _parse_script(_text_of(messages[0]["content"]))
        turn = sum(1 for m in messages if m["role"] == "assistant")
        thinking = req.get("thinking")
        thinking_on = isinstance(thinking, dict) and thinking.get("type") == "enabled"

        content: list[dict[str, Any]] = []
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
        if thinking_on:
            content.append(
                {
                    "type": "thinking",
                    "thinking": thought,
                    "signature": sign(self.secret, model, system, tools, messages, thought),
                }
            )
        content.append({"type": "text", "text": text})
        task_text = _text_of(messages[0]["content"])
        for index, call in enumerate(calls):
            content.append(
                {
                    "type": "tool_use",
                    "id": "toolu_" + _hex24("tool_use", model, turn, index, task_text),
                    "name": call.name,
                    "input": call.input,
                }
            )

        payload = {
            "id": "msg_offline_" + _hex24("message", body),
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": None,
            "usage": {
                "input_tokens": max(1, len(body) // 4),
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 0,
                "output_tokens": max(1, len(canonical_bytes(content)) // 4),
                "service_tier": "standard",
            },
            "container": None,
            # Not modelled by the SDK: lets tests check that the raw body is stored verbatim.
            "offline_script": {"turn": turn, "plan_lines": len(script.plan)},
        }
        return payload, script.latency, script.chunk_latency

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
            expected = "user" if i % 2 == 0 else "assistant"
            if m.get("role") != expected:
                raise _invalid(
                    f"messages.{i}.role: roles must alternate between `user` and `assistant`, "
                    f"starting with `user`; expected `{expected}`, got {m.get('role')!r}"
                )
            content = m.get("content")
            if not isinstance(content, str | list):
                raise _invalid(f"messages.{i}.content: must be a string or a list of blocks")
            for j, b in enumerate(_blocks(content)):
                if not isinstance(b, dict) or not isinstance(b.get("type"), str):
                    raise _invalid(f"messages.{i}.content.{j}: must be a block with a `type`")
        if messages[-1]["role"] != "user":
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
        self, model: str, system: Any, tools: Any, messages: list[dict[str, Any]]
    ) -> None:
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            for j, b in enumerate(_blocks(m["content"])):
                if b["type"] != "thinking":
                    continue  # redacted_thinking is opaque and left unchecked
                given = b.get("signature")
                expected = sign(self.secret, model, system, tools, messages[:i], b.get("thinking"))
                if not isinstance(given, str) or not hmac.compare_digest(given, expected):
                    raise _invalid(f"messages.{i}.content.{j}: {SIGNATURE_ERROR}")


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
        if kind == "thinking":
            opening = {"type": "thinking", "thinking": "", "signature": ""}
            deltas = [
                {"type": "thinking_delta", "thinking": part} for part in _chunks(block["thinking"])
            ]
            deltas.append({"type": "signature_delta", "signature": block["signature"]})
        elif kind == "text":
            opening = {"type": "text", "text": ""}
            deltas = [{"type": "text_delta", "text": part} for part in _chunks(block["text"])]
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
                "usage": {"output_tokens": payload["usage"]["output_tokens"]},
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
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

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
