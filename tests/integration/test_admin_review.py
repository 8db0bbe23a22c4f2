"""The admin after a security review: what a person decides on reads as it is stored
(invisible and direction-changing characters drawn as markers), the dead letter's
confirmation acts only on the runs it showed, a decision is audited once, list pages answer
hostile query strings without a 500, and text that cannot be encoded never loses its audit."""

from __future__ import annotations

import html
import re
import threading
from typing import Any

import pytest
from django.contrib import admin
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import Permission
from django.db import connection
from django.db.models import CharField, TextField
from django.db.models.functions import Now
from django.test import Client
from django.urls import reverse
from django.utils import translation
from django.utils.html import escape
from django.utils.http import urlencode

import durable_agents
from durable_agents import api, store
from durable_agents.admin.entries import PageEntry
from durable_agents.models import (
    AgentEvent,
    AgentQuestion,
    AgentRun,
    ConcurrencyKey,
    IntentStatus,
    QuestionStatus,
    RunStatus,
    ToolIntent,
    WaitKind,
)
from tests.integration.conftest import written_intent
from tests.integration.test_admin import (
    hidden_fields,
    intent_url,
    intents_url,
    messages_of,
    parked_intent,
)
from tests.integration.test_admin_waits import park

# What the person reads, laid out by the browser: "DELETE FROM users /* keep admins */ WHERE
# id = 42". What runs: a DELETE without a WHERE (it is inside the comment).
DISGUISED = "DELETE FROM users /*\u202e \u2066WHERE id = 42\u2069 keep admins */"
HIDDEN = ("\u202e", "\u2066", "\u2069")
WARNING = "This value contains 3 invisible or direction-changing characters"
# Every invisible or direction-changing character a page must never send as it is.
RAW = re.compile("[\u00ad\u180e\u200b-\u200f\u202a-\u202e\u2060-\u2064\u2066-\u2069\ufeff]")


def disguised_intent(sql: str = DISGUISED) -> ToolIntent:
    """A run waiting on a pending ``run_sql`` intent whose input is ``sql``."""
    return written_intent("Clean up the users.", "run_sql", {"sql": sql}, says=f"I will run {sql}")


def assert_revealed(html: str) -> None:
    """Each hidden character is a titled marker, none is sent as it is, and a warning says
    how many there are."""
    assert not RAW.search(html), RAW.findall(html)
    assert (
        '<span class="da-invisible" title="U+202E RIGHT-TO-LEFT OVERRIDE">⟨U+202E⟩</span>' in html
    )
    assert "⟨U+2066⟩" in html
    assert "⟨U+2069⟩" in html
    assert WARNING in html


# ---------------------------------------------------------------------------------------------
# What a person decides on reads as it is stored


@pytest.mark.django_db
def test_a_disguised_input_reads_as_stored_on_every_page_that_decides_it(
    admin_client: Client,
) -> None:
    intent = disguised_intent()
    page = admin_client.get(intent_url(intent))
    assert page.status_code == 200
    assert_revealed(page.content.decode())

    listing = admin_client.get(intents_url())
    assert listing.status_code == 200
    assert_revealed(listing.content.decode())

    confirm = admin_client.get(intent_url(intent, "approve"))
    assert confirm.status_code == 200
    assert_revealed(confirm.content.decode())

    bulk = admin_client.post(
        intents_url(), {"action": "approve_intents", "_selected_action": [intent.pk], "index": 0}
    )
    assert bulk.status_code == 200
    assert_revealed(bulk.content.decode())

    reject = admin_client.get(intent_url(intent, "reject"))
    assert_revealed(reject.content.decode())

    # What was shown is what is approved: the fingerprint is of the stored input, untouched.
    admin_client.post(intent_url(intent, "approve"), hidden_fields(confirm))
    intent.refresh_from_db()
    assert intent.status == IntentStatus.APPROVED
    assert intent.input == {"sql": DISGUISED}


@pytest.mark.django_db
def test_the_bulk_approval_of_a_disguised_input_approves_the_stored_value(
    admin_client: Client,
) -> None:
    intent = disguised_intent()
    data = {"action": "approve_intents", "_selected_action": [intent.pk]}
    confirm = admin_client.post(intents_url(), {**data, "index": 0})
    response = admin_client.post(intents_url(), hidden_fields(confirm), follow=True)
    assert any("Approved 1 intent(s)" in m for m in messages_of(response))
    assert LogEntry.objects.count() == 1


