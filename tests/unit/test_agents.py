"""durable_agents.declare.agents: Agent validation, request parameters, fingerprints, the registry.

Agents here are built with ``register=False`` or against a private ``AgentRegistry``; the few
tests of the global registry unregister what they add, because other tests rely on it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured

import durable_agents
from durable_agents.declare.agents import (
    Agent,
    AgentNotFound,
    AgentRegistry,
    get_agent,
    registry,
)
from durable_agents.declare.tools import tool


@tool(effect="pure")
def get_schema(table: str) -> str:
    """Return the CREATE TABLE statement of one table."""
    return f"CREATE TABLE {table} ()"


@tool(effect="non_idempotent")
def charge_card(customer: str, cents: int, *, idempotency_key: str) -> dict[str, Any]:
    """Charge a card."""
    return {}


def make(**overrides: Any) -> Agent:
    kwargs: dict[str, Any] = {
        "name": "migrator",
        "version": "2026-12-01",
        "model": "claude-fable-5-1",
        "system": "You are a careful database migration agent.",
        "tools": [get_schema, charge_card],
        "max_tokens": 8000,
        "register": False,
    }
    kwargs.update(overrides)
    return Agent(**kwargs)


@pytest.fixture
def global_cleanup() -> Iterator[list[tuple[str, str]]]:
    """Names and versions that a test registered globally; unregistered afterwards."""
    added: list[tuple[str, str]] = []
    yield added
    for name, version in added:
        registry.unregister(name, version)


# --------------------------------------------------------------------------- construction


def test_package_exports_agent() -> None:
    assert durable_agents.Agent is Agent


def test_attributes() -> None:
    agent = make(thinking={"type": "enabled", "budget_tokens": 4000}, params={"top_k": 5})
    assert agent.name == "migrator"
    assert agent.version == "2026-12-01"
    assert agent.model == "claude-fable-5-1"
    assert agent.tools == (get_schema, charge_card)
    assert agent.tools_by_name == {"get_schema": get_schema, "charge_card": charge_card}
    assert agent.max_tokens == 8000
    assert agent.thinking == {"type": "enabled", "budget_tokens": 4000}
    assert agent.params == {"top_k": 5}
    assert agent.max_turns == 50
    assert agent.label == "migrator@2026-12-01"
    assert repr(agent) == "<Agent migrator@2026-12-01 model=claude-fable-5-1 tools=2>"


def test_arguments_are_keyword_only() -> None:
    with pytest.raises(TypeError):
        Agent("migrator", "v1", "m")  # type: ignore[call-arg]  # deliberately positional


@pytest.mark.parametrize("field", ["name", "version", "model"])
@pytest.mark.parametrize("value", ["", "   ", None])
def test_empty_name_version_model(field: str, value: Any) -> None:
    with pytest.raises(ImproperlyConfigured, match=f"Agent {field} must be a non-empty string"):
        make(**{field: value})


def test_overlong_name_is_rejected() -> None:
    with pytest.raises(ImproperlyConfigured, match=r"Agent name .* is longer than 200 characters"):
        make(name="x" * 201)


def test_plain_function_as_tool_says_how_to_fix() -> None:
    def undecorated(table: str) -> str:
        return table

    with pytest.raises(ImproperlyConfigured) as excinfo:
        make(tools=[get_schema, undecorated])
    message = str(excinfo.value)
    assert "agent migrator@2026-12-01" in message
    assert "undecorated is not a tool" in message
    assert "decorate it with @tool(effect=...)" in message


def test_duplicate_tool_names() -> None:
    @tool(effect="pure", name="get_schema")
    def other(table: str) -> str:
        return table

    with pytest.raises(ImproperlyConfigured, match="two tools are named 'get_schema'"):
        make(tools=[get_schema, other])


@pytest.mark.parametrize(
    "key", ["messages", "model", "system", "tools", "max_tokens", "thinking", "stream"]
)
def test_reserved_params(key: str) -> None:
    with pytest.raises(ImproperlyConfigured, match=f"params must not contain '{key}'"):
        make(params={"temperature": 0.2, key: "x"})


def test_params_must_be_json() -> None:
    with pytest.raises(ImproperlyConfigured, match="request parameters are not JSON-serialisable"):
        make(params={"metadata": object()})


@pytest.mark.parametrize("value", [0, -1, True, 1.5])
def test_max_turns_must_be_at_least_one(value: Any) -> None:
    with pytest.raises(ImproperlyConfigured, match=r"max_turns must be at least 1, got"):
        make(max_turns=value)
    assert make(max_turns=1).max_turns == 1


@pytest.mark.parametrize("value", [0, -5, "8000", False])
def test_max_tokens_must_be_positive(value: Any) -> None:
    with pytest.raises(ImproperlyConfigured, match="max_tokens must be a positive integer"):
        make(max_tokens=value)


def test_thinking_budget_must_be_below_max_tokens() -> None:
    with pytest.raises(
        ImproperlyConfigured,
        match=r"budget_tokens \(8000\) must be less than max_tokens \(8000\)",
    ):
        make(thinking={"type": "enabled", "budget_tokens": 8000})
    with pytest.raises(ImproperlyConfigured, match="thinking must be a dict"):
        make(thinking="enabled")


def test_construction_registers_unless_register_false(
    global_cleanup: list[tuple[str, str]],
) -> None:
    unregistered = make(name="test-agents-unregistered")
    assert registry.versions("test-agents-unregistered") == []

    global_cleanup.append(("test-agents-registered", "v1"))
    agent = make(name="test-agents-registered", version="v1", register=True)
    assert registry.get("test-agents-registered") is agent
    assert get_agent("test-agents-registered", "v1") is agent
    assert unregistered not in registry.all()


# --------------------------------------------------------------------------- request params


def test_request_params_key_order_and_content() -> None:
    agent = make(
        thinking={"type": "enabled", "budget_tokens": 4000},
        params={"temperature": 1, "metadata": {"user_id": "u"}},
    )
    params = agent.request_params()
    assert list(params) == [
        "model",
        "max_tokens",
        "system",
        "tools",
        "thinking",
        "temperature",
        "metadata",
    ]
    assert params == {
        "model": "claude-fable-5-1",
        "max_tokens": 8000,
        "system": "You are a careful database migration agent.",
        "tools": [get_schema.definition(), charge_card.definition()],
        "thinking": {"type": "enabled", "budget_tokens": 4000},
        "temperature": 1,
        "metadata": {"user_id": "u"},
    }
    assert "messages" not in params


def test_request_params_model_argument_overrides() -> None:
    assert make().request_params("claude-other")["model"] == "claude-other"
    assert make().request_params()["model"] == "claude-fable-5-1"


def test_request_params_omit_tools_thinking_and_empty_system() -> None:
    params = make(tools=[], system="").request_params()
    assert params == {"model": "claude-fable-5-1", "max_tokens": 8000}


def test_system_as_blocks_is_passed_through() -> None:
    blocks = [{"type": "text", "text": "Be careful.", "cache_control": {"type": "ephemeral"}}]
    assert make(system=blocks).request_params()["system"] == blocks


def test_request_params_are_fresh_copies() -> None:
    agent = make(params={"metadata": {"user_id": "u"}})
    before = agent.fingerprint()
    params = agent.request_params()
    params["metadata"]["user_id"] = "changed"
    params["tools"][0]["input_schema"]["properties"].clear()
    assert agent.fingerprint() == before


def test_constructor_arguments_are_copied() -> None:
    params = {"metadata": {"user_id": "u"}}
    agent = make(params=params)
    before = agent.fingerprint()
    params["metadata"]["user_id"] = "changed"
    assert agent.fingerprint() == before


# --------------------------------------------------------------------------- fingerprint


def test_fingerprint_is_sha256_of_canonical_request_params() -> None:
    agent = make(thinking={"type": "enabled", "budget_tokens": 4000})
    expected = hashlib.sha256(
        json.dumps(
            agent.request_params(), sort_keys=True, separators=(",", ":"), ensure_ascii=False
        ).encode()
    ).hexdigest()
    assert agent.fingerprint() == expected
    assert len(expected) == 64


def test_fingerprint_is_stable_for_the_same_definition() -> None:
    assert make().fingerprint() == make().fingerprint()
    # name, version, max_turns and the params' insertion order are not part of what is sent.
    assert make(name="other", version="v9", max_turns=3).fingerprint() == make().fingerprint()
    assert (
        make(params={"a": 1, "b": 2}).fingerprint() == make(params={"b": 2, "a": 1}).fingerprint()
    )


def test_fingerprint_of_non_ascii_matches_ensure_ascii_false() -> None:
    agent = make(system="Sois prudent — très prudent.")
    canonical = json.dumps(
        agent.request_params(), sort_keys=True, separators=(",", ":"), ensure_ascii=False
    )
    assert "—" in canonical
    assert agent.fingerprint() == hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def _tool_variant(**overrides: Any) -> Any:
    def get_schema(table: str) -> str:
        """Return the CREATE TABLE statement of one table."""
        return table

    options: dict[str, Any] = {"effect": "pure"}
    options.update(overrides)
    return tool(**options)(get_schema)


def test_identical_tool_definitions_give_identical_fingerprints() -> None:
    assert make(tools=[_tool_variant()]).fingerprint() == make(tools=[get_schema]).fingerprint()


@pytest.mark.parametrize(
    "change",
    [
        {"system": "You are a reckless migration agent."},
        {"model": "claude-fable-5-2"},
        {"max_tokens": 8001},
        {"thinking": {"type": "enabled", "budget_tokens": 4000}},
        {"params": {"temperature": 0.5}},
        {"tools": [get_schema]},
        {"tools": [charge_card, get_schema]},
        {"tools": [_tool_variant(description="Another description."), charge_card]},
        {"tools": [_tool_variant(name="get_ddl"), charge_card]},
        {
            "tools": [
                _tool_variant(input_schema={"type": "object", "properties": {}}),
                charge_card,
            ]
        },
    ],
)
def test_fingerprint_changes_with_what_is_sent(change: dict[str, Any]) -> None:
    assert make(**change).fingerprint() != make().fingerprint()


def test_fingerprint_model_argument() -> None:
    agent = make()
    assert agent.fingerprint("claude-fable-5-1") == agent.fingerprint()
    assert agent.fingerprint("claude-other") != agent.fingerprint()
    assert agent.fingerprint("claude-other") == make(model="claude-other").fingerprint()


def test_effect_change_alone_keeps_the_fingerprint() -> None:
    # The effect is not sent to the model, so it cannot break a resumed conversation.
    changed = make(tools=[_tool_variant(effect="idempotent"), charge_card])
    assert changed.fingerprint() == make().fingerprint()


# --------------------------------------------------------------------------- registry


def test_registry_get_versions_and_newest() -> None:
    reg = AgentRegistry()
    v1 = reg.register(make(version="v1"))
    v3 = reg.register(make(version="v3"))
    v2 = reg.register(make(version="v2", max_tokens=9000))
    other = reg.register(make(name="reporter", version="v1"))

    assert reg.versions("migrator") == ["v1", "v3", "v2"]
    assert reg.versions("nobody") == []
    assert reg.get("migrator") is v2  # Most recently registered, not the "largest" version.
    assert reg.get("migrator", "v1") is v1
    assert reg.get("migrator", "v3") is v3
    assert reg.all() == [v1, v3, v2, other]
    assert len(reg) == 4
    assert ("migrator", "v3") in reg
    assert ("migrator", "v9") not in reg


def test_registry_same_fingerprint_replaces_silently() -> None:
    reg = AgentRegistry()
    first = reg.register(make(version="v1"))
    reg.register(make(version="v2"))
    again = make(version="v1")  # The same module imported a second time.
    assert reg.register(again) is again
    assert reg.get("migrator", "v1") is again
    assert reg.get("migrator", "v1") is not first
    # Replacing keeps its place: v2 is still the newest.
    assert reg.versions("migrator") == ["v1", "v2"]
    assert reg.get("migrator").version == "v2"


def test_registry_different_fingerprint_under_same_version_is_refused() -> None:
    reg = AgentRegistry()
    original = reg.register(make())
    with pytest.raises(ImproperlyConfigured) as excinfo:
        reg.register(make(system="A changed prompt."))
    message = str(excinfo.value)
    assert message.startswith("two agents are registered as migrator@2026-12-01")
    assert original.fingerprint()[:12] in message
    assert "give the changed agent a new version" in message
    assert reg.get("migrator", "2026-12-01") is original


def test_registry_registering_the_same_object_twice_is_fine() -> None:
    reg = AgentRegistry()
    agent = make()
    reg.register(agent)
    reg.register(agent)
    assert reg.all() == [agent]


def test_agent_not_found_unknown_name() -> None:
    reg = AgentRegistry()
    reg.register(make(name="reporter", version="v1"))
    reg.register(make(name="auditor", version="v1"))
    with pytest.raises(AgentNotFound) as excinfo:
        reg.get("migrator", "2026-12-01")
    assert isinstance(excinfo.value, LookupError)
    assert str(excinfo.value).startswith(
        "no agent named 'migrator' (version '2026-12-01') is registered; "
        "registered agents: auditor, reporter."
    )
    with pytest.raises(AgentNotFound, match="registered agents: none"):
        AgentRegistry().get("migrator")


def test_agent_not_found_unknown_version() -> None:
    reg = AgentRegistry()
    reg.register(make(version="v1"))
    reg.register(make(version="v2"))
    with pytest.raises(AgentNotFound) as excinfo:
        reg.get("migrator", "v0")
    assert str(excinfo.value).startswith(
        "agent 'migrator' has no version 'v0'; registered versions: v1, v2."
    )


def test_unregister_and_clear() -> None:
    reg = AgentRegistry()
    reg.register(make(version="v1"))
    v2 = reg.register(make(version="v2"))
    reg.unregister("migrator", "v1")
    assert reg.versions("migrator") == ["v2"]
    assert reg.get("migrator") is v2
    reg.unregister("migrator", "v1")  # Already gone: a no-op.
    reg.unregister("nobody", "v1")
    reg.unregister("migrator", "v2")
    with pytest.raises(AgentNotFound):
        reg.get("migrator")
    assert reg.all() == []

    reg.register(make(version="v1"))
    reg.clear()
    assert reg.all() == []
    assert reg.versions("migrator") == []


def test_global_duplicate_is_refused_at_construction(
    global_cleanup: list[tuple[str, str]],
) -> None:
    global_cleanup.append(("test-agents-dup", "v1"))
    first = make(name="test-agents-dup", version="v1", register=True)
    same = make(name="test-agents-dup", version="v1", register=True)
    assert get_agent("test-agents-dup", "v1") is same
    assert same is not first
    with pytest.raises(
        ImproperlyConfigured, match="two agents are registered as test-agents-dup@v1"
    ):
        make(name="test-agents-dup", version="v1", max_tokens=100, register=True)
    assert get_agent("test-agents-dup") is same


def test_get_agent_delegates_to_the_global_registry(
    global_cleanup: list[tuple[str, str]],
) -> None:
    global_cleanup.extend([("test-agents-get", "a"), ("test-agents-get", "b")])
    a = make(name="test-agents-get", version="a", register=True)
    b = make(name="test-agents-get", version="b", register=True)
    assert get_agent("test-agents-get") is b
    assert get_agent("test-agents-get", "a") is a
    with pytest.raises(AgentNotFound, match="registered versions: a, b"):
        get_agent("test-agents-get", "c")


@pytest.mark.parametrize("limit", [0, -1, 2.0, True, "5"])
def test_a_concurrency_limit_is_a_whole_number_of_at_least_1(limit: Any) -> None:
    with pytest.raises(ValueError, match="concurrency_limit must be"):
        Agent(name="limited", version="1", model="m", concurrency_limit=limit, register=False)


def test_the_concurrency_limit_is_not_part_of_the_fingerprint() -> None:
    plain = Agent(name="limited", version="1", model="m", register=False)
    limited = Agent(name="limited", version="1", model="m", concurrency_limit=5, register=False)
    assert limited.concurrency_limit == 5
    assert limited.fingerprint() == plain.fingerprint()
