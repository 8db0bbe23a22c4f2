"""Model capacity on a real database: 429s pause the model for the fleet and never cost a run
its life, grants are race-free between connections, and the claimer takes no more runs than
the buckets have room for."""

from __future__ import annotations

import itertools
import threading
from typing import Any

import pytest

from durable_agents import store
from durable_agents.api import start_run
from durable_agents.flow.capacity import Estimate
from durable_agents.flow.capacity.portable import PortableCapacity
from durable_agents.models import AgentRun, CapacityEvent, ModelCapacity, RunStatus
from tests.conftest import wait_for
from tests.fakeserver import FakeAnthropic, api_error

pytestmark = pytest.mark.django_db(transaction=True)

MODEL = "claude-test-1"  # the model of the test app's "tester" agent


def reload(run: AgentRun) -> AgentRun:
    return AgentRun.objects.get(pk=run.pk)


def test_429s_pause_the_model_for_the_fleet_and_never_dead_letter_a_run(
    fake_api: FakeAnthropic, da_settings: Any, worker_thread: Any
) -> None:
    # One claim without progress would dead-letter a run; six 429s in a row do not.
    da_settings(MAX_ATTEMPTS=1, MODEL_RETRIES=0)
    fake_api.fail_next(
        api_error(
            429,
            "rate_limit_error",
            "Number of requests has exceeded your rate limit",
            **{
                "retry-after": "1",
                "anthropic-ratelimit-requests-limit": "50",
                "anthropic-ratelimit-requests-remaining": "0",
            },
        ),
        times=6,
    )
    runs = [start_run("tester", '@lookup {"key": "a"}') for _ in range(3)]
    # One slot: each call is sent after the previous answer (with several, calls in flight
    # when a 429 comes back were sent before it).
    worker_thread(concurrency=1, poll_interval=0.05)
    wait_for(lambda: all(reload(run).is_finished for run in runs), timeout=120)
    assert {reload(run).status for run in runs} == {RunStatus.SUCCEEDED}
    assert [r.status for r in fake_api.requests].count(429) == 6
    row = ModelCapacity.objects.get(model=MODEL)
    assert (row.rate_limited, row.pauses) == (6, 6)
    assert row.requests_per_minute == 50  # learned from the 429's headers
    assert CapacityEvent.objects.filter(model=MODEL, kind="rate_limited").count() == 6
    # After a 429, nothing went out to that model before its retry-after was over.
    statuses = [(r.status, r.at) for r in fake_api.requests]
    for (status, when), (_, after) in itertools.pairwise(statuses):
        if status == 429:
            assert after - when >= 0.95


def test_a_run_waiting_for_capacity_holds_nothing_and_says_so(
    fake_api: FakeAnthropic, da_settings: Any, worker_thread: Any
) -> None:
    da_settings(RATE_LIMITS={MODEL: {"requests_per_minute": 6, "burst_seconds": 10}})
    run = start_run("tester", '@lookup {"key": "a"}')
    worker_thread(concurrency=2, poll_interval=0.05)
    # The first call goes out; the second waits ten seconds for the bucket, handed back.
    wait_for(
        lambda: reload(run).waiting_for == "capacity" and reload(run).status == "pending",
        timeout=30,
    )
    waiting = reload(run)
    assert waiting.lease_owner is None
    assert waiting.stalled_claims == 0
    assert waiting.last_seq == 2
    assert len(fake_api.requests) == 1
    wait_for(lambda: reload(run).status == RunStatus.SUCCEEDED, timeout=60)
    assert len(fake_api.requests) == 2
    assert fake_api.requests[1].at - fake_api.requests[0].at >= 9.5


@pytest.mark.postgres
def test_grants_are_race_free_between_connections(da_settings: Any) -> None:
    da_settings(RATE_LIMITS={"racing": {"requests_per_minute": 60, "burst_seconds": 50}})
    granted: list[bool] = []
    lock = threading.Lock()
    start = threading.Barrier(16)

    def acquire() -> None:
        from django.db import connection

        gate = PortableCapacity()
        try:
            start.wait()
            for _ in range(10):
                grant = gate.acquire("racing", Estimate(1, 1), 0)
                with lock:
                    granted.append(grant.granted)
        finally:
            connection.close()

    threads = [threading.Thread(target=acquire) for _ in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    # 50 calls' room, 160 asks within well under a second: 50 granted (one refilled at most).
    assert len(granted) == 160
    assert 50 <= granted.count(True) <= 52


def test_the_claimer_takes_no_more_runs_than_there_is_room_for(da_settings: Any) -> None:
    from durable_agents.engine.worker import FIRST_CLAIMS, NO_LIMIT, Worker

    for _ in range(8):
        start_run("tester", '@lookup {"key": "a"}')
    worker = Worker(concurrency=8, handle_signals=False, burst=True)
    assert worker._capacity_room()[0] == FIRST_CLAIMS  # nothing claimed yet: no model known
    # The room is that of the models of the runs the worker claimed lately: the test model,
    # three calls at once, and another model (a run of it claimed too), limited by "*" in a
    # bucket of its own, one call at once.
    da_settings(
        RATE_LIMITS={
            MODEL: {"requests_per_minute": 60, "burst_seconds": 3},
            "*": {"requests_per_minute": 6, "burst_seconds": 10},
        }
    )
    worker._saw_models(store.current().claim_runs("w", 30, 1))
    worker._models_seen["claude-other-1"] = worker._models_seen[MODEL]
    assert worker._capacity_room()[0] == 3 + 1
    store.current().capacity.acquire(MODEL, Estimate(10, 10), 0)
    assert worker._capacity_room()[0] == 2 + 1
    for _ in range(2):
        store.current().capacity.acquire(MODEL, Estimate(10, 10), 0)
    store.current().capacity.acquire("claude-other-1", Estimate(10, 10), 0)
    room, next_in = worker._capacity_room()
    assert room == 0
    assert 0 < next_in <= 1.0  # the test model's next request, in a second at most
    da_settings(RATE_LIMITS={MODEL: {"requests_per_minute": 60, "burst_seconds": 3}})
    # The other model's bucket now has no limit: any number of its runs may be claimed.
    assert worker._capacity_room()[0] == NO_LIMIT
