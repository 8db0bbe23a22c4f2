"""The capacity page: each model's buckets, the last hour's 429s and pauses, and the runs
waiting for capacity or for their key's budget, by priority and by key."""

from __future__ import annotations

import datetime
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from durable_agents.api import start_run
from durable_agents.models import AgentRun, CapacityEvent, ModelCapacity, RunStatus, WaitKind

pytestmark = pytest.mark.django_db

URL = "admin:durable_agents_agentrun_capacity"


def waiting(kind: WaitKind, priority: int = 0, key: str | None = None) -> None:
    run = start_run("tester", "Say hello.", priority=priority, concurrency_key=key)
    AgentRun.objects.filter(pk=run.pk).update(
        status=RunStatus.PENDING,
        waiting_for=kind,
        lease_until=timezone.now() + datetime.timedelta(seconds=30),
    )


def test_the_page_shows_each_models_buckets_pauses_and_waiting_runs(
    admin_client: Client, django_assert_max_num_queries: Any
) -> None:
    now = timezone.now()
    ModelCapacity.objects.create(
        model="<script>alert(1)</script>",
        configured=True,
        requests_per_minute=600,
        requests_level=25,
        refilled_at=now,
        paused_until=now + datetime.timedelta(seconds=30),
        rate_limited=3,
        pauses=3,
    )
    CapacityEvent.objects.create(model="claude-test-1", kind="rate_limited", seconds=2)
    CapacityEvent.objects.create(
        model="claude-test-1", kind="paused", at=now - datetime.timedelta(hours=2)
    )
    waiting(WaitKind.CAPACITY, priority=10, key="tenant:a")
    waiting(WaitKind.CAPACITY, priority=10, key="tenant:a")
    waiting(WaitKind.BUDGET, key="tenant:<b>")
    with django_assert_max_num_queries(8):
        response = admin_client.get(reverse(URL))
    assert response.status_code == 200
    page = response.content.decode()
    assert "<script>alert(1)</script>" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "tenant:&lt;b&gt;" in page
    stats = response.context
    (model,) = stats["models"]
    assert model.source == "RATE_LIMITS"
    (requests,) = model.buckets
    assert requests.capacity == 100
    # 25 when written, refilled at 10 a second since (the page shows the bucket as it is now).
    assert 25 <= requests.percent <= 40
    assert 29 < (model.paused_for or 0) <= 30
    assert [(e["model"], e["kind"], e["n"]) for e in stats["events"]] == [
        ("claude-test-1", "rate_limited", 1)  # the pause two hours ago is out of the window
    ]
    assert {(w["waiting_for"], w["priority"], w["n"]) for w in stats["by_priority"]} == {
        ("budget", 0, 1),
        ("capacity", 10, 2),
    }
    assert stats["by_key"][0] == {"waiting_for": "capacity", "concurrency_key": "tenant:a", "n": 2}
    operations = admin_client.get(reverse("admin:durable_agents_agentrun_operations"))
    assert reverse(URL) in operations.content.decode()


def test_the_page_needs_the_view_permission() -> None:
    staff = get_user_model().objects.create_user("nobody", password="pw", is_staff=True)
    client = Client()
    client.force_login(staff)
    assert client.get(reverse(URL)).status_code == 403
    staff.user_permissions.add(Permission.objects.get(codename="view_agentrun"))
    assert client.get(reverse(URL)).status_code == 200


def test_housekeeping_prunes_the_capacity_record_after_a_week() -> None:
    from durable_agents.housekeeping import sweeps as housekeeping

    now = timezone.now()
    old = CapacityEvent.objects.create(
        model="m", kind="paused", at=now - datetime.timedelta(days=8)
    )
    recent = CapacityEvent.objects.create(
        model="m", kind="paused", at=now - datetime.timedelta(days=6)
    )
    assert housekeeping.prune_capacity_events(now) == 1
    assert list(CapacityEvent.objects.values_list("pk", flat=True)) == [recent.pk]
    assert not CapacityEvent.objects.filter(pk=old.pk).exists()
