"""Two deploys of the same code base for the rolling-deploy test
(tests/acceptance/test_rolling_deploy.py), chosen by the DA_ROLLOUT_CODE environment variable
of the process:

- ``A`` (the old code): version 1 of ``deploying`` and of ``deploying_thinking``;
- ``B`` (the new code): version 2 of both, with another system prompt and the same tools,
  each ``upgrades_from=["1"]``, and NOT version 1;
- unset (the test process, which starts the runs, and every other test): all four.

``deploying_thinking`` runs with extended thinking: its signed thinking blocks bind version 1's
system prompt, so its runs cannot move to version 2 and only code A can finish them.
"""

from __future__ import annotations

import os

from durable_agents import Agent
from tests.testapp.agents import charge, lookup

CODE_ENV = "DA_ROLLOUT_CODE"
CODE = os.environ.get(CODE_ENV, "")
if CODE not in ("", "A", "B"):
    raise ValueError(f"{CODE_ENV} is A, B or unset, not {CODE!r}")

SYSTEM = {
    "1": "You are the rollout agent, version 1.",
    "2": "You are the rollout agent, version 2: reworded for the new deploy.",
}
THINKING_SYSTEM = {
    "1": "You are the rollout agent that thinks first, version 1.",
    "2": "You are the rollout agent that thinks first, version 2: reworded.",
}
TOOLS = [lookup, charge]
THINKING = {"type": "enabled", "budget_tokens": 1024}

if CODE in ("", "A"):
    Agent(
        name="deploying",
        version="1",
        model="claude-test-1",
        system=SYSTEM["1"],
        tools=TOOLS,
        max_tokens=1024,
    )
    Agent(
        name="deploying_thinking",
        version="1",
        model="claude-test-1",
        system=THINKING_SYSTEM["1"],
        tools=TOOLS,
        max_tokens=2048,
        thinking=THINKING,
    )

if CODE in ("", "B"):
    Agent(
        name="deploying",
        version="2",
        model="claude-test-1",
        system=SYSTEM["2"],
        tools=TOOLS,
        max_tokens=1024,
        upgrades_from=["1"],
    )
    Agent(
        name="deploying_thinking",
        version="2",
        model="claude-test-1",
        system=THINKING_SYSTEM["2"],
        tools=TOOLS,
        max_tokens=2048,
        thinking=THINKING,
        upgrades_from=["1"],
    )
