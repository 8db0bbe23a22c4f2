"""The seam between the engine and its observers (``durable_agents.observers``): what a run
reports, once each, to an observer subscribed to it; and the model-call layer's independence
from the engine and the observers (read from its imports)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from durable_agents import llm, observers
from durable_agents.declare.agents import Agent
from durable_agents.declare.tools import tool
from durable_agents.engine import runner
from durable_agents.engine.worker import Worker
from durable_agents.observers import ModelOutcome, ToolOutcome
from durable_agents.store import Claim, InMemoryStore
from tests.unit.conftest import RegisterAgent, claimed, start


@tool(effect="pure")
def lookup(key: str) -> str:
    """Read a value by key."""
    return f"value-of-{key}"


@tool(effect="idempotent")
def explode(message: str) -> str:
    """Fail with a message."""
    raise RuntimeError(message)


class Recording(observers.Observer):
    """Every report, in order, as (what, details); scopes as their entry and exit."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, Any]] = []

    def of(self, what: str) -> list[Any]:
        return [details for name, details in self.seen if name == what]

    def model_attempt(self, event: observers.ModelAttempt) -> None:
        self.seen.append(("model_attempt", event))

    def tool_call(self, event: observers.ToolCallEnd) -> None:
        self.seen.append(("tool_call", event))

    def step_committed(self, event: observers.StepCommit) -> None:
        self.seen.append(("step_committed", event))

    def claim_ended(self, event: observers.ClaimEnd) -> None:
        self.seen.append(("claim_ended", event))

    def agent_span(self, claim: Claim) -> observers.AgentSpan:
        recording = self

        class Span(observers.AgentSpan):
            def __enter__(self) -> Span:
                recording.seen.append(("agent_span", claim.run_id))
                return self

            def finish(self, disposition: str) -> None:
                recording.seen.append(("agent_finish", str(disposition)))

            def __exit__(self, *exc: Any) -> None:
                recording.seen.append(("agent_span_end", claim.run_id))

        return Span()

    def model_call(self, request: observers.ModelRequest) -> observers.ModelCall:
        recording = self
        recording.seen.append(("model_call", request.params["model"]))

        class Attempt(observers.ModelSpan):
            def answered(self, turn: observers.AnswerT) -> observers.AnswerT:
                recording.seen.append(("answered", turn.message.get("stop_reason")))
                return turn

        class Call(observers.ModelCall):
            def attempt(self) -> observers.ModelSpan:
                return Attempt()

        return Call()

    def tool_span(self, request: observers.ToolRequest) -> observers.ToolSpan:
        recording = self

        class Span(observers.ToolSpan):
            def result(self, text: str, is_error: bool) -> None:
                recording.seen.append(("tool_result", (request.call["name"], is_error)))

        return Span()


@pytest.fixture
def recording() -> Iterator[Recording]:
    observer = Recording()
    observers.subscribe(observer)
    observers.subscribe(observer)  # once, however often
    yield observer
    observers.unsubscribe(observer)


@pytest.fixture
def agent(register_agent: RegisterAgent) -> Agent:
    return register_agent(
        name="unit-observers",
        system="You are the unit test agent.",
        tools=[lookup, explode],
        max_turns=10,
    )


def test_an_observer_sees_each_call_commit_and_claim_of_a_run_once(
    recording: Recording, agent: Agent, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = InMemoryStore()
    monkeypatch.setattr(runner, "current", lambda: store)  # the worker's runs live here
    run_id = start(store, agent, 'Look it up.\n@lookup {"key": "a"} && explode {"message": "x"}')
    claim = claimed(store, run_id)
    # One slot of a worker, without its threads: the claim advanced and reported as the
    # worker's slots do.
    assert Worker(handle_signals=False, listen=False)._work(claim) is None
    assert store.run(run_id).status == "succeeded"

    # Two model calls (the turn with the tool calls, the final turn), each one attempt.
    assert recording.of("model_call") == ["claude-test-1"] * 2
    assert [(e.model, e.outcome) for e in recording.of("model_attempt")] == [
        ("claude-test-1", ModelOutcome.OK)
    ] * 2
    assert all(e.seconds >= 0 for e in recording.of("model_attempt"))
    assert recording.of("answered") == ["tool_use", "end_turn"]
    # Two tool calls: one returned, one raised (its class is the span's error type).
    assert [(e.tool, e.effect, e.outcome, e.error_type) for e in recording.of("tool_call")] == [
        ("lookup", "pure", ToolOutcome.OK, None),
        ("explode", "idempotent", ToolOutcome.ERROR, "RuntimeError"),
    ]
    assert recording.of("tool_result") == [("lookup", False), ("explode", True)]
    # Three steps committed: the turn, the tool results, the final turn.
    assert [e.kind for e in recording.of("step_committed")] == [
        "model_turn",
        "tool_result",
        "model_turn",
    ]
    # One claim: its span around everything else, then its outcome, reported by the worker.
    assert recording.of("claim_ended") == [observers.ClaimEnd(run_id, "succeeded")]
    names = [name for name, _ in recording.seen]
    assert names[0] == "agent_span"
    assert names[-3:] == ["agent_finish", "agent_span_end", "claim_ended"]
    assert names.count("agent_span") == names.count("agent_finish") == 1


def test_reports_to_nobody_build_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(observers, "_observers", ())
    monkeypatch.setattr(observers, "ModelAttempt", None)  # building one would raise
    observers.model_attempt("claude-test-1", ModelOutcome.OK, 1.0)
    span = observers.tool_span(None, {}, "key")  # type: ignore[arg-type]
    assert span is observers.tool_span(None, {}, "other")  # type: ignore[arg-type]
    with span:
        span.result("text", False)


def test_an_unsubscribed_observer_sees_nothing_more(recording: Recording) -> None:
    observers.step_committed("model_turn", 0.001)
    observers.unsubscribe(recording)
    observers.step_committed("tool_result", 0.001)
    assert [e.kind for e in recording.of("step_committed")] == ["model_turn"]


# -- the model-call layer knows neither the engine nor the observers ----------------------

LLM = Path(llm.__file__).parent
FORBIDDEN = ("prometheus", "telemetry", "runner", "worker")


def forbidden_imports(source: str) -> list[str]:
    """The modules of ``FORBIDDEN`` that ``source`` imports, however it spells the import."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            names = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "durable_agents" and any(part in FORBIDDEN for part in parts[1:]):
                found.append(name)
    return found


def test_the_model_call_layer_imports_neither_observers_nor_the_engine() -> None:
    modules = sorted(LLM.glob("*.py"))
    assert {m.name for m in modules} >= {"retries.py", "client.py", "body.py", "sse.py"}
    found = {m.name: forbidden_imports(m.read_text()) for m in modules}
    assert found == {m.name: [] for m in modules}


@pytest.mark.parametrize(
    "line",
    [
        "from durable_agents import calls, prometheus",
        "import durable_agents.observe.telemetry",
        "from durable_agents.engine.runner import advance_run",
        "from durable_agents.engine.worker import Worker",
        "def f():\n    from durable_agents import telemetry",
    ],
)
def test_the_import_check_catches_an_import_added_back(line: str) -> None:
    source = (LLM / "retries.py").read_text() + "\n" + line + "\n"
    assert forbidden_imports(source)
