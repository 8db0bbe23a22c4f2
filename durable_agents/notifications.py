"""Tell staff when a person is needed: an intent waits, a run asks a question, or a run went
to the dead letter.

Connected to the signals in ``signals.py`` by ``AppConfig.ready``. Each mail goes to the
active staff who may act on it: those with ``approve_toolintent`` for intents and dead runs,
with ``answer_question`` for questions; it names the run and links its admin page (and the
intent's page): ``SITE_URL`` followed by the page's path, or the path alone without it. The
e-mail is handed to a django-q2 ``async_task`` when django-q2 is installed, so a worker never
waits on SMTP; without it the mail is sent in the calling thread. Turn it off with
``DURABLE_AGENTS["NOTIFY"] = False`` and connect your own receivers to the signals instead.

A mail goes to several people at once, from a worker that serves no request: it is written in
the project's ``LANGUAGE_CODE`` (the catalogue in ``durable_agents/locale``), whatever language
is active. The model's text that it quotes is never translated; log lines stay in English.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from django.apps import apps
from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.core.mail import send_mail
from django.db.models import Q
from django.urls import NoReverseMatch, reverse
from django.utils import translation
from django.utils.http import urlencode
from django.utils.translation import gettext

from durable_agents._internal import intent_links
from durable_agents._internal.text import storable_text
from durable_agents.conf import app_settings

logger = logging.getLogger("durable_agents.notifications")

# A project without a mail server fails every notification the same way. The first failure of
# a kind is a warning; identical ones (same exception type and message) are logged at DEBUG for
# this long, then warned about again with how many there were in between, so that an outage
# stays visible in a long-lived worker without a line per event.
REPEAT_WARNING_SECONDS = 3600.0
# Kinds remembered at most (exception messages may vary, e.g. with a recipient in them).
_MAX_KINDS = 256
_failures: dict[tuple[str, str], tuple[float, int]] = {}  # kind -> (last warned, quiet since)
_failures_lock = threading.Lock()
_clock = time.monotonic  # replaced by tests


# Who is told: holders of one of durable_agents' permissions.
APPROVERS = "approve_toolintent"
ANSWERERS = "answer_question"
# Characters of a question quoted in its mail (it is model output: the page has the whole).
QUESTION_MAIL_CHARS = 2_000


def recipients(codename: str = APPROVERS) -> list[str]:
    """Active staff who hold the permission ``durable_agents.<codename>`` (directly, through a
    group, or as superusers): by default those who may decide intents."""
    try:
        permission = Permission.objects.get(
            content_type__app_label="durable_agents", codename=codename
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


def send_notification(subject: str, body: str, codename: str = APPROVERS) -> int:
    """Send one mail to every recipient; the task django-q2 runs."""
    to = recipients(codename)
    if not to:
        return 0
    return send_mail(subject, body, None, to, fail_silently=False)


def notify(subject: str, body: str, codename: str = APPROVERS) -> None:
    if not app_settings.NOTIFY:
        return
    # The approvers' mails keep the two-argument task of earlier releases (tasks queued by
    # an older worker, receivers that replaced send_notification).
    args = (subject, body) if codename == APPROVERS else (subject, body, codename)
    try:
        if apps.is_installed("django_q"):
            from django_q.tasks import async_task

            async_task("durable_agents.notifications.send_notification", *args)
        else:
            send_notification(*args)
    except Exception as exc:  # noqa: BLE001 - a notification must never take a worker down
        _log_failure(subject, exc)


def absolute_url(path: str) -> str:
    """``path`` as a link a mail reader can follow: ``SITE_URL`` followed by the path, or the
    path alone when no base URL is set (system check W007 says so at start-up). No request is
    at hand in a worker, so the base cannot be guessed from one."""
    base = app_settings.SITE_URL
    if not isinstance(base, str) or not base.strip():
        return path
    return base.strip().rstrip("/") + path


def admin_url(name: str, object_id: Any) -> str | None:
    """The link of an admin page of durable_agents (the admin may be mounted anywhere, or not
    at all: None when its URLs are not installed)."""
    try:
        return absolute_url(reverse(f"admin:durable_agents_{name}", args=[object_id]))
    except NoReverseMatch:
        return None


def decision_links(intent: Any) -> dict[str, str]:
    """Signed links to the approve and reject confirmation pages of a pending intent, by
    action ("approve", "reject"); empty when the admin's URLs are not installed. A link only
    leads to the page: login, the permission and a confirming POST are still required, and the
    page refuses a link made for another intent, an altered or expired one, or one made before
    the call changed (``durable_agents._internal.intent_links``)."""
    links = {}
    for action in intent_links.ACTIONS:
        url = admin_url(f"toolintent_{action}", intent.pk)
        if url is None:
            return {}
        token = intent_links.sign(intent, action)
        links[action] = f"{url}?{urlencode({intent_links.LINK_PARAMETER: token})}"
    return links


def decision_lines(intent: Any) -> str:
    """The signed approve and reject links, as lines for a mail body."""
    links = decision_links(intent)
    if not links:
        return ""
    return (
        "\n\n"
        + gettext("Approve (you confirm on the page): %(url)s") % {"url": links["approve"]}
        + "\n"
        + gettext("Reject (you confirm on the page): %(url)s") % {"url": links["reject"]}
    )


def run_page(run_id: Any) -> str:
    """The link of the run's admin page, as a line for a mail body; empty when the admin's
    URLs are not installed."""
    url = admin_url("agentrun_change", run_id)
    if url is None:
        return ""
    return "\n\n" + gettext("The run's admin page: %(path)s") % {"path": url}


def intent_page(intent_id: Any) -> str:
    """The link of the intent's admin page (where it is approved, rejected or resolved), as
    a line for a mail body; empty when the admin's URLs are not installed."""
    url = admin_url("toolintent_change", intent_id)
    if url is None:
        return ""
    return "\n\n" + gettext("The intent's admin page: %(path)s") % {"path": url}


