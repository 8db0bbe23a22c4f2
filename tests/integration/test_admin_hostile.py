"""The admin against hostile input and races: confirmation pages act on what they
listed, a huge run renders a small page, malformed ids are 404s, text that cannot be encoded is
marked, the dead letter groups by cause, search finds what operators see, and an approval
approves exactly the input that was shown."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from django import forms
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import Permission
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

import durable_agents
from durable_agents import causes
from durable_agents.admin import format as views
from durable_agents.admin.forms import RejectForm, StartRunForm
from durable_agents.declare.agents import Agent, registry
from durable_agents.models import (
    AgentRun,
    AgentStep,
    IntentStatus,
    RunStatus,
    StepKind,
    ToolEffect,
    ToolIntent,
    short_id,
)
from tests.integration.test_admin import (
    SCRIPT,
    hidden_fields,
    intent_url,
    intents_url,
    make_runs,
    messages_of,
    parked_intent,
    run_url,
    runs_url,
)


@pytest.fixture
def viewer_client(django_user_model: Any) -> Client:
    """Staff who may look at runs and intents but neither operate nor decide."""
    user = django_user_model.objects.create_user("viewer", password="pw", is_staff=True)
    user.user_permissions.add(
        *Permission.objects.filter(codename__in=["view_agentrun", "view_toolintent"])
    )
    client = Client()
    client.force_login(user)
    return client


def statuses(*objects: Any) -> list[str]:
    return [type(o).objects.get(pk=o.pk).status for o in objects]


def step_text_url(run: AgentRun, seq: int) -> str:
    return reverse("admin:durable_agents_agentrun_step_text", args=[run.pk, seq])


def dead_letter_url() -> str:
    return reverse("admin:durable_agents_agentrun_dead_letter")


def dead_group_url(group: Any, action: str) -> str:
    """The confirmation of a dead-letter group's requeue or cancel."""
    return (
        reverse("admin:durable_agents_agentrun_dead_letter_confirm", args=[action])
        + "?"
        + group.query
    )


# ---------------------------------------------------------------------------------------------
# 3. A confirmation acts on the ids it listed, never on a replayed filter


@pytest.mark.django_db
def test_select_all_approval_never_decides_an_intent_created_after_the_page(
    admin_client: Client,
) -> None:
    shown = [parked_intent(table=f"t{i}") for i in range(3)]
    data: dict[str, str | list[str]] = {"action": "approve_intents", "select_across": "1"}
    data["_selected_action"] = [str(shown[0].pk)]
    url = intents_url() + "?status__exact=pending"
    confirm = admin_client.post(url, {**data, "index": 0})
    assert confirm.status_code == 200
    fields = hidden_fields(confirm)
    assert fields["select_across"] == ["0"]
    assert sorted(fields["_selected_action"]) == sorted(str(i.pk) for i in shown)

    late = parked_intent(table="created_after_the_page")
    admin_client.post(url, fields)
    assert statuses(*shown) == [IntentStatus.APPROVED] * 3
    assert statuses(late) == [IntentStatus.PENDING]


@pytest.mark.django_db
def test_a_yes_that_carries_select_across_is_not_acted_on(admin_client: Client) -> None:
    """A forged (or old-style) "Yes" replaying the filter gets the confirmation page."""
    intent = parked_intent()
    response = admin_client.post(
        intents_url(),
        {
            "action": "approve_intents",
            "select_across": "1",
            "_selected_action": [str(intent.pk)],
            "post": "yes",
        },
    )
    assert response.status_code == 200
    assert "Yes, approve them" in response.content.decode()
    assert statuses(intent) == [IntentStatus.PENDING]


@pytest.mark.django_db
def test_select_all_requeue_never_touches_a_run_that_died_after_the_page(
    admin_client: Client,
) -> None:
    dead = make_runs(3, RunStatus.DEAD, error="boom")
    url = runs_url("?status__exact=dead")
    data = {"action": "requeue_runs", "select_across": "1", "_selected_action": [str(dead[0].pk)]}
    confirm = admin_client.post(url, {**data, "index": 0})
    fields = hidden_fields(confirm)
    assert sorted(fields["_selected_action"]) == sorted(str(r.pk) for r in dead)

    late = make_runs(1, RunStatus.DEAD, error="boom")[0]
    response = admin_client.post(url, fields, follow=True)
    assert any("Requeued 3 run(s); 0 skipped" in m for m in messages_of(response))
    assert statuses(*dead) == [RunStatus.PENDING] * 3
    assert statuses(late) == [RunStatus.DEAD]


