"""The admin of long-running runs: what waiting runs wait for
(list, filter, run page), parents and children, questions and their answers, events and the
"send the event" form and action, the operations page's waits, and the transcript's compaction
blocks and cache figures. Every decision needs its permission, is CSRF-protected, goes through
``durable_agents.api`` and is audited as a LogEntry; model output is escaped; list pages stay
bounded in queries."""

from __future__ import annotations

import datetime
import json
import uuid
from typing import Any

import pytest
from django.contrib.admin.models import ADDITION, CHANGE, LogEntry
from django.contrib.auth.models import Permission
from django.contrib.contenttypes.models import ContentType
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

import durable_agents
from durable_agents import api, housekeeping
from durable_agents.models import (
    AgentEvent,
    AgentQuestion,
    AgentRun,
    AgentStep,
    QuestionStatus,
    RunStatus,
    StepKind,
    ToolIntent,
    WaitKind,
    short_id,
)
from tests.conftest import run_worker
from tests.integration.test_admin import (
    ESCAPED,
    SCRIPT,
    hidden_fields,
    messages_of,
    run_url,
    runs_url,
)

pytestmark = pytest.mark.django_db(transaction=True)

HOSTILE_QUESTION = f"{SCRIPT} Which region first?"


# ---------------------------------------------------------------------------------------------
# Helpers


def question_url(question: AgentQuestion, view: str = "change") -> str:
    return reverse(f"admin:durable_agents_agentquestion_{view}", args=[question.pk])


def questions_url(suffix: str = "") -> str:
    return reverse("admin:durable_agents_agentquestion_changelist") + suffix


def event_url(event: AgentEvent, view: str = "change") -> str:
    return reverse(f"admin:durable_agents_agentevent_{view}", args=[event.pk])


def events_url(suffix: str = "") -> str:
    return reverse("admin:durable_agents_agentevent_changelist") + suffix


def send_url() -> str:
    return reverse("admin:durable_agents_agentevent_add")


def answer_url(run: AgentRun) -> str:
    return reverse("admin:durable_agents_agentrun_answer", args=[run.pk])


def operations_url() -> str:
    return reverse("admin:durable_agents_agentrun_operations")


def reload(run: AgentRun) -> AgentRun:
    return AgentRun.objects.get(pk=run.pk)


def parked(task: str, agent: str = "waiter", **worker: Any) -> AgentRun:
    """A run parked by a real worker (the offline model plays the task's script)."""
    run = durable_agents.start_run(agent, f"Wait for something.\n{task}")
    run_worker(**worker)
    run = reload(run)
    assert run.status == RunStatus.WAITING, (run.status, run.error)
    return run


def logs_for(obj: Any) -> list[LogEntry]:
    content_type = ContentType.objects.get_for_model(type(obj))
    return list(
        LogEntry.objects.filter(content_type=content_type, object_id=str(obj.pk)).order_by("pk")
    )


def staff_client(django_user_model: Any, name: str, *codenames: str) -> Client:
    user = django_user_model.objects.create_user(name, password="pw", is_staff=True)
    user.user_permissions.add(
        *Permission.objects.filter(content_type__app_label="durable_agents", codename__in=codenames)
    )
    client = Client()
    client.force_login(user)
    return client


VIEW_PERMS = ("view_agentrun", "view_agentquestion", "view_agentevent", "view_toolintent")


@pytest.fixture
def viewer_client(django_user_model: Any) -> Client:
    """Staff who may look at runs, questions and events, and decide nothing."""
    return staff_client(django_user_model, "viewer", *VIEW_PERMS)


# Runs parked without a worker (for the pages and the query counts): the columns a park writes.


def park(kind: str, agent: str = "waiter", **fields: Any) -> AgentRun:
    run = durable_agents.start_run(agent, f"Park on {kind}")
    values: dict[str, Any] = {
        "status": RunStatus.WAITING,
        "waiting_for": kind,
        "waiting_since": timezone.now(),
        "wait_key": uuid.uuid4().hex,
        **fields,
    }
    AgentRun.objects.filter(pk=run.pk).update(**values)
    return reload(run)


def park_on_question(text: str = "Go?") -> tuple[AgentRun, AgentQuestion]:
    run = park(WaitKind.QUESTION)
    assert run.wait_key is not None
    return run, AgentQuestion.objects.create(run=run, key=run.wait_key, question=text)


def park_on_children(count: int, ended: int = 0) -> tuple[AgentRun, list[AgentRun]]:
    parent = durable_agents.start_run("waiter", "Fan out")
    children = [durable_agents.start_run("waiter_child", f"Research {i}") for i in range(count)]
    for i, child in enumerate(children):
        status = RunStatus.SUCCEEDED if i < ended else RunStatus.PENDING
        AgentRun.objects.filter(pk=child.pk).update(
            parent=parent, spawn_key=f"k:{i}", depth=1, status=status
        )
    AgentRun.objects.filter(pk=parent.pk).update(
        status=RunStatus.WAITING,
        waiting_for=WaitKind.RUNS,
        waiting_since=timezone.now(),
        wait_key=uuid.uuid4().hex,
        wait_runs=[str(c.pk) for c in children],
    )
    return reload(parent), [reload(c) for c in children]


