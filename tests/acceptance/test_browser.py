"""The admin in a real browser: Playwright driving Debian's Chromium against ``live_server``.

What the Django test client cannot show: the login form, buttons found by their visible text,
the action select and its confirmation page, messages after redirects, and that untrusted text
does not run as script. The run, intent and operations pages are also captured as full-page
screenshots into ``tests/artifacts/`` (git-ignored); with DA_UPDATE_DOCS_IMAGES=1 three of them are
copied to ``docs/img/`` for the README.

Needs the ``playwright`` Python package and a Chromium binary (``/usr/bin/chromium``, or
``DA_CHROMIUM``); Playwright's own browser download is never used. ``scripts/install-browser.sh``
installs both. Without them the module is skipped, unless ``DA_REQUIRE_BROWSER=1`` (CI sets it),
in which case it fails: a CI that silently skipped these tests would prove nothing.

Why ``DJANGO_ALLOW_ASYNC_UNSAFE``: Playwright's sync API runs an asyncio event loop in this
(the main) thread for as long as the browser is open, driven through greenlets, so
``asyncio.get_running_loop()`` succeeds here between Playwright calls. Django takes that to mean
"inside async code" and raises ``SynchronousOnlyOperation`` on every ORM call of the test thread
(creating users and runs, ``run_worker()``, ``refresh_from_db()``, and pytest-django's flush at
teardown). Nothing here is actually async: the loop only waits on the browser's pipe while a
Playwright call is in progress, so the ORM calls in between are safe. The variable is set for this
module's tests only (a module-scoped fixture), not for the rest of the suite.
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import Permission
from django.urls import reverse
from django.utils import timezone

import durable_agents
from durable_agents import store as run_store
from durable_agents.models import AgentRun, AgentStep, IntentStatus, RunStatus, ToolIntent, short_id
from tests.conftest import ROOT, run_worker, wait_for

CHROMIUM = os.environ.get("DA_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",  # root in CI; the pages are our own
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    # Debian's launcher means to add this when /dev/shm is small (containers) but its check is
    # broken on some machines; without it Chromium can crash on a 64 MB /dev/shm.
    "--disable-dev-shm-usage",
]
ARTIFACTS = ROOT / "tests" / "artifacts"
DOCS_IMG = ROOT / "docs" / "img"
PASSWORD = "browser-pw-1"
PWNED = "<script>window.__pwned = 1</script>"
TIMEOUT_MS = 15_000


def _missing_browser() -> str:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright package is not installed (scripts/install-browser.sh)"
    if not (Path(CHROMIUM).is_file() and os.access(CHROMIUM, os.X_OK)):
        return f"no Chromium at {CHROMIUM} (scripts/install-browser.sh; or set DA_CHROMIUM)"
    return ""


_MISSING = _missing_browser()
if _MISSING:
    if os.environ.get("DA_REQUIRE_BROWSER") == "1":
        raise RuntimeError(f"DA_REQUIRE_BROWSER=1 but {_MISSING}")
    pytest.skip(f"browser tests: {_MISSING}", allow_module_level=True)

from playwright.sync_api import Browser, Page, expect, sync_playwright  # noqa: E402

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


# ---------------------------------------------------------------------------------------------
# Fixtures


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    # The env var first and gone last: function-scoped teardowns (the database flush) run while
    # the browser, and so the event loop, is still up.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            yield browser
            browser.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    context.set_default_timeout(TIMEOUT_MS)
    page = context.new_page()
    yield page
    context.close()


def make_staff(username: str, *codenames: str) -> Any:
    from django.contrib.auth import get_user_model

    user = get_user_model().objects.create_user(username, password=PASSWORD, is_staff=True)
    perms = Permission.objects.filter(
        content_type__app_label="durable_agents", codename__in=codenames
    )
    assert perms.count() == len(codenames), codenames
    user.user_permissions.add(*perms)
    return user


OPERATOR_PERMS = (
    "approve_toolintent",
    "view_agentrun",
    "change_agentrun",
    "view_toolintent",
    "change_toolintent",
)


@pytest.fixture
def operator(live_server: Any) -> Any:
    """Staff who may decide intents and operate runs (no superuser shortcut)."""
    return make_staff("operator", *OPERATOR_PERMS)


def login(page: Page, base: str, username: str) -> None:
    """Through the real admin login form."""
    page.goto(f"{base}{reverse('admin:login')}?next={reverse('admin:index')}")
    page.fill("#id_username", username)
    page.fill("#id_password", PASSWORD)
    page.get_by_role("button", name="Log in").click()
    page.wait_for_url(f"{base}{reverse('admin:index')}")
    expect(page.locator("#user-tools")).to_contain_text(username, ignore_case=True)


def run_url(base: str, run: AgentRun) -> str:
    return base + reverse("admin:durable_agents_agentrun_change", args=[run.pk])


def intent_url(base: str, intent: ToolIntent) -> str:
    return base + reverse("admin:durable_agents_toolintent_change", args=[intent.pk])


def waiting_run(task: str, agent: str = "thinker") -> tuple[AgentRun, ToolIntent]:
    run = durable_agents.start_run(agent, task)
    run_worker()
    run.refresh_from_db()
    assert run.status == RunStatus.WAITING, run.error
    return run, ToolIntent.objects.get(run=run, status=IntentStatus.PENDING)


def assert_apart(page: Page, first: str, second: str) -> None:
    """The two elements are on screen and their boxes do not intersect."""
    a, b = page.locator(first).bounding_box(), page.locator(second).bounding_box()
    assert a, (first, a)
    assert b, (second, b)
    apart = (
        a["x"] + a["width"] <= b["x"]
        or b["x"] + b["width"] <= a["x"]
        or a["y"] + a["height"] <= b["y"]
        or b["y"] + b["height"] <= a["y"]
    )
    assert apart, f"{first} {a} overlaps {second} {b}"


def assert_object_tools_clear_of(page: Page, *boxes: str) -> None:
    """Django's HISTORY button (floated up with a negative margin) overlaps none of the boxes,
    and the boxes' forms are not nested in the read-only change form."""
    expect(page.locator(".object-tools a").first).to_be_visible()
    for box in boxes:
        assert_apart(page, ".object-tools", box)
        assert page.locator(f"form {box}").count() == 0, f"{box} is inside a form"


