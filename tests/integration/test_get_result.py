"""get_result / aget_result: waiting for a run's end, from sync code, async code and tests."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.db import connection, connections

import durable_agents
from durable_agents import results
from durable_agents.exceptions import InvalidArgument, ResultTimeout, RunNotFound
from durable_agents.models import AgentRun, RunStatus
from tests.conftest import run_worker, wait_for

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _services_stopped() -> Iterator[None]:
    """Each test's service thread and connections end with it (its database is flushed)."""
    yield
    results.close_services()


def waiting_in_thread(run_id: uuid.UUID, timeout: float = 30) -> tuple[threading.Thread, list[Any]]:
    """get_result in a thread of its own; what it returned or raised lands in the list."""
    got: list[Any] = []

    def wait() -> None:
        try:
            got.append(durable_agents.get_result(run_id, timeout=timeout))
        except Exception as exc:  # noqa: BLE001 - the test reads it
            got.append(exc)
        finally:
            connection.close()

    thread = threading.Thread(target=wait)
    thread.start()
    return thread, got


def until_waited_on(*run_ids: uuid.UUID) -> None:
    service = results.service()
    wait_for(lambda: all(r in service.waiting for r in run_ids), what="the waiters registered")


def test_a_waiter_gets_the_run_a_worker_finishes() -> None:
    run = durable_agents.start_run("tester", "Say hello.")
    thread, got = waiting_in_thread(run.pk)
    until_waited_on(run.pk)
    run_worker()
    thread.join(30)
    [finished] = got
    assert isinstance(finished, AgentRun)
    assert finished.pk == run.pk
    assert finished.status == RunStatus.SUCCEEDED
    assert finished.result


def test_a_run_that_ended_already_is_returned_at_once() -> None:
    run = durable_agents.start_run("tester", "Say hello.")
    durable_agents.cancel_run(run.pk)
    assert durable_agents.get_result(str(run.pk), timeout=0).status == RunStatus.CANCELLED
    assert results.service().waiters() == 0


def test_a_timeout_raises_and_leaves_the_run_alone() -> None:
    run = durable_agents.start_run("tester", "Say hello.")
    before = AgentRun.objects.values().get(pk=run.pk)
    with pytest.raises(ResultTimeout) as raised:
        durable_agents.get_result(run.pk, timeout=0.2)
    assert isinstance(raised.value, TimeoutError)
    assert AgentRun.objects.values().get(pk=run.pk) == before
    assert results.service().waiters() == 0


def test_a_cancel_and_a_dead_letter_end_the_wait() -> None:
    cancelled = durable_agents.start_run("tester", "Say hello.")
    dead = durable_agents.start_run("tester", "Say hello.")
    first, got_first = waiting_in_thread(cancelled.pk)
    second, got_second = waiting_in_thread(dead.pk)
    until_waited_on(cancelled.pk, dead.pk)
    durable_agents.cancel_run(cancelled.pk)
    AgentRun.objects.filter(pk=dead.pk).update(status=RunStatus.DEAD, error="broken")
    first.join(30)
    second.join(30)
    assert [r.status for r in got_first + got_second] == [RunStatus.CANCELLED, RunStatus.DEAD]


def test_a_change_that_is_no_end_wakes_nobody() -> None:
    run = durable_agents.start_run("tester", "Say hello.")
    thread, got = waiting_in_thread(run.pk, timeout=1.0)
    until_waited_on(run.pk)
    AgentRun.objects.filter(pk=run.pk).update(status=RunStatus.WAITING)
    thread.join(30)
    [timed_out] = got
    assert isinstance(timed_out, ResultTimeout)


def test_aget_result_from_async_code() -> None:
    run = durable_agents.start_run("tester", "Say hello.")

    async def main() -> AgentRun:
        waiting = asyncio.ensure_future(durable_agents.aget_result(run.pk, timeout=30))
        while run.pk not in results.service().waiting:
            await asyncio.sleep(0.01)
        await asyncio.to_thread(durable_agents.cancel_run, run.pk)
        try:
            return await waiting
        finally:
            await sync_to_async(connections.close_all)()  # the executor thread's connection

    finished = asyncio.run(main())
    assert finished.status == RunStatus.CANCELLED


