"""The admin of long-running runs in a real browser: a person
answers a run's question on its page, a person sends the event that runs wait on from the
events form, and a question made of markup stays text.

The setup (Debian's Chromium driven by Playwright, the login through the real form) is
tests/acceptance/test_browser.py's, imported from there: without a browser both modules are
skipped, or fail with DA_REQUIRE_BROWSER=1.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.urls import reverse

import durable_agents
from durable_agents.models import (
    AgentEvent,
    AgentQuestion,
    AgentRun,
    QuestionStatus,
    RunStatus,
    short_id,
)
from tests.acceptance import test_browser
from tests.acceptance.test_browser import (
    PWNED,
    Page,
    expect,
    login,
    make_staff,
    run_url,
    screenshot,
    success_message,
)
from tests.conftest import run_worker

# The Chromium (module scope) and the page (a 1280 px context) of test_browser.py.
browser = test_browser.browser
page = test_browser.page

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def parked(task: str) -> AgentRun:
    run = durable_agents.start_run("waiter", f"Wait for something.\n{task}")
    run_worker()
    run.refresh_from_db()
    assert run.status == RunStatus.WAITING, (run.status, run.error)
    return run


@pytest.fixture
def helper(live_server: Any) -> Any:
    """Staff who may see runs, questions and events, answer questions and send events."""
    return make_staff(
        "helper",
        "view_agentrun",
        "view_agentquestion",
        "view_agentevent",
        "answer_question",
        "send_event",
    )


def test_a_staff_user_answers_a_question_on_the_run_page(
    page: Page, live_server: Any, helper: Any
) -> None:
    base = live_server.url
    run = parked('@ask_person {"question": "Which region do we migrate first?"}')
    question = AgentQuestion.objects.get(run_id=run.pk)
    login(page, base, helper.username)

    # The list says what the run waits for.
    page.goto(base + reverse("admin:durable_agents_agentrun_changelist"))
    row = page.locator("#result_list tbody tr", has_text=short_id(run.pk))
    expect(row.locator(".da-wait")).to_have_text(
        "waits for an answer to “Which region do we migrate first?”"
    )

    page.goto(run_url(base, run))
    box = page.locator("#open-question")
    expect(box.locator("#question-text")).to_have_text("Which region do we migrate first?")
    expect(page.locator("#run-wait h3")).to_contain_text("Waiting for an answer")
    screenshot(page, "admin-run-question")
    page.get_by_label("Your answer (the model reads it, with your name):").fill(
        "eu-west first, then us-east"
    )
    page.get_by_role("button", name="Answer", exact=True).click()
    expect(success_message(page)).to_have_text(
        f"Answered question {question.pk}: run {run.pk} goes on (pending)."
    )
    expect(page.locator(".field-status_badge")).to_contain_text("Pending", ignore_case=True)
    expect(page.locator("#open-question")).to_have_count(0)
    expect(page.locator("#questions")).to_contain_text("eu-west first, then us-east")
    expect(page.locator("#questions")).to_contain_text(f"answered by {helper.username} at 20")

    run.refresh_from_db()
    assert run.status == RunStatus.PENDING
    question.refresh_from_db()
    assert (question.status, question.answered_by_id) == (QuestionStatus.ANSWERED, helper.pk)

    run_worker()
    run.refresh_from_db()
    assert run.status == RunStatus.SUCCEEDED, run.error
    page.goto(run_url(base, run))
    expect(page.locator("#transcript")).to_contain_text("eu-west first, then us-east")


def test_a_staff_user_sends_an_event_from_the_events_form(
    page: Page, live_server: Any, helper: Any, receiver: Any
) -> None:
    base = live_server.url
    runs = [parked('@await_event {"name": "deploy:42"}') for _ in range(2)]
    login(page, base, helper.username)

    page.goto(base + reverse("admin:durable_agents_agentevent_changelist"))
    row = page.locator("#result_list tbody tr", has_text="deploy:42")
    expect(row).to_contain_text("Awaited")
    expect(row.locator(".field-waiting_runs")).to_have_text("2")
    page.get_by_role("link", name="Send an event").click()

    page.get_by_label("Name:").fill("deploy:42")
    page.get_by_label("Payload (JSON; empty for null):").fill("{not json")
    page.get_by_role("button", name="Send the event").click()
    expect(page.locator(".errorlist")).to_contain_text("The payload is not JSON")
    assert not AgentEvent.objects.get(name="deploy:42").is_sent

    page.get_by_label("Payload (JSON; empty for null):").fill('{"status": "deployed"}')
    page.get_by_role("button", name="Send the event").click()
    expect(success_message(page)).to_have_text(
        "Sent event “deploy:42”; 2 run(s) were waiting on it and woke."
    )
    expect(page.locator(".field-sent_badge")).to_contain_text("Sent")
    expect(page.locator(".field-payload_text")).to_contain_text('"status": "deployed"')
    expect(page.locator("#send-event-form")).to_have_count(0)

    event = AgentEvent.objects.get(name="deploy:42")
    assert event.sent_by_id == helper.pk
    assert event.payload == {"status": "deployed"}
    assert {AgentRun.objects.get(pk=r.pk).status for r in runs} == {RunStatus.PENDING}
    run_worker()
    assert {AgentRun.objects.get(pk=r.pk).status for r in runs} == {RunStatus.SUCCEEDED}


def test_a_question_made_of_markup_stays_text(page: Page, live_server: Any, helper: Any) -> None:
    base = live_server.url
    run = parked(f"@ask_person {json.dumps({'question': f'{PWNED} Go?'})}")
    question = AgentQuestion.objects.get(run_id=run.pk)
    login(page, base, helper.username)
    for url in (
        run_url(base, run),
        base + reverse("admin:durable_agents_agentrun_changelist"),
        base + reverse("admin:durable_agents_agentquestion_changelist"),
        base + reverse("admin:durable_agents_agentquestion_change", args=[question.pk]),
    ):
        page.goto(url)
        page.wait_for_load_state("load")
        assert page.evaluate("window.__pwned") is None, url
        expect(page.locator("#content")).to_contain_text(PWNED)
