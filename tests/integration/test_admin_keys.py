"""Concurrency keys in the admin: the key under the status on the runs list (and a run held
back by it), the list filtered by key or found by an exact search, and the run's page with
the key's limit and whether the run holds one of its slots."""

from __future__ import annotations

import re
from typing import Any

import pytest
from django.test import Client, override_settings

import durable_agents
from durable_agents.models import AgentRun, short_id
from durable_agents.store import current
from tests.integration.test_admin import run_url, runs_url

pytestmark = pytest.mark.django_db


def status_cell(page: str, run: AgentRun) -> str:
    rows = [row for row in page.split("<tr") if short_id(run.pk) in row]
    assert rows, f"no row for {run.pk}"
    cell = re.search(r'<td class="field-status_short">(.*?)</td>', rows[0], re.S)
    assert cell
    return cell.group(1)


def test_the_list_shows_the_key_and_a_run_that_waits_for_it(admin_client: Client) -> None:
    with override_settings(DURABLE_AGENTS={"CONCURRENCY_LIMITS": {"tenant:acme": 1}}):
        first = durable_agents.start_run("tester", "first", concurrency_key="tenant:acme")
        second = durable_agents.start_run("tester", "second", concurrency_key="tenant:acme")
        [claim] = current().claim_runs("w", 60, 5)
        assert claim.run_id == first.pk
        page = admin_client.get(runs_url()).content.decode()
    assert "tenant:acme" in status_cell(page, first)
    assert "waits for its key" not in status_cell(page, first)
    assert "waits for its key (1 of 1 running)" in status_cell(page, second)
    with override_settings(DURABLE_AGENTS={"CONCURRENCY_LIMITS": {"tenant:acme": 0}}):
        page = admin_client.get(runs_url()).content.decode()
    assert "waits for its key (limit 0)" in status_cell(page, second)


def test_the_list_is_filtered_by_key_and_found_by_it(admin_client: Client) -> None:
    acme = durable_agents.start_run("tester", "acme's", concurrency_key="tenant:acme")
    other = durable_agents.start_run("tester", "other's", concurrency_key="tenant:other")
    plain = durable_agents.start_run("tester", "no key")
    for response in (
        admin_client.get(runs_url(), {"concurrency_key": "tenant:acme"}),
        admin_client.get(runs_url(), {"q": "tenant:acme"}),
    ):
        page = response.content.decode()
        assert short_id(acme.pk) in page
        assert short_id(other.pk) not in page
        assert short_id(plain.pk) not in page
    filters = admin_client.get(runs_url()).content.decode()
    assert "?concurrency_key=tenant%3Aother" in filters


def test_the_run_page_shows_the_key_its_limit_and_whether_the_run_holds_it(
    admin_client: Client,
) -> None:
    held = durable_agents.start_run("tester", "holds", concurrency_key="tenant:acme")
    waits = durable_agents.start_run("tester", "waits", concurrency_key="tenant:acme")
    plain = durable_agents.start_run("tester", "no key")
    with override_settings(DURABLE_AGENTS={"CONCURRENCY_LIMITS": {"tenant:acme": 1}}):
        current().claim_runs("w", 60, 5)
        holder = admin_client.get(run_url(held)).content.decode()
        waiter = admin_client.get(run_url(waits)).content.decode()
    assert re.search(r'id="concurrency-key">tenant:acme</a>', holder)
    assert "limit 1 (CONCURRENCY_LIMITS)" in holder
    assert "this run holds one of its slots; 1 running" in holder
    assert "waits for its key (1 of 1 running)" in waiter
    assert 'id="concurrency-key"' not in admin_client.get(run_url(plain)).content.decode()
    agents = admin_client.get(run_url(waits)).content.decode()  # the setting gone: no limit
    assert "no limit" in agents


@override_settings(LANGUAGE_CODE="de")
def test_the_key_lines_are_in_german(admin_client: Client) -> None:
    run = durable_agents.start_run("tester", "wartet", concurrency_key="tenant:acme")
    with override_settings(DURABLE_AGENTS={"CONCURRENCY_LIMITS": {"tenant:acme": 0}}):
        page = admin_client.get(run_url(run), HTTP_ACCEPT_LANGUAGE="de").content.decode()
    assert "Nebenläufigkeitsschlüssel" in page or "Nebenl&auml;ufigkeitsschl&uuml;ssel" in page
    assert "wartet auf seinen Schlüssel (Limit 0)" in page


def test_the_run_page_says_a_limit_set_on_the_keys_page_comes_from_there(
    admin_client: Client, superuser: Any
) -> None:
    from durable_agents.api import set_key_limit

    run = durable_agents.start_run("tester", "keyed", concurrency_key="tenant:acme")
    set_key_limit("tenant:acme", 4, user=superuser)
    with override_settings(DURABLE_AGENTS={"CONCURRENCY_LIMITS": {"tenant:acme": 1}}):
        page = admin_client.get(run_url(run)).content.decode()
    # The key's own row overrides the setting: it is named as the source, not the setting.
    assert "limit 4 (set on the key&#x27;s page)" in page
    assert "(CONCURRENCY_LIMITS)" not in page
