"""OpenTelemetry spans around claims, model calls and tool calls: an observer of the engine
(``durable_agents.observers``), subscribed by ``install()`` when ``opentelemetry-api`` is
installed.

Tracing follows the OpenTelemetry GenAI semantic conventions:

- ``invoke_agent {agent}`` (INTERNAL): one claim advancing one run (``agent_span``);
- ``chat {model}`` (CLIENT): one model call, each retry its own span (``model_call``), with
  ``durable_agents.cost_usd``, its turn's cost at the PRICES setting, when its model has one;
- ``execute_tool {tool}`` (INTERNAL): one tool call of a turn (``tool_span``); a failed
  call's ``error.type`` comes from its ``tool_call`` report.

A run carries the trace context of the code that started it (``current_trace_context``, stored
by ``start_run`` and ``spawn_run``), and every claim's ``invoke_agent`` span is a child of it:
all the claims of a run, by any worker, before and after a crash, are one trace.

Without ``opentelemetry-api`` (the ``otel`` extra) nothing is subscribed, and the engine's
reports cost what a report to nobody costs; with the API but no SDK's provider, a claim's
``invoke_agent`` span is the API's non-recording one (it carries the run's trace context to
the code under it) and model and tool calls make no span at all. Prompts, completions and
tool arguments and results are recorded only when
``OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT`` asks for them.
"""

from __future__ import annotations

import contextvars
import json
import os
from collections.abc import Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self

from durable_agents import observers
from durable_agents._internal.text import storable_text
from durable_agents.flow import pricing
from durable_agents.observers import AgentSpan, ModelCall, ModelSpan, ToolSpan

try:
    from opentelemetry import context as otel_context
    from opentelemetry import propagate, trace
    from opentelemetry.trace import Link, SpanKind, Status, StatusCode
except ImportError:  # the otel extra is not installed: every span below is a no-op
    AVAILABLE = False
else:
    AVAILABLE = True

if TYPE_CHECKING:
    from durable_agents.store.base import Claim

PROVIDER = "anthropic"
# The cost of a chat span's turn in USD at the PRICES setting (not a semantic convention).
COST_ATTRIBUTE = "durable_agents.cost_usd"
# The opt-in of the GenAI instrumentations of OpenTelemetry Python: "true" (or SPAN_ONLY,
# SPAN_AND_EVENT) records message content on the spans. Off by default.
CAPTURE_CONTENT_ENV = "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"
_CAPTURE_VALUES = frozenset({"true", "1", "yes", "span_only", "span_and_event"})

# Dispositions (runner.Disposition values) that end an invoke_agent span in error.
ERROR_DISPOSITIONS = frozenset({"dead", "failed", "error"})

# Anthropic stop reasons as the finish reasons of the conventions' output messages.
_FINISH_REASONS = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "max_tokens": "length",
    "tool_use": "tool_call",
    "refusal": "content_filter",
}

_tracer: Any = None  # a Tracer; None: the global provider's, looked up on first use


def use_tracer_provider(provider: Any) -> None:
    """Emit durable_agents' spans through ``provider`` instead of the global tracer provider
    (``None``: back to the global one). For tests and processes with several providers."""
    global _tracer
    _tracer = None if provider is None else provider.get_tracer("durable_agents")


def _get_tracer() -> Any:
    global _tracer
    if _tracer is None:
        # A proxy until the application sets its provider, which it then follows.
        _tracer = trace.get_tracer("durable_agents")
    return _tracer


def _no_provider() -> bool:
    """Whether no SDK's provider is set, neither the global one nor ``use_tracer_provider``'s.
    The API's tracer then hands out every span non-recording, with its parent's context: a
    ``chat`` or ``execute_tool`` span would change nothing the code under it sees (the claim's
    ``invoke_agent`` span, whose parent is the run's stored context, is still made current, so
    that a tool's outgoing request carries the run's trace)."""
    tracer = _tracer
    if tracer is not None and not isinstance(tracer, trace.ProxyTracer):
        return False
    return isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)


def capture_content() -> bool:
    """Whether message content goes on spans (the conventions' opt-in)."""
    return os.environ.get(CAPTURE_CONTENT_ENV, "").strip().lower() in _CAPTURE_VALUES


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, default=str)