def success_message(page: Page) -> Any:
    return page.locator("ul.messagelist li.success")


def screenshot(page: Page, name: str, docs: bool = False) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    page.evaluate("window.scrollTo(0, 0)")  # the admin's sticky sidebar follows the scroll
    page.screenshot(path=str(path), full_page=True)
    # The README's copies change only when asked: DA_UPDATE_DOCS_IMAGES=1 make test.
    if docs and os.environ.get("DA_UPDATE_DOCS_IMAGES") == "1":
        DOCS_IMG.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, DOCS_IMG / f"{name}.png")
    return path


# A realistic run for the screenshots: a few turns, thinking, parallel calls, one approval.
CLEANUP_TASK = "\n".join(
    [
        "Clean up the legacy orders table: check what still reads it, switch the flag, drop it.",
        '@lookup {"key": "readers:legacy_orders"}',
        '@lookup {"key": "rows:legacy_orders"} && set_flag {"name": "legacy_reads", '
        '"value": false}',
        '@drop_table {"table": "legacy_orders"}',
    ]
)


# ---------------------------------------------------------------------------------------------
# 1. Approve


def test_approve_from_the_intent_page(page: Page, live_server: Any, operator: Any) -> None:
    base = live_server.url
    run, intent = waiting_run(CLEANUP_TASK)
    login(page, base, operator.username)

    page.goto(intent_url(base, intent))
    expect(page.locator("#intent-input")).to_contain_text('"table": "legacy_orders"')
    expect(page.locator("#intent-summary details summary").first).to_have_text("Thinking")
    assert_object_tools_clear_of(page, "#intent-summary", "#intent-decision")
    expect(page.locator(".field-created_at_display")).to_contain_text(
        intent.created_at.strftime("%Y-%m-%d %H:%M:%S")
    )
    screenshot(page, "admin-intent", docs=True)

    page.get_by_role("link", name="Approve…", exact=True).click()
    # The confirmation step shows the exact input; its button approves what it shows.
    expect(page.locator("#decision-input")).to_contain_text('"table": "legacy_orders"')
    page.get_by_role("button", name="Yes, approve this call", exact=True).click()
    expect(success_message(page)).to_have_text(f"Approved intent {intent.pk}.")
    # Decided: the page no longer offers the decision.
    expect(page.get_by_role("link", name="Approve…", exact=True)).to_have_count(0)
    expect(page.locator(".field-decided_by")).to_contain_text(operator.username)
    intent.refresh_from_db()
    assert (intent.status, intent.decided_by_id) == (IntentStatus.APPROVED, operator.pk)

    run_worker()
    run.refresh_from_db()
    assert run.status == RunStatus.SUCCEEDED, run.error

    page.goto(run_url(base, run))
    page.reload()
    expect(page.locator(".field-status_badge")).to_contain_text("Succeeded", ignore_case=True)
    transcript = page.locator("#transcript")
    expect(transcript).to_contain_text("calls drop_table")
    expect(transcript).to_contain_text("dropped legacy_orders")
    # The decision and the outcome, apart: the operator approved; the worker ran the call.
    line = transcript.locator(".da-intent")
    expect(line).to_have_count(1)
    expect(line).to_contain_text(f"Intent #{intent.pk} approved by {operator.username} at 20")
    expect(line).to_contain_text("· done")
    expect(line).not_to_contain_text("Done by")
    # One time format for fields and transcript, and "claims" for the claim count.
    expect(page.locator(".field-created_at_display .readonly")).to_have_text(
        run.created_at.strftime("%Y-%m-%d %H:%M:%S")
    )
    claims = page.locator(".field-attempt")
    expect(claims).to_contain_text("Claims:")
    expect(claims).to_contain_text("how many times a worker took this run")
    # Thinking, the intent line and the call headers use the step's font size.
    sizes = transcript.evaluate(
        """t => [".da-step summary", ".da-intent", ".da-call > strong", ".da-step"].map(
            s => getComputedStyle(t.querySelector(s)).fontSize)"""
    )
    assert len(set(sizes)) == 1, sizes
    expect(page.get_by_role("button", name="Cancel this run")).to_have_count(0)
    # Thinking folds open in the browser.
    first_thought = transcript.locator("details").first
    first_thought.locator("summary").click()
    expect(first_thought.locator(".da-pre")).to_contain_text("the plan says to call lookup")
    screenshot(page, "admin-run", docs=True)


