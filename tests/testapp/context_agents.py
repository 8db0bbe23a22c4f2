"""The agent whose tools receive their run (``RunContext``): a new agent, so that no existing
agent's fingerprint changes."""

from __future__ import annotations

import asyncio
from typing import Any

from durable_agents import Agent, RunContext, spawn_run, tool

# What the tools saw, in this process (the tests run the worker in process).
SEEN: list[dict[str, Any]] = []
CONTEXTS: list[RunContext] = []


def _seen(run: RunContext, note: str) -> dict[str, Any]:
    run.logger.info("looked at the run: %s", note)
    CONTEXTS.append(run)
    seen = {
        "id": str(run.id),
        "agent": run.agent,
        "version": run.version,
        "metadata": dict(run.metadata),
        "key": run.key,
        "concurrency_key": run.concurrency_key,
        "attempt": run.attempt,
        "note": note,
    }
    SEEN.append(seen)
    return seen


@tool(effect="pure")
def whoami(note: str, ctx: RunContext) -> dict[str, Any]:
    """Say which run this is."""
    return _seen(ctx, note)


@tool(effect="pure")
async def awhoami(note: str, *, current: RunContext) -> dict[str, Any]:
    """Say which run this is, from async code."""
    await asyncio.sleep(0)
    return _seen(current, note)


@tool(effect="idempotent")
def delegate(task: str, own: dict[str, Any] | None = None, *, idempotency_key: str) -> str:
    """Start a child run (with its own metadata, or its parent's)."""
    child = spawn_run("contextual", task, key=idempotency_key, metadata=own)
    return str(child.id)


contextual = Agent(
    name="contextual",
    version="v1",
    model="claude-test-1",
    system="You know the run you are in.",
    tools=[whoami, awhoami, delegate],
    max_tokens=512,
    max_turns=10,
)
