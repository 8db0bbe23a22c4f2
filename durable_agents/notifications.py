"""Tell staff when a person is needed: an intent waits, or a run went to the dead letter.

Connected to the signals in ``signals.py`` by ``AppConfig.ready``. The e-mail is handed to a
django-q2 ``async_task`` when django-q2 is installed, so a worker never waits on SMTP; without
it the mail is sent in the calling thread. Turn it off with ``DURABLE_AGENTS["NOTIFY"] = False``
and connect your own receivers to the signals instead.
"""

from __future__ import annotations

import logging
from typing import Any

from django.apps import apps
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.core.mail import send_mail
from django.db.models import Q

from durable_agents.conf import app_settings

logger = logging.getLogger("durable_agents.notifications")


def recipients() -> list[str]:
    """Active staff who may decide intents (directly, through a group, or as superusers)."""
    try:
        permission = Permission.objects.get(
            content_type__app_label="durable_agents", codename="approve_toolintent"
        )
    except Permission.DoesNotExist:
        return []
    users = (
        get_user_model()
        .objects.filter(is_active=True, is_staff=True)
        .filter(
            Q(is_superuser=True)
            | Q(user_permissions=permission)
            | Q(groups__permissions=permission)
        )
        .exclude(email="")
        .distinct()
    )
    return sorted(users.values_list("email", flat=True))


def send_notification(subject: str, body: str) -> int:
    """Send one mail to every recipient; the task django-q2 runs."""
    to = recipients()
    if not to:
        return 0
    return send_mail(subject, body, None, to, fail_silently=False)


def notify(subject: str, body: str) -> None:
    if not app_settings.NOTIFY:
        return
    try:
        if apps.is_installed("django_q"):
            from django_q.tasks import async_task

            async_task("durable_agents.notifications.send_notification", subject, body)
        else:
            send_notification(subject, body)
    except Exception:  # a notification must never take a worker down
        logger.exception("could not send the notification %r", subject)


def on_intent_waiting(sender: Any, intent: Any, **kwargs: Any) -> None:
    if intent.status == "unknown":
        subject = f"[durable_agents] outcome unknown: {intent.tool} (run {intent.run_id})"
        body = (
            f"A worker stopped while the irreversible tool {intent.tool} was running for run "
            f"{intent.run_id}. Nobody knows whether it took effect. Check the target system, "
            f"then resolve intent {intent.pk} in the admin: it happened (with its result) or "
            "it did not (it will run again)."
        )
    else:
        subject = f"[durable_agents] approval needed: {intent.tool} (run {intent.run_id})"
        body = (
            f"Run {intent.run_id} wants to call the irreversible tool {intent.tool}. "
            f"Approve or reject intent {intent.pk} in the admin. The run waits until then."
        )
    notify(subject, body)


def on_run_dead_lettered(sender: Any, run_id: Any, reason: str, **kwargs: Any) -> None:
    notify(
        f"[durable_agents] run {run_id} is in the dead letter",
        f"Run {run_id} stopped and needs a person.\n\nReason: {reason}\n\n"
        "Requeue it or cancel it from the admin.",
    )
