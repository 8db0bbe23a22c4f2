"""Debounced starts: ``start_run(agent, task, key=..., debounce=seconds)``.

Starts with one (agent, key) within the window collapse into one run, started once the key
has been quiet for ``debounce`` seconds, with the last call's task. Time is moved with the
pytest plugin's fake clock (``durable_clock``), never waited for."""

from __future__ import annotations

import base64
import itertools
import json
import math
import threading
import time
from typing import Any

import pytest
from django.db import connection, connections
from django.test import Client
from django.urls import reverse

from durable_agents.admin.waits import wait_info
from durable_agents.api import MAX_DEBOUNCE_SECONDS, cancel_run, start_run
from durable_agents.models import AgentRun, AgentStep, RunStatus, WaitKind
from durable_agents.store import current
from durable_agents.testing import FakeClock
from tests.conftest import run_worker
from tests.fakeserver import FakeAnthropic
from tests.integration.conftest import call_at_once
from tests.integration.test_admin import ESCAPED, SCRIPT, run_url, runs_url
from tests.integration.test_admin_waits import operations_url

# Transactions of their own (as in production): on PostgreSQL, calls then take the store's
# one-statement path (``PostgresStore``), which a test transaction would bypass.
pytestmark = pytest.mark.django_db(transaction=True)


def task_step(run: AgentRun) -> str:
    """The run's step 0 (its task as the model is sent it), decoded."""
    payload = AgentStep.objects.get(run_id=run.pk, seq=0).payload
    decoded: str = json.loads(payload)
    return decoded


def claim_all() -> list[Any]:
    """Whatever a worker could claim now (ids)."""
    return [claim.run_id for claim in current().claim_runs("test-worker", 60, limit=10)]


def test_starts_within_the_window_collapse_into_one_run_with_the_last_task(
    durable_clock: Any,
) -> None:
    first = start_run("tester", "Summarise ticket 7 (1 comment)", key="ticket:7", debounce=30)
    assert (first.status, first.waiting_for) == (RunStatus.WAITING, WaitKind.DEBOUNCE)
    first_wake = first.wake_at
    assert first_wake is not None
    second = start_run("tester", "Summarise ticket 7 (2 comments)", key="ticket:7", debounce=30)
    last = start_run(
        "tester",
        "Summarise ticket 7 (3 comments)",
        key="ticket:7",
        debounce=30,
        priority=5,
        concurrency_key="tenant:acme",
    )
    assert first.pk == second.pk == last.pk
    assert AgentRun.objects.count() == 1
    run = AgentRun.objects.get(pk=first.pk)
    assert run.task == "Summarise ticket 7 (3 comments)"
    assert task_step(run) == "Summarise ticket 7 (3 comments)"
    assert AgentStep.objects.filter(run_id=run.pk).count() == 1
    # The last call's settings win while the run has not started.
    assert (run.priority, run.concurrency_key) == (5, "tenant:acme")
    # Each call starts the window again: the run starts 30 s after the last one.
    assert run.wake_at is not None
    assert run.wake_at >= first_wake
    assert (run.status, run.waiting_for, run.started_at) == (
        RunStatus.WAITING,
        WaitKind.DEBOUNCE,
        None,
    )
    assert claim_all() == []
    # Due, it is claimed within its new concurrency key (a key no run had before).
    durable_clock.advance(31)
    assert claim_all() == [run.pk]


def test_the_run_starts_after_the_quiet_window_with_the_last_task(
    durable_clock: Any, agent_runner: Any
) -> None:
    start_run("tester", "first draft", key="ticket:8", debounce=300)
    durable_clock.advance(200)
    run = start_run("tester", "final draft", key="ticket:8", debounce=300)
    # 200 s after the first call, 300 s would have ended its window; the second call
    # started it again: 200 s more are not enough.
    durable_clock.advance(200)
    assert claim_all() == []
    run.refresh_from_db()
    assert run.status == RunStatus.WAITING
    durable_clock.advance(101)
    result = agent_runner.drive(run)
    assert result.status == RunStatus.SUCCEEDED
    assert result.transcript().startswith("0 task: final draft\n")
    assert result.run.woken_by is None  # a start, not the wake of a tool call
    assert result.run.attempt == 1
    assert durable_clock.offset == 501  # nothing else was waited for


def test_a_worker_starts_the_run_once_due_and_sends_the_model_the_last_task(
    fake_api: FakeAnthropic, durable_clock: Any
) -> None:
    run = start_run("tester", "old task", key="ticket:worker", debounce=60)
    start_run("tester", "new task", key="ticket:worker", debounce=60)
    run_worker()  # its window is not over: nothing is claimed
    assert fake_api.ok_requests() == []
    assert AgentRun.objects.get(pk=run.pk).status == RunStatus.WAITING
    durable_clock.advance(61)
    run_worker()
    run.refresh_from_db()
    assert (run.status, run.attempt, run.woken_by) == (RunStatus.SUCCEEDED, 1, None)
    [request] = fake_api.ok_requests()
    assert request.json()["messages"][0] == {"role": "user", "content": "new task"}