def park_on_intent(tool: str = "drop_table") -> tuple[AgentRun, ToolIntent]:
    run = park(WaitKind.INTENT, agent="tester")
    assert run.wait_key is not None
    intent = ToolIntent.objects.create(  # type: ignore[misc]  # a JSONTextField takes any JSON value; the stubs say str
        run=run, seq=1, call_index=0, tool=tool, input={"table": "t"}, key=run.wait_key
    )
    return run, intent


def park_one_of_each(label: str = "") -> None:
    park(WaitKind.TIMER, wake_at=timezone.now() + datetime.timedelta(hours=1))
    park(WaitKind.EVENT, wait_event=f"deploy:{label}{uuid.uuid4().hex[:6]}")
    park_on_children(3, ended=1)
    park_on_question(f"Question {label}?")
    park_on_intent()


# ---------------------------------------------------------------------------------------------
# 1. What waiting runs wait for: list, filter, run page; parents and children


def test_runs_list_says_what_each_run_waits_for(admin_client: Client) -> None:
    due = timezone.now() + datetime.timedelta(hours=2)
    timer = park(WaitKind.TIMER, wake_at=due)
    event = park(WaitKind.EVENT, wait_event="refund:o-1")
    parent, children = park_on_children(3, ended=2)
    asking, _ = park_on_question("Which region do we migrate first?\nDetails follow.")
    approving, _ = park_on_intent("drop_table")

    content = admin_client.get(runs_url()).content.decode()
    until = timezone.localtime(due).strftime("%Y-%m-%d %H:%M:%S")
    assert f"waits for a timer until {until}" in content
    assert "waits for event “refund:o-1”" in content
    assert "waits for child runs (2 of 3 ended)" in content
    assert "waits for an answer to “Which region do we migrate first?”" in content
    assert "waits for an approval of drop_table" in content
    # A child run is marked, with a link to its parent.
    assert content.count(f'href="{run_url(parent)}" title="a child run of {parent.pk}"') == 3
    assert f"↳ {short_id(parent.pk)}" in content
    del timer, event, children, asking, approving


def test_runs_can_be_filtered_by_what_they_wait_for(admin_client: Client) -> None:
    timer = park(WaitKind.TIMER, wake_at=timezone.now() + datetime.timedelta(hours=1))
    event = park(WaitKind.EVENT, wait_event="e1")
    asking, _ = park_on_question()
    # waiting_for is kept after the wake: a woken run is not "waiting for an event".
    woken = park(WaitKind.EVENT, wait_event="e0")
    AgentRun.objects.filter(pk=woken.pk).update(status=RunStatus.PENDING)

    def listed(query: str) -> set[Any]:
        response = admin_client.get(runs_url(query))
        assert response.status_code == 200
        return {r.pk for r in response.context["cl"].result_list}

    assert listed("?waits_for=event") == {event.pk}
    assert listed("?waits_for=timer") == {timer.pk}
    assert listed("?waits_for=question") == {asking.pk}
    filters = admin_client.get(runs_url()).content.decode()
    assert "By waiting for" in filters
    assert "?waits_for=runs" in filters
    # Child runs, and the runs waiting on one event (the events list links there).
    parent, children = park_on_children(2)
    assert listed("?family=child") == {c.pk for c in children}
    assert listed(f"?parent__id__exact={parent.pk}") == {c.pk for c in children}
    assert listed("?waits_for=event&wait_event=e1") == {event.pk}


def test_run_page_shows_the_timer_and_the_event(admin_client: Client) -> None:
    due = timezone.now() + datetime.timedelta(hours=3)
    timer = park(WaitKind.TIMER, wake_at=due)
    page = admin_client.get(run_url(timer)).content.decode()
    assert 'id="run-wait"' in page
    assert f"called again at <strong>{timezone.localtime(due):%Y-%m-%d %H:%M:%S}</strong>" in page
    assert "Last wait" not in page  # the box says it all while the run waits

    event = park(WaitKind.EVENT, wait_event=f"build:{SCRIPT}")
    AgentEvent.objects.create(name=f"build:{SCRIPT}")
    page = admin_client.get(run_url(event)).content.decode()
    assert f'<strong id="wait-event">build:{ESCAPED}</strong>' in page
    assert SCRIPT not in page
    # The superuser may send it from here: a form posting to the send view.
    assert f'action="{send_url()}"' in page


def test_run_page_links_parent_and_children(admin_client: Client, superuser: Any) -> None:
    parent, children = park_on_children(3, ended=1)
    page = admin_client.get(run_url(parent)).content.decode()
    assert "0 of 3" not in page
    assert "1 of 3 child runs ended" in page
    assert "Child runs (3, 1 ended)" in page
    for child in children:
        assert run_url(child) in page
    assert page.count("da-awaited") == 3
    assert page.count(">Succeeded</span>") == 1
    assert page.count(">Pending</span>") == 2

    child_page = admin_client.get(run_url(children[0])).content.decode()
    assert f'<a href="{run_url(parent)}" id="parent-link">{parent.pk}</a>' in child_page
    assert "Child run" in child_page
    assert "k:0" in child_page

    # A child that ends counts as ended, whatever its end.
    api.cancel_run(children[1].pk)
    page = admin_client.get(run_url(parent)).content.decode()
    assert "2 of 3 child runs ended" in page


