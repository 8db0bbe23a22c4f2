"""What changes state: cancel and requeue runs, approve and reject intents. Each goes through
``durable_agents.api``, as the admin's buttons do; the ids were checked before (``lookup``), so
a typo changes nothing. With ``--user``, a change is audited as the admin audits it
(``durable_agents.audit``: a LogEntry naming the user); a decision of an intent always names
its user."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.core.management.base import CommandError

from durable_agents import api, audit
from durable_agents._internal import encryption
from durable_agents.cli.formatting import Output, one_line
from durable_agents.cli.listing import intent_document, intent_lines
from durable_agents.models import AgentRun, IntentStatus, ToolIntent, short_id

# Who may cancel or requeue runs: Django's change permission on runs (the admin asks the same).
OPERATE_PERMISSION = "durable_agents.change_agentrun"


def _operate(
    runs: list[AgentRun],
    operation: Callable[[Any], bool],
    *,
    done: str,
    unchanged: str,
    logged: str,
    user: Any | None,
) -> Output:
    """Apply ``operation`` to each run and say what happened to it: ``done``, or that nothing
    changed (its status now), or that it is gone (deleted meanwhile)."""
    outcomes = []
    lines = []
    for run in runs:
        before = run.status
        changed = operation(run.pk)
        after = AgentRun.objects.filter(pk=run.pk).values_list("status", flat=True).first()
        if changed:
            outcome = done
            if user is not None:
                audit.log_change(user, run, f"{logged} from the command line (was {before}).")
        elif after is None:
            outcome = "not found"
        else:
            outcome = "unchanged"
        outcomes.append(
            {
                "id": str(run.pk),
                "short_id": short_id(run.pk),
                "outcome": outcome,
                "status_before": before,
                "status": after,
            }
        )
        if outcome == done:
            lines.append(f"{short_id(run.pk)}  {run.pk}  {done} (was {before})")
        elif outcome == "not found":
            lines.append(f"{short_id(run.pk)}  {run.pk}  not found (deleted meanwhile)")
        else:
            lines.append(f"{short_id(run.pk)}  {run.pk}  {unchanged}: it is {after}")
    failed = sum(1 for outcome in outcomes if outcome["outcome"] != done)
    document = {"runs": outcomes, "changed": len(outcomes) - failed, "failed": failed}
    failure = None
    if failed:
        failure = f"{failed} of {len(outcomes)} run(s) not {done}"
    return Output(document, lines, failure)


def cancel(runs: list[AgentRun], *, user: Any | None = None) -> Output:
    """Cancel each run (pending, running, waiting or dead) with its unfinished descendants."""
    return _operate(
        runs,
        api.cancel_run,
        done="cancelled",
        unchanged="already finished",
        logged="Cancelled",
        user=user,
    )


def requeue(runs: list[AgentRun], *, user: Any | None = None) -> Output:
    """Send each dead run back to pending."""
    return _operate(
        runs,
        api.requeue_run,
        done="requeued",
        unchanged="not dead, nothing changed",
        logged="Requeued",
        user=user,
    )


def decide(intent_id: int, user: Any, *, approve: bool, reason: str = "") -> Output:
    """Show the intent (what runs if it is approved), decide it as ``user``, audited, and show
    it again. An intent that is not pending is shown and left as it is (exit status 1)."""
    try:
        intent = ToolIntent.objects.select_related("decided_by").get(pk=intent_id)
    except ToolIntent.DoesNotExist:
        raise CommandError(f"there is no intent {intent_id}") from None
    except encryption.UndecryptableValue as exc:
        raise CommandError(
            f"nothing was decided: intent {intent_id}'s input cannot be read ({exc}); put the "
            "key that encrypted it back in ENCRYPTION_KEYS, then decide"
        ) from None
    verb = "approved" if approve else "rejected"
    lines = ["Before:", *intent_lines(intent)]
    if intent.status != IntentStatus.PENDING:
        refusal = (
            f"intent {intent.pk} is {intent.status}, not pending: nothing was {verb}"
            if intent.status != IntentStatus.UNKNOWN
            else f"intent {intent.pk}'s outcome is unknown: resolve it in the admin; nothing "
            f"was {verb}"
        )
        return Output({"intent": intent_document(intent), "decided": False}, lines, failure=refusal)
    after, decided = audit.decide_intent(intent.pk, user, approve=approve, reason=reason)
    after = ToolIntent.objects.select_related("decided_by").get(pk=after.pk)
    lines += ["", "After:", *intent_lines(after)]
    failure: str | None = None
    if decided:
        lines.append(f"Intent {after.pk} {verb} by {one_line(user.get_username())}.")
    else:
        failure = f"intent {after.pk} was decided meanwhile by someone else: nothing was {verb}"
    return Output({"intent": intent_document(after), "decided": decided}, lines, failure)
