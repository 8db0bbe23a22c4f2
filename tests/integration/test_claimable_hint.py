"""A slot's last step claims the next run only while runs may wait (engine/claimable.py).

A real worker with its listener on PostgreSQL, the real SDK over the fake API. The store is
the real PostgresStore, which also notes each last step's choice: whether it sent the claim
along (``NextClaim.take``) and whether that claim found a run."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import transaction

import durable_agents
from durable_agents.engine.worker import Worker
from durable_agents.models import AgentRun, RunStatus
from durable_agents.store.base import NextClaim
from durable_agents.store.postgres import PostgresStore
from tests.conftest import wait_for, worker_in_a_thread
from tests.fakeserver import FakeAnthropic

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


class NotingStore(PostgresStore):
    """PostgresStore, noting (claim sent along, run found) for every last step."""

    def __init__(self) -> None:
        super().__init__()
        self.last_steps: list[tuple[bool, bool]] = []
        self._lock = threading.Lock()

    def _finish_and_claim(
        self, params: dict[str, Any], then_claim: NextClaim, unless_messages: bool
    ) -> bool:
        took: list[bool] = []
        take = then_claim.take

        def noted_take() -> bool:
            took.append(take())
            return took[-1]

        then_claim.take = noted_take
        try:
            return super()._finish_and_claim(params, then_claim, unless_messages)
        finally:
            with self._lock:
                self.last_steps.append((bool(took and took[0]), then_claim.claim is not None))


@pytest.fixture
def worker(fake_api: FakeAnthropic, request: pytest.FixtureRequest) -> Iterator[Worker]:
    options = {"concurrency": 2, "listen": True, "poll_interval": 30}
    options.update(getattr(request, "param", {}))
    with worker_in_a_thread(store=NotingStore(), **options) as w:
        # A claim that found nothing is believed for as long as a test may take on a busy
        # machine (the hint forgets it after a second otherwise, and a slow run's last step
        # would then send the claim after all).
        w._claimable._forget_seconds = 120
        yield w


def noted(w: Worker) -> list[tuple[bool, bool]]:
    assert isinstance(w.store, NotingStore)
    return w.store.last_steps


def run_alone(w: Worker, task: str) -> None:
    """Start one run, with the worker idle, and wait for it to end."""
    run = durable_agents.start_run("tester", task)
    wait_for(lambda: AgentRun.objects.get(pk=run.pk).status == RunStatus.SUCCEEDED)
    # Its slot has ended it (the status is committed by the last step itself).
    wait_for(lambda: w.in_flight() == 0)


def test_runs_ending_while_nothing_is_claimable_send_no_claim(worker: Worker) -> None:
    # Each run alone: the claimer asked for two and found one, so nothing else waited.
    for i in range(3):
        run_alone(worker, f"Run {i}.")
    assert noted(worker) == [(False, False)] * 3


def run_unheard(w: Worker, task: str) -> None:
    """Start one run with the worker idle and no listener, tell the claimer as a poll would,
    and wait for it to end."""
    durable_agents.start_run("tester", task)
    w._wake.set()
    wait_for(lambda: w.in_flight() == 0 and not AgentRun.objects.exclude(
        status=RunStatus.SUCCEEDED).exists())  # fmt: skip


@pytest.mark.parametrize("worker", [{"listen": False, "concurrency": 1}], indirect=True)
def test_without_the_listener_every_last_step_tries_to_claim(worker: Worker) -> None:
    # With no notifications to hear of new runs, the hint never says "nothing waits": the one
    # slot's last step sends the claim every time.
    for i in range(3):
        run_unheard(worker, f"Run {i}.")
    assert noted(worker) == [(True, False)] * 3


@pytest.mark.parametrize("worker", [{"listen": False}], indirect=True)
def test_with_a_slot_idle_the_claimer_claims_instead(worker: Worker) -> None:
    # Runs may wait (no listener), but the other slot is idle: the last step sends no claim
    # and wakes the claimer, which takes any waiting runs for every idle slot in one batch.
    for i in range(3):
        run_unheard(worker, f"Run {i}.")
    assert noted(worker) == [(False, False)] * 3


@pytest.mark.parametrize("worker", [{"listen": False, "poll_interval": 600}], indirect=True)
def test_a_run_ending_with_a_slot_idle_wakes_the_claimer(
    worker: Worker, fake_api: FakeAnthropic
) -> None:
    # Run 0 is held at the model while run 1 is started, unheard (no listener, and the next
    # poll is ten minutes away). Run 0's end sends no claim (the other slot is idle) but wakes
    # the claimer, which takes run 1 at once.
    release = threading.Event()

    def hold_run_0(body: dict[str, Any]) -> None:
        if "Run 0." in json.dumps(body["messages"][0]):
            release.wait(60)

    fake_api.before_answer = hold_run_0
    first = durable_agents.start_run("tester", "Run 0.")
    worker._wake.set()
    wait_for(lambda: worker.in_flight() == 1)
    second = durable_agents.start_run("tester", "Run 1.")
    release.set()
    wait_for(
        lambda: (
            AgentRun.objects.filter(
                pk__in=[first.pk, second.pk], status=RunStatus.SUCCEEDED
            ).count()
            == 2
        ),
        timeout=20,
        what="run 1 claimed after run 0 ended",
    )
    assert noted(worker)[0] == (False, False)


def test_a_backlog_is_claimed_with_the_last_step(worker: Worker, fake_api: FakeAnthropic) -> None:
    # Three runs at once for two slots: the claimer's batch comes back full, so the first
    # slot to end its run takes the third run with its last step. "Run 1." is held at the
    # model until two runs have ended, so the last step of the third to end cannot overlap
    # the one whose claim found nothing (two last steps at once may both send the claim).
    two_ended = threading.Event()

    def hold_run_1(body: dict[str, Any]) -> None:
        if "Run 1." in json.dumps(body["messages"][0]):
            two_ended.wait(60)

    fake_api.before_answer = hold_run_1
    with transaction.atomic():
        runs = [durable_agents.start_run("tester", f"Run {i}.") for i in range(3)]
    wait_for(lambda: len(noted(worker)) == 2)
    two_ended.set()
    wait_for(
        lambda: (
            AgentRun.objects.filter(pk__in=[r.pk for r in runs], status=RunStatus.SUCCEEDED).count()
            == 3
        )
    )
    wait_for(lambda: worker.in_flight() == 0)
    # The first to end took the third run; the third's claim found nothing; the held run's
    # last step, after that, sends none.
    assert noted(worker) == [(True, True), (True, False), (False, False)]
