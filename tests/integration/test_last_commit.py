"""A run's last commit on PostgreSQL: one round trip that sends the run's lock and then the
step, which ends the run only while no message waits in its inbox (``append_last_step``).

The race it closes: a message queued while the last commit waits for the run's row lock.
An UPDATE that waits for a row lock checks its WHERE again on the new row, but a subquery in
it keeps the snapshot taken before the wait: without the lock sent first, the step's guard
would not see the message and the run would end without answering it."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from django.db import connection, transaction

from durable_agents import start_run
from durable_agents.models import AgentRun, RunStatus, StepKind
from durable_agents.store import StepWrite, current
from tests.conftest import backend_waits_on_lock, run_worker, steps_refused, wait_for
from tests.fakeserver import FakeAnthropic

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("unpooled"),
]


def reload(run: AgentRun) -> AgentRun:
    return AgentRun.objects.get(pk=run.pk)


def in_thread(body: Any, into: dict[str, Any]) -> threading.Thread:
    """``body()`` on a thread of its own (its own connection); its return or exception."""

    def run() -> None:
        try:
            into["returned"] = body()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            into["raised"] = exc
        finally:
            connection.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_message_queued_while_the_last_commit_waits_for_the_lock_keeps_the_run_going() -> None:
    store = current()
    run = start_run("tester", "hello")
    claim = store.claim_run(run.pk, "w1", 30)
    assert claim is not None
    queued, commit_it = threading.Event(), threading.Event()

    def queue_and_hold() -> None:
        # queue_message's own transaction, held open: the run's row stays locked.
        with transaction.atomic():
            store.queue_message(run.pk, "one more thing", None)
            queued.set()
            assert commit_it.wait(30)

    sender: dict[str, Any] = {}
    sending = in_thread(queue_and_hold, sender)
    assert queued.wait(30)
    last = StepWrite(1, StepKind.MODEL_TURN, "{}", finish=(RunStatus.SUCCEEDED, "done"))
    finisher: dict[str, Any] = {}
    finishing = in_thread(lambda: store.append_last_step(claim, last), finisher)
    # The last commit waits for the run's row (its lock, sent first, in the same round trip).
    wait_for(lambda: backend_waits_on_lock("agent_run"), what="the last commit to wait")
    commit_it.set()
    sending.join(30)
    finishing.join(30)
    assert sender == {"returned": None}
    assert finisher == {"returned": None}  # a message waits: nothing was appended
    run = reload(run)
    assert (run.status, run.last_seq) == (RunStatus.RUNNING, 0)
    assert [m.text for m in store.waiting_messages(run.pk)] == ["one more thing"]
    # Once the message is folded, the same claim can end the run.
    waiting = store.waiting_messages(run.pk)
    fold = StepWrite(1, StepKind.MESSAGE, '[{"type":"text","text":"one more thing"}]')
    assert store.fold_messages(claim, fold, [m.pk for m in waiting])
    assert store.append_last_step(claim, StepWrite(2, **_final())) is True
    assert reload(run).status == RunStatus.SUCCEEDED


def _final() -> dict[str, Any]:
    return {"kind": StepKind.MODEL_TURN, "payload": "{}", "finish": (RunStatus.SUCCEEDED, "ok")}


def test_a_stale_claims_last_step_is_refused_and_no_message_is_invented() -> None:
    store = current()
    run = start_run("tester", "hello")
    stale = store.claim_run(run.pk, "w1", 30)
    assert stale is not None
    AgentRun.objects.filter(pk=run.pk).update(lease_until=None)  # taken over below
    AgentRun.objects.filter(pk=run.pk).update(status=RunStatus.PENDING)
    fresh = store.claim_run(run.pk, "w2", 30)
    assert fresh is not None
    assert store.append_last_step(stale, StepWrite(1, **_final())) is False
    assert store.append_last_step(fresh, StepWrite(1, **_final())) is True
    assert reload(run).status == RunStatus.SUCCEEDED


def test_a_last_turn_the_database_refuses_ends_the_run_and_is_still_counted(
    fake_api: FakeAnthropic,
) -> None:
    with steps_refused("model_turn"):
        run = start_run("tester", "hello")
        run_worker(max_runs=1)
    run = reload(run)
    assert run.status == RunStatus.DEAD
    assert run.error.startswith("step 1 (model_turn) could not be stored: value out of range")
    assert len(fake_api.requests) == 1
    # The refused turn was paid for: its tokens count on the run all the same.
    assert run.tokens_used > 0


def test_without_a_pipeline_the_last_commit_takes_the_portable_way(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """psycopg over a libpq older than 14 sends no pipeline: the lock, the probe and the step
    go out one by one in a transaction, with the same outcomes."""
    import psycopg

    from durable_agents.store import postgres_steps

    monkeypatch.setattr(psycopg.Pipeline, "is_supported", classmethod(lambda cls: False))
    postgres_steps.pipelines.cache_clear()
    sent: list[bool] = []
    monkeypatch.setattr(postgres_steps, "locked_first", lambda run_id: sent.append(True))
    try:
        store = current()
        run = start_run("tester", "hello")
        claim = store.claim_run(run.pk, "w1", 30)
        assert claim is not None
        store.queue_message(run.pk, "wait for me", None)
        assert store.append_last_step(claim, StepWrite(1, **_final())) is None
        waiting = store.waiting_messages(run.pk)
        fold = StepWrite(1, StepKind.MESSAGE, '[{"type":"text","text":"wait for me"}]')
        assert store.fold_messages(claim, fold, [m.pk for m in waiting])
        assert store.append_last_step(claim, StepWrite(2, **_final())) is True
        assert reload(run).status == RunStatus.SUCCEEDED
        assert sent == []
    finally:
        postgres_steps.pipelines.cache_clear()
