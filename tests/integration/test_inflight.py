"""Many runs in flight on a few database connections.

The heartbeat renews every lease in one statement; LISTEN/NOTIFY picks up new runs and
cancellations without polling; a worker subprocess keeps its connections to its pool while
dozens of model calls are in flight; plain tools share TOOL_THREADS permits; ``async def``
tools are awaited on the event loop (and cancelled when abandoned).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

import durable_agents
from durable_agents import store
from durable_agents.engine.worker import Worker, _Held
from durable_agents.models import AgentRun, AgentStep, RunStatus, StepKind, ToolEffect
from durable_agents.store import LeaseLoss
from tests.conftest import backend_waits_on_lock, wait_for
from tests.testapp import inflight_agents


def start(task: str, agent: str = "inflight") -> AgentRun:
    return durable_agents.start_run(agent, task)


@pytest.fixture
def background_worker(worker_thread: Any) -> Iterator[Any]:
    """conftest's ``worker_thread``; the gate is opened at teardown so no tool call hangs."""
    yield worker_thread
    inflight_agents.GATE.open.set()


# --------------------------------------------------------------------------- heartbeat


@pytest.mark.django_db(transaction=True)
def test_one_heartbeat_statement_renews_every_lease_and_names_the_runs_to_stop() -> None:
    runs = [start(f"Run {i}.") for i in range(30)]
    claims = store.current().claim_runs("worker-a", 60, 30)
    assert len(claims) == 30
    by_id = {c.run_id: c for c in claims}
    cancelled, stolen, finished = runs[0].pk, runs[1].pk, runs[2].pk
    durable_agents.cancel_run(cancelled)
    # Another worker took this one over after its lease expired.
    AgentRun.objects.filter(pk=stolen).update(lease_until="2000-01-01T00:00:00Z")
    assert store.current().claim_run(stolen, "worker-b", 60) is not None
    # Its own slot ended this one just now: not a loss.
    assert store.current().finish_run(by_id[finished], RunStatus.SUCCEEDED, result="done")
    AgentRun.objects.filter(pk__in=[r.pk for r in runs[3:]]).update(
        lease_until="2000-01-01T00:00:00Z"
    )

    worker = Worker(worker_id="worker-a", concurrency=30, lease_seconds=60, handle_signals=False)
    for claim in claims:
        worker._held[claim.run_id] = _Held(claim)
    with CaptureQueriesContext(connection) as queries:
        lost = worker.beat()

    assert lost == {cancelled: LeaseLoss.CANCELLED, stolen: LeaseLoss.LOST}
    if connection.vendor == "postgresql":
        assert len(queries) == 1, [q["sql"] for q in queries]
    assert worker._held[cancelled].interrupt.reason == "cancelled"
    assert worker._held[stolen].interrupt.reason == "lost"
    assert not worker._held[finished].interrupt.is_set()
    # Every lease still this worker's was renewed (they had expired in 2000).
    renewed = AgentRun.objects.filter(pk__in=[r.pk for r in runs[3:]], lease_owner="worker-a")
    assert renewed.filter(lease_until__gt="2001-01-01T00:00:00Z").count() == 27
    # The stolen run's new lease is untouched by the old owner.
    assert AgentRun.objects.get(pk=stolen).lease_owner == "worker-b"


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_run_finished_while_the_heartbeat_waits_for_its_row_is_not_called_lost() -> None:
    import psycopg

    from tests.conftest import database_url

    run = start("Finish me.")
    claim = store.current().claim_run(run.pk, "worker-a", 60)
    assert claim is not None
    worker = Worker(worker_id="worker-a", lease_seconds=60, handle_signals=False)
    worker._held[run.pk] = _Held(claim)
    # The run's slot ends it, in a transaction that commits only after the heartbeat's
    # statement has started and is waiting for the row.
    ending = psycopg.connect(database_url())
    ending.execute(
        "UPDATE agent_run SET status = 'succeeded', lease_owner = NULL, lease_until = NULL "
        "WHERE id = %s",
        (run.pk,),
    )
    outcome: dict[str, Any] = {}
    beat = threading.Thread(target=lambda: outcome.setdefault("lost", worker.beat()))
    beat.start()
    try:
        wait_for(lambda: backend_waits_on_lock("unnest"))
    finally:
        ending.commit()
        ending.close()
    beat.join(30)
    assert outcome["lost"] == {}
    assert not worker._held[run.pk].interrupt.is_set()


