"""Staff hear about intents that wait and runs that die, through django-q2 or directly."""

from __future__ import annotations

from typing import Any

import pytest
from django.apps import apps
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group, Permission

import durable_agents
from durable_agents import notifications, signals
from durable_agents.models import AgentRun, IntentStatus, RunStatus, ToolIntent
from tests.conftest import run_worker

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def staff() -> dict[str, Any]:
    User = get_user_model()  # noqa: N806
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
