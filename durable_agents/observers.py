"""The one seam between the engine and whatever watches it.

The engine reports here what happened, once each, and knows nothing of who listens. An
observer subclasses ``Observer``, overrides the methods of what it watches (each default does
nothing) and is ``subscribe``d. The two in this app:

- ``prometheus``: the counters and histograms, subscribed by ``prometheus.enable()``
  (``runagents --metrics-port``) and unsubscribed by ``disable()``;
- ``telemetry``: the OpenTelemetry spans, subscribed by ``telemetry.install()`` (the app's
  ``ready``) when ``opentelemetry-api`` is installed.

What is reported, by the observer method of the same name as the function that reports it:

=================  =========================  ==================================================
method             receives                   reported by, and when
=================  =========================  ==================================================
``model_attempt``  ``ModelAttempt``           ``llm.retries``: each attempt of a model call, once,
                                              with its outcome; the outcome of the call as a
                                              whole is that of its last attempt
``tool_call``      ``ToolCallEnd``            ``dispatch``: each call of a tool that was invoked
                                              (returned, raised or timed out)
``step_committed`` ``StepCommit``             ``runner``: each step it committed
``turn_cost``      ``TurnCost``               ``runner``: each answered model turn, once, with
                                              its cost at PRICES (None: no price), before its
                                              commit (it is paid whatever becomes of that)
``claim_ended``    ``ClaimEnd``               ``worker``: each claim, once, when its slot is done
                                              with it (a sweep or a ``cancel_run`` is no claim)
``capacity_wait``  ``CapacityWait``           ``runner``: a run handed back to wait for model
                                              capacity (buckets short, a 429's pause, a 529)
``agent_span``     a ``Claim``: returns an    ``runner.advance_run``: one claim advancing one run
                   ``AgentSpan`` or None
``model_call``     a ``ModelRequest``:        ``llm.retries.create_turn``: one model call; its
                   returns a ``ModelCall``    ``attempt()`` wraps each attempt
                   or None
``tool_span``      a ``ToolRequest``:         ``dispatch``: one ``tool_use`` block of a turn
                   returns a ``ToolSpan``
                   or None
``trace_context``  nothing: returns the       ``api``: a run created or forked (the first
                   caller's trace context     observer's answer that is not None is stored
                   (text) or None             on the run)
=================  =========================  ==================================================

The last three are scopes: context managers around the work, for observers that need its
duration or its context (a span made current on the thread). With nobody subscribed, each
report is a truth test of an empty tuple and a return: no event is built, and a scope is a
shared object whose methods do nothing. Observers are called on the thread that reports, in
the order they subscribed; they must not raise.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import re
import threading
from collections.abc import Callable, Collection, Mapping
from decimal import Decimal
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol, Self, TypeVar

if TYPE_CHECKING:
    from durable_agents.declare.agents import Agent
    from durable_agents.store.base import Claim


class ModelOutcome(enum.StrEnum):
    """How one attempt of a model call ended."""

    OK = "ok"
    RETRIED = "retried"  # a transient error; the call is tried again
    TRANSIENT_ERROR = "transient_error"  # retries over, or not retryable now: the run goes back
    PERMANENT_ERROR = "permanent_error"  # the run is dead-lettered
    INTERRUPTED = "interrupted"  # cancelled, lease lost or shutdown: the claim's outcome says


class ToolOutcome(enum.StrEnum):
    """How one attempt of a tool call ended."""

    OK = "ok"
    ERROR = "error"
    TIMEOUT = "timeout"
    RETRIED = "retried"  # it failed as its Retry policy says is worth another attempt


@dataclasses.dataclass(frozen=True, slots=True)
class ModelAttempt:
    model: str
    outcome: ModelOutcome
    seconds: float  # from the request to the whole answer (or to the failure)


@dataclasses.dataclass(frozen=True, slots=True)
class ToolCallEnd:
    tool: str
    effect: str  # the tool's EffectClass
    outcome: ToolOutcome
    seconds: float
    error_type: str | None = None  # what it raised (its class name), or "timeout"
    attempt: int = 1  # which attempt of the call this was (a tool with a Retry policy)


@dataclasses.dataclass(frozen=True, slots=True)
class StepCommit:
    kind: str  # StepKind: model_turn, tool_result
    seconds: float


class WaitReason(enum.StrEnum):
    """Why a run waits for model capacity."""

    CAPACITY = "capacity"  # the fleet's buckets have no room for the call now
    RATE_LIMITED = "rate_limited"  # a 429: the model is paused for the fleet
    OVERLOADED = "overloaded"  # a 529 whose retries ran out
    BUDGET = "budget"  # the run's concurrency key spent its budget for the UTC day


@dataclasses.dataclass(frozen=True, slots=True)
class CapacityWait:
    model: str
    reason: WaitReason
    seconds: float  # how long the run is held back


@dataclasses.dataclass(frozen=True, slots=True)
class TurnCost:
    agent: str
    model: str
    cost: Decimal | None  # USD at the PRICES setting; None: the model has no price


@dataclasses.dataclass(frozen=True, slots=True)
class ClaimEnd:
    run_id: object
    disposition: str  # runner.Disposition


@dataclasses.dataclass(frozen=True, slots=True)
class ModelRequest:
    """What ``create_turn`` is about to send: the pinned request parameters, the JSON text of
    the messages, and the SDK client that sends them."""

    params: Mapping[str, Any]
    messages: bytes
    stream: bool
    client: Any


@dataclasses.dataclass(frozen=True, slots=True)
class ToolRequest:
    """One ``tool_use`` block of the model's turn (``call``), about to run under ``key``."""

    agent: Agent
    call: Mapping[str, Any]
    key: str


