"""pytest fixtures for projects that use durable_agents (needs pytest-django).

Enabled automatically when durable_agents is installed with pip (a ``pytest11`` entry point),
or with ``pytest_plugins = ["durable_agents.pytest_plugin"]`` in a conftest.py.

    def test_migrator_asks_before_dropping(agent_runner, durable_plan):
        result = agent_runner("migrator", durable_plan(("drop_table", {"table": "old"})),
                              intents="wait")
        assert result.status == "waiting"
        assert result.intents[0].tool == "drop_table"
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest


@pytest.fixture
def offline_model(settings: Any) -> Iterator[None]:
    """The offline scripted model answers every model call in this test."""
    from durable_agents.testing import offline_model as force_offline

    with force_offline():
        yield


@pytest.fixture
def agent_runner(db: None, offline_model: None) -> Callable[..., Any]:
    """``agent_runner(agent, task, intents="approve"|"reject"|"wait"|fn)`` -> RunResult."""
    from durable_agents.testing import run_agent

    def runner(agent: str, task: str, **options: Any) -> Any:
        return run_agent(agent, task, offline=False, **options)

    return runner


@pytest.fixture
def durable_plan() -> Callable[..., str]:
    """``durable_plan(("tool", {...}), [("a", {...}), ("b", {...})])`` -> a task text."""
    from durable_agents.testing import plan

    return plan
