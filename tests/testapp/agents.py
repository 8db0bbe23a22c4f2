"""Agents and tools that the test suite drives, one tool per situation a run must survive."""

from __future__ import annotations

import os
import signal
import time

from durable_agents import Agent, tool
from tests.testapp import receiver


@tool(effect="pure")
def lookup(key: str) -> str:
    """Read a value by key."""
    return f"value-of-{key}"


@tool(effect="idempotent")
def set_flag(name: str, value: bool) -> str:
    """Set a flag to a value."""
    return f"{name}={value}"


@tool(effect="non_idempotent")
def charge(customer: str, cents: int, *, idempotency_key: str) -> dict:
    """Charge a customer's card."""
    receiver.touch("charge-started")
    delay = float(os.environ.get("DA_CHARGE_DELAY", "0"))
    result = receiver.deliver("charge", idempotency_key, {"customer": customer, "cents": cents})
    if delay:
        time.sleep(delay)  # the effect happened; the worker may die before it is recorded
    return result


@tool(effect="irreversible")
def drop_table(table: str, *, idempotency_key: str) -> str:
    """Drop a table. Needs a person's approval."""
    receiver.touch("drop-started")
    delay = float(os.environ.get("DA_DROP_DELAY", "0"))
    receiver.deliver("drop", idempotency_key, {"table": table})
    if delay:
        time.sleep(delay)
    return f"dropped {table}"


@tool(effect="pure")
def slow(seconds: float) -> str:
    """Take a while."""
    receiver.touch("slow-started")
    receiver.pause(seconds, until="slow-release")  # a test may end it early
    return f"slept {seconds}"


@tool(effect="pure")
def explode(message: str) -> str:
    """Always fails."""
    raise RuntimeError(message)


@tool(effect="pure")
def big(chars: int) -> str:
    """Return a large result."""
    return "x" * chars


@tool(effect="pure")
def weird(kind: str) -> str:
    """Return awkward text."""
    if kind == "nul":
        return "before\x00after"
    if kind == "surrogate":
        return "lone \ud800 surrogate"
    return "emoji \U0001f600, rtl \u202eabc, combining e\u0301, zero-width \u200b."


@tool(effect="pure")
def not_json() -> object:
    """Return something that is not JSON."""
    return object()


@tool(effect="pure")
def poison() -> str:
    """Kill the worker that runs it, like a segfault in native tool code."""
    os.kill(os.getpid(), signal.SIGKILL)
    return "unreachable"


TOOLS = [lookup, set_flag, charge, drop_table, slow, explode, big, weird, not_json, poison]

tester = Agent(
    name="tester",
    version="v1",
    model="claude-test-1",
    system="You are the test agent.",
    tools=TOOLS,
    max_tokens=1024,
    max_turns=40,
)

thinker = Agent(
    name="thinker",
    version="v1",
    model="claude-test-1",
    system="You are the test agent that thinks first.",
    tools=TOOLS,
    max_tokens=2048,
    thinking={"type": "enabled", "budget_tokens": 1024},
    max_turns=40,
)

short = Agent(
    name="short",
    version="v1",
    model="claude-test-1",
    system="You have few turns.",
    tools=[lookup],
    max_tokens=256,
    max_turns=2,
)


@tool(effect="pure")
def busy(key: str, seconds: float) -> str:
    """Work a while for a concurrency key (the receiver logs when the work started and ended)."""
    receiver.interval(key, seconds)
    return f"worked {seconds}s for {key}"


# At most 2 of its runs per concurrency key run at once (tests/acceptance/test_crash_keys.py).
keyed = Agent(
    name="keyed",
    version="v1",
    model="claude-test-1",
    system="You share your tenant's slots.",
    tools=[busy],
    max_tokens=256,
    max_turns=10,
    concurrency_limit=2,
)


# Text deltas seen by the streaming agent's callback: (run id, text).
STREAMED_TEXT: list[tuple[str, str]] = []


def collect_text(run_id: object, text: str) -> None:
    STREAMED_TEXT.append((str(run_id), text))


streamer = Agent(
    name="streamer",
    version="v1",
    model="claude-test-1",
    system="You stream your answers.",
    tools=TOOLS,
    max_tokens=2048,
    thinking={"type": "enabled", "budget_tokens": 1024},
    stream=True,
    on_text=collect_text,
)

token_capped = Agent(
    name="token_capped",
    version="v1",
    model="claude-test-1",
    system="You have a token budget.",
    tools=[lookup],
    max_tokens=256,
    max_total_tokens=400,
)

time_capped = Agent(
    name="time_capped",
    version="v1",
    model="claude-test-1",
    system="You have a time budget.",
    tools=[slow],
    max_tokens=256,
    max_wall_seconds=1.0,
)

# The fuzz suite's agents, the in-flight tests' agents, the agent whose tool reads its run,
# and the rolling deploy's two codes.
from tests.testapp import (  # noqa: E402, F401
    compaction_agents,
    context_agents,
    fuzz_agents,
    inflight_agents,
    message_agents,
    rollout_agents,
    wait_agents,
)
