"""durable_agents.tree_cost: a run's cost with its descendants', from the API."""

from __future__ import annotations

import asyncio
import uuid
from decimal import Decimal

import pytest

import durable_agents
from durable_agents.exceptions import InvalidArgument, RunNotFound
from durable_agents.models import AgentRun

pytestmark = pytest.mark.django_db


def priced(task: str, cost: str | None, parent: AgentRun | None = None) -> AgentRun:
    run = durable_agents.start_run("tester", task)
    AgentRun.objects.filter(pk=run.pk).update(
        cost_usd=None if cost is None else Decimal(cost),
        parent=parent,
        depth=0 if parent is None else parent.depth + 1,
    )
    return AgentRun.objects.get(pk=run.pk)


def test_a_tree_costs_its_runs_together() -> None:
    root = priced("root", "0.5")
    child = priced("child", "0.25", root)
    priced("grandchild", "0.125", child)
    priced("unpriced child", None, root)
    whole = durable_agents.tree_cost(root.pk)
    assert (whole.cost, whole.descendants, whole.complete) == (Decimal("0.875"), 3, True)
    branch = durable_agents.tree_cost(str(child.pk))  # the text of an id too
    assert (branch.cost, branch.descendants) == (Decimal("0.375"), 1)


def test_a_run_without_children_or_prices() -> None:
    alone = priced("alone", None)
    cost = durable_agents.tree_cost(alone.pk)
    assert (cost.cost, cost.descendants) == (None, 0)


@pytest.mark.django_db(transaction=True)
def test_atree_cost_from_async_code() -> None:
    root = priced("root", "1.25")
    priced("child", "0.75", root)
    cost = asyncio.run(durable_agents.atree_cost(root.pk))
    assert cost.cost == Decimal("2.00")


@pytest.mark.parametrize("bad", ["not-a-uuid", 42, None])
def test_an_id_that_is_not_a_run_id_is_refused(bad: object) -> None:
    with pytest.raises(InvalidArgument):
        durable_agents.tree_cost(bad)  # type: ignore[arg-type]


def test_an_unknown_run_is_not_found() -> None:
    with pytest.raises(RunNotFound):
        durable_agents.tree_cost(uuid.uuid4())