def test_fan_out_through_a_worker_shows_on_both_pages(admin_client: Client) -> None:
    parent = parked('@fan_out {"topics": ["tides", "moons"]}', max_runs=1)
    children = list(AgentRun.objects.filter(parent_id=parent.pk))
    assert len(children) == 2
    listing = admin_client.get(runs_url()).content.decode()
    assert "waits for child runs (0 of 2 ended)" in listing
    page = admin_client.get(run_url(parent)).content.decode()
    assert "0 of 2 child runs ended" in page
    assert all(run_url(child) in page for child in children)


def test_run_page_of_an_intent_wait_links_the_intent(admin_client: Client) -> None:
    run, intent = park_on_intent("drop_table")
    page = admin_client.get(run_url(run)).content.decode()
    intent_page = reverse("admin:durable_agents_toolintent_change", args=[intent.pk])
    assert f'<a href="{intent_page}">#{intent.pk} drop_table</a>' in page
    assert "decide it" in page


# ---------------------------------------------------------------------------------------------
# 2. Questions: shown, answered with the permission, audited, escaped


def test_a_question_is_answered_on_the_run_page(
    admin_client: Client, superuser: Any, spy: Any
) -> None:
    calls = spy("answer_question", keywords=True)
    run = parked('@ask_person {"question": "Which region do we migrate first?"}')
    question = AgentQuestion.objects.get(run_id=run.pk)
    page = admin_client.get(run_url(run)).content.decode()
    assert 'id="open-question"' in page
    assert 'id="answer-form"' in page
    assert "Which region do we migrate first?" in page
    assert f'action="{answer_url(run)}"' in page

    response = admin_client.post(
        answer_url(run), {"question": question.pk, "answer": "eu-west first"}, follow=True
    )
    assert response.redirect_chain[-1][0] == run_url(run)
    assert f"Answered question {question.pk}: run {run.pk} goes on (pending)." in messages_of(
        response
    )
    question = AgentQuestion.objects.get(run_id=run.pk)
    # The question the person was shown, by its id: never one the run asked since.
    assert calls == [(run.pk, "eu-west first", {"user": superuser, "question_id": question.pk})]
    question.refresh_from_db()
    assert (question.status, question.answer) == (QuestionStatus.ANSWERED, "eu-west first")
    assert question.answered_by == superuser
    assert reload(run).status == RunStatus.PENDING
    # Audited on the question and on the run.
    [on_question] = logs_for(question)
    [on_run] = logs_for(run)
    assert on_question.action_flag == CHANGE
    assert on_question.user == superuser
    assert "eu-west first" in on_question.get_change_message()
    assert f"Answered question {question.pk}" in on_run.get_change_message()
    # The answered question shows its answer, who and when; no form any more.
    page = response.content.decode()
    assert 'id="answer-form"' not in page
    assert "answered by boss at 20" in page
    assert "Last wait" in page
    assert "&quot;answered_by&quot;: &quot;boss&quot;" in page

    run_worker()
    done = reload(run)
    assert done.status == RunStatus.SUCCEEDED, done.error


def test_answering_twice_changes_nothing(admin_client: Client) -> None:
    run, question = park_on_question()
    data = {"question": question.pk, "answer": "yes"}
    admin_client.post(answer_url(run), data)
    response = admin_client.post(answer_url(run), {**data, "answer": "no, wait"}, follow=True)
    assert any("already answered by boss" in m for m in messages_of(response))
    question.refresh_from_db()
    assert question.answer == "yes"
    assert len(logs_for(question)) == 1


def test_an_answer_goes_only_to_the_question_the_page_showed(
    admin_client: Client, superuser: Any
) -> None:
    run, first = park_on_question("First?")
    api.answer_question(run.pk, "done", user=superuser)
    second = AgentQuestion.objects.create(run=run, key=uuid.uuid4().hex, question="Second?")
    AgentRun.objects.filter(pk=run.pk).update(status=RunStatus.WAITING, wait_key=second.key)
    # A form for the first question, posted once the run asked the second one.
    response = admin_client.post(
        answer_url(run), {"question": first.pk, "answer": "meant for the first"}, follow=True
    )
    assert any("already answered" in m for m in messages_of(response))
    second.refresh_from_db()
    assert second.status == QuestionStatus.OPEN
    # A question of another run is not this run's to answer.
    other, other_question = park_on_question("Elsewhere?")
    response = admin_client.post(
        answer_url(run), {"question": other_question.pk, "answer": "x"}, follow=True
    )
    assert any("named no question of this run" in m for m in messages_of(response))
    other_question.refresh_from_db()
    assert other_question.status == QuestionStatus.OPEN
    # An empty answer is refused by the form.
    response = admin_client.post(
        answer_url(run), {"question": second.pk, "answer": "   "}, follow=True
    )
    assert any("Write an answer" in m for m in messages_of(response))
    assert reload(other).status == RunStatus.WAITING


