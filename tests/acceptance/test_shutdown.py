"""SIGTERM drains a real worker process: the step in flight commits if it ends within the
grace period, else it is abandoned uncommitted; either way the lease is released at once and
the interrupted claim is not counted against MAX_ATTEMPTS."""

from __future__ import annotations

import datetime
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.utils import timezone

import durable_agents
from durable_agents.models import AgentRun, AgentStep, IntentStatus, RunStatus, ToolIntent
from tests.conftest import run_worker, wait_for
from tests.fakeserver import FakeAnthropic, api_error

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True),
]

TASK = 'Deploy me.\n@slow {"seconds": 1.5}\n@lookup {"key": "after"}'


def _steps(run: AgentRun) -> list[tuple[int, int]]:
    return list(AgentStep.objects.filter(run=run).values_list("seq", "attempt"))


def _sigterm_during_slow_tool(
    spawn_worker: Any, receiver: Any, grace: str, task: str = TASK
) -> AgentRun:
    """SIGTERM while the tool runs; the worker must exit within a minute, which only a worker
    that neither waits out an hour-long grace period nor an hour-long tool can do."""
    run = durable_agents.start_run("tester", task)
    # A lease nobody waits out: the run is claimable again only if it was handed back.
    worker = spawn_worker("--lease-seconds", "3600", "--grace-seconds", grace)
    wait_for(lambda: receiver.marker("slow-started"), timeout=30)
    worker.terminate()
    assert worker.wait(60) == 0, worker.output()
    return run


def test_the_step_in_flight_commits_within_the_grace_period(
    spawn_worker: Any, receiver: Any
) -> None:
    # The 1.5 s tool ends within the grace period; the hour-long grace is not waited out.
    run = _sigterm_during_slow_tool(spawn_worker, receiver, grace="3600")
    run.refresh_from_db()
    # The tool finished and its result was committed; then the run was handed back.
    assert _steps(run) == [(0, 0), (1, 1), (2, 1)]
    assert (run.status, run.lease_owner, run.lease_until) == (RunStatus.PENDING, None, None)
    assert run.stalled_claims == 0
    finisher = spawn_worker("--burst")
    assert finisher.wait(30) == 0
    run.refresh_from_db()
    assert run.status == RunStatus.SUCCEEDED
    assert _steps(run) == [(0, 0), (1, 1), (2, 1), (3, 2), (4, 2), (5, 2)]


def test_a_step_longer_than_the_grace_period_is_abandoned(spawn_worker: Any, receiver: Any) -> None:
    # The worker exits without waiting for the hour-long tool.
    task = 'Deploy me.\n@slow {"seconds": 3600}\n@lookup {"key": "after"}'
    run = _sigterm_during_slow_tool(spawn_worker, receiver, grace="0.2", task=task)
    run.refresh_from_db()
    assert _steps(run) == [(0, 0), (1, 1)]  # nothing half-committed
    assert (run.status, run.lease_owner) == (RunStatus.PENDING, None)
    assert run.stalled_claims == 0  # a deploy is not the run's fault
    # Claimable at once: the hour-long lease was released, not left to expire.
    assert AgentRun.objects.claimable().filter(pk=run.pk).exists()
    (receiver.directory / "slow-release").touch()  # the tool's rerun need not take an hour
    finisher = spawn_worker("--burst")
    assert finisher.wait(60) == 0, finisher.output()
    run.refresh_from_db()
    assert run.status == RunStatus.SUCCEEDED
    assert _steps(run)[2:] == [(2, 2), (3, 2), (4, 2), (5, 2)]  # the tool ran again


def test_a_second_signal_abandons_at_once(spawn_worker: Any, receiver: Any) -> None:
    run = durable_agents.start_run("tester", 'Slow.\n@slow {"seconds": 3600}')
    worker = spawn_worker("--lease-seconds", "3600", "--grace-seconds", "3600")
    wait_for(lambda: receiver.marker("slow-started"), timeout=30)
    worker.terminate()
    wait_for(lambda: "draining" in worker.output(), timeout=30)  # the first signal was seen
    worker.terminate()
    # Within a minute: neither the hour-long tool nor the hour-long grace period is waited out.
    assert worker.wait(60) == 0, worker.output()
    run.refresh_from_db()
    assert (run.status, run.lease_owner, run.stalled_claims) == (RunStatus.PENDING, None, 0)
    assert _steps(run) == [(0, 0), (1, 1)]


