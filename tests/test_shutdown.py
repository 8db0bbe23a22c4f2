"""SIGTERM drains a real worker process: the step in flight commits if it ends within the
grace period, else it is abandoned uncommitted; either way the lease is released at once and
the interrupted claim is not counted against MAX_ATTEMPTS."""

from __future__ import annotations

import time
from typing import Any

import pytest

import durable_agents
from durable_agents.models import AgentRun, AgentStep, RunStatus
from tests.conftest import wait_for

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
) -> tuple[Any, float]:
    run = durable_agents.start_run("tester", task)
    worker = spawn_worker("--lease-seconds", "30", "--grace-seconds", grace)
    wait_for(lambda: receiver.marker("slow-started"), timeout=30)
    started = time.monotonic()
    worker.terminate()
    assert worker.wait(15) == 0, worker.output()
    return run, time.monotonic() - started


def test_the_step_in_flight_commits_within_the_grace_period(
    spawn_worker: Any, receiver: Any
) -> None:
    run, took = _sigterm_during_slow_tool(spawn_worker, receiver, grace="5")
    assert took < 4
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
    task = 'Deploy me.\n@slow {"seconds": 6}\n@lookup {"key": "after"}'
    run, took = _sigterm_during_slow_tool(spawn_worker, receiver, grace="0.2", task=task)
    assert took < 4  # did not wait for the 6 s tool
    run.refresh_from_db()
    assert _steps(run) == [(0, 0), (1, 1)]  # nothing half-committed
    assert (run.status, run.lease_owner) == (RunStatus.PENDING, None)
    assert run.stalled_claims == 0  # a deploy is not the run's fault
    started = time.monotonic()
    finisher = spawn_worker("--burst")
    assert finisher.wait(30) == 0
    assert time.monotonic() - started < 20  # claimable at once: no 30 s lease to wait out
    run.refresh_from_db()
    assert run.status == RunStatus.SUCCEEDED
    assert _steps(run)[2:] == [(2, 2), (3, 2), (4, 2), (5, 2)]  # the tool ran again


def test_a_second_signal_abandons_at_once(spawn_worker: Any, receiver: Any) -> None:
    run = durable_agents.start_run("tester", 'Slow.\n@slow {"seconds": 5}')
    worker = spawn_worker("--lease-seconds", "30", "--grace-seconds", "30")
    wait_for(lambda: receiver.marker("slow-started"), timeout=30)
    worker.terminate()
    time.sleep(0.3)
    started = time.monotonic()
    worker.terminate()
    assert worker.wait(10) == 0
    assert time.monotonic() - started < 4  # neither the 5 s tool nor the 30 s grace
    run.refresh_from_db()
    assert (run.status, run.lease_owner, run.stalled_claims) == (RunStatus.PENDING, None, 0)
    assert _steps(run) == [(0, 0), (1, 1)]
