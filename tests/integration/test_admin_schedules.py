"""Schedules in the admin: the list (state, timing, slots, the last slot's run) and its filters,
the change form and its errors, pause / resume / run now (permissions, CSRF, the audit
trail), broken schedules, hostile text, and the operations page's schedules panel."""

from __future__ import annotations

import datetime
from typing import Any

import pytest
from django.contrib.admin.models import ADDITION, CHANGE, LogEntry
from django.contrib.auth.models import Permission
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from durable_agents.api import start_run
from durable_agents.models import AgentRun, AgentSchedule, RunStatus, short_id
from durable_agents.schedules import defining as schedules
from tests.integration.test_admin import ESCAPED, SCRIPT, messages_of

pytestmark = pytest.mark.django_db

FIVE_MINUTES = datetime.timedelta(minutes=5)


def make(name: str, agent: str = "tester", **fields: Any) -> AgentSchedule:
    """A schedule row as ``schedule()`` or a worker leaves it (every five minutes unless a
    cron expression is given)."""
    if "cron" not in fields:
        fields.setdefault("every", FIVE_MINUTES)
    fields.setdefault("task", f"The task of {name}.")
    row = AgentSchedule(name=name, agent=agent, **fields)
    if row.next_slot is None and "next_slot" not in fields:
        row.next_slot = schedules.next_slot(row, timezone.now())
    row.save()
    return row


def list_url(query: str = "") -> str:
    return reverse("admin:durable_agents_agentschedule_changelist") + query


def page_url(row: AgentSchedule, view: str = "change") -> str:
    return reverse(f"admin:durable_agents_agentschedule_{view}", args=[row.pk])


def run_url(run_id: Any) -> str:
    return reverse("admin:durable_agents_agentrun_change", args=[run_id])


def listed(client: Client, query: str = "") -> list[str]:
    response = client.get(list_url(query))
    assert response.status_code == 200
    return [row.name for row in response.context["cl"].result_list]


def staff_client(django_user_model: Any, *codenames: str, csrf: bool = False) -> Client:
    user = django_user_model.objects.create_user(
        "-".join(codenames) or "staff", password="pw", is_staff=True
    )
    user.user_permissions.add(*Permission.objects.filter(codename__in=codenames))
    client = Client(enforce_csrf_checks=csrf)
    client.force_login(user)
    return client


def form_data(row: AgentSchedule | None = None, **changes: Any) -> dict[str, Any]:
    """What the change form posts for ``row`` (or for a new schedule), with ``changes``."""
    data: dict[str, Any] = {
        "agent": "tester",
        "task": "Summarise yesterday's orders.",
        "cron": "",
        "every": "00:05:00",
        "timezone": "UTC",
        "priority": "0",
        "concurrency_key": "",
        "enabled": "on",
    }
    if row is not None:
        data.update(
            agent=row.agent,
            task=row.task,
            cron=row.cron,
            every="" if row.every is None else str(row.every),
            timezone=row.timezone,
            priority=str(row.priority),
            concurrency_key=row.concurrency_key or "",
        )
        if not row.enabled:
            del data["enabled"]
        if row.catch_up:
            data["catch_up"] = "on"
    data.update(changes)
    return {key: value for key, value in data.items() if value is not None}


# -- the list ---------------------------------------------------------------------------------


