"""Staff hear about intents that wait and runs that die, through django-q2 or directly."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from django.apps import apps
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group, Permission
from django.urls import reverse

import durable_agents
from durable_agents import notifications, signals
from durable_agents.models import AgentQuestion, AgentRun, IntentStatus, RunStatus, ToolIntent
from tests.conftest import free_port, run_worker

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def fresh_failure_memory() -> Any:
    notifications.reset_failures()
    yield
    notifications.reset_failures()


@pytest.fixture
def no_mail_server(settings: Any, monkeypatch: pytest.MonkeyPatch) -> int:
    """A fresh project's mail setup: SMTP on localhost, where nothing listens; sent inline."""
    port = free_port()  # connections are refused
    settings.EMAIL_BACKEND = "django.core.mail.backends.smtp.EmailBackend"
    settings.EMAIL_HOST = "127.0.0.1"
    settings.EMAIL_PORT = port
    settings.EMAIL_TIMEOUT = 5
    monkeypatch.setattr(apps, "is_installed", lambda name: name != "django_q")
    return port


@pytest.fixture
def staff() -> dict[str, Any]:
    User = get_user_model()
    permission = Permission.objects.get(codename="approve_toolintent")
    approver = User.objects.create_user("ann", "ann@example.com", is_staff=True)
    approver.user_permissions.add(permission)
    group = Group.objects.create(name="approvers")
    group.permissions.add(permission)
    via_group = User.objects.create_user("bob", "bob@example.com", is_staff=True)
    via_group.groups.add(group)
    User.objects.create_user("cat", "cat@example.com", is_staff=True)  # no permission
    User.objects.create_user("dan", "dan@example.com", is_staff=False).user_permissions.add(
        permission
    )
    User.objects.create_superuser("eve", "eve@example.com", "pw")
    return {"approver": approver}


def test_recipients_are_active_staff_who_may_decide(staff: dict[str, Any]) -> None:
    assert notifications.recipients() == ["ann@example.com", "bob@example.com", "eve@example.com"]


def test_a_waiting_intent_mails_the_approvers_through_django_q(
    staff: dict[str, Any], mailoutbox: list, receiver: Any
) -> None:
    assert apps.is_installed("django_q")  # the test settings run its tasks inline
    received: list[Any] = []

    def listener(sender: Any, intent: ToolIntent, **kwargs: Any) -> None:
        received.append(intent)

    signals.intent_waiting.connect(listener)
    try:
        run = durable_agents.start_run("tester", 'Drop it.\n@drop_table {"table": "old"}')
        run_worker()
    finally:
        signals.intent_waiting.disconnect(listener)
    intent = ToolIntent.objects.get(run=run)
    assert intent.status == IntentStatus.PENDING
    assert [i.pk for i in received] == [intent.pk]
    assert len(mailoutbox) == 1
    mail = mailoutbox[0]
    assert sorted(mail.to) == ["ann@example.com", "bob@example.com", "eve@example.com"]
    assert "approval needed: drop_table" in mail.subject
    assert str(run.id) in mail.body