@pytest.mark.django_db
def test_every_page_that_shows_a_value_to_decide_on_draws_hidden_characters_as_markers(
    admin_client: Client,
) -> None:
    intent = disguised_intent()
    run = intent.run
    AgentRun.objects.filter(pk=run.pk).update(task=f"Clean up: {DISGUISED}")
    asking = park(WaitKind.QUESTION)
    question = AgentQuestion.objects.create(
        run=asking, key=str(asking.wait_key), question=f"May I run {DISGUISED}?"
    )
    answered = park(WaitKind.QUESTION)
    AgentQuestion.objects.create(
        run=answered,
        key=str(answered.wait_key),
        question="Which rows?",
        status=QuestionStatus.ANSWERED,
        answer=DISGUISED,
    )
    name = "deploy:\u202eevil\u202c"
    waiting = park(WaitKind.EVENT, wait_event=name)
    event = AgentEvent.objects.create(name=name)
    sent = AgentEvent.objects.create(  # type: ignore[misc]  # a JSONTextField takes any JSON value
        name="sent", payload={"sql": DISGUISED}, sent_at=Now()
    )
    key = ConcurrencyKey.objects.create(key="tenant:\u2067acme\u2069")
    AgentRun.objects.filter(pk=run.pk).update(concurrency_key=key.key)
    pages = {
        "run page": reverse("admin:durable_agents_agentrun_change", args=[run.pk]),
        "runs list": reverse("admin:durable_agents_agentrun_changelist"),
        "question page": reverse("admin:durable_agents_agentquestion_change", args=[question.pk]),
        "questions list": reverse("admin:durable_agents_agentquestion_changelist"),
        "asking run page": reverse("admin:durable_agents_agentrun_change", args=[asking.pk]),
        "answered run page": reverse("admin:durable_agents_agentrun_change", args=[answered.pk]),
        "waiting run page": reverse("admin:durable_agents_agentrun_change", args=[waiting.pk]),
        "event page": reverse("admin:durable_agents_agentevent_change", args=[event.pk]),
        "sent event page": reverse("admin:durable_agents_agentevent_change", args=[sent.pk]),
        "events list": reverse("admin:durable_agents_agentevent_changelist"),
        "send page": reverse("admin:durable_agents_agentevent_add")
        + "?"
        + urlencode({"name": name}),
        "keys list": reverse("admin:durable_agents_concurrencykey_changelist"),
        "key page": reverse("admin:durable_agents_concurrencykey_change", args=[key.pk]),
    }
    for page, url in pages.items():
        response = admin_client.get(url)
        assert response.status_code == 200, page
        content = response.content.decode()
        assert not RAW.search(content), (page, RAW.findall(content))
        assert '<span class="da-invisible-warning" role="alert">' in content, page
        assert "&lt;span" not in content, page  # drawn, not escaped twice
    # The send forms post the name back exactly (as character references in their HTML).
    waiting_page = admin_client.get(pages["waiting run page"]).content.decode()
    assert 'value="deploy:&#x202E;evil&#x202C;"' in waiting_page
    runs = reverse("admin:durable_agents_agentrun_changelist")
    data = {"action": "send_events", "_selected_action": [waiting.pk], "index": 0}
    confirm = admin_client.post(runs, data)
    assert not RAW.search(confirm.content.decode())
    # What a browser posts: the references decoded.
    fields = {k: [html.unescape(v) for v in vs] for k, vs in hidden_fields(confirm).items()}
    assert fields["event"] == [name]
    admin_client.post(runs, {**fields, "payload": "1"})
    assert AgentEvent.objects.get(name=name).is_sent


# ---------------------------------------------------------------------------------------------
# The dead letter's confirmation acts on the runs it showed


def dead_runs(count: int, error: str = "gone (request id req_1)") -> list[AgentRun]:
    runs = [durable_agents.start_run("tester", f"task {i}") for i in range(count)]
    for run in runs:
        assert store.current().dead_letter(run.pk, error)
    return runs


