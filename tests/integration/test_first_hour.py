"""What a new user meets in the first hour: a worker without a key, a key the API refuses, a
prompt edited without a new version, a burst right after a killed worker, the worker's summary.

The model is the real SDK over HTTP to the fake API (``fake_api``), or the SDK with no key."""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError, SystemCheckError
from django.db.models.functions import Now
from django.urls import reverse

from durable_agents import checks as da_checks
from durable_agents import store
from durable_agents.api import start_run
from durable_agents.engine import credentials
from durable_agents.engine.worker import Worker
from durable_agents.models import AgentRun, RunStatus, WaitKind
from durable_agents.observe.figures import Part, read_figures
from tests.conftest import run_worker, wait_for
from tests.fakeserver import FakeAnthropic, api_error

pytestmark = pytest.mark.django_db(transaction=True)

REFUSED_KEY = api_error(401, "authentication_error", "invalid x-api-key")


@pytest.fixture
def no_key(da_settings: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """OFFLINE off, the default client, and no key in the environment."""
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    monkeypatch.delenv("ANTHROPIC_AUTH_TOKEN", raising=False)
    da_settings(OFFLINE=False)


def errors_of(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= logging.ERROR]


# -- a worker without a key --------------------------------------------------------------


def test_runagents_without_a_key_refuses_to_start(no_key: None, settings: Any) -> None:
    settings.DEBUG = True
    run = start_run("tester", "hello")
    with pytest.raises(SystemCheckError, match=r"durable_agents\.E040"):
        call_command("runagents", "--burst", skip_checks=False)
    assert AgentRun.objects.get(pk=run.pk).attempt == 0  # nothing was claimed
    # Only the worker refuses: `manage.py check` (every other command) warns, as before.
    assert "durable_agents.E040" not in [m.id for m in da_checks.check_settings()]
    settings.SILENCED_SYSTEM_CHECKS = ["durable_agents.E040"]
    assert [m for m in da_checks.worker_checks.run_checks() if not m.is_silenced()] == []


def test_a_worker_without_a_key_hands_runs_back_uncounted(
    no_key: None, caplog: pytest.LogCaptureFixture
) -> None:
    # Past the check (call_command skips it, as --skip-checks does): the SDK has no key to send.
    caplog.set_level(logging.INFO, logger="durable_agents")
    run = start_run("tester", "hello")
    worker = run_worker()
    run = AgentRun.objects.get(pk=run.pk)
    assert (run.status, run.stalled_claims) == (RunStatus.PENDING, 0)
    assert worker.stats.dispositions == {"refused": 1}
    [error] = errors_of(caplog)
    assert "no credentials" in error.getMessage()
    assert error.exc_info is None


# -- a key the API refuses -----------------------------------------------------------------


def test_a_refused_key_pauses_claims_and_charges_no_attempt(
    fake_api: FakeAnthropic,
    da_settings: Any,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(credentials, "FIRST_PAUSE_SECONDS", 0.2)
    monkeypatch.setattr(credentials, "MAX_PAUSE_SECONDS", 0.4)
    caplog.set_level(logging.INFO, logger="durable_agents")
    # More refusals than attempts: before, the run went to the dead letter after two.
    da_settings(MAX_ATTEMPTS=2)
    fake_api.fail_next(REFUSED_KEY, times=4)
    run = start_run("tester", '@lookup {"key": "a"}')
    worker = Worker(handle_signals=False, poll_interval=0.05)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: AgentRun.objects.get(pk=run.pk).status == RunStatus.SUCCEEDED, 60)
    finally:
        worker.stop()
        thread.join(30)
    statuses = [r.status for r in fake_api.requests]
    assert statuses[:4] == [401, 401, 401, 401]
    assert worker.stats.dispositions["refused"] == 4
    # One line when the API started refusing (the status and its message, no traceback), one
    # when it answered again; nothing for the refusals in between.
    [error] = errors_of(caplog)
    assert "(401)" in error.getMessage()
    assert "invalid x-api-key" in error.getMessage()
    assert error.exc_info is None
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]
    again = [r for r in caplog.records if "accepts this worker's credentials" in r.getMessage()]
    assert len(again) == 1