def test_drive_advances_the_clock_to_a_debounced_start(agent_runner: Any) -> None:
    run = start_run("tester", "only call", key="ticket:9", debounce=3600)
    result = agent_runner.drive(run)
    assert result.status == RunStatus.SUCCEEDED
    assert agent_runner.clock.offset >= 3599


def test_a_call_after_the_run_started_returns_it_unchanged(durable_clock: Any) -> None:
    first = start_run("tester", "first", key="ticket:10", debounce=5)
    durable_clock.advance(6)
    assert claim_all() == [first.pk]
    started = AgentRun.objects.get(pk=first.pk)
    late = start_run("tester", "too late", key="ticket:10", debounce=5, priority=50)
    assert late.pk == first.pk
    assert (late.status, late.task, late.priority, late.wake_at) == (
        RunStatus.RUNNING,
        "first",
        0,
        None,
    )
    assert (late.attempt, late.started_at, late.updated_at) == (
        started.attempt,
        started.started_at,
        started.updated_at,
    )
    assert task_step(late) == "first"
    assert AgentRun.objects.count() == 1


def test_a_call_without_debounce_returns_a_debouncing_run_unchanged() -> None:
    first = start_run("tester", "debounced", key="ticket:11", debounce=30)
    plain = start_run("tester", "plain", key="ticket:11")
    assert plain.pk == first.pk
    assert (plain.task, plain.wake_at, plain.updated_at) == (
        "debounced",
        first.wake_at,
        first.updated_at,
    )


def test_cancel_while_debouncing(durable_clock: Any) -> None:
    run = start_run("tester", "t", key="ticket:12", debounce=30)
    assert cancel_run(run.pk) is True
    again = start_run("tester", "after the cancel", key="ticket:12", debounce=30)
    assert again.pk == run.pk
    assert (again.status, again.task) == (RunStatus.CANCELLED, "t")
    durable_clock.advance(31)
    assert claim_all() == []
    assert AgentRun.objects.get(pk=run.pk).status == RunStatus.CANCELLED


def test_the_admin_shows_the_quiet_window(admin_client: Client) -> None:
    run = start_run("tester", "t", key=f"ticket:{SCRIPT}", debounce=30)
    info = wait_info(run)
    assert info is not None
    assert info.label == "a quiet window"
    assert info.summary.startswith("a quiet window: starts at ")
    assert not info.due

    listing = admin_client.get(runs_url()).content.decode()
    assert "waits for a quiet window: starts at " in listing
    assert admin_client.get(runs_url("?waits_for=debounce")).context["cl"].result_count == 1
    page = admin_client.get(run_url(run)).content.decode()
    assert 'id="wait-debounce"' in page
    assert f"<code>ticket:{ESCAPED}</code>" in page
    assert SCRIPT not in page
    # The operations page counts it as a wait of its own kind, not as anything stuck.
    operations = admin_client.get(operations_url())
    [row] = [r for r in operations.context["wait_rows"] if r.kind == WaitKind.DEBOUNCE]
    assert (row.label, row.count) == ("a quiet window", 1)
    # Cancel from the run page (POST), as for any run.
    response = admin_client.post(reverse("admin:durable_agents_agentrun_cancel", args=[run.pk]))
    assert response.status_code == 302
    assert AgentRun.objects.get(pk=run.pk).status == RunStatus.CANCELLED