@pytest.mark.django_db(transaction=True)
def test_a_heartbeat_with_nothing_held_sends_nothing() -> None:
    worker = Worker(worker_id="idle", handle_signals=False)
    with CaptureQueriesContext(connection) as queries:
        assert worker.beat() == {}
    assert len(queries) == 0


# --------------------------------------------------------------------------- LISTEN / NOTIFY


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_new_run_is_picked_up_by_its_notification_not_by_polling(background_worker) -> None:
    # An hour between polls: only the notification can explain a pickup.
    worker = background_worker(concurrency=2, poll_interval=3600)
    wait_for(lambda: worker.listener is not None and worker.listener.listening.is_set())
    first = start("First.")
    wait_for(lambda: AgentRun.objects.get(pk=first.pk).status == RunStatus.SUCCEEDED)
    # By now the claimer has claimed and is waiting out its poll interval.
    second = start("Second.")
    wait_for(lambda: AgentRun.objects.get(pk=second.pk).status == RunStatus.SUCCEEDED)
    # Each claimed once. (Not ``worker.stats.claims``: the claimer reserves its count before
    # it looks, so a look in progress shows there as a claim until it finds nothing.)
    attempts = AgentRun.objects.filter(pk__in=[first.pk, second.pk]).values_list("attempt")
    assert sorted(attempts) == [(1,), (1,)]


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_cancel_notification_interrupts_the_model_call_in_flight(
    background_worker, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="durable_agents")
    # A heartbeat every 100 s cannot be what interrupts the call.
    worker = background_worker(concurrency=1, lease_seconds=300, heartbeat_seconds=100)
    wait_for(lambda: worker.listener is not None and worker.listener.listening.is_set())
    run = start("Wait for the model.\n@@latency 3600")
    wait_for(lambda: run.pk in worker._held)
    assert durable_agents.cancel_run(run.pk)
    wait_for(lambda: worker.stats.dispositions.get("cancelled") == 1)
    assert AgentStep.objects.filter(run_id=run.pk).count() == 1  # only the task
    notified = [r for r in caplog.records if "cancelled (notified)" in r.getMessage()]
    assert [vars(r)["run_id"] for r in notified] == [str(run.pk)]


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_cancel_lets_a_call_with_a_side_effect_finish_and_records_it(
    background_worker,
) -> None:
    gate = inflight_agents.GATE
    gate.reset()
    worker = background_worker(concurrency=1, lease_seconds=300, heartbeat_seconds=100)
    wait_for(lambda: worker.listener is not None and worker.listener.listening.is_set())
    run = start('Charge.\n@gated_charge {"cents": 250}')
    wait_for(lambda: gate.inside == 1)
    assert durable_agents.cancel_run(run.pk)
    wait_for(lambda: worker._held[run.pk].interrupt.reason == "cancelled")
    # The charge started behind the fence, so it happens: it is not walked away from.
    gate.open.set()
    wait_for(lambda: worker.stats.dispositions.get("cancelled") == 1)
    effect = ToolEffect.objects.get(run_id=run.pk)
    assert effect.result.startswith("charged 250 with ")
    assert not effect.is_error
    # The run stays cancelled: the tool_result step was not appended.
    assert AgentRun.objects.get(pk=run.pk).status == RunStatus.CANCELLED
    assert AgentStep.objects.filter(run_id=run.pk).count() == 2  # task, the turn


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_the_notify_trigger_fires_for_new_woken_and_cancelled_runs() -> None:
    import psycopg

    from durable_agents._internal import db

    listener = db.dedicated()
    listener.ensure_connection()
    raw: psycopg.Connection = listener.connection
    raw.execute(f"LISTEN {db.CHANNEL}")

    def received() -> list[str]:
        return [n.payload for n in raw.notifies(timeout=2, stop_after=1)]

    try:
        run = start("Notify me.")
        assert received() == ["run"]
        claim = store.current().claim_run(run.pk, "w", 60)
        assert claim is not None
        assert store.current().release_lease(claim)  # handed back: claimable again
        assert received() == ["run"]
        durable_agents.cancel_run(run.pk)
        assert received() == [f"cancel:{run.pk}"]
    finally:
        listener.close()


