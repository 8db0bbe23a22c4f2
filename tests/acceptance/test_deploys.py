"""Deploys: a new prompt version never touches runs pinned to the old one, and changes to
other agents never disturb a run."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from django.contrib.auth import get_user_model

import durable_agents
from durable_agents.declare.agents import Agent, registry
from durable_agents.models import AgentRun, RunStatus, ToolIntent
from tests.conftest import run_worker
from tests.testapp.agents import TOOLS, lookup

pytestmark = pytest.mark.django_db(transaction=True)

PLAN = 'Deploy.\n@lookup {"key": "a"}\n@lookup {"key": "b"}'


@pytest.fixture
def deployed_v2() -> Iterator[Agent]:
    agent = Agent(
        name="thinker",
        version="v2",
        model="claude-test-2",
        system="You are the reworded test agent.",
        tools=TOOLS,
        max_tokens=2048,
        thinking={"type": "enabled", "budget_tokens": 1024},
    )
    yield agent
    registry.unregister("thinker", "v2")


def test_a_new_prompt_version_leaves_runs_of_the_old_one_alone(deployed_v2: Agent) -> None:
    registry.unregister("thinker", "v2")
    old = durable_agents.start_run(
        "thinker", 'Deploy.\n@lookup {"key": "a"}\n@drop_table {"table": "t"}\n@lookup {"key": "b"}'
    )
    run_worker()  # two turns in, then it waits for a person
    assert AgentRun.objects.get(pk=old.pk).status == RunStatus.WAITING
    registry.register(deployed_v2)  # the deploy lands while `old` is in flight
    new = durable_agents.start_run("thinker", PLAN)
    admin = get_user_model().objects.create_superuser("boss", "boss@example.com", "pw")
    durable_agents.approve_intent(ToolIntent.objects.get(run=old).pk, user=admin)
    assert (new.prompt_version, new.model) == ("v2", "claude-test-2")
    assert (old.prompt_version, old.model) == ("v1", "claude-test-1")
    run_worker()
    old.refresh_from_db()
    new.refresh_from_db()
    assert old.status == new.status == RunStatus.SUCCEEDED
    assert old.fingerprint == registry.get("thinker", "v1").fingerprint("claude-test-1")
    assert new.fingerprint == deployed_v2.fingerprint()


def test_changing_an_unrelated_agent_does_not_disturb_a_run() -> None:
    run = durable_agents.start_run("thinker", PLAN)
    other = Agent(
        name="bystander", version="v1", model="claude-test-1", system="one", tools=[lookup]
    )
    registry.unregister("bystander", "v1")
    changed = Agent(
        name="bystander", version="v1", model="claude-test-1", system="two", tools=[lookup]
    )
    try:
        run_worker()
    finally:
        registry.unregister("bystander", "v1")
    assert other.fingerprint() != changed.fingerprint()
    assert AgentRun.objects.get(pk=run.pk).status == RunStatus.SUCCEEDED
