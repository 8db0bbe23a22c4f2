"""``InMemoryStore`` on its own: the clock, copies, parking, decisions and the operations a
person or the housekeeping performs. No database (the contract it shares with the database
stores is tests/integration/test_store_contract.py)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from django.contrib.auth import get_user_model

from durable_agents.models import AgentRun, IntentStatus, RunStatus, ToolEffect, ToolIntent
from durable_agents.store import Claim, InMemoryStore, Parked
from durable_agents.store.base import StepWrite
from durable_agents.store.memory import ManualClock
from tests.unit.conftest import claimed, start


def intent_for(run_id: Any, key: str = "k1") -> ToolIntent:
    return ToolIntent(run_id=run_id, seq=1, call_index=0, tool="launch", input={}, key=key)  # type: ignore[misc]  # a JSONTextField takes any JSON value; the stubs say str


def test_the_unit_tests_cannot_reach_the_database() -> None:
    with pytest.raises(RuntimeError, match="Database access not allowed"):
        AgentRun.objects.count()


def test_callers_get_copies(store: InMemoryStore) -> None:
    run_id = start(store)
    claim = claimed(store, run_id)
    claim.run.status = RunStatus.SUCCEEDED
    assert store.current_status(run_id) == RunStatus.RUNNING
    assert claim.task_payload == '"t"'  # as a PostgreSQL claim brings it


def test_leases_expire_by_the_stores_clock(store: InMemoryStore, clock: ManualClock) -> None:
    run_id = start(store)
    claimed(store, run_id)
    clock.advance(29)
    assert store.claim_runs("w2", 30) == []
    clock.advance(2)
    [again] = store.claim_runs("w2", 30)
    assert (again.run_id, again.attempt, again.run.stalled_claims) == (run_id, 2, 2)


def test_a_release_can_hold_the_run_and_take_back_its_count(
    store: InMemoryStore, clock: ManualClock
) -> None:
    run_id = start(store)
    claim = claimed(store, run_id)
    assert store.release_lease(claim, error="later", count_claim=False, hold_seconds=10)
    run = store.run(run_id)
    assert (run.status, run.stalled_claims, run.error) == (RunStatus.PENDING, 0, "later")
    assert store.claim_runs("w2", 30) == []
    clock.advance(11)
    assert [c.run_id for c in store.claim_runs("w2", 30)] == [run_id]


def test_parking_writes_the_intent_only_when_the_fence_holds(store: InMemoryStore) -> None:
    run_id = start(store)
    claim = claimed(store, run_id)
    stale = Claim(claim.run, "w1", claim.attempt + 1, 30)
    assert store.park_on_intent(stale, intent_for(run_id), new=True) is Parked.FENCE_FAILED
    assert store.intents_of(run_id) == []
    intent = intent_for(run_id)
    assert store.park_on_intent(claim, intent, new=True) is Parked.PARKED
    assert intent.pk is not None
    assert store.run(run_id).status == RunStatus.WAITING


def test_a_decision_before_the_park_means_the_run_goes_on(store: InMemoryStore) -> None:
    run_id = start(store)
    first = claimed(store, run_id)
    intent = intent_for(run_id)
    store.park_on_intent(first, intent, new=True)
    person = get_user_model()(username="ada")
    store.decide_intent(intent.pk, person, IntentStatus.PENDING, IntentStatus.APPROVED, "")
    second = claimed(store, run_id)
    assert store.park_on_intent(second, intent) is Parked.DECIDED
    assert store.run(run_id).status == RunStatus.RUNNING
    store.reload_intent(intent)
    assert intent.status == IntentStatus.APPROVED
    assert intent.decided_by is person


def test_a_crashed_call_is_parked_as_unknown_and_resolved(store: InMemoryStore) -> None:
    run_id = start(store)
    claim = claimed(store, run_id)
    intent = intent_for(run_id)
    store.park_on_intent(claim, intent, new=True)
    person = get_user_model()(username="ada")
    store.decide_intent(intent.pk, person, IntentStatus.PENDING, IntentStatus.APPROVED, "")
    claim = claimed(store, run_id)
    assert store.start_intent_execution(claim, intent)
    assert not store.start_intent_execution(claim, intent)  # executing already
    # The worker died; the next one finds the intent executing.
    store.release_lease(claim)
    claim = claimed(store, run_id)
    store.reload_intent(intent)
    assert store.park_on_intent(claim, intent, unknown_because="it died") is Parked.PARKED
    assert store.intents_of(run_id)[0].status == IntentStatus.UNKNOWN
    assert (intent.status, intent.reason) == (IntentStatus.UNKNOWN, "it died")
    assert (store.intents_of(run_id)[0].reason, store.run(run_id).error) == ("it died", "it died")
    resolved = store.resolve_intent(intent.pk, person, outcome=("it happened", False), reason="")
    assert resolved.status == IntentStatus.DONE
    assert store.recorded_effects(run_id, 1)["k1"].result == "it happened"
    assert store.run(run_id).status == RunStatus.PENDING


def test_a_late_completion_settles_the_intent_and_wakes_the_run(store: InMemoryStore) -> None:
    run_id = start(store)
    claim = claimed(store, run_id)
    intent = intent_for(run_id)
    store.park_on_intent(claim, intent, new=True)
    store.intents[intent.pk].status = IntentStatus.UNKNOWN
    effect = ToolEffect(key="k1", run_id=run_id, seq=1, call_index=0, tool="launch", result="ok")
    store.complete_intent(intent, effect)
    assert intent.status == IntentStatus.DONE
    assert store.run(run_id).status == RunStatus.PENDING


def test_dead_letter_leaves_held_runs_to_their_worker(
    store: InMemoryStore, clock: ManualClock
) -> None:
    held, free = start(store), start(store)
    claimed(store, held)
    assert not store.dead_letter(held, "retired")
    assert store.dead_letter(free, "retired")
    clock.advance(31)
    assert store.dead_letter(held, "retired")
    run = store.run(held)
    assert (run.status, run.error, run.lease_owner) == (RunStatus.DEAD, "retired", None)
    assert store.requeue_run(held)
    run = store.run(held)
    assert (run.status, run.stalled_claims, run.finished_at) == (RunStatus.PENDING, 0, None)


def test_a_finished_run_cannot_be_cancelled(store: InMemoryStore) -> None:
    run_id = start(store)
    claim = claimed(store, run_id)
    assert store.finish_run(claim, RunStatus.SUCCEEDED, result="done")
    assert not store.cancel_run(run_id)
    assert store.current_status(run_id) == RunStatus.SUCCEEDED


def test_a_fork_reads_the_stretches_it_shares(store: InMemoryStore) -> None:
    from durable_agents.store.base import ForkWrite

    parent = start(store, task="the task")
    claim = claimed(store, parent)
    for seq in (1, 2, 3):
        assert store.append_step(claim, StepWrite(seq, "model_turn", f'{{"n": {seq}}}'))
    fork = AgentRun(
        id=uuid.uuid4(), agent="a", prompt_version="v1", model="m", task="t", last_seq=2
    )
    effect = ToolEffect(key="fk", run_id=fork.pk, seq=2, call_index=0, tool="x", result="r")
    store.create_fork(fork, ForkWrite([(parent, 0, 2)], (2, "tool_result", "[]"), [effect]))
    rows = store.load_log_rows(fork.pk)
    assert [(seq, payload) for seq, _, payload, _, _ in rows] == [
        (0, '"the task"'),
        (1, '{"n": 1}'),
        (2, "[]"),
    ]
    assert [s[0] for s in store.load_steps(fork.pk, after_seq=0)] == [1, 2]
    assert set(store.recorded_effects(fork.pk, 2)) == {"fk"}
    assert [s.seq for s in store.steps_of(parent)] == [0, 1, 2, 3]  # untouched


def test_firing_schedules_needs_a_database_store() -> None:
    """The memory store keeps no schedules: it is no ``ScheduleStore``, and the firer's
    ``schedule_store`` says so rather than failing in the middle of a firing."""
    from durable_agents.store import PortableStore, PostgresStore, ScheduleStore, schedule_store

    with pytest.raises(TypeError, match="firing schedules needs a database store"):
        schedule_store(InMemoryStore())
    assert isinstance(PortableStore(), ScheduleStore)
    assert isinstance(PostgresStore(), ScheduleStore)
