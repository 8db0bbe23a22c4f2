"""Agents for the long-transcript tests: server-side compaction through
``params={"context_management": ...}`` and ``betas``, automatic caching, thinking on so that the
offline model checks every signature it reads."""

from __future__ import annotations

from typing import Any

from durable_agents import Agent, tool

COMPACT_BETA = "compact-2026-01-12"
# Small enough that the offline model compacts every few turns of the tests' scripts (the real
# API wants at least 50,000; the offline model takes 100 and up).
TRIGGER = 800


@tool(effect="pure")
def note(key: str) -> str:
    """Read a note by key (a few hundred characters, so that the context grows quickly)."""
    return f"note {key}: " + "lorem ipsum dolor sit amet " * 8


def compaction_params(pause: bool, trigger: int = TRIGGER) -> dict[str, Any]:
    return {
        "context_management": {
            "edits": [
                {
                    "type": "compact_20260112",
                    "trigger": {"type": "input_tokens", "value": trigger},
                    "pause_after_compaction": pause,
                }
            ]
        }
    }


def compactor(
    name: str, *, pause: bool, stream: bool, register: bool = True, **extra: Any
) -> Agent:
    options: dict[str, Any] = {
        "version": "v1",
        "model": "claude-test-1",
        "system": "You compact your context.",
        "tools": [note],
        "max_tokens": 2048,
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "params": compaction_params(pause),
        "betas": [COMPACT_BETA],
        "cache": True,
        "stream": stream,
        "max_turns": 200,
    }
    options.update(extra)
    return Agent(name=name, register=register, **options)


# One agent per way a compaction turn arrives: whole or paused, as JSON or streamed.
COMPACTORS = {
    (pause, stream): compactor(
        f"compactor{'-paused' if pause else ''}{'-streamed' if stream else ''}",
        pause=pause,
        stream=stream,
    )
    for pause in (False, True)
    for stream in (False, True)
}
