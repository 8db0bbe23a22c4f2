"""Concurrency keys' budgets in the admin and through the API: who may set one, what setting it
does to the key's waiting runs, and the audit trail."""

from __future__ import annotations

import datetime
from decimal import Decimal
from typing import Any

import pytest
from django.contrib.admin.models import CHANGE, LogEntry
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.core.exceptions import PermissionDenied
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from durable_agents.api import set_key_budget, start_run
from durable_agents.housekeeping import sweeps as housekeeping
from durable_agents.models import AgentRun, ConcurrencyKey, RunStatus, WaitKind

pytestmark = pytest.mark.django_db


def waiting_for_budget(key: str) -> AgentRun:
    """A run of ``key`` parked for its budget until tomorrow, as the runner parks one."""
    run = start_run("tester", "Say hello.", concurrency_key=key)
    AgentRun.objects.filter(pk=run.pk).update(
        status=RunStatus.PENDING,
        waiting_for=WaitKind.BUDGET,
        lease_until=timezone.now() + datetime.timedelta(hours=5),
    )
    return AgentRun.objects.get(pk=run.pk)


def change_url(key: str) -> str:
    return reverse("admin:durable_agents_concurrencykey_change", args=[key])


def test_raising_a_budget_in_the_admin_wakes_the_keys_runs_and_is_audited(
    admin_client: Client, superuser: Any, da_settings: Any
) -> None:
    da_settings(BUDGETS={"*": {"usd_per_day": 1}})
    run = waiting_for_budget("tenant:<b>acme</b>")
    other = waiting_for_budget("tenant:other")
    listing = admin_client.get(reverse("admin:durable_agents_concurrencykey_changelist"))
    assert listing.status_code == 200
    assert b"tenant:&lt;b&gt;acme&lt;/b&gt;" in listing.content  # escaped, not markup
    assert b"tenant:<b>acme" not in listing.content
    page = admin_client.get(change_url(run.concurrency_key or ""))
    assert page.status_code == 200
    response = admin_client.post(change_url(run.concurrency_key or ""), {"usd_per_day": "25"})
    assert response.status_code == 302
    assert ConcurrencyKey.objects.get(key=run.concurrency_key).usd_per_day == Decimal(25)
    assert AgentRun.objects.get(pk=run.pk).lease_until is None  # back in the queue
    assert AgentRun.objects.get(pk=other.pk).lease_until is not None  # another key's: not
    entry = LogEntry.objects.get(object_id=run.concurrency_key)
    assert (entry.action_flag, entry.user_id) == (CHANGE, superuser.pk)


def test_only_staff_with_the_permission_set_a_budget(da_settings: Any) -> None:
    da_settings(BUDGETS={"*": {"usd_per_day": 1}})
    run = waiting_for_budget("tenant:acme")
    staff = get_user_model().objects.create_user("viewer", password="pw", is_staff=True)
    staff.user_permissions.add(Permission.objects.get(codename="view_concurrencykey"))
    client = Client(enforce_csrf_checks=True)
    client.force_login(staff)
    assert client.get(change_url("tenant:acme")).status_code == 200  # may look
    assert client.post(change_url("tenant:acme"), {"usd_per_day": "99"}).status_code == 403
    with pytest.raises(PermissionDenied):
        set_key_budget("tenant:acme", 99, user=staff)
    assert ConcurrencyKey.objects.get(key="tenant:acme").usd_per_day is None
    assert AgentRun.objects.get(pk=run.pk).lease_until is not None


def test_the_change_form_needs_its_csrf_token(superuser: Any) -> None:
    start_run("tester", "Say hello.", concurrency_key="tenant:acme")
    client = Client(enforce_csrf_checks=True)
    client.force_login(superuser)
    assert client.post(change_url("tenant:acme"), {"usd_per_day": "5"}).status_code == 403
    assert ConcurrencyKey.objects.get(key="tenant:acme").usd_per_day is None