# ---------------------------------------------------------------------------------------------
# 2. Reject with a reason


def test_reject_with_a_reason_reaches_the_model(
    page: Page, live_server: Any, operator: Any
) -> None:
    base = live_server.url
    run, intent = waiting_run('Drop it.\n@drop_table {"table": "t1"}', agent="tester")
    login(page, base, operator.username)

    page.goto(run_url(base, run))
    expect(page.locator(".field-status_badge")).to_contain_text("Waiting", ignore_case=True)
    expect(page.get_by_role("button", name="Cancel this run")).to_be_visible()
    assert_object_tools_clear_of(page, "#run-operations")
    expect(page.locator("#transcript .da-intent")).to_contain_text(
        f"Intent #{intent.pk} awaiting a decision — decide it"
    )
    screenshot(page, "admin-run-waiting")

    page.goto(intent_url(base, intent))
    page.get_by_label("Reason (the model sees it):").fill("not on a Friday")
    page.get_by_role("button", name="Reject", exact=True).click()
    expect(success_message(page)).to_have_text(f"Rejected intent {intent.pk}.")
    expect(page.locator(".field-reason_shown")).to_contain_text("not on a Friday")

    run_worker()
    run.refresh_from_db()
    assert run.status == RunStatus.SUCCEEDED, run.error
    page.goto(run_url(base, run))
    transcript = page.locator("#transcript")
    expected = f"drop_table was not run: rejected by {operator.username}: not on a Friday"
    expect(transcript).to_contain_text(expected)
    expect(transcript.locator(".da-intent")).to_contain_text(
        f"Intent #{intent.pk} rejected by {operator.username} at "
    )
    expect(transcript.locator(".da-intent")).to_contain_text(": “not on a Friday” · not run")
    result = AgentStep.objects.get(run=run, seq=2).data()[0]
    assert result["is_error"] is True
    assert expected in result["content"]