def test_without_the_permission_there_is_no_form_and_a_forged_post_is_refused(
    viewer_client: Client, spy: Any
) -> None:
    calls = spy("answer_question", keywords=True)
    run, question = park_on_question()
    page = viewer_client.get(run_url(run)).content.decode()
    assert 'id="open-question"' in page
    assert 'id="answer-form"' not in page
    assert "Answering needs the permission durable_agents.answer_question" in page
    question_page = viewer_client.get(question_url(question)).content.decode()
    assert 'id="answer-form"' not in question_page

    data = {"question": question.pk, "answer": "forged"}
    assert viewer_client.post(answer_url(run), data).status_code == 403
    assert viewer_client.post(question_url(question, "answer"), data).status_code == 403
    question.refresh_from_db()
    assert question.status == QuestionStatus.OPEN
    assert reload(run).status == RunStatus.WAITING
    assert calls == []
    assert not LogEntry.objects.exists()


def test_a_person_with_only_the_answer_permission_may_answer(django_user_model: Any) -> None:
    client = staff_client(django_user_model, "answerer", "view_agentrun", "answer_question")
    run, question = park_on_question()
    assert 'id="answer-form"' in client.get(run_url(run)).content.decode()
    client.post(answer_url(run), {"question": question.pk, "answer": "go"})
    question.refresh_from_db()
    assert question.status == QuestionStatus.ANSWERED
    assert question.answered_by is not None
    assert question.answered_by.username == "answerer"


def test_answering_needs_csrf_and_post(superuser: Any) -> None:
    run, question = park_on_question()
    client = Client(enforce_csrf_checks=True)
    client.force_login(superuser)
    data = {"question": question.pk, "answer": "yes"}
    assert client.post(answer_url(run), data).status_code == 403
    assert client.post(question_url(question, "answer"), data).status_code == 403
    assert client.get(answer_url(run)).status_code == 405
    question.refresh_from_db()
    assert question.status == QuestionStatus.OPEN

    page = client.get(run_url(run))  # sets the CSRF cookie
    assert page.status_code == 200
    token = client.cookies["csrftoken"].value
    response = client.post(answer_url(run), {**data, "csrfmiddlewaretoken": token})
    assert response.status_code == 302
    question.refresh_from_db()
    assert question.status == QuestionStatus.ANSWERED


def test_hostile_question_text_is_escaped_everywhere(admin_client: Client) -> None:
    run = parked(f"@ask_person {json.dumps({'question': HOSTILE_QUESTION})}")
    question = AgentQuestion.objects.get(run_id=run.pk)
    assert question.question == HOSTILE_QUESTION
    for url in (
        run_url(run),
        runs_url(),
        questions_url(),
        question_url(question),
        operations_url(),
    ):
        content = admin_client.get(url).content.decode()
        assert SCRIPT not in content, url
        assert ESCAPED in content, url
    # The whole text is plain text that a browser never runs.
    whole = admin_client.get(
        reverse("admin:durable_agents_agentquestion_text", args=[question.pk, "question"])
    )
    assert whole["Content-Type"] == "text/plain; charset=utf-8"
    assert whole.content.decode() == HOSTILE_QUESTION
    # A hostile answer is escaped too.
    admin_client.post(answer_url(run), {"question": question.pk, "answer": SCRIPT})
    for url in (run_url(run), question_url(question), questions_url()):
        content = admin_client.get(url).content.decode()
        assert SCRIPT not in content, url


def test_questions_list_open_first_and_answer_from_the_question_page(
    admin_client: Client, superuser: Any
) -> None:
    answered_run, answered = park_on_question("Old one?")
    api.answer_question(answered_run.pk, "fine", user=superuser)
    _, first = park_on_question("First open?")
    _, second = park_on_question("Second open?")
    response = admin_client.get(questions_url())
    order = [q.pk for q in response.context["cl"].result_list]
    assert order == [first.pk, second.pk, answered.pk]
    content = response.content.decode()
    assert reverse("admin:durable_agents_agentrun_change", args=[first.run_id]) in content

    page = admin_client.get(question_url(first)).content.decode()
    assert 'id="answer-form"' in page
    assert "First open?" in page
    response = admin_client.post(
        question_url(first, "answer"), {"question": first.pk, "answer": "yes"}, follow=True
    )
    assert response.redirect_chain[-1][0] == question_url(first)
    assert any(f"Answered question {first.pk}" in m for m in messages_of(response))
    assert '<strong id="answered-by">boss</strong>' in response.content.decode()
    first.refresh_from_db()
    assert first.status == QuestionStatus.ANSWERED
    assert reload(first.run).status == RunStatus.PENDING
    assert [e.action_flag for e in logs_for(first)] == [CHANGE]
    # Questions cannot be added, changed or deleted by hand.
    assert admin_client.get(questions_url("add/")).status_code == 403
    assert 'name="_save"' not in page


def test_a_long_question_is_cut_with_a_link_to_the_whole(admin_client: Client) -> None:
    run, question = park_on_question("why? " * 2000)
    page = admin_client.get(run_url(run)).content.decode()
    whole = reverse("admin:durable_agents_agentquestion_text", args=[question.pk, "question"])
    assert f'<a href="{whole}">the whole text (10000 characters)</a>' in page
    assert len(page) < 200_000


# ---------------------------------------------------------------------------------------------
# 3. Events: the list, the send form, the action


