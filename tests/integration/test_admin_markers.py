"""Invisible and direction-changing characters read as markers on the pages that showed them
as they are: a run's start key, the operations page's cost per key, a schedule's form inputs
(task and concurrency key) and a schedule's history title."""

from __future__ import annotations

import datetime
from decimal import Decimal

import pytest
from django.test import Client
from django.urls import reverse

from durable_agents.api import start_run
from durable_agents.models import AgentUsageDay
from tests.integration.test_admin_schedules import make, page_url

RLO = "\u202e"  # RIGHT-TO-LEFT OVERRIDE: draws what follows backwards
ZWSP = "\u200b"  # ZERO WIDTH SPACE: not drawn at all
MARKED_RLO = '<span class="da-invisible" title="U+202E RIGHT-TO-LEFT OVERRIDE">⟨U+202E⟩</span>'
MARKED_ZWSP = '<span class="da-invisible" title="U+200B ZERO WIDTH SPACE">⟨U+200B⟩</span>'


def assert_marked_not_raw(html: str) -> None:
    assert MARKED_RLO in html
    assert MARKED_ZWSP in html
    assert RLO not in html, "a hidden character reached the page as is"
    assert ZWSP not in html, "a hidden character reached the page as is"


@pytest.mark.django_db
def test_a_runs_start_key_reads_with_markers(admin_client: Client) -> None:
    run = start_run("tester", "t", key=f"order-{RLO}1234{ZWSP}")
    html = admin_client.get(reverse("admin:durable_agents_agentrun_change", args=[run.pk]))
    page = html.content.decode()
    assert_marked_not_raw(page)
    assert "starting it again with it returns this run" in page  # the field's help still shown


@pytest.mark.django_db
def test_the_cost_per_key_table_reads_with_markers(admin_client: Client) -> None:
    AgentUsageDay.objects.create(
        day=datetime.datetime.now(datetime.UTC).date(),
        concurrency_key=f"tenant:{RLO}evil{ZWSP}",
        agent="tester",
        model="m",
        shard=0,
        turns=1,
        input_tokens=1,
        output_tokens=1,
        cache_read_tokens=0,
        cache_write_tokens=0,
        cost_usd=Decimal("1.00"),
    )
    page = admin_client.get(reverse("admin:durable_agents_agentrun_operations")).content.decode()
    table = page[page.index('id="cost-per-key"') :]
    assert_marked_not_raw(table[: table.index("</table>")])


@pytest.mark.django_db
def test_a_schedules_form_shows_its_task_and_key_with_markers(admin_client: Client) -> None:
    row = make(
        f"nightly{RLO}{ZWSP}",
        task=f"Refund order 12{RLO}34{ZWSP}.",
        concurrency_key=f"tenant:{RLO}a{ZWSP}",
    )
    page = admin_client.get(page_url(row)).content.decode()
    assert_marked_not_raw(page)
    # Each input still holds its exact value (as character references), so saving the form
    # unchanged changes nothing.
    assert "Refund order 12&#x202E;34&#x200B;." in page
    assert 'value="tenant:&#x202E;a&#x200B;"' in page
    # The task's and the key's values are shown marked above their inputs, with the warning.
    assert page.count('class="da-input-markers"') == 2


@pytest.mark.django_db
def test_a_schedules_history_title_reads_with_markers(admin_client: Client) -> None:
    row = make(f"nightly{RLO}x{ZWSP}")
    response = admin_client.get(page_url(row, "history"))
    assert response.status_code == 200
    page = response.content.decode()
    assert "nightly⟨U+202E⟩x⟨U+200B⟩" in page
    assert RLO not in page
    assert ZWSP not in page


@pytest.mark.django_db
def test_plain_values_show_no_marker_block(admin_client: Client) -> None:
    row = make("plain", task="Plain task.", concurrency_key="tenant:plain")
    page = admin_client.get(page_url(row)).content.decode()
    assert "da-input-markers" not in page
    assert 'value="tenant:plain"' in page
