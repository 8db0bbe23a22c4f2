"""The demo's live page in a real Chromium, served by uvicorn, while a real worker is SIGKILLed.

An end user's page (no staff login: a stream token) starts a run of the streamed ``narrator``
agent and follows it through ``runs/<id>/events``. The worker dies mid-run; the page keeps what
it has, goes on when another worker takes the run over, and ends with exactly the run's
transcript. uvicorn runs as a subprocess on the test database, as it would in production (one
hub for every reader of the process).

Needs Chromium and playwright like test_browser.py (skipped without them unless
DA_REQUIRE_BROWSER=1), and PostgreSQL (text deltas travel by NOTIFY).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.db import connections

from durable_agents.models import AgentRun, RunStatus, steps_of
from tests.conftest import ROOT, database_url, free_port, wait_for

CHROMIUM = os.environ.get("DA_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"]
SIGKILLED = -9


def _missing() -> str:
    try:
        import playwright.sync_api  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        return f"{exc.name} is not installed (make venv)"
    if not (Path(CHROMIUM).is_file() and os.access(CHROMIUM, os.X_OK)):
        return f"no Chromium at {CHROMIUM} (scripts/install-browser.sh; or set DA_CHROMIUM)"
    return ""


if _missing():
    if os.environ.get("DA_REQUIRE_BROWSER") == "1":
        raise RuntimeError(f"DA_REQUIRE_BROWSER=1 but {_missing()}")
    pytest.skip(f"browser tests: {_missing()}", allow_module_level=True)

from playwright.sync_api import Page, sync_playwright  # noqa: E402

pytestmark = [
    pytest.mark.browser,
    pytest.mark.postgres,
    pytest.mark.django_db(transaction=True),
]


@pytest.fixture
def asgi_server(tmp_path: Path) -> Iterator[str]:
    """uvicorn serving the demo project on the test database. Tests ask for it before the
    page, so that the browser closes its streams before uvicorn is stopped (uvicorn would
    otherwise wait out its graceful shutdown for them)."""
    port = free_port()
    log = (tmp_path / "uvicorn.log").open("w")
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "DATABASE_URL": database_url(),
        "DJANGO_DEBUG": "1",  # static files (live.js) served by the ASGI app itself
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "project.asgi:application", "--port", str(port)],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )

    def up() -> bool:
        with socket.socket() as sock:
            return sock.connect_ex(("127.0.0.1", port)) == 0

    try:
        wait_for(up, timeout=30)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@pytest.fixture
def page() -> Iterator[Page]:
    with pytest.MonkeyPatch.context() as mp:
        # Playwright's sync API keeps an event loop in this thread; the ORM calls between its
        # calls are plain synchronous ones (see test_browser.py).
        mp.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            context = browser.new_context()
            context.set_default_timeout(30_000)
            yield context.new_page()
            browser.close()
            # The ORM connection the test opened while Playwright's loop was up is kept where
            # only code under that loop sees it: closed here, or the test database's DROP
            # waits out PostgreSQL's five seconds for "other sessions".
            connections.close_all()


def shown_seqs(page: Page) -> list[int]:
    return [
        int(seq)
        for seq in page.eval_on_selector_all(
            "[data-live-steps] li[data-seq]", "items => items.map(i => i.dataset.seq)"
        )
    ]


def test_the_live_page_keeps_its_text_across_a_killed_worker(
    asgi_server: str, page: Page, spawn_worker: Any, fake_api: Any
) -> None:
    page.goto(f"{asgi_server}/demo/live/")
    page.get_by_role("button", name="Start a run").click()
    page.wait_for_url("**/demo/live/?run=*")
    run = AgentRun.objects.get(pk=page.url.rsplit("run=", 1)[1])
    section = page.locator("[data-live-events]")
    page.wait_for_function("document.querySelector('[data-live-events]').dataset.live")

    first = spawn_worker("--lease-seconds", "2", "--worker-id", "first")
    # Kill it once the page has steps of the run and shows a turn's text while it streams.
    page.wait_for_function(
        "document.querySelectorAll('[data-live-steps] li[data-seq]').length >= 3"
        " && document.querySelector('[data-live-streaming]').textContent.length > 0",
        timeout=60_000,
    )
    assert first.kill() == SIGKILLED
    kept = shown_seqs(page)
    run.refresh_from_db()
    assert run.status == RunStatus.RUNNING  # cut mid-run, its lease held by a dead worker

    second = spawn_worker("--lease-seconds", "2", "--worker-id", "second")
    # Once the second worker has committed a step of its own, the page shows it after what it
    # had before the kill: nothing it kept went away meanwhile.
    page.wait_for_function(
        f"document.querySelectorAll('[data-live-steps] li[data-seq]').length > {len(kept)}",
        timeout=90_000,
    )
    assert shown_seqs(page)[: len(kept)] == kept
    page.wait_for_function(
        "document.querySelector('[data-live-events]').dataset.live === 'ended'", timeout=90_000
    )
    second.terminate()
    run.refresh_from_db()
    assert run.status == RunStatus.SUCCEEDED
    assert run.attempt >= 2  # taken over
    # Exactly the final transcript: every step once, in order, each of its kind.
    log = list(steps_of(run.pk).order_by("seq").values_list("seq", "kind"))
    assert shown_seqs(page) == [seq for seq, _ in log]
    kinds = page.eval_on_selector_all(
        "[data-live-steps] li[data-seq]", "items => items.map(i => i.dataset.kind)"
    )
    assert kinds == [kind for _, kind in log]
    assert section.get_attribute("data-status") == "succeeded"
    assert page.locator("[data-live-streaming]").text_content() == ""  # superseded by steps
    assert page.locator(".live-progress").count() >= 3  # check_table's progress messages
    # The final answer's text is on the page as the model wrote it.
    final = page.locator(f"[data-live-steps] li[data-seq='{log[-1][0]}']").text_content() or ""
    assert "Done." in final


def test_the_admin_page_of_a_run_updates_live(
    asgi_server: str, page: Page, spawn_worker: Any, fake_api: Any, django_user_model: Any
) -> None:
    import durable_agents
    from project.demo.views import TASK

    django_user_model.objects.create_superuser("watcher", password="watch-pw-1")
    # The demo's task, streamed faster: this page shows committed steps, not the text as it
    # comes (the live page's test above watches that at the demo's pace).
    fast = TASK.replace("@@chunk_latency 0.15", "@@chunk_latency 0.02")
    assert fast != TASK
    run = durable_agents.start_run("narrator", fast)
    page.goto(f"{asgi_server}/admin/login/?next=/admin/")
    page.fill("#id_username", "watcher")
    page.fill("#id_password", "watch-pw-1")
    page.get_by_role("button", name="Log in").click()
    page.wait_for_url("**/admin/")
    page.goto(f"{asgi_server}/admin/durable_agents/agentrun/{run.pk}/change/")
    box = page.locator("#run-live")
    assert box.is_visible()  # shown by live.js
    assert page.locator("#run-live [data-live-steps] li").count() == 0  # nothing new yet
    spawn_worker("--lease-seconds", "2")
    page.wait_for_function(
        "document.querySelector('#run-live').dataset.live === 'ended'", timeout=90_000
    )
    log = list(steps_of(run.pk).order_by("seq").values_list("seq", flat=True))
    assert shown_seqs(page) == log[1:]  # each step after the task, once
    assert box.get_attribute("data-status") == "succeeded"
    assert page.locator("#run-live [data-live-status]").text_content() == "succeeded"