def _log_failure(subject: str, exc: Exception) -> None:
    """One line per failure, with the exception; the traceback only at DEBUG level."""
    kind = (f"{type(exc).__module__}.{type(exc).__qualname__}", str(exc))
    now = _clock()
    with _failures_lock:
        last = _failures.get(kind)
        warn = last is None or now - last[0] >= REPEAT_WARNING_SECONDS
        quiet = 0
        if last is not None and not warn:
            _failures[kind] = (last[0], last[1] + 1)
        else:
            if last is None and len(_failures) >= _MAX_KINDS:
                _failures.clear()
            quiet = last[1] if last is not None else 0
            _failures[kind] = (now, 0)
    suffix = ""
    if warn:
        suffix = _mail_setup_hint(exc)
        if quiet:
            suffix += f" ({quiet} identical failures since the last warning)"
        suffix += (
            f"; identical failures in the next {REPEAT_WARNING_SECONDS / 60:.0f} minutes are "
            "logged at DEBUG level"
        )
    logger.log(
        logging.WARNING if warn else logging.DEBUG,
        "could not send the notification %r: %s: %s%s",
        subject,
        type(exc).__name__,
        exc,
        suffix,
        exc_info=exc if logger.isEnabledFor(logging.DEBUG) else None,
    )


def _mail_setup_hint(exc: Exception) -> str:
    """For an SMTP server that cannot be reached (a new project sends with SMTP to
    localhost:25, where nothing listens): which setting to change."""
    backend = settings.EMAIL_BACKEND
    # smtplib's errors and refused connections are OSErrors.
    if backend != SMTP_BACKEND or not isinstance(exc, OSError):
        return ""
    return (
        f". Mail goes by SMTP to {settings.EMAIL_HOST}:{settings.EMAIL_PORT}: set EMAIL_HOST "
        "and EMAIL_PORT to a mail server, or EMAIL_BACKEND = "
        "'django.core.mail.backends.console.EmailBackend' to print mails instead "
        '(development), or turn these mails off with DURABLE_AGENTS = {"NOTIFY": False}'
    )


