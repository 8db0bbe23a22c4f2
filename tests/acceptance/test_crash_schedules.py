"""A schedule fired by three real ``runagents`` processes while one of them is SIGKILLed every
few slots (and started again): every slot starts exactly one run, none is missed, none
fired twice, and the runs themselves get done.

The schedule has a slot every second and ``catch_up=False``: a slot the surviving workers did
not fire in time would be skipped for good, so a missed slot shows here. The delay of each
run's creation after its slot is printed (p95, max): the target is under a second."""

from __future__ import annotations

import datetime as dt
import functools
import itertools
from typing import Any

import pytest
from django.utils import timezone

from durable_agents.models import AgentRun, AgentSchedule, RunStatus
from durable_agents.schedules.defining import schedule, slot_key
from tests.conftest import WorkerProcess, wait_for

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True),
]

EVERY = dt.timedelta(seconds=1)
# Bounded by a count of kills, each after the fleet has fired some slots since the last one,
# not by a duration: on a slow machine the loop takes longer and still kills as often.
# Three kills: each of the three workers is killed once (a fourth added a start-up, the most
# expensive thing here on a loaded machine, and tested nothing new).
KILLS = 3
SLOTS_BETWEEN_KILLS = 3
SIGKILLED = -9


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def test_each_slot_starts_one_run_while_workers_are_killed(spawn_worker: Any) -> None:
    started = itertools.count()

    def start(i: int) -> WorkerProcess:
        # A fresh id per process: one restarted under a killed worker's id would first wait
        # for the killed one's row to age out (up to its lease), which this test is not about.
        return spawn_worker(
            "--concurrency", "2", "--lease-seconds", "2", "--worker-id", f"w{i}-{next(started)}"
        )  # fmt: skip

    def up(worker: WorkerProcess) -> None:
        wait_for(lambda: "started" in worker.output(), timeout=60, interval=0.1)

    workers = [start(i) for i in range(3)]
    for worker in workers:
        up(worker)
    # Declared once the workers are up: its first slot is the first after this call.
    tick = schedule("tick", "tester", "Note the time.", every=EVERY)
    first = tick.next_slot
    assert first is not None
    fired_runs = AgentRun.objects.filter(agent="tester", start_key__startswith="tick@")

    def fired_at_least(count: int) -> bool:
        return fired_runs.count() >= count

    for kills in range(KILLS):
        # The slots between kills fire while the worker restarted last starts (the two others
        # fire them): the start-up and the slots overlap rather than add up.
        wait_for(functools.partial(fired_at_least, fired_runs.count() + SLOTS_BETWEEN_KILLS))
        # Two workers stay up through each kill: the one restarted last is up before the next
        # is killed (on a loaded machine a start takes seconds), so a missed slot is the
        # firing's fault, never a fleet that was down.
        for worker in workers:
            up(worker)
        victim = kills % len(workers)
        assert workers[victim].kill() == SIGKILLED
        workers[victim] = start(victim)
    kills = KILLS
    until = timezone.now()
    slots = []
    slot = first
    while slot <= until:
        slots.append(slot)
        slot += EVERY
    keys = {slot_key("tick", s): s for s in slots}

    def fired_through_until() -> bool:
        return AgentRun.objects.filter(start_key__in=list(keys)).count() == len(keys)

    wait_for(fired_through_until, timeout=60, interval=0.2)
    schedule("tick", "tester", "Note the time.", every=EVERY, enabled=False)
    paused_at = AgentSchedule.objects.get(name="tick").last_slot
    assert paused_at is not None

    runs = list(AgentRun.objects.filter(agent="tester"))
    # Every run is a slot's (no run without a slot key, none twice), every slot has its run.
    by_key: dict[str, int] = {}
    for run in runs:
        assert run.start_key is not None
        by_key[run.start_key] = by_key.get(run.start_key, 0) + 1
    assert set(by_key.values()) == {1}
    expected = {slot_key("tick", first + i * EVERY) for i in range(len(slots))}
    fired = set(by_key)
    assert expected <= fired, sorted(expected - fired)[:5]
    assert fired <= expected | {slot_key("tick", s) for s in _slots_after(until, paused_at)}

    # The runs get done, those of the killed workers too (their leases ran out).
    done = AgentRun.objects.filter(agent="tester", status=RunStatus.SUCCEEDED)
    wait_for(lambda: done.count() == len(runs), timeout=120, interval=0.2)

    delays = [
        (run.created_at - keys[run.start_key]).total_seconds()
        for run in runs
        if run.start_key in keys
    ]
    print(
        f"\n{len(slots)} slots, {kills} workers SIGKILLed: 1 run per slot, 0 missed; "
        f"start delay p95 {percentile(delays, 0.95) * 1000:.0f} ms, "
        f"max {max(delays) * 1000:.0f} ms"
    )
    for worker in workers:
        up(worker)  # the last one restarted handles SIGTERM once it has started
        worker.terminate()
        assert worker.wait(30) == 0, worker.output()


def _slots_after(until: dt.datetime, last: dt.datetime) -> list[dt.datetime]:
    """The slots after ``until`` up to ``last``: fired while the test was pausing."""
    slots = []
    slot = until.replace(microsecond=0) + EVERY
    while slot <= last:
        slots.append(slot)
        slot += EVERY
    return slots
