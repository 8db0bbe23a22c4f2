"""Runs in batches while their workers are SIGKILLed at random (real ``runagents``
subprocesses of one slot each, on PostgreSQL; the real SDK over HTTP to the fake API, whose
batches take a few seconds and expire a tenth of their requests).

What must hold, whatever was killed when: every run ends as it should, with each non-idempotent
effect applied once; no turn goes outside a batch; the API refuses nothing (a turn committed
other than as the API sent it would break the next request's thinking signatures: a 400);
batches carry several requests; few turns are paid twice."""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Callable

import pytest

import durable_agents
from durable_agents.models import (
    AgentBatchRequest,
    AgentRun,
    AgentWorker,
    RunStatus,
    StepKind,
)
from durable_agents.testing import plan
from tests.conftest import Receiver, WorkerProcess
from tests.fakeserver import FakeAnthropic

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True),
]

Spawn = Callable[..., WorkerProcess]
# 10 runs keep the test well within a minute; DA_CRASH_BATCH_RUNS=30 runs the release target
# (30 runs of 4 to 13 turns on three one-slot workers).
RUNS = int(os.environ.get("DA_CRASH_BATCH_RUNS", "10"))
# Seconds the fake API takes to end a batch: a run's turns go one batch after another, so this
# sets the test's length (DA_CRASH_BATCH_SECONDS=3 for batches of a few seconds).
BATCH_SECONDS = float(os.environ.get("DA_CRASH_BATCH_SECONDS", "0.5"))
WORKERS = 3
# Workers killed at least while the runs are at work.
KILLS = 3
# A safety net for a run that never ends, not a bound on speed.
DEADLINE_SECONDS = 400


def a_plan(rng: random.Random, number: int) -> tuple[str, int]:
    """3 to 12 tool turns (4 to 13 model turns with the answer), one charge among them; and
    the number of model turns."""
    turns: list[tuple[str, dict[str, object]]] = [
        ("lookup", {"key": f"r{number}-{turn}"}) for turn in range(rng.randint(3, 12))
    ]
    turns[rng.randrange(len(turns))] = ("charge", {"customer": f"c{number}", "cents": 100})
    return plan(*turns, task=f"Run {number}: follow the plan."), len(turns) + 1


class KillPacedClock:
    """The fake batches' clock: real time, but until ``KILLS`` workers were killed at most
    ``pace`` seconds past its start for each worker killed so far, and one more. A run's
    turns go one batch after another, each ending ``BATCH_SECONDS`` after its create by this
    clock: with ``pace`` the longest run's batch time shared into ``KILLS`` + 1, the runs
    cannot all end before ``KILLS`` workers were killed among them, however slowly a loaded
    machine starts the workers again."""

    def __init__(self, pace: float) -> None:
        self.pace = pace
        self.start = time.time()
        self.kills = 0

    def __call__(self) -> float:
        if self.kills >= KILLS:
            return time.time()
        return min(time.time(), self.start + (self.kills + 1) * self.pace)


def test_runs_in_batches_survive_workers_killed_at_random(
    receiver: Receiver, fake_api: FakeAnthropic, spawn_worker: Spawn
) -> None:
    rng = random.Random(37)
    fake_api.batches.processing_seconds = BATCH_SECONDS
    fake_api.batches.expire_ratio = 0.1
    env = {
        "ANTHROPIC_BASE_URL": fake_api.base_url,
        "ANTHROPIC_API_KEY": "sk-test",
        "DA_SETTINGS": json.dumps(
            {
                "BATCH_WINDOW_SECONDS": 0.25,
                "BATCH_POLL_SECONDS": 0.25,
                "BATCH_POLL_MAX_SECONDS": 0.5,
                "MAX_ATTEMPTS": 10,
                "MODEL_TIMEOUT": 30,
            }
        ),
    }
    plans = [a_plan(rng, number) for number in range(RUNS)]
    clock = KillPacedClock(max(turns for _, turns in plans) * BATCH_SECONDS / (KILLS + 1))
    fake_api.batches.clock = clock
    runs = [durable_agents.start_run("thinker", task, batch=True) for task, _ in plans]

    def worker(number: int) -> WorkerProcess:
        return spawn_worker(
            "--concurrency", "1", "--lease-seconds", "2", "--worker-id", f"w{number}", env=env
        )

    names = [f"w{n}" for n in range(WORKERS)]
    workers = [worker(n) for n in range(WORKERS)]
    started = time.monotonic()
    kills = spawned = 0
    while (
        AgentRun.objects.filter(pk__in=[r.pk for r in runs])
        .exclude(status__in=[RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.DEAD])
        .exists()
    ):
        assert time.monotonic() - started < DEADLINE_SECONDS, "the runs did not end in time"
        time.sleep(rng.uniform(1.5, 3.5))
        # A worker is killed once all three are at work (each writes its row as it starts):
        # one killed while Python still imports would test nothing, and the fleet is never
        # all restarting at once.
        working = set(AgentWorker.objects.filter(pk__in=names).values_list("pk", flat=True))
        if len(working) < WORKERS:
            continue
        candidates = list(range(WORKERS))
        victim = rng.choice(candidates)
        workers[victim].kill()
        kills += 1
        clock.kills = kills
        spawned += 1
        names[victim] = f"w{WORKERS + spawned}"
        workers[victim] = worker(WORKERS + spawned)
    for process in workers:
        process.kill()

    ended = {run.pk: run for run in AgentRun.objects.filter(pk__in=[r.pk for r in runs])}
    assert [run.status for run in ended.values()] == [RunStatus.SUCCEEDED] * RUNS, [
        run.error for run in ended.values() if run.status != RunStatus.SUCCEEDED
    ]
    assert kills >= KILLS
    # No turn went outside a batch, and the API refused nothing.
    assert fake_api.requests == []
    assert [call.status for call in fake_api.batch_calls if call.status >= 400] == []
    stats = fake_api.batches.stats()
    turns = sum(run.steps.filter(kind=StepKind.MODEL_TURN).count() for run in ended.values())
    assert turns == AgentBatchRequest.objects.filter(status="answered").count()
    sizes = stats.batch_sizes
    print(
        f"{turns} turns in {len(sizes)} batches (mean {sum(sizes) / len(sizes):.1f} requests), "
        f"{kills} workers killed, {len(stats.paid_twice)} turns paid twice, "
        f"{sum(stats.succeeded.values())} answers paid"
    )
    assert sum(sizes) / len(sizes) >= 3
    paid_twice = sum(count - 1 for count in stats.succeeded.values())
    assert paid_twice <= 0.1 * turns
    # Each charge applied once, whatever was killed while it ran.
    charges = receiver.applied("charge")
    assert len(charges) == RUNS
    assert len({charge["key"] for charge in charges}) == RUNS