def test_a_grace_that_runs_out_during_an_irreversible_call_says_so(
    spawn_worker: Any, receiver: Any
) -> None:
    run = durable_agents.start_run("tester", 'Drop it.\n@drop_table {"table": "old"}')
    run_worker()  # the run asks for approval
    intent = ToolIntent.objects.get(run=run)
    approver = get_user_model().objects.create_superuser("ann", "ann@example.com", "pw")
    durable_agents.approve_intent(intent.pk, user=approver)
    # The approved call takes an hour; the worker is stopped with half a second of grace.
    worker = spawn_worker(
        "--lease-seconds", "3600", "--grace-seconds", "0.5", env={"DA_DROP_DELAY": "3600"}
    )
    wait_for(lambda: receiver.attempts("drop"), timeout=30)  # the effect is under way
    worker.terminate()
    assert worker.wait(60) == 0, worker.output()
    intent.refresh_from_db()
    run.refresh_from_db()
    # Said at once, by the worker that stopped, as what happened: not a crash found later.
    assert intent.status == IntentStatus.UNKNOWN
    assert "shutdown grace of 0.5s" in intent.reason
    assert "(SIGTERM)" in intent.reason
    assert "ran out while the call was in flight" in intent.reason
    assert "crash" not in intent.reason
    assert run.error == intent.reason  # on the runs list and the run's page too
    assert (run.status, run.waiting_for, run.lease_owner) == (RunStatus.WAITING, "intent", None)
    assert run.stalled_claims == 0
    output = worker.output()
    assert "outcome unknown after a crash" not in output
    assert f"intent {intent.pk} for drop_table: outcome unknown: worker" in output
    assert "the shutdown grace of 0.5s ran out with 1 step(s) in flight" in output
    assert len(receiver.attempts("drop")) == 1  # never run again blindly


def test_a_drain_during_a_pause_before_a_retry_ends_at_once(
    spawn_worker: Any, fake_api: FakeAnthropic
) -> None:
    # The API is overloaded and asks for 30 s; the grace is two minutes. A worker that slept
    # out the pause (or the grace) would still be running when the bound below ends.
    fake_api.fail_next(api_error(529, "overloaded_error", "Overloaded", **{"retry-after": "30"}))
    run = durable_agents.start_run("tester", 'Look.\n@lookup {"key": "a"}')
    worker = spawn_worker("--lease-seconds", "3600", "--grace-seconds", "120")
    wait_for(lambda: "retry 1/" in worker.output(), timeout=60)  # the slot waits to retry
    overloaded_at = timezone.now()
    worker.terminate()
    assert worker.wait(20) == 0, worker.output()
    run.refresh_from_db()
    # Handed back, uncounted: claimable once the server's 30 s have passed, not the lease.
    assert (run.status, run.lease_owner, run.stalled_claims) == (RunStatus.PENDING, None, 0)
    assert run.waiting_for == "capacity"
    assert run.lease_until is not None
    assert run.lease_until <= overloaded_at + datetime.timedelta(seconds=31)
    assert [r.status for r in fake_api.requests] == [529]  # no call went out meanwhile
    assert not AgentRun.objects.claimable().filter(pk=run.pk).exists()  # the pause holds it
    # The server's 30 s pass (the run's not-before time moves back rather than the test
    # sleeping them out): the run is claimable, and the next worker finishes it.
    AgentRun.objects.filter(pk=run.pk).update(lease_until=timezone.now())
    wait_for(lambda: AgentRun.objects.claimable().filter(pk=run.pk).exists(), timeout=10)
    finisher = spawn_worker("--burst")
    assert finisher.wait(60) == 0, finisher.output()
    run.refresh_from_db()
    assert run.status == RunStatus.SUCCEEDED, run.error
    assert run.stalled_claims == 0
