"""OpenTelemetry spans (durable_agents/observe/telemetry.py): invoke_agent per claim, chat per model
call, execute_tool per tool call, all in the trace of the code that started the run.

The spans go to the SDK's in-memory exporter through a provider of this module's own
(``telemetry.use_tracer_provider``): the process's global provider is never set, so the
other tests are unaffected.
"""

from __future__ import annotations

import datetime
import json
import random
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connection
from django.utils import timezone

pytest.importorskip("opentelemetry.sdk")

from opentelemetry import propagate, trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter,
)
from opentelemetry.trace import SpanKind, StatusCode

from durable_agents import Retry, store
from durable_agents.api import start_run
from durable_agents.declare.agents import Agent, registry
from durable_agents.declare.tools import tool
from durable_agents.models import AgentRun, AgentStep
from durable_agents.observe import telemetry
from durable_agents.testing import drive
from tests.conftest import run_worker
from tests.fakeserver import FakeAnthropic, api_error

pytestmark = pytest.mark.django_db(transaction=True)

EXPORTER = InMemorySpanExporter()
PROVIDER = TracerProvider()
PROVIDER.add_span_processor(SimpleSpanProcessor(EXPORTER))
TRACER = PROVIDER.get_tracer("tests")

CONTENT_KEYS = {
    "gen_ai.input.messages",
    "gen_ai.output.messages",
    "gen_ai.system_instructions",
    "gen_ai.tool.call.arguments",
    "gen_ai.tool.call.result",
}


@pytest.fixture(scope="module", autouse=True)
def tracer_provider() -> Iterator[TracerProvider]:
    telemetry.use_tracer_provider(PROVIDER)
    yield PROVIDER
    telemetry.use_tracer_provider(None)