def dead_group_url(action: str, cause: str) -> str:
    url = reverse("admin:durable_agents_agentrun_dead_letter_confirm", args=[action])
    return f"{url}?{urlencode({'cause': cause})}"


def statuses(*runs: AgentRun) -> list[str]:
    return [AgentRun.objects.get(pk=run.pk).status for run in runs]


@pytest.mark.django_db
def test_the_dead_letter_confirmation_acts_only_on_the_runs_it_showed(
    admin_client: Client, superuser: Any
) -> None:
    shown = dead_runs(2)
    other = dead_runs(1, error="another cause")[0]
    cause = AgentRun.objects.get(pk=shown[0].pk).dead_cause
    url = dead_group_url("requeue_runs", cause)
    confirm = admin_client.get(url)
    assert confirm.status_code == 200
    late = dead_runs(1, error="gone (request id req_2)")[0]  # the same cause, never shown
    fields = hidden_fields(confirm)
    fields["_selected_action"].append(str(other.pk))  # a run of another group, forged in

    response = admin_client.post(url, fields)
    assert response.status_code == 302
    assert response["Location"] == reverse("admin:durable_agents_agentrun_dead_letter")
    assert statuses(*shown) == [RunStatus.PENDING] * 2
    assert statuses(late, other) == [RunStatus.DEAD, RunStatus.DEAD]
    assert LogEntry.objects.filter(user=superuser).count() == 2
    assert f'action="{escape(url)}"' in confirm.content.decode()  # "Yes" posts back here
    page = admin_client.get(response["Location"])
    assert any("Requeued 2 run(s); 1 skipped" in m for m in messages_of(page))

    # A POST that is not a confirmation's "Yes" (the group's filter alone) changes nothing.
    for data in ({"action": "requeue_runs", "post": "yes"}, {"_selected_action": [late.pk]}):
        response = admin_client.post(url, data)
        assert response.status_code == 302
    assert statuses(late) == [RunStatus.DEAD]
    malformed = {**fields, "_selected_action": ["not-a-uuid"]}
    assert admin_client.post(url, malformed).status_code == 302


@pytest.mark.django_db
def test_the_dead_letter_confirmation_needs_the_permission_and_csrf(
    django_user_model: Any, superuser: Any
) -> None:
    run = dead_runs(1)[0]
    url = dead_group_url("cancel_runs", AgentRun.objects.get(pk=run.pk).dead_cause)
    data = {"action": "cancel_runs", "post": "yes", "_selected_action": [run.pk]}
    viewer = django_user_model.objects.create_user("viewer", password="pw", is_staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_agentrun"))
    client = Client()
    client.force_login(viewer)
    assert client.post(url, data).status_code == 403
    forged = Client(enforce_csrf_checks=True)
    forged.force_login(superuser)
    assert forged.post(url, data).status_code == 403
    assert statuses(run) == [RunStatus.DEAD]


# ---------------------------------------------------------------------------------------------
# A decision is audited once: by the request that made it


def at_once(monkeypatch: pytest.MonkeyPatch, name: str, *requests: Any) -> list[Any]:
    """Run each request (a callable) in a thread of its own, each held at ``api.<name>``
    until all have reached it: every request has read the object before any changes it, as
    when one person clicks in two tabs at once. The store's lock then orders the changes."""
    barrier = threading.Barrier(len(requests), timeout=60)
    real = getattr(api, name)

    def held(*args: Any, **kwargs: Any) -> Any:
        barrier.wait()
        return real(*args, **kwargs)

    monkeypatch.setattr(api, name, held)
    results: list[Any] = [None] * len(requests)

    def run(index: int) -> None:
        try:
            results[index] = requests[index]()
        except Exception as exc:  # noqa: BLE001 - the test asserts on it below
            results[index] = exc
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(requests))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads)
    return results


def logged_in(user: Any) -> Client:
    client = Client()
    client.force_login(user)
    return client


