"""The admin: read-only pages, actions and decision views that change state only through the
api, permissions, CSRF, escaping of untrusted text and bounded query counts."""

from __future__ import annotations

import datetime
import json
import re
import uuid
from typing import Any

import pytest
from django.contrib.admin.models import CHANGE, LogEntry
from django.contrib.auth.models import Permission
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone
from django.utils.html import escape

import durable_agents
from durable_agents import api, store
from durable_agents.housekeeping import sweeps as housekeeping
from durable_agents.models import (
    AgentRun,
    AgentStep,
    IntentStatus,
    RunStatus,
    StepKind,
    ToolEffect,
    ToolIntent,
    new_run_id,
    short_id,
)
from tests.conftest import run_worker
from tests.integration.conftest import written_intent

SCRIPT = "<script>alert(1)</script>"
ESCAPED = "&lt;script&gt;alert(1)&lt;/script&gt;"
DROP_TASK = 'Drop the old table.\n@drop_table {"table": "t1"}'


def runs_url(suffix: str = "") -> str:
    return reverse("admin:durable_agents_agentrun_changelist") + suffix


def run_url(run: AgentRun) -> str:
    return reverse("admin:durable_agents_agentrun_change", args=[run.pk])


def intent_url(intent: ToolIntent, view: str = "change") -> str:
    return reverse(f"admin:durable_agents_toolintent_{view}", args=[intent.pk])


def intents_url() -> str:
    return reverse("admin:durable_agents_toolintent_changelist")


@pytest.fixture
def viewer(django_user_model: Any) -> Any:
    """Staff who may look at runs and intents but neither operate nor decide."""
    user = django_user_model.objects.create_user("viewer", password="pw", is_staff=True)
    user.user_permissions.add(
        *Permission.objects.filter(codename__in=["view_agentrun", "view_toolintent"])
    )
    return django_user_model.objects.get(pk=user.pk)


@pytest.fixture
def viewer_client(viewer: Any) -> Client:
    client = Client()
    client.force_login(viewer)
    return client


def waiting_run(task: str = DROP_TASK, agent: str = "tester") -> tuple[AgentRun, ToolIntent]:
    """A run parked on a pending drop_table intent, reached by a real worker."""
    run = durable_agents.start_run(agent, task)
    run_worker()
    run.refresh_from_db()
    assert run.status == RunStatus.WAITING, run.error
    return run, ToolIntent.objects.get(run=run)


def parked_intent(status: str = IntentStatus.PENDING, table: str = "t1") -> ToolIntent:
    """A run and an intent written directly (no worker): for tests that only read or decide."""
    return written_intent(
        f'Drop.\n@drop_table {{"table": "{table}"}}',
        "drop_table",
        {"table": table},
        says="I will drop the table.",
        status=status,
    )


def make_runs(count: int, status: str = RunStatus.SUCCEEDED, error: str = "") -> list[AgentRun]:
    runs = [durable_agents.start_run("tester", f"task {i}") for i in range(count)]
    if status == RunStatus.DEAD:  # through the store, which also stores the cause
        for run in runs:
            assert store.current().dead_letter(run.pk, error)
        return runs
    AgentRun.objects.filter(pk__in=[r.pk for r in runs]).update(status=status, error=error)
    return runs


def messages_of(response: Any) -> list[str]:
    return [str(m) for m in response.context["messages"]] if response.context else []


HIDDEN_INPUT = re.compile(r'<input type="hidden" name="([^"]+)" value="([^"]*)">')


def hidden_fields(response: Any) -> dict[str, list[str]]:
    """The hidden inputs of a confirmation page (csrf token aside): what its "Yes" posts."""
    fields: dict[str, list[str]] = {}
    for name, value in HIDDEN_INPUT.findall(response.content.decode()):
        if name != "csrfmiddlewaretoken":
            fields.setdefault(name, []).append(value)
    return fields


def approve(client: Client, intent: ToolIntent, follow: bool = False) -> Any:
    """Approve as a person does: open the confirmation page, post what it shows."""
    page = client.get(intent_url(intent, "approve"))
    assert page.status_code == 200
    return client.post(intent_url(intent, "approve"), hidden_fields(page), follow=follow)


# ---------------------------------------------------------------------------------------------
# Pages


@pytest.mark.django_db
def test_app_index_links_operations_and_dead_letter(admin_client: Client) -> None:
    response = admin_client.get(reverse("admin:app_list", args=["durable_agents"]))
    assert response.status_code == 200
    content = response.content.decode()
    assert reverse("admin:durable_agents_agentrun_operations") in content
    assert reverse("admin:durable_agents_agentrun_dead_letter") in content


@pytest.mark.django_db
@pytest.mark.parametrize("index", ["admin:index", "durable_agents"])
def test_the_admin_index_lists_operations_and_dead_letter(admin_client: Client, index: str) -> None:
    url = reverse(index) if index == "admin:index" else reverse("admin:app_list", args=[index])
    content = admin_client.get(url).content.decode()
    for page in ("operations", "dead_letter"):
        entry = reverse(f"admin:durable_agents_{page.replace('_', '')}entry_changelist")
        assert f'href="{entry}"' in content
        followed = admin_client.get(entry)
        assert followed.status_code == 302
        assert followed["Location"] == reverse(f"admin:durable_agents_agentrun_{page}")


