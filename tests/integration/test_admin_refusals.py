"""Inputs the admin refused with a 500 now refused with an answer: a NUL in a concurrency
key's URL (404), a negative budget (a form error), a decision on an intent whose input does not
decrypt (it stays pending, the page says why), run pages under a malformed ENCRYPTION_KEYS, and
a whitespace-only concurrency key (refused where keys are accepted).

Through the real admin (Django's test client) on the real database."""

from __future__ import annotations

import base64
from decimal import Decimal
from typing import Any

import pytest
from django.contrib.admin.models import LogEntry
from django.test import Client
from django.urls import reverse

import durable_agents
from durable_agents import api
from durable_agents.models import ConcurrencyKey, IntentStatus, ToolIntent
from tests.integration.test_admin import intent_url, messages_of, parked_intent, run_url

pytestmark = pytest.mark.django_db(transaction=True)

KEY_A = base64.urlsafe_b64encode(b"A" * 32).decode()
KEY_B = base64.urlsafe_b64encode(b"B" * 32).decode()


@pytest.mark.parametrize("view", ["change", "history", "delete"])
def test_a_nul_in_a_concurrency_keys_url_is_404(admin_client: Client, view: str) -> None:
    durable_agents.start_run("tester", "t", concurrency_key="tenant:acme")
    url = f"/admin/durable_agents/concurrencykey/tenant%00acme/{view}/"
    assert admin_client.get(url).status_code == 404
    assert admin_client.post(url, {"usd_per_day": "1"}).status_code == 404


def test_a_negative_budget_is_a_form_error(admin_client: Client) -> None:
    durable_agents.start_run("tester", "t", concurrency_key="tenant:acme")
    url = reverse("admin:durable_agents_concurrencykey_change", args=["tenant:acme"])
    response = admin_client.post(url, {"usd_per_day": "-5"})
    assert response.status_code == 200  # the form again, with the error beside the field
    assert response.context["adminform"].form.errors["usd_per_day"]
    assert ConcurrencyKey.objects.get(key="tenant:acme").usd_per_day is None
    assert not LogEntry.objects.exists()
    assert admin_client.post(url, {"usd_per_day": "5"}).status_code == 302
    assert ConcurrencyKey.objects.get(key="tenant:acme").usd_per_day == Decimal(5)


@pytest.mark.parametrize("key", [" ", "\t\n", "\u3000"])
def test_a_whitespace_only_concurrency_key_is_refused(key: str) -> None:
    with pytest.raises(ValueError, match="only whitespace"):
        api.start_run("tester", "t", concurrency_key=key)
    assert not ConcurrencyKey.objects.exists()


@pytest.mark.parametrize(
    ("view", "data"),
    [
        ("approve", {}),
        ("reject", {"reason": "no"}),
    ],
)
def test_a_decision_on_an_input_that_does_not_decrypt_leaves_it_pending_and_says_why(
    admin_client: Client, da_settings: Any, view: str, data: dict[str, str]
) -> None:
    da_settings(ENCRYPTION_KEYS=[KEY_A])
    intent = parked_intent()
    da_settings(ENCRYPTION_KEYS=[KEY_B])  # the key that encrypted the input is gone
    response = admin_client.post(intent_url(intent, view), data, follow=True)
    assert response.status_code == 200
    assert response.redirect_chain[-1][0] == intent_url(intent)
    [message] = messages_of(response)
    assert "Nothing was decided" in message
    assert "which ENCRYPTION_KEYS does not hold" in message
    assert ToolIntent.objects.filter(pk=intent.pk, status=IntentStatus.PENDING).exists()
    assert not LogEntry.objects.exists()


@pytest.mark.parametrize("keys", [["not base64!"], [[KEY_A]], [KEY_A, 7]])
def test_run_pages_under_malformed_keys_name_the_problem(
    admin_client: Client, da_settings: Any, keys: list[Any]
) -> None:
    da_settings(ENCRYPTION_KEYS=[KEY_A])
    intent = parked_intent()
    da_settings(ENCRYPTION_KEYS=keys)
    for url in (run_url(intent.run), intent_url(intent)):
        page = admin_client.get(url)
        assert page.status_code == 200, url
        assert "[cannot decrypt: " in page.content.decode(), url
