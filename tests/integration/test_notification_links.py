"""Signed links in the mail of a waiting intent: they lead, after the admin's login, to the
approve or reject confirmation page, which shows exactly the call and decides only on a POST;
a forged, altered, expired, misdirected or outdated link is refused with a 403 page."""

from __future__ import annotations

import re
import time
from typing import Any
from unittest import mock
from urllib.parse import parse_qs, urlsplit

import pytest
from django.contrib.auth.models import Permission, User
from django.test import Client
from django.urls import reverse

import durable_agents
from durable_agents._internal import intent_links
from durable_agents.models import IntentStatus, RunStatus, ToolIntent
from tests.conftest import run_worker
from tests.integration.test_admin import hidden_fields

pytestmark = pytest.mark.django_db(transaction=True)

LINK = re.compile(r"http://testserver(/\S+/(approve|reject)/\?link=\S+)")


@pytest.fixture
def person() -> User:
    """A staff user with an e-mail address who may decide intents (and log in)."""
    user = User.objects.create_user("ann", "ann@example.com", "pw", is_staff=True)
    user.user_permissions.add(Permission.objects.get(codename="approve_toolintent"))
    return user


def waiting_intent(table: str = "t1") -> ToolIntent:
    run = durable_agents.start_run("tester", f'Drop it.\n@drop_table {{"table": "{table}"}}')
    run_worker()
    run.refresh_from_db()
    assert run.status == RunStatus.WAITING, run.error
    return ToolIntent.objects.get(run=run)


def mailed_links(mailoutbox: list[Any], intent: ToolIntent) -> dict[str, str]:
    """The approve and reject links (path and query) of the intent's mail."""
    [mail] = [m for m in mailoutbox if f"(run {intent.run_id})" in m.subject]
    return {action: path for path, action in LINK.findall(mail.body)}


def logged_in(user: User) -> Client:
    client = Client()
    client.force_login(user)
    return client


def refused(response: Any, why: str) -> None:
    assert response.status_code == 403
    html = response.content.decode()
    assert "cannot be used" in html
    assert why in html
    assert "Nothing was decided" in html


def test_the_mail_links_both_confirmation_pages(mailoutbox: list[Any], person: User) -> None:
    intent = waiting_intent()
    links = mailed_links(mailoutbox, intent)
    approve = reverse("admin:durable_agents_toolintent_approve", args=[intent.pk])
    reject = reverse("admin:durable_agents_toolintent_reject", args=[intent.pk])
    assert links["approve"].startswith(approve + "?link=")
    assert links["reject"].startswith(reject + "?link=")


def test_a_link_leads_through_the_login_to_exactly_the_call(
    mailoutbox: list[Any], person: User
) -> None:
    intent = waiting_intent("orders_2019")
    link = mailed_links(mailoutbox, intent)["approve"]
    client = Client()
    to_login = client.get(link)
    assert to_login.status_code == 302
    login = urlsplit(to_login["Location"])
    assert login.path == reverse("admin:login")
    [next_page] = parse_qs(login.query)["next"]
    assert next_page == link  # the token survives the login
    back = client.post(
        reverse("admin:login"), {"username": "ann", "password": "pw", "next": next_page}
    )
    assert back.status_code == 302
    assert back["Location"] == link
    page = client.get(link)
    assert page.status_code == 200
    html = page.content.decode()
    assert "It will run with exactly this input:" in html
    assert "orders_2019" in html
    assert (
        ToolIntent.objects.get(pk=intent.pk).status == IntentStatus.PENDING
    )  # GET decides nothing
    # The page's own form decides, as without a link.
    client.post(
        reverse("admin:durable_agents_toolintent_approve", args=[intent.pk]), hidden_fields(page)
    )
    assert ToolIntent.objects.get(pk=intent.pk).status == IntentStatus.APPROVED