@pytest.mark.django_db
def test_the_index_entries_follow_the_runs_view_permission(client: Client) -> None:
    from django.contrib.auth.models import Permission, User

    staff = User.objects.create_user("clerk", is_staff=True)
    staff.user_permissions.add(Permission.objects.get(codename="view_toolintent"))
    client.force_login(staff)
    assert "operationsentry" not in client.get(reverse("admin:index")).content.decode()
    staff.user_permissions.add(Permission.objects.get(codename="view_agentrun"))
    staff = User.objects.get(pk=staff.pk)
    client.force_login(staff)
    content = client.get(reverse("admin:index")).content.decode()
    assert reverse("admin:durable_agents_operationsentry_changelist") in content


@pytest.mark.django_db
def test_run_list_columns_and_filters(admin_client: Client) -> None:
    run = durable_agents.start_run("tester", "first line of the task\nsecond line")
    AgentRun.objects.filter(pk=run.pk).update(
        last_seq=4,
        attempt=2,
        error="boom " + "x" * 200,
        lease_owner="host-1:4242:abc",
        lease_until=timezone.now() + datetime.timedelta(minutes=5),
    )
    response = admin_client.get(runs_url("?status__exact=pending&agent=tester"))
    assert response.status_code == 200
    content = response.content.decode()
    assert 'class="da-badge"' in content
    assert "first line of the task" in content
    assert "second line" not in content
    assert ">5<" in content  # steps = last_seq + 1
    assert ">2<" in content  # claims
    # Short headers; one lease column; the error truncated under the task.
    for header in ("column-claims", "column-lease"):
        assert header in content
    for gone in ("attempt", "lease_owner", "lease_until", "age", "last_error"):
        assert not re.search(rf'column-{gone}[ "]', content), gone
    assert '<span class="da-list-error" title="boom xxx' in content
    assert "boom " + "x" * 54 + "…</span>" in content  # 60 characters
    assert "host-1:<wbr>4242:<wbr>abc" in content
    assert "until " in content
    assert " ago</span>" in content  # the age, under the run id
    AgentRun.objects.filter(pk=run.pk).update(lease_until=timezone.now())
    assert "expired" in admin_client.get(runs_url()).content.decode()


@pytest.mark.django_db
def test_search_by_uuid_request_id_and_task(admin_client: Client) -> None:
    run = durable_agents.start_run("tester", "find the needle")
    other = durable_agents.start_run("tester", f"mentions {run.pk} in its text")
    for seq in (1, 2):
        AgentStep.objects.create(
            run=run, seq=seq, kind=StepKind.MODEL_TURN, payload="{}", request_id=f"req_{seq}"
        )

    def found(query: str) -> list[Any]:
        response = admin_client.get(runs_url(), {"q": query})
        assert response.status_code == 200
        return [r.pk for r in response.context["cl"].result_list]

    assert found(str(run.pk)) == [run.pk]  # exact id, not the run that mentions it
    assert found("req_2") == [run.pk]  # through steps, one row
    assert found("needle") == [run.pk]
    assert found("mentions") == [other.pk]
    assert found("req_404") == []


@pytest.mark.django_db
def test_run_page_shows_the_start_key_when_there_is_one(admin_client: Client) -> None:
    keyed = durable_agents.start_run("tester", "t", key="ticket-<b>7</b>")
    plain = durable_agents.start_run("tester", "t")
    page = admin_client.get(run_url(keyed)).content.decode()
    assert "field-start_key" in page
    assert "ticket-&lt;b&gt;7&lt;/b&gt;" in page  # escaped
    assert "field-start_key" not in admin_client.get(run_url(plain)).content.decode()
    listing = admin_client.get(runs_url()).content.decode()
    assert "start_key" not in listing  # the list keeps its columns
    assert "ticket-&lt;b&gt;" not in listing


@pytest.mark.django_db
def test_the_list_and_the_run_page_show_the_priority(admin_client: Client) -> None:
    run = durable_agents.start_run("tester", "urgent", priority=73)
    listing_page = admin_client.get(runs_url()).content.decode()
    status_cell = re.search(r'<td class="field-status_short">(.*?)</td>', listing_page, re.S)
    assert status_cell
    assert "priority 73" in status_cell.group(1)
    page = admin_client.get(run_url(run)).content.decode()
    assert re.search(r'field-priority">.*?<div class="readonly">73</div>', page, re.S)


