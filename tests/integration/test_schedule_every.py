"""A schedule row whose interval (``every``) is zero or negative, written past ``schedule()``
(raw SQL, a fixture, an install from before the constraint): the firing marks it broken and
fires the other schedules, Resume in the admin refuses it with a message, the database refuses
new ones, and migration 0022 adds that refusal on a table that holds such a row.

The rows are inserted on the schema of the migration before 0022 (before the constraint),
reached with the real ``migrate`` command, which then migrates forward again."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from typing import Any

import pytest
from django.contrib.admin.models import LogEntry
from django.core.management import call_command
from django.db import IntegrityError, connection, transaction
from django.test import Client

from durable_agents.models import AgentRun, AgentSchedule
from durable_agents.schedules.defining import schedule, slot_key
from durable_agents.schedules.firing import fire_due
from tests.integration.test_admin import messages_of
from tests.integration.test_admin_schedules import page_url

pytestmark = pytest.mark.django_db(transaction=True)

UTC = dt.UTC
DUE = dt.datetime(2026, 1, 1, tzinfo=UTC)
NOW = DUE + dt.timedelta(seconds=5)
# The migration 0022 (the constraint) depends on: the schema the bad rows are written on.
BEFORE_THE_CONSTRAINT = "0021_fork_key_run"


@pytest.fixture
def before_the_constraint() -> Iterator[None]:
    """The schema of the migration before 0022 for the test; the newest again after it (each test
    deletes its rows: a transaction=True test's flush comes after this fixture's end)."""
    call_command("migrate", "durable_agents", BEFORE_THE_CONSTRAINT, verbosity=0)
    try:
        yield
    finally:
        call_command("migrate", "durable_agents", verbosity=0)


@pytest.fixture
def without_the_constraint() -> Iterator[None]:
    """The newest schema without the CHECK of migration 0022 for the test (the code that
    runs must find today's tables: an older schema lacks their newer columns), the CHECK back
    after it, once the test's schedules are gone."""
    if connection.vendor == "sqlite":
        # SQLite drops a CHECK only by copying the table, from the model (which has it).
        with connection.cursor() as cursor:
            cursor.execute("PRAGMA ignore_check_constraints = ON")
        try:
            yield
        finally:
            AgentSchedule.objects.all().delete()
            with connection.cursor() as cursor:
                cursor.execute("PRAGMA ignore_check_constraints = OFF")
        return
    (constraint,) = [
        c for c in AgentSchedule._meta.constraints if c.name == "agent_schedule_every_positive"
    ]
    with connection.schema_editor() as editor:
        editor.remove_constraint(AgentSchedule, constraint)
    try:
        yield
    finally:
        AgentSchedule.objects.all().delete()
        with connection.schema_editor() as editor:
            editor.add_constraint(AgentSchedule, constraint)


def write_by_hand(name: str, every: dt.timedelta, **fields: Any) -> None:
    """A schedule as SQL past the app writes it: ``schedule()`` for the row, then its
    interval set with an UPDATE that no check of the app sees."""
    schedule(name, "tester", f"Work of {name}.", every=dt.timedelta(minutes=1), **fields)
    # Microseconds on SQLite, an interval on PostgreSQL: as the field writes it.
    stored = AgentSchedule._meta.get_field("every").get_db_prep_value(every, connection)
    with connection.cursor() as cursor:
        cursor.execute("UPDATE agent_schedule SET every = %s WHERE name = %s", [stored, name])
    AgentSchedule.objects.filter(name=name).update(next_slot=DUE)


@pytest.mark.parametrize(
    "every", [dt.timedelta(0), dt.timedelta(seconds=-5)], ids=["zero", "negative"]
)
def test_firing_marks_a_schedule_with_a_bad_interval_broken_and_fires_the_others(
    without_the_constraint: None, every: dt.timedelta
) -> None:
    write_by_hand("bad", every, catch_up=True)
    schedule("good", "tester", "Work.", every=dt.timedelta(minutes=1))
    AgentSchedule.objects.filter(name="good").update(next_slot=DUE)
    fired = fire_due(NOW)
    assert fired.broken == ["bad"]
    assert [run.start_key for run in fired.runs] == [slot_key("good", DUE)]
    bad = AgentSchedule.objects.get(name="bad")
    assert "its interval (every) is" in bad.broken
    assert bad.next_slot == DUE  # not moved backwards
    # Broken: the next firings take it no more, and start nothing of it.
    assert fire_due(NOW + dt.timedelta(minutes=5)).broken == []
    assert not AgentRun.objects.filter(start_key__startswith="bad@").exists()
    AgentSchedule.objects.all().delete()


def test_resume_in_the_admin_refuses_a_bad_interval_with_a_message(
    without_the_constraint: None, admin_client: Client
) -> None:
    write_by_hand("paused-bad", dt.timedelta(0), enabled=False)
    row = AgentSchedule.objects.get(name="paused-bad")
    response = admin_client.post(page_url(row, "resume"), follow=True)
    assert response.status_code == 200
    [message] = messages_of(response)
    assert "was not resumed" in message
    assert "its interval (every) is 0:00:00" in message
    row.refresh_from_db()
    assert not row.enabled
    assert not LogEntry.objects.exists()
    AgentSchedule.objects.all().delete()


def test_the_migration_breaks_a_bad_row_then_adds_the_constraint(
    before_the_constraint: None,
) -> None:
    write_by_hand("bad", dt.timedelta(seconds=-5))
    schedule("good", "tester", "Work.", every=dt.timedelta(minutes=1))
    call_command("migrate", "durable_agents", verbosity=0)  # must not fail on the bad row
    bad = AgentSchedule.objects.get(name="bad")
    assert "was -1 day, 23:59:55, not positive" in bad.broken
    assert bad.every == dt.timedelta(days=366)
    good = AgentSchedule.objects.get(name="good")
    assert (good.broken, good.every) == ("", dt.timedelta(minutes=1))
    # From now on the database itself refuses such an interval.
    for every in (dt.timedelta(0), dt.timedelta(seconds=-5)):
        with pytest.raises(IntegrityError), transaction.atomic():
            AgentSchedule.objects.filter(name="good").update(every=every)
    AgentSchedule.objects.all().delete()
