"""The cron expressions schedules take: five fields, or a macro (``@daily``...) read as its five
fields wherever a schedule's slots are computed; six fields (seconds) refused by
``schedule()`` and the admin form, while rows stored with six fields by an earlier version go
on firing as before and system check W006 names them."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from django.core import checks
from django.test import Client
from django.urls import reverse
from django.utils import translation

from durable_agents.admin.schedule_forms import ScheduleForm
from durable_agents.exceptions import CronExpressionError, DurableAgentsError
from durable_agents.models import AgentSchedule
from durable_agents.schedules.defining import next_slot, schedule, slot_key
from durable_agents.schedules.firing import fire_due
from tests.integration.test_admin_schedules import form_data

pytestmark = pytest.mark.django_db

UTC = dt.UTC
EVERY_FIVE_SECONDS = "*/5 * * * * *"


def at(
    year: int, month: int, day: int, hour: int = 0, minute: int = 0, second: int = 0
) -> dt.datetime:
    return dt.datetime(year, month, day, hour, minute, second, tzinfo=UTC)


def stored_by_an_earlier_version(name: str, cron: str, slot: dt.datetime) -> AgentSchedule:
    """A row as an earlier version's ``schedule()`` saved it (it took six fields)."""
    return AgentSchedule.objects.create(
        name=name, agent="tester", task="Work.", cron=cron, next_slot=slot
    )


def w006(**run: Any) -> list[checks.CheckMessage]:
    return [m for m in checks.run_checks(**run) if m.id == "durable_agents.W006"]


# -- six fields: refused ------------------------------------------------------------------


def test_six_fields_are_refused_with_what_to_write_instead() -> None:
    with pytest.raises(CronExpressionError) as excinfo:
        schedule("fast", "tester", "Work.", cron=EVERY_FIVE_SECONDS)
    error = excinfo.value
    assert isinstance(error, ValueError)  # what schedule() raised for a bad cron before
    assert isinstance(error, DurableAgentsError)
    message = str(error)
    assert f"{EVERY_FIVE_SECONDS!r} has six fields" in message
    assert "five fields (minute hour day-of-month month day-of-week)" in message
    assert "every=" in message  # the way to a slot every few seconds
    assert not AgentSchedule.objects.exists()


@pytest.mark.parametrize(("cron", "count"), [("0 6 * *", 4), ("0 0 6 * * * 2026", 7)])
def test_another_number_of_fields_is_refused_by_its_count(cron: str, count: int) -> None:
    with pytest.raises(CronExpressionError, match=f"has {count} fields; a cron expression has"):
        schedule("report", "tester", "Work.", cron=cron)


def test_the_admin_form_shows_six_fields_as_an_error_of_the_cron_field(
    admin_client: Client,
) -> None:
    url = reverse("admin:durable_agents_agentschedule_add")
    response = admin_client.post(url, form_data(name="fast", cron=EVERY_FIVE_SECONDS, every=""))
    assert response.status_code == 200
    errors = response.context["adminform"].form.errors
    assert list(errors) == ["cron"], errors
    assert "six fields" in errors["cron"][0]
    assert not AgentSchedule.objects.exists()


def test_the_admin_forms_six_field_error_is_translated() -> None:
    with translation.override("de"):
        form = ScheduleForm(data=form_data(name="fast", cron=EVERY_FIVE_SECONDS, every=""))
        assert not form.is_valid()
        [error] = form.errors["cron"]
    assert "sechs Felder" in error, error


# -- six fields stored before: they go on firing, and W006 names them -----------------------


def test_a_stored_six_field_schedule_fires_every_five_seconds_as_before() -> None:
    stored_by_an_earlier_version("legacy", EVERY_FIVE_SECONDS, at(2026, 1, 1))
    fired = fire_due(at(2026, 1, 1, 0, 0, 12))
    # Without catch_up, the newest slot passed; the next one five seconds on.
    assert [r.start_key for r in fired.runs] == [slot_key("legacy", at(2026, 1, 1, 0, 0, 10))]
    row = AgentSchedule.objects.get(name="legacy")
    assert (row.broken, row.next_slot) == ("", at(2026, 1, 1, 0, 0, 15))


