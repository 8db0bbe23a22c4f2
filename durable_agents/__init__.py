"""durable_agents: LLM agent runs that live in the database and survive any worker's death.

The public surface (see README): ``Agent``, ``tool`` (and its ``Retry`` policies), ``Wait``,
``ask_person``, the run operations of ``durable_agents.api`` and ``schedule`` (agents on a
clock). The operations are imported lazily so that importing ``durable_agents`` in a settings
module or an ``agents.py`` never touches the app registry; a type checker sees them imported
here, with their real signatures.

The operations that a view or other async code calls have async twins (``astart_run``,
``afork_run``, ...: ``durable_agents.api`` lists them, and those without one). Of the others:
``schedule`` is declared from a data migration or ``AppConfig.ready`` (sync code); ``progress``
is called from tool code, which runs in a worker's thread; ``stream`` is async already (and
``stream_sync`` its sync twin); ``stream_token`` signs a string, with no database, and so does
``callback_url`` (called from tool code: the running call's signed URL).

The errors are in ``durable_agents.exceptions``, under ``DurableAgentsError``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from durable_agents.declare.agents import Agent
from durable_agents.declare.context import RunContext
from durable_agents.declare.retries import Retry
from durable_agents.declare.tools import tool
from durable_agents.declare.waits import Wait, ask_person

if TYPE_CHECKING:
    from durable_agents.api import (
        aanswer_question,
        aapprove_intent,
        acancel_run,
        acarry_over_runs,
        afork_run,
        aget_result,
        amessages_for,
        answer_question,
        approve_intent,
        areject_intent,
        arequeue_run,
        aresolve_intent,
        asend_event,
        asend_message,
        aset_key_budget,
        aset_key_limit,
        astart_run,
        atree_cost,
        aupgrade_runs,
        cancel_run,
        carry_over_runs,
        fork_run,
        get_result,
        made_transition,
        messages_for,
        reject_intent,
        requeue_run,
        resolve_intent,
        send_event,
        send_message,
        set_key_budget,
        set_key_limit,
        spawn_run,
        start_run,
        tree_cost,
        upgrade_runs,
    )
    from durable_agents.callbacks import callback_url
    from durable_agents.live import progress, set_stream_cookie, stream, stream_token
    from durable_agents.schedules.defining import schedule

__all__ = [
    "Agent",
    "Retry",
    "RunContext",
    "Wait",
    "aanswer_question",
    "aapprove_intent",
    "acancel_run",
    "acarry_over_runs",
    "afork_run",
    "aget_result",
    "amessages_for",
    "answer_question",
    "approve_intent",
    "areject_intent",
    "arequeue_run",
    "aresolve_intent",
    "asend_event",
    "asend_message",
    "aset_key_budget",
    "aset_key_limit",
    "ask_person",
    "astart_run",
    "atree_cost",
    "aupgrade_runs",
    "callback_url",
    "cancel_run",
    "carry_over_runs",
    "fork_run",
    "get_result",
    "made_transition",
    "messages_for",
    "progress",
    "reject_intent",
    "requeue_run",
    "resolve_intent",
    "schedule",
    "send_event",
    "send_message",
    "set_key_budget",
    "set_key_limit",
    "set_stream_cookie",
    "spawn_run",
    "start_run",
    "stream",
    "stream_token",
    "tool",
    "tree_cost",
    "upgrade_runs",
]

# The names above that live in ``durable_agents.live`` and in ``durable_agents.api`` (both
# import the models).
_LIVE_NAMES = frozenset({"progress", "set_stream_cookie", "stream", "stream_token"})
_API_NAMES = (
    frozenset(__all__)
    - {"Agent", "Retry", "RunContext", "tool", "Wait", "ask_person", "schedule", "callback_url"}
    - _LIVE_NAMES
)

if not TYPE_CHECKING:
    # Hidden from the type checker, which would otherwise take any misspelt name for ``Any``.
    def __getattr__(name: str) -> object:
        if name in _API_NAMES:
            from durable_agents import api

            return getattr(api, name)
        if name in _LIVE_NAMES:
            from durable_agents import live

            return getattr(live, name)
        if name == "callback_url":
            from durable_agents.callbacks import callback_url

            return callback_url
        if name == "schedule":
            from durable_agents.schedules.defining import schedule

            return schedule
        raise AttributeError(f"module 'durable_agents' has no attribute {name!r}")
