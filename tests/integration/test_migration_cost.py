"""Migration 0011 (what runs cost): re-runnable after an interruption, and its ALTER on
agent_run gives up its lock wait and tries again rather than queueing the fleet behind it."""

from __future__ import annotations

import importlib
import threading
from decimal import Decimal
from typing import Any

import pytest
from django.apps import apps
from django.db import connection

import durable_agents
from durable_agents.models import AgentRun, AgentUsageDay
from tests.conftest import database_url

migration: Any = importlib.import_module("durable_agents.migrations.0011_run_cost")


def has_cost_column() -> bool:
    with connection.cursor() as cursor:
        columns = connection.introspection.get_table_description(cursor, "agent_run")
    return any(column.name == "cost_usd" for column in columns)


def run_migration() -> None:
    with connection.schema_editor(atomic=False) as editor:
        migration.add_cost(apps, editor)
        migration.create_usage_day(apps, editor)


@pytest.mark.django_db(transaction=True)
def test_0011_runs_again_and_finishes_what_an_interruption_left() -> None:
    run = durable_agents.start_run("tester", "t")
    AgentRun.objects.filter(pk=run.pk).update(cost_usd=Decimal("0.25"))
    run_migration()  # complete already: nothing to do, nothing lost
    assert AgentRun.objects.get(pk=run.pk).cost_usd == Decimal("0.25")
    # Interrupted after the column, before the table.
    with connection.schema_editor(atomic=False) as editor:
        editor.execute('DROP TABLE "agent_usage_day"')
    run_migration()
    AgentUsageDay.objects.create(day="2026-01-01", agent="a", model="m", turns=1)
    assert AgentRun.objects.get(pk=run.pk).cost_usd == Decimal("0.25")
    # Interrupted before the column (and the reverse of the migration): added again, NULL.
    with connection.schema_editor(atomic=False) as editor:
        migration.remove_cost(apps, editor)
        migration.remove_cost(apps, editor)  # twice: nothing to drop
    assert not has_cost_column()
    run_migration()
    assert has_cost_column()
    assert AgentRun.objects.get(pk=run.pk).cost_usd is None
    assert AgentUsageDay.objects.count() == 1


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_0011_waits_briefly_for_its_lock_and_tries_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """A long transaction holds agent_run: the ALTER gives up after lock_timeout (so claims
    and commits do not queue behind it), waits, and succeeds once the lock is free."""
    import psycopg

    with connection.schema_editor(atomic=False) as editor:
        migration.remove_cost(apps, editor)
    holder = psycopg.connect(database_url())
    holder.execute("SELECT count(*) FROM agent_run")  # an open transaction reading the table
    waits: list[float] = []
    released = threading.Event()

    def pause(seconds: float) -> None:
        waits.append(seconds)
        holder.rollback()  # the long transaction ends while the migration waits
        released.set()

    monkeypatch.setattr(migration, "LOCK_TIMEOUT", "50ms")
    monkeypatch.setattr(migration.time, "sleep", pause)
    try:
        run_migration()
    finally:
        holder.close()
    assert released.is_set()
    assert waits == [1.0]  # one refusal, then the ALTER got its lock
    assert has_cost_column()
