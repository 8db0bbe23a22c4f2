"""Webhooks: events posted as signed JSON to the URLs of ``DURABLE_AGENTS["WEBHOOKS"]``.

Four events, from the signals of ``signals.py`` (connected by ``AppConfig.ready``):
``intent.waiting`` (``intent_waiting``), ``question.asked`` (``question_asked``), ``run.dead``
(``run_dead_lettered``) and ``run.finished`` (``run_finished``: succeeded, failed, cancelled).

A receiver never sends anything itself, so a worker never waits on a webhook: once the
transaction that made the event is committed it writes one ``agent_webhook_delivery`` row per
webhook that takes the event, and hands their sending to a django-q2 ``async_task`` (when
django-q2 is installed) or to a thread of its own. An attempt that fails (a connection error,
a timeout of ``TIMEOUT_SECONDS``, any answer but 2xx; redirects are not followed) is tried
again by housekeeping (``retry_due``) after ``WEBHOOK_RETRY_SECONDS``, a wait that doubles
after each failure, until ``WEBHOOK_MAX_ATTEMPTS`` attempts have failed: the delivery is then
``failed``. The admin's Webhook deliveries page shows each, and sends one again on request.

The body is JSON: ``event``, ``at``, ``run`` (id, agent, version, status, metadata), the
``intent`` or the ``question``, ``links`` (the admin pages; for a pending intent the signed
links to its approve and reject confirmation pages) and ``text``, a line that chat tools such
as Slack's incoming webhooks show (a webhook's ``template`` writes its own). It is signed with
the webhook's secret: ``X-Durable-Agents-Signature: sha256=<hex>``, the HMAC-SHA256 of
``<timestamp>.<body>``, where the timestamp (Unix seconds) is the ``X-Durable-Agents-Timestamp``
header; a receiver recomputes it and refuses an old timestamp (a replay).

With ``ENCRYPTION_KEYS`` on, the body says what happened and to what, never a value that is
encrypted at rest or text a model wrote: ids, names, statuses, metadata and links; no tool
arguments, question text or dead-letter reason (the admin's LogEntry follows the same rule).
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import http.client
import json
import logging
import string
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from django.apps import apps
from django.db import connections, transaction
from django.db.models import F
from django.utils import timezone

from durable_agents import notifications
from durable_agents._internal import encryption
from durable_agents._internal.text import storable_text
from durable_agents.conf import app_settings
from durable_agents.models import AgentRun, WebhookDelivery, WebhookStatus

logger = logging.getLogger("durable_agents.webhooks")

INTENT_WAITING = "intent.waiting"
QUESTION_ASKED = "question.asked"
RUN_DEAD = "run.dead"
RUN_FINISHED = "run.finished"
EVENTS = (INTENT_WAITING, QUESTION_ASKED, RUN_DEAD, RUN_FINISHED)

SIGNATURE_HEADER = "X-Durable-Agents-Signature"
TIMESTAMP_HEADER = "X-Durable-Agents-Timestamp"
EVENT_HEADER = "X-Durable-Agents-Event"
DELIVERY_HEADER = "X-Durable-Agents-Delivery"

# Seconds one attempt may take (connecting, sending, reading the answer).
TIMEOUT_SECONDS = 10.0
# An attempt holds its delivery this long ahead, so that housekeeping leaves it alone
# meanwhile: well over the timeout.
CLAIM_SECONDS = 60.0
# The longest wait between two attempts, however many have failed.
MAX_RETRY_SECONDS = 86_400.0
# Characters of an error (or of a refusing answer's body) kept in last_error.
ERROR_CHARS = 1000
# A secret shorter than this is refused by the checks (E074).
MIN_SECRET_CHARS = 32
# Characters of a question or a dead-letter reason in a body (the admin shows the whole).
QUOTED_CHARS = 2000
# Deliveries housekeeping sends per pass, one after the other.
RETRY_BATCH = 50

# The keys of a webhook's entry in WEBHOOKS.
HOOK_KEYS = ("url", "events", "secret", "template")

# The names a template may use, each a string (empty where the event has none): {tool}, ...
TEMPLATE_FIELDS = (
    "event",
    "at",
    "text",
    "run_id",
    "agent",
    "version",
    "status",
    "run_url",
    "intent_id",
    "tool",
    "intent_status",
    "intent_url",
    "approve_url",
    "reject_url",
    "question_id",
    "question",
    "reason",
)


# -- the configured webhooks -------------------------------------------------------------------


def hooks_for(event: str) -> list[Mapping[str, Any]]:
    """The entries of WEBHOOKS that take ``event``. Malformed entries are left out here (the
    system checks name them): an event never fails over a setting."""
    hooks = app_settings.WEBHOOKS
    if not isinstance(hooks, list | tuple):
        return []
    return [
        hook
        for hook in hooks
        if isinstance(hook, Mapping)
        and isinstance(hook.get("url"), str)
        and isinstance(hook.get("events"), list | tuple)
        and event in hook["events"]
    ]


def secret_for(url: str) -> str | None:
    """The secret of the first webhook of WEBHOOKS with this URL (a secret is never stored in
    the database: a delivery finds it again by its URL); None when no webhook has it now."""
    hooks = app_settings.WEBHOOKS
    for hook in hooks if isinstance(hooks, list | tuple) else ():
        if isinstance(hook, Mapping) and hook.get("url") == url:
            secret = hook.get("secret")
            return secret if isinstance(secret, str) and secret else None
    return None


# -- templates -----------------------------------------------------------------------------------


class TemplateProblem(ValueError):
    """A webhook's template that cannot be rendered."""