def test_w006_names_the_stored_six_field_schedules_and_says_to_resave_them() -> None:
    stored_by_an_earlier_version("legacy-b", EVERY_FIVE_SECONDS, at(2026, 1, 1))
    stored_by_an_earlier_version("legacy-a", "0 */10 * * * *", at(2026, 1, 1))
    schedule("five", "tester", "Work.", cron="0 6 * * *")
    schedule("macro", "tester", "Work.", cron="@daily")
    schedule("interval", "tester", "Work.", every=dt.timedelta(minutes=5))
    [warning] = w006(databases=["default"])
    assert warning.level == checks.WARNING
    assert "2 schedule(s)" in warning.msg
    assert "'legacy-a', 'legacy-b'" in warning.msg
    for sound in ("five", "macro", "interval"):
        assert repr(sound) not in warning.msg
    assert warning.hint is not None
    assert "five fields" in warning.hint
    assert "Save each again" in warning.hint
    # It reads the database: only when asked to (check --database, migrate).
    assert w006() == []


def test_w006_is_quiet_without_six_field_schedules() -> None:
    schedule("five", "tester", "Work.", cron="*/5 * * * *")
    assert w006(databases=["default"]) == []


# -- macros -------------------------------------------------------------------------------

MACROS = [
    ("@hourly", "0 * * * *"),
    ("@daily", "0 0 * * *"),
    ("@midnight", "0 0 * * *"),
    ("@weekly", "0 0 * * 0"),
    ("@monthly", "0 0 1 * *"),
    ("@yearly", "0 0 1 1 *"),
    ("@annually", "0 0 1 1 *"),
]


@pytest.mark.parametrize(("macro", "fields"), MACROS)
def test_a_macro_is_kept_as_written_and_slots_like_its_five_fields(macro: str, fields: str) -> None:
    schedule("macro", "tester", "Work.", cron=macro, timezone="Europe/Berlin")
    row = AgentSchedule.objects.get(name="macro")
    assert row.cron == macro  # what the admin shows is what was written
    spelt_out = AgentSchedule(cron=fields, timezone="Europe/Berlin")
    # Across the spring-forward night in Berlin, the turn of a month and of a year.
    assert slots_after(row, at(2026, 3, 27, 23, 30)) == slots_after(
        spelt_out, at(2026, 3, 27, 23, 30)
    )


def slots_after(row: AgentSchedule, after: dt.datetime, count: int = 5) -> list[dt.datetime]:
    slots: list[dt.datetime] = []
    for _ in range(count):
        slot = next_slot(row, slots[-1] if slots else after)
        assert slot is not None
        slots.append(slot)
    return slots


def test_a_macro_is_read_whatever_its_case_and_spaces() -> None:
    schedule("macro", "tester", "Work.", cron=" @Daily ")
    assert next_slot(AgentSchedule.objects.get(name="macro"), at(2026, 1, 1, 6)) == at(2026, 1, 2)


def test_a_macro_schedule_fires_and_catches_up_like_its_five_fields() -> None:
    schedule("hourly", "tester", "Work.", cron="@hourly")
    AgentSchedule.objects.update(next_slot=at(2026, 1, 1))
    # An outage of five and a half hours: without catch_up, the newest slot only.
    fired = fire_due(at(2026, 1, 1, 5, 30))
    assert [r.start_key for r in fired.runs] == [slot_key("hourly", at(2026, 1, 1, 5))]
    row = AgentSchedule.objects.get(name="hourly")
    assert (row.broken, row.next_slot) == ("", at(2026, 1, 1, 6))


@pytest.mark.parametrize("cron", ["@reboot", "@every 5m", "@fortnightly"])
def test_an_unknown_macro_is_refused_with_the_known_ones(cron: str) -> None:
    with pytest.raises(CronExpressionError, match="@hourly, @daily") as excinfo:
        schedule("report", "tester", "Work.", cron=cron)
    assert repr(cron) in str(excinfo.value)
    assert not AgentSchedule.objects.exists()


def test_the_admin_form_takes_a_macro(admin_client: Client) -> None:
    url = reverse("admin:durable_agents_agentschedule_add")
    response = admin_client.post(url, form_data(name="nightly", cron="@daily", every=""))
    assert response.status_code == 302, response.context["adminform"].form.errors
    row = AgentSchedule.objects.get(name="nightly")
    assert row.cron == "@daily"
    assert row.next_slot is not None
    assert (row.next_slot.hour, row.next_slot.minute) == (0, 0)
