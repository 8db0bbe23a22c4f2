"""``RunContext``: a tool parameter annotated with it gets the run the call belongs to, found by
its annotation (not its name), and never appears in the schema the model sees."""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Annotated, Any

import pytest

from durable_agents import Agent, RunContext, tool
from durable_agents.declare.tools import Tool, ToolInputError, schema_from_signature
from durable_agents.exceptions import DefinitionError
from durable_agents.logging import current_run_id

RUN_ID = uuid.uuid4()


def context(**changes: Any) -> RunContext:
    values: dict[str, Any] = {
        "id": RUN_ID,
        "agent": "support",
        "version": "v1",
        "metadata": {"tenant": "acme"},
        "key": "order:1",
        "concurrency_key": "tenant:acme",
        "attempt": 2,
        "logger_name": "durable_agents.tools.lookup",
    }
    values.update(changes)
    return RunContext(**values)


def lookup_plain(order: str) -> str:
    """Look an order up."""
    return order


def lookup_with_context(order: str, run: RunContext) -> str:
    """Look an order up."""
    return f"{order} for {run.metadata['tenant']} in {run.id}"


def lookup_named_run(order: str, run: str) -> str:
    """Look an order up."""
    return order + run


def test_the_context_parameter_is_left_out_of_the_schema_whatever_its_name() -> None:
    def anywhere(order: str, *, current: Annotated[RunContext, "the run"]) -> str:
        """Look an order up."""
        return order

    plain = schema_from_signature(lookup_plain)
    assert schema_from_signature(lookup_with_context) == plain
    assert schema_from_signature(anywhere) == plain
    assert Tool(anywhere, effect="pure").run_context_parameter == "current"


def test_a_parameter_named_run_of_another_type_keeps_its_schema_and_fingerprint() -> None:
    named = Tool(lookup_named_run, effect="pure")
    assert named.run_context_parameter is None
    assert named.input_schema["properties"]["run"] == {"type": "string"}
    assert named.input_schema["required"] == ["order", "run"]
    assert named.invoke({"order": "o", "run": "-r"}) == "o-r"


def test_a_context_parameter_does_not_change_the_agents_fingerprint() -> None:
    def agent(func: Any) -> Agent:
        renamed = tool(effect="pure", name="lookup")(func)
        return Agent(name="fp", version="1", model="m", tools=[renamed], register=False)

    assert agent(lookup_with_context).fingerprint() == agent(lookup_plain).fingerprint()
    assert agent(lookup_named_run).fingerprint() != agent(lookup_plain).fingerprint()


def test_invoke_passes_the_context_and_refuses_one_from_the_model() -> None:
    t = Tool(lookup_with_context, effect="pure")
    assert t.invoke({"order": "o"}, run_context=context()) == f"o for acme in {RUN_ID}"
    with pytest.raises(ToolInputError):
        t.invoke({"order": "o", "run": {"agent": "forged"}}, run_context=context())
    with pytest.raises(TypeError, match="needs a RunContext"):
        t.invoke({"order": "o"})


def test_a_context_with_a_default_may_be_left_out() -> None:
    def maybe(order: str, run: RunContext | None = None) -> str:
        return order if run is None else run.agent

    t = Tool(maybe, effect="pure")
    assert t.run_context_parameter == "run"
    assert t.definition()["input_schema"]["properties"] == {"order": {"type": "string"}}
    assert t.invoke({"order": "o"}) == "o"
    assert t.invoke({"order": "o"}, run_context=context()) == "support"


def test_async_tools_receive_it_too() -> None:
    async def alookup(order: str, ctx: RunContext) -> str:
        await asyncio.sleep(0)
        return ctx.agent

    t = Tool(alookup, effect="pure")
    assert t.definition()["input_schema"]["properties"] == {"order": {"type": "string"}}
    assert asyncio.run(t.invoke({"order": "o"}, run_context=context())) == "support"


def test_two_context_parameters_are_a_definition_error() -> None:
    def twice(order: str, a: RunContext, b: RunContext) -> str:
        return order

    with pytest.raises(DefinitionError, match="only one parameter may be a RunContext"):
        Tool(twice, effect="pure")


def test_the_context_is_frozen_and_holds_a_copy_of_the_metadata() -> None:
    given = {"tenant": "acme", "tags": ["a"]}
    ctx = context(metadata=given)
    given["tenant"] = "changed"
    assert ctx.metadata["tenant"] == "acme"
    with pytest.raises(TypeError):
        ctx.metadata["tenant"] = "x"  # type: ignore[index]
    with pytest.raises(AttributeError):
        ctx.attempt = 3  # type: ignore[misc]


def test_its_logger_is_bound_to_the_run(caplog: pytest.LogCaptureFixture) -> None:
    ctx = context()
    assert current_run_id.get() == "-"
    with caplog.at_level(logging.INFO, logger="durable_agents.tools"):
        ctx.logger.info("seen %s", "order")
    (record,) = caplog.records
    assert record.name == "durable_agents.tools.lookup"
    assert record.getMessage() == "seen order"
    assert record.run_id == str(RUN_ID)  # type: ignore[attr-defined]
    assert current_run_id.get() == "-"
