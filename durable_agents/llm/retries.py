"""One model call, retried until it answers: ``create_turn``.

The SDK's own retries are switched off: it would sleep for any ``retry-after`` in the calling
thread, blind to cancellation. Here the wait is on an event that the heartbeat sets when the
run is cancelled or its lease is lost, while the heartbeat thread keeps renewing the lease, so
a long retry-after never lets the run be stolen. ``classify`` sorts what the SDK raises into
what may be retried and what may not.

Each attempt is reported once to ``durable_agents.observers`` (``model_attempt``, with its
outcome) inside the scope of its ``chat`` span (``model_call(...).attempt()``); the outcome of
the call as a whole is that of its last attempt, reported from here and nowhere else.
"""

from __future__ import annotations

import email.utils
import json
import logging
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import anthropic
import httpx2

from durable_agents import observers
from durable_agents._internal import calls
from durable_agents._internal.interrupt import Interrupt
from durable_agents.conf import app_settings
from durable_agents.llm.body import read_turn, request_body
from durable_agents.llm.client import (
    Answer,
    configured,
    get_client,
    post_message,
    rate_limit_headers,
)
from durable_agents.llm.errors import (
    CredentialsRefused,
    ModelCallInterrupted,
    ModelError,
    ModelTurn,
    PermanentModelError,
    TransientModelError,
)
from durable_agents.llm.sse import stream_message
from durable_agents.observers import ModelOutcome

logger = logging.getLogger("durable_agents.llm")

RETRYABLE_STATUSES = frozenset({408, 409, 429})
# What the SDK raises (a TypeError) when a client has neither an API key nor a token to send.
NO_CREDENTIALS = "Could not resolve authentication method"


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


def backoff_ceiling(retry: int) -> float:
    """Seconds before retry number ``retry`` + 1 when the server named none (before jitter):
    doubling from half a second, at most MAX_BACKOFF_SECONDS."""
    return min(float(app_settings.MAX_BACKOFF_SECONDS), 0.5 * 2.0 ** min(retry, 16))


def _backoff(retry: int) -> float:
    return backoff_ceiling(retry) * (0.75 + random.random() / 2)


def classify(exc: Exception, model: str) -> ModelError:
    """Map an SDK exception to what the runner does with it."""
    if isinstance(exc, anthropic.APIStatusError):
        status = exc.status_code
        message = _error_message(exc)
        request_id = exc.request_id
        headers = exc.response.headers if exc.response else None
        should_retry = headers.get("x-should-retry") if headers is not None else None
        if should_retry == "true" or (
            should_retry != "false" and (status in RETRYABLE_STATUSES or status >= 500)
        ):
            return TransientModelError(
                message,
                status=status,
                request_id=request_id,
                retry_after=_retry_after(headers),
                rate_headers=rate_limit_headers(headers),
            )
        if status == 404:
            return PermanentModelError(
                f"model {model!r} is not available (retired or unknown): {message}",
                status=status,
                request_id=request_id,
            )
        if status in (401, 403):
            # Not the run's fault and not fixable by retrying now: the run is handed back
            # uncounted and the worker pauses its claims until the key works.
            return CredentialsRefused(message, status=status, request_id=request_id)
        return PermanentModelError(
            f"the API rejected the request ({status}): {message}",
            status=status,
            request_id=request_id,
        )
    if isinstance(exc, anthropic.APIConnectionError):
        return TransientModelError(f"{type(exc).__name__}: {exc}")
    if isinstance(exc, TypeError) and NO_CREDENTIALS in str(exc):
        # The SDK found neither an API key nor a token to send: a refusal before the call.
        return CredentialsRefused(" ".join(str(exc).strip('"').split()))
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
    retry_rate_limits: bool = True,
) -> ModelTurn:
    """Call the Messages API until it answers, retrying what may be retried.

    ``params`` is the pinned request (model, max_tokens, system, tools, ...; its ``betas``, if
    any, are sent as ``anthropic-beta`` after the ``BETAS`` setting's); ``messages`` the
    JSON text of the messages (a list is encoded first, for tests and one-off calls). The call
    runs in its own thread so that an interrupt (cancellation, lost lease, shutdown) returns
    control at once; an abandoned stream is closed at its next event, so the model stops
    generating. Waits between retries end early on an interrupt, and on a drain of the worker
    (``ModelCallInterrupted`` with what is left of a ``retry_after`` the server named). Raises
    a ``ModelError`` subclass.

    ``meanwhile`` (the commit of the previous step) runs exactly once on this thread: while the
    first attempt is in flight, or before anything is raised. If it raises, the call is
    abandoned and its exception propagates.

    ``retry_rate_limits=False``: a 429 is raised at once (``TransientModelError.rate_limited``,
    with its ``retry_after``), for a caller that waits for capacity fleet-wide instead.
    """
    # Copying a client costs about half a millisecond: the cached one is configured already.
    client = get_client() if client is None else configured(client)
    extra_headers = {}
    agent_betas = params.get("betas")
    if agent_betas is not None:
        # The agent's anthropic-beta values (``Agent(betas=...)``) ride in the pinned request
        # parameters, as the SDK's ``betas=`` argument does; they are a header, not a body key.
        params = {key: value for key, value in params.items() if key != "betas"}
    betas = beta_header(app_settings.BETAS, agent_betas)
    if betas:
        extra_headers["anthropic-beta"] = betas
    model = str(params.get("model"))
    if not isinstance(messages, bytes):
        messages = json.dumps(messages, ensure_ascii=False, separators=(",", ":")).encode()
    body = request_body(params, messages, stream=stream)
    once = _Once(meanwhile) if meanwhile is not None else None
    spans = observers.model_call(params, messages, stream=stream, client=client)
    try:
        return _create_turn(
            client,
            body,
            model,
            extra_headers,
            interrupt,
            stream,
            on_text,
            once,
            spans,
            retry_rate_limits,
        )
    except BaseException:
        if once is not None:
            once()  # no-op if it ran; else the call never went out (an interrupt came first)
        raise