def test_a_dead_run_mails_with_its_reason(
    staff: dict[str, Any], mailoutbox: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(apps, "is_installed", lambda name: name != "django_q")
    run = durable_agents.start_run("tester", "hello", model="claude-2.1")  # a retired model
    run_worker()
    assert AgentRun.objects.get(pk=run.id).status == RunStatus.DEAD
    assert len(mailoutbox) == 1
    assert "dead letter" in mailoutbox[0].subject
    assert "claude-2.1" in mailoutbox[0].body


def test_notifications_can_be_switched_off(
    staff: dict[str, Any], mailoutbox: list, da_settings: Any
) -> None:
    da_settings(NOTIFY=False)
    durable_agents.start_run("tester", "hello", model="claude-2.1")
    run_worker()
    assert mailoutbox == []


def test_a_failing_notification_is_one_warning_line_then_quiet(
    staff: dict[str, Any], no_mail_server: int, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="durable_agents.notifications")
    for i in range(5):
        notifications.notify(f"[durable_agents] event {i}", "body")
    [record] = caplog.records  # not one traceback per event
    assert record.levelno == logging.WARNING
    assert record.exc_info is None  # no traceback at INFO
    line = record.getMessage()
    assert "\n" not in line
    assert "event 0" in line
    assert "ConnectionRefusedError" in line
    assert "refused" in line.lower()


def test_an_unreachable_mail_server_names_the_settings_to_change(
    staff: dict[str, Any], no_mail_server: int, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="durable_agents.notifications")
    for i in range(3):
        notifications.notify(f"event {i}", "body")
    [record] = caplog.records  # once, not per event
    line = record.getMessage()
    assert f"127.0.0.1:{no_mail_server}" in line
    assert "EMAIL_BACKEND" in line
    assert "console.EmailBackend" in line
    assert '"NOTIFY": False' in line


def test_at_debug_level_the_traceback_and_the_repeats_are_logged(
    staff: dict[str, Any], no_mail_server: int, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="durable_agents.notifications")
    for i in range(3):
        notifications.notify(f"event {i}", "body")
    levels = [r.levelno for r in caplog.records]
    assert levels == [logging.WARNING, logging.DEBUG, logging.DEBUG]
    assert all(r.exc_info is not None for r in caplog.records)


def test_a_lasting_failure_is_warned_about_again_with_a_count(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = [1000.0]
    monkeypatch.setattr(notifications, "_clock", lambda: clock[0])

    def refuse(subject: str, body: str) -> int:
        raise ConnectionRefusedError(111, "Connection refused")

    monkeypatch.setattr(apps, "is_installed", lambda name: name != "django_q")
    monkeypatch.setattr(notifications, "send_notification", refuse)
    caplog.set_level(logging.INFO, logger="durable_agents.notifications")
    for _ in range(4):
        notifications.notify("s", "b")
    clock[0] += notifications.REPEAT_WARNING_SECONDS
    notifications.notify("s", "b")
    first, again = caplog.records
    assert (first.levelno, again.levelno) == (logging.WARNING, logging.WARNING)
    assert "3 identical failures since the last warning" in again.getMessage()


def test_different_failures_each_get_their_warning(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    errors = iter([OSError("disk full"), TimeoutError("timed out"), OSError("disk full")])

    def fail(subject: str, body: str) -> int:
        raise next(errors)

    monkeypatch.setattr(apps, "is_installed", lambda name: name != "django_q")
    monkeypatch.setattr(notifications, "send_notification", fail)
    caplog.set_level(logging.INFO, logger="durable_agents.notifications")
    for _ in range(3):
        notifications.notify("s", "b")
    assert [r.getMessage().split(": ", 1)[1] for r in caplog.records] == [
        "OSError: disk full; identical failures in the next 60 minutes are logged at DEBUG level",
        "TimeoutError: timed out; identical failures in the next 60 minutes are logged at DEBUG "
        "level",
    ]


@pytest.fixture
def answerers() -> dict[str, Any]:
    """Staff who may answer questions (and one who may only approve intents)."""
    User = get_user_model()
    permission = Permission.objects.get(codename="answer_question")
    answerer = User.objects.create_user("fay", "fay@example.com", is_staff=True)
    answerer.user_permissions.add(permission)
    approver = User.objects.create_user("gus", "gus@example.com", is_staff=True)
    approver.user_permissions.add(Permission.objects.get(codename="approve_toolintent"))
    User.objects.create_superuser("hal", "hal@example.com", "pw")
    return {"answerer": answerer}


def test_a_question_mails_those_who_may_answer_with_a_link_to_the_run(
    answerers: dict[str, Any], mailoutbox: list
) -> None:
    assert notifications.recipients("answer_question") == ["fay@example.com", "hal@example.com"]
    received: list[Any] = []

    def listener(sender: Any, question: Any, **kwargs: Any) -> None:
        received.append(question)

    signals.question_asked.connect(listener)
    try:
        run = durable_agents.start_run(
            "waiter", 'Ask.\n@ask_person {"question": "Which region do we migrate first?"}'
        )
        run_worker()
    finally:
        signals.question_asked.disconnect(listener)
    question = AgentQuestion.objects.get(run_id=run.pk)
    assert [q.pk for q in received] == [question.pk]
    assert len(mailoutbox) == 1  # through django-q2, run inline by the test settings
    mail = mailoutbox[0]
    assert sorted(mail.to) == ["fay@example.com", "hal@example.com"]
    assert mail.subject == f"[durable_agents] question from run {run.pk}"
    assert "Which region do we migrate first?" in mail.body
    assert reverse("admin:durable_agents_agentrun_change", args=[run.pk]) in mail.body


def test_a_long_question_is_cut_in_the_mail_and_a_mail_without_django_q_is_sent_inline(
    answerers: dict[str, Any], mailoutbox: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(apps, "is_installed", lambda name: name != "django_q")
    run = durable_agents.start_run("waiter", "Ask a long question.")
    question = AgentQuestion.objects.create(run=run, key="k" * 64, question="why? " * 1000)
    notifications.on_question_asked(AgentQuestion, question)
    [mail] = mailoutbox
    assert "[cut: 5000 characters in all" in mail.body
    assert len(mail.body) < 3000


def test_questions_follow_the_notify_setting(
    answerers: dict[str, Any], mailoutbox: list, da_settings: Any
) -> None:
    da_settings(NOTIFY=False)
    durable_agents.start_run("waiter", 'Ask.\n@ask_person {"question": "Go?"}')
    run_worker()
    assert AgentQuestion.objects.count() == 1
    assert mailoutbox == []


def test_an_intent_mail_links_the_run_page(
    staff: dict[str, Any], mailoutbox: list, receiver: Any
) -> None:
    run = durable_agents.start_run("tester", 'Drop it.\n@drop_table {"table": "old"}')
    run_worker()
    [mail] = mailoutbox
    assert reverse("admin:durable_agents_agentrun_change", args=[run.pk]) in mail.body


def test_an_intent_whose_outcome_is_unknown_asks_to_resolve_it_not_to_approve_it(
    staff: dict[str, Any], mailoutbox: list, receiver: Any
) -> None:
    run = durable_agents.start_run("tester", 'Drop it.\n@drop_table {"table": "old"}')
    run_worker()
    intent = ToolIntent.objects.get(run=run)
    durable_agents.approve_intent(intent.pk, user=staff["approver"])
    # As a worker that died mid-call leaves it: executing, its outcome never recorded.
    ToolIntent.objects.filter(pk=intent.pk).update(status=IntentStatus.EXECUTING)
    mailoutbox.clear()
    run_worker()
    [mail] = mailoutbox
    assert mail.subject == f"[durable_agents] outcome unknown: drop_table (run {run.pk})"
    assert "Approve or reject" not in mail.body
    assert "nobody knows whether it took effect" in mail.body
    assert f"resolve intent {intent.pk} in the admin" in mail.body
    assert reverse("admin:durable_agents_toolintent_change", args=[intent.pk]) in mail.body
    assert reverse("admin:durable_agents_agentrun_change", args=[run.pk]) in mail.body
    # What happened is said, and recorded where a person reads it: the intent and the run.
    cause = f"intent {intent.pk} for drop_table: outcome unknown after a crash"
    assert f"What happened: {cause}" in mail.body
    intent.refresh_from_db()
    assert (intent.status, intent.reason) == (IntentStatus.UNKNOWN, cause)
    assert AgentRun.objects.get(pk=run.pk).error == cause


def test_with_a_site_url_every_link_in_a_mail_is_absolute(
    staff: dict[str, Any],
    answerers: dict[str, Any],
    mailoutbox: list,
    receiver: Any,
    da_settings: Any,
) -> None:
    da_settings(SITE_URL="https://agents.example.com/")  # the trailing slash is not doubled
    site = "https://agents.example.com"
    drop = durable_agents.start_run("tester", 'Drop it.\n@drop_table {"table": "old"}')
    ask = durable_agents.start_run("waiter", 'Ask.\n@ask_person {"question": "Go?"}')
    dead = durable_agents.start_run("tester", "hello", model="claude-2.1")  # a retired model
    run_worker()
    intent = ToolIntent.objects.get(run=drop)
    expected = {
        "approval needed": [
            site + reverse("admin:durable_agents_toolintent_change", args=[intent.pk]),
            site + reverse("admin:durable_agents_agentrun_change", args=[drop.pk]),
        ],
        "question": [site + reverse("admin:durable_agents_agentrun_change", args=[ask.pk])],
        "dead letter": [site + reverse("admin:durable_agents_agentrun_change", args=[dead.pk])],
    }
    assert len(mailoutbox) == 3
    for mail in mailoutbox:
        [kind] = [kind for kind in expected if kind in mail.subject]
        for url in expected[kind]:
            assert url in mail.body, (kind, mail.body)
        # No link is left relative: every "/admin/" follows the site's address.
        assert mail.body.count("/admin/") == mail.body.count(site + "/admin/"), mail.body
