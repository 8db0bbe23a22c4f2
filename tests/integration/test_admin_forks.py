"""Forks in the admin: a fork's transcript, "Fork from here", "Edit and rerun", their audit
record, the run page's origin and forks, and the compare page; through the real admin and
runs finished by a real worker over the real SDK against the fake API."""

from __future__ import annotations

import datetime
import json
from collections.abc import Iterator
from typing import Any

import pytest
from django.contrib.admin.models import ADDITION, LogEntry
from django.contrib.auth.models import Permission
from django.test import Client
from django.urls import reverse
from django.utils import timezone
from django.utils.html import escape

from durable_agents import Agent, api, tool
from durable_agents._internal.deepjson import loads_deep
from durable_agents.admin import listing
from durable_agents.forks.planning import ForkRefused
from durable_agents.housekeeping import sweeps as housekeeping
from durable_agents.models import AgentRun, AgentStep, RunStatus, short_id, steps_of
from durable_agents.testing import plan
from tests.conftest import run_worker
from tests.fakeserver import FakeAnthropic
from tests.integration.conftest import agents_registered

pytestmark = pytest.mark.django_db(transaction=True)

SCRIPT = "<script>alert(1)</script>"
# A terminal escape sequence, a script tag and a right-to-left override.
HOSTILE = f"\x1b[31mred\x1b[0m {SCRIPT} \u202eexe.txt"


@tool(effect="pure")
def lookup(order: str) -> dict[str, Any]:
    """Look an order up."""
    return {"order": order, "total": 120}


@tool(effect="pure")
def echo(text: str) -> str:
    """Say it back."""
    return text


agent = Agent(
    name="admin-fork",
    version="v1",
    model="claude-test-1",
    system="You settle orders.",
    tools=[lookup, echo],
    max_tokens=1024,
)
# seq 0: the task, 1: lookup, 2: its result, 3: echo, 4: its result, 5: the end.
TASK = plan(
    ("lookup", {"order": "o-1"}),
    ("echo", {"text": HOSTILE}),
    task="Settle order o-1.",
)


@pytest.fixture(autouse=True)
def registered() -> Iterator[None]:
    with agents_registered(agent):
        yield


def finished(task: str = TASK) -> AgentRun:
    run = api.start_run(agent.name, task, version=agent.version)
    run_worker()
    run.refresh_from_db()
    assert (run.status, run.error) == (RunStatus.SUCCEEDED, "")
    return run


def staff(django_user_model: Any, name: str, *codenames: str) -> Any:
    user = django_user_model.objects.create_user(name, password="pw", is_staff=True)
    user.user_permissions.add(*Permission.objects.filter(codename__in=codenames))
    return user


@pytest.fixture
def viewer(django_user_model: Any) -> Client:
    """May look at runs, not fork them."""
    client = Client()
    client.force_login(staff(django_user_model, "viewer", "view_agentrun"))
    return client


@pytest.fixture
def forker_user(django_user_model: Any) -> Any:
    return staff(django_user_model, "forker", "view_agentrun", "fork_agentrun")


@pytest.fixture
def forker(forker_user: Any) -> Client:
    client = Client()
    client.force_login(forker_user)
    return client


def run_url(run: AgentRun | Any) -> str:
    pk = run.pk if isinstance(run, AgentRun) else run
    return reverse("admin:durable_agents_agentrun_change", args=[pk])


def fork_url(run: AgentRun, seq: int) -> str:
    return reverse("admin:durable_agents_agentrun_fork", args=[run.pk, seq])


def edit_url(run: AgentRun, seq: int) -> str:
    return reverse("admin:durable_agents_agentrun_fork_edit", args=[run.pk, seq])


def compare_url(a: Any, b: Any) -> str:
    return reverse("admin:durable_agents_agentrun_compare") + f"?a={a}&b={b}"


def results_of(run: AgentRun, seq: int) -> Any:
    return loads_deep(steps_of(run.pk).get(seq=seq).payload)


def forks_of(run: AgentRun) -> list[AgentRun]:
    return list(AgentRun.objects.filter(forked_from=run))


def assert_no_raw_hostile_text(html: str) -> None:
    assert SCRIPT not in html
    assert "\u202e" not in html
    assert "\x1b" not in html


