"""The offline model: ``ScriptedModel`` answers ``POST /v1/messages`` as a pure function of the
request, playing the script written in the task; given ``RateLimits``, it also limits requests
as the API does (429s, ``anthropic-ratelimit-*`` headers). The Message Batches endpoints
(``/v1/messages/batches``) go to its ``BatchDesk``."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

import httpx2

from durable_agents._internal.deepjson import loads_deep
from durable_agents.offline.batches import BatchDesk, is_batch_path, shared_batch_desk
from durable_agents.offline.compaction import (
    CompactionEdit,
    View,
    compaction_block,
    compaction_edit,
    view_of,
)
from durable_agents.offline.limits import (
    Admission,
    RateLimits,
    Rejection,
    billed_input_tokens,
    billed_output_tokens,
    key_of,
)
from durable_agents.offline.requests import (
    cache_control,
    check_output_config,
    check_signatures,
    check_structure,
    parse_body,
)
from durable_agents.offline.script import PlanCall, Script, script_of
from durable_agents.offline.signatures import Signer, canonical_bytes
from durable_agents.offline.sse import sse_events
from durable_agents.offline.wire import (
    DEFAULT_SECRET,
    MESSAGES_PATH,
    RETIRED_MODELS,
    RequestError,
    Response,
    betas_of,
    compaction_only,
    hex24,
    json_bytes,
)


@dataclasses.dataclass
class _Request:
    """A request that passed every check, with what the answer is computed from."""

    model: str
    max_tokens: int
    system: Any
    tools: Any
    thinking_on: bool
    compaction: CompactionEdit | None
    cached: bool
    view: View
    signer: Signer  # over every message the model reads
    parts: list[bytes]  # each read message's canonical bytes


@dataclasses.dataclass
class _Answer:
    """The answer to a request that passed every check, and how it is to be sent."""

    payload: dict[str, Any]
    latency: float
    chunk_latency: float
    max_tokens: int
    task: str

    def admit(self, limits: RateLimits | None) -> Admission | Rejection | None:
        """Charge the rate limits for it as its request starts (``None``: no limits). What it
        is charged is what its usage bills, so a client that settles with usage agrees."""
        if limits is None:
            return None
        billed = billed_input_tokens(self.payload["usage"])
        return limits.admit(billed, self.max_tokens, key_of(self.task))


@dataclasses.dataclass
class _Input:
    """The input tokens billed: read in all, of which read from the prompt cache."""

    read: int
    cache_read: int
    body_bytes: int  # of the request body the model reads (from the last compaction block on)


class ScriptedModel:
    """The offline model. ``respond`` is a pure function of the request (plus a sleep when the
    task asks for latency): the same request bytes always give the same response bytes.

    ``rate_limits``: limit requests as the API does (``RateLimits``, shared by every client of
    this model). A request is charged its usage's billed input tokens (``input_tokens`` plus
    ``cache_creation_input_tokens``) and its ``max_tokens`` as it starts, corrected to its
    output tokens when its answer is complete; a request some bucket cannot serve gets a 429
    ``rate_limit_error`` with ``retry-after``, and every answer the ``anthropic-ratelimit-*``
    headers. A task may name its concurrency key with a ``[key:NAME]`` marker, counted in
    ``rate_limits.stats()``.

    ``batches``: the ``BatchDesk`` that answers the Message Batches endpoints (by default the
    process-wide one, shared by every model not given one); a batch's requests are answered by
    this model as direct requests are, without the rate limits (batches have limits of their
    own) or the script's latency. ``direct_calls`` counts the ``POST /v1/messages`` requests
    (those outside any batch)."""

    def __init__(
        self,
        secret: bytes = DEFAULT_SECRET,
        *,
        rate_limits: RateLimits | None = None,
        batches: BatchDesk | None = None,
    ) -> None:
        self.secret = secret
        self.rate_limits = rate_limits
        self.batches = batches if batches is not None else shared_batch_desk()
        self.direct_calls = 0
        self._calls_lock = threading.Lock()

    # -- transport adapters --------------------------------------------------------------

    def handle(self, request: httpx2.Request) -> httpx2.Response:
        """Handler for ``httpx2.MockTransport``; streamed requests get a streamed body."""
        path = request.url.path
        if is_batch_path(path) and request.url.query:
            path += "?" + request.url.query.decode("ascii")  # the list's paging
        status, headers, chunks = self.respond_stream(
            request.method, path, request.headers, request.read()
        )
        return httpx2.Response(status, headers=headers, content=chunks)

    def respond_stream(
        self, method: str, path: str, headers: Mapping[str, str], body: bytes
    ) -> tuple[int, dict[str, str], Iterator[bytes]]:
        """Like ``respond``, but a request with ``"stream": true`` is answered with server-sent
        events (``@@chunk_latency`` seconds apart) that assemble into exactly the message
        ``respond`` would have returned."""
        if is_batch_path(path):
            status, out_headers, out = self.respond(method, path, headers, body)
            return status, out_headers, iter([out])
        try:
            streamed = loads_deep(body).get("stream") is True
        except (ValueError, AttributeError, UnicodeDecodeError):
            streamed = False
        if not streamed:
            status, out_headers, out = self.respond(method, path, headers, body)
            return status, out_headers, iter([out])
        self._count_direct(method, path)
        request_id = "req_offline_" + hex24("request", method, path, body)
        try:
            answer = self._answer(method, path, body, request_id, streamed=True, headers=headers)
        except RequestError as e:
            status, out_headers, out = self._error(e, request_id)
            return status, out_headers, iter([out])
        admission = answer.admit(self.rate_limits)
        if isinstance(admission, Rejection):
            status, out_headers, out = self._rejected(admission, request_id)
            return status, out_headers, iter([out])
        if answer.latency:
            time.sleep(answer.latency)
        sse_headers = self._headers(request_id)
        sse_headers["content-type"] = "text/event-stream"
        chunks = sse_events(answer.payload, answer.chunk_latency)
        if admission is not None:
            chunks = self._settling(chunks, admission, answer.payload["usage"])
        return 200, sse_headers, chunks

    def _settling(
        self, chunks: Iterator[bytes], admission: Admission, usage: dict[str, Any]
    ) -> Iterator[bytes]:
        """``chunks``, then the request's end: settled when the stream ends or is dropped."""
        assert self.rate_limits is not None
        try:
            yield from chunks
        finally:
            self.rate_limits.settle(admission, billed_output_tokens(usage))

    # -- the API -------------------------------------------------------------------------

    def respond(self, method: str, path: str, headers: Mapping[str, str], body: bytes) -> Response:
        if is_batch_path(path):
            return self.batches.respond(method, path, headers, body, self._batch_answer)
        self._count_direct(method, path)
        request_id = "req_offline_" + hex24("request", method, path, body)
        try:
            answer = self._answer(method, path, body, request_id, headers=headers)
        except RequestError as e:
            return self._error(e, request_id)
        admission = answer.admit(self.rate_limits)
        if isinstance(admission, Rejection):
            return self._rejected(admission, request_id)
        if answer.latency:
            time.sleep(answer.latency)
        if admission is not None:
            assert self.rate_limits is not None
            self.rate_limits.settle(admission, billed_output_tokens(answer.payload["usage"]))
        return 200, self._headers(request_id), self._dump(answer.payload)

    def _batch_answer(self, headers: Mapping[str, str], body: bytes) -> Response:
        """The answer to one request of a batch: the bytes ``respond`` gives for it, without the
        rate limits or the script's latency."""
        request_id = "req_offline_" + hex24("request", "POST", MESSAGES_PATH, body)
        try:
            answer = self._answer("POST", MESSAGES_PATH, body, request_id, headers=headers)
        except RequestError as e:
            return self._error(e, request_id)
        headers = {"content-type": "application/json", "request-id": request_id}
        return 200, headers, self._dump(answer.payload)

    def _count_direct(self, method: str, path: str) -> None:
        if method.upper() == "POST" and path.split("?", 1)[0].rstrip("/") == MESSAGES_PATH:
            with self._calls_lock:
                self.direct_calls += 1

    def _headers(self, request_id: str) -> dict[str, str]:
        headers = {"content-type": "application/json", "request-id": request_id}
        if self.rate_limits is not None:
            headers.update(self.rate_limits.headers())
        return headers

    def _error(self, e: RequestError, request_id: str) -> Response:
        payload = {
            "type": "error",
            "error": {"type": e.error_type, "message": e.message},
            "request_id": request_id,
        }
        return e.status, self._headers(request_id), self._dump(payload)

    def _rejected(self, rejection: Rejection, request_id: str) -> Response:
        """The API's 429: its error body, ``retry-after`` and the rate-limit headers."""
        headers = {"content-type": "application/json", "request-id": request_id}
        headers.update(rejection.headers)
        payload = {**rejection.body(), "request_id": request_id}
        return 429, headers, self._dump(payload)

    @staticmethod
    def _dump(payload: dict[str, Any]) -> bytes:
        return json_bytes(payload, separators=(", ", ": "))

    def _answer(
        self,
        method: str,
        path: str,
        body: bytes,
        request_id: str,
        streamed: bool = False,
        headers: Mapping[str, str] | None = None,
    ) -> _Answer:
        req = self._read(method, path, body, streamed, headers or {})
        script = script_of(req.view.task)
        turn = req.view.turns_before + sum(
            1
            for m in req.view.messages
            if m["role"] == "assistant" and not compaction_only(m["content"])
        )
        billed = _input_of(req, body)
        content: list[dict[str, Any]] = []
        iterations: list[dict[str, Any]] = []
        signer = req.signer
        if req.compaction is not None and _compaction_fires(req, req.compaction):
            block, signer = self._compact(req, turn, script, billed, iterations)
            content.append(block)
            if req.compaction.pause:
                # Paused after the compaction: the message pass is the next request's.
                usage = _usage_entry(None, 0, 0, 0, 0)
                return self._message(
                    req, body, turn, script, content, "compaction", usage, iterations
                )
        failed = _failed_call(req.view.messages[-1]) if script.stop_on_error else None
        blocks, stop_reason = self._turn_blocks(
            req.model, turn, script, req.view.task, req.thinking_on, signer, failed
        )
        content.extend(blocks)
        output = max(1, len(canonical_bytes(blocks)) // 4)
        if req.cached:
            created = billed.read - billed.cache_read
            usage = _usage_entry(None, 0, created, billed.cache_read, output)
        else:
            usage = _usage_entry(None, billed.read, 0, 0, output)
        if iterations:
            iterations.append({"type": "message", **usage})
        return self._message(req, body, turn, script, content, stop_reason, usage, iterations)

    def _read(
        self, method: str, path: str, body: bytes, streamed: bool, headers: Mapping[str, str]
    ) -> _Request:
        """The request, checked as the API checks it (else the error it would answer)."""
        path = path.split("?", 1)[0]
        if method.upper() != "POST" or path.rstrip("/") != MESSAGES_PATH:
            raise RequestError(404, "not_found_error", f"{method.upper()} {path}: not found")
        req = parse_body(body, streamed)
        model: str = req["model"]
        if not model.startswith("claude-") or model in RETIRED_MODELS:
            raise RequestError(404, "not_found_error", f"model: {model}")
        betas = betas_of(headers)
        compaction = compaction_edit(req.get("context_management"), betas)
        cached = cache_control(req.get("cache_control"))
        check_output_config(req.get("output_config"))
        messages: list[dict[str, Any]] = req["messages"]
        check_structure(messages)
        view = view_of(self.secret, model, messages, betas)
        system, tools = req.get("system"), req.get("tools")
        signer, parts = check_signatures(self.secret, model, system, tools, view)
        thinking = req.get("thinking")
        thinking_on = isinstance(thinking, dict) and thinking.get("type") == "enabled"
        return _Request(
            model,
            req["max_tokens"],
            system,
            tools,
            thinking_on,
            compaction,
            cached,
            view,
            signer,
            parts,
        )

    def _compact(
        self,
        req: _Request,
        turn: int,
        script: Script,
        billed: _Input,
        iterations: list[dict[str, Any]],
    ) -> tuple[dict[str, Any], Signer]:
        """The compaction block of this answer, with its pass in ``iterations``; ``billed``
        becomes what the message pass reads (the summary instead of what it replaces). Returns
        the block and the signer of the message pass, over the summary alone."""
        assert req.compaction is not None
        block = compaction_block(self.secret, req.model, turn, req.view, script, req.compaction)
        iterations.append(
            _usage_entry("compaction", billed.read, 0, 0, max(1, len(canonical_bytes(block)) // 4))
        )
        summary_bytes = canonical_bytes({"role": "assistant", "content": [block]})
        billed.read = max(1, (billed.body_bytes - sum(len(p) for p in req.parts)) // 4)
        billed.read += len(summary_bytes) // 4
        billed.cache_read = 0
        signer = Signer(self.secret, req.model, req.system, req.tools)
        signer.add(summary_bytes)
        return block, signer

    @staticmethod
    def _message(
        req: _Request,
        body: bytes,
        turn: int,
        script: Script,
        content: list[dict[str, Any]],
        stop_reason: str,
        usage: dict[str, Any],
        iterations: list[dict[str, Any]],
    ) -> _Answer:
        """The answer's message, and the latencies the script asks for."""
        usage["service_tier"] = "standard"
        if iterations:
            usage["iterations"] = iterations
        payload = {
            "id": "msg_offline_" + hex24("message", body),
            "type": "message",
            "role": "assistant",
            "model": req.model,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": None,
            "usage": usage,
            "container": None,
            # Not modelled by the SDK: lets tests check that the raw body is stored verbatim.
            "offline_script": {"turn": turn, "plan_lines": len(script.plan)},
        }
        return _Answer(payload, script.latency, script.chunk_latency, req.max_tokens, req.view.task)

    def _turn_blocks(
        self,
        model: str,
        turn: int,
        script: Script,
        task_text: str,
        thinking_on: bool,
        signer: Signer,
        failed: str | None = None,
    ) -> tuple[list[dict[str, Any]], str]:
        """The blocks of turn ``turn`` of the script (a thinking block signed by ``signer``,
        the text, the calls) and its stop reason. ``failed``: the error result the model just
        read, under ``@@stop_on_error``: it stops there."""
        calls: list[PlanCall]
        if failed is not None:
            calls = []
            thought = f"Turn {turn + 1}: a tool call failed, so the plan cannot go on."
            text = f"Stopped: a tool call failed: {failed}"
            stop_reason = "end_turn"
        elif turn in script.answers:
            calls = []
            thought = f"Turn {turn + 1}: the plan says to answer now."
            text = script.answers[turn]
            stop_reason = "end_turn"
        elif turn < len(script.plan):
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
                    "id": "toolu_" + hex24("tool_use", model, turn, index, task_text),
                    "name": call.name,
                    "input": call.input,
                }
            )
        return content, stop_reason


def _input_of(req: _Request, body: bytes) -> _Input:
    """What the model reads: the body less what precedes the last compaction block; with
    automatic caching, all but the last two messages come from the cache."""
    dropped = sum(len(canonical_bytes(m)) + 1 for m in req.view.dropped)  # and its comma
    read_before = len(body) - dropped - sum(len(p) for p in req.parts[-2:])
    cache_read = max(0, read_before // 4) if req.cached and len(req.parts) >= 3 else 0
    return _Input(max(1, (len(body) - dropped) // 4), cache_read, len(body) - dropped)


def _compaction_fires(req: _Request, compaction: CompactionEdit) -> bool:
    """Whether the request's compaction edit fires: on a user turn, when what the model reads
    reaches the trigger."""
    return (
        req.view.messages[-1]["role"] == "user"
        and sum(len(p) for p in req.parts) // 4 >= compaction.trigger
    )


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


def _failed_call(message: dict[str, Any]) -> str | None:
    """The content of the first error tool_result in ``message`` (a user message), cut to 200
    characters; None when it holds none."""
    content = message.get("content") if message.get("role") == "user" else None
    if not isinstance(content, list):
        return None
    for block in content:
        if isinstance(block, dict) and block.get("type") == "tool_result" and block.get("is_error"):
            text = block.get("content")
            shown = text if isinstance(text, str) else json.dumps(text, ensure_ascii=False)
            return shown[:200]
    return None