@pytest.mark.django_db(transaction=True)
def test_run_page_shows_the_transcript(admin_client: Client) -> None:
    task = 'Look it up.\n@lookup {"key": "k1"} && explode {"message": "kaput"}'
    run = durable_agents.start_run("thinker", task)
    run_worker()
    run.refresh_from_db()
    assert run.status == RunStatus.SUCCEEDED
    turn = AgentStep.objects.get(run=run, seq=1)

    response = admin_client.get(run_url(run))
    assert response.status_code == 200
    content = response.content.decode()
    assert "<details><summary>Thinking</summary>" in content
    assert "Step 1: calling lookup, explode." in content
    assert "{\n  &quot;key&quot;: &quot;k1&quot;\n}" in content  # pretty JSON, escaped
    assert turn.request_id is not None
    assert turn.request_id in content
    assert "stop_reason <strong>tool_use</strong>" in content
    assert "value-of-k1" in content
    assert "explode raised RuntimeError: kaput" in content
    assert 'class="da-error-label">error' in content
    assert "effect recorded" in content
    stored_id = run.pk.hex if connection.vendor == "sqlite" else str(run.pk)
    assert f"FROM agent_step WHERE run_id = &#x27;{stored_id}&#x27; ORDER BY seq;" in content
    assert 'value="Save' not in content  # read-only: no submit row
    assert "Cancel this run" not in content  # finished: no operation applies
    # One time format, for the fields and the transcript.
    created = run.created_at.strftime("%Y-%m-%d %H:%M:%S")
    assert f'<div class="readonly">{created}</div>' in content
    assert turn.created_at.strftime("%Y-%m-%d %H:%M:%S") + "\n" in content
    assert " p.m." not in content
    assert " a.m." not in content
    # The claim count is called so, with what it counts.
    assert ">Claims:</label>" in content
    assert "Attempt:" not in content
    assert "how many times a worker took this run" in content
    # The run's token count, the sum of its turns' usage.
    assert run.tokens_used > 0
    assert ">Tokens used:</label>" in content
    assert f'<div class="readonly">{run.tokens_used}</div>' in content


@pytest.mark.django_db
def test_run_change_form_cannot_be_posted(admin_client: Client) -> None:
    run = durable_agents.start_run("tester", "hands off")
    response = admin_client.post(run_url(run), {"status": "succeeded", "task": "edited"})
    assert response.status_code == 403
    run.refresh_from_db()
    assert (run.status, run.task) == (RunStatus.PENDING, "hands off")


@pytest.mark.django_db
def test_run_cannot_be_deleted(admin_client: Client) -> None:
    run = durable_agents.start_run("tester", "keep me")
    url = reverse("admin:durable_agents_agentrun_delete", args=[run.pk])
    assert admin_client.post(url, {"post": "yes"}).status_code == 403
    assert AgentRun.objects.filter(pk=run.pk).exists()


@pytest.mark.django_db
def test_start_a_run_from_the_admin(admin_client: Client, spy: Any) -> None:
    calls = spy("start_run")
    add_url = reverse("admin:durable_agents_agentrun_add")
    page = admin_client.get(add_url)
    assert page.status_code == 200
    assert "tester @ v1" in page.content.decode()
    response = admin_client.post(
        add_url, {"agent": json.dumps(["tester", "v1"]), "task": "do the thing", "model": ""}
    )
    run = AgentRun.objects.get()
    assert response.status_code == 302
    assert response["Location"] == run_url(run)
    assert (run.agent, run.prompt_version, run.task) == ("tester", "v1", "do the thing")
    assert calls == [("tester", "do the thing")]
    assert AgentStep.objects.filter(run=run, seq=0, kind=StepKind.TASK).exists()


# ---------------------------------------------------------------------------------------------
# Escaping


@pytest.mark.django_db(transaction=True)
def test_untrusted_text_is_escaped_everywhere(admin_client: Client) -> None:
    task = f'{SCRIPT} please\n@lookup {{"key": "{SCRIPT}"}}\n@drop_table {{"table": "{SCRIPT}"}}'
    run, intent = waiting_run(task)
    AgentRun.objects.filter(pk=run.pk).update(
        error=f"{SCRIPT} went wrong", lease_owner=SCRIPT, lease_until=timezone.now()
    )
    assert SCRIPT in ToolEffect.objects.get(run=run).result

    pages = {
        "run page": run_url(run),
        "run list": runs_url(),
        "intent page": intent_url(intent),
        "intent list": intents_url(),
    }
    for name, url in pages.items():
        content = admin_client.get(url).content.decode()
        assert SCRIPT not in content, name
        if name != "intent list":  # the list shows no model or tool text
            assert ESCAPED in content or "&lt;script&gt;" in content, name


# ---------------------------------------------------------------------------------------------
# Intents


@pytest.mark.django_db(transaction=True)
def test_intent_page_shows_call_and_reasoning(admin_client: Client) -> None:
    _, intent = waiting_run(agent="thinker")
    response = admin_client.get(intent_url(intent))
    assert response.status_code == 200
    content = response.content.decode()
    assert "{\n  &quot;table&quot;: &quot;t1&quot;\n}" in content
    assert "the plan says to call drop_table" in content  # thinking
    assert "Step 1: calling drop_table." in content  # the assistant's words
    assert run_url(intent.run) in content
    assert intent_url(intent, "approve") in content
    assert intent_url(intent, "reject") in content