def test_the_list_shows_timing_state_slots_and_the_last_run(admin_client: Client) -> None:
    run = start_run("tester", "Report.")
    AgentRun.objects.filter(pk=run.pk).update(status=RunStatus.FAILED)
    slot = timezone.now() - datetime.timedelta(hours=1)
    make("nightly", cron="0 6 * * *", timezone="Europe/Berlin", last_slot=slot, last_run=run)
    make("often")
    make("resting", enabled=False)
    make("vanished", broken="agent 'reporter' is not registered since the deploy")
    make("ghostly", agent="ghost")
    response = admin_client.get(list_url())
    assert response.status_code == 200
    content = response.content.decode()
    assert "<code>0 6 * * *</code> (Europe/Berlin)" in content
    assert "every 5 min" in content
    assert f'<a href="{run_url(run.pk)}">{short_id(run.pk)}</a>' in content
    assert ">Failed<" in content  # the last run's status, read in the same query
    page = admin_client.get(page_url(AgentSchedule.objects.get(name="nightly"))).content.decode()
    assert f'<a href="{run_url(run.pk)}">{short_id(run.pk)}</a>' in page
    assert ">Failed<" in page
    states = {
        row.name: response.context["cl"].model_admin.state(row)
        for row in response.context["cl"].result_list
    }
    assert ">active<" in states["nightly"]
    assert ">active<" in states["often"]
    assert ">paused<" in states["resting"]
    assert ">broken<" in states["vanished"]
    assert "agent &#x27;reporter&#x27; is not registered since the deploy" in states["vanished"]
    # Detected by the admin itself: no worker has recorded it yet.
    assert ">broken<" in states["ghostly"]
    assert "no agent named “ghost” is registered" in states["ghostly"]


def test_the_next_slot_is_shown_only_for_a_schedule_that_fires(admin_client: Client) -> None:
    slot = timezone.now() + datetime.timedelta(minutes=3)
    active = make("active", next_slot=slot)
    make("resting", enabled=False, next_slot=slot)
    response = admin_client.get(list_url())
    admin_object = response.context["cl"].model_admin
    rows = {row.name: row for row in response.context["cl"].result_list}
    assert admin_object.next_slot_shown(rows["active"]) == timezone.localtime(
        active.next_slot
    ).strftime("%Y-%m-%d %H:%M:%S")
    assert admin_object.next_slot_shown(rows["resting"]) == "-"


def test_the_list_filters_by_state_and_agent_and_searches_names(admin_client: Client) -> None:
    make("a-active")
    make("b-paused", enabled=False)
    make("c-broken", broken="gone")
    make("d-ghost", agent="ghost")
    make("e-paused-and-broken", enabled=False, broken="gone")
    make("f-thinking", agent="thinker")
    assert listed(admin_client, "?state=active") == ["a-active", "f-thinking"]
    assert listed(admin_client, "?state=paused") == ["b-paused"]
    assert listed(admin_client, "?state=broken") == ["c-broken", "d-ghost", "e-paused-and-broken"]
    assert listed(admin_client, "?agent=thinker") == ["f-thinking"]
    assert listed(admin_client, "?q=paused") == ["b-paused", "e-paused-and-broken"]
    assert listed(admin_client, "?q=paused&state=broken") == ["e-paused-and-broken"]


def test_the_list_reads_the_same_queries_for_many_schedules(admin_client: Client) -> None:
    def count() -> int:
        with CaptureQueriesContext(connection) as ctx:
            assert admin_client.get(list_url()).status_code == 200
        return len(ctx)

    for i in range(3):
        make(f"s{i}", last_run=start_run("tester", "x"), last_slot=timezone.now())
    few = count()
    for i in range(3, 60):
        make(f"s{i}", last_run=start_run("tester", "x"), last_slot=timezone.now())
        make(f"t{i}", enabled=False, broken="gone" if i % 2 else "")
    assert count() == few


# -- the change form --------------------------------------------------------------------------