class WorkerLoad(Protocol):
    """What a worker tells of its load, read when an observer asks (``prometheus``' gauges of
    runs in flight and of slots): an observer holds a worker as this, never as ``Worker``."""

    concurrency: int

    def in_flight(self) -> int: ...


# -- scopes: the base classes do nothing ---------------------------------------------------


class Scope:
    """A context manager that does nothing; the scopes below add what they record."""

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        return None


class AgentSpan(Scope):
    """``with agent_span(claim) as span: ... span.finish(disposition)``."""

    def finish(self, disposition: str) -> None:
        """What became of the run (a ``runner.Disposition``)."""


class Answer(Protocol):
    """What an observer may read of a model call's answer (``llm.ModelTurn`` is one): the seam
    names it by what it reads, so that it imports nothing of the model calls that report to it."""

    @property
    def request_id(self) -> str | None: ...
    @property
    def message(self) -> dict[str, Any]: ...
    @property
    def elapsed_ms(self) -> float: ...


# ``ModelSpan.answered`` returns the very answer it was given, whatever its class.
AnswerT = TypeVar("AnswerT", bound=Answer)


class ModelSpan(Scope):
    """One attempt of a model call: ``with call.attempt() as span: return span.answered(turn)``."""

    def answered(self, turn: AnswerT) -> AnswerT:
        """Record the answer; returns it."""
        return turn


class ModelCall:
    """One model call; ``attempt()`` gives the scope of each attempt."""

    def attempt(self) -> ModelSpan:
        return _NO_MODEL_SPAN


class ToolSpan(Scope):
    """``with tool_span(agent, call, key) as span: ... span.result(text, is_error)``."""

    def result(self, text: str, is_error: bool) -> None:
        """Record the call's result (the tool_result text the model reads)."""


_NO_AGENT_SPAN = AgentSpan()
_NO_MODEL_SPAN = ModelSpan()
_NO_MODEL_CALL = ModelCall()
_NO_TOOL_SPAN = ToolSpan()