def test_events_list_shows_awaited_and_sent_events(admin_client: Client, superuser: Any) -> None:
    for _ in range(2):
        park(WaitKind.EVENT, wait_event="deploy:42")
    AgentEvent.objects.create(name="deploy:42")
    api.send_event("refund:o-1", {"status": f"refunded {SCRIPT}"}, user=superuser)
    AgentEvent.objects.create(name="nobody-waits")
    response = admin_client.get(events_url())
    content = response.content.decode()
    rows = {e.name: e for e in response.context["cl"].result_list}
    assert [e.name for e in response.context["cl"].result_list][-1] == "refund:o-1"  # sent last
    assert rows["deploy:42"]._waiting == 2
    assert rows["nobody-waits"]._waiting == 0
    assert ">Awaited<" in content
    assert ">Sent<" in content
    waiting_link = runs_url("?waits_for=event&amp;wait_event=deploy%3A42")
    assert f'<a href="{waiting_link}">2</a>' in content
    assert SCRIPT not in content
    assert "refunded &lt;script&gt;" in content
    assert "Send an event" in content
    # Filter by sent.
    sent = admin_client.get(events_url("?sent=yes")).context["cl"].result_list
    assert [e.name for e in sent] == ["refund:o-1"]


def test_send_an_event_from_the_form(admin_client: Client, superuser: Any, spy: Any) -> None:
    calls = spy("send_event", keywords=True)
    runs = [park(WaitKind.EVENT, wait_event="deploy:done") for _ in range(2)]
    other = park(WaitKind.EVENT, wait_event="deploy:other")
    form = admin_client.get(send_url() + "?name=deploy:done").content.decode()
    assert 'value="deploy:done"' in form
    assert "2 runs wait on “deploy:done” now." in form

    # Invalid JSON, NaN, and too deep: the form says why and nothing is sent.
    for payload, error in (
        ("{not json", "The payload is not JSON"),
        ("[NaN]", "NaN and Infinity"),
        ("[" * 150 + "]" * 150, "nests deeper than 100 levels"),
    ):
        response = admin_client.post(send_url(), {"name": "deploy:done", "payload": payload})
        assert response.status_code == 200, payload
        assert error in response.content.decode(), payload
    assert calls == []
    assert {reload(r).status for r in runs} == {RunStatus.WAITING}

    response = admin_client.post(
        send_url(), {"name": "deploy:done", "payload": '{"ok": true}'}, follow=True
    )
    event = AgentEvent.objects.get(name="deploy:done")
    assert response.redirect_chain[-1][0] == event_url(event)
    assert "Sent event “deploy:done”; 2 run(s) were waiting on it and woke." in messages_of(
        response
    )
    assert calls == [("deploy:done", {"ok": True}, {"user": superuser})]
    assert event.payload == {"ok": True}
    assert event.sent_by == superuser
    assert {reload(r).status for r in runs} == {RunStatus.PENDING}
    assert reload(other).status == RunStatus.WAITING
    [entry] = logs_for(event)
    assert entry.action_flag == ADDITION
    assert entry.user == superuser

    # Sent once: a second send changes nothing and says so.
    response = admin_client.post(
        send_url(), {"name": "deploy:done", "payload": '"again"'}, follow=True
    )
    assert any("was sent already" in m for m in messages_of(response))
    event.refresh_from_db()
    assert event.payload == {"ok": True}
    assert len(logs_for(event)) == 1


def test_an_event_nobody_awaits_yet_can_be_sent_and_a_later_wait_does_not_park(
    admin_client: Client, receiver: Any
) -> None:
    admin_client.post(send_url(), {"name": "ready:7", "payload": "[1, 2]"})
    event = AgentEvent.objects.get(name="ready:7")
    assert event.is_sent
    assert [e.action_flag for e in logs_for(event)] == [ADDITION]
    run = durable_agents.start_run("waiter", 'Wait.\n@await_event {"name": "ready:7"}')
    run_worker()
    assert reload(run).status == RunStatus.SUCCEEDED


def test_send_an_awaited_event_from_its_page(admin_client: Client, receiver: Any) -> None:
    run = parked('@await_event {"name": "refund:o-9"}')
    event = AgentEvent.objects.get(name="refund:o-9")
    page = admin_client.get(event_url(event)).content.decode()
    assert "1 run waits on this event" in page
    assert run_url(run) in page
    assert f'action="{event_url(event, "send")}"' in page
    response = admin_client.post(
        event_url(event, "send"), {"payload": '{"status": "refunded"}'}, follow=True
    )
    assert any("Sent event “refund:o-9”" in m for m in messages_of(response))
    assert reload(run).status == RunStatus.PENDING
    assert [e.action_flag for e in logs_for(event)] == [CHANGE]  # the row existed, unsent
    page = response.content.decode()
    assert 'id="send-event-form"' not in page
    assert "refunded" in page
    run_worker()
    done = reload(run)
    assert done.status == RunStatus.SUCCEEDED, done.error
    # The waiting call got the payload; the run refers to the event, which stores it once.
    assert receiver.calls("await_event")[-1]["woken_by"]["payload"] == {"status": "refunded"}
    assert done.woken_by["event"] == "refund:o-9"


