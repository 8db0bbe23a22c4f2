"""What runs cost, in the admin: the runs list, a run's page (with its children's) and the
operations page's cost per agent and per day, read from the rollup."""

from __future__ import annotations

import datetime
from decimal import Decimal
from typing import Any

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

import durable_agents
from durable_agents.models import AgentRun, AgentUsageDay, trees
from tests.conftest import run_worker
from tests.integration.test_admin_i18n import german_client

__all__ = ["german_client"]  # the fixture, imported for the German page

PRICES = {"claude-test-1": {"input": 3.0, "output": 15.0}}


def runs_url() -> str:
    return reverse("admin:durable_agents_agentrun_changelist")


def run_url(run: AgentRun) -> str:
    return reverse("admin:durable_agents_agentrun_change", args=[run.pk])


def operations_url() -> str:
    return reverse("admin:durable_agents_agentrun_operations")


def with_cost(task: str, cost: str | None, tokens: int = 100) -> AgentRun:
    run = durable_agents.start_run("tester", task)
    AgentRun.objects.filter(pk=run.pk).update(
        cost_usd=None if cost is None else Decimal(cost), tokens_used=tokens
    )
    return AgentRun.objects.get(pk=run.pk)


def test_the_runs_list_shows_the_cost_under_the_steps(admin_client: Client) -> None:
    with_cost("priced", "0.012345")
    with_cost("unpriced", None)
    with_cost("not started", None, tokens=0)
    content = admin_client.get(runs_url()).content.decode()
    assert '<span class="da-meta da-cost" title="100 tokens">$0.0123</span>' in content
    assert '<span class="da-meta da-cost" title="100 tokens">no price</span>' in content
    assert content.count('class="da-meta da-cost"') == 2  # nothing before the first turn


def test_a_run_page_shows_its_cost_next_to_its_tokens(admin_client: Client) -> None:
    run = with_cost("priced", "1.23456")
    content = admin_client.get(run_url(run)).content.decode()
    tokens, cost = content.index("okens used"), content.index("$1.2346")
    assert tokens < cost
    assert "family-cost" not in content  # no children
    unpriced = with_cost("unpriced", None)
    assert "no price" in admin_client.get(run_url(unpriced)).content.decode()