class _Active:
    """A span made current on this thread (and on the threads that copy its context: tool
    calls and model calls run on such threads) until it ends."""

    def __init__(self, span: Any) -> None:
        self.span = span
        self.recording = bool(span.is_recording())
        self._token = otel_context.attach(trace.set_span_in_context(span))

    def _end(self, exc: BaseException | None, error_type: str | None = None) -> None:
        otel_context.detach(self._token)
        if exc is not None and self.recording:
            self.span.set_attribute("error.type", error_type or type(exc).__qualname__)
            self.span.record_exception(exc)
            self.span.set_status(Status(StatusCode.ERROR, _describe(exc)))
        self.span.end()


def _describe(exc: BaseException) -> str:
    message = getattr(exc, "message", None)
    text = message if isinstance(message, str) else str(exc)
    return f"{type(exc).__qualname__}: {text}"[:500]


# -- trace context of a run ----------------------------------------------------------------


def current_trace_context() -> str | None:
    """The caller's trace context (W3C ``traceparent``/``tracestate``, through the configured
    propagators) as JSON text, to store on a new run; None outside any trace. Baggage is not
    kept: it may carry anything, and the spans of a claim need only the trace context."""
    if not AVAILABLE:
        return None
    if not trace.get_current_span().get_span_context().is_valid:
        return None
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    carrier.pop("baggage", None)
    return json.dumps(carrier, sort_keys=True) if carrier else None


def _stored_context(text: Any) -> Any:
    """The context stored on a run (``current_trace_context``), or None."""
    if not isinstance(text, str) or not text:
        return None
    try:
        carrier = json.loads(text)
    except ValueError:
        return None
    if not isinstance(carrier, dict):
        return None
    context = propagate.extract({str(k): str(v) for k, v in carrier.items()})
    if not trace.get_current_span(context).get_span_context().is_valid:
        return None
    return context


# -- invoke_agent: one claim ---------------------------------------------------------------


_current_agent: contextvars.ContextVar[_AgentSpan | None] = contextvars.ContextVar(
    "durable_agents_agent_span", default=None
)


class _AgentSpan(AgentSpan):
    """The ``invoke_agent`` span of one claim, a child of the trace that started the run."""

    def __init__(self, claim: Claim) -> None:
        self.claim = claim
        self.usage: dict[str, int] = {}
        self.finish_reasons: list[str] = []

    def __enter__(self) -> Self:
        claim, run = self.claim, self.claim.run
        # The run's stored context is the parent (the messaging conventions' option for one
        # message processed on its own); a span current here already (a worker started in a
        # span) stays correlated through a link.
        parent = _stored_context(getattr(run, "trace_context", None))
        ambient = trace.get_current_span().get_span_context()
        links = [Link(ambient)] if parent is not None and ambient.is_valid else None
        span = _get_tracer().start_span(
            f"invoke_agent {run.agent}",
            context=parent,
            kind=SpanKind.INTERNAL,
            links=links,
            attributes={
                "gen_ai.operation.name": "invoke_agent",
                "gen_ai.provider.name": PROVIDER,
                "gen_ai.agent.name": run.agent,
                "gen_ai.agent.version": run.prompt_version,
                "gen_ai.conversation.id": str(run.pk),
                "gen_ai.request.model": run.model,
                "durable_agents.attempt": claim.attempt,
                "durable_agents.worker.id": claim.owner,
            },
        )
        self.active = _Active(span)
        self._token = _current_agent.set(self)
        return self

    def add_call(self, usage: Mapping[str, int], finish_reason: str | None) -> None:
        for key, value in usage.items():
            self.usage[key] = self.usage.get(key, 0) + value
        if finish_reason:
            self.finish_reasons.append(finish_reason)

    def finish(self, disposition: str) -> None:
        span = self.active.span
        if not self.active.recording:
            return
        span.set_attribute("durable_agents.disposition", str(disposition))
        if str(disposition) in ERROR_DISPOSITIONS:
            span.set_attribute("error.type", str(disposition))
            span.set_status(Status(StatusCode.ERROR, f"the run is {disposition}"))

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        _current_agent.reset(self._token)
        span = self.active.span
        if self.active.recording:
            for key, value in self.usage.items():
                span.set_attribute(key, value)
            if self.finish_reasons:
                span.set_attribute("gen_ai.response.finish_reasons", self.finish_reasons)
            if exc is not None:
                span.set_attribute("durable_agents.disposition", "error")
        self.active._end(exc)


