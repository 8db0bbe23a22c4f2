"""The agents the benchmarks drive: one trivial pure tool, a short prompt, no thinking."""

from __future__ import annotations

from durable_agents import Agent, tool

MODEL = "claude-bench-1"


@tool(effect="pure")
def noop(key: str) -> str:
    """Return the key (a trivial pure tool)."""
    return f"ok-{key}"


bench = Agent(
    name="bench",
    version="1",
    model=MODEL,
    system="You are a benchmark agent.",
    tools=[noop],
    max_tokens=256,
)

# Long runs (bench/longrun.py): thousands of turns.
bench_long = Agent(
    name="bench_long",
    version="1",
    model=MODEL,
    system="You are a benchmark agent.",
    tools=[noop],
    max_tokens=256,
    max_turns=100_000,
)