def test_the_reject_link_shows_the_reject_form(mailoutbox: list[Any], person: User) -> None:
    intent = waiting_intent()
    page = logged_in(person).get(mailed_links(mailoutbox, intent)["reject"])
    assert page.status_code == 200
    assert 'id="reject-form"' in page.content.decode()
    assert ToolIntent.objects.get(pk=intent.pk).status == IntentStatus.PENDING


def test_a_link_grants_no_permission(mailoutbox: list[Any], person: User) -> None:
    intent = waiting_intent()
    other = User.objects.create_user("bob", "bob@example.com", "pw", is_staff=True)
    page = logged_in(other).get(mailed_links(mailoutbox, intent)["approve"])
    assert page.status_code == 403
    assert ToolIntent.objects.get(pk=intent.pk).status == IntentStatus.PENDING


def test_an_altered_token_is_refused(mailoutbox: list[Any], person: User) -> None:
    intent = waiting_intent()
    link = mailed_links(mailoutbox, intent)["approve"]
    path, token = link.split("?link=")
    altered = token[:-2] + ("AA" if not token.endswith("AA") else "BB")
    refused(logged_in(person).get(f"{path}?link={altered}"), "not made by this site")
    refused(logged_in(person).get(f"{path}?link=nonsense"), "not made by this site")


def test_a_link_for_another_intent_or_decision_is_refused(
    mailoutbox: list[Any], person: User
) -> None:
    first = waiting_intent("t1")
    second = waiting_intent("t2")
    token = mailed_links(mailoutbox, first)["approve"].split("?link=")[1]
    client = logged_in(person)
    other_intent = reverse("admin:durable_agents_toolintent_approve", args=[second.pk])
    refused(client.get(f"{other_intent}?link={token}"), "another intent")
    other_action = reverse("admin:durable_agents_toolintent_reject", args=[first.pk])
    refused(client.get(f"{other_action}?link={token}"), "another intent")


def test_an_expired_link_is_refused(mailoutbox: list[Any], person: User, da_settings: Any) -> None:
    intent = waiting_intent()
    da_settings(LINK_MAX_AGE=3600)
    # What the signer reads as now, an hour and more ago, while the link is made.
    with mock.patch("time.time", return_value=time.time() - 3700):
        old = intent_links.sign(intent, "approve")
    path = reverse("admin:durable_agents_toolintent_approve", args=[intent.pk])
    refused(logged_in(person).get(f"{path}?link={old}"), "expired")
    fresh = intent_links.sign(intent, "approve")
    assert logged_in(person).get(f"{path}?link={fresh}").status_code == 200


def test_a_link_made_before_the_call_changed_is_refused(
    mailoutbox: list[Any], person: User
) -> None:
    intent = waiting_intent("t1")
    link = mailed_links(mailoutbox, intent)["approve"]
    ToolIntent.objects.filter(pk=intent.pk).update(input={"table": "customers"})
    refused(logged_in(person).get(link), "has changed")
    assert ToolIntent.objects.get(pk=intent.pk).status == IntentStatus.PENDING


def test_a_link_never_decides_on_get(mailoutbox: list[Any], person: User) -> None:
    intent = waiting_intent()
    client = logged_in(person)
    for link in mailed_links(mailoutbox, intent).values():
        for _ in range(2):
            assert client.get(link).status_code == 200
            assert client.head(link).status_code == 200
    assert ToolIntent.objects.get(pk=intent.pk).status == IntentStatus.PENDING


def test_an_unknown_outcome_mail_has_no_decision_links(mailoutbox: list[Any], person: User) -> None:
    from durable_agents import notifications

    intent = waiting_intent()
    ToolIntent.objects.filter(pk=intent.pk).update(status=IntentStatus.UNKNOWN, reason="crash")
    mailoutbox.clear()
    notifications.on_intent_waiting(ToolIntent, ToolIntent.objects.get(pk=intent.pk))
    [mail] = mailoutbox
    assert "?link=" not in mail.body
    assert "resolve" in mail.body