SMTP_BACKEND = "django.core.mail.backends.smtp.EmailBackend"


def reset_failures() -> None:
    """Forget the failures already reported (tests; a process that fixed its mail setup)."""
    with _failures_lock:
        _failures.clear()


# Every subject starts so (mail filters match it): not translated.
SUBJECT_PREFIX = "[durable_agents] "


def _mail_language() -> translation.override:
    """The language of the mails: the project's, not that of a request being served."""
    return translation.override(settings.LANGUAGE_CODE)


def on_intent_waiting(sender: Any, intent: Any, **kwargs: Any) -> None:
    """An irreversible call waits for a person: for an approval (``pending``), or, when its
    outcome was never recorded (``unknown``: a crash, a shutdown whose grace ran out, a
    timeout), for someone to find out whether it took effect and resolve it."""
    names = {"tool": intent.tool, "run": intent.run_id, "intent": intent.pk}
    with _mail_language():
        if intent.status == "unknown":
            subject = gettext("outcome unknown: %(tool)s (run %(run)s)") % names
            body = (
                gettext(
                    "The irreversible tool %(tool)s was called for run %(run)s, but the call's "
                    "outcome was never recorded: nobody knows whether it took effect."
                )
                % names
            )
            # What the worker recorded (a crash, a shutdown, a timeout), in its own words.
            cause = storable_text(intent.reason or "")
            if cause:
                body += "\n\n" + gettext("What happened: %(cause)s") % {"cause": cause}
            body += "\n\n" + (
                gettext(
                    "Find out in the target system whether the call took effect, then resolve "
                    "intent %(intent)s in the admin: either it happened (give its result, which "
                    "the model reads) or it did not (the call runs again). The run waits until "
                    "then."
                )
                % names
            )
        else:
            subject = gettext("approval needed: %(tool)s (run %(run)s)") % names
            body = (
                gettext(
                    "Run %(run)s wants to call the irreversible tool %(tool)s. Approve or reject "
                    "intent %(intent)s in the admin. The run waits until then."
                )
                % names
            )
            body += decision_lines(intent)
        body += intent_page(intent.pk) + run_page(intent.run_id)
    notify(SUBJECT_PREFIX + subject, body)


def on_question_asked(sender: Any, question: Any, **kwargs: Any) -> None:
    """A run asked a person (``ask_person``): mail those who may answer."""
    text = storable_text(question.question)
    with _mail_language():
        if len(text) > QUESTION_MAIL_CHARS:
            text = (
                text[:QUESTION_MAIL_CHARS]
                + "\n"
                + gettext("[cut: %(count)s characters in all; the admin shows the whole question]")
                % {"count": len(text)}
            )
        names = {"run": question.run_id, "question": question.pk}
        subject = gettext("question from run %(run)s") % names
        body = (
            gettext("Run %(run)s asks a person (question %(question)s):") % names
            + f"\n\n{text}\n\n"
            + gettext("Answer it on the run's admin page; the run waits until then.")
            + run_page(question.run_id)
        )
    notify(SUBJECT_PREFIX + subject, body, ANSWERERS)


def on_run_dead_lettered(sender: Any, run_id: Any, reason: str, **kwargs: Any) -> None:
    with _mail_language():
        subject = gettext("run %(run)s is in the dead letter") % {"run": run_id}
        body = (
            gettext("Run %(run)s stopped and needs a person.") % {"run": run_id}
            + "\n\n"
            + gettext("Reason: %(reason)s") % {"reason": reason}
            + "\n\n"
            + gettext("Requeue it or cancel it from the admin.")
            + run_page(run_id)
        )
    notify(SUBJECT_PREFIX + subject, body)
