"""Helpers for testing your own agents deterministically, offline.

``run_agent`` starts a run and drives it to the end in the calling thread (so it works inside
pytest-django's transactional ``db`` fixture), with the offline scripted model playing a plan
you write with ``plan(...)``. It returns a ``RunResult`` to assert on: the tool calls with their
idempotency keys and results, the transcript, the final status.

The pytest fixtures around it live in ``durable_agents.pytest_plugin``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from django.contrib.auth import get_user_model
from django.test import override_settings

from durable_agents import api, leases, llm
from durable_agents.conf import app_settings
from durable_agents.history import Conversation, step_message
from durable_agents.models import (
    AgentRun,
    AgentStep,
    IntentStatus,
    RunStatus,
    StepKind,
    ToolEffect,
    ToolIntent,
)
from durable_agents.runner import Interrupt, advance_run

Call = tuple[str, Any]


def plan(*turns: Call | Sequence[Call], task: str = "Follow the plan.") -> str:
    """A task text for the offline model: one turn per argument, each a ``(tool, input)``
    call or a list of calls made in the same turn. After the plan the model ends its run."""
    lines = [task]
    for turn in turns:
        calls = [turn] if isinstance(turn, tuple) else list(turn)
        lines.append(
            "@" + " && ".join(f"{name} {json.dumps(arguments)}" for name, arguments in calls)
        )
    return "\n".join(lines)


@dataclass(frozen=True)
class ToolCall:
    turn_seq: int
    index: int
    name: str
    input: Any
    key: str | None
    result: str | None
    is_error: bool


@dataclass
class RunResult:
    run: AgentRun
    steps: list[AgentStep]
    effects: list[ToolEffect]
    intents: list[ToolIntent]

    @property
    def status(self) -> str:
        return self.run.status

    @property
    def result(self) -> str | None:
        return self.run.result

    @property
    def error(self) -> str:
        return self.run.error

    def messages(self) -> list[dict[str, Any]]:
        conversation = Conversation()
        for step in self.steps:
            conversation.append(step_message(step.kind, step.payload, step.content_span))
        return conversation.messages()

    def tool_calls(self) -> list[ToolCall]:
        """Every call the model made, in order, with the recorded outcome."""
        from durable_agents.effects import idempotency_key

        by_key = {e.key: e for e in self.effects}
        calls = []
        for step in self.steps:
            if step.kind != StepKind.MODEL_TURN:
                continue
            uses = [b for b in step.data()["content"] if b.get("type") == "tool_use"]
            for index, block in enumerate(uses):
                key = idempotency_key(self.run.pk, step.seq, index, block["name"], block["input"])
                effect = by_key.get(key)
                calls.append(
                    ToolCall(
                        turn_seq=step.seq,
                        index=index,
                        name=block["name"],
                        input=block["input"],
                        key=key,
                        result=effect.result if effect else None,
                        is_error=effect.is_error if effect else False,
                    )
                )
        return calls

    def tool_names(self) -> list[str]:
        return [c.name for c in self.tool_calls()]

    def transcript(self) -> str:
        """A readable, stable rendering for snapshot-style assertions."""
        lines = []
        for step in self.steps:
            data = step.data()
            if step.kind == StepKind.TASK:
                lines.append(f"{step.seq} task: {data}")
            elif step.kind == StepKind.MODEL_TURN:
                for block in data["content"]:
                    if block.get("type") == "text":
                        lines.append(f"{step.seq} assistant: {block['text']}")
                    elif block.get("type") == "tool_use":
                        lines.append(
                            f"{step.seq} call {block['name']} {json.dumps(block['input'])}"
                        )
            else:
                for block in data:
                    flag = " (error)" if block.get("is_error") else ""
                    lines.append(f"{step.seq} result{flag}: {block['content']}")
        return "\n".join(lines)


Decision = str | Callable[[ToolIntent], str]


def _operator() -> Any:
    user_model = get_user_model()
    user, _ = user_model.objects.get_or_create(
        username="durable-agents-test-operator", defaults={"is_staff": True, "is_superuser": True}
    )
    if not user.is_superuser:
        user.is_superuser = True
        user.save(update_fields=["is_superuser"])
    return user


def drive(run: AgentRun, *, intents: Decision = "approve", max_claims: int = 100) -> RunResult:
    """Advance ``run`` in this thread until it ends (or waits with ``intents="wait"``).

    ``intents``: "approve", "reject", "wait" or a function of the intent returning one of them;
    for an intent whose outcome is unknown, "approve" resolves it as not having happened.
    """
    for _ in range(max_claims):
        run.refresh_from_db()
        if run.status == RunStatus.WAITING:
            waiting = list(
                ToolIntent.objects.filter(run=run).filter(
                    status__in=(IntentStatus.PENDING, IntentStatus.UNKNOWN)
                )
            )
            if not waiting:
                break
            for intent in waiting:
                decision = intents(intent) if callable(intents) else intents
                if decision == "wait":
                    return _result(run)
                if intent.status == IntentStatus.UNKNOWN:
                    api.resolve_intent(intent.pk, _operator(), happened=decision != "approve")
                elif decision == "approve":
                    api.approve_intent(intent.pk, _operator())
                elif decision == "reject":
                    api.reject_intent(intent.pk, _operator(), reason="rejected by the test")
                else:
                    raise ValueError(f"unknown decision {decision!r}")
            continue
        if run.status not in (RunStatus.PENDING, RunStatus.RUNNING):
            break
        claim = leases.claim_run(run.pk, "durable-agents-test", app_settings.LEASE_SECONDS)
        if claim is None:
            raise RuntimeError(f"run {run.pk} is leased by another worker")
        advance_run(claim, Interrupt())
    else:
        raise RuntimeError(f"run {run.pk} did not end within {max_claims} claims")
    return _result(run)


def _result(run: AgentRun) -> RunResult:
    run.refresh_from_db()
    return RunResult(
        run=run,
        steps=list(AgentStep.objects.filter(run=run).order_by("seq")),
        effects=list(ToolEffect.objects.filter(run=run).order_by("seq", "call_index")),
        intents=list(ToolIntent.objects.filter(run=run).order_by("pk")),
    )


def run_agent(
    agent: str,
    task: str,
    *,
    version: str | None = None,
    model: str | None = None,
    intents: Decision = "approve",
    offline: bool = True,
) -> RunResult:
    """Start a run of ``agent`` and drive it to its end with the offline scripted model."""
    run = api.start_run(agent, task, version=version, model=model)
    if not offline:
        return drive(run, intents=intents)
    with offline_model():
        return drive(run, intents=intents)


class offline_model(override_settings):  # noqa: N801 - used like override_settings
    """Force the offline scripted model (and a fresh client) inside a block or a test."""

    def __init__(self) -> None:
        from django.conf import settings

        current = dict(getattr(settings, "DURABLE_AGENTS", None) or {})
        super().__init__(
            DURABLE_AGENTS={
                **current,
                "OFFLINE": True,
                "CLIENT_FACTORY": "durable_agents.llm.default_client",
            }
        )

    def enable(self) -> None:
        super().enable()
        llm.reset_clients()

    def disable(self) -> None:
        super().disable()
        llm.reset_clients()
