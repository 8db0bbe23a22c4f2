"""``manage.py demo_admin`` (``make admin`` without the server): a demo superuser, and a pending
intent, a dead run and a waiting run for the admin to act on, started through the public API
and taken there by a worker on the offline model. Idempotent; refused with DEBUG off."""

from __future__ import annotations

from io import StringIO
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.core.management import CommandError, call_command

from durable_agents.models import AgentRun, IntentStatus, RunStatus, ToolIntent, WaitKind
from project.demo.management.commands import demo_admin

pytestmark = pytest.mark.django_db(transaction=True)


def _call() -> str:
    out = StringIO()
    call_command("demo_admin", stdout=out, stderr=StringIO())
    return out.getvalue()


def _counts() -> tuple[int, int, int, int]:
    return (
        AgentRun.objects.count(),
        ToolIntent.objects.filter(status=IntentStatus.PENDING).count(),
        AgentRun.objects.filter(status=RunStatus.DEAD).count(),
        AgentRun.objects.filter(status=RunStatus.WAITING, waiting_for=WaitKind.QUESTION).count(),
    )


def test_superuser_and_three_runs_to_act_on(settings: Any) -> None:
    settings.DEBUG = True
    out = _call()

    user = get_user_model().objects.get(username=demo_admin.USERNAME)
    assert user.is_superuser
    assert user.is_staff
    assert user.is_active
    assert user.check_password(demo_admin.PASSWORD)
    assert user.email == ""  # no notification is mailed to the demo account

    intent = ToolIntent.objects.get(status=IntentStatus.PENDING)
    assert intent.tool == "drop_table"
    assert intent.input == {"table": "orders_archive"}
    assert intent.run.status == RunStatus.WAITING

    dead = AgentRun.objects.get(status=RunStatus.DEAD)
    assert dead.model == demo_admin.RETIRED_MODEL
    assert "retired or unknown" in (dead.error or "")

    waiting = AgentRun.objects.get(status=RunStatus.WAITING, waiting_for=WaitKind.QUESTION)
    assert waiting.agent == "coordinator"

    assert "admin / admin" in out
    assert "local demo only" in out
    assert "http://127.0.0.1:8000/admin/" in out
    assert f"/admin/durable_agents/toolintent/{intent.pk}/change/" in out
    assert f"/admin/durable_agents/agentrun/{dead.pk}/change/" in out
    assert f"/admin/durable_agents/agentrun/{waiting.pk}/change/" in out


def test_running_it_again_adds_nothing(settings: Any) -> None:
    settings.DEBUG = True
    _call()
    before = _counts()
    assert before[1:] == (1, 1, 1)

    user = get_user_model().objects.get(username=demo_admin.USERNAME)
    user.set_password("changed")
    user.save()
    out = _call()

    assert _counts() == before
    assert "already there" in out
    assert get_user_model().objects.filter(username=demo_admin.USERNAME).count() == 1
    user.refresh_from_db()
    assert user.check_password(demo_admin.PASSWORD)  # the printed password is the real one


def test_refused_with_debug_off(settings: Any) -> None:
    settings.DEBUG = False
    with pytest.raises(CommandError, match="local demo only"):
        _call()
    assert not get_user_model().objects.filter(username=demo_admin.USERNAME).exists()
    assert not AgentRun.objects.exists()
