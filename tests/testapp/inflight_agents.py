"""Agents for the in-flight tests: a tool that holds its callers at a gate, and
``async def`` tools."""

from __future__ import annotations

import asyncio
import threading

from durable_agents import Agent, tool


class Gate:
    """Counts the calls inside the tool at once; they wait until the test opens it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.open = threading.Event()
        self.inside = 0
        self.most_inside = 0
        self.calls = 0

    def reset(self) -> None:
        self.__init__()  # type: ignore[misc]


GATE = Gate()
# Names of the threads the async tools ran on, and whether a hung one was cancelled.
ASYNC_THREADS: list[str] = []
CANCELLED = threading.Event()


@tool(effect="pure")
def gate(n: int) -> str:
    """Wait at the gate."""
    with GATE.lock:
        GATE.inside += 1
        GATE.calls += 1
        GATE.most_inside = max(GATE.most_inside, GATE.inside)
    try:
        GATE.open.wait(60)
        return f"passed {n}"
    finally:
        with GATE.lock:
            GATE.inside -= 1


@tool(effect="non_idempotent")
def gated_charge(cents: int, *, idempotency_key: str) -> str:
    """Charge, once past the gate."""
    gate(cents)  # the Tool is callable with the plain function's arguments
    return f"charged {cents} with {idempotency_key[:8]}"


@tool(effect="pure")
async def async_lookup(key: str) -> str:
    """Read a value by key, asynchronously."""
    await asyncio.sleep(0)
    ASYNC_THREADS.append(threading.current_thread().name)
    return f"async-value-of-{key}"


@tool(effect="pure", timeout=0.5)
async def async_hang() -> str:
    """Never answer."""
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        CANCELLED.set()
        raise
    return "unreachable"


inflight = Agent(
    name="inflight",
    version="v1",
    model="claude-test-1",
    system="You wait a lot.",
    tools=[gate, gated_charge, async_lookup, async_hang],
    max_tokens=256,
)