@pytest.mark.django_db(transaction=True)
def test_approve_runs_the_call_once(admin_client: Client, superuser: Any, spy: Any) -> None:
    calls = spy("approve_intent")
    run, intent = waiting_run()
    response = approve(admin_client, intent, follow=True)
    assert response.status_code == 200
    assert any("Approved intent" in m for m in messages_of(response))
    intent.refresh_from_db()
    run.refresh_from_db()
    assert (intent.status, intent.decided_by_id) == (IntentStatus.APPROVED, superuser.pk)
    assert run.status == RunStatus.PENDING
    assert len(calls) == 1
    entry = LogEntry.objects.get(object_id=str(intent.pk))
    assert entry.action_flag == CHANGE
    assert entry.user_id == superuser.pk
    assert "Approved" in entry.get_change_message()

    # A second decision changes nothing and says so.
    again = admin_client.post(intent_url(intent, "reject"), {"reason": "late"}, follow=True)
    assert any("already decided" in m for m in messages_of(again))
    intent.refresh_from_db()
    assert (intent.status, intent.reason) == (IntentStatus.APPROVED, "")
    assert LogEntry.objects.filter(object_id=str(intent.pk)).count() == 1

    run_worker()
    run.refresh_from_db()
    intent.refresh_from_db()
    assert (run.status, intent.status) == (RunStatus.SUCCEEDED, IntentStatus.DONE)

    # The transcript tells the decision (a person's) from the outcome (the worker's).
    content = admin_client.get(run_url(run)).content.decode()
    assert intent.decided_at is not None
    decided = intent.decided_at.strftime("%Y-%m-%d %H:%M:%S")
    assert f"<strong>approved</strong> by boss at {decided} ·" in content
    assert '<span class="da-outcome">done</span>' in content
    assert "Done by" not in content


@pytest.mark.django_db(transaction=True)
def test_reject_with_a_reason_reaches_the_model(admin_client: Client, superuser: Any) -> None:
    run, intent = waiting_run()
    admin_client.post(intent_url(intent, "reject"), {"reason": "not on a Friday"})
    intent.refresh_from_db()
    assert (intent.status, intent.reason) == (IntentStatus.REJECTED, "not on a Friday")
    assert intent.decided_by_id == superuser.pk
    assert "Rejected: not on a Friday" in LogEntry.objects.get().get_change_message()

    run_worker()
    run.refresh_from_db()
    assert run.status == RunStatus.SUCCEEDED
    result = AgentStep.objects.get(run=run, seq=2).data()[0]
    assert result["is_error"] is True
    assert "not on a Friday" in result["content"]
    content = admin_client.get(run_url(run)).content.decode()
    assert "<strong>rejected</strong> by boss at " in content
    assert ': “not on a Friday” · <span class="da-outcome">not run</span>' in content


@pytest.mark.django_db
def test_transcript_sends_a_person_to_undecided_intents(admin_client: Client) -> None:
    intent = parked_intent()
    content = admin_client.get(run_url(intent.run)).content.decode()
    assert "<strong>awaiting a decision</strong>" in content
    assert f'<a href="{intent_url(intent)}">decide it</a>' in content

    ToolIntent.objects.filter(pk=intent.pk).update(status=IntentStatus.UNKNOWN)
    content = admin_client.get(run_url(intent.run)).content.decode()
    assert '<span class="da-outcome">outcome unknown</span>' in content
    assert f'<a href="{intent_url(intent)}">resolve it</a>' in content


@pytest.mark.django_db
def test_resolve_unknown_intent_as_happened(admin_client: Client, spy: Any) -> None:
    calls = spy("resolve_intent")
    intent = parked_intent(IntentStatus.UNKNOWN)
    page = admin_client.get(intent_url(intent)).content.decode()
    assert "It happened" in page
    assert 'value="Approve"' not in page
    admin_client.post(
        intent_url(intent, "resolve"), {"happened": "yes", "result": "dropped by hand"}
    )
    intent.refresh_from_db()
    assert intent.status == IntentStatus.DONE
    assert ToolEffect.objects.get(key=intent.key).result == "dropped by hand"
    assert AgentRun.objects.get(pk=intent.run_id).status == RunStatus.PENDING
    assert len(calls) == 1
    assert "it happened" in LogEntry.objects.get().get_change_message()


@pytest.mark.django_db
def test_resolve_unknown_intent_as_not_happened(admin_client: Client) -> None:
    intent = parked_intent(IntentStatus.UNKNOWN)
    admin_client.post(intent_url(intent, "resolve"), {"happened": "no"})
    intent.refresh_from_db()
    assert intent.status == IntentStatus.APPROVED
    assert not ToolEffect.objects.filter(key=intent.key).exists()
    # Resolving twice is harmless.
    response = admin_client.post(intent_url(intent, "resolve"), {"happened": "yes"}, follow=True)
    assert any("already decided" in m for m in messages_of(response))
    intent.refresh_from_db()
    assert intent.status == IntentStatus.APPROVED


@pytest.mark.django_db
def test_viewer_sees_no_buttons_and_forged_posts_are_refused(
    viewer_client: Client, spy: Any
) -> None:
    calls = spy("approve_intent")
    intent = parked_intent()
    page = viewer_client.get(intent_url(intent))
    assert page.status_code == 200
    content = page.content.decode()
    assert intent_url(intent, "approve") not in content
    assert intent_url(intent, "reject") not in content

    for view, data in (
        ("approve", {}),
        ("reject", {"reason": "x"}),
        ("resolve", {"happened": "yes"}),
    ):
        assert viewer_client.post(intent_url(intent, view), data).status_code == 403
    # The list action is not offered, and posting it anyway does nothing.
    listing = viewer_client.get(intents_url())
    assert "approve_intents" not in listing.content.decode()
    viewer_client.post(
        intents_url(),
        {"action": "approve_intents", "_selected_action": [intent.pk], "post": "yes"},
    )
    intent.refresh_from_db()
    assert (intent.status, intent.decided_by_id) == (IntentStatus.PENDING, None)
    assert calls == []
    assert not LogEntry.objects.exists()


