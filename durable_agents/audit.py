"""What people decide, in Django's admin log (``django_admin_log``), wherever they decided it:
on an admin page or from the command line (``manage.py durable_agents approve``). One entry per
change made, written by the call that made it (``api.made_transition``): a second decision of
the same intent finds it made and writes nothing.

The entries are an audit record: English, plain text in every dump and backup. They say what
was done and by whom; never a value encrypted at rest (``ENCRYPTION_KEYS``): an intent's
decision names its outcome and the reason the person typed (a plain column), not the input.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.db.models import Model

from durable_agents import api
from durable_agents._internal.text import storable_text
from durable_agents.models import ToolIntent

if TYPE_CHECKING:
    from django.contrib.admin.models import LogEntry


def log_change(user: Any, obj: Model, message: str) -> LogEntry:
    """The LogEntry of a change of ``obj`` by ``user``, as ``ModelAdmin.log_change`` writes
    it (the admin's history of the object lists it)."""
    from django.contrib.admin.models import CHANGE, LogEntry

    entry: LogEntry = LogEntry.objects.log_actions(
        user_id=user.pk,
        queryset=[obj],
        action_flag=CHANGE,
        change_message=storable_text(message),
        single_object=True,
    )
    return entry


def decision_message(*, approve: bool, reason: str = "") -> str:
    """The audit text of an intent's decision."""
    return "Approved." if approve else f"Rejected: {reason or 'no reason given'}."


def decide_intent(
    intent_id: int, user: Any, *, approve: bool, reason: str = ""
) -> tuple[ToolIntent, bool]:
    """Approve or reject the intent through the api (which checks ``user``'s permission), and
    audit the decision when this call made it. Returns the intent as it is now, and whether
    this call decided it (False: it was decided already, by anyone)."""
    if approve:
        after = api.approve_intent(intent_id, user=user)
    else:
        after = api.reject_intent(intent_id, user=user, reason=reason)
    decided = api.made_transition(after)
    if decided:
        log_change(user, after, decision_message(approve=approve, reason=reason))
    return after, decided