class _FlatFormatter(string.Formatter):
    """``str.format`` over a flat dict of strings: ``{name}``, with a conversion and a format
    spec, but no attribute or item access (``{run_id.__class__}``, ``{x[0]}``) and no
    positional fields, so a template reaches nothing but the strings it is given."""

    def get_field(self, field_name: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        if not field_name.isidentifier():
            raise TemplateProblem(
                f"{{{field_name}}}: a field is a plain name ({', '.join(TEMPLATE_FIELDS)})"
            )
        if field_name not in kwargs:
            raise TemplateProblem(
                f"{{{field_name}}} is not a field; the fields are {', '.join(TEMPLATE_FIELDS)}"
            )
        return kwargs[field_name], field_name


def render_template(template: str, fields: Mapping[str, str]) -> str:
    """``template`` (a ``str.format`` string) with ``fields``; TemplateProblem when it names
    an unknown field, reaches into one, or is not a format string."""
    try:
        return _FlatFormatter().vformat(template, (), fields)
    except TemplateProblem:
        raise
    except (ValueError, IndexError, KeyError, TypeError) as exc:
        raise TemplateProblem(str(exc)) from exc


def slack_escaped(text: str) -> str:
    """Text for Slack's ``text``: ``&``, ``<`` and ``>`` escaped as Slack asks, so that text a
    model wrote cannot mention ``<!channel>`` or show a link of its own."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def template_fields(payload: Mapping[str, Any]) -> dict[str, str]:
    """The flat fields of a payload (every name of TEMPLATE_FIELDS, empty where the event has
    none), escaped for Slack's text."""
    run = payload.get("run") or {}
    intent = payload.get("intent") or {}
    question = payload.get("question") or {}
    links = payload.get("links") or {}
    values = {
        "event": payload.get("event"),
        "at": payload.get("at"),
        "text": payload.get("text"),
        "run_id": run.get("id"),
        "agent": run.get("agent"),
        "version": run.get("version"),
        "status": run.get("status"),
        "run_url": links.get("run"),
        "intent_id": intent.get("id"),
        "tool": intent.get("tool"),
        "intent_status": intent.get("status"),
        "intent_url": links.get("intent"),
        "approve_url": links.get("approve"),
        "reject_url": links.get("reject"),
        "question_id": question.get("id"),
        "question": question.get("text"),
        "reason": payload.get("reason"),
    }
    return {
        name: slack_escaped("" if value is None else str(value)) for name, value in values.items()
    }


def sample_payload(event: str) -> dict[str, Any]:
    """A payload of ``event`` with every field filled: what the checks render templates with."""
    payload: dict[str, Any] = {
        "event": event,
        "at": "2026-01-01T00:00:00+00:00",
        "run": {"id": "0", "agent": "agent", "version": "1", "status": "waiting", "metadata": {}},
        "links": {"run": "/run/", "intent": "/intent/", "approve": "/a/", "reject": "/r/"},
        "intent": {"id": 1, "tool": "tool", "status": "pending"},
        "question": {"id": 1, "text": "question"},
        "reason": "reason",
    }
    payload["text"] = default_text(payload)
    return payload


# -- payloads ------------------------------------------------------------------------------------


def _now() -> datetime.datetime:
    return timezone.now()


def _quoted(text: str) -> str:
    text = storable_text(text)
    return text if len(text) <= QUOTED_CHARS else text[:QUOTED_CHARS] + "…"


def _run_part(run_id: Any, status: str | None = None) -> dict[str, Any]:
    """The run as a body names it: ids, names, status and the product's metadata (plain at
    rest, meant to be searched), never its task or transcript."""
    row = (
        AgentRun.objects.filter(pk=run_id)
        .values("agent", "prompt_version", "status", "metadata")
        .first()
    )
    part: dict[str, Any] = {"id": str(run_id)}
    if row is not None:
        part.update(
            agent=row["agent"],
            version=row["prompt_version"],
            status=row["status"],
            metadata=row["metadata"] or {},
        )
    if status is not None:
        part["status"] = str(status)
    return part


def _links(run_id: Any) -> dict[str, str]:
    url = notifications.admin_url("agentrun_change", run_id)
    return {"run": url} if url else {}


def intent_payload(intent: Any) -> dict[str, Any]:
    part: dict[str, Any] = {"id": intent.pk, "tool": storable_text(intent.tool)}
    part["status"] = str(intent.status)
    links = _links(intent.run_id)
    page = notifications.admin_url("toolintent_change", intent.pk)
    if page:
        links["intent"] = page
    if intent.status == "pending":
        links.update(notifications.decision_links(intent))
    if not encryption.enabled():
        # The exact call, as the confirmation page shows it; encrypted at rest otherwise.
        part["arguments"] = intent.input
        if intent.reason:
            part["reason"] = _quoted(intent.reason)
    return {"run": _run_part(intent.run_id), "intent": part, "links": links}


def question_payload(question: Any) -> dict[str, Any]:
    part: dict[str, Any] = {"id": question.pk}
    if not encryption.enabled():
        part["text"] = _quoted(question.question)
    return {"run": _run_part(question.run_id), "question": part, "links": _links(question.run_id)}


def dead_payload(run_id: Any, reason: str) -> dict[str, Any]:
    payload: dict[str, Any] = {"run": _run_part(run_id), "links": _links(run_id)}
    if not encryption.enabled():
        payload["reason"] = _quoted(reason)  # may quote a tool's or a model's text
    return payload


def finished_payload(run_id: Any, status: str) -> dict[str, Any]:
    return {"run": _run_part(run_id, status), "links": _links(run_id)}


def default_text(payload: Mapping[str, Any]) -> str:
    """The ``text`` of a body without a template: one line of what happened, then links."""
    f = template_fields({**payload, "text": ""})
    run = f"run {f['run_id']}" + (f" ({f['agent']})" if f["agent"] else "")
    event = payload.get("event")
    if event == INTENT_WAITING and f["intent_status"] == "unknown":
        line = f"Outcome unknown: {f['tool']} for {run}; find out and resolve it: {f['intent_url']}"
    elif event == INTENT_WAITING:
        line = f"Approval needed: {f['tool']} for {run}."
        if f["approve_url"]:
            line += f"\nApprove: {f['approve_url']}\nReject: {f['reject_url']}"
    elif event == QUESTION_ASKED:
        line = f"{run.capitalize()} asks a person" + (
            f": {f['question']}" if f["question"] else "."
        )
    elif event == RUN_DEAD:
        line = f"{run.capitalize()} is in the dead letter" + (
            f": {f['reason']}" if f["reason"] else "."
        )
    else:
        line = f"{run.capitalize()} {f['status']}."
    if f["run_url"]:
        line += f"\nRun: {f['run_url']}"
    return line


# -- recording (what the signal receivers do) -----------------------------------------------------


def record(event: str, build: Callable[[], dict[str, Any]], run_id: Any) -> None:
    """Once the current transaction commits (at once outside one): one delivery per webhook
    that takes ``event``, then their sending handed off. Never raises: an event is never
    undone, nor a worker stopped, by a webhook."""
    hooks = hooks_for(event)
    if not hooks:
        return

    def write() -> None:
        try:
            base = {"event": event, "at": _now().isoformat(), **build()}
            ids = []
            for hook in hooks:
                body = dict(base)
                template = hook.get("template")
                text = default_text(body)
                if isinstance(template, str) and template:
                    try:
                        text = render_template(template, template_fields({**body, "text": text}))
                    except TemplateProblem as exc:
                        logger.warning("webhook %s: its template fails (%s)", hook["url"], exc)
                body["text"] = text
                delivery = WebhookDelivery.objects.create(
                    url=hook["url"],
                    event=event,
                    run_id=run_id,
                    payload=body,
                    next_attempt_at=_now(),
                )
                ids.append(delivery.pk)
            send_soon(ids)
        except Exception as exc:  # noqa: BLE001 - never take a worker down
            logger.warning("could not record the webhook deliveries of %s: %s", event, exc)

    transaction.on_commit(write)


def on_intent_waiting(sender: Any, intent: Any, **kwargs: Any) -> None:
    record(INTENT_WAITING, lambda: intent_payload(intent), intent.run_id)


def on_question_asked(sender: Any, question: Any, **kwargs: Any) -> None:
    record(QUESTION_ASKED, lambda: question_payload(question), question.run_id)


def on_run_dead_lettered(sender: Any, run_id: Any, reason: str, **kwargs: Any) -> None:
    record(RUN_DEAD, lambda: dead_payload(run_id, reason), run_id)


def on_run_finished(sender: Any, run_id: Any, status: str, **kwargs: Any) -> None:
    record(RUN_FINISHED, lambda: finished_payload(run_id, status), run_id)


# -- sending -----------------------------------------------------------------------------------


def send_soon(ids: Sequence[int]) -> None:
    """Hand the sending of these deliveries off: a django-q2 task when django-q2 is installed,
    else a thread of its own. What is lost meanwhile (a process that exits) stays pending, and
    housekeeping sends it."""
    if not ids:
        return
    if apps.is_installed("django_q"):
        from django_q.tasks import async_task

        async_task("durable_agents.webhooks.deliver", list(ids))
        return
    thread = threading.Thread(
        target=_deliver_in_thread, args=(list(ids),), name="durable_agents-webhooks", daemon=True
    )
    thread.start()


def _deliver_in_thread(ids: list[int]) -> None:
    try:
        deliver(ids)
    except Exception:  # a thread's error would only reach stderr
        logger.exception("webhook deliveries %s", ids)
    finally:
        connections.close_all()  # this thread's own connections


def deliver(ids: Iterable[int]) -> None:
    """Attempt each delivery that is due (the task django-q2 runs)."""
    for delivery_id in ids:
        attempt(delivery_id)


def signature(secret: str, timestamp: str, body: bytes) -> str:
    """``sha256=<hex>``: the HMAC-SHA256, keyed by the secret, of ``<timestamp>.<body>``."""
    signed = timestamp.encode("ascii") + b"." + body
    return "sha256=" + hmac.new(secret.encode("utf-8"), signed, hashlib.sha256).hexdigest()


def retry_wait(attempts: int) -> datetime.timedelta:
    """The wait after ``attempts`` failed attempts: WEBHOOK_RETRY_SECONDS, doubled after each
    failure, at most a day."""
    first = float(app_settings.WEBHOOK_RETRY_SECONDS)
    return datetime.timedelta(seconds=min(first * 2 ** max(attempts - 1, 0), MAX_RETRY_SECONDS))


def attempt(delivery_id: int, now: datetime.datetime | None = None) -> WebhookStatus | None:
    """One attempt at a pending delivery that is due (at ``now``); its status after it, or None
    when it was not due (delivered, failed, not yet, or being sent by someone else). The next
    attempt's time counts from ``now``."""
    now = now or _now()
    claimed = WebhookDelivery.objects.filter(
        pk=delivery_id, status=WebhookStatus.PENDING, next_attempt_at__lte=now
    ).update(
        attempts=F("attempts") + 1,
        next_attempt_at=now + datetime.timedelta(seconds=CLAIM_SECONDS),
    )
    if not claimed:
        return None
    delivery = WebhookDelivery.objects.get(pk=delivery_id)
    secret = secret_for(delivery.url)
    response_status: int | None = None
    if secret is None:
        error = "this URL is no longer in WEBHOOKS (or has no secret): not sent"
        final = True
    else:
        response_status, error = _post(delivery, secret)
        final = False
    after = WebhookDelivery.objects.filter(pk=delivery_id, attempts=delivery.attempts)
    if not error:
        after.update(
            status=WebhookStatus.DELIVERED,
            delivered_at=_now(),
            next_attempt_at=None,
            response_status=response_status,
            last_error="",
        )
        return WebhookStatus.DELIVERED
    error = storable_text(error)[:ERROR_CHARS]
    if final or delivery.attempts >= int(app_settings.WEBHOOK_MAX_ATTEMPTS):
        logger.warning(
            "webhook delivery %s (%s to %s) failed after %d attempt(s): %s",
            delivery_id,
            delivery.event,
            delivery.url,
            delivery.attempts,
            error,
        )
        after.update(
            status=WebhookStatus.FAILED,
            next_attempt_at=None,
            response_status=response_status,
            last_error=error,
        )
        return WebhookStatus.FAILED
    after.update(
        next_attempt_at=now + retry_wait(delivery.attempts),
        response_status=response_status,
        last_error=error,
    )
    return WebhookStatus.PENDING


def _post(delivery: WebhookDelivery, secret: str) -> tuple[int | None, str]:
    """POST the delivery's body, signed; (the answer's status, "" or what went wrong)."""
    body = json.dumps(delivery.payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    timestamp = str(int(time.time()))
    headers = {
        "Content-Type": "application/json",
        "User-Agent": "durable-agents-webhooks",
        TIMESTAMP_HEADER: timestamp,
        SIGNATURE_HEADER: signature(secret, timestamp, body),
        EVENT_HEADER: delivery.event,
        DELIVERY_HEADER: str(delivery.pk),
    }
    request = urllib.request.Request(delivery.url, data=body, headers=headers, method="POST")
    try:
        with _opener.open(request, timeout=TIMEOUT_SECONDS) as response:
            status = int(response.status)
    except urllib.error.HTTPError as exc:  # an answer, but not 2xx (a redirect included)
        with exc:
            text = exc.read(200).decode("utf-8", "replace")
        return exc.code, f"HTTP {exc.code}: {text}"
    except (OSError, http.client.HTTPException, ValueError) as exc:
        return None, f"{type(exc).__name__}: {exc}"
    if 200 <= status < 300:
        return status, ""
    return status, f"HTTP {status}"


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """A redirect is an answer like any other that is not 2xx: never followed (it could lead
    a signed body anywhere)."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


_opener = urllib.request.build_opener(_NoRedirects)


# -- what housekeeping and the admin do --------------------------------------------------------


def retry_due(now: datetime.datetime | None = None, limit: int = RETRY_BATCH) -> int:
    """Attempt the pending deliveries that are due, oldest due first, in this process (the
    housekeeping task's own time); how many were attempted."""
    now = now or _now()
    due = list(
        WebhookDelivery.objects.filter(status=WebhookStatus.PENDING, next_attempt_at__lte=now)
        .order_by("next_attempt_at")
        .values_list("pk", flat=True)[:limit]
    )
    return sum(1 for delivery_id in due if attempt(delivery_id, now) is not None)


def prune(now: datetime.datetime | None = None) -> int:
    """Delete the delivered and failed deliveries older than WEBHOOK_KEEP_DAYS."""
    cutoff = (now or _now()) - datetime.timedelta(days=float(app_settings.WEBHOOK_KEEP_DAYS))
    deleted, _ = WebhookDelivery.objects.filter(
        status__in=(WebhookStatus.DELIVERED, WebhookStatus.FAILED), created_at__lt=cutoff
    ).delete()
    return deleted


def send_again(ids: Sequence[int]) -> int:
    """Make these deliveries due now, delivered ones aside, and hand their sending off (the
    admin's "send again"): a failed one gets one more attempt. How many were made due."""
    made_due = list(
        WebhookDelivery.objects.filter(pk__in=ids)
        .exclude(status=WebhookStatus.DELIVERED)
        .values_list("pk", flat=True)
    )
    WebhookDelivery.objects.filter(pk__in=made_due).update(
        status=WebhookStatus.PENDING, next_attempt_at=_now()
    )
    send_soon(made_due)
    return len(made_due)
