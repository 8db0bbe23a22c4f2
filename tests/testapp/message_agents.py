"""The agent that a user writes to while it works (``send_message``): its tool sends the run a
message, as a person would while the tool runs. A new agent, so that no existing agent's
fingerprint changes."""

from __future__ import annotations

from durable_agents import Agent, RunContext, send_message, tool
from tests.testapp import receiver


@tool(effect="idempotent")
def tell(text: str, run: RunContext, policy: str = "queue") -> str:
    """Note something (the person writes ``text`` to the run meanwhile)."""
    send_message(run.id, text, key=f"tell:{text}", policy=policy)
    return f"noted {text}"


@tool(effect="pure")
def pause(label: str) -> str:
    """Wait until told to go on (a crash test kills the worker meanwhile)."""
    receiver.touch(f"pause-{label}")
    receiver.pause(60, until=f"go-{label}")
    return f"went on after {label}"


messenger = Agent(
    name="messenger",
    version="v1",
    model="claude-test-1",
    system="You read what the user writes while you work.",
    tools=[tell, pause],
    max_tokens=256,
    max_turns=40,
)