def test_without_the_fork_permission_every_fork_page_is_refused_and_no_button_shown(
    fake_api: FakeAnthropic, viewer: Client
) -> None:
    parent = finished()
    page = viewer.get(run_url(parent))
    assert page.status_code == 200
    assert "Fork from here" not in page.content.decode()
    assert "Edit and rerun" not in page.content.decode()
    for url, data in (
        (fork_url(parent, 2), {"post": "yes"}),
        (edit_url(parent, 2), {"post": "yes", "edit": json.dumps(results_of(parent, 2))}),
        (edit_url(parent, 0), {"post": "yes", "edit": "Settle order o-2."}),
    ):
        assert viewer.get(url).status_code == 403
        assert viewer.post(url, data).status_code == 403
    assert forks_of(parent) == []
    assert not LogEntry.objects.exists()


def test_a_fork_post_without_the_csrf_token_is_refused(
    fake_api: FakeAnthropic, forker_user: Any
) -> None:
    parent = finished()
    client = Client(enforce_csrf_checks=True)
    client.force_login(forker_user)
    assert client.post(fork_url(parent, 2), {"post": "yes"}).status_code == 403
    edit = {"post": "yes", "edit": json.dumps(results_of(parent, 2))}
    assert client.post(edit_url(parent, 2), edit).status_code == 403
    assert forks_of(parent) == []
    # With the token the page's form carries, the same POST forks.
    page = client.get(fork_url(parent, 2))
    token = page.context["csrf_token"]
    response = client.post(fork_url(parent, 2), {"post": "yes", "csrfmiddlewaretoken": token})
    assert response.status_code == 302
    assert len(forks_of(parent)) == 1


def test_fork_from_here_makes_the_fork_logs_it_and_redirects_to_it(
    fake_api: FakeAnthropic, forker: Client, forker_user: Any
) -> None:
    parent = finished()
    page = forker.get(run_url(parent)).content.decode()
    assert f'href="{fork_url(parent, 2)}"' in page
    assert f'href="{edit_url(parent, 2)}"' in page  # a tool_result step
    # The task: editing it starts a run with a task of one's own, which needs add_agentrun.
    assert f'href="{edit_url(parent, 0)}"' not in page
    assert f'href="{edit_url(parent, 1)}"' not in page  # a model turn cannot be edited
    assert forker.get(edit_url(parent, 1)).status_code == 404

    confirmation = forker.get(fork_url(parent, 2))
    assert confirmation.status_code == 200
    assert forks_of(parent) == []  # a GET creates nothing

    response = forker.post(fork_url(parent, 2), {"post": "yes"})
    [fork] = forks_of(parent)
    assert response.status_code == 302
    assert response["Location"] == run_url(fork)
    assert (fork.fork_seq, fork.status) == (2, RunStatus.PENDING)
    [entry] = LogEntry.objects.all()
    assert (entry.action_flag, entry.object_id, entry.user_id) == (
        ADDITION,
        str(fork.pk),
        forker_user.pk,
    )
    assert str(parent.pk) in entry.change_message
    assert "step 2" in entry.change_message
    assert "unedited" in entry.change_message


def test_the_edit_form_shows_invalid_json_as_an_error_and_creates_nothing(
    fake_api: FakeAnthropic, forker: Client
) -> None:
    parent = finished()
    response = forker.post(edit_url(parent, 2), {"post": "yes", "edit": "[{not json"})
    assert response.status_code == 400
    assert "This is not valid JSON" in response.content.decode()
    assert forks_of(parent) == []
    assert not LogEntry.objects.exists()


def test_the_edit_form_shows_what_fork_run_refuses_and_creates_nothing(
    fake_api: FakeAnthropic, forker: Client
) -> None:
    parent = finished()
    blocks = results_of(parent, 2)
    blocks[0]["tool_use_id"] = "toolu_not_asked_for"
    with pytest.raises(ForkRefused) as refused:
        api.fork_run(parent.pk, 2, edit=blocks)
    response = forker.post(edit_url(parent, 2), {"post": "yes", "edit": json.dumps(blocks)})
    assert response.status_code == 400
    assert escape(str(refused.value)) in response.content.decode()
    assert forks_of(parent) == []
    assert not LogEntry.objects.exists()