def test_sending_events_needs_the_permission(viewer_client: Client, spy: Any) -> None:
    calls = spy("send_event", keywords=True)
    run = park(WaitKind.EVENT, wait_event="gate")
    event = AgentEvent.objects.create(name="gate")
    listing = viewer_client.get(events_url()).content.decode()
    assert "Send an event" not in listing
    page = viewer_client.get(event_url(event)).content.decode()
    assert 'id="send-event-form"' not in page
    assert 'id="send-event-form"' not in viewer_client.get(run_url(run)).content.decode()
    assert viewer_client.get(send_url()).status_code == 403
    assert viewer_client.post(send_url(), {"name": "gate", "payload": "1"}).status_code == 403
    assert viewer_client.post(event_url(event, "send"), {"payload": "1"}).status_code == 403
    # The runs list action is not offered, and posting it anyway does nothing.
    assert "send_events" not in viewer_client.get(runs_url()).content.decode()
    viewer_client.post(
        runs_url(),
        {
            "action": "send_events",
            "_selected_action": [str(run.pk)],
            "post": "yes",
            "event": "gate",
            "payload": "1",
        },
    )
    assert calls == []
    assert not AgentEvent.objects.get(pk=event.pk).is_sent
    assert reload(run).status == RunStatus.WAITING
    assert not LogEntry.objects.exists()


def test_a_person_with_only_the_send_permission_sees_events_and_sends(
    django_user_model: Any,
) -> None:
    client = staff_client(django_user_model, "sender", "send_event")
    run = park(WaitKind.EVENT, wait_event="go")
    assert client.get(events_url()).status_code == 200
    client.post(send_url(), {"name": "go", "payload": ""})
    event = AgentEvent.objects.get(name="go")
    assert event.is_sent
    assert event.payload is None
    assert event.sent_by is not None
    assert event.sent_by.username == "sender"
    assert reload(run).status == RunStatus.PENDING


def test_sending_events_needs_csrf(superuser: Any) -> None:
    park(WaitKind.EVENT, wait_event="csrf")
    client = Client(enforce_csrf_checks=True)
    client.force_login(superuser)
    assert client.post(send_url(), {"name": "csrf", "payload": ""}).status_code == 403
    assert not AgentEvent.objects.filter(name="csrf", sent_at__isnull=False).exists()


def test_the_send_event_action_confirms_then_sends_for_the_runs_listed(
    admin_client: Client, superuser: Any
) -> None:
    waiting = [park(WaitKind.EVENT, wait_event="build:9") for _ in range(2)]
    unlisted = park(WaitKind.EVENT, wait_event="build:9")  # same event, not selected
    timer = park(WaitKind.TIMER, wake_at=timezone.now() + datetime.timedelta(hours=1))
    selected = [str(r.pk) for r in [*waiting, timer]]
    page = admin_client.post(runs_url(), {"action": "send_events", "_selected_action": selected})
    assert page.status_code == 200
    content = page.content.decode()
    assert "Send event “build:9”" in content
    assert "3 run(s) wait on this event in all" in content  # the unlisted one wakes too
    fields = hidden_fields(page)
    assert sorted(fields["_selected_action"]) == sorted(str(r.pk) for r in waiting)
    assert fields["event"] == ["build:9"]
    assert fields["action"] == ["send_events"]
    assert 'name="payload"' in content
    assert "1</strong> selected will be skipped" in content

    # An invalid payload shows the page again, with the error, and sends nothing.
    again = admin_client.post(runs_url(), {**fields, "payload": "{oops"})
    assert again.status_code == 200
    assert "The payload is not JSON" in again.content.decode()
    assert not AgentEvent.objects.filter(name="build:9", sent_at__isnull=False).exists()

    response = admin_client.post(runs_url(), {**fields, "payload": '{"ok": 1}'}, follow=True)
    assert any(
        "Sent event “build:9”: 2 of the 2 listed run(s) woke." in m for m in messages_of(response)
    )
    event = AgentEvent.objects.get(name="build:9")
    assert event.payload == {"ok": 1}
    assert event.sent_by == superuser
    assert {reload(r).status for r in [*waiting, unlisted]} == {RunStatus.PENDING}
    assert reload(timer).status == RunStatus.WAITING
    assert len(logs_for(event)) == 1
    assert all(len(logs_for(r)) == 1 for r in waiting)


def test_the_send_event_action_refuses_mixed_or_stale_selections(admin_client: Client) -> None:
    a = park(WaitKind.EVENT, wait_event="a")
    b = park(WaitKind.EVENT, wait_event="b")
    response = admin_client.post(
        runs_url(),
        {"action": "send_events", "_selected_action": [str(a.pk), str(b.pk)]},
        follow=True,
    )
    assert any("wait on 2 different events" in m for m in messages_of(response))
    timer = park(WaitKind.TIMER, wake_at=timezone.now())
    response = admin_client.post(
        runs_url(), {"action": "send_events", "_selected_action": [str(timer.pk)]}, follow=True
    )
    assert any("None of the selected runs waits on an event" in m for m in messages_of(response))
    # A "Yes" whose runs were woken meanwhile, or that names another event, sends nothing.
    page = admin_client.post(runs_url(), {"action": "send_events", "_selected_action": [a.pk]})
    fields = hidden_fields(page)
    forged = admin_client.post(runs_url(), {**fields, "event": "b", "payload": "1"}, follow=True)
    assert any("Nothing was sent" in m for m in messages_of(forged))
    api.send_event("a", "elsewhere")
    stale = admin_client.post(runs_url(), {**fields, "payload": "1"}, follow=True)
    assert any("Nothing was sent" in m for m in messages_of(stale))
    assert not AgentEvent.objects.filter(name="b").exists()
    assert AgentEvent.objects.get(name="a").payload == "elsewhere"
    # select_across on the "Yes" gets the confirmation page again, never a send.
    api.cancel_run(b.pk)
    c = park(WaitKind.EVENT, wait_event="c")
    page = admin_client.post(runs_url(), {"action": "send_events", "_selected_action": [c.pk]})
    replay = admin_client.post(
        runs_url(), {**hidden_fields(page), "select_across": "1", "payload": "1"}
    )
    assert replay.status_code == 200
    assert "Yes, send it" in replay.content.decode()
    assert not AgentEvent.objects.filter(name="c", sent_at__isnull=False).exists()