@pytest.mark.django_db
def test_viewer_cannot_cancel_or_requeue(viewer_client: Client) -> None:
    run = make_runs(1, RunStatus.DEAD)[0]
    page = viewer_client.get(run_url(run)).content.decode()
    assert "Requeue this run" not in page
    url = reverse("admin:durable_agents_agentrun_requeue", args=[run.pk])
    assert viewer_client.post(url).status_code == 403
    assert AgentRun.objects.get(pk=run.pk).status == RunStatus.DEAD


@pytest.mark.django_db
def test_decision_views_need_csrf_and_post(superuser: Any) -> None:
    intent = parked_intent()
    client = Client(enforce_csrf_checks=True)
    client.force_login(superuser)
    assert client.post(intent_url(intent, "approve")).status_code == 403
    cancel = reverse("admin:durable_agents_agentrun_cancel", args=[intent.run_id])
    assert client.post(cancel).status_code == 403
    # GET never changes state: approve shows its confirmation, cancel refuses.
    page = client.get(intent_url(intent, "approve"))
    assert page.status_code == 200
    assert "Yes, approve this call" in page.content.decode()
    assert client.get(cancel).status_code == 405
    intent.refresh_from_db()
    assert intent.status == IntentStatus.PENDING
    assert AgentRun.objects.get(pk=intent.run_id).status == RunStatus.WAITING

    # With the token from the page, the same POST works.
    token = client.cookies["csrftoken"].value
    response = client.post(
        intent_url(intent, "approve"), {"csrfmiddlewaretoken": token, **hidden_fields(page)}
    )
    assert response.status_code == 302
    intent.refresh_from_db()
    assert intent.status == IntentStatus.APPROVED


@pytest.mark.django_db
def test_intents_list_puts_waiting_ones_first(admin_client: Client) -> None:
    done = parked_intent(IntentStatus.DONE, "a")
    pending = parked_intent(IntentStatus.PENDING, "b")
    rejected = parked_intent(IntentStatus.REJECTED, "c")
    unknown = parked_intent(IntentStatus.UNKNOWN, "d")
    response = admin_client.get(intents_url())
    order = [i.pk for i in response.context["cl"].result_list]
    assert set(order[:2]) == {pending.pk, unknown.pk}
    assert set(order[2:]) == {done.pk, rejected.pk}


@pytest.mark.django_db
def test_bulk_approve_and_reject_actions(admin_client: Client, superuser: Any) -> None:
    a, b = parked_intent(table="a"), parked_intent(table="b")
    done = parked_intent(IntentStatus.DONE, "c")
    data = {"action": "reject_intents", "_selected_action": [a.pk, b.pk, done.pk]}
    confirm = admin_client.post(intents_url(), {**data, "index": 0})
    assert confirm.status_code == 200
    content = confirm.content.decode()
    assert 'name="reason"' in content
    assert "will be skipped" in content

    response = admin_client.post(
        intents_url(), {**data, "post": "yes", "reason": "no"}, follow=True
    )
    assert any("Rejected 2 intent(s); 1 skipped" in m for m in messages_of(response))
    statuses = dict(ToolIntent.objects.values_list("pk", "status"))
    assert statuses == {a.pk: "rejected", b.pk: "rejected", done.pk: "done"}
    assert LogEntry.objects.filter(user=superuser).count() == 2

    c = parked_intent(table="e")
    data = {"action": "approve_intents", "_selected_action": [c.pk]}
    confirm = admin_client.post(intents_url(), {**data, "index": 0})
    assert "{\n  &quot;table&quot;: &quot;e&quot;\n}" in confirm.content.decode()  # the input
    admin_client.post(intents_url(), hidden_fields(confirm))
    c.refresh_from_db()
    assert c.status == IntentStatus.APPROVED


# ---------------------------------------------------------------------------------------------
# Run operations


@pytest.mark.django_db
def test_cancel_action_confirms_then_cancels_only_active_runs(
    admin_client: Client, spy: Any
) -> None:
    calls = spy("cancel_run")
    pending = make_runs(2, RunStatus.PENDING)
    waiting = make_runs(1, RunStatus.WAITING)
    finished = make_runs(1, RunStatus.SUCCEEDED)
    selected = [str(r.pk) for r in pending + waiting + finished]
    data = {"action": "cancel_runs", "_selected_action": selected}

    confirm = admin_client.post(runs_url(), {**data, "index": 0})
    assert confirm.status_code == 200
    content = confirm.content.decode()
    assert "<strong>3</strong> agent runs will change" in content
    assert "<strong>1</strong> selected will be skipped" in content
    assert not calls
    assert not AgentRun.objects.filter(status=RunStatus.CANCELLED).exists()

    response = admin_client.post(runs_url(), {**data, "post": "yes"}, follow=True)
    assert any("Cancelled 3 run(s); 1 skipped" in m for m in messages_of(response))
    assert len(calls) == 3
    statuses = dict(AgentRun.objects.values_list("pk", "status"))
    assert {statuses[r.pk] for r in pending + waiting} == {RunStatus.CANCELLED}
    assert statuses[finished[0].pk] == RunStatus.SUCCEEDED
    assert LogEntry.objects.count() == 3


