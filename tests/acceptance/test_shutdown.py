"""SIGTERM drains a real worker process: the step in flight commits if it ends within the
grace period, else it is abandoned uncommitted; either way the lease is released at once and
the interrupted claim is not counted against MAX_ATTEMPTS."""

from __future__ import annotations

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
