"""durable_agents: LLM agent runs that live in the database and survive any worker's death.

The public surface (see README): ``Agent``, ``tool``, ``Wait``, ``ask_person``, the run
operations of ``durable_agents.api`` and ``schedule`` (agents on a clock). The operations are
imported lazily so that importing ``durable_agents`` in a settings module or an ``agents.py``
never touches the app registry; a type checker sees them imported here, with their real
signatures.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from durable_agents.agents import Agent
from durable_agents.tools import tool
from durable_agents.waits import Wait, ask_person

if TYPE_CHECKING:
    from durable_agents.api import (
        aanswer_question,
        acancel_run,
        amessages_for,
        answer_question,
        approve_intent,
        asend_event,
        astart_run,
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
    from durable_agents.live import progress, set_stream_cookie, stream, stream_token
    from durable_agents.schedules import schedule

__all__ = [
    "Agent",
    "Wait",
    "aanswer_question",
    "acancel_run",
    "amessages_for",
    "answer_question",
    "approve_intent",
    "asend_event",
    "ask_person",
    "astart_run",
    "cancel_run",
    "fork_run",
    "messages_for",
    "progress",
    "reject_intent",
    "requeue_run",
    "resolve_intent",
    "schedule",
    "send_event",
    "set_key_budget",
    "set_key_limit",
    "set_stream_cookie",
    "spawn_run",
    "start_run",
    "stream",
    "stream_token",
    "tool",
]

# The names above that live in ``durable_agents.live`` and in ``durable_agents.api`` (both
# import the models).
_LIVE_NAMES = frozenset({"progress", "set_stream_cookie", "stream", "stream_token"})
_API_NAMES = frozenset(__all__) - {"Agent", "tool", "Wait", "ask_person", "schedule"} - _LIVE_NAMES

if not TYPE_CHECKING:
    # Hidden from the type checker, which would otherwise take any misspelt name for ``Any``.
    def __getattr__(name: str) -> object:
        if name in _API_NAMES:
            from durable_agents import api

            return getattr(api, name)
        if name in _LIVE_NAMES:
            from durable_agents import live

            return getattr(live, name)
        if name == "schedule":
            from durable_agents.schedules import schedule

            return schedule
        raise AttributeError(f"module 'durable_agents' has no attribute {name!r}")
