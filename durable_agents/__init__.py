"""durable_agents: LLM agent runs that live in the database and survive any worker's death.

The public surface (see README): ``Agent``, ``tool``, and the run operations re-exported from
``durable_agents.api``. The operations are imported lazily so that importing ``durable_agents``
in a settings module or an ``agents.py`` never touches the app registry.
"""

from __future__ import annotations

from typing import Any

from durable_agents.agents import Agent
from durable_agents.tools import tool
from durable_agents.waits import Wait, ask_person

__all__ = [
    "Agent",
    "tool",
    "Wait",
    "ask_person",
    "send_event",
    "spawn_run",
    "answer_question",
    "start_run",
    "cancel_run",
    "requeue_run",
    "messages_for",
    "approve_intent",
    "reject_intent",
    "resolve_intent",
]

_API_NAMES = {
    "send_event",
    "spawn_run",
    "answer_question",
    "start_run",
    "cancel_run",
    "requeue_run",
    "messages_for",
    "approve_intent",
    "reject_intent",
    "resolve_intent",
}


def __getattr__(name: str) -> Any:
    if name in _API_NAMES:
        from durable_agents import api

        return getattr(api, name)
    raise AttributeError(f"module 'durable_agents' has no attribute {name!r}")