# ---------------------------------------------------------------------------------------------
# 3. Cancel a running run through the list action


def test_cancel_a_running_run_from_the_list(page: Page, live_server: Any, operator: Any) -> None:
    base = live_server.url
    run = durable_agents.start_run("tester", 'Think slowly.\n@@latency 30\n@lookup {"key": "a"}')
    worker = threading.Thread(
        target=run_worker, kwargs={"lease_seconds": 3, "heartbeat_seconds": 0.3}, daemon=True
    )
    worker.start()
    try:
        wait_for(lambda: AgentRun.objects.get(pk=run.pk).status == RunStatus.RUNNING, 10)
        login(page, base, operator.username)

        page.goto(base + reverse("admin:durable_agents_agentrun_changelist"))
        row = page.locator("#result_list tbody tr", has_text=short_id(run.pk))
        expect(row).to_contain_text("Running", ignore_case=True)
        row.locator("input.action-select").check()
        page.locator("select[name=action]").select_option(label="Cancel selected runs")
        page.get_by_role("button", name="Go").click()

        expect(page.locator("#content")).to_contain_text("1 agent runs will change")
        page.get_by_role("button", name="Yes, cancel them").click()
        expect(success_message(page)).to_have_text(
            "Cancelled 1 run(s); 0 skipped (not in a status that allows it)."
        )
        expect(row).to_contain_text("Cancelled", ignore_case=True)

        # The heartbeat notices and abandons the 30 s model call; the burst worker then ends.
        worker.join(15)
        assert not worker.is_alive(), "the worker did not stop after the cancellation"
    finally:
        if worker.is_alive():
            AgentRun.objects.filter(pk=run.pk).update(status=RunStatus.CANCELLED)
            worker.join(40)
    run.refresh_from_db()
    assert run.status == RunStatus.CANCELLED
    assert run.last_seq == 0  # no model turn was recorded


# ---------------------------------------------------------------------------------------------
# 4. No approve permission, no buttons


def test_viewer_sees_the_intent_without_decision_buttons(page: Page, live_server: Any) -> None:
    base = live_server.url
    viewer = make_staff("viewer", "view_agentrun", "view_toolintent")
    _, intent = waiting_run('Drop it.\n@drop_table {"table": "t1"}', agent="tester")
    login(page, base, viewer.username)

    page.goto(intent_url(base, intent))
    expect(page.locator("#intent-input")).to_contain_text('"table": "t1"')
    expect(page.locator(".field-status_badge")).to_contain_text("Pending", ignore_case=True)
    expect(page.locator("#intent-decision")).to_have_count(0)
    for name in ("Approve", "Reject"):
        expect(page.get_by_role("button", name=name, exact=True)).to_have_count(0)
    expect(page.get_by_role("link", name="Approve…", exact=True)).to_have_count(0)
    expect(page.locator("textarea")).to_have_count(0)


# ---------------------------------------------------------------------------------------------
# 5. Untrusted text is text