def post_each(user: Any, url: str, *datas: dict[str, Any]) -> list[Any]:
    """One callable per data: a POST of it to ``url`` from a client of its own (a tab)."""
    clients = [logged_in(user) for _ in datas]
    return [
        (lambda client=client, data=data: client.post(url, data).status_code)
        for client, data in zip(clients, datas, strict=True)
    ]


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_two_rejects_at_once_by_one_person_write_one_log_entry(
    monkeypatch: pytest.MonkeyPatch, superuser: Any
) -> None:
    intent = parked_intent()
    url = intent_url(intent, "reject")
    requests = post_each(superuser, url, {"reason": "first tab"}, {"reason": "second tab"})
    assert at_once(monkeypatch, "reject_intent", *requests) == [302, 302]
    intent.refresh_from_db()
    assert intent.status == IntentStatus.REJECTED
    entry = LogEntry.objects.get()  # one decision, one audit: the one that was made
    assert entry.get_change_message() == f"Rejected: {intent.reason}."


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_two_approvals_at_once_by_one_person_write_one_log_entry(
    monkeypatch: pytest.MonkeyPatch, superuser: Any
) -> None:
    intent = parked_intent()
    url = intent_url(intent, "approve")
    fields = hidden_fields(logged_in(superuser).get(url))
    assert at_once(monkeypatch, "approve_intent", *post_each(superuser, url, fields, fields)) == [
        302,
        302,
    ]
    assert ToolIntent.objects.get(pk=intent.pk).status == IntentStatus.APPROVED
    assert LogEntry.objects.count() == 1


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_two_resolutions_at_once_by_one_person_write_one_log_entry(
    monkeypatch: pytest.MonkeyPatch, superuser: Any
) -> None:
    intent = parked_intent(IntentStatus.UNKNOWN)
    url = intent_url(intent, "resolve")
    data = {"happened": "no"}
    assert at_once(monkeypatch, "resolve_intent", *post_each(superuser, url, data, data)) == [
        302,
        302,
    ]
    assert ToolIntent.objects.get(pk=intent.pk).status == IntentStatus.APPROVED
    assert LogEntry.objects.count() == 1


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_two_answers_at_once_by_one_person_write_one_answer_to_the_log(
    monkeypatch: pytest.MonkeyPatch, superuser: Any
) -> None:
    run = park(WaitKind.QUESTION)
    question = AgentQuestion.objects.create(run=run, key=str(run.wait_key), question="Go?")
    url = reverse("admin:durable_agents_agentquestion_answer", args=[question.pk])
    data = {"question": question.pk, "answer": "yes"}
    assert at_once(monkeypatch, "answer_question", *post_each(superuser, url, data, data)) == [
        302,
        302,
    ]
    # The answer is logged on the question and on its run: once each.
    assert LogEntry.objects.count() == 2


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_two_sends_of_an_event_at_once_by_one_person_write_one_log_entry(
    monkeypatch: pytest.MonkeyPatch, superuser: Any
) -> None:
    park(WaitKind.EVENT, wait_event="deploy:42")
    url = reverse("admin:durable_agents_agentevent_add")
    data = {"name": "deploy:42", "payload": '{"ok": true}'}
    assert at_once(monkeypatch, "send_event", *post_each(superuser, url, data, data)) == [
        302,
        302,
    ]
    assert AgentEvent.objects.get(name="deploy:42").is_sent
    assert LogEntry.objects.count() == 1


# ---------------------------------------------------------------------------------------------
# Text that cannot be encoded never costs the audit


@pytest.mark.django_db
def test_an_event_payload_with_a_lone_surrogate_is_sent_and_audited(
    admin_client: Client, superuser: Any
) -> None:
    waiting = park(WaitKind.EVENT, wait_event="deploy:7")
    url = reverse("admin:durable_agents_agentevent_add")
    payload = '{"note": "half a pair: \\ud800"}'  # valid JSON: a lone surrogate, escaped
    response = admin_client.post(url, {"name": "deploy:7", "payload": payload})
    assert response.status_code == 302
    event = AgentEvent.objects.get(name="deploy:7")
    assert event.payload == {"note": "half a pair: \ud800"}  # sent exactly as given
    entry = LogEntry.objects.get(user=superuser)
    assert "half a pair: \ufffd" in entry.get_change_message()
    assert AgentRun.objects.get(pk=waiting.pk).status == RunStatus.PENDING
    # The same from the runs list's action, which also logs each run it woke.
    other = park(WaitKind.EVENT, wait_event="deploy:8")
    data = {"action": "send_events", "_selected_action": [other.pk]}
    runs = reverse("admin:durable_agents_agentrun_changelist")
    confirm = admin_client.post(runs, {**data, "index": 0})
    fields = {**hidden_fields(confirm), "payload": payload}
    assert admin_client.post(runs, fields).status_code == 302
    assert AgentEvent.objects.get(name="deploy:8").is_sent
    assert LogEntry.objects.filter(user=superuser).count() == 3