def test_the_task_step_a_later_call_writes_is_encrypted_at_rest(
    da_settings: Any, agent_runner: Any
) -> None:
    da_settings(ENCRYPTION_KEYS=[base64.urlsafe_b64encode(b"K" * 32).decode()])
    run = start_run("tester", "first secret", key="ticket:enc", debounce=30)
    start_run("tester", "second secret", key="ticket:enc", debounce=30)
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT payload FROM agent_step WHERE run_id = %s",
            [AgentRun._meta.pk.get_db_prep_value(run.pk, connection)],
        )
        [(stored,)] = cursor.fetchall()
    assert stored.startswith("da:enc:v1:")
    assert "secret" not in stored
    assert task_step(run) == "second secret"
    result = agent_runner.drive(run)
    assert result.status == RunStatus.SUCCEEDED
    assert result.transcript().startswith("0 task: second secret\n")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"debounce": 30}, "needs key= too"),
        ({"key": "k", "debounce": 0}, "positive, finite"),
        ({"key": "k", "debounce": -1}, "positive, finite"),
        ({"key": "k", "debounce": math.nan}, "positive, finite"),
        ({"key": "k", "debounce": math.inf}, "positive, finite"),
        ({"key": "k", "debounce": True}, "not bool"),
        ({"key": "k", "debounce": "30"}, "not str"),
        ({"key": "k", "debounce": MAX_DEBOUNCE_SECONDS + 1}, "at most 86400 seconds"),
    ],
)
def test_bad_debounce_is_refused_and_creates_nothing(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        start_run("tester", "t", **options)
    assert AgentRun.objects.count() == 0
    assert AgentStep.objects.count() == 0


def test_bad_debounce_does_not_touch_a_debouncing_run() -> None:
    run = start_run("tester", "kept", key="ticket:14", debounce=30)
    with pytest.raises(ValueError, match="positive"):
        start_run("tester", "lost", key="ticket:14", debounce=-5)
    stored = AgentRun.objects.get(pk=run.pk)
    assert (stored.task, stored.wake_at) == ("kept", run.wake_at)


@pytest.mark.parametrize("seconds", [0.001, 1, 2.5, MAX_DEBOUNCE_SECONDS])
def test_debounce_takes_any_positive_number_of_seconds_up_to_a_day(seconds: float) -> None:
    run = start_run("tester", "t", key=f"k{seconds}", debounce=seconds)
    assert run.waiting_for == WaitKind.DEBOUNCE


# -- racing callers ----------------------------------------------------------------------


def _debounce_at_once(callers: int, at_once: int) -> tuple[list[Any], list[BaseException]]:
    """``callers`` threads, each with its own connection, call ``start_run(key=,
    debounce=)`` with one key, released together; at most ``at_once`` hold a connection."""
    return call_at_once(
        lambda i: start_run("tester", f"call {i}", key="ticket:race", debounce=60).pk,
        callers,
        at_once=at_once,
        join_seconds=120,
    )


def _one_consistent_run(got: list[Any], callers: int) -> None:
    assert len(got) == callers
    [run] = AgentRun.objects.filter(start_key="ticket:race")
    assert set(got) == {run.pk}
    assert AgentRun.objects.count() == 1
    assert AgentStep.objects.filter(run_id=run.pk).count() == 1
    # The row and its task step were changed together, by the same call.
    assert task_step(run) == run.task
    assert run.task in {f"call {i}" for i in range(callers)}
    assert (run.status, run.waiting_for) == (RunStatus.WAITING, WaitKind.DEBOUNCE)


@pytest.mark.postgres
def test_racing_callers_make_exactly_one_run_on_postgres() -> None:
    got, errors = _debounce_at_once(callers=60, at_once=30)
    assert errors == []
    _one_consistent_run(got, 60)


def test_racing_callers_make_exactly_one_run() -> None:
    got, errors = _debounce_at_once(callers=8, at_once=8)
    assert errors == []
    _one_consistent_run(got, 8)


@pytest.mark.postgres
def test_calls_racing_a_claim_never_change_the_run_it_took() -> None:
    """Callers push the window while a worker makes the run due (the fake clock) and claims
    it, in the middle of their calls: whatever wins each time, the task the claim read is the
    run's task for good, and no call after the claim changed the run."""
    run = start_run("tester", "call 0", key="ticket:claimed", debounce=60)
    calls_made = threading.Semaphore(0)
    hold_calls = threading.Event()  # set when the claimer lost too often: callers wait
    took_it = threading.Event()  # set once the claim is in
    claimed: list[Any] = []
    after_the_claim: list[Any] = []
    errors: list[BaseException] = []
    deadline = time.monotonic() + 120

    def claimer() -> None:
        try:
            for _ in range(20):  # let the callers get going
                calls_made.acquire(timeout=60)
            attempts = 0
            while not claimed and time.monotonic() < deadline:
                attempts += 1
                if attempts == 200:
                    # Four busy callers can keep pushing the window for as long as they like
                    # (that is what debounce is for); after 200 lost races they wait, so that
                    # the claim happens while they are still mid-loop and call after it.
                    hold_calls.set()
                FakeClock().advance(120)  # due now, unless a call pushes it again first
                claimed.extend(current().claim_runs("racer", 60, limit=1))
        except BaseException as exc:  # noqa: BLE001 - every failure of a thread is reported
            errors.append(exc)
        finally:
            took_it.set()
            connections.close_all()

    def caller(worker: int) -> None:
        """Calls until five of its calls came after the claim."""
        seen_started = 0
        try:
            for i in itertools.count(1):
                if hold_calls.is_set():
                    took_it.wait(120)
                got = start_run("tester", f"call {worker}.{i}", key="ticket:claimed", debounce=60)
                calls_made.release()
                if got.status == RunStatus.RUNNING:
                    after_the_claim.append(got)
                    seen_started += 1
                    if seen_started == 5:
                        break
                if time.monotonic() > deadline:
                    break
        except BaseException as exc:  # noqa: BLE001 - every failure of a thread is reported
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=claimer)] + [
        threading.Thread(target=caller, args=(w,)) for w in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(150)
    assert errors == []
    [claim] = claimed
    assert claim.run_id == run.pk
    assert len(after_the_claim) == 4 * 5, "too few calls came after the claim"
    stored = AgentRun.objects.get(pk=run.pk)
    assert stored.status == RunStatus.RUNNING
    assert stored.task == claim.run.task
    assert task_step(stored) == claim.run.task
    assert claim.task_payload == json.dumps(claim.run.task, ensure_ascii=False)
    assert all(got.task == claim.run.task for got in after_the_claim)