# -- chat: one model call ------------------------------------------------------------------


class _ModelCall(ModelCall):
    """The ``chat`` spans of one ``create_turn``: ``params`` the pinned request, ``messages``
    the JSON text of the messages sent."""

    def __init__(self, request: observers.ModelRequest) -> None:
        self.params = request.params
        self.messages = request.messages
        self.stream = request.stream
        self.client = request.client

    def attempt(self) -> ModelSpan:
        return _ModelSpan(self)

    def attributes(self) -> dict[str, Any]:
        params = self.params
        attributes: dict[str, Any] = {}
        for key, name, kind in (
            ("max_tokens", "gen_ai.request.max_tokens", int),
            ("temperature", "gen_ai.request.temperature", float),
            ("top_p", "gen_ai.request.top_p", float),
            ("top_k", "gen_ai.request.top_k", float),
        ):
            value = params.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool):
                attributes[name] = kind(value)
        stop = params.get("stop_sequences")
        if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
            attributes["gen_ai.request.stop_sequences"] = stop
        if self.stream:
            attributes["gen_ai.request.stream"] = True
        url = getattr(self.client, "base_url", None)
        host = getattr(url, "host", None)
        if isinstance(host, str) and host:
            attributes["server.address"] = host
            port = getattr(url, "port", None)
            if not isinstance(port, int):
                port = 443 if getattr(url, "scheme", "https") == "https" else 80
            attributes["server.port"] = port
        agent = _current_agent.get()
        if agent is not None:
            attributes["gen_ai.conversation.id"] = str(agent.claim.run.pk)
        return attributes

    def content(self) -> dict[str, str]:
        """The opt-in content attributes of the request."""
        attributes: dict[str, str] = {}
        system = self.params.get("system")
        if isinstance(system, str):
            system = [{"type": "text", "text": system}]
        if isinstance(system, list):
            attributes["gen_ai.system_instructions"] = _json(_parts(system))
        try:
            messages = json.loads(self.messages)
        except (ValueError, RecursionError):
            messages = None
        if isinstance(messages, list):
            attributes["gen_ai.input.messages"] = _json(
                [
                    {"role": m.get("role"), "parts": _parts(m.get("content"))}
                    for m in messages
                    if isinstance(m, dict)
                ]
            )
        return attributes


class _ModelSpan(ModelSpan):
    def __init__(self, call: _ModelCall) -> None:
        self.call = call

    def __enter__(self) -> Self:
        call = self.call
        model = str(call.params.get("model"))
        span = _get_tracer().start_span(
            f"chat {model}",
            kind=SpanKind.CLIENT,
            # What a sampler may look at; the rest only when the span records.
            attributes={
                "gen_ai.operation.name": "chat",
                "gen_ai.provider.name": PROVIDER,
                "gen_ai.request.model": model,
            },
        )
        if span.is_recording():
            span.set_attributes(call.attributes())
            if capture_content():
                span.set_attributes(call.content())
        self.active = _Active(span)
        return self

    def answered(self, turn: observers.AnswerT) -> observers.AnswerT:
        message = turn.message
        usage = _usage(message.get("usage"))
        stop_reason = message.get("stop_reason")
        stop_reason = stop_reason if isinstance(stop_reason, str) else None
        agent = _current_agent.get()
        if agent is not None:
            agent.add_call(usage, stop_reason)
        span = self.active.span
        if not self.active.recording:
            return turn
        for key, name in (("id", "gen_ai.response.id"), ("model", "gen_ai.response.model")):
            if isinstance(message.get(key), str):
                span.set_attribute(name, message[key])
        if stop_reason is not None:
            span.set_attribute("gen_ai.response.finish_reasons", [stop_reason])
        span.set_attributes(usage)
        # What the turn cost at PRICES (a dict lookup and a few multiplications); no
        # attribute for a model without a price.
        cost = pricing.cost_of(str(self.call.params.get("model")), pricing.usage_of(message))
        if cost is not None:
            span.set_attribute(COST_ATTRIBUTE, float(cost))
        if turn.request_id:  # named as on the Anthropic SDK's own spans
            span.set_attribute("anthropic.request.id", turn.request_id)
        if capture_content():
            output = {
                "role": "assistant",
                "parts": _parts(message.get("content")),
                "finish_reason": _FINISH_REASONS.get(stop_reason or "", stop_reason or ""),
            }
            span.set_attribute("gen_ai.output.messages", _json([output]))
        return turn

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is not None and self.active.recording:
            request_id = getattr(exc, "request_id", None)
            if isinstance(request_id, str) and request_id:
                self.active.span.set_attribute("anthropic.request.id", request_id)
        self.active._end(exc, _model_error_type(exc) if exc is not None else None)


