"""The operations on runs and intents. The admin, the demo and user code all go through
these functions; none of them re-implements a transition. The transitions themselves are
the store's (``durable_agents.store``); signals and permission checks are here."""

from __future__ import annotations

import json
import uuid
from typing import Any

from django.core.exceptions import PermissionDenied

from durable_agents import effects, signals
from durable_agents.agents import registry
from durable_agents.history import rebuild_messages
from durable_agents.models import AgentRun, IntentStatus, RunStatus, ToolIntent
from durable_agents.store import current
from durable_agents.text import has_unstorable

APPROVE_PERMISSION = "durable_agents.approve_toolintent"


def start_run(
    agent: str, task: str, *, version: str | None = None, model: str | None = None
) -> AgentRun:
    """Create a pending run pinned to the agent's version, model and fingerprint, with its
    task as step 0. Raises ``AgentNotFound`` for an unknown agent or version."""
    if not isinstance(task, str) or not task.strip():
        raise ValueError("a run needs a non-empty task")
    if has_unstorable(task):
        # The database cannot store NUL, nor UTF-8 encode a lone surrogate: say so now rather
        # than fail inside the INSERT.
        raise ValueError("a task cannot contain NUL characters or lone surrogates")
    definition = registry.get(agent, version)
    pinned_model = model or definition.model
    run = AgentRun(
        id=uuid.uuid4(),
        agent=definition.name,
        prompt_version=definition.version,
        model=pinned_model,
        fingerprint=definition.fingerprint(pinned_model),
        task=task,
    )
    return current().create_run(run, json.dumps(task, ensure_ascii=False))


def cancel_run(run_id: Any) -> bool:
    """Cancel a pending, running or waiting run. A worker holding it hears of it at once
    (PostgreSQL NOTIFY) or at its next heartbeat, and its fence refuses any further step.
    False if the run was already over."""
    cancelled = current().cancel_run(run_id)
    if cancelled:
        signals.run_finished.send(sender=AgentRun, run_id=run_id, status=RunStatus.CANCELLED)
    return cancelled


def requeue_run(run_id: Any) -> bool:
    """Send a dead run back to pending with a fresh no-progress count; its error stays as
    history until the run progresses."""
    return current().requeue_run(run_id)


def messages_for(run_id: Any) -> list[dict[str, Any]]:
    return rebuild_messages(run_id)


def _check_permission(user: Any) -> None:
    if user is None or not user.has_perm(APPROVE_PERMISSION):
        raise PermissionDenied(f"deciding tool intents needs the {APPROVE_PERMISSION} permission")


def _decide(intent_id: Any, user: Any, from_status: str, to_status: str, reason: str) -> ToolIntent:
    _check_permission(user)
    return current().decide_intent(intent_id, user, from_status, to_status, reason)


def approve_intent(intent_id: Any, user: Any) -> ToolIntent:
    """Allow a pending irreversible call to run; the run becomes claimable. Deciding an
    intent that was already decided changes nothing."""
    return _decide(intent_id, user, IntentStatus.PENDING, IntentStatus.APPROVED, "")


def reject_intent(intent_id: Any, user: Any, reason: str = "") -> ToolIntent:
    """Refuse a pending call; the model receives an error result naming who and why."""
    return _decide(intent_id, user, IntentStatus.PENDING, IntentStatus.REJECTED, reason)


def resolve_intent(
    intent_id: Any, user: Any, *, happened: bool, result: Any = None, reason: str = ""
) -> ToolIntent:
    """Settle an intent whose outcome is unknown (its worker died while the tool ran).

    ``happened=True``: the call took place; ``result`` becomes its recorded result and the
    run goes on with it. ``happened=False``: it did not; the call runs again.
    """
    _check_permission(user)
    outcome = effects.format_result("" if result is None else result) if happened else None
    return current().resolve_intent(intent_id, user, outcome=outcome, reason=reason)
