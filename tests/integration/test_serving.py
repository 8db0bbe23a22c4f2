"""A worker's pass over what the fleet can serve (housekeeping/serving.py): runs of versions no
live worker defines wait for one, a worker that serves them wakes them, and a worker whose
agent ``upgrades_from`` an old version carries its runs over once no live worker defines it."""

from __future__ import annotations

import datetime
import uuid
from collections.abc import Iterator

import pytest
from django.utils import timezone

from durable_agents import store
from durable_agents.api import start_run
from durable_agents.declare.agents import Agent, registry
from durable_agents.housekeeping import serving
from durable_agents.models import AgentRun, AgentWorker, RunStatus
from durable_agents.testing import describe_wait
from tests.testapp.agents import lookup

pytestmark = pytest.mark.django_db(transaction=True)


def rollout(version: str, **options: object) -> Agent:
    return Agent(
        name="rollout-pass",
        version=version,
        model="claude-test-1",
        system=f"You roll out, version {version}.",
        tools=[lookup],
        max_tokens=512,
        **options,  # type: ignore[arg-type]
    )


@pytest.fixture
def old_runs() -> Iterator[list[AgentRun]]:
    """Three pending runs of rollout-pass@1, started by code that defined it; then the code
    of the test process defines only version 2, which upgrades from 1."""
    rollout("1")
    runs = [start_run("rollout-pass", f"Task {n}.") for n in range(3)]
    registry.unregister("rollout-pass", "1")
    rollout("2", upgrades_from=["1"])
    yield runs
    registry.unregister("rollout-pass", "2")


def live_worker(version: str) -> None:
    AgentWorker.objects.create(
        id=f"old-code-{uuid.uuid4().hex[:6]}", instance=uuid.uuid4(), host="h", pid=1,
        concurrency=1, alive_until=timezone.now() + datetime.timedelta(minutes=1),
        versions=[{"agent": "rollout-pass", "version": version, "model": "m", "fingerprint": "f"}],
    )  # fmt: skip


def versions(runs: list[AgentRun]) -> list[tuple[str, str]]:
    rows = dict(AgentRun.objects.values_list("pk", "prompt_version"))
    status = dict(AgentRun.objects.values_list("pk", "status"))
    return [(rows[r.pk], status[r.pk]) for r in runs]


def test_a_live_worker_of_the_old_code_keeps_its_runs(old_runs: list[AgentRun]) -> None:
    live_worker("1")
    carry = serving.CarryOver()
    assert serving.serve_pass(store.current(), "w", carry) == (0, 0)
    assert versions(old_runs) == [("1", RunStatus.PENDING)] * 3


def test_once_no_live_worker_defines_the_old_version_its_runs_are_carried_over(
    old_runs: list[AgentRun],
) -> None:
    carry = serving.CarryOver()
    assert serving.serve_pass(store.current(), "w", carry) == (0, 0)
    assert versions(old_runs) == [("2", RunStatus.PENDING)] * 3
    fingerprint = registry.get("rollout-pass", "2").fingerprint("claude-test-1")
    assert set(AgentRun.objects.values_list("fingerprint", flat=True)) >= {fingerprint}


def test_without_upgrades_from_they_wait_for_a_worker_and_one_wakes_them() -> None:
    rollout("1")
    runs = [start_run("rollout-pass", f"Task {n}.") for n in range(2)]
    registry.unregister("rollout-pass", "1")
    try:
        assert serving.serve_pass(store.current(), "w", serving.CarryOver()) == (0, 2)
        assert versions(runs) == [("1", RunStatus.WAITING)] * 2
        assert store.current().claim_runs("w", 5) == []
        rollout("1")  # a worker of the old code comes back
        assert serving.serve_pass(store.current(), "w", serving.CarryOver()) == (2, 0)
        assert versions(runs) == [("1", RunStatus.PENDING)] * 2
    finally:
        registry.unregister("rollout-pass", "1")


def test_a_run_held_at_that_moment_is_offered_again_at_the_next_pass(
    old_runs: list[AgentRun],
) -> None:
    held = store.current().claim_run(old_runs[0].pk, "old-code", 60)  # a live lease
    assert held is not None
    carry = serving.CarryOver()
    serving.serve_pass(store.current(), "w", carry)
    assert versions(old_runs)[1:] == [("2", RunStatus.PENDING)] * 2
    assert versions(old_runs)[0] == ("1", RunStatus.RUNNING)
    assert old_runs[0].pk not in carry.refused  # momentary: not remembered
    assert store.current().release_lease(held)
    serving.serve_pass(store.current(), "w", carry)
    assert versions(old_runs)[0] == ("2", RunStatus.PENDING)


def test_a_killed_workers_runs_of_a_version_nobody_defines_wait_visibly() -> None:
    rollout("1")
    run = start_run("rollout-pass", "Task.")
    registry.unregister("rollout-pass", "1")
    assert store.current().claim_run(run.pk, "killed-worker", 60) is not None
    AgentRun.objects.filter(pk=run.pk).update(
        lease_until=timezone.now() - datetime.timedelta(seconds=1)
    )  # its worker died: the lease ran out
    assert serving.serve_pass(store.current(), "w", serving.CarryOver()) == (0, 1)
    assert versions([run]) == [("1", RunStatus.WAITING)]


def test_the_testing_helpers_say_what_a_run_waiting_for_a_worker_waits_for() -> None:
    rollout("1")
    run = start_run("rollout-pass", "Task.")
    registry.unregister("rollout-pass", "1")
    serving.serve_pass(store.current(), "w", serving.CarryOver())
    said = describe_wait(AgentRun.objects.get(pk=run.pk))
    assert said.startswith("a worker that defines rollout-pass@1 with the run's definition")
    assert "no live worker does" in said
