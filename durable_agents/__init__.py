"""durable_agents: LLM agent runs that live in the database and survive any worker's death.

The public surface (see README): ``Agent``, ``tool``, ``Wait``, ``ask_person``, and the run
operations of ``durable_agents.api``. The operations are imported lazily so that importing
``durable_agents`` in a settings module or an ``agents.py`` never touches the app registry; a
type checker sees them imported here, with their real signatures.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from durable_agents.agents import Agent
from durable_agents.tools import tool
from durable_agents.waits import Wait, ask_person

if TYPE_CHECKING:
    from durable_agents.api import (
        answer_question,
        approve_intent,
        cancel_run,
        fork_run,
        messages_for,
        reject_intent,
        requeue_run,
        resolve_intent,
        send_event,
        set_key_budget,
        set_key_limit,
        spawn_run,
        start_run,
    )

__all__ = [
    "Agent",
    "Wait",
    "answer_question",
    "approve_intent",
    "ask_person",
    "cancel_run",
    "fork_run",
    "messages_for",
    "reject_intent",
    "requeue_run",
    "resolve_intent",
    "send_event",
    "set_key_budget",
    "set_key_limit",
    "spawn_run",
    "start_run",
    "tool",
]

# The names above that live in ``durable_agents.api``, which imports the models.
_API_NAMES = frozenset(__all__) - {"Agent", "tool", "Wait", "ask_person"}

if not TYPE_CHECKING:
    # Hidden from the type checker, which would otherwise take any misspelt name for ``Any``.
    def __getattr__(name: str) -> object:
        if name in _API_NAMES:
            from durable_agents import api

            return getattr(api, name)
        raise AttributeError(f"module 'durable_agents' has no attribute {name!r}")