def test_script_in_task_and_tool_result_does_not_run(
    page: Page, live_server: Any, operator: Any
) -> None:
    base = live_server.url
    task = f'{PWNED} summarise\n@lookup {{"key": "{PWNED}"}}\n@drop_table {{"table": "{PWNED}"}}'
    run, intent = waiting_run(task, agent="tester")
    AgentRun.objects.filter(pk=run.pk).update(error=f"{PWNED} went wrong")
    login(page, base, operator.username)

    pages = {
        "run page": run_url(base, run),
        "run list": base + reverse("admin:durable_agents_agentrun_changelist"),
        "intent page": intent_url(base, intent),
    }
    for name, url in pages.items():
        page.goto(url)
        page.wait_for_load_state("load")
        assert page.evaluate("window.__pwned") is None, name
        assert page.locator("script", has_text="__pwned").count() == 0, name
        # The markup is shown as text.
        expect(page.locator("#content")).to_contain_text(PWNED)

    page.goto(run_url(base, run))
    expect(page.locator(".field-task_text")).to_contain_text(f"{PWNED} summarise")
    expect(page.locator("#transcript")).to_contain_text(f"value-of-{PWNED}")  # a tool result
    assert page.evaluate("window.__pwned") is None


# ---------------------------------------------------------------------------------------------
# Operations page (with realistic content for the screenshot)


def test_operations_page_with_traffic(page: Page, live_server: Any, operator: Any) -> None:
    base = live_server.url
    for i in range(6):
        durable_agents.start_run(
            "thinker",
            f"Check order {1000 + i}.\n"
            f'@lookup {{"key": "order:{1000 + i}"}}\n'
            f'@lookup {{"key": "customer:{i}"}} && set_flag {{"name": "checked_{i}", '
            f'"value": true}}',
        )
    durable_agents.start_run("tester", 'Try a thing.\n@explode {"message": "upstream 503"}')
    waiting_run(CLEANUP_TASK)  # also runs the ones above
    dead = durable_agents.start_run("tester", "A run that died.")
    AgentRun.objects.filter(pk=dead.pk).update(
        status=RunStatus.DEAD, attempt=3, error="model claude-x: not found"
    )
    durable_agents.start_run("tester", "Still queued.")

    login(page, base, operator.username)
    page.goto(base + reverse("admin:durable_agents_agentrun_operations"))
    expect(page.locator("#runs-by-status h3")).to_have_text("Runs by status")
    # Live statuses now, finished runs over the last 24 hours, each saying its window.
    expect(page.locator("#live-statuses")).to_contain_text("pending: 1")
    expect(page.locator("#finished-window")).to_contain_text("last 24 hours")
    expect(page.locator("#finished-statuses")).to_contain_text("succeeded: 7")
    expect(page.locator("#queue")).to_contain_text("drop_table (pending approval)")
    expect(page.locator("#steps-per-run")).to_contain_text("p50")
    expect(page.locator("#finished-per-hour h3")).to_contain_text(": 7")
    # The charts are drawn: every SVG has a size on screen.
    for chart in page.locator("svg.da-chart").all():
        box = chart.bounding_box()
        assert box
        assert box["width"] > 100, box
        assert box["height"] > 20, box
    hours = page.locator("#finished-per-hour svg")
    expect(hours.locator("line.da-baseline")).to_have_count(1)
    expect(hours.locator("text.da-axis").last).to_have_text("now")
    screenshot(page, "admin-operations", docs=True)

    # The runs list fits a 1280 px screen with the sidebar and the filters: no column needs
    # horizontal scrolling, and the task is not squeezed to a word per line.
    AgentRun.objects.filter(pk=dead.pk).update(
        error="model claude-x: not found (HTTP 404 from the provider); " + "details " * 30
    )
    AgentRun.objects.filter(status=RunStatus.PENDING).update(
        lease_owner="worker-host-with-a-long-name:31726:5c4f87", lease_until=timezone.now()
    )
    AgentRun.objects.filter(status=RunStatus.WAITING).update(
        lease_owner="vm:31726:5c4f87", lease_until=timezone.now() + timedelta(minutes=5)
    )
    # A long concurrency key under the status, and runs that wait for their key (a limit of 0,
    # as CONCURRENCY_LIMITS would hold them).
    AgentRun.objects.filter(pk=dead.pk).update(
        concurrency_key="tenant:a-customer-with-a-rather-long-name-0042"
    )
    AgentRun.objects.filter(status=RunStatus.PENDING).update(
        concurrency_key="tenant:paused", concurrency_limit=0
    )
    for width in (1280, 1440):
        page.set_viewport_size({"width": width, "height": 800})
        page.goto(base + reverse("admin:durable_agents_agentrun_changelist"))
        expect(page.locator("#result_list tbody tr")).to_have_count(10)
        results = page.locator("#changelist .results")
        scroll, client = results.evaluate("r => [r.scrollWidth, r.clientWidth]")
        assert scroll <= client, f"{width}px: table {scroll}px in {client}px"
        task = page.locator("#result_list th.column-task_excerpt").bounding_box()
        assert task, width
        assert task["width"] >= 150, (width, task)
        headers = page.locator("#result_list thead th").all_inner_texts()
        assert [h.strip().lower() for h in headers[1:]] == [
            *("run", "status", "agent", "task", "steps", "claims", "lease")
        ], headers
        dead_row = page.locator("#result_list tbody tr", has_text=short_id(dead.pk))
        expect(dead_row.locator(".da-list-error")).to_contain_text("model claude-x: not found")
        error = dead_row.locator(".da-list-error").inner_text()
        assert len(error) <= 60, error  # truncated; the whole error is on the run page
        expect(page.locator("#result_list")).to_contain_text("expired")
        expect(page.locator("#result_list")).to_contain_text("until ")
        if width == 1280:
            screenshot(page, "admin-runs")