@pytest.mark.parametrize("amount", [-1, "lots", float("nan"), float("inf"), True])
def test_a_budget_that_is_not_an_amount_is_refused(amount: Any) -> None:
    with pytest.raises(ValueError, match="usd_per_day"):
        set_key_budget("tenant:acme", amount)
    with pytest.raises(ValueError, match="concurrency key"):
        set_key_budget("", 5)


def test_housekeeping_wakes_a_keys_runs_once_its_budget_has_room(da_settings: Any) -> None:
    da_settings(BUDGETS={"tenant:acme": {"usd_per_day": 0}})
    run = waiting_for_budget("tenant:acme")
    assert housekeeping.wake_budget_waiters() == 0  # spent 0 of 0: still no room
    da_settings(BUDGETS={"tenant:acme": {"usd_per_day": 10}})  # raised by a deploy
    assert housekeeping.wake_budget_waiters() == 1
    assert AgentRun.objects.get(pk=run.pk).lease_until is None


def test_a_limit_set_for_a_key_holds_the_claims_and_raising_it_lets_them_through(
    admin_client: Client, superuser: Any
) -> None:
    from durable_agents import store
    from durable_agents.api import set_key_limit

    for _ in range(4):
        start_run("tester", "Say hello.", concurrency_key="tenant:acme")
    set_key_limit("tenant:acme", 0, user=superuser)  # staff pause the key
    assert store.current().claim_runs("w1", 30, 10) == []
    # Raised in the admin: the claims of this process follow at once.
    response = admin_client.post(change_url("tenant:acme"), {"concurrency_limit": "2"})
    assert response.status_code == 302
    assert ConcurrencyKey.objects.get(key="tenant:acme").concurrency_limit == 2
    assert len(store.current().claim_runs("w1", 30, 10)) == 2
    assert store.current().claim_runs("w2", 30, 10) == []  # two running: the key is full
    assert LogEntry.objects.filter(object_id="tenant:acme").count() == 1
    with pytest.raises(ValueError, match="whole number"):
        set_key_limit("tenant:acme", -1)


def _page(client: Client, key: str) -> str:
    response = client.get(change_url(key))
    assert response.status_code == 200
    return response.content.decode()


def test_a_keys_page_shows_the_limit_in_force_and_where_it_comes_from(
    admin_client: Client, superuser: Any, da_settings: Any
) -> None:
    from durable_agents.api import set_key_limit

    da_settings(CONCURRENCY_LIMITS={"tenant:setting": 5, "tenant:row": 7})
    for key in ("tenant:setting", "tenant:row", "tenant:none"):
        start_run("tester", "Say hello.", concurrency_key=key)
    set_key_limit("tenant:row", 3, user=superuser)
    viewer = get_user_model().objects.create_user("viewer", password="pw", is_staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_concurrencykey"))
    looking = Client()
    looking.force_login(viewer)
    for client in (admin_client, looking):  # may change it, may only look
        setting = _page(client, "tenant:setting")
        assert "5, from the CONCURRENCY_LIMITS setting" in setting
        row = _page(client, "tenant:row")
        assert "3, set on this page (it overrides CONCURRENCY_LIMITS, 7)" in row
        none = _page(client, "tenant:none")
        # The test app's agent "keyed" limits its own runs: the page says so.
        assert "none for the key: each run keeps its agent&#x27;s own limit (keyed@v1: 2)" in none
    listing = admin_client.get(reverse("admin:durable_agents_concurrencykey_changelist"))
    content = listing.content.decode()
    assert "5, from the CONCURRENCY_LIMITS setting" in content
    assert "3, set on this page" in content


def test_the_budget_column_and_field_read_usd_per_day(admin_client: Client) -> None:
    start_run("tester", "Say hello.", concurrency_key="tenant:acme")
    set_key_budget("tenant:acme", 25)
    listing = admin_client.get(reverse("admin:durable_agents_concurrencykey_changelist"))
    page = admin_client.get(change_url("tenant:acme"))
    for response in (listing, page):
        content = response.content.decode()
        assert "USD per day" in content
        assert "Usd per day" not in content
    assert "$25.0000" in listing.content.decode()