def test_aget_result_timeout_and_cancellation() -> None:
    run = durable_agents.start_run("tester", "Say hello.")

    async def main() -> None:
        with pytest.raises(ResultTimeout):
            await durable_agents.aget_result(run.pk, timeout=0.1)
        task = asyncio.ensure_future(durable_agents.aget_result(run.pk))
        while run.pk not in results.service().waiting:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await sync_to_async(connections.close_all)()  # the executor thread's connection

    asyncio.run(main())
    assert results.service().waiters() == 0
    assert AgentRun.objects.get(pk=run.pk).status == RunStatus.PENDING


@pytest.mark.parametrize("bad", ["not-a-uuid", 42, None, b"x"])
def test_an_id_that_is_not_a_run_id_is_refused(bad: object) -> None:
    with pytest.raises(InvalidArgument):
        durable_agents.get_result(bad, timeout=1)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [-1, "10", float("nan"), True])
def test_a_bad_timeout_is_refused(bad: object) -> None:
    run = durable_agents.start_run("tester", "Say hello.")
    with pytest.raises(InvalidArgument):
        durable_agents.get_result(run.pk, timeout=bad)  # type: ignore[arg-type]


def test_an_unknown_run_is_not_found() -> None:
    with pytest.raises(RunNotFound):
        durable_agents.get_result(uuid.uuid4(), timeout=1)
    assert results.service().waiters() == 0


def test_many_waiters_cost_the_database_no_query_each() -> None:
    """40 threads wait on 40 runs, which end in one statement. The service's queries do not
    grow with the waiters: on PostgreSQL none while nothing ends (but its look after
    connecting) and one per batch of notified ends; elsewhere one per poll for them all."""
    runs = [durable_agents.start_run("tester", f"Say hello {i}.") for i in range(40)]
    service = results.service()
    before = service.queries
    waiting = [waiting_in_thread(run.pk) for run in runs]
    until_waited_on(*(run.pk for run in runs))
    wait_for(service.ready.is_set, what="the service ready")
    before_end, ending = service.queries, time.monotonic()
    AgentRun.objects.filter(pk__in=[r.pk for r in runs]).update(status=RunStatus.FAILED)
    for thread, _ in waiting:
        thread.join(30)
    took = time.monotonic() - ending
    assert all(got[0].status == RunStatus.FAILED for _, got in waiting)
    sent = service.queries - before_end
    if connection.vendor == "postgresql":
        assert before_end - before <= 1  # nothing ended yet: at most the look after connecting
        assert sent <= 5  # the 40 ends of one commit arrive in a packet or a few
    else:
        # At most one per poll while the runs ended, whatever the number of waiters.
        assert sent <= took / results.POLL_SECONDS + 2, (sent, took)


def listening_connection() -> Any:
    import psycopg

    from tests.conftest import database_url

    listener = psycopg.connect(
        database_url().replace("postgres://", "postgresql://"), autocommit=True
    )
    listener.execute(f"LISTEN {results.END_CHANNEL}")
    return listener


@pytest.mark.postgres
def test_a_run_that_ends_is_notified_once_and_nothing_else_is() -> None:
    run = durable_agents.start_run("tester", "Say hello.")
    listener = listening_connection()
    try:
        AgentRun.objects.filter(pk=run.pk).update(status=RunStatus.WAITING)
        AgentRun.objects.filter(pk=run.pk).update(status=RunStatus.RUNNING)
        AgentRun.objects.filter(pk=run.pk).update(status=RunStatus.SUCCEEDED)
        AgentRun.objects.filter(pk=run.pk).update(result="again")  # no change of status
        heard = [n.payload for n in listener.notifies(timeout=1.0)]
    finally:
        listener.close()
    assert heard == [str(run.pk)]


@pytest.mark.postgres
def test_an_end_while_the_listener_was_cut_off_is_not_missed() -> None:
    run = durable_agents.start_run("tester", "Say hello.")
    thread, got = waiting_in_thread(run.pk)
    until_waited_on(run.pk)
    service = results.service()
    wait_for(service.ready.is_set, what="the service listening")
    with connection.cursor() as cursor:
        cursor.execute(
            # Only this test database's: other test processes listen on the same cluster.
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND query = %s AND pid <> pg_backend_pid()",
            [f"LISTEN {results.END_CHANNEL}"],
        )
        assert cursor.fetchone() is not None  # the service's connection was found and cut
    # Ended while the service is (likely) reconnecting: its look after connecting finds it.
    durable_agents.cancel_run(run.pk)
    thread.join(30)
    [finished] = got
    assert finished.status == RunStatus.CANCELLED