# ---------------------------------------------------------------------------------------------
# 7. The dead letter: runs grouped by their stored cause, a group requeued as listed


def test_requeue_a_dead_letter_group(page: Page, live_server: Any, operator: Any) -> None:
    base = live_server.url
    store = run_store.current()
    overloaded = [durable_agents.start_run("tester", f"Overloaded {i}.") for i in range(3)]
    for i, run in enumerate(overloaded):  # one cause: only the request id and count differ
        assert store.dead_letter(run.pk, f"overloaded_error (request id req_0{i}) after {i} tries")
    retired = durable_agents.start_run("tester", "Retired.")
    assert store.dead_letter(retired.pk, "model claude-x: not found")

    login(page, base, operator.username)
    page.goto(base + reverse("admin:durable_agents_agentrun_changelist"))
    expect(page.locator("#result-count")).to_have_text("4 agent runs")
    page.get_by_role("link", name="Dead letter (4)").click()
    groups = page.locator("#dead-letter-reasons tbody tr")
    expect(groups).to_have_count(2)
    first = groups.first  # the most frequent cause first
    expect(first).to_contain_text("overloaded_error (request id <id>) after <n> tries")
    expect(first.locator("td").nth(1)).to_have_text("3")
    first.get_by_role("link", name="Requeue…").click()
    expect(page.locator("#content")).to_contain_text("3 agent runs will change")
    page.get_by_role("button", name="Yes, requeue them").click()
    expect(success_message(page)).to_contain_text("3")
    statuses = {run.pk: AgentRun.objects.get(pk=run.pk).status for run in overloaded}
    assert set(statuses.values()) == {RunStatus.PENDING}
    assert AgentRun.objects.get(pk=retired.pk).status == RunStatus.DEAD
    # Requeued runs leave their group: the dead letter holds the other cause alone.
    page.goto(base + reverse("admin:durable_agents_agentrun_dead_letter"))
    expect(groups).to_have_count(1)
    expect(groups.first).to_contain_text("model claude-x: not found")