@pytest.mark.django_db
def test_a_confirmation_lists_at_most_its_limit_and_says_so(
    admin_client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("durable_agents.admin.run_actions.RUN_ACTION_LIMIT", 2)
    runs = make_runs(3, RunStatus.PENDING)
    confirm = admin_client.post(
        runs_url(),
        {
            "action": "cancel_runs",
            "select_across": "1",
            "_selected_action": [str(runs[0].pk)],
            "index": 0,
        },
    )
    content = confirm.content.decode()
    assert len(hidden_fields(confirm)["_selected_action"]) == 2
    assert "<strong>1</strong> more match but are not listed" in content
    admin_client.post(runs_url(), hidden_fields(confirm))
    assert sorted(statuses(*runs)).count(RunStatus.CANCELLED) == 2


@pytest.mark.django_db
def test_malformed_ids_posted_to_an_action_change_nothing(admin_client: Client) -> None:
    intent = parked_intent()
    for bad in ("abc", "1\x00", str(10**30)):
        response = admin_client.post(
            intents_url(),
            {"action": "approve_intents", "_selected_action": [bad, intent.pk], "post": "yes"},
            follow=True,
        )
        assert response.status_code == 200
        assert any("Malformed ids" in m for m in messages_of(response))
    response = admin_client.post(
        runs_url(), {"action": "cancel_runs", "_selected_action": ["not-a-uuid"], "index": 0}
    )
    assert response.status_code == 302
    assert statuses(intent) == [IntentStatus.PENDING]


# ---------------------------------------------------------------------------------------------
# 9. The run page has a size limit

BIG = 1_000_000  # characters of each large text


def huge_run(steps: int = 2_000, big_steps: int = 52) -> AgentRun:
    """A run of ``steps`` steps written directly: model turns that call a tool and tool
    results. The newest ``big_steps`` carry 1 MB texts (enough for the first page and the
    next), and so do their effects' results; older ones are small, to keep the test fast."""
    run = durable_agents.start_run("tester", "a very long run")
    big = "y" * BIG
    rows, effects = [], []
    for seq in range(1, steps):
        large = seq >= steps - big_steps
        text = big if large else f"turn {seq}"
        if seq % 2:
            payload = {
                "id": f"msg_{seq}",
                "type": "message",
                "role": "assistant",
                "model": "claude-test-1",
                "content": [
                    {"type": "text", "text": text},
                    {"type": "tool_use", "id": f"toolu_{seq}", "name": "lookup", "input": {}},
                ],
                "stop_reason": "tool_use",
                "usage": {"input_tokens": 1, "output_tokens": 1},
            }
            rows.append(
                AgentStep(
                    run=run,
                    seq=seq,
                    kind=StepKind.MODEL_TURN,
                    payload=json.dumps(payload),
                    request_id=f"req_{seq}",
                )
            )
            effects.append(
                ToolEffect(
                    key=f"{run.pk.hex}{seq:08d}",
                    run=run,
                    seq=seq,
                    call_index=0,
                    tool="lookup",
                    result=text,
                )
            )
        else:
            block = {"type": "tool_result", "tool_use_id": f"toolu_{seq - 1}", "content": text}
            rows.append(
                AgentStep(run=run, seq=seq, kind=StepKind.TOOL_RESULT, payload=json.dumps([block]))
            )
    AgentStep.objects.bulk_create(rows, batch_size=100)
    ToolEffect.objects.bulk_create(effects, batch_size=100)
    AgentRun.objects.filter(pk=run.pk).update(last_seq=steps - 1, status=RunStatus.SUCCEEDED)
    run.refresh_from_db()
    return run


@pytest.mark.django_db
def test_run_page_of_a_huge_run_stays_under_a_megabyte(admin_client: Client) -> None:
    run = huge_run()
    with CaptureQueriesContext(connection) as queries:
        response = admin_client.get(run_url(run))
    assert response.status_code == 200
    assert len(response.content) < 1_000_000, len(response.content)
    content = response.content.decode()
    # The newest steps, cut with links to the whole; the oldest are on other pages.
    assert 'id="seq-1999"' in content
    assert 'id="seq-1950"' in content
    assert 'id="seq-1949"' not in content
    assert 'id="seq-1"' not in content
    assert "Transcript (2000 steps): steps 1950 to 1999, page 1 of 40" in content
    assert "the whole text (1000000 characters)" in content
    assert "?page=2#transcript" in content
    # The step before the page names the tool whose result opens it.
    first = re.search(r'id="seq-1950".*?</div>\s*</div>', content, re.S)
    assert first
    assert "result of lookup" in first.group()
    # The effects' results are never read for the page (they would be 1 MB each).
    effect_sql = [q["sql"] for q in queries.captured_queries if '"tool_effect"' in q["sql"]]
    assert effect_sql
    assert not any('"tool_effect"."result"' in sql for sql in effect_sql)

    older = admin_client.get(run_url(run) + "?page=2")
    assert older.status_code == 200
    assert len(older.content) < 1_000_000
    assert 'id="seq-1949"' in older.content.decode()
    # The whole text of a step's block, as plain text that no browser runs.
    whole = admin_client.get(step_text_url(run, 1999) + "?block=0")
    assert whole.status_code == 200
    assert whole["Content-Type"] == "text/plain; charset=utf-8"
    assert whole["X-Content-Type-Options"] == "nosniff"
    assert len(whole.content) == BIG


@pytest.mark.django_db
def test_run_page_query_count_does_not_grow_with_the_run(admin_client: Client) -> None:
    small, large = huge_run(steps=20, big_steps=0), huge_run(steps=400, big_steps=0)

    def count(run: AgentRun) -> int:
        with CaptureQueriesContext(connection) as ctx:
            assert admin_client.get(run_url(run)).status_code == 200
        return len(ctx)

    assert count(small) == count(large)


@pytest.mark.django_db
def test_transcript_pages_and_jumping_to_a_step(admin_client: Client) -> None:
    run = huge_run(steps=120, big_steps=0)
    page = admin_client.get(run_url(run) + "?seq=5")
    assert page.status_code == 200
    content = page.content.decode()
    assert 'id="seq-5"' in content
    assert "page 3 of 3" in content
    for bad in ("abc", "-4", "999", "1\x00"):
        assert admin_client.get(run_url(run), {"page": bad}).status_code == 200
        assert admin_client.get(run_url(run), {"seq": bad}).status_code == 200


@pytest.mark.django_db
def test_whole_texts_of_steps_effects_and_fields(
    admin_client: Client, viewer_client: Client, client: Client
) -> None:
    run = durable_agents.start_run("tester", f"{SCRIPT}\n" + "t" * 10_000)
    AgentRun.objects.filter(pk=run.pk).update(
        status=RunStatus.DEAD, error=f"{SCRIPT} " + "e" * 10_000
    )
    effect = ToolEffect.objects.create(  # type: ignore[misc]  # a JSONTextField takes any JSON value; the stubs say str
        key="k" * 64, run=run, seq=1, call_index=0, tool="lookup", result={"html": SCRIPT}
    )
    task = reverse("admin:durable_agents_agentrun_text", args=[run.pk, "task"])
    error = reverse("admin:durable_agents_agentrun_text", args=[run.pk, "error"])
    result = reverse("admin:durable_agents_agentrun_effect_text", args=[run.pk, effect.key])

    page = admin_client.get(run_url(run)).content.decode()
    assert task in page
    assert error in page  # the fields are cut, with links
    for url, expected in ((task, run.task), (step_text_url(run, 0), run.task)):
        response = viewer_client.get(url)
        assert response.status_code == 200
        assert response.content.decode() == expected
        assert response["X-Content-Type-Options"] == "nosniff"
    assert viewer_client.get(error).content.decode().startswith(SCRIPT)
    assert json.loads(viewer_client.get(result).content) == {"html": SCRIPT}
    # Staff only; unknown fields, steps, blocks and effects are 404s.
    assert client.get(task).status_code == 302  # to the login page
    for url in (
        reverse("admin:durable_agents_agentrun_text", args=[run.pk, "fingerprint"]),
        step_text_url(run, 7),
        step_text_url(run, 0) + "?block=x",
        reverse("admin:durable_agents_agentrun_effect_text", args=[run.pk, "nope"]),
    ):
        assert admin_client.get(url).status_code == 404, url


# ---------------------------------------------------------------------------------------------
# 10. 404 for malformed ids; form errors for bad reasons; the model is a choice

MALFORMED_IDS = ("abc", "1%00", "%ED%A0%80", str(10**30), "-1", "1.5")


@pytest.mark.django_db
@pytest.mark.parametrize("bad", MALFORMED_IDS)
def test_malformed_ids_are_404_on_every_object_view(admin_client: Client, bad: str) -> None:
    admin = "/admin/durable_agents"
    posts = [
        f"{admin}/toolintent/{bad}/approve/",
        f"{admin}/toolintent/{bad}/reject/",
        f"{admin}/toolintent/{bad}/resolve/",
        f"{admin}/agentrun/{bad}/cancel/",
        f"{admin}/agentrun/{bad}/requeue/",
    ]
    gets = [
        f"{admin}/toolintent/{bad}/approve/",
        f"{admin}/toolintent/{bad}/reject/",
        f"{admin}/agentrun/{bad}/steps/0/",
        f"{admin}/agentrun/{bad}/effects/k/",
        f"{admin}/agentrun/{bad}/text/task/",
    ]
    for url in posts:
        assert admin_client.post(url, {"reason": "x", "happened": "no"}).status_code == 404, url
    for url in gets:
        assert admin_client.get(url).status_code == 404, url


@pytest.mark.django_db
def test_a_nul_in_a_reject_reason_is_a_form_error(admin_client: Client) -> None:
    intent = parked_intent()
    for reason in ("a\x00b", "", "   "):
        response = admin_client.post(intent_url(intent, "reject"), {"reason": reason})
        assert response.status_code == 200, reason
        assert 'class="errorlist' in response.content.decode()
        assert "Nothing was rejected" in response.content.decode()
    assert statuses(intent) == [IntentStatus.PENDING]
    assert not LogEntry.objects.exists()
    # A lone surrogate cannot come through an HTTP form (it is not UTF-8) but is refused too.
    form = RejectForm({"reason": "lone \ud800"})
    assert not form.is_valid()
    assert "reason" in form.errors


@pytest.mark.django_db
def test_a_bulk_reject_needs_a_reason(admin_client: Client) -> None:
    intent = parked_intent()
    data = {"action": "reject_intents", "_selected_action": [intent.pk]}
    confirm = admin_client.post(intents_url(), {**data, "index": 0})
    for reason in ("", "x\x00y"):
        response = admin_client.post(intents_url(), {**hidden_fields(confirm), "reason": reason})
        assert response.status_code == 200
        assert "Nothing was rejected" in response.content.decode()
    assert statuses(intent) == [IntentStatus.PENDING]
    admin_client.post(intents_url(), {**hidden_fields(confirm), "reason": "no"})
    assert statuses(intent) == [IntentStatus.REJECTED]


@pytest.mark.django_db
def test_a_nul_in_a_resolution_is_an_error_message(admin_client: Client) -> None:
    intent = parked_intent(IntentStatus.UNKNOWN)
    response = admin_client.post(
        intent_url(intent, "resolve"), {"happened": "yes", "result": "a\x00b"}, follow=True
    )
    assert response.status_code == 200
    assert any("Null characters are not allowed" in m for m in messages_of(response))
    assert statuses(intent) == [IntentStatus.UNKNOWN]


@pytest.mark.django_db
def test_a_nul_in_a_search_or_filter_is_not_a_500(admin_client: Client) -> None:
    for url in (runs_url(), intents_url()):
        for params in ({"q": "a\x00b"}, {"tool": "\x00"}, {"model": "\x00"}):
            response = admin_client.get(url, params, follow=True)
            assert response.status_code == 200, (url, params)
            assert any("NUL character" in m for m in messages_of(response)), (url, params)


@pytest.fixture
def two_model_agent() -> Iterator[None]:
    """An agent whose versions use two models (registered for this test only)."""
    for version, model in (("v1", "model-a"), ("v2", "model-b")):
        Agent(name="multi", version=version, model=model, system="Two models.")
    yield
    for version in ("v1", "v2"):
        registry.unregister("multi", version)


@pytest.mark.django_db
def test_start_a_run_offers_only_the_agents_own_models(
    admin_client: Client, two_model_agent: None
) -> None:
    add_url = reverse("admin:durable_agents_agentrun_add")
    page = admin_client.get(add_url).content.decode()
    assert '<select name="model"' in page
    assert '<option value="model-b">' in page

    def start(agent: list[str], model: str) -> Any:
        return admin_client.post(
            add_url, {"agent": json.dumps(agent), "task": "do it", "model": model}
        )

    for agent, model in ((["tester", "v1"], "model-a"), (["multi", "v1"], "gpt-pinned-by-me")):
        response = start(agent, model)
        assert response.status_code == 200
        assert 'class="errorlist' in response.content.decode()
    assert not AgentRun.objects.exists()
    # Another version's model of the same agent is allowed.
    assert start(["multi", "v1"], "model-b").status_code == 302
    assert AgentRun.objects.get().model == "model-b"
    field = StartRunForm().fields["model"]
    assert isinstance(field, forms.ChoiceField)
    # A list once the form is built; the stubs allow what a field may be given.
    assert ("", "The chosen version's own model") in field.choices  # type: ignore[operator]


# ---------------------------------------------------------------------------------------------
# 12. The dead letter groups by cause


def test_dead_cause_replaces_the_variable_parts() -> None:
    cause = causes.dead_cause
    a = "model call failed: overloaded (request id req_011CXabcDEF) after 3 tries"
    b = "model call failed: overloaded (request id req_9zzQ) after 5 tries"
    assert cause(a) == cause(b) == "model call failed: overloaded (request id <id>) after <n> tries"
    assert cause("run 3f2a1c9e-1234-4abc-8def-0123456789ab stalled") == "run <uuid> stalled"
    assert cause("fingerprint a1b2c3d4e5f6 differs") == "fingerprint <hex> differs"
    assert cause("200000 tokens of 250000") == "<n> tokens of <n>"
    assert cause("msg_01ABC and toolu_01XYZ") == "msg_<id> and toolu_<id>"
    # Names, versions and HTTP statuses are part of the cause.
    assert cause("model claude-3-5-x: HTTP 404") == "model claude-3-5-x: HTTP 404"
    assert cause("the API rejected the request (400): bad") != cause("rejected (413): bad")
    assert cause("agent tester@v1 drifted") == "agent tester@v1 drifted"
    assert cause("a\x00b \ud800") == "a\u2400b \ufffd"


@pytest.mark.django_db
def test_dead_letter_groups_runs_that_differ_by_request_id(admin_client: Client) -> None:
    long_reason = "the model is overloaded " + "because of many requests " * 20
    make_runs(2, RunStatus.DEAD, error="overloaded_error (request id req_A1)")
    make_runs(1, RunStatus.DEAD, error="overloaded_error (request id req_B2)\ndetails")
    make_runs(1, RunStatus.DEAD, error=long_reason + "(request id req_C3)")
    response = admin_client.get(dead_letter_url())
    groups = response.context["groups"]
    assert (groups[0].cause, groups[0].count) == ("overloaded_error (request id <id>)", 3)
    cut = next(g for g in groups if g.count == 1)
    # One whole example, cut at a word with an ellipsis, the whole reachable from its run.
    assert cut.example_cut
    assert cut.example.endswith("…")
    assert long_reason.startswith(cut.example[:-1])
    assert long_reason[len(cut.example) - 1] == " "  # the cut falls between words
    whole = reverse("admin:durable_agents_agentrun_text", args=[cut.example_run_id, "error"])
    assert whole in response.content.decode()


@pytest.mark.django_db
def test_dead_letter_group_operations_are_bound_to_the_runs_listed(
    admin_client: Client,
) -> None:
    shown = make_runs(2, RunStatus.DEAD, error="gone (request id req_1)")
    groups = admin_client.get(dead_letter_url()).context["groups"]
    confirm = admin_client.get(dead_group_url(groups[0], "cancel_runs"))
    assert confirm.status_code == 200
    late = make_runs(1, RunStatus.DEAD, error="gone (request id req_2)")[0]  # same cause
    admin_client.post(runs_url("?status__exact=dead"), hidden_fields(confirm))
    assert statuses(*shown) == [RunStatus.CANCELLED] * 2
    assert statuses(late) == [RunStatus.DEAD]
    # A group that no longer exists, or an operation that does not: nothing to confirm.
    gone = reverse("admin:durable_agents_agentrun_dead_letter_confirm", args=["cancel_runs"])
    assert admin_client.get(gone + "?cause=x").status_code == 302
    assert admin_client.get(gone).status_code == 302
    bad = reverse("admin:durable_agents_agentrun_dead_letter_confirm", args=["delete"])
    assert admin_client.get(bad + "?cause=x").status_code == 404


@pytest.mark.django_db
def test_viewer_sees_the_dead_letter_without_operations(viewer_client: Client) -> None:
    make_runs(1, RunStatus.DEAD, error="gone")
    page = viewer_client.get(dead_letter_url())
    assert page.status_code == 200
    assert "Requeue…" not in page.content.decode()
    url = dead_group_url(page.context["groups"][0], "requeue_runs")
    assert viewer_client.get(url).status_code == 403


# ---------------------------------------------------------------------------------------------
# 13. Search finds what operators see


@pytest.mark.django_db
def test_search_by_short_id_error_request_id_and_model(admin_client: Client) -> None:
    run = durable_agents.start_run("tester", "nothing to see")
    other = durable_agents.start_run("tester", "something else")
    # A dead or failed run's reason is searchable (agent_run_error_trgm covers those).
    AgentRun.objects.filter(pk=run.pk).update(
        status=RunStatus.DEAD,
        error="model call failed (request id req_011CXerror)",
        model="claude-special-9",
    )
    AgentStep.objects.create(
        run=other, seq=1, kind=StepKind.MODEL_TURN, payload="{}", request_id="req_step"
    )

    def found(query: str) -> set[Any]:
        response = admin_client.get(runs_url(), {"q": query})
        assert response.status_code == 200
        return {r.pk for r in response.context["cl"].result_list}

    text = str(run.pk)
    # The short id the list shows (the last digits of a time-ordered id): this run alone,
    # though the other run, started the same second, shares its first digits.
    assert found(short_id(run.pk)) == {run.pk}
    assert run.pk in found(text[:8])  # the first characters of the id
    assert run.pk in found(text[:13].upper())  # with its dash, in capitals
    assert run.pk in found(run.pk.hex[:12])  # without dashes
    assert found("req_011CXerror") == {run.pk}  # a request id quoted in the error
    assert found("req_step") == {other.pk}  # a request id of a step
    assert found("req_ste") == {other.pk}  # its first characters
    assert found("req_011CX") == {run.pk}  # a prefix of the one in the error
    assert found("claude-special-9") == {run.pk}  # a model, by its whole name
    assert found("model call failed") == {run.pk}  # words of the reason
    assert found(short_id(other.pk)) == {other.pk}


# ---------------------------------------------------------------------------------------------
# 14. What a person needs is on screen


@pytest.mark.django_db
def test_intents_list_shows_each_input(admin_client: Client) -> None:
    for table in ("orders", "users", "payments"):
        parked_intent(table=table)
    parked_intent(table=SCRIPT)
    content = admin_client.get(intents_url()).content.decode()
    for table in ("orders", "users", "payments"):
        assert f"{{&quot;table&quot;: &quot;{table}&quot;}}" in content
    assert "column-input_excerpt" in content
    assert SCRIPT not in content


@pytest.mark.django_db
def test_a_dead_runs_reason_is_first_on_its_page(admin_client: Client) -> None:
    run = make_runs(1, RunStatus.DEAD, error="prompt drift: the cause of death")[0]
    content = admin_client.get(run_url(run)).content.decode()
    box = content.index('id="run-error"')
    assert box < content.index("<fieldset")
    assert "prompt drift: the cause of death" in content[box : content.index("<fieldset")]
    fine = make_runs(1, RunStatus.SUCCEEDED)[0]
    assert 'id="run-error"' not in admin_client.get(run_url(fine)).content.decode()


@pytest.mark.django_db
def test_an_intent_whose_tool_raised_is_not_a_green_done(admin_client: Client) -> None:
    intent = parked_intent(IntentStatus.DONE)
    ToolEffect.objects.create(
        key=intent.key,
        run=intent.run,
        seq=intent.seq,
        call_index=intent.call_index,
        tool="drop_table",
        result="drop_table raised RuntimeError: no such table",
        is_error=True,
    )
    fine = parked_intent(IntentStatus.DONE, table="t2")
    listing = admin_client.get(intents_url()).content.decode()
    assert listing.count(views.RAISED_LABEL) == 1
    assert views.RAISED_COLOR in listing
    assert views.RAISED_LABEL in admin_client.get(intent_url(intent)).content.decode()
    assert views.RAISED_LABEL not in admin_client.get(intent_url(fine)).content.decode()
    transcript = admin_client.get(run_url(intent.run)).content.decode()
    assert f'<span class="da-outcome">{views.RAISED_LABEL}</span>' in transcript


# ---------------------------------------------------------------------------------------------
# 15. What is approved is exactly what was shown


@pytest.mark.django_db
def test_approval_shows_the_exact_input_and_checks_its_fingerprint(admin_client: Client) -> None:
    intent = parked_intent(table="orders")
    page = admin_client.get(intent_url(intent))
    approve_url = intent_url(intent, "approve")
    assert approve_url in page.content.decode()  # a link to the confirmation, not a POST

    confirm = admin_client.get(approve_url)
    assert confirm.status_code == 200
    assert views.pretty_json({"table": "orders"}).replace('"', "&quot;") in (
        confirm.content.decode()
    )
    fields = hidden_fields(confirm)
    assert fields["fingerprint"] == [views.intent_fingerprint(intent)]

    # No fingerprint, or one of another input: refused, back to the confirmation.
    for data in ({}, {"fingerprint": views.intent_fingerprint(parked_intent(table="other"))}):
        response = admin_client.post(approve_url, data, follow=True)
        assert response.redirect_chain[-1][0] == approve_url
        assert any("Nothing was approved" in m for m in messages_of(response))
    # The input changed after the page was shown: the old fingerprint no longer approves.
    ToolIntent.objects.filter(pk=intent.pk).update(input={"table": "users"})
    admin_client.post(approve_url, fields)
    assert statuses(intent) == [IntentStatus.PENDING]
    assert not LogEntry.objects.exists()

    fresh = hidden_fields(admin_client.get(approve_url))
    admin_client.post(approve_url, fresh)
    assert statuses(intent) == [IntentStatus.APPROVED]
    assert "Approved" in LogEntry.objects.get().get_change_message()


@pytest.mark.django_db
def test_bulk_approval_lists_every_input_and_approves_only_what_it_showed(
    admin_client: Client,
) -> None:
    a, b = parked_intent(table="orders"), parked_intent(table="users")
    data = {"action": "approve_intents", "_selected_action": [a.pk, b.pk]}
    confirm = admin_client.post(intents_url(), {**data, "index": 0})
    content = confirm.content.decode()
    for table in ("orders", "users"):
        assert f"&quot;table&quot;: &quot;{table}&quot;" in content
    ToolIntent.objects.filter(pk=b.pk).update(input={"table": "everything"})
    response = admin_client.post(intents_url(), hidden_fields(confirm), follow=True)
    assert any("1 not approved: what was shown" in m for m in messages_of(response))
    assert statuses(a, b) == [IntentStatus.APPROVED, IntentStatus.PENDING]


@pytest.mark.django_db
def test_an_input_too_long_for_a_list_is_approved_from_its_page(
    admin_client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("durable_agents.admin.intents.BULK_INPUT_CHARS", 10)
    intent = parked_intent(table="a table with a long name")
    confirm = admin_client.post(
        intents_url(), {"action": "approve_intents", "_selected_action": [intent.pk], "index": 0}
    )
    assert "approve it from its own page" in confirm.content.decode()
    assert "_selected_action" not in hidden_fields(confirm)


@pytest.mark.django_db
def test_viewer_cannot_open_a_decision_page(viewer_client: Client) -> None:
    intent = parked_intent()
    for view in ("approve", "reject"):
        assert viewer_client.get(intent_url(intent, view)).status_code == 403


# ---------------------------------------------------------------------------------------------
# Text that cannot be encoded never crashes a page


@pytest.mark.django_db
def test_nul_and_lone_surrogates_from_the_model_are_marked(admin_client: Client) -> None:
    # JSON escapes: how a provider or a tool can hand over text that UTF-8 cannot encode.
    hostile = "\\u0000 nul, \\ud800 lone, " + SCRIPT
    intent = parked_intent()
    turn = (
        '{"id":"msg_2","type":"message","role":"assistant","model":"m\\ud800",'
        '"content":[{"type":"text","text":"' + hostile + '"},'
        '{"type":"thinking","thinking":"' + hostile + '","signature":"s"},'
        '{"type":"tool_use","id":"t\\ud800","name":"n\\u0000","input":{"k":"' + hostile + '"}}],'
        '"stop_reason":"end\\ud800","usage":{}}'
    )
    AgentStep.objects.create(run=intent.run, seq=2, kind=StepKind.MODEL_TURN, payload=turn)
    result = '[{"type":"tool_result","tool_use_id":"t\\ud800","content":"' + hostile + '"}]'
    AgentStep.objects.create(run=intent.run, seq=3, kind=StepKind.TOOL_RESULT, payload=result)
    # Stored as JSON escapes (JSONTextField), decoded into a lone surrogate and a NUL.
    ToolIntent.objects.filter(pk=intent.pk).update(input={"table": f"\ud800\x00{SCRIPT}"})
    for url in (run_url(intent.run), intent_url(intent), intents_url()):
        response = admin_client.get(url)
        assert response.status_code == 200, url
        content = response.content.decode()
        assert SCRIPT not in content, url
        # Pages mark the decoded text; the list shows the stored JSON text, escapes and all.
        assert ("\\ud800" if url == intents_url() else "\ufffd") in content, url
    run_page = admin_client.get(run_url(intent.run)).content.decode()
    assert "\u2400 nul, \ufffd lone, &lt;script&gt;" in run_page
    confirm = admin_client.get(intent_url(intent, "approve"))
    # pretty_json keeps the lone surrogate (marked) and writes the NUL as a JSON escape.
    assert confirm.status_code == 200
    assert "\ufffd\\u0000" in confirm.content.decode()
    # The fingerprint covers the real value, so the marked page still approves it.
    admin_client.post(intent_url(intent, "approve"), hidden_fields(confirm))
    assert statuses(intent) == [IntentStatus.APPROVED]
    whole = admin_client.get(step_text_url(intent.run, 2) + "?block=0")
    assert whole.status_code == 200
    assert "\u2400 nul, \ufffd lone" in whole.content.decode()


@pytest.mark.django_db
def test_hostile_agent_and_lease_text_in_the_runs_list(admin_client: Client) -> None:
    run = make_runs(1, RunStatus.RUNNING, error=SCRIPT)[0]
    AgentRun.objects.filter(pk=run.pk).update(lease_owner=SCRIPT, model=SCRIPT, agent=SCRIPT)
    response = admin_client.get(runs_url())
    assert response.status_code == 200
    assert SCRIPT not in response.content.decode()
    assert uuid.UUID(str(run.pk))  # the row is there


@pytest.mark.django_db
def test_json_nested_too_deep_to_decode_or_indent_is_shown_as_text(admin_client: Client) -> None:
    run = durable_agents.start_run("tester", "deep")
    deep_block = "[" * 600 + "]" * 600  # decodes, but the indenting encoder recurses per level
    too_deep = "[" * 100_000 + "]" * 100_000  # json.loads raises RecursionError
    turn = '{"content": [{"type": "other", "v": ' + deep_block + "}]}"
    AgentStep.objects.create(run=run, seq=1, kind=StepKind.MODEL_TURN, payload=turn)
    AgentStep.objects.create(run=run, seq=2, kind=StepKind.TOOL_RESULT, payload=too_deep)
    response = admin_client.get(run_url(run))
    assert response.status_code == 200
    assert "[[[[" in response.content.decode()
    for url in (step_text_url(run, 1) + "?block=0", step_text_url(run, 2)):
        assert admin_client.get(url).status_code == 200, url