# ---------------------------------------------------------------------------------------------
# 4. The operations page


def test_operations_page_counts_waits_by_kind(admin_client: Client) -> None:
    old = timezone.now() - datetime.timedelta(hours=5)
    oldest_timer = park(
        WaitKind.TIMER, wake_at=timezone.now() + datetime.timedelta(hours=1), waiting_since=old
    )
    park(WaitKind.TIMER, wake_at=timezone.now() + datetime.timedelta(hours=1))
    park(WaitKind.EVENT, wait_event="x")
    _, question = park_on_question(f"{SCRIPT} now?")
    response = admin_client.get(operations_url())
    content = response.content.decode()
    rows = {row.kind: row for row in response.context["wait_rows"]}
    assert rows[WaitKind.TIMER].count == 2
    assert rows[WaitKind.TIMER].oldest_run.pk == oldest_timer.pk
    assert rows[WaitKind.EVENT].count == 1
    assert rows[WaitKind.RUNS].count == 0
    assert response.context["waiting_total"] == 4
    assert response.context["questions_open"] == 1
    assert response.context["oldest_question"].pk == question.pk
    assert runs_url("?status__exact=waiting&amp;waits_for=timer") in content
    assert run_url(oldest_timer) in content
    assert question_url(question) in content
    assert SCRIPT not in content


def test_operations_page_queries_are_bounded(admin_client: Client) -> None:
    park_one_of_each("a")

    def count() -> int:
        with CaptureQueriesContext(connection) as ctx:
            assert admin_client.get(operations_url()).status_code == 200
        return len(ctx)

    small = count()
    for label in "bcdef":
        park_one_of_each(label)
    assert count() == small


def test_operations_page_reads_the_oldest_pending_run_with_the_oldest_waits(
    admin_client: Client,
) -> None:
    park_one_of_each("a")
    durable_agents.start_run("tester", "Pending, not claimed yet")
    durable_agents.start_run("tester", "Pending too")
    oldest = AgentRun.objects.filter(status=RunStatus.PENDING).order_by("created_at").first()
    assert oldest is not None
    # The table's total comes from the latest metrics snapshot, as housekeeping takes them
    # every few minutes (without one, the page counts up to 10,000 runs: a query more).
    housekeeping.snapshot_metrics()
    admin_client.get(operations_url())  # caches (content types) warmed
    with CaptureQueriesContext(connection) as ctx:
        response = admin_client.get(operations_url())
    assert response.context["oldest_pending"].pk == oldest.pk
    assert run_url(oldest) in response.content.decode()
    timer = {row.kind: row for row in response.context["wait_rows"]}[WaitKind.TIMER]
    assert timer.oldest_run is not None
    assert timer.oldest_run.status == RunStatus.WAITING
    # Every panel, the session's and the user's reads included.
    assert len(ctx) <= 15, "\n".join(q["sql"][:150] for q in ctx.captured_queries)


# ---------------------------------------------------------------------------------------------
# 5. The transcript: compaction blocks and cache figures


def test_transcript_shows_compaction_blocks_and_cache_usage(admin_client: Client) -> None:
    run = durable_agents.start_run("tester", "A long task")
    turn = {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "claude-test-1",
        "content": [
            {"type": "compaction", "content": f"Summary so far: {SCRIPT} tables checked."},
            {"type": "text", "text": "Going on."},
        ],
        "stop_reason": "end_turn",
        "usage": {
            "input_tokens": 40,
            "output_tokens": 12,
            "cache_read_input_tokens": 0,
            "cache_creation_input_tokens": 0,
            "iterations": [
                {
                    "type": "compaction",
                    "input_tokens": 9000,
                    "output_tokens": 300,
                    "cache_read_input_tokens": 0,
                    "cache_creation_input_tokens": 0,
                },
                {
                    "type": "message",
                    "input_tokens": 40,
                    "output_tokens": 12,
                    "cache_read_input_tokens": 1200,
                    "cache_creation_input_tokens": 300,
                },
            ],
        },
    }
    failed = {
        **turn,
        "id": "msg_2",
        "content": [{"type": "compaction", "content": None}, {"type": "text", "text": "Still."}],
        "usage": {"input_tokens": 5, "output_tokens": 1},
    }
    for seq, body in ((1, turn), (2, failed)):
        AgentStep.objects.create(
            run=run, seq=seq, kind=StepKind.MODEL_TURN, payload=json.dumps(body)
        )
    AgentRun.objects.filter(pk=run.pk).update(last_seq=2)
    page = admin_client.get(run_url(run)).content.decode()
    assert page.count("<strong>Compaction summary</strong>") == 2
    assert f"Summary so far: {ESCAPED} tables checked." in page
    assert SCRIPT not in page
    assert "compaction failed" in page
    # Cache figures summed over the passes, shown when the turn used the cache.
    assert "tokens in 9040 · out 312 · " in page
    assert "cache read 1200 · cache write 300" in page
    assert "2 passes (compaction, message)" in page
    assert page.count('class="da-cache"') == 1  # not on the turn without cache figures
    # The block's whole text is its summary.
    block = reverse("admin:durable_agents_agentrun_step_text", args=[run.pk, 1]) + "?block=0"
    assert admin_client.get(block).content.decode() == f"Summary so far: {SCRIPT} tables checked."