def test_a_valid_edit_becomes_the_forks_step_at_the_fork_point(
    fake_api: FakeAnthropic, forker: Client
) -> None:
    parent = finished()
    form = forker.get(edit_url(parent, 2))
    assert form.status_code == 200
    # Pre-filled with the step's blocks, as JSON.
    assert json.loads(form.context["form"].initial["edit"]) == results_of(parent, 2)
    blocks = results_of(parent, 2)
    blocks[0]["content"] = '{"order": "o-1", "total": 99}'
    response = forker.post(edit_url(parent, 2), {"post": "yes", "edit": json.dumps(blocks)})
    [fork] = forks_of(parent)
    assert response.status_code == 302
    assert response["Location"] == run_url(fork)
    assert results_of(fork, 2) == blocks
    assert results_of(parent, 2) != blocks
    [entry] = LogEntry.objects.all()
    assert "(edited)" in entry.change_message


def test_editing_the_task_forks_with_the_new_task(
    fake_api: FakeAnthropic, django_user_model: Any
) -> None:
    # A run with a task of one's own: the permission to add runs as well as to fork them.
    forker = Client()
    forker.force_login(
        staff(django_user_model, "starter", "view_agentrun", "fork_agentrun", "add_agentrun")
    )
    parent = finished()
    assert forker.get(edit_url(parent, 0)).context["form"].initial["edit"] == TASK
    new_task = plan(("lookup", {"order": "o-2"}), task="Settle order o-2.")
    response = forker.post(edit_url(parent, 0), {"post": "yes", "edit": new_task})
    [fork] = forks_of(parent)
    assert response.status_code == 302
    assert results_of(fork, 0) == new_task
    run_worker()
    fork.refresh_from_db()
    assert fork.status == RunStatus.SUCCEEDED
    # The list shows the fork's task.
    listing = forker.get(reverse("admin:durable_agents_agentrun_changelist")).content.decode()
    assert "Settle order o-2." in listing


def test_a_forks_transcript_shows_its_shared_steps_linked_to_their_run(
    fake_api: FakeAnthropic, forker: Client
) -> None:
    parent = finished()
    fork = api.fork_run(parent.pk, 4)
    page = forker.get(run_url(fork)).content.decode()
    for seq in range(5):
        assert f'id="seq-{seq}"' in page
    assert f'href="{run_url(parent)}#seq-0"' in page
    assert f"from run {short_id(parent.pk)}" in page
    assert "Transcript (5 steps)" in page
    # Its origin, and the parent's list of forks.
    assert f'id="forked-from-link">{short_id(parent.pk)}</a> at step 4' in page
    assert escape(compare_url(parent.pk, fork.pk)) in page
    parent_page = forker.get(run_url(parent)).content.decode()
    assert 'id="forks"' in parent_page
    assert f'href="{run_url(fork)}"' in parent_page
    # A step's whole text reads through the fork too.
    text = forker.get(reverse("admin:durable_agents_agentrun_step_text", args=[fork.pk, 0]))
    assert text.status_code == 200
    assert "Settle order o-1." in text.content.decode()


def test_hostile_model_and_tool_text_is_escaped_on_every_fork_page(
    fake_api: FakeAnthropic, forker: Client
) -> None:
    parent = finished()
    fork = api.fork_run(parent.pk, 3)  # reads the hostile echo call (seq 3)
    run_worker()
    pages = {
        "run": forker.get(run_url(parent)),
        "fork run": forker.get(run_url(fork)),
        "edit": forker.get(edit_url(parent, 4)),
        "fork": forker.get(fork_url(parent, 4)),
        "compare": forker.get(compare_url(parent.pk, fork.pk)),
    }
    for name, response in pages.items():
        assert response.status_code == 200, name
        html = response.content.decode()
        assert_no_raw_hostile_text(html)
    assert escape(SCRIPT) in pages["run"].content.decode()
    assert escape(SCRIPT) in pages["edit"].content.decode()