def test_a_parents_page_adds_its_descendants_costs(
    admin_client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    parent = with_cost("parent", "0.5")
    child = with_cost("child", "0.25")
    grandchild = with_cost("grandchild", "0.125")
    unpriced = with_cost("unpriced child", None)
    AgentRun.objects.filter(pk__in=[child.pk, unpriced.pk]).update(parent=parent, depth=1)
    AgentRun.objects.filter(pk=grandchild.pk).update(parent=child, depth=2)
    content = admin_client.get(run_url(parent)).content.decode()
    assert '$0.5000 <span class="da-meta" id="family-cost">($0.8750 with its 3 ' in content
    # A child's page: its own subtree.
    content = admin_client.get(run_url(child)).content.decode()
    assert "($0.3750 with its 1 descendant run)" in content
    # Past the limit the figure is a lower bound, and says so.
    monkeypatch.setattr(trees, "FAMILY_LIMIT", 1)
    content = admin_client.get(run_url(parent)).content.decode()
    assert "(at least $0." in content
    assert "with the first 2 of its descendant runs)" in content


@pytest.mark.django_db(transaction=True)
def test_the_operations_page_shows_cost_per_agent_and_per_day(
    admin_client: Client, da_settings: Any
) -> None:
    da_settings(PRICES=PRICES)
    runs = [durable_agents.start_run("tester", f'@lookup {{"key": "k{i}"}}') for i in range(2)]
    assert run_worker().stats.dispositions == {"succeeded": 2}
    paid = sum((AgentRun.objects.get(pk=r.pk).cost_usd or Decimal(0) for r in runs), Decimal(0))
    assert paid > 0
    today = timezone.now().astimezone(datetime.UTC).date()
    # Three days ago, and eight (out of the window): as the rollup holds them.
    for back, cost in ((3, "2.5"), (8, "100")):
        AgentUsageDay.objects.create(
            day=today - datetime.timedelta(days=back),
            agent="tester",
            model="claude-test-1",
            turns=10,
            input_tokens=1000,
            cost_usd=Decimal(cost),
        )
    AgentUsageDay.objects.create(day=today, agent="other", model="claude-free", turns=1)

    with CaptureQueriesContext(connection) as queries:
        response = admin_client.get(operations_url())
    assert response.status_code == 200
    # The rollup alone: one aggregate, never a pass over the step log.
    sql = [q["sql"] for q in queries.captured_queries]
    assert sum("agent_usage_day" in q for q in sql) == 1
    assert not any('"agent_step"' in q for q in sql)

    ctx = response.context
    tester, other = ctx["cost_rows"]
    assert (tester.agent, tester.model, tester.turns) == ("tester", "claude-test-1", 14)
    assert (tester.cost, tester.today) == (paid + Decimal("2.5"), paid)
    assert (other.agent, other.cost, other.cost_text, other.today_text) == (
        "other",
        None,
        "no price",
        "no price",
    )
    bars = ctx["cost_day_bars"]
    assert [bar.text for bar in bars][-1] == "today"
    assert len(bars) == 7
    assert [bar.shown for bar in bars][3] == "$2.5000"  # three days ago
    assert bars[-1].shown == f"${paid.quantize(Decimal('0.0001'))}"
    content = response.content.decode()
    assert f"Cost of model turns, last 7 days (UTC): ${(paid + Decimal('2.5')):.4f}" in content
    assert "?agent=tester&amp;model=claude-test-1" in content


def test_the_operations_page_without_turns(admin_client: Client) -> None:
    content = admin_client.get(operations_url()).content.decode()
    assert "No model turns in that window." in content
    assert "Cost of model turns, last 7 days (UTC): $0.0000" in content


def test_the_cost_texts_are_german(german_client: Client) -> None:
    run = with_cost("priced", "0.5")
    AgentUsageDay.objects.create(
        day=timezone.now().astimezone(datetime.UTC).date(), agent="tester", model="m", turns=1
    )
    content = german_client.get(operations_url()).content.decode()
    for german in ("Kosten der Modellzüge, letzte 7 Tage (UTC)", "Modellzüge", "heute"):
        assert german in content, german
    assert "kein Preis" in content  # the row's model has no price
    content = german_client.get(runs_url()).content.decode()
    assert 'title="100 Tokens">$0.5000<' in content
    content = german_client.get(run_url(run)).content.decode()
    assert "Kosten" in content


@pytest.mark.django_db
def test_the_operations_page_lists_cost_by_concurrency_key(admin_client: Any) -> None:
    import datetime as _dt
    from decimal import Decimal as _D

    from django.urls import reverse as _reverse

    from durable_agents.models import AgentUsageDay

    today = _dt.datetime.now(_dt.UTC).date()
    for key, cost in (("tenant:<b>", "1.50"), ("tenant:cheap", "0.25"), ("", "9.00")):
        AgentUsageDay.objects.create(
            day=today,
            concurrency_key=key,
            agent="tester",
            model="m",
            shard=0,
            turns=3,
            input_tokens=10,
            output_tokens=5,
            cache_read_tokens=0,
            cache_write_tokens=0,
            cost_usd=_D(cost),
        )
    response = admin_client.get(_reverse("admin:durable_agents_agentrun_operations"))
    rows = response.context["key_cost_rows"]
    assert [(r.agent, r.cost) for r in rows] == [
        ("tenant:<b>", _D("1.50")),
        ("tenant:cheap", _D("0.25")),
    ]  # runs without a key are not a key's
    assert "tenant:&lt;b&gt;" in response.content.decode()
