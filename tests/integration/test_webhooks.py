"""Webhooks: events posted as signed JSON to a real HTTP receiver on 127.0.0.1, recorded in
agent_webhook_delivery, retried by housekeeping with a doubling wait, given up after
WEBHOOK_MAX_ATTEMPTS; the admin's deliveries page and its "send again" action; the checks."""

from __future__ import annotations

import base64
import datetime
import hashlib
import hmac
import io
import json
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from django.apps import apps
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import Permission
from django.core.management import call_command
from django.db import connection
from django.test import Client
from django.urls import reverse

import durable_agents
from durable_agents import webhooks
from durable_agents.checks.webhooks import bad_webhooks
from durable_agents.housekeeping import sweeps as housekeeping
from durable_agents.models import (
    AgentRun,
    IntentStatus,
    RunStatus,
    ToolIntent,
    WebhookDelivery,
    WebhookStatus,
)
from tests.conftest import free_port, run_worker, wait_for
from tests.integration.test_admin import ESCAPED, SCRIPT

pytestmark = pytest.mark.django_db(transaction=True)

SECRET = "s3cret-s3cret-s3cret-s3cret-s3cret-42"
KEY = base64.urlsafe_b64encode(b"K" * 32).decode()
ALL_EVENTS = list(webhooks.EVENTS)


# ---------------------------------------------------------------------------------------------
# A real receiver


@dataclass
class Received:
    headers: dict[str, str]
    body: bytes

    @property
    def json(self) -> Any:
        return json.loads(self.body)

    def signed_by(self, secret: str) -> bool:
        """What a receiver does: the HMAC of "<timestamp>.<body>" under the shared secret."""
        timestamp = self.headers[webhooks.TIMESTAMP_HEADER]
        expected = hmac.new(
            secret.encode(), timestamp.encode() + b"." + self.body, hashlib.sha256
        ).hexdigest()
        return hmac.compare_digest(self.headers[webhooks.SIGNATURE_HEADER], f"sha256={expected}")


@dataclass
class HookServer:
    """An HTTP server on 127.0.0.1 that records each POST and answers with the next status
    of ``answers`` (200 once they run out)."""

    url: str
    received: list[Received] = field(default_factory=list)
    answers: queue.Queue[tuple[int, dict[str, str]]] = field(default_factory=queue.Queue)

    def answer(self, status: int, **headers: str) -> None:
        self.answers.put((status, headers))

    def events(self) -> list[str]:
        return [r.json["event"] for r in self.received]


@pytest.fixture
def hook_server() -> Iterator[HookServer]:
    box: list[HookServer] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length", "0"))
            body = self.rfile.read(length)
            server = box[0]
            server.received.append(Received(dict(self.headers.items()), body))
            try:
                status, headers = server.answers.get_nowait()
            except queue.Empty:
                status, headers = 200, {}
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    box.append(HookServer(f"http://127.0.0.1:{httpd.server_address[1]}/hook"))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield box[0]
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join()


@pytest.fixture
def hooked(da_settings: Any, hook_server: HookServer) -> HookServer:
    da_settings(WEBHOOKS=[{"url": hook_server.url, "events": ALL_EVENTS, "secret": SECRET}])
    return hook_server


def drop_run(table: str = "t1") -> tuple[AgentRun, ToolIntent]:
    run = durable_agents.start_run("tester", f'Drop it.\n@drop_table {{"table": "{table}"}}')
    run_worker()
    run.refresh_from_db()
    assert run.status == RunStatus.WAITING, run.error
    return run, ToolIntent.objects.get(run=run)


def deliveries(event: str | None = None) -> list[WebhookDelivery]:
    rows = WebhookDelivery.objects.order_by("pk")
    return list(rows.filter(event=event) if event else rows)


# ---------------------------------------------------------------------------------------------
# Events