class Observer:
    """Override what you watch; each method's default does nothing (a scope: returns None)."""

    def model_attempt(self, event: ModelAttempt) -> None:
        pass

    def tool_call(self, event: ToolCallEnd) -> None:
        pass

    def step_committed(self, event: StepCommit) -> None:
        pass

    def claim_ended(self, event: ClaimEnd) -> None:
        pass

    def capacity_wait(self, event: CapacityWait) -> None:
        pass

    def turn_cost(self, event: TurnCost) -> None:
        pass

    def agent_span(self, claim: Claim) -> AgentSpan | None:
        return None

    def model_call(self, request: ModelRequest) -> ModelCall | None:
        return None

    def tool_span(self, request: ToolRequest) -> ToolSpan | None:
        return None

    def trace_context(self) -> str | None:
        """The caller's trace context as text, to store on a run it creates, or None."""
        return None


# Replaced whole (under the lock) by subscribe and unsubscribe: a reporter reads it once.
_observers: tuple[Observer, ...] = ()
_lock = threading.Lock()


def subscribe(observer: Observer) -> None:
    """Report to ``observer`` from now on (once, however often it is subscribed)."""
    global _observers
    with _lock:
        if observer not in _observers:
            _observers = (*_observers, observer)


def unsubscribe(observer: Observer) -> None:
    global _observers
    with _lock:
        _observers = tuple(o for o in _observers if o is not observer)


def subscribed() -> tuple[Observer, ...]:
    return _observers


# -- reporting -----------------------------------------------------------------------------


def model_attempt(model: str, outcome: ModelOutcome, seconds: float) -> None:
    observers = _observers
    if observers:
        event = ModelAttempt(model, outcome, seconds)
        for observer in observers:
            observer.model_attempt(event)


def tool_call(
    tool: str,
    effect: str,
    outcome: str,
    seconds: float,
    error_type: str | None = None,
    attempt: int = 1,
) -> None:
    observers = _observers
    if observers:
        event = ToolCallEnd(tool, str(effect), ToolOutcome(outcome), seconds, error_type, attempt)
        for observer in observers:
            observer.tool_call(event)


def step_committed(kind: str, seconds: float) -> None:
    observers = _observers
    if observers:
        event = StepCommit(str(kind), seconds)
        for observer in observers:
            observer.step_committed(event)


def turn_cost(agent: str, model: str, cost: Decimal | None) -> None:
    observers = _observers
    if observers:
        event = TurnCost(agent, model, cost)
        for observer in observers:
            observer.turn_cost(event)


def claim_ended(disposition: str, run_id: object) -> None:
    observers = _observers
    if observers:
        event = ClaimEnd(run_id, str(disposition))
        for observer in observers:
            observer.claim_ended(event)


def capacity_wait(model: str, reason: WaitReason, seconds: float) -> None:
    observers = _observers
    if observers:
        event = CapacityWait(model, reason, seconds)
        for observer in observers:
            observer.capacity_wait(event)


def agent_span(claim: Claim) -> AgentSpan:
    observers = _observers
    if not observers:
        return _NO_AGENT_SPAN
    spans = [s for o in observers if (s := o.agent_span(claim)) is not None]
    if len(spans) < 2:
        return spans[0] if spans else _NO_AGENT_SPAN
    return _AgentSpans(spans)


def model_call(
    params: Mapping[str, Any], messages: bytes, *, stream: bool, client: Any
) -> ModelCall:
    observers = _observers
    if not observers:
        return _NO_MODEL_CALL
    request = ModelRequest(params, messages, stream, client)
    calls = [c for o in observers if (c := o.model_call(request)) is not None]
    if len(calls) < 2:
        return calls[0] if calls else _NO_MODEL_CALL
    return _ModelCalls(calls)


def tool_span(agent: Agent, call: Mapping[str, Any], key: str) -> ToolSpan:
    observers = _observers
    if not observers:
        return _NO_TOOL_SPAN
    request = ToolRequest(agent, call, key)
    spans = [s for o in observers if (s := o.tool_span(request)) is not None]
    if len(spans) < 2:
        return spans[0] if spans else _NO_TOOL_SPAN
    return _ToolSpans(spans)