def beta_header(*lists: Any) -> str:
    """The ``anthropic-beta`` header value of a call: the values of each list in turn (the
    global ``BETAS`` setting first, then the agent's), duplicates dropped, order kept; "" when
    there are none."""
    return ",".join(dict.fromkeys(beta for values in lists if values for beta in values))


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
    spans: observers.ModelCall,
    retry_rate_limits: bool = True,
) -> ModelTurn:
    def call(abort: threading.Event) -> Answer:
        if stream:
            return stream_message(client, body, extra_headers, abort, on_text)
        return post_message(client, body, extra_headers)

    retries = app_settings.MODEL_RETRIES
    retry = 0
    while True:
        last = retry >= retries  # whatever the last attempt raises is what the call raises
        try:
            return _attempt(
                call, model, interrupt, meanwhile, spans, last=last, retry_429=retry_rate_limits
            )
        except TransientModelError as error:
            if last or not _retryable(error) or (error.rate_limited and not retry_rate_limits):
                raise
            exc = error.__cause__
            delay = error.retry_after
            if delay is None:
                delay = _backoff(retry)
            logger.warning(
                "model call failed (%s), retry %d/%d in %.1fs",
                error.message,
                retry + 1,
                retries,
                delay,
            )
            retry_at = time.monotonic() + delay
            # Nothing is in flight during this pause: a draining worker ends it at once (the
            # run is handed back) instead of sleeping out its shutdown grace.
            if interrupt.wait_unless_draining(delay):
                # How much of a wait the server asked for is left: the next claim honours it.
                left = max(0.0, retry_at - time.monotonic()) if error.retry_after else None
                raise ModelCallInterrupted(
                    f"stopped while waiting to retry after: {error.message}",
                    status=error.status,
                    retry_after=left,
                ) from exc
        meanwhile = None  # it goes with the first attempt only
        retry += 1


def _retryable(error: ModelError) -> bool:
    # An authentication failure is transient (the run is handed back) but asking again now
    # cannot help.
    return isinstance(error, TransientModelError) and not isinstance(error, CredentialsRefused)


def _outcome(error: ModelError, last: bool) -> ModelOutcome:
    """What an attempt that raised ``error`` is reported as."""
    if isinstance(error, ModelCallInterrupted):
        return ModelOutcome.INTERRUPTED
    if isinstance(error, PermanentModelError):
        return ModelOutcome.PERMANENT_ERROR
    if last or not _retryable(error):
        return ModelOutcome.TRANSIENT_ERROR
    return ModelOutcome.RETRIED


def _attempt(
    call: Callable[[threading.Event], Answer],
    model: str,
    interrupt: Interrupt,
    meanwhile: _Once | None,
    spans: observers.ModelCall,
    *,
    last: bool,
    retry_429: bool = True,
) -> ModelTurn:
    """One call (one ``chat`` span), reported once: the turn, or a ``ModelError`` whose
    ``__cause__`` is what went wrong. ``last``: no retry follows a transient error."""
    if interrupt.is_set():
        raise ModelCallInterrupted("interrupted before the model call")
    started = time.monotonic()
    try:
        turn = _call_once(call, model, interrupt, meanwhile, spans, started)
    except ModelError as error:
        final = last or (error.rate_limited and not retry_429)
        observers.model_attempt(model, _outcome(error, final), time.monotonic() - started)
        raise
    observers.model_attempt(model, ModelOutcome.OK, turn.elapsed_ms / 1000)
    return turn


def _call_once(
    call: Callable[[threading.Event], Answer],
    model: str,
    interrupt: Interrupt,
    meanwhile: _Once | None,
    spans: observers.ModelCall,
    started: float,
) -> ModelTurn:
    with spans.attempt() as span:
        try:
            try:
                text, request_id, headers = calls.run_abortable(
                    call, interrupt, meanwhile=meanwhile
                )
            except calls.CallInterrupted as exc:
                raise ModelCallInterrupted(
                    f"model call abandoned: {interrupt.reason or 'interrupted'}"
                ) from exc
            return span.answered(read_turn(text, request_id, started, headers))
        except ModelCallInterrupted:
            raise
        except (anthropic.APIError, ModelError, httpx2.HTTPError, ValueError, TypeError) as exc:
            # ValueError: an undecodable body; httpx2.HTTPError: a stream cut mid-way;
            # TypeError: a client without credentials (any other is re-raised as it was).
            if isinstance(exc, TypeError) and NO_CREDENTIALS not in str(exc):
                raise
            error = exc if isinstance(exc, ModelError) else classify(exc, model)
            raise error from exc