# ---------------------------------------------------------------------------------------------
# Every list answers a hostile query string without a 500

APP_ADMINS = [
    (model, model_admin)
    for model, model_admin in admin.site._registry.items()
    if model._meta.app_label == "durable_agents"
    # The index's entries for the operations and dead-letter pages have no list: they
    # redirect to their page and never read a parameter.
    and not isinstance(model_admin, PageEntry)
]


def hostile_queries(model: Any, model_admin: Any) -> list[dict[str, str]]:
    """Lookups the admin does not ship, on fields the model has, and values no list filter
    expects, for every filter parameter the list does ship."""
    texts = [f.name for f in model._meta.get_fields() if isinstance(f, CharField | TextField)]
    field = texts[0]
    queries = [
        {f"{field}__regex": "["},
        {f"{field}__iregex": "(?<"},
        {"pk__regex": "["},
        {"id__gt": "not a number"},
        {"id__in": "1,x"},
        {"nonexistent": "1"},
        {f"{field}__nonexistentlookup": "1"},
        {"pk": "9" * 40},
        {"p": "9" * 40},
        {"p": "-3"},
        {"o": "99.-x"},
        {"all": "", "p": "2"},
        {"q": "é" * 150},
    ]
    for value in ("[", "9" * 40, "-1", "\ufffd"):
        for name in ("status__exact", "status__isnull", "created_at__gte", "created_at__lt"):
            queries.append({name: value})
        for item in model_admin.list_filter:
            if isinstance(item, str | tuple):
                path = item[0] if isinstance(item, tuple) else item
                queries.extend({f"{path}{suffix}": value} for suffix in ("__exact", "__isnull"))
            else:
                queries.append({item.parameter_name: value})
        queries.extend({name: value} for name in getattr(model_admin, "list_lookups", ()))
    return queries


@pytest.mark.django_db
@pytest.mark.parametrize(("model", "model_admin"), APP_ADMINS, ids=lambda v: str(v))
def test_every_list_answers_hostile_lookups_without_a_500(
    admin_client: Client, model: Any, model_admin: Any
) -> None:
    parked_intent()
    url = reverse(f"admin:durable_agents_{model._meta.model_name}_changelist")
    for query in hostile_queries(model, model_admin):
        response = admin_client.get(url, query)
        assert response.status_code in (200, 302, 400), (query, response.status_code)
    # An unshipped lookup is Django's invalid lookup: the list again, with ?e=1.
    response = admin_client.get(url, {"task__regex": "[", "tool__regex": "[", "id__gt": "x"})
    assert response.status_code == 302
    assert response["Location"].endswith("?e=1")


@pytest.mark.django_db
def test_a_search_term_past_the_limit_is_refused_with_a_message(admin_client: Client) -> None:
    url = reverse("admin:durable_agents_agentrun_changelist")
    response = admin_client.get(url, {"q": "x" * 201, "status__exact": "dead"}, follow=True)
    assert response.redirect_chain[0][0] == f"{url}?status__exact=dead"
    assert any("longer than 200 characters" in m for m in messages_of(response))
    assert admin_client.get(url, {"q": "x" * 200}).status_code == 200


# ---------------------------------------------------------------------------------------------
# The warning in the site's language


@pytest.mark.django_db
def test_the_warning_is_german_for_a_german_site(settings: Any, admin_client: Client) -> None:
    settings.LANGUAGE_CODE = "de"
    translation.deactivate()  # nothing active: the project's language applies
    try:
        html = admin_client.get(intent_url(disguised_intent())).content.decode()
    finally:
        translation.deactivate()
    assert "Dieser Wert enthält 3 unsichtbare oder die Schreibrichtung ändernde Zeichen" in html
