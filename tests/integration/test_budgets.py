"""Per-agent budgets (turns, tokens, wall time), checked between steps."""

from __future__ import annotations

import json

import pytest

import durable_agents
from durable_agents.engine.runner import tokens_of
from durable_agents.models import AgentRun, AgentStep, RunStatus, StepKind
from tests.conftest import run_worker

pytestmark = pytest.mark.django_db(transaction=True)


def _seqs(run: AgentRun) -> list[int]:
    return list(AgentStep.objects.filter(run=run).values_list("seq", flat=True))


def test_turn_budget() -> None:
    run = durable_agents.start_run("short", 'T.\n@lookup {"key": "1"}\n@lookup {"key": "2"}')
    run_worker()
    run.refresh_from_db()
    assert run.status == RunStatus.FAILED
    assert run.error == "budget exceeded: max_turns (2) reached"
    assert _seqs(run) == [0, 1, 2, 3, 4]


def test_token_budget_counts_usage_of_every_turn() -> None:
    run = durable_agents.start_run(
        "token_capped", 'T.\n@lookup {"key": "1"}\n@lookup {"key": "2"}\n@lookup {"key": "3"}'
    )
    run_worker()
    run.refresh_from_db()
    turns = [
        json.loads(p)
        for p in AgentStep.objects.filter(run=run, kind=StepKind.MODEL_TURN).values_list(
            "payload", flat=True
        )
    ]
    used = sum(tokens_of(t) for t in turns)
    assert run.status == RunStatus.FAILED
    assert used >= 400
    assert sum(tokens_of(t) for t in turns[:-1]) < 400  # it stopped at the first turn over
    assert run.error == f"budget exceeded: {used} tokens used, max_total_tokens is 400"


def test_wall_time_budget() -> None:
    run = durable_agents.start_run(
        "time_capped", 'T.\n@slow {"seconds": 1.2}\n@slow {"seconds": 0.1}'
    )
    run_worker()
    run.refresh_from_db()
    assert run.status == RunStatus.FAILED
    assert run.error.startswith("budget exceeded: ")
    assert "since the run started, max_wall_seconds is 1.0" in run.error
    assert _seqs(run) == [0, 1, 2]  # the slow call finished; no model call after it