def test_retiming_a_schedule_moves_its_next_slot_and_clears_broken(
    admin_client: Client, superuser: Any
) -> None:
    stale = timezone.now() - datetime.timedelta(days=3)
    row = make("nightly", cron="0 6 * * *", next_slot=stale, broken="agent gone")
    page = admin_client.get(page_url(row))
    assert page.status_code == 200
    assert 'id="schedule-broken"' in page.content.decode()
    before = timezone.now()
    response = admin_client.post(
        page_url(row), form_data(row, cron="30 7 * * 1", timezone="Europe/Berlin")
    )
    assert response.status_code == 302, response.context["adminform"].form.errors
    row.refresh_from_db()
    assert (row.cron, row.timezone, row.broken) == ("30 7 * * 1", "Europe/Berlin", "")
    assert row.next_slot is not None
    assert row.next_slot > before
    local = row.next_slot.astimezone(schedules.time_zone("Europe/Berlin"))
    assert (local.weekday(), local.hour, local.minute) == (0, 7, 30)
    entry = LogEntry.objects.get(object_id=str(row.pk))
    assert (entry.action_flag, entry.user_id) == (CHANGE, superuser.pk)
    assert 'id="schedule-broken"' not in admin_client.get(page_url(row)).content.decode()


def test_changing_only_the_task_keeps_the_next_slot(admin_client: Client) -> None:
    slot = timezone.now() + datetime.timedelta(minutes=2)
    row = make("often", next_slot=slot)
    response = admin_client.post(page_url(row), form_data(row, task="A new task."))
    assert response.status_code == 302
    row.refresh_from_db()
    assert (row.task, row.next_slot) == ("A new task.", slot)


def test_enabling_a_paused_schedule_in_the_form_moves_its_next_slot(admin_client: Client) -> None:
    stale = timezone.now() - datetime.timedelta(days=1)
    row = make("resting", enabled=False, next_slot=stale)
    response = admin_client.post(page_url(row), form_data(row, enabled="on"))
    assert response.status_code == 302
    row.refresh_from_db()
    assert row.enabled
    assert row.next_slot is not None
    assert row.next_slot > timezone.now()


BAD_INPUTS = [
    ({"cron": "every morning", "every": ""}, "cron"),
    ({"cron": "0 6 31 2 *", "every": ""}, "cron"),  # 31 February never comes
    ({"cron": "0 6 * * *", "every": "", "timezone": "Mars/Olympus_Mons"}, "timezone"),
    ({"timezone": ""}, "timezone"),
    ({"every": "0"}, "every"),
    ({"every": "-00:05:00"}, "every"),
    ({"every": "soon"}, "every"),
    ({"cron": "0 6 * * *", "every": "00:05:00"}, "cron"),  # both
    ({"cron": "", "every": ""}, "cron"),  # neither
    ({"agent": "ghost"}, "agent"),
    ({"task": ""}, "task"),
    ({"task": "   "}, "task"),
    ({"priority": "1000000"}, "priority"),
    ({"concurrency_key": "k" * 201}, "concurrency_key"),
]


@pytest.mark.parametrize(("changes", "field"), BAD_INPUTS, ids=[str(c) for c, _ in BAD_INPUTS])
def test_bad_input_is_a_form_error_and_changes_nothing(
    admin_client: Client, changes: dict[str, str], field: str
) -> None:
    row = make("nightly", cron="0 6 * * *")
    before = AgentSchedule.objects.values().get(pk=row.pk)
    response = admin_client.post(page_url(row), form_data(row, **changes))
    assert response.status_code == 200
    errors = response.context["adminform"].form.errors
    assert field in errors, errors
    assert "errornote" in response.content.decode()
    assert AgentSchedule.objects.values().get(pk=row.pk) == before
    assert not LogEntry.objects.exists()