@pytest.mark.django_db
def test_requeue_action_sends_dead_runs_back(admin_client: Client, spy: Any) -> None:
    calls = spy("requeue_run")
    dead = make_runs(2, RunStatus.DEAD, error="model gone")
    failed = make_runs(1, RunStatus.FAILED)
    data = {
        "action": "requeue_runs",
        "_selected_action": [str(r.pk) for r in dead + failed],
        "post": "yes",
    }
    response = admin_client.post(runs_url(), data, follow=True)
    assert any("Requeued 2 run(s); 1 skipped" in m for m in messages_of(response))
    assert len(calls) == 2
    statuses = dict(AgentRun.objects.values_list("pk", "status"))
    assert [statuses[r.pk] for r in dead] == [RunStatus.PENDING] * 2
    assert statuses[failed[0].pk] == RunStatus.FAILED


@pytest.mark.django_db
def test_select_across_acts_on_every_run_matching_the_filters(admin_client: Client) -> None:
    boom = make_runs(5, RunStatus.DEAD, error="boom: the model is gone\ndetails")
    other = make_runs(3, RunStatus.DEAD, error="prompt drift")
    make_runs(2, RunStatus.SUCCEEDED)
    url = runs_url("?status__exact=dead&error__startswith=boom")
    assert admin_client.get(url).context["cl"].result_count == 5

    # The changelist posts the runs of the page it shows (here one) plus select_across=1.
    data = {
        "action": "requeue_runs",
        "select_across": "1",
        "_selected_action": [str(boom[0].pk)],
    }
    confirm = admin_client.post(url, {**data, "index": 0})
    assert confirm.status_code == 200
    content = confirm.content.decode()
    # The confirmation lists every matching run and posts exactly their ids.
    assert 'name="select_across" value="0"' in content
    assert "of those matching the current filters" in content
    assert "<strong>5</strong> agent runs will change" in content
    assert f'action="{url.replace("&", "&amp;")}"' in content  # filters kept
    fields = hidden_fields(confirm)
    assert sorted(fields["_selected_action"]) == sorted(str(r.pk) for r in boom)

    admin_client.post(url, fields)
    statuses = dict(AgentRun.objects.values_list("pk", "status"))
    assert {statuses[r.pk] for r in boom} == {RunStatus.PENDING}
    assert {statuses[r.pk] for r in other} == {RunStatus.DEAD}


@pytest.mark.django_db
def test_run_page_cancel_and_requeue_buttons(admin_client: Client, superuser: Any) -> None:
    intent = parked_intent()
    run = intent.run
    page = admin_client.get(run_url(run)).content.decode()
    cancel = reverse("admin:durable_agents_agentrun_cancel", args=[run.pk])
    assert f'action="{cancel}"' in page
    assert "csrfmiddlewaretoken" in page
    assert admin_client.post(cancel).status_code == 302
    run.refresh_from_db()
    assert run.status == RunStatus.CANCELLED
    assert "Cancelled" in LogEntry.objects.get(object_id=str(run.pk)).get_change_message()
    # Nothing left to cancel: harmless, says so.
    response = admin_client.post(cancel, follow=True)
    assert any("Nothing changed" in m for m in messages_of(response))

    dead = make_runs(1, RunStatus.DEAD, error="x")[0]
    requeue = reverse("admin:durable_agents_agentrun_requeue", args=[dead.pk])
    assert f'action="{requeue}"' in admin_client.get(run_url(dead)).content.decode()
    admin_client.post(requeue)
    assert AgentRun.objects.get(pk=dead.pk).status == RunStatus.PENDING


# ---------------------------------------------------------------------------------------------
# Dead letter and operations


@pytest.mark.django_db
def test_dead_letter_groups_reasons(admin_client: Client) -> None:
    make_runs(3, RunStatus.DEAD, error="model claude-x: not found\nrequest id 1")
    make_runs(1, RunStatus.DEAD, error="model claude-x: not found\nrequest id 2")
    make_runs(2, RunStatus.DEAD, error=f"{SCRIPT} drift")
    make_runs(2, RunStatus.FAILED, error="not dead")
    response = admin_client.get(reverse("admin:durable_agents_agentrun_dead_letter"))
    assert response.status_code == 200
    groups = {g.example: g.count for g in response.context["groups"]}
    assert groups == {"model claude-x: not found": 4, f"{SCRIPT} drift": 2}
    content = response.content.decode()
    assert SCRIPT not in content
    # Each group offers its requeue and cancel, through a confirmation listing its runs.
    group = next(g for g in response.context["groups"] if g.count == 4)
    confirm_url = reverse(
        "admin:durable_agents_agentrun_dead_letter_confirm", args=["requeue_runs"]
    )
    assert f"{confirm_url}?{escape(group.query)}" in content
    confirm_url += "?" + group.query
    confirm = admin_client.get(confirm_url)
    assert "<strong>4</strong> agent runs will change" in confirm.content.decode()
    admin_client.post(runs_url("?status__exact=dead"), hidden_fields(confirm))
    assert AgentRun.objects.filter(status=RunStatus.PENDING).count() == 4