def test_an_intent_waiting_is_posted_signed_with_its_call_and_links(hooked: HookServer) -> None:
    run, intent = drop_run()
    assert hooked.events() == ["intent.waiting"]
    post = hooked.received[0]
    assert post.signed_by(SECRET)
    assert not post.signed_by(SECRET + "x")
    assert post.headers[webhooks.EVENT_HEADER] == "intent.waiting"
    body = post.json
    assert body["run"] == {
        "id": str(run.pk),
        "agent": "tester",
        "version": run.prompt_version,
        "status": "waiting",
        "metadata": {},
    }
    assert body["intent"] == {
        "id": intent.pk,
        "tool": "drop_table",
        "status": "pending",
        "arguments": {"table": "t1"},
    }
    approve_path = reverse("admin:durable_agents_toolintent_approve", args=[intent.pk])
    assert body["links"]["approve"].startswith(f"http://testserver{approve_path}?link=")
    assert "/reject/?link=" in body["links"]["reject"]
    assert body["links"]["run"].endswith(
        reverse("admin:durable_agents_agentrun_change", args=[run.pk])
    )
    assert "Approval needed: drop_table" in body["text"]
    assert body["links"]["approve"] in body["text"]
    [delivery] = deliveries()
    assert delivery.status == WebhookStatus.DELIVERED
    assert (delivery.attempts, delivery.response_status, delivery.run_id) == (1, 200, run.pk)
    assert post.headers[webhooks.DELIVERY_HEADER] == str(delivery.pk)


def test_finished_and_dead_runs_are_posted(hooked: HookServer, da_settings: Any) -> None:
    run = durable_agents.start_run("tester", "Say hello.", metadata={"tenant": "acme"})
    run_worker()
    assert AgentRun.objects.get(pk=run.pk).status == RunStatus.SUCCEEDED
    [finished] = [r.json for r in hooked.received if r.json["event"] == "run.finished"]
    assert finished["run"]["status"] == "succeeded"
    assert finished["run"]["metadata"] == {"tenant": "acme"}
    doomed = durable_agents.start_run("tester", "Never served.", model="claude-retired-1")
    da_settings(RETIRED_MODELS=["claude-retired-1"])
    housekeeping.sweep()
    [dead] = [r.json for r in hooked.received if r.json["event"] == "run.dead"]
    assert dead["run"]["id"] == str(doomed.pk)
    assert dead["run"]["status"] == "dead"
    assert "retired" in dead["reason"]
    assert "is in the dead letter" in dead["text"]
    assert all(r.signed_by(SECRET) for r in hooked.received)


def test_a_question_is_posted_escaped_for_slack(hooked: HookServer) -> None:
    run = durable_agents.start_run(
        "waiter", 'Ask.\n@ask_person {"question": "<!channel> Which region & why?"}'
    )
    run_worker()
    [asked] = [r.json for r in hooked.received if r.json["event"] == "question.asked"]
    assert asked["run"]["id"] == str(run.pk)
    assert asked["question"]["text"] == "<!channel> Which region & why?"
    # The text chat tools show cannot mention the channel.
    assert "&lt;!channel&gt; Which region &amp; why?" in asked["text"]
    assert "<!channel>" not in asked["text"]


def test_only_the_events_a_webhook_takes_are_posted(
    da_settings: Any, hook_server: HookServer
) -> None:
    da_settings(WEBHOOKS=[{"url": hook_server.url, "events": ["run.dead"], "secret": SECRET}])
    drop_run()
    durable_agents.start_run("tester", "Say hello.")
    run_worker()
    assert hook_server.received == []
    assert deliveries() == []


def test_a_template_writes_the_text(da_settings: Any, hook_server: HookServer) -> None:
    template = "{tool} waits for {agent}: {approve_url} ({{literal}})"
    da_settings(
        WEBHOOKS=[
            {
                "url": hook_server.url,
                "events": ["intent.waiting"],
                "secret": SECRET,
                "template": template,
            }
        ]
    )
    drop_run()
    body = hook_server.received[0].json
    assert body["text"] == f"drop_table waits for tester: {body['links']['approve']} ({{literal}})"


def test_a_template_reaches_nothing_but_its_fields() -> None:
    fields = webhooks.template_fields(webhooks.sample_payload("run.finished"))
    for template in ("{run_id.__class__}", "{run_id[0]}", "{0}", "{secret}", "{tool"):
        with pytest.raises(webhooks.TemplateProblem):
            webhooks.render_template(template, fields)