def test_adding_a_schedule_needs_the_add_permission(
    admin_client: Client, superuser: Any, django_user_model: Any
) -> None:
    add_url = reverse("admin:durable_agents_agentschedule_add")
    assert admin_client.get(add_url).status_code == 200
    before = timezone.now()
    response = admin_client.post(add_url, form_data(name="every-five", every="00:05:00"))
    assert response.status_code == 302
    row = AgentSchedule.objects.get(name="every-five")
    assert row.every == FIVE_MINUTES
    assert row.broken == ""
    assert row.next_slot is not None
    assert before < row.next_slot <= before + FIVE_MINUTES
    entry = LogEntry.objects.get(object_id=str(row.pk))
    assert (entry.action_flag, entry.user_id) == (ADDITION, superuser.pk)
    # The name is taken; and a name is what code declares a schedule by: read-only once added.
    again = admin_client.post(add_url, form_data(name="every-five"))
    assert again.status_code == 200
    assert "name" in again.context["adminform"].form.errors
    response = admin_client.post(page_url(row), form_data(row, name="renamed"))
    assert response.status_code == 302
    assert AgentSchedule.objects.filter(name="renamed").count() == 0
    viewer = staff_client(django_user_model, "view_agentschedule", "change_agentschedule")
    assert viewer.get(add_url).status_code == 403
    assert viewer.post(add_url, form_data(name="sneaky")).status_code == 403
    assert not AgentSchedule.objects.filter(name="sneaky").exists()


def test_a_viewer_cannot_save_the_form(django_user_model: Any) -> None:
    row = make("nightly")
    viewer = staff_client(django_user_model, "view_agentschedule")
    assert viewer.get(page_url(row)).status_code == 200
    assert viewer.post(page_url(row), form_data(row, task="Changed.")).status_code == 403
    row.refresh_from_db()
    assert row.task == "The task of nightly."


# -- pause, resume, run now --------------------------------------------------------------------


def test_pause_and_resume_from_the_page_are_audited(admin_client: Client, superuser: Any) -> None:
    stale = timezone.now() - datetime.timedelta(days=2)
    row = make("often", next_slot=stale)
    page = admin_client.get(page_url(row)).content.decode()
    assert 'id="schedule-pause"' in page
    assert 'id="schedule-resume"' not in page
    response = admin_client.post(page_url(row, "pause"), follow=True)
    assert "Paused schedule “often”." in messages_of(response)
    row.refresh_from_db()
    assert not row.enabled
    assert row.next_slot == stale
    page = admin_client.get(page_url(row)).content.decode()
    assert 'id="schedule-resume"' in page
    assert 'id="schedule-pause"' not in page
    before = timezone.now()
    response = admin_client.post(page_url(row, "resume"), follow=True)
    assert "Resumed schedule “often”." in messages_of(response)
    row.refresh_from_db()
    # The slots missed while paused are not run: the next one is the first after now.
    assert row.enabled
    assert row.next_slot is not None
    assert before < row.next_slot <= before + FIVE_MINUTES
    logged = list(
        LogEntry.objects.filter(object_id=str(row.pk))
        .order_by("pk")
        .values_list("user_id", "action_flag", "change_message")
    )
    assert [entry[:2] for entry in logged] == [(superuser.pk, CHANGE)] * 2
    assert logged[0][2] == "Paused from the admin."
    assert logged[1][2].startswith("Resumed from the admin; next slot ")
    # Again: nothing to do, nothing logged.
    response = admin_client.post(page_url(row, "resume"), follow=True)
    assert "Nothing changed: schedule “often” is already running." in messages_of(response)
    assert LogEntry.objects.count() == 2
    assert admin_client.get(page_url(row, "pause")).status_code == 405  # POST only


def test_run_now_starts_a_run_and_links_it(admin_client: Client, superuser: Any) -> None:
    row = make("nightly", cron="0 6 * * *", priority=7, concurrency_key="tenant:a")
    slot = row.next_slot
    response = admin_client.post(page_url(row, "run_now"), follow=True)
    run = AgentRun.objects.get()
    assert (run.agent, run.task, run.priority, run.concurrency_key) == (
        "tester",
        "The task of nightly.",
        7,
        "tenant:a",
    )
    (message,) = messages_of(response)
    assert f'<a href="{run_url(run.pk)}" class="da-started-run">{run.pk}</a>' in message
    assert f'href="{run_url(run.pk)}"' in response.content.decode()
    row.refresh_from_db()
    assert row.next_slot == slot  # its slots do not change
    entry = LogEntry.objects.get(object_id=str(row.pk))
    assert (entry.user_id, entry.change_message) == (
        superuser.pk,
        f"Run now from the admin: started run {run.pk}.",
    )


