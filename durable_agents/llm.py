"""Model calls: the client factory, one call, retries that keep the lease, error classes.

Every call goes through the official ``anthropic`` SDK. The request body is built here as JSON
text (the pinned parameters, then the run's messages exactly as history.Conversation keeps
them) and handed to ``client.post(..., content=...)``: the SDK would otherwise walk and
re-serialise the whole history on every call, which grows with the run. The response is read
raw, so the provider's body is stored byte for byte.

The SDK's own retries are switched off: it would sleep for any ``retry-after`` in the calling
thread, blind to cancellation. Here the wait is on an event that the heartbeat sets when the
run is cancelled or its lease is lost, while the heartbeat thread keeps renewing the lease, so
a long retry-after never lets the run be stolen.
Nothing here knows about Django models.
"""

from __future__ import annotations

import contextlib
import dataclasses
import email.utils
import json
import json.scanner
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import anthropic
import httpx2
from django.utils.module_loading import import_string

from durable_agents import calls
from durable_agents.conf import app_settings
from durable_agents.deepjson import loads_deep, value_end
from durable_agents.interrupt import Interrupt
from durable_agents.text import storable_text

logger = logging.getLogger("durable_agents.llm")

RETRYABLE_STATUSES = frozenset({408, 409, 429})


class ModelError(Exception):
    """A model call that did not produce a turn."""

    def __init__(self, message: str, *, status: int | None = None, request_id: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.request_id = request_id


class PermanentModelError(ModelError):
    """Retrying cannot help (400, 404 retired model, 413, 422): the run goes to the dead letter."""


class TransientModelError(ModelError):
    """Retries inside this claim ran out (rate limits, overload, outages, auth)."""


class ModelCallInterrupted(ModelError):
    """The run was cancelled, its lease lost, or the worker is stopping."""


@dataclasses.dataclass(frozen=True)
class ModelTurn:
    body: str  # the response body, verbatim
    request_id: str | None
    message: dict[str, Any]  # json.loads(body)
    elapsed_ms: float
    content_span: tuple[int, int] | None = None  # of the message's content in body


MESSAGES_PATH = "/v1/messages"
_scan_once = json.scanner.make_scanner(json.JSONDecoder())  # type: ignore[attr-defined]


def content_span(body: str) -> tuple[int, int] | None:
    """Where the value of the top-level ``content`` key lies in ``body``, a JSON object, as
    character offsets; None if it has none. Scans the top level only (each value once, by the
    C scanner); with duplicate keys the last wins, as for ``json.loads``."""
    scan, scanstring, size = _scan_once, json.decoder.scanstring, len(body)  # type: ignore[attr-defined]

    def skip(i: int) -> int:
        while i < size and body[i] in " \t\n\r":
            i += 1
        return i

    try:
        i = skip(0)
        if body[i : i + 1] != "{":
            return None
        found = None
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
            if key == "content":
                found = (i, end)
            i = skip(end)
            if body[i : i + 1] != ",":
                break
            i = skip(i + 1)
        return found
    except (ValueError, StopIteration):
        return None


def request_body(params: dict[str, Any], messages: bytes, *, stream: bool = False) -> bytes:
    """The JSON body of a Messages API call: the pinned ``params``, then ``messages`` (a JSON
    array, as sent before: never re-serialised here)."""
    members = json.dumps(params, ensure_ascii=False, separators=(",", ":"))[1:-1].encode()
    if stream:
        members += b',"stream":true' if members else b'"stream":true'
    # One copy of the (possibly large) messages text.
    return b"".join((b"{", members, b"," if members else b"", b'"messages":', messages, b"}"))


def default_client() -> anthropic.Anthropic:
    """``anthropic.Anthropic()`` (ANTHROPIC_API_KEY, ANTHROPIC_BASE_URL), or the offline model."""
    if app_settings.OFFLINE:
        from durable_agents.offline import offline_client

        return offline_client()
    return anthropic.Anthropic()


_clients: dict[tuple[str, bool], anthropic.Anthropic] = {}
_clients_lock = threading.Lock()


def get_client() -> anthropic.Anthropic:
    """One client per (factory, OFFLINE, timeout) per process, with the SDK's own retries off
    (see ``create_turn``); the SDK client is thread-safe."""
    cache_key = (
        app_settings.CLIENT_FACTORY,
        bool(app_settings.OFFLINE),
        app_settings.MODEL_TIMEOUT,
    )
    with _clients_lock:
        client = _clients.get(cache_key)
        if client is None:
            factory: Callable[[], anthropic.Anthropic] = import_string(cache_key[0])
            client = _configured(factory())
            _clients[cache_key] = client
        return client


def _configured(client: anthropic.Anthropic) -> anthropic.Anthropic:
    return client.with_options(max_retries=0, timeout=app_settings.MODEL_TIMEOUT)


def reset_clients() -> None:
    with _clients_lock:
        _clients.clear()


def _error_message(exc: anthropic.APIStatusError) -> str:
    body = exc.body
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            return f"{error.get('type', 'error')}: {error['message']}"
    return str(exc.message)


def _retry_after(headers: Any) -> float | None:
    """Seconds the server asked us to wait (retry-after-ms, retry-after seconds or date)."""
    if headers is None:
        return None
    value = headers.get("retry-after-ms")
    if value:
        try:
            return max(0.0, float(value) / 1000)
        except ValueError:
            pass
    value = headers.get("retry-after")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        parsed = email.utils.parsedate_to_datetime(value)
        return max(0.0, parsed.timestamp() - time.time()) if parsed else None


def _backoff(retry: int) -> float:
    base = min(app_settings.MAX_BACKOFF_SECONDS, 0.5 * 2**retry)
    return base * (0.75 + random.random() / 2)


def classify(exc: Exception, model: str) -> ModelError:
    """Map an SDK exception to what the runner does with it."""
    if isinstance(exc, anthropic.APIStatusError):
        status = exc.status_code
        message = _error_message(exc)
        request_id = exc.request_id
        should_retry = exc.response.headers.get("x-should-retry") if exc.response else None
        if should_retry == "true" or (
            should_retry != "false" and (status in RETRYABLE_STATUSES or status >= 500)
        ):
            return TransientModelError(message, status=status, request_id=request_id)
        if status == 404:
            return PermanentModelError(
                f"model {model!r} is not available (retired or unknown): {message}",
                status=status,
                request_id=request_id,
            )
        if status in (401, 403):
            # Not the run's fault and not fixable by retrying now: hand the run back; the
            # no-progress count dead-letters it if the key stays wrong.
            return TransientModelError(
                f"authentication failed ({status}): {message}", status=status, request_id=request_id
            )
        return PermanentModelError(
            f"the API rejected the request ({status}): {message}",
            status=status,
            request_id=request_id,
        )
    if isinstance(exc, anthropic.APIConnectionError):
        return TransientModelError(f"{type(exc).__name__}: {exc}")
    return TransientModelError(f"{type(exc).__name__}: {exc}")


def create_turn(
    params: dict[str, Any],
    messages: bytes | list[dict[str, Any]],
    *,
    interrupt: Interrupt,
    client: anthropic.Anthropic | None = None,
    stream: bool = False,
    on_text: Callable[[str], None] | None = None,
    meanwhile: Callable[[], None] | None = None,
) -> ModelTurn:
    """Call the Messages API until it answers, retrying what may be retried.

    ``params`` is the pinned request (model, max_tokens, system, tools, ...); ``messages`` the
    JSON text of the messages (a list is encoded first, for tests and one-off calls). The call
    runs in its own thread so that an interrupt (cancellation, lost lease, shutdown) returns
    control at once; an abandoned stream is closed at its next event, so the model stops
    generating. Waits between retries end early on an interrupt too. Raises a ``ModelError``
    subclass.

    ``meanwhile`` (the commit of the previous step) runs exactly once on this thread: while the
    first attempt is in flight, or before anything is raised. If it raises, the call is
    abandoned and its exception propagates.
    """
    # Copying a client costs about half a millisecond: the cached one is configured already.
    client = get_client() if client is None else _configured(client)
    extra_headers = {}
    if app_settings.BETAS:
        extra_headers["anthropic-beta"] = ",".join(app_settings.BETAS)
    model = str(params.get("model"))
    if not isinstance(messages, bytes):
        messages = json.dumps(messages, ensure_ascii=False, separators=(",", ":")).encode()
    body = request_body(params, messages, stream=stream)
    once = _Once(meanwhile) if meanwhile is not None else None
    try:
        return _create_turn(client, body, model, extra_headers, interrupt, stream, on_text, once)
    except BaseException:
        if once is not None:
            once()  # no-op if it ran; else the call never went out (an interrupt came first)
        raise


def _turn(text: str, request_id: str | None, started: float) -> ModelTurn:
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


class _Once:
    def __init__(self, func: Callable[[], None]) -> None:
        self.func: Callable[[], None] | None = func

    def __call__(self) -> None:
        func, self.func = self.func, None
        if func is not None:
            func()


def _create_turn(
    client: anthropic.Anthropic,
    body: bytes,
    model: str,
    extra_headers: dict[str, str],
    interrupt: Interrupt,
    stream: bool,
    on_text: Callable[[str], None] | None,
    meanwhile: _Once | None,
) -> ModelTurn:
    retries = app_settings.MODEL_RETRIES
    for retry in range(retries + 1):
        if interrupt.is_set():
            raise ModelCallInterrupted("interrupted before the model call")
        started = time.monotonic()

        def call(abort: threading.Event) -> tuple[str, str | None]:
            if stream:
                return _streamed(client, body, extra_headers, abort, on_text)
            return _posted(client, body, extra_headers)

        try:
            try:
                text, request_id = calls.run_abortable(
                    call, interrupt, meanwhile=meanwhile if retry == 0 else None
                )
            except calls.CallInterrupted as exc:
                raise ModelCallInterrupted(
                    f"model call abandoned: {interrupt.reason or 'interrupted'}"
                ) from exc
            return _turn(text, request_id, started)
        except ModelCallInterrupted:
            raise
        except (anthropic.APIError, ModelError, httpx2.HTTPError, ValueError) as exc:
            # ValueError: an undecodable body; httpx2.HTTPError: a stream cut mid-way.
            error = exc if isinstance(exc, ModelError) else classify(exc, model)
            if not isinstance(error, TransientModelError) or error.status in (401, 403):
                raise error from exc
            if retry == retries:
                raise error from exc
            headers = exc.response.headers if isinstance(exc, anthropic.APIStatusError) else None
            delay = _retry_after(headers)
            if delay is None:
                delay = _backoff(retry)
            logger.warning(
                "model call failed (%s), retry %d/%d in %.1fs",
                error.message,
                retry + 1,
                retries,
                delay,
            )
            if interrupt.wait(delay):
                raise ModelCallInterrupted("interrupted while waiting to retry") from exc
    raise AssertionError("unreachable")


def _sends_raw_bodies(client: anthropic.Anthropic) -> bool:
    # The first-party client posts a body as given. Other clients (Bedrock, Vertex) rewrite
    # the path and body from the parsed parameters, so they get them parsed.
    return isinstance(client, anthropic.Anthropic)


def _posted(
    client: anthropic.Anthropic, body: bytes, extra_headers: dict[str, str]
) -> tuple[str, str | None]:
    """One non-streamed call; the response body verbatim and the provider's request id."""
    if not _sends_raw_bodies(client):
        raw = client.messages.with_raw_response.create(
            **json.loads(body), extra_headers=extra_headers or None
        )
        return raw.http_response.content.decode("utf-8"), raw.request_id
    # Errors raise the SDK's APIStatusError subclasses, as messages.create would.
    response = client.post(
        MESSAGES_PATH,
        cast_to=httpx2.Response,
        content=body,
        options={"headers": extra_headers} if extra_headers else {},
    )
    return response.content.decode("utf-8"), response.headers.get("request-id")


@contextlib.contextmanager
def _event_stream(
    client: anthropic.Anthropic, body: bytes, extra_headers: dict[str, str]
) -> Iterator[tuple[httpx2.Response, str | None]]:
    if not _sends_raw_bodies(client):
        params = json.loads(body)
        with client.messages.with_streaming_response.create(
            **params, extra_headers=extra_headers or None
        ) as response:
            yield response.http_response, response.request_id
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


def _streamed(
    client: anthropic.Anthropic,
    body: bytes,
    extra_headers: dict[str, str],
    abort: threading.Event,
    on_text: Callable[[str], None] | None,
) -> tuple[str, str | None]:
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
                index = data["index"]
                if index in partial_json:
                    text = partial_json.pop(index)
                    message["content"][index]["input"] = json.loads(text) if text else {}
            elif kind == "message_delta":
                assert message is not None
                for key, value in (data.get("delta") or {}).items():
                    message[key] = value
                if "usage" in data:
                    message.setdefault("usage", {}).update(data["usage"])
            elif kind == "message_stop":
                if message is None:
                    raise TransientModelError("stream ended without message_start")
                return json.dumps(message, ensure_ascii=False), request_id
            elif kind == "error":
                error = data.get("error") or {}
                text = f"{error.get('type', 'error')}: {error.get('message', '')}"
                if error.get("type") in ("overloaded_error", "api_error", "rate_limit_error"):
                    raise TransientModelError(f"error event in the stream: {text}")
                raise PermanentModelError(f"error event in the stream: {text}")
        raise TransientModelError("the stream ended before message_stop; nothing was committed")


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
    else:
        # An unknown delta: keep its fields rather than lose them.
        for key, value in delta.items():
            if key != "type":
                block[key] = value