def test_with_encryption_on_a_body_says_what_and_who_never_the_values(
    hooked: HookServer, da_settings: Any
) -> None:
    da_settings(ENCRYPTION_KEYS=[KEY])
    _, intent = drop_run("payroll_secret_table")
    durable_agents.start_run("waiter", 'Ask.\n@ask_person {"question": "The vault code?"}')
    run_worker()
    assert sorted(hooked.events()) == ["intent.waiting", "question.asked"]
    intent_body, question_body = sorted((r.json for r in hooked.received), key=lambda b: b["event"])
    assert intent_body["intent"] == {"id": intent.pk, "tool": "drop_table", "status": "pending"}
    assert "approve" in intent_body["links"]
    assert question_body["question"] == {"id": question_body["question"]["id"]}
    for post in hooked.received:
        text = post.body.decode()
        assert "payroll_secret_table" not in text
        assert "vault code" not in text
    with connection.cursor() as cursor:
        cursor.execute("SELECT payload FROM agent_webhook_delivery")
        stored = " ".join(str(row[0]) for row in cursor.fetchall())
    assert "payroll_secret_table" not in stored
    assert "vault code" not in stored


def test_without_django_q_a_thread_sends_it(
    hooked: HookServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(apps, "is_installed", lambda name: name != "django_q")
    drop_run()
    wait_for(
        lambda: WebhookDelivery.objects.filter(status=WebhookStatus.DELIVERED).exists(),
        what="the thread's delivery",
    )
    assert hooked.events() == ["intent.waiting"]
    assert hooked.received[0].signed_by(SECRET)


# ---------------------------------------------------------------------------------------------
# Attempts


def test_a_500_is_retried_after_a_doubling_wait_then_delivered(hooked: HookServer) -> None:
    hooked.answer(500)
    hooked.answer(503)
    drop_run()
    [delivery] = deliveries()
    assert (delivery.status, delivery.attempts, delivery.response_status) == ("pending", 1, 500)
    assert delivery.last_error.startswith("HTTP 500")
    first_due = delivery.next_attempt_at
    assert first_due is not None
    # Not yet due: nothing is sent.
    assert housekeeping.deliver_webhooks(first_due - datetime.timedelta(seconds=1)) == {
        "attempted": 0,
        "pruned": 0,
    }
    assert len(hooked.received) == 1
    assert webhooks.retry_due(first_due) == 1
    delivery.refresh_from_db()
    assert (delivery.status, delivery.attempts, delivery.response_status) == ("pending", 2, 503)
    # The wait doubled: 30 s after the first failure, 60 s after the second.
    assert delivery.next_attempt_at == first_due + datetime.timedelta(seconds=60)
    assert webhooks.retry_due(delivery.next_attempt_at) == 1
    delivery.refresh_from_db()
    assert (delivery.status, delivery.attempts, delivery.response_status) == ("delivered", 3, 200)
    assert delivery.last_error == ""
    assert delivery.next_attempt_at is None
    assert len(hooked.received) == 3
    assert all(r.signed_by(SECRET) for r in hooked.received)
    # The same body each time; the receiver tells attempts apart by the delivery id.
    assert len({r.body for r in hooked.received}) == 1


def test_it_gives_up_after_the_last_attempt(hooked: HookServer, da_settings: Any) -> None:
    da_settings(WEBHOOK_MAX_ATTEMPTS=3, WEBHOOK_RETRY_SECONDS=1)
    for _ in range(5):
        hooked.answer(500)
    drop_run()
    [delivery] = deliveries()
    far = delivery.created_at + datetime.timedelta(days=1)
    assert webhooks.retry_due(far) == 1
    assert webhooks.retry_due(far) == 0  # the next attempt counts from this one
    assert webhooks.retry_due(far + datetime.timedelta(seconds=2)) == 1
    delivery.refresh_from_db()
    assert (delivery.status, delivery.attempts) == ("failed", 3)
    assert delivery.next_attempt_at is None
    assert webhooks.retry_due(far + datetime.timedelta(days=1)) == 0
    assert len(hooked.received) == 3


def test_a_redirect_is_not_followed(hooked: HookServer) -> None:
    hooked.answer(302, Location=hooked.url + "/elsewhere")
    drop_run()
    [delivery] = deliveries()
    assert (delivery.status, delivery.response_status) == ("pending", 302)
    assert len(hooked.received) == 1


def test_a_receiver_that_is_down_leaves_it_pending(da_settings: Any) -> None:
    url = f"http://127.0.0.1:{free_port()}/hook"
    da_settings(WEBHOOKS=[{"url": url, "events": ALL_EVENTS, "secret": SECRET}])
    drop_run()
    [delivery] = deliveries()
    assert (delivery.status, delivery.attempts, delivery.response_status) == ("pending", 1, None)
    assert "refused" in delivery.last_error.lower()


def test_a_url_no_longer_configured_fails_without_a_post(
    hooked: HookServer, da_settings: Any
) -> None:
    hooked.answer(500)
    drop_run()
    da_settings(WEBHOOKS=[])
    [delivery] = deliveries()
    assert webhooks.retry_due(delivery.next_attempt_at) == 1
    delivery.refresh_from_db()
    assert delivery.status == WebhookStatus.FAILED
    assert "no longer in WEBHOOKS" in delivery.last_error
    assert len(hooked.received) == 1


def test_the_housekeeping_command_sends_what_is_due(hooked: HookServer) -> None:
    hooked.answer(500)
    drop_run()
    [delivery] = deliveries()
    WebhookDelivery.objects.filter(pk=delivery.pk).update(next_attempt_at=delivery.created_at)
    out = io.StringIO()
    call_command("durable_agents_housekeeping", "--webhooks", stdout=out)
    assert "webhooks: {'attempted': 1, 'pruned': 0}" in out.getvalue()
    delivery.refresh_from_db()
    assert (delivery.status, delivery.attempts) == ("delivered", 2)


def test_housekeeping_prunes_old_finished_deliveries(hooked: HookServer) -> None:
    hooked.answer(500)
    drop_run()
    durable_agents.start_run("tester", "Say hello.")
    run_worker()
    assert sorted(d.status for d in deliveries()) == ["delivered", "pending"]
    later = WebhookDelivery.objects.order_by("-created_at")[0].created_at + datetime.timedelta(
        days=31
    )
    assert webhooks.prune(later) == 1
    assert [d.status for d in deliveries()] == ["pending"]


# ---------------------------------------------------------------------------------------------
# The admin


def deliveries_url() -> str:
    return reverse("admin:durable_agents_webhookdelivery_changelist")


def test_the_deliveries_page_shows_them_escaped(
    hooked: HookServer, admin_client: Client, da_settings: Any
) -> None:
    hooked.answer(500)
    run = durable_agents.start_run("tester", "Say hello.", metadata={"note": SCRIPT})
    run_worker()
    [delivery] = deliveries()
    page = admin_client.get(deliveries_url())
    assert page.status_code == 200
    html = page.content.decode()
    assert "run.finished" in html
    assert "HTTP 500" in html
    detail = admin_client.get(
        reverse("admin:durable_agents_webhookdelivery_change", args=[delivery.pk])
    )
    assert detail.status_code == 200
    text = detail.content.decode()
    assert ESCAPED in text
    assert SCRIPT not in text
    assert str(run.pk)[:8] in text


def test_send_again_needs_its_permission(
    hooked: HookServer, django_user_model: Any, da_settings: Any
) -> None:
    da_settings(WEBHOOK_MAX_ATTEMPTS=1)
    hooked.answer(500)
    drop_run()
    [delivery] = deliveries()
    assert delivery.status == WebhookStatus.FAILED
    viewer = django_user_model.objects.create_user("viewer", password="pw", is_staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_webhookdelivery"))
    client = Client()
    client.force_login(viewer)
    page = client.get(deliveries_url())
    assert page.status_code == 200
    assert "send_again" not in page.content.decode()
    client.post(deliveries_url(), {"action": "send_again", "_selected_action": [delivery.pk]})
    delivery.refresh_from_db()
    assert delivery.status == WebhookStatus.FAILED
    assert len(hooked.received) == 1


def test_send_again_posts_with_csrf_and_is_audited(
    hooked: HookServer, django_user_model: Any, da_settings: Any
) -> None:
    da_settings(WEBHOOK_MAX_ATTEMPTS=1)
    hooked.answer(500)
    drop_run()
    [delivery] = deliveries()
    assert delivery.status == WebhookStatus.FAILED
    operator = django_user_model.objects.create_user("op", password="pw", is_staff=True)
    operator.user_permissions.add(
        *Permission.objects.filter(codename__in=["view_webhookdelivery", "retry_webhookdelivery"])
    )
    client = Client(enforce_csrf_checks=True)
    client.force_login(operator)
    chosen = {"action": "send_again", "_selected_action": [delivery.pk]}
    assert client.post(deliveries_url(), chosen).status_code == 403  # no CSRF token
    assert len(hooked.received) == 1
    page = client.get(deliveries_url())
    assert "send_again" in page.content.decode()
    token = page.cookies["csrftoken"].value
    response = client.post(deliveries_url(), {**chosen, "csrfmiddlewaretoken": token}, follow=True)
    assert response.status_code == 200
    delivery.refresh_from_db()
    assert (delivery.status, delivery.attempts) == ("delivered", 2)
    assert len(hooked.received) == 2
    assert LogEntry.objects.get(object_id=str(delivery.pk)).change_message == "Sent again."


def test_an_intent_is_still_decided_as_before(hooked: HookServer, superuser: Any) -> None:
    _, intent = drop_run()
    durable_agents.approve_intent(intent.pk, user=superuser)
    assert ToolIntent.objects.get(pk=intent.pk).status == IntentStatus.APPROVED


# ---------------------------------------------------------------------------------------------
# The checks


def ids_of(hooks: Any, da_settings: Any) -> list[str]:
    da_settings(WEBHOOKS=hooks)
    return [str(message.id) for message in bad_webhooks()]


GOOD = {"url": "https://hooks.example.net/x", "events": ["run.dead"], "secret": SECRET}


@pytest.mark.parametrize(
    ("hooks", "ids"),
    [
        ([GOOD], []),
        ({"url": "x"}, ["durable_agents.E070"]),
        (["https://hooks.example.net"], ["durable_agents.E070"]),
        ([{**GOOD, "secrets": SECRET}], ["durable_agents.E070"]),
        ([{**GOOD, "url": "ftp://hooks.example.net/x"}], ["durable_agents.E071"]),
        ([{**GOOD, "url": "hooks.example.net/x"}], ["durable_agents.E071"]),
        ([{**GOOD, "url": "https://agents.example.com/hook"}], ["durable_agents.E072"]),
        ([{**GOOD, "url": "http://localhost:9000/hook"}], ["durable_agents.W070"]),
        ([{**GOOD, "events": ["run.died"]}], ["durable_agents.E073"]),
        ([{**GOOD, "events": []}], ["durable_agents.E073"]),
        ([{**GOOD, "secret": "short"}], ["durable_agents.E074"]),
        ([{k: v for k, v in GOOD.items() if k != "secret"}], ["durable_agents.E074"]),
        ([{**GOOD, "template": "{run_id.__class__}"}], ["durable_agents.E075"]),
        ([{**GOOD, "template": "{nope}"}], ["durable_agents.E075"]),
        ([{**GOOD, "template": "{tool}: {approve_url}"}], []),
    ],
)
def test_the_checks_name_each_problem(hooks: Any, ids: list[str], da_settings: Any) -> None:
    da_settings(SITE_URL="https://agents.example.com")
    assert ids_of(hooks, da_settings) == ids


def test_a_short_secret_is_never_shown(da_settings: Any) -> None:
    da_settings(WEBHOOKS=[{**GOOD, "secret": "hunter2-hunter2"}])
    [message] = bad_webhooks()
    assert "hunter2" not in message.msg + (message.hint or "")