def test_compare_collapses_the_shared_steps_and_shows_both_runs_from_where_they_part(
    fake_api: FakeAnthropic, forker: Client
) -> None:
    parent = finished()
    blocks = results_of(parent, 2)
    blocks[0]["content"] = "the order is gone"
    fork = api.fork_run(parent.pk, 2, edit=blocks)
    run_worker()
    response = forker.get(compare_url(parent.pk, fork.pk))
    assert response.status_code == 200
    html = response.content.decode()
    # Each run by its own short id: two runs made seconds apart share their ids' first digits.
    assert f"Compare runs {short_id(parent.pk)} and {short_id(fork.pk)}" in html
    assert f'">{short_id(fork.pk)}</a>' in html
    assert "Steps 0-1 are the same in both runs." in html
    parting = response.context["parting"]
    assert parting.same == 2
    assert [e.step.seq for e in parting.left] == list(range(2, parent.last_seq + 1))
    fork.refresh_from_db()
    assert [e.step.seq for e in parting.right] == list(range(2, fork.last_seq + 1))
    assert "the order is gone" in html
    # The same run twice: nothing parts.
    same = forker.get(compare_url(parent.pk, parent.pk))
    assert same.context["parting"].same == parent.last_seq + 1


def test_compare_answers_bad_ids_with_404_or_400(
    fake_api: FakeAnthropic, forker: Client, viewer: Client
) -> None:
    parent = finished()
    base = reverse("admin:durable_agents_agentrun_compare")
    unknown = "00000000-0000-0000-0000-000000000000"
    assert forker.get(compare_url(parent.pk, unknown)).status_code == 404
    assert forker.get(compare_url("not-an-id", parent.pk)).status_code == 404
    assert forker.get(compare_url("%00", parent.pk)).status_code == 404
    assert forker.get(base + f"?a={parent.pk}").status_code == 400
    assert forker.get(base).status_code == 400
    # Viewing runs is enough to compare them.
    assert viewer.get(compare_url(parent.pk, parent.pk)).status_code == 200


def test_the_run_list_search_finds_a_fork_by_its_shared_task_before_the_recent_window(
    fake_api: FakeAnthropic, forker: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Past the recent window, words are looked up in the task steps' index; a fork forked past
    # its task holds no task step of its own, and must be found all the same.
    monkeypatch.setattr(listing, "RECENT_WINDOW", 1)
    parent = finished(plan(("lookup", {"order": "o-7"}), task="Settle order 7731."))
    fork = api.fork_run(parent.pk, 2)
    assert not AgentStep.objects.filter(run_id=fork.pk, seq=0).exists()
    AgentRun.objects.filter(pk__in=[parent.pk, fork.pk]).update(
        created_at=timezone.now() - datetime.timedelta(days=30)
    )
    for i in range(3):
        api.start_run(agent.name, f"Another task {i}", version=agent.version)
    response = forker.get(reverse("admin:durable_agents_agentrun_changelist") + "?q=7731")
    assert {r.pk for r in response.context["cl"].result_list} == {fork.pk, parent.pk}


def test_a_forks_incident_sql_reads_the_stretches_it_shares(
    fake_api: FakeAnthropic, forker: Client
) -> None:
    parent = finished()
    fork = api.fork_run(parent.pk, 4)
    assert "agent_step_share" in forker.get(run_url(fork)).context["sql_hint"]
    assert "agent_step_share" not in forker.get(run_url(parent)).context["sql_hint"]


def test_a_fork_whose_parent_was_deleted_says_so_and_keeps_its_whole_transcript(
    fake_api: FakeAnthropic, forker: Client, da_settings: Any
) -> None:
    parent = finished()
    fork = api.fork_run(parent.pk, 4)
    da_settings(RETENTION_DAYS=1)
    AgentRun.objects.filter(pk=parent.pk).update(
        finished_at=timezone.now() - datetime.timedelta(days=3)
    )
    assert housekeeping.apply_retention() == 1
    page = forker.get(run_url(fork)).content.decode()
    assert "Forked from a run since deleted, at step 4." in page
    assert 'id="compare-link"' not in page
    for seq in range(5):
        assert f'id="seq-{seq}"' in page
    assert "from run " not in page  # the steps were copied in: its own rows now
