"""Unit tests: no database. Nothing here is marked ``django_db``, so pytest-django refuses any
query: a test that reached the database would fail, which is what proves it does not.

Besides the fixtures, the helpers the unit modules share: ``start`` and ``claimed`` (import
them like ``from tests.unit.conftest import claimed, start``) and the ``register_agent``
fixture."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

import pytest

from durable_agents import llm
from durable_agents.declare.agents import Agent, registry
from durable_agents.declare.tools import Tool
from durable_agents.models import AgentRun
from durable_agents.store import Claim, InMemoryStore
from durable_agents.store.memory import ManualClock


@pytest.fixture(autouse=True)
def offline_and_quiet(settings: Any) -> Iterator[None]:
    """The offline scripted model, and no notifications (their recipients are in the
    database)."""
    settings.DURABLE_AGENTS = {**settings.DURABLE_AGENTS, "OFFLINE": True, "NOTIFY": False}
    llm.reset_clients()
    yield
    llm.reset_clients()


@pytest.fixture
def clock() -> ManualClock:
    """The in-memory store's clock: leases and timers move only when a test advances it."""
    return ManualClock()


@pytest.fixture
def store(clock: ManualClock) -> Iterator[InMemoryStore]:
    """The store of a unit test: every transition, no database. The agent of a bare run
    (``start`` without an agent: "a" at "v1") is registered meanwhile, since claims take only
    runs of the agent versions the process defines."""
    bare = Agent(name="a", version="v1", model="m", register=False)
    registry.register(bare)
    yield InMemoryStore(now=clock)
    registry.unregister("a", "v1")


class RegisterAgent(Protocol):
    """The callable of the ``register_agent`` fixture."""

    def __call__(self, *, name: str, tools: Iterable[Tool] = (), **options: Any) -> Agent: ...


# What a unit test's agent is unless it says otherwise (``register_agent``'s defaults).
AGENT_DEFAULTS: dict[str, Any] = {"version": "v1", "model": "claude-test-1", "max_tokens": 256}


@pytest.fixture
def register_agent() -> Iterator[RegisterAgent]:
    """Define and register agents for one test: ``register_agent(name="unit-x", tools=[...],
    system=..., max_turns=...)`` builds the Agent (version "v1", model "claude-test-1" and
    max_tokens 256 unless given), registers it and returns it. Every agent it registered is
    unregistered at teardown, after the teardown of the fixtures that use it."""
    registered: list[Agent] = []

    def register(*, name: str, tools: Iterable[Tool] = (), **options: Any) -> Agent:
        made = Agent(name=name, tools=tools, **{**AGENT_DEFAULTS, **options}, register=False)
        registry.register(made)
        registered.append(made)
        return made

    yield register
    for made in registered:
        registry.unregister(made.name, made.version)


def start(
    store: InMemoryStore,
    agent: Agent | None = None,
    task: str = "t",
    *,
    version: str | None = None,
    fingerprint: str | None = None,
    **fields: Any,
) -> uuid.UUID:
    """Create a pending run of ``task`` in ``store`` and return its id. With an agent, the run
    is pinned as ``start_run`` pins it: the agent's name, version, model and fingerprint
    (``version`` or ``fingerprint`` pins another, e.g. one no worker has). Without one, a
    bare run (agent "a" at "v1" on model "m", no fingerprint): the store looks no agent up.
    ``fields`` sets other columns of the run (``concurrency_key=...``)."""
    if agent is None:
        pinned: dict[str, Any] = {"agent": "a", "prompt_version": "v1", "model": "m"}
    else:
        pinned = {
            "agent": agent.name,
            "prompt_version": agent.version,
            "model": agent.model,
            "fingerprint": agent.fingerprint(agent.model),
        }
    if version is not None:
        pinned["prompt_version"] = version
    if fingerprint is not None:
        pinned["fingerprint"] = fingerprint
    run = AgentRun(id=uuid.uuid4(), task=task, **pinned, **fields)
    return store.create_run(run, json.dumps(task)).pk


def claimed(store: InMemoryStore, run_id: Any, owner: str = "w1") -> Claim:
    """Claim the run ``run_id`` for ``owner`` (a 30 s lease), asserting that it was claimable."""
    claim = store.claim_run(run_id, owner, 30)
    assert claim is not None
    return claim