# --------------------------------------------------------------------------- connections


@pytest.mark.postgres
@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_worker_holds_many_model_calls_in_flight_on_its_small_pool(
    fake_api: Any, spawn_worker: Any
) -> None:
    in_flight = 40
    release = threading.Event()
    arrived: list[int] = []
    lock = threading.Lock()

    def hold(body: Any) -> None:
        with lock:
            arrived.append(1)
        release.wait(120)

    fake_api.before_answer = hold
    runs = [
        durable_agents.start_run("tester", f'Run {i}.\n@lookup {{"key": "k{i}"}}')
        for i in range(in_flight)
    ]

    def connections_to_the_test_db() -> int:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
            return cursor.fetchone()[0]

    baseline = connections_to_the_test_db()
    worker = spawn_worker(
        "--concurrency",
        str(in_flight),
        env={
            "ANTHROPIC_BASE_URL": fake_api.base_url,
            "ANTHROPIC_API_KEY": "sk-test",
            "DA_DB_POOL_SIZE": "3",
            # The model's limits known: no probing ramp (ten calls, then one a second until the
            # first answer, which the fake holds here) between the runs and their calls.
            "DA_SETTINGS": json.dumps(
                {"RATE_LIMITS": {"claude-test-1": {"requests_per_minute": 60_000}}}
            ),
        },
    )
    try:
        # Every run's first model call is waiting in the fake at once.
        wait_for(lambda: len(arrived) >= in_flight, timeout=60)
        held = connections_to_the_test_db() - baseline
        # DB_POOL_SIZE is all the worker holds: the heartbeat's, the listener's and a pool of
        # one connection: not one per run.
        assert held <= 3, f"{held} connections for {in_flight} runs in flight"
    finally:
        release.set()
    wait_for(
        lambda: (
            AgentRun.objects.filter(pk__in=[r.pk for r in runs], status=RunStatus.SUCCEEDED).count()
            == in_flight
        ),
        timeout=120,
    )
    worker.terminate()
    assert worker.wait() == 0, worker.output()


# --------------------------------------------------------------------------- tools


@pytest.mark.django_db(transaction=True)
def test_plain_tools_share_tool_threads_permits(background_worker, da_settings) -> None:
    da_settings(TOOL_THREADS=2)
    gate = inflight_agents.GATE
    gate.reset()
    runs = [start(f'Gate {i}.\n@gate {{"n": {i}}}') for i in range(5)]
    background_worker(concurrency=5)
    # Every run has asked for its tool call (its turn is committed): five callers, two permits.
    wait_for(
        lambda: (
            AgentStep.objects.filter(
                run_id__in=[r.pk for r in runs], kind=StepKind.MODEL_TURN
            ).count()
            == 5
        )
    )
    wait_for(lambda: gate.inside == 2)
    gate.open.set()
    wait_for(
        lambda: (
            AgentRun.objects.filter(pk__in=[r.pk for r in runs], status=RunStatus.SUCCEEDED).count()
            == 5
        )
    )
    assert gate.calls == 5
    assert gate.most_inside == 2


@pytest.mark.django_db(transaction=True)
def test_async_tools_are_awaited_on_the_event_loop(background_worker) -> None:
    inflight_agents.ASYNC_THREADS.clear()
    run = start('Async.\n@async_lookup {"key": "a"}')
    background_worker(concurrency=1)
    wait_for(lambda: AgentRun.objects.get(pk=run.pk).status == RunStatus.SUCCEEDED)
    effect = ToolEffect.objects.get(run_id=run.pk)
    assert effect.result == "async-value-of-a"
    assert not effect.is_error
    assert inflight_agents.ASYNC_THREADS == ["da-async-tools"]


@pytest.mark.django_db(transaction=True)
def test_an_async_tool_past_its_timeout_is_cancelled(background_worker) -> None:
    inflight_agents.CANCELLED.clear()
    run = start("Hang.\n@async_hang {}")
    background_worker(concurrency=1)
    wait_for(lambda: AgentRun.objects.get(pk=run.pk).status == RunStatus.SUCCEEDED)
    effect = ToolEffect.objects.get(run_id=run.pk)
    assert effect.is_error
    assert "timed out after 0.5s" in effect.result
    assert inflight_agents.CANCELLED.wait(10)