def test_the_buttons_need_their_permissions(django_user_model: Any) -> None:
    row = make("often")
    viewer = staff_client(django_user_model, "view_agentschedule")
    page = viewer.get(page_url(row)).content.decode()
    assert 'id="schedule-operations"' not in page
    for view in ("pause", "resume", "run_now"):
        assert viewer.post(page_url(row, view)).status_code == 403
    # May change (pause and resume) but not start runs.
    changer = staff_client(django_user_model, "view_agentschedule", "change_agentschedule")
    page = changer.get(page_url(row)).content.decode()
    assert 'id="schedule-pause"' in page
    assert 'id="schedule-run-now"' not in page
    assert changer.post(page_url(row, "run_now")).status_code == 403
    assert not AgentRun.objects.exists()
    # May start runs but not change.
    runner = staff_client(django_user_model, "view_agentschedule", "run_agentschedule")
    page = runner.get(page_url(row)).content.decode()
    assert 'id="schedule-run-now"' in page
    assert 'id="schedule-pause"' not in page
    assert runner.post(page_url(row, "pause")).status_code == 403
    row.refresh_from_db()
    assert row.enabled
    assert runner.post(page_url(row, "run_now")).status_code == 302
    assert AgentRun.objects.count() == 1
    assert changer.post(page_url(row, "pause")).status_code == 302
    row.refresh_from_db()
    assert not row.enabled


def test_every_change_needs_its_csrf_token(superuser: Any) -> None:
    row = make("often")
    client = Client(enforce_csrf_checks=True)
    client.force_login(superuser)
    for view in ("pause", "run_now"):
        assert client.post(page_url(row, view)).status_code == 403
    assert client.post(page_url(row), form_data(row, task="Changed.")).status_code == 403
    actions = {"action": "pause_schedules", "_selected_action": [str(row.pk)]}
    assert client.post(list_url(), actions).status_code == 403
    row.refresh_from_db()
    assert (row.enabled, row.task) == (True, "The task of often.")
    assert not AgentRun.objects.exists()
    assert not LogEntry.objects.exists()
    # With the page's token, the same POST goes through.
    page = client.get(page_url(row))
    token = {"csrfmiddlewaretoken": str(page.context["csrf_token"])}
    assert client.post(page_url(row, "pause"), token).status_code == 302
    row.refresh_from_db()
    assert not row.enabled


def test_the_list_actions_pause_resume_and_run_now(admin_client: Client, superuser: Any) -> None:
    rows = [make("a"), make("b"), make("c", enabled=False, next_slot=timezone.now())]
    ids = [str(row.pk) for row in rows]
    response = admin_client.post(
        list_url(), {"action": "pause_schedules", "_selected_action": ids}, follow=True
    )
    assert "Paused 2 schedule(s)." in messages_of(response)
    assert not AgentSchedule.objects.filter(enabled=True).exists()
    response = admin_client.post(
        list_url(), {"action": "resume_schedules", "_selected_action": ids[:2]}, follow=True
    )
    assert "Resumed 2 schedule(s)." in messages_of(response)
    assert sorted(AgentSchedule.objects.filter(enabled=True).values_list("name", flat=True)) == [
        "a",
        "b",
    ]
    assert LogEntry.objects.filter(user=superuser).count() == 4
    # Run now: a confirmation lists the schedules; its "Yes" starts one run each.
    confirm = admin_client.post(
        list_url(), {"action": "run_schedules_now", "_selected_action": ids[1:]}
    )
    assert confirm.status_code == 200
    assert not AgentRun.objects.exists()
    assert "<strong>2</strong> agent schedules will change" in confirm.content.decode()
    response = admin_client.post(
        list_url(),
        {"action": "run_schedules_now", "_selected_action": ids[1:], "post": "yes"},
        follow=True,
    )
    assert sorted(AgentRun.objects.values_list("task", flat=True)) == [
        "The task of b.",
        "The task of c.",
    ]
    assert "Started 2 run(s)." in messages_of(response)
    assert LogEntry.objects.filter(change_message__startswith="Run now").count() == 2