def test_a_key_revoked_while_running_pauses_the_worker(
    fake_api: FakeAnthropic, caplog: pytest.LogCaptureFixture
) -> None:
    # The first call is answered, the second refused (403: the key lost its permission).
    caplog.set_level(logging.INFO, logger="durable_agents")
    run = start_run("tester", '@lookup {"key": "a"}')
    calls = 0

    def revoke(body: dict[str, Any]) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            fake_api.fail_next(api_error(403, "permission_error", "key revoked"), times=9)

    fake_api.before_answer = revoke
    worker = run_worker()
    run = AgentRun.objects.get(pk=run.pk)
    assert (run.status, run.stalled_claims, run.last_seq) == (RunStatus.PENDING, 0, 2)
    assert worker.stats.dispositions == {"refused": 1}
    [error] = errors_of(caplog)
    assert "(403)" in error.getMessage()
    assert "key revoked" in error.getMessage()


# -- prompt drift --------------------------------------------------------------------------


def _drifted_run() -> AgentRun:
    """A run whose agent changed since it started (its pinned fingerprint is another)."""
    run = start_run("tester", "hello")
    AgentRun.objects.filter(pk=run.pk).update(fingerprint="f" * 64)
    return run


def test_check_names_the_drifted_agent_and_its_runs(settings: Any) -> None:
    settings.DEBUG = True
    _drifted_run()
    _drifted_run()
    start_run("tester", "not drifted")
    # Only when asked for the database: plain `manage.py check` does not read it.
    assert da_checks.check_prompt_drift(databases=None) == []
    [warning] = da_checks.check_prompt_drift(databases=["default"])
    assert warning.id == "durable_agents.W040"
    assert "tester@" in warning.msg
    assert "2 run(s) in flight" in warning.msg
    assert "ffffffffffff" in warning.msg


def test_runagents_strict_refuses_before_touching_a_drifted_run(
    keep_signal_handlers: None, settings: Any, caplog: pytest.LogCaptureFixture
) -> None:
    settings.DEBUG = True
    run = _drifted_run()
    with pytest.raises(CommandError, match="tester@"):
        call_command("runagents", "--burst", "--strict")
    assert AgentRun.objects.get(pk=run.pk).attempt == 0
    caplog.set_level(logging.INFO, logger="durable_agents")
    call_command("runagents", "--burst", "--max-runs", "0")
    [warning] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "1 run(s) in flight" in warning.getMessage()
    assert AgentRun.objects.get(pk=run.pk).attempt == 0


# -- the end of a burst --------------------------------------------------------------------


def test_a_burst_says_when_other_workers_leases_expire(
    keep_signal_handlers: None, settings: Any, caplog: pytest.LogCaptureFixture
) -> None:
    settings.DEBUG = True
    for i in range(2):
        start_run("tester", f"held {i}")
    # A worker claimed them and was killed: its leases hold them for a minute more.
    assert len(store.current().claim_runs("killed-worker", 60, 2)) == 2
    caplog.set_level(logging.INFO, logger="durable_agents")
    call_command("runagents", "--burst")
    [line] = [r.getMessage() for r in caplog.records if "leases" in r.getMessage()]
    assert line.startswith("2 runs are held by other workers' leases; the last expires in ")
    assert line.endswith(" UTC)")


def test_the_worker_summary_reads_as_plain_words(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="durable_agents")
    start_run("tester", "hello")
    run_worker()
    [line] = [r.getMessage() for r in caplog.records if " stopped after " in r.getMessage()]
    assert line.endswith("stopped after 1 claims: succeeded 1"), line
    assert "Disposition" not in line


# -- the operations page ---------------------------------------------------------------------


def test_the_oldest_wait_is_found_whatever_the_database(admin_client: Any) -> None:
    # The store stamps waiting_since with the database's clock (Now()), as here.
    older, newer = start_run("tester", "first"), start_run("tester", "second")
    for run in (older, newer):
        AgentRun.objects.filter(pk=run.pk).update(
            status=RunStatus.WAITING, waiting_for=WaitKind.TIMER, waiting_since=Now()
        )
    figures = read_figures(Part.WAITS | Part.OLDEST_WAITING_RUNS)
    [wait] = figures.waits
    assert wait.runs == 2
    assert wait.oldest_run is not None
    first = AgentRun.objects.order_by("waiting_since", "pk").first()
    assert first is not None
    assert wait.oldest_run.pk == first.pk
    page = admin_client.get(reverse("admin:durable_agents_agentrun_operations"))
    assert page.status_code == 200
    assert "waiting since" in page.content.decode()
