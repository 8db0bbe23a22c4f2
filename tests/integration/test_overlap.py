"""Results of pure and idempotent calls commit while the next model call is in flight.

The tests hold a row lock on the run (a second PostgreSQL connection) at the moment the worker
commits its tool results, so that commit waits; whether the next model request reaches the fake
API meanwhile tells whether the two overlapped. Real PostgreSQL, a real worker, the real SDK.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg
import pytest

from durable_agents.api import start_run
from durable_agents.engine.worker import Worker
from durable_agents.models import AgentRun, AgentStep, ToolEffect
from tests.conftest import backend_waits_on_lock, before_commit_of, database_url, wait_for
from tests.fakeserver import FakeAnthropic

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

TWO_TURNS_PURE = '@lookup {"key": "a"}\n@lookup {"key": "b"}'
WITH_A_CHARGE = (
    '@lookup {"key": "a"} && charge {"customer": "cus_1", "cents": 5}\n@lookup {"key": "b"}'
)


class RowLock:
    """Locks the run's row from another connection just before the worker commits ``seq``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, seq: int) -> None:
        self.conn: psycopg.Connection | None = None
        self.taken = threading.Event()

        def lock(claim: Any) -> None:
            if self.conn is None:
                self.conn = psycopg.connect(database_url())
                self.conn.execute(
                    "SELECT 1 FROM agent_run WHERE id = %s FOR UPDATE", (claim.run_id,)
                )
                self.taken.set()

        before_commit_of(monkeypatch, seq, lock)

    def release(self, sql: str | None = None, params: tuple[Any, ...] = ()) -> None:
        assert self.conn is not None
        if sql:
            self.conn.execute(sql, params)
        self.conn.commit()
        self.conn.close()


def run_in_background() -> threading.Thread:
    worker = Worker(burst=True, handle_signals=False)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    return thread


def seqs(run_id: Any) -> list[int]:
    return list(
        AgentStep.objects.filter(run_id=run_id).order_by("seq").values_list("seq", flat=True)
    )


def second_call_sent_while_results_wait(
    fake_api: FakeAnthropic, monkeypatch: pytest.MonkeyPatch
) -> tuple[AgentRun, RowLock, threading.Thread]:
    """A two-turn pure run whose turn-1 results cannot commit (row lock held), once the
    second model call has reached the fake API all the same."""
    run = start_run("tester", TWO_TURNS_PURE)
    lock = RowLock(monkeypatch, seq=2)
    thread = run_in_background()
    assert lock.taken.wait(10)
    wait_for(lambda: len(fake_api.requests) == 2, timeout=10)
    return run, lock, thread


def test_pure_results_commit_while_the_next_call_is_in_flight(
    fake_api: FakeAnthropic, monkeypatch: pytest.MonkeyPatch
) -> None:
    run, lock, thread = second_call_sent_while_results_wait(fake_api, monkeypatch)
    assert AgentRun.objects.get(pk=run.pk).last_seq == 1  # the results are not committed yet
    lock.release()
    thread.join(30)
    run = AgentRun.objects.get(pk=run.pk)
    assert run.status == "succeeded", run.error
    assert seqs(run.pk) == [0, 1, 2, 3, 4, 5]
    assert len(fake_api.requests) == 3


@pytest.mark.parametrize(
    ("task", "overlap_setting"),
    [(TWO_TURNS_PURE, False), (WITH_A_CHARGE, True)],
    ids=["setting-off", "non-idempotent-call"],
)
def test_results_commit_before_the_next_call_when_overlap_is_not_allowed(
    fake_api: FakeAnthropic,
    monkeypatch: pytest.MonkeyPatch,
    da_settings: Any,
    task: str,
    overlap_setting: bool,
) -> None:
    da_settings(OVERLAP_SAFE_COMMITS=overlap_setting)
    run = start_run("tester", task)
    lock = RowLock(monkeypatch, seq=2)
    thread = run_in_background()
    assert lock.taken.wait(10)
    # The commit is under way and waits for the lock. A worker that overlapped would have
    # sent its next call before it began that commit: the call reaches the fake API while
    # the lock is held.
    try:
        wait_for(backend_waits_on_lock, timeout=30)
        sent_while_locked = len(fake_api.requests)
    finally:
        released_at = time.monotonic()
        lock.release()  # even on a failure: a held lock would hang the teardown
    thread.join(30)
    assert sent_while_locked == 1
    run = AgentRun.objects.get(pk=run.pk)
    assert run.status == "succeeded", run.error
    assert seqs(run.pk) == [0, 1, 2, 3, 4, 5]
    # The worker waited for its commit before calling: the call came after the lock went.
    assert fake_api.requests[1].at > released_at


def test_a_failed_commit_abandons_the_call_in_flight(
    fake_api: FakeAnthropic, monkeypatch: pytest.MonkeyPatch
) -> None:
    run, lock, thread = second_call_sent_while_results_wait(fake_api, monkeypatch)
    # A person cancels the run while its results wait to commit: the fence fails, and the
    # turn the in-flight call returned is never committed.
    lock.release(
        "UPDATE agent_run SET status = 'cancelled', lease_owner = NULL WHERE id = %s", (run.pk,)
    )
    thread.join(30)
    assert not thread.is_alive()
    run = AgentRun.objects.get(pk=run.pk)
    assert run.status == "cancelled"
    assert seqs(run.pk) == [0, 1]
    assert len(fake_api.requests) == 2
    # The call that ran is recorded all the same: it happened.
    assert ToolEffect.objects.filter(run_id=run.pk, seq=1, tool="lookup").count() == 1