# -- the text of streamed turns -----------------------------------------------------------

# What makes the receiver of one streamed turn's text for the readers of its run's live
# stream, given (run id, seq, attempt): the process's publisher (``live.publish``, which sets
# it when imported: the app's ``ready`` imports it), or None.
TextPublisher = Callable[[Any, int, int], Callable[[str], None]]
_text_publisher: TextPublisher | None = None


def publish_text(publisher: TextPublisher | None) -> None:
    """Send the text of streamed turns to ``publisher``'s receivers (None: to nobody)."""
    global _text_publisher
    _text_publisher = publisher


def text_receivers(
    agent: Any, run_id: Any, seq: int, attempt: int, live: bool
) -> Callable[[str], None] | None:
    """What gets the text of streamed turn ``seq`` while it comes: the agent's ``on_text``, and
    (``live``: the store can send it, LIVE_DELTAS on) the readers of the run's stream."""
    from durable_agents.conf import app_settings

    receivers: list[Callable[[str], None]] = []
    if agent.on_text is not None:
        callback = agent.on_text
        receivers.append(lambda text: callback(run_id, text))
    publisher = _text_publisher
    if agent.stream and live and app_settings.LIVE_DELTAS and publisher is not None:
        receivers.append(publisher(run_id, seq, attempt))
    if len(receivers) <= 1:
        return receivers[0] if receivers else None

    def on_text(text: str) -> None:
        for receiver in receivers:
            receiver(text)

    return on_text


def trace_context() -> str | None:
    """The caller's trace context to store on a new run (``api``, at a run's creation or
    fork): the first an observer gives (``telemetry``: W3C trace context as JSON), or None."""
    for observer in _observers:
        context = observer.trace_context()
        if context is not None:
            return context
    return None


# -- several observers' scopes as one ------------------------------------------------------


class _Together(Scope):
    """Enters its scopes in order and leaves them in reverse, as nested ``with`` would."""

    def __init__(self, scopes: list[Any]) -> None:
        self.scopes = scopes

    def __enter__(self) -> Self:
        self._stack = contextlib.ExitStack()
        self.entered = [self._stack.enter_context(scope) for scope in self.scopes]
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stack.__exit__(exc_type, exc, tb)


class _AgentSpans(_Together, AgentSpan):
    def finish(self, disposition: str) -> None:
        for span in self.entered:
            span.finish(disposition)


class _ModelSpans(_Together, ModelSpan):
    def answered(self, turn: AnswerT) -> AnswerT:
        for span in self.entered:
            span.answered(turn)
        return turn


class _ModelCalls(ModelCall):
    def __init__(self, calls: list[ModelCall]) -> None:
        self.calls = calls

    def attempt(self) -> ModelSpan:
        return _ModelSpans([call.attempt() for call in self.calls])


class _ToolSpans(_Together, ToolSpan):
    def result(self, text: str, is_error: bool) -> None:
        for span in self.entered:
            span.result(text, is_error)


# What a tool's name becomes in a span's name, a span attribute or a metric label: a name the
# model chose that is no tool of the agent's is this one label (the model may invent any
# number of names, of any length, with any characters: unbounded cardinality and content in
# the telemetry); a known name keeps [A-Za-z0-9_.-] only, the rest replaced, cut to 64.
UNKNOWN_TOOL = "unknown_tool"
MAX_TOOL_LABEL = 64
_NOT_LABEL = re.compile(r"[^A-Za-z0-9_.-]")


def tool_label(name: object, known: Collection[str]) -> str:
    """``name`` as a telemetry label: ``UNKNOWN_TOOL`` unless it is one of ``known``."""
    if not isinstance(name, str) or name not in known:
        return UNKNOWN_TOOL
    return _NOT_LABEL.sub("_", name)[:MAX_TOOL_LABEL] or UNKNOWN_TOOL