@pytest.mark.django_db
def test_operations_page_empty(admin_client: Client) -> None:
    response = admin_client.get(reverse("admin:durable_agents_agentrun_operations"))
    assert response.status_code == 200
    content = response.content.decode()
    assert "No finished runs yet." in content
    assert "<svg" in content


@pytest.mark.django_db(transaction=True)
def test_operations_page_with_data(admin_client: Client) -> None:
    waiting_run()
    for i in range(3):
        durable_agents.start_run("tester", f'Look.\n@lookup {{"key": "k{i}"}}')
    run_worker()
    durable_agents.start_run("tester", "still pending")
    response = admin_client.get(reverse("admin:durable_agents_agentrun_operations"))
    assert response.status_code == 200
    ctx = response.context
    # Without a metrics snapshot the table's size is a bounded count (exact up to 10,000);
    # with one, the snapshot's count, and the page says when it was taken.
    assert ctx["table"].taken_at is None
    assert ctx["table"].shown == "5"
    assert "housekeeping's metrics snapshot, which has not run yet" in response.content.decode()
    housekeeping.snapshot_metrics()
    response = admin_client.get(reverse("admin:durable_agents_agentrun_operations"))
    ctx = response.context
    assert ctx["total_runs"] == 5
    assert ctx["table"].taken_at is not None
    assert "as counted by housekeeping" in response.content.decode()
    # Live statuses now, finished runs over the last 24 hours.
    assert {b.label: b.value for b in ctx["live_bars"]} == {
        "pending": 1,
        "running": 0,
        "waiting": 1,
        "dead": 0,
    }
    assert {b.label: b.value for b in ctx["finished_bars"]}["succeeded"] == 3
    assert ctx["oldest_pending"].task == "still pending"
    assert ctx["steps_sample"] == 3
    assert ctx["steps_p50"] == 4.0
    assert ctx["steps_p95"] == 4.0
    assert ctx["intents_waiting"] == 1
    assert ctx["hour_total"] == 3
    content = response.content.decode()
    assert "<rect" in content
    assert "Intents waiting for a person" in content
    # The hours stand on a baseline; the labels count back from the current hour, "now".
    assert '<line class="da-baseline"' in content
    labels = [b.axis_label for b in ctx["hour_bars"]]
    assert labels[-1] == "now"
    assert [i for i, label in enumerate(labels) if label] == list(range(2, 24, 3))
    assert "Claims per run" in content
    assert "1 claim<" in content


# ---------------------------------------------------------------------------------------------
# Query counts


def _count_queries(client: Client, url: str) -> int:
    with CaptureQueriesContext(connection) as ctx:
        response = client.get(url)
    assert response.status_code == 200
    return len(ctx)


@pytest.mark.django_db
def test_list_pages_run_a_bounded_number_of_queries(
    admin_client: Client, superuser: Any, django_assert_max_num_queries: Any
) -> None:
    for intent in [parked_intent(table=f"t{i}") for i in range(10)]:
        AgentRun.objects.filter(pk=intent.run_id).update(lease_owner="w1", error="e")
    small = {url: _count_queries(admin_client, url) for url in (runs_url(), intents_url())}

    for intent in [parked_intent(table=f"u{i}") for i in range(90)]:
        api.approve_intent(intent.pk, user=superuser)  # decided_by on every row
    large = {url: _count_queries(admin_client, url) for url in (runs_url(), intents_url())}
    assert small == large, (small, large)
    with django_assert_max_num_queries(11):  # the concurrency keys of the filter: one more
        admin_client.get(runs_url())
    with django_assert_max_num_queries(6):
        admin_client.get(intents_url())
    with django_assert_max_num_queries(11):
        admin_client.get(runs_url("?q=req_1"))


# -- a run's page by the short id the admin shows ---------------------------------------


def _run_with_id(run_id: str) -> AgentRun:
    return AgentRun.objects.create(
        id=uuid.UUID(run_id), agent="tester", prompt_version="v1", model="m", task="t"
    )


def short_url(prefix: str, suffix: str = "") -> str:
    return f"/admin/durable_agents/agentrun/{prefix}/change/{suffix}"


def test_a_runs_short_id_in_the_url_opens_its_page(admin_client: Client) -> None:
    run = durable_agents.start_run("tester", "Find me by my short id.")
    short = short_id(run.pk)
    assert short == run.pk.hex[-8:]  # a time-ordered id: its last digits
    assert short_url(short) != run_url(run)
    response = admin_client.get(short_url(short, "?seq=0"))
    assert response.status_code == 302
    assert response["Location"] == run_url(run) + "?seq=0"  # the query string is kept
    page = admin_client.get(response["Location"])
    assert page.status_code == 200
    assert "Find me by my short id." in page.content.decode()
    # Upper case, and the first characters of the id as pasted with its dash, name it too.
    assert admin_client.get(short_url(short.upper()))["Location"] == run_url(run)
    assert admin_client.get(short_url(str(run.pk)[:13].upper()))["Location"] == run_url(run)