def test_a_real_compacting_run_renders(admin_client: Client) -> None:
    """Usage figures that are not numbers (a hostile body) never break the page."""
    run = durable_agents.start_run("tester", "odd usage")
    body = {
        "content": [{"type": "compaction", "content": {"not": "a string"}}],
        "usage": {"input_tokens": "many", "cache_read_input_tokens": -1, "iterations": "x"},
        "stop_reason": "compaction",
    }
    AgentStep.objects.create(run=run, seq=1, kind=StepKind.MODEL_TURN, payload=json.dumps(body))
    AgentRun.objects.filter(pk=run.pk).update(last_seq=1)
    page = admin_client.get(run_url(run))
    assert page.status_code == 200
    content = page.content.decode()
    assert "Compaction summary" in content
    assert "&quot;not&quot;: &quot;a string&quot;" in content
    assert "da-cache" not in content


# ---------------------------------------------------------------------------------------------
# 6. Bounded pages


def _queries(client: Client, url: str) -> int:
    with CaptureQueriesContext(connection) as ctx:
        response = client.get(url)
    assert response.status_code == 200
    return len(ctx)


def test_runs_list_with_waiting_runs_runs_a_bounded_number_of_queries(
    admin_client: Client, django_assert_max_num_queries: Any
) -> None:
    park_one_of_each("a")
    small = {
        url: _queries(admin_client, url)
        for url in (runs_url(), runs_url("?status__exact=waiting"), questions_url(), events_url())
    }
    for label in "bcdefghij":
        park_one_of_each(label)
    large = {url: _queries(admin_client, url) for url in small}
    assert small == large, (small, large)
    # The list's own queries, plus at most three for what the page's runs wait on.
    with django_assert_max_num_queries(13):
        admin_client.get(runs_url())
    with django_assert_max_num_queries(7):
        admin_client.get(questions_url())
    with django_assert_max_num_queries(7):
        admin_client.get(events_url())


def test_run_page_queries_do_not_grow_with_children_or_questions(
    admin_client: Client, django_assert_max_num_queries: Any
) -> None:
    many, _ = park_on_children(150, ended=40)
    more, _ = park_on_children(300, ended=10)
    for run, count in ((many, 30), (more, 60)):
        AgentQuestion.objects.bulk_create(
            AgentQuestion(
                run=run,
                key=uuid.uuid4().hex,
                question=f"q{i}",
                status=QuestionStatus.ANSWERED,
                answer="a",
            )
            for i in range(count)
        )
    admin_client.get(run_url(many))  # caches (content types) warmed
    assert _queries(admin_client, run_url(many)) == _queries(admin_client, run_url(more))
    # The run page's queries (session, user, run, transcript: 7) plus, at most, the runs
    # awaited, the questions and their count, the children and their count, and the cost of
    # its descendants (one recursive query), its forks, (an active run) the newest progress
    # message, where its live box starts, and the messages waiting in its inbox.
    with django_assert_max_num_queries(16):
        page = admin_client.get(run_url(many)).content.decode()
    assert "Child runs (150)" in page
    assert "50 more not listed" in page
    assert "40 of 150 child runs ended" in page
    assert "Questions (30)" in page
    assert "30 in all" in page


def test_pages_of_missing_or_malformed_ids_are_404(admin_client: Client) -> None:
    for url in (
        reverse("admin:durable_agents_agentquestion_text", args=["nope", "question"]),
        reverse("admin:durable_agents_agentquestion_text", args=[999999, "question"]),
        reverse("admin:durable_agents_agentevent_payload", args=["x"]),
    ):
        assert admin_client.get(url).status_code == 404, url
    assert admin_client.post(answer_url_for("nope"), {"answer": "x"}).status_code == 404
    assert (
        admin_client.post(
            reverse("admin:durable_agents_agentevent_send", args=["12x"]), {"payload": ""}
        ).status_code
        == 404
    )
    run, _ = park_on_question()
    response = admin_client.post(answer_url(run), {"question": "1\x00", "answer": "x"}, follow=True)
    assert response.status_code == 200
    assert any("named no question" in m for m in messages_of(response))


def answer_url_for(run_id: str) -> str:
    return reverse("admin:durable_agents_agentrun_answer", args=[run_id])
