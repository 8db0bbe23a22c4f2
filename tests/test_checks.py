"""Each system check fires on its mistake and stays quiet otherwise."""

from __future__ import annotations

from typing import Any

import pytest
from django.core import checks

from durable_agents import checks as da_checks
from durable_agents.agents import Agent, registry
from durable_agents.tools import tool


def ids(messages: list[checks.CheckMessage]) -> list[str]:
    return sorted(m.id for m in messages)


def test_the_test_settings_pass() -> None:
    assert da_checks.check_settings() == []
    assert da_checks.check_agents() == []


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({"LEASE_SECONDZ": 5}, ["durable_agents.E002"]),
        ({"LEASE_SECONDS": 0}, ["durable_agents.E003"]),
        ({"POLL_INTERVAL": "1"}, ["durable_agents.E003"]),
        ({"MAX_ATTEMPTS": 0}, ["durable_agents.E004"]),
        ({"MODEL_RETRIES": -1}, ["durable_agents.E004"]),
        ({"BETAS": "a-beta"}, ["durable_agents.E005"]),
        ({"CLIENT_FACTORY": "nowhere.factory"}, ["durable_agents.E006"]),
        ({"LEASE_SECONDS": 10, "HEARTBEAT_SECONDS": 8}, ["durable_agents.W001"]),
        ({"SHUTDOWN_GRACE_SECONDS": -1}, ["durable_agents.E003"]),
        ({"RETENTION_DAYS": 0}, ["durable_agents.E003"]),
        ({"RETENTION_BATCH": 0}, ["durable_agents.E004"]),
        ({"OFFLINE": "yes"}, ["durable_agents.E007"]),
        ({"OVERLAP_SAFE_COMMITS": 1}, ["durable_agents.E007"]),
        ({"RETIRED_MODELS": "claude-2.1"}, ["durable_agents.E005"]),
        ({"ARCHIVER": "nowhere.archive"}, ["durable_agents.E006"]),
    ],
)
def test_invalid_settings(da_settings: Any, values: dict[str, Any], expected: list[str]) -> None:
    da_settings(**values)
    assert ids(da_checks.check_settings()) == expected


def test_settings_that_are_not_a_dict(settings: Any) -> None:
    settings.DURABLE_AGENTS = ["LEASE_SECONDS", 5]
    assert ids(da_checks.check_settings()) == ["durable_agents.E001"]


def test_missing_api_key_warns_only_when_online(
    da_settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    monkeypatch.delenv("ANTHROPIC_AUTH_TOKEN", raising=False)
    da_settings(OFFLINE=False)
    assert ids(da_checks.check_settings()) == ["durable_agents.W002"]
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-x")
    assert da_checks.check_settings() == []
    da_settings(OFFLINE=True)
    monkeypatch.delenv("ANTHROPIC_API_KEY")
    assert da_checks.check_settings() == []


def test_sqlite_without_debug_warns(settings: Any) -> None:
    from django.db import connection

    settings.DEBUG = False
    found = ids(da_checks.check_database())
    if connection.vendor == "sqlite":
        assert found == ["durable_agents.W003"]
    else:
        assert found == []
    settings.DEBUG = True
    assert da_checks.check_database() == []


def test_non_idempotent_tool_without_a_key() -> None:
    @tool(effect="non_idempotent")
    def send_email(to: str) -> str:
        """Send an e-mail."""
        return to

    agent = Agent(name="mailer", version="v1", model="claude-x", system="s", tools=[send_email])
    try:
        messages = da_checks.check_agents()
        assert ids(messages) == ["durable_agents.E010"]
        assert "send_email" in messages[0].msg
    finally:
        registry.unregister(agent.name, agent.version)
    assert da_checks.check_agents() == []


def test_checks_are_registered() -> None:
    registered = {c.__name__ for c in checks.registry.registry.get_checks()}
    assert {"check_settings", "check_database", "check_agents"} <= registered