def _model_error_type(exc: BaseException) -> str:
    """The provider's error type (``overloaded_error``), else the HTTP status, else the class
    name of what went wrong (``APIConnectionError``, ``CallInterrupted``)."""
    cause = exc.__cause__ or exc
    body = getattr(cause, "body", None)
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and isinstance(error.get("type"), str):
            return str(error["type"])
    status = getattr(exc, "status", None) or getattr(cause, "status_code", None)
    if isinstance(status, int):
        return str(status)
    return type(cause).__qualname__


def _usage(usage: Any) -> dict[str, int]:
    """The conventions' usage attributes of one turn. Anthropic's ``input_tokens`` leaves out
    cache reads and writes; the conventions' input tokens include them. When the server ran
    several passes (``usage.iterations``: a compaction, then the message), they are summed."""
    if not isinstance(usage, dict):
        return {}
    iterations = usage.get("iterations")
    passes = (
        [i for i in iterations if isinstance(i, dict)]
        if isinstance(iterations, list) and iterations
        else [usage]
    )

    def total(key: str) -> int:
        return sum(int(p.get(key) or 0) for p in passes)

    cache_read = total("cache_read_input_tokens")
    cache_creation = total("cache_creation_input_tokens")
    return {
        "gen_ai.usage.input_tokens": total("input_tokens") + cache_read + cache_creation,
        "gen_ai.usage.output_tokens": total("output_tokens"),
        "gen_ai.usage.cache_read.input_tokens": cache_read,
        "gen_ai.usage.cache_creation.input_tokens": cache_creation,
    }


def _parts(content: Any) -> list[dict[str, Any]]:
    """Messages API content blocks as the conventions' message parts."""
    if isinstance(content, str):
        return [{"type": "text", "content": content}]
    parts: list[dict[str, Any]] = []
    for block in content if isinstance(content, list) else []:
        if not isinstance(block, dict):
            continue
        kind = block.get("type")
        if kind == "text":
            parts.append({"type": "text", "content": block.get("text")})
        elif kind == "tool_use":
            parts.append(
                {
                    "type": "tool_call",
                    "id": block.get("id"),
                    "name": block.get("name"),
                    "arguments": block.get("input"),
                }
            )
        elif kind == "tool_result":
            parts.append(
                {
                    "type": "tool_call_response",
                    "id": block.get("tool_use_id"),
                    "response": block.get("content"),
                }
            )
        elif kind == "thinking":
            parts.append({"type": "reasoning", "content": block.get("thinking")})
        elif kind == "server_tool_use":
            parts.append(
                {
                    "type": "server_tool_call",
                    "id": block.get("id"),
                    "name": block.get("name"),
                    "server_tool_call": {"type": block.get("name"), "input": block.get("input")},
                }
            )
        else:  # images, documents, redacted thinking, compaction, server tool results
            parts.append({"type": str(kind)})
    return parts


# -- execute_tool: one tool call -----------------------------------------------------------


# The longest tool name a span records as the model asked for it (content opted in only).
MAX_REQUESTED_NAME = 256

_current_tool: contextvars.ContextVar[_ToolSpan | None] = contextvars.ContextVar(
    "durable_agents_tool_span", default=None
)