def test_the_list_actions_need_their_permissions(django_user_model: Any) -> None:
    row = make("a")
    viewer = staff_client(django_user_model, "view_agentschedule")
    response = viewer.get(list_url())
    assert response.status_code == 200
    assert "pause_schedules" not in response.content.decode()
    assert "run_schedules_now" not in response.content.decode()
    for action in ("pause_schedules", "run_schedules_now"):
        forged = {"action": action, "_selected_action": [str(row.pk)], "post": "yes"}
        viewer.post(list_url(), forged)
    changer = staff_client(django_user_model, "view_agentschedule", "change_agentschedule")
    content = changer.get(list_url()).content.decode()
    assert "pause_schedules" in content
    assert "run_schedules_now" not in content
    forged = {"action": "run_schedules_now", "_selected_action": [str(row.pk)], "post": "yes"}
    changer.post(list_url(), forged)
    row.refresh_from_db()
    assert row.enabled
    assert not AgentRun.objects.exists()
    assert not LogEntry.objects.exists()


# -- broken schedules and hostile text ---------------------------------------------------------


def test_a_broken_schedule_says_why_and_run_now_starts_nothing(admin_client: Client) -> None:
    row = make("ghostly", agent="ghost")
    page = admin_client.get(page_url(row))
    content = page.content.decode()
    assert "This schedule is broken and starts nothing: no agent named “ghost” is registered" in (
        content
    )
    assert "ghost (not registered)" in content  # listed, not replaced by another agent
    response = admin_client.post(page_url(row, "run_now"), follow=True)
    (message,) = messages_of(response)
    assert message.startswith("No run was started for schedule “ghostly”")
    assert not AgentRun.objects.exists()
    assert not LogEntry.objects.exists()
    # Resuming a broken schedule says it stays broken.
    AgentSchedule.objects.filter(pk=row.pk).update(enabled=False)
    response = admin_client.post(page_url(row, "resume"), follow=True)
    assert any("is still broken" in m for m in messages_of(response))
    # Saved with a registered agent, it is sound again.
    assert admin_client.post(page_url(row), form_data(row, agent="tester")).status_code == 302
    assert listed(admin_client, "?state=active") == ["ghostly"]


def test_hostile_names_and_tasks_are_escaped(admin_client: Client) -> None:
    run = start_run("tester", "x")
    AgentRun.objects.filter(pk=run.pk).update(status=RunStatus.DEAD)
    row = make(SCRIPT, task=f"{SCRIPT} do it", broken=f"{SCRIPT} vanished", last_run=run)
    pages = [
        admin_client.get(list_url()),
        admin_client.get(page_url(row)),
        admin_client.post(page_url(row, "pause"), follow=True),
        admin_client.post(page_url(row, "run_now"), follow=True),
        admin_client.get(reverse("admin:durable_agents_agentrun_operations")),
    ]
    for page in pages:
        assert page.status_code == 200
        content = page.content.decode()
        assert SCRIPT not in content
        assert ESCAPED in content


# -- the operations page -----------------------------------------------------------------------


def operations(client: Client) -> Any:
    response = client.get(reverse("admin:durable_agents_agentrun_operations"))
    assert response.status_code == 200
    return response