@pytest.fixture(autouse=True)
def exporter(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    monkeypatch.delenv(telemetry.CAPTURE_CONTENT_ENV, raising=False)
    EXPORTER.clear()
    yield EXPORTER
    EXPORTER.clear()


def spans_named(prefix: str) -> list[ReadableSpan]:
    return sorted(
        (s for s in EXPORTER.get_finished_spans() if s.name.startswith(prefix)),
        key=lambda s: s.start_time or 0,
    )


def parent_id(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def reload(run: AgentRun) -> AgentRun:
    return AgentRun.objects.get(pk=run.pk)


def started_in_a_trace(agent: str, task: str) -> tuple[AgentRun, trace.Span]:
    """start_run inside a span of the caller (itself in a trace with a tracestate, as if the
    request came in with W3C headers)."""
    traceparent = f"00-{random.getrandbits(128):032x}-{random.getrandbits(64) | 1:016x}-01"
    incoming = propagate.extract({"traceparent": traceparent, "tracestate": "congo=t61rcWkgMzE"})
    with TRACER.start_as_current_span("caller", context=incoming) as caller:
        run = start_run(agent, task)
    return run, caller


# --------------------------------------------------------------------------- the three spans


def test_a_run_is_one_trace_of_claim_model_and_tool_spans(fake_api: FakeAnthropic) -> None:
    run, caller = started_in_a_trace("tester", '@lookup {"key": "a"}')
    caller_context = caller.get_span_context()
    assert json.loads(reload(run).trace_context or "") == {
        "traceparent": f"00-{caller_context.trace_id:032x}-{caller_context.span_id:016x}-01",
        "tracestate": "congo=t61rcWkgMzE",
    }

    worker = run_worker(worker_id="w-otel")
    assert worker.stats.dispositions == {"succeeded": 1}

    (agent_span,) = spans_named("invoke_agent")
    chats = spans_named("chat ")
    (tool_span,) = spans_named("execute_tool")
    assert agent_span.name == "invoke_agent tester"
    assert [c.name for c in chats] == ["chat claude-test-1"] * 2
    assert tool_span.name == "execute_tool lookup"

    # One trace: the caller's. The claim is a child of the caller's span; model and tool
    # calls are children of the claim.
    assert {s.context.trace_id for s in [agent_span, *chats, tool_span]} == {
        caller_context.trace_id
    }
    assert parent_id(agent_span) == caller_context.span_id
    assert {parent_id(s) for s in [*chats, tool_span]} == {agent_span.context.span_id}
    assert chats[0].end_time <= tool_span.start_time <= chats[1].start_time  # type: ignore[operator]

    assert agent_span.kind is SpanKind.INTERNAL

    def total(key: str) -> int:
        counted = 0
        for chat in chats:
            assert chat.attributes is not None
            value = chat.attributes[key]
            assert isinstance(value, int), value
            counted += value
        return counted

    usage = {
        key: total(key)
        for key in (
            "gen_ai.usage.input_tokens",
            "gen_ai.usage.output_tokens",
            "gen_ai.usage.cache_read.input_tokens",
            "gen_ai.usage.cache_creation.input_tokens",
        )
    }
    assert dict(agent_span.attributes or {}) == {
        "gen_ai.operation.name": "invoke_agent",
        "gen_ai.provider.name": "anthropic",
        "gen_ai.agent.name": "tester",
        "gen_ai.agent.version": "v1",
        "gen_ai.conversation.id": str(run.pk),
        "gen_ai.request.model": "claude-test-1",
        "durable_agents.attempt": 1,
        "durable_agents.worker.id": "w-otel",
        "durable_agents.disposition": "succeeded",
        "gen_ai.response.finish_reasons": ("tool_use", "end_turn"),
        **usage,
    }
    assert agent_span.status.status_code is StatusCode.UNSET

    turns = {s.seq: s for s in AgentStep.objects.filter(run_id=run.pk, kind="model_turn")}
    for chat, seq, stop in ((chats[0], 1, "tool_use"), (chats[1], 3, "end_turn")):
        body = json.loads(turns[seq].payload)
        attributes = dict(chat.attributes or {})
        assert chat.kind is SpanKind.CLIENT
        assert attributes["gen_ai.operation.name"] == "chat"
        assert attributes["gen_ai.provider.name"] == "anthropic"
        assert attributes["gen_ai.request.model"] == "claude-test-1"
        assert attributes["gen_ai.request.max_tokens"] == 1024
        assert attributes["gen_ai.conversation.id"] == str(run.pk)
        assert attributes["server.address"] == "127.0.0.1"
        assert isinstance(attributes["server.port"], int)
        assert attributes["gen_ai.response.model"] == body["model"]
        assert attributes["gen_ai.response.id"] == body["id"]
        assert attributes["gen_ai.response.finish_reasons"] == (stop,)
        assert attributes["anthropic.request.id"] == turns[seq].request_id
        usage = body["usage"]
        cached = usage["cache_read_input_tokens"] + usage["cache_creation_input_tokens"]
        assert attributes["gen_ai.usage.input_tokens"] == usage["input_tokens"] + cached
        assert attributes["gen_ai.usage.output_tokens"] == usage["output_tokens"]
        for cache in ("cache_read", "cache_creation"):
            assert (
                attributes[f"gen_ai.usage.{cache}.input_tokens"] == usage[f"{cache}_input_tokens"]
            )
        assert "error.type" not in attributes
        assert chat.status.status_code is StatusCode.UNSET

    (tool_use,) = [b for b in json.loads(turns[1].payload)["content"] if b["type"] == "tool_use"]
    tool_attributes = dict(tool_span.attributes or {})
    assert tool_span.kind is SpanKind.INTERNAL
    assert tool_attributes == {
        "gen_ai.operation.name": "execute_tool",
        "gen_ai.tool.name": "lookup",
        "gen_ai.tool.call.id": tool_use["id"],
        "gen_ai.tool.type": "function",
        "gen_ai.tool.description": "Read a value by key.",
        "durable_agents.effect_class": "pure",
        "durable_agents.idempotency_key": tool_attributes["durable_agents.idempotency_key"],
    }
    assert tool_span.status.status_code is StatusCode.UNSET

    # Content is opt-in: none by default.
    for span in EXPORTER.get_finished_spans():
        assert not CONTENT_KEYS & set(span.attributes or {}), span.name


def test_a_chat_span_carries_its_turns_cost_when_the_model_has_a_price(
    fake_api: FakeAnthropic, da_settings: Any
) -> None:
    da_settings(PRICES={"claude-test-1": {"input": 3.0, "output": 15.0}})
    run = start_run("tester", '@lookup {"key": "a"}')
    assert run_worker().stats.dispositions == {"succeeded": 1}
    costs = [
        float(dict(chat.attributes or {})["durable_agents.cost_usd"])  # type: ignore[arg-type]
        for chat in spans_named("chat ")
    ]
    assert len(costs) == 2
    assert all(cost > 0 for cost in costs)
    assert sum(costs) == pytest.approx(float(reload(run).cost_usd or 0), rel=1e-9)
    # Without a price: no attribute (not 0).
    da_settings(PRICES={})
    start_run("tester", "Say hello.")
    run_worker()
    last = spans_named("chat ")[-1]
    assert "durable_agents.cost_usd" not in dict(last.attributes or {})


def test_spans_started_in_tool_code_are_children_of_its_execute_tool_span(
    fake_api: FakeAnthropic,
) -> None:
    """The tool runs on the slot's caller thread, in a copy of the slot's context."""

    @tool(effect="pure")
    def traced(key: str) -> str:
        """Look a key up inside a span of its own."""
        with TRACER.start_as_current_span("inside the tool"):
            return f"value-of-{key}"

    agent = Agent(
        name="otel_tracer_tool",
        version="t1",
        model="claude-test-1",
        system="You trace.",
        tools=[traced],
        max_tokens=256,
    )
    try:
        _run, caller = started_in_a_trace(agent.name, '@traced {"key": "a"}')
        assert run_worker().stats.dispositions == {"succeeded": 1}
    finally:
        registry.unregister(agent.name, agent.version)

    (tool_span,) = spans_named("execute_tool traced")
    (inner,) = spans_named("inside the tool")
    assert parent_id(inner) == tool_span.context.span_id
    assert inner.context.trace_id == caller.get_span_context().trace_id


def test_a_retried_tool_call_is_one_span_that_counts_its_attempts(
    fake_api: FakeAnthropic,
) -> None:
    attempts: list[int] = []

    @tool(effect="pure", retry=Retry(attempts=3, backoff=0))
    def flaky(key: str) -> str:
        """Loses its connection once."""
        attempts.append(1)
        if len(attempts) == 1:
            raise ConnectionError("reset")
        return f"value-of-{key}"

    agent = Agent(
        name="otel_retried_tool",
        version="t1",
        model="claude-test-1",
        system="You retry.",
        tools=[flaky],
        max_tokens=256,
    )
    try:
        start_run(agent.name, '@flaky {"key": "a"}')
        assert run_worker().stats.dispositions == {"succeeded": 1}
    finally:
        registry.unregister(agent.name, agent.version)

    (tool_span,) = spans_named("execute_tool flaky")
    assert tool_span.attributes is not None
    assert tool_span.attributes["durable_agents.tool.attempts"] == 2
    # Its last attempt succeeded: the span is no error.
    assert "error.type" not in tool_span.attributes
    assert tool_span.status.status_code is not StatusCode.ERROR


# --------------------------------------------------------------------------- claims


def test_every_claim_joins_the_trace_after_a_hand_back_and_after_a_crash(
    fake_api: FakeAnthropic, da_settings: Any
) -> None:
    da_settings(MODEL_RETRIES=1, MAX_BACKOFF_SECONDS=0.05)
    fake_api.fail_next(api_error(500, "api_error", "Internal server error"), times=2)
    run, caller = started_in_a_trace("tester", '@lookup {"key": "a"}')

    # Claim 1: both attempts of the model call fail; the run is handed back.
    assert run_worker(worker_id="w-first", max_runs=1).stats.dispositions == {"released": 1}
    (first,) = spans_named("invoke_agent")
    assert first.attributes is not None
    assert first.attributes["durable_agents.disposition"] == "released"
    assert first.status.status_code is StatusCode.UNSET
    failed = spans_named("chat ")
    assert len(failed) == 2
    for chat in failed:
        assert chat.attributes is not None
        assert chat.attributes["error.type"] == "api_error"
        assert chat.attributes["anthropic.request.id"] == "req_fault"
        assert chat.status.status_code is StatusCode.ERROR
        assert parent_id(chat) == first.context.span_id

    # Claim 2: a worker takes the run and dies at once (its lease is left to expire).
    (crashed,) = store.current().claim_runs("w-crashed", 5)
    assert crashed.attempt == 2
    AgentRun.objects.filter(pk=run.pk).update(
        lease_until=timezone.now() - datetime.timedelta(seconds=1)
    )

    # Claim 3: another worker, another "process": the run's stored context is all it has.
    EXPORTER.clear()
    assert run_worker(worker_id="w-after").stats.dispositions == {"succeeded": 1}
    (third,) = spans_named("invoke_agent")
    assert third.attributes is not None
    assert third.attributes["durable_agents.attempt"] == 3
    assert third.attributes["durable_agents.worker.id"] == "w-after"
    assert third.attributes["durable_agents.disposition"] == "succeeded"
    caller_context = caller.get_span_context()
    for claim_span in (first, third):
        assert claim_span.context.trace_id == caller_context.trace_id
        assert parent_id(claim_span) == caller_context.span_id
    assert {s.context.trace_id for s in EXPORTER.get_finished_spans()} == {caller_context.trace_id}


def test_a_run_claimed_with_the_last_step_of_another_joins_its_own_trace(
    fake_api: FakeAnthropic, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On PostgreSQL the statement that commits a run's last turn claims the slot's next run:
    that claim, too, comes with the run's stored context."""
    chained: list[Any] = []
    if connection.vendor == "postgresql":
        from durable_agents.store.postgres import PostgresStore

        finish_and_claim = PostgresStore._finish_and_claim

        def spy(store: Any, params: Any, then_claim: Any, unless_messages: bool) -> bool:
            appended = finish_and_claim(store, params, then_claim, unless_messages)
            chained.append(then_claim.claim)
            return appended

        monkeypatch.setattr(PostgresStore, "_finish_and_claim", spy)
    first, first_caller = started_in_a_trace("tester", "Say hello.")
    second, second_caller = started_in_a_trace("tester", "Say goodbye.")
    assert run_worker(concurrency=1).stats.dispositions == {"succeeded": 2}
    if connection.vendor == "postgresql":
        assert [c.run_id for c in chained if c is not None] == [second.pk]
    for run, caller in ((first, first_caller), (second, second_caller)):
        (claim_span,) = [
            s
            for s in spans_named("invoke_agent")
            if (s.attributes or {}).get("gen_ai.conversation.id") == str(run.pk)
        ]
        assert claim_span.context.trace_id == caller.get_span_context().trace_id
        assert parent_id(claim_span) == caller.get_span_context().span_id


def test_a_child_run_joins_the_trace_under_the_tool_call_that_spawned_it(
    fake_api: FakeAnthropic,
) -> None:
    run, caller = started_in_a_trace("waiter", '@spawn_only {"task": "Say hello."}')
    worker = run_worker()
    assert worker.stats.dispositions == {"succeeded": 2}
    child = AgentRun.objects.get(parent_id=run.pk)

    (spawning,) = spans_named("execute_tool spawn_only")
    (child_claim,) = [
        s
        for s in spans_named("invoke_agent")
        if (s.attributes or {}).get("gen_ai.conversation.id") == str(child.pk)
    ]
    assert child_claim.name == "invoke_agent waiter_child"
    assert child_claim.context.trace_id == caller.get_span_context().trace_id
    assert parent_id(child_claim) == spawning.context.span_id


def test_a_run_started_outside_any_trace_stores_no_context(fake_api: FakeAnthropic) -> None:
    run = start_run("tester", "Say hello.")
    assert reload(run).trace_context is None
    run_worker()
    (agent_span,) = spans_named("invoke_agent")
    assert agent_span.parent is None  # each claim is a trace of its own


def test_a_claim_advanced_inside_a_span_keeps_it_as_a_link(fake_api: FakeAnthropic) -> None:
    """durable_agents.testing drives the run on this thread, inside the test's span."""
    run, caller = started_in_a_trace("tester", "Say hello.")
    with TRACER.start_as_current_span("driver") as driver:
        assert drive(run).status == "succeeded"
    (agent_span,) = spans_named("invoke_agent")
    assert parent_id(agent_span) == caller.get_span_context().span_id
    assert [link.context for link in agent_span.links] == [driver.get_span_context()]


# --------------------------------------------------------------------------- errors


def test_tool_errors_and_dead_runs_end_their_spans_in_error(
    fake_api: FakeAnthropic, da_settings: Any, receiver: Any
) -> None:
    start_run("tester", '@explode {"message": "boom"}\n@no_such_tool {}')
    assert run_worker().stats.dispositions == {"succeeded": 1}
    explode, unknown = spans_named("execute_tool")
    assert explode.attributes is not None
    assert unknown.attributes is not None
    assert explode.attributes["error.type"] == "RuntimeError"
    assert explode.status.status_code is StatusCode.ERROR
    assert unknown.name == "execute_tool unknown_tool"
    assert unknown.attributes["gen_ai.tool.name"] == "unknown_tool"
    assert unknown.attributes["error.type"] == "unknown_tool"
    assert "durable_agents.effect_class" not in unknown.attributes

    EXPORTER.clear()
    da_settings(TOOL_TIMEOUT=0.2)
    start_run("tester", '@slow {"seconds": 3}')
    assert run_worker().stats.dispositions == {"succeeded": 1}
    (timed_out,) = spans_named("execute_tool")
    assert timed_out.attributes is not None
    assert timed_out.attributes["error.type"] == "timeout"

    EXPORTER.clear()
    fake_api.fail_next(api_error(400, "invalid_request_error", "messages: bad"))
    start_run("tester", "Say hello.")
    assert run_worker().stats.dispositions == {"dead": 1}
    (agent_span,) = spans_named("invoke_agent")
    (chat,) = spans_named("chat ")
    assert agent_span.attributes is not None
    assert chat.attributes is not None
    assert agent_span.attributes["durable_agents.disposition"] == "dead"
    assert agent_span.attributes["error.type"] == "dead"
    assert agent_span.status.status_code is StatusCode.ERROR
    assert chat.attributes["error.type"] == "invalid_request_error"
    assert chat.status.status_code is StatusCode.ERROR
    assert "invalid_request_error: messages: bad" in (chat.status.description or "")


# --------------------------------------------------------------------------- content


def test_content_is_recorded_with_the_opt_in(
    fake_api: FakeAnthropic, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(telemetry.CAPTURE_CONTENT_ENV, "true")
    start_run("tester", '@lookup {"key": "a"}')
    run_worker()

    first, second = spans_named("chat ")
    assert first.attributes is not None
    assert second.attributes is not None
    assert json.loads(str(first.attributes["gen_ai.system_instructions"])) == [
        {"type": "text", "content": "You are the test agent."}
    ]
    assert json.loads(str(first.attributes["gen_ai.input.messages"])) == [
        {"role": "user", "parts": [{"type": "text", "content": '@lookup {"key": "a"}'}]}
    ]
    (output,) = json.loads(str(first.attributes["gen_ai.output.messages"]))
    assert output["role"] == "assistant"
    assert output["finish_reason"] == "tool_call"
    (call,) = [p for p in output["parts"] if p["type"] == "tool_call"]
    assert (call["name"], call["arguments"]) == ("lookup", {"key": "a"})

    messages = json.loads(str(second.attributes["gen_ai.input.messages"]))
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    assert messages[2]["parts"] == [
        {"type": "tool_call_response", "id": call["id"], "response": "value-of-a"}
    ]
    (final,) = json.loads(str(second.attributes["gen_ai.output.messages"]))
    assert final["finish_reason"] == "stop"

    (tool_span,) = spans_named("execute_tool")
    assert tool_span.attributes is not None
    assert json.loads(str(tool_span.attributes["gen_ai.tool.call.arguments"])) == {"key": "a"}
    assert tool_span.attributes["gen_ai.tool.call.result"] == "value-of-a"
    (agent_span,) = spans_named("invoke_agent")
    assert not CONTENT_KEYS & set(agent_span.attributes or {})


# --------------------------------------------------------------------------- no opentelemetry


def test_without_opentelemetry_runs_work_and_emit_nothing(
    fake_api: FakeAnthropic, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(telemetry, "AVAILABLE", False)
    run, _ = started_in_a_trace("tester", '@lookup {"key": "a"}\n@explode {"message": "x"}')
    assert reload(run).trace_context is None
    assert run_worker().stats.dispositions == {"succeeded": 1}
    assert reload(run).status == "succeeded"
    assert [s.name for s in EXPORTER.get_finished_spans()] == ["caller"]


def test_a_tool_name_the_model_invents_never_names_a_span(
    fake_api: FakeAnthropic, monkeypatch: pytest.MonkeyPatch
) -> None:
    invented = "x" * 300 + "\n<script>"
    call = "@" + invented.replace("\n", "") + " {}"
    start_run("tester", f"Say hello.\n{call}")
    assert run_worker().stats.dispositions == {"succeeded": 1}
    (unknown,) = spans_named("execute_tool")
    assert unknown.name == "execute_tool unknown_tool"
    assert unknown.attributes is not None
    assert unknown.attributes["gen_ai.tool.name"] == "unknown_tool"
    assert not any("xxx" in str(value) for value in unknown.attributes.values())

    EXPORTER.clear()
    monkeypatch.setenv(telemetry.CAPTURE_CONTENT_ENV, "true")
    start_run("tester", f"Say hello.\n{call}")
    assert run_worker().stats.dispositions == {"succeeded": 1}
    (unknown,) = spans_named("execute_tool")
    assert unknown.name == "execute_tool unknown_tool"
    assert unknown.attributes is not None
    requested = unknown.attributes["durable_agents.tool.requested_name"]
    assert isinstance(requested, str)
    assert requested.startswith("x" * 256)
    assert "[cut:" in requested


def test_tool_labels_are_bounded_and_plain() -> None:
    from durable_agents.observers import tool_label

    known = {"look up", "a" * 100, "fine-name.v2"}
    assert tool_label("look up", known) == "look_up"
    assert tool_label("a" * 100, known) == "a" * 64
    assert tool_label("fine-name.v2", known) == "fine-name.v2"
    assert tool_label("invented", known) == "unknown_tool"
    assert tool_label(None, known) == "unknown_tool"


# --------------------------------------------------------------------------- the API, no SDK


def test_with_the_api_but_no_provider_only_the_claim_makes_a_span(
    fake_api: FakeAnthropic, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The global provider is the API's proxy (never set in the tests): as in a process that
    # installed opentelemetry-api and configured no SDK.
    telemetry.use_tracer_provider(None)
    made: list[str] = []

    def noting(name: str) -> Any:
        cls = getattr(telemetry, name)

        def make(request: Any) -> Any:
            made.append(name)
            return cls(request)

        return make

    for name in ("_ModelCall", "_ToolSpan", "_AgentSpan"):
        monkeypatch.setattr(telemetry, name, noting(name))
    seen: list[Any] = []

    @tool(effect="pure")
    def trace_of_the_run() -> str:
        """What a tool's outgoing request would carry."""
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
        seen.append(carrier.get("traceparent"))
        return "ok"

    agent = Agent(
        name="no_sdk_agent",
        version="v1",
        model="claude-test-1",
        system="s",
        tools=[trace_of_the_run],
        max_tokens=64,
    )
    try:
        _run, caller = started_in_a_trace(agent.name, "@trace_of_the_run {}")
        assert run_worker().stats.dispositions == {"succeeded": 1}
    finally:
        registry.unregister(agent.name, agent.version)
        telemetry.use_tracer_provider(PROVIDER)
    trace_id = caller.get_span_context().trace_id
    # One claim: its invoke_agent span, and no chat or execute_tool span for its two model
    # calls and its tool call.
    assert made == ["_AgentSpan"]
    # The tool still ran inside the run's trace (the claim's non-recording span carries it).
    (traceparent,) = seen
    assert traceparent is not None
    assert traceparent.split("-")[1] == f"{trace_id:032x}"