def test_runs_started_in_the_same_second_each_have_a_short_id_of_their_own(
    admin_client: Client,
) -> None:
    """Time-ordered ids of one millisecond share their first digits: the lists show the last
    ones, and each short id the list shows opens its own run."""
    same_moment = 1_700_000_000_000  # 2023-11-14, a millisecond in the past
    first = _run_with_id(str(new_run_id(now_ms=same_moment)))
    second = _run_with_id(str(new_run_id(now_ms=same_moment)))
    assert first.pk.hex[:8] == second.pk.hex[:8]  # what the lists showed before
    assert short_id(first.pk) != short_id(second.pk)
    page = admin_client.get(runs_url()).content.decode()
    for run, other in ((first, second), (second, first)):
        [row] = [row for row in page.split("<tr") if short_id(run.pk) in row]
        assert f'href="{run_url(run)}"' in row  # the row links its own run
        assert short_id(other.pk) not in row
        assert admin_client.get(short_url(short_id(run.pk)))["Location"] == run_url(run)
        found = admin_client.get(runs_url(), {"q": short_id(run.pk)}).context["cl"].result_list
        assert [listed.pk for listed in found] == [run.pk]


def test_a_short_id_is_the_tail_of_a_time_ordered_id_and_the_head_of_a_random_one(
    admin_client: Client,
) -> None:
    ordered = durable_agents.start_run("tester", "a run of this release")
    random_id = uuid.uuid4()
    older = _run_with_id(str(random_id))  # a run made before ids were time-ordered
    assert short_id(older.pk) == random_id.hex[:8]
    assert admin_client.get(short_url(short_id(ordered.pk)))["Location"] == run_url(ordered)
    assert admin_client.get(short_url(short_id(older.pk)))["Location"] == run_url(older)
    # The last digits of a random id are not its short id: they name no run.
    tail_of_random = admin_client.get(short_url(random_id.hex[-8:]))
    assert tail_of_random.status_code == 404
    assert f"No run has the short id {random_id.hex[-8:]}" in tail_of_random.content.decode()
    # A random id that starts with the short id of a time-ordered one: both are named.
    clash = _run_with_id(short_id(ordered.pk) + "0000400080000000" + "00000000")
    several = admin_client.get(short_url(short_id(ordered.pk)))
    assert several.status_code == 404
    assert f"Several runs have the short id {short_id(ordered.pk)}" in several.content.decode()
    found = admin_client.get(runs_url(), {"q": short_id(ordered.pk)}).context["cl"].result_list
    assert {run.pk for run in found} == {ordered.pk, clash.pk}


def test_a_short_id_of_no_run_or_of_several_is_a_404_that_says_which(
    admin_client: Client,
) -> None:
    first = _run_with_id("abcd1234-1000-4000-8000-000000000000")
    _run_with_id("abcd1234-2000-4000-8000-000000000000")

    def said(term: str) -> str:
        response = admin_client.get(short_url(term))
        assert response.status_code == 404
        return response.content.decode()

    several = said("abcd1234")
    assert "Several runs have the short id abcd1234 or an id that starts with it" in several
    assert "?q=abcd1234" in several  # the list of them
    assert "No run has the short id 0123abcd, nor an id that starts with it." in said("0123abcd")
    # Fewer or more digits than a short id has: the first characters of an id only.
    assert "Several runs&#x27; ids start with abcd:" in said("abcd")
    assert "No run&#x27;s id starts with 0123a." in said("0123a")
    # One more digit tells the two apart.
    assert admin_client.get(short_url("abcd1234-1"))["Location"] == run_url(first)


def test_a_user_who_may_not_see_runs_learns_nothing_from_a_short_id(
    django_user_model: Any,
) -> None:
    run = durable_agents.start_run("tester", "secret")
    staff = django_user_model.objects.create_user("nosy", password="pw", is_staff=True)
    client = Client()
    client.force_login(staff)
    # The same answer whether the prefix names a run or not.
    assert client.get(short_url(short_id(run.pk))).status_code == 403
    assert client.get(short_url("0123abcd")).status_code == 403
    client.logout()
    assert client.get(short_url(short_id(run.pk))).status_code == 302  # to the login page


def test_an_unknown_intents_page_says_what_happened(admin_client: Client) -> None:
    intent = parked_intent(IntentStatus.UNKNOWN)
    cause = (
        f"intent {intent.pk} for drop_table: outcome unknown: worker w1 was shutting down "
        "(SIGTERM) and its shutdown grace of 10s ran out while the call was in flight"
    )
    ToolIntent.objects.filter(pk=intent.pk).update(reason=cause)
    content = admin_client.get(intent_url(intent)).content.decode()
    assert "nobody knows whether it took effect" in content
    assert f'<p id="intent-unknown-cause">What happened: {cause}</p>' in content
    assert "The worker died" not in content  # not said of a shutdown