def test_the_operations_page_lists_next_slots_and_schedules_in_trouble(
    admin_client: Client,
) -> None:
    now = timezone.now()
    for i in range(12):
        make(f"slot-{i:02}", next_slot=now + datetime.timedelta(minutes=12 - i))
    make("resting", enabled=False, next_slot=now)
    make("vanished", broken="agent gone", next_slot=now)
    make("ghostly", agent="ghost", next_slot=now)
    failed, dead, fine = (start_run("tester", t) for t in ("f", "d", "s"))
    AgentRun.objects.filter(pk=failed.pk).update(status=RunStatus.FAILED)
    AgentRun.objects.filter(pk=dead.pk).update(status=RunStatus.DEAD)
    make("failing", last_run=failed, last_slot=now, next_slot=now + datetime.timedelta(hours=1))
    make("dying", last_run=dead, last_slot=now, next_slot=now + datetime.timedelta(hours=1))
    make("fine", last_run=fine, last_slot=now, next_slot=now + datetime.timedelta(hours=1))
    response = operations(admin_client)
    panel = response.context["schedules"]
    # The ten next slots of enabled, sound schedules, soonest first.
    assert [row.name for row, _ in panel.upcoming] == [f"slot-{i:02}" for i in range(11, 1, -1)]
    trouble = {row.name: reason for row, reason in panel.troubled}
    assert trouble == {
        "dying": "its last run is dead",
        "failing": "its last run is failed",
        "ghostly": "no agent named “ghost” is registered",
        "vanished": "agent gone",
    }
    content = response.content.decode()
    schedule = AgentSchedule.objects.get(name="failing")
    assert page_url(schedule) in content
    assert run_url(failed.pk) in content
    assert "every 5 min" in content


def test_the_operations_page_without_schedules(admin_client: Client) -> None:
    content = operations(admin_client).content.decode()
    assert "No schedule fires: none is enabled and sound." in content
    assert "None: no schedule is broken, and no last run failed or died." in content


def test_the_schedules_panel_reads_the_same_queries_for_many_schedules(
    admin_client: Client,
) -> None:
    def count() -> int:
        with CaptureQueriesContext(connection) as ctx:
            operations(admin_client)
        return len(ctx)

    def add(label: str) -> None:
        failed = start_run("tester", label)
        AgentRun.objects.filter(pk=failed.pk).update(status=RunStatus.FAILED)
        make(f"{label}-ok")
        make(f"{label}-failing", last_run=failed)
        make(f"{label}-broken", broken="gone")

    add("a")
    few = count()
    for label in "bcdefghijklmnopqrstuvwxyz":
        add(label)
    assert count() == few
    panel = operations(admin_client).context["schedules"]
    assert len(panel.troubled) == 20
    assert panel.more_troubled
    assert "?state=broken" in operations(admin_client).content.decode()


def test_the_schedules_panel_is_for_whoever_may_see_schedules(django_user_model: Any) -> None:
    make("nightly", broken="agent gone")
    runs_only = staff_client(django_user_model, "view_agentrun")
    response = operations(runs_only)
    assert response.context["schedules"] is None
    assert 'id="schedules"' not in response.content.decode()
    both = staff_client(django_user_model, "view_agentrun", "view_agentschedule")
    assert 'id="schedules"' in operations(both).content.decode()


def test_a_schedule_whose_timing_no_longer_reads_is_not_resumed(admin_client: Client) -> None:
    # Written by hand (or its zone gone from the tz database): resuming it says why, no 500.
    row = make("odd", cron="0 6 * * *", timezone="Mars/Olympus_Mons", enabled=False, next_slot=None)
    response = admin_client.post(page_url(row, "resume"), follow=True)
    assert response.status_code == 200
    (message,) = messages_of(response)
    assert message.startswith("Schedule “odd” was not resumed: its timing cannot be read")
    response = admin_client.post(
        list_url(), {"action": "resume_schedules", "_selected_action": [str(row.pk)]}, follow=True
    )
    assert any("was not resumed" in m for m in messages_of(response))
    row.refresh_from_db()
    assert not row.enabled
    assert not LogEntry.objects.exists()
    assert admin_client.get(page_url(row)).status_code == 200
