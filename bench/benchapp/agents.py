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

# bench/versions.py: a fleet's 10 versions of 5 agents (fleet0@1, fleet0@2, ..., fleet4@2), of
# which this process defines those DA_BENCH_FLEET_DEFINES names by index ("0,1,2"); none
# unless it is set.
FLEET_VERSIONS = [(f"fleet{a}", str(v)) for a in range(5) for v in (1, 2)]


def _fleet() -> list[Agent]:
    import os

    wanted = os.environ.get("DA_BENCH_FLEET_DEFINES", "")
    return [
        Agent(
            name=FLEET_VERSIONS[int(i)][0],
            version=FLEET_VERSIONS[int(i)][1],
            model=MODEL,
            system=f"You are benchmark agent {FLEET_VERSIONS[int(i)][0]}.",
            tools=[noop],
            max_tokens=256 + int(FLEET_VERSIONS[int(i)][1]),
        )
        for i in wanted.split(",")
        if i.strip()
    ]


fleet = _fleet()