class _ToolSpan(ToolSpan):
    """The ``execute_tool`` span of one call (a ``tool_use`` block of the model's turn) with
    idempotency key ``key``."""

    def __init__(self, request: observers.ToolRequest) -> None:
        self.agent = request.agent
        self.call = request.call
        self.key = request.key
        self.error_type: str | None = None
        self.finished = False

    def __enter__(self) -> Self:
        requested = self.call.get("name")
        # The model chose the name: an unknown one is one fixed label, never the span's name.
        name = observers.tool_label(requested, self.agent.tools_by_name)
        tool = self.agent.tools_by_name.get(requested) if isinstance(requested, str) else None
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": name,
            "gen_ai.tool.type": "function",
            "durable_agents.idempotency_key": self.key,
        }
        if isinstance(self.call.get("id"), str):
            attributes["gen_ai.tool.call.id"] = self.call["id"]
        if tool is not None:
            attributes["durable_agents.effect_class"] = str(tool.effect)
            if tool.description:
                attributes["gen_ai.tool.description"] = tool.description
        span = _get_tracer().start_span(
            f"execute_tool {name}", kind=SpanKind.INTERNAL, attributes=attributes
        )
        self.active = _Active(span)
        if self.active.recording and capture_content():
            span.set_attribute("gen_ai.tool.call.arguments", _json(self.call.get("input")))
            if tool is None:
                # Content opted in: the name the model asked for, as text (cut).
                requested_text = storable_text(requested, MAX_REQUESTED_NAME)
                span.set_attribute("durable_agents.tool.requested_name", requested_text)
        self._token = _current_tool.set(self)
        return self

    def result(self, text: str, is_error: bool) -> None:
        self.finished = True
        span = self.active.span
        if not self.active.recording:
            return
        if is_error:
            if self.error_type is None:
                known = self.call.get("name") in self.agent.tools_by_name
                self.error_type = "tool_error" if known else "unknown_tool"
            span.set_attribute("error.type", self.error_type)
            span.set_status(Status(StatusCode.ERROR, self.error_type))
        elif capture_content():
            span.set_attribute("gen_ai.tool.call.result", text)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        _current_tool.reset(self._token)
        if exc is not None and self.active.recording and not self.finished:
            # No result in this claim: the run parked (a wait, an approval) or stopped; the
            # invoke_agent span tells which.
            self.active.span.set_attribute("durable_agents.tool.outcome", "unfinished")
        self.active._end(None)


# -- the observer --------------------------------------------------------------------------


class Tracing(observers.Observer):
    """The spans above, for the engine's reports. Each checks ``AVAILABLE`` again, so that a
    test can switch tracing off without unsubscribing."""

    def agent_span(self, claim: Claim) -> AgentSpan | None:
        return _AgentSpan(claim) if AVAILABLE else None

    def model_call(self, request: observers.ModelRequest) -> ModelCall | None:
        # No span at all while nothing could record it: a model call and a tool call cost
        # what a report to nobody costs until an SDK is configured.
        return _ModelCall(request) if AVAILABLE and not _no_provider() else None

    def tool_span(self, request: observers.ToolRequest) -> ToolSpan | None:
        return _ToolSpan(request) if AVAILABLE and not _no_provider() else None

    def trace_context(self) -> str | None:
        return current_trace_context()

    def capacity_wait(self, event: observers.CapacityWait) -> None:
        # An event on the claim's invoke_agent span (current on this thread): the claim ends
        # there, and the next claim's span says when the run went on.
        if not AVAILABLE:
            return
        trace.get_current_span().add_event(
            "durable_agents.capacity_wait",
            {
                "gen_ai.request.model": event.model,
                "durable_agents.capacity.reason": event.reason.value,
                "durable_agents.capacity.wait_seconds": event.seconds,
            },
        )

    def tool_call(self, event: observers.ToolCallEnd) -> None:
        # What made the call in flight on this thread an error: its span's error.type.
        if not AVAILABLE:
            return
        span = _current_tool.get()
        if span is None:
            return
        if event.attempt > 1 and span.active.recording:
            # A tool with a Retry policy: how many attempts the call took so far.
            span.active.span.set_attribute("durable_agents.tool.attempts", event.attempt)
        if event.error_type is not None:
            span.error_type = event.error_type


TRACING = Tracing()


def install() -> None:
    """Subscribe ``TRACING`` to the engine's reports, if ``opentelemetry-api`` is installed
    (the app's ``ready`` calls it; calling it again changes nothing)."""
    if AVAILABLE:
        observers.subscribe(TRACING)
