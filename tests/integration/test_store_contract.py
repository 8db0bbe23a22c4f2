"""The contract every store keeps, run against ``InMemoryStore`` and the real store of the
test database (``PostgresStore`` on PostgreSQL, ``PortableStore`` on SQLite): the fence, the
seq order, the effect ledger, claims and leases, the heartbeat's answer."""

from __future__ import annotations

import dataclasses
import datetime
import json
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from django.db import connection
from django.db.models.functions import Now

from durable_agents.models import AgentRun, RunStatus, StepKind, ToolEffect
from durable_agents.store import (
    Claim,
    InMemoryStore,
    LeaseLoss,
    PortableStore,
    PostgresStore,
    Store,
    store_for,
)
from durable_agents.store.memory import ManualClock


@dataclasses.dataclass
class Env:
    store: Store
    run: Callable[[Any], AgentRun]
    expire: Callable[[Any], None]

    def start(self, task: str = "t") -> Any:
        run = AgentRun(id=uuid.uuid4(), agent="contract", prompt_version="v1", model="m", task=task)
        return self.store.create_run(run, json.dumps(task)).pk

    def claim(self, run_id: Any, owner: str = "w1") -> Claim:
        claim = self.store.claim_run(run_id, owner, 30)
        assert claim is not None
        return claim

    def seqs(self, run_id: Any) -> list[int]:
        return [row[0] for row in self.store.load_log_rows(run_id)]


def memory_env() -> Env:
    store = InMemoryStore(now=ManualClock())

    def expire(run_id: Any) -> None:
        store.runs[run_id].lease_until = store.now() - datetime.timedelta(seconds=1)

    return Env(store, store.run, expire)


def database_env() -> Env:
    store = store_for(connection)
    expected = PostgresStore if connection.vendor == "postgresql" else PortableStore
    assert type(store) is expected

    def expire(run_id: Any) -> None:
        AgentRun.objects.filter(pk=run_id).update(lease_until=Now() - datetime.timedelta(seconds=1))

    return Env(store, lambda run_id: AgentRun.objects.get(pk=run_id), expire)


@pytest.fixture(
    params=[
        pytest.param("memory", id="memory"),
        pytest.param("database", id="database", marks=pytest.mark.django_db(transaction=True)),
    ]
)
def env(request: pytest.FixtureRequest) -> Env:
    return memory_env() if request.param == "memory" else database_env()


def effect(run_id: Any, key: str, result: str) -> ToolEffect:
    return ToolEffect(key=key, run_id=run_id, seq=1, call_index=0, tool="t", result=result)


def test_the_fence_refuses_a_stale_attempt(env: Env) -> None:
    run_id = env.start()
    stale = env.claim(run_id)
    env.expire(run_id)
    fresh = env.claim(run_id, "w1")  # the same worker name, a new attempt
    assert fresh.attempt == stale.attempt + 1
    assert not env.store.append_step(stale, 1, StepKind.MODEL_TURN, "{}")
    assert not env.store.renew_lease(stale)
    assert not env.store.finish_run(stale, RunStatus.SUCCEEDED, result="stolen")
    assert not env.store.release_lease(stale)
    assert env.store.append_step(fresh, 1, StepKind.MODEL_TURN, "{}")
    run = env.run(run_id)
    assert (run.status, run.last_seq, run.lease_owner) == (RunStatus.RUNNING, 1, "w1")


def test_a_seq_gap_or_repeat_is_refused(env: Env) -> None:
    run_id = env.start()
    claim = env.claim(run_id)
    assert not env.store.append_step(claim, 2, StepKind.MODEL_TURN, "{}")  # gap
    assert env.store.append_step(claim, 1, StepKind.MODEL_TURN, "{}")
    assert not env.store.append_step(claim, 1, StepKind.MODEL_TURN, "{}")  # again
    assert env.store.append_step(claim, 2, StepKind.TOOL_RESULT, "[]", tokens=7)
    assert env.seqs(run_id) == [0, 1, 2]
    run = env.run(run_id)
    assert (run.last_seq, run.stalled_claims, run.tokens_used) == (2, 0, 7)


def test_effects_are_recorded_even_when_the_fence_fails(env: Env) -> None:
    run_id = env.start()
    stale = env.claim(run_id)
    assert env.store.append_step(stale, 1, StepKind.MODEL_TURN, "{}")
    env.expire(run_id)
    fresh = env.claim(run_id, "w2")
    first = effect(run_id, "k1", "the call happened")
    assert not env.store.append_step(stale, 2, StepKind.TOOL_RESULT, "[]", effects=[first])
    assert env.store.recorded_effects(run_id, 1)["k1"].result == "the call happened"
    # A second recording of the key changes nothing (ON CONFLICT DO NOTHING).
    again = effect(run_id, "k1", "a second run of the call")
    assert env.store.append_step(fresh, 2, StepKind.TOOL_RESULT, "[]", effects=[again])
    env.store.record_effect(again)
    assert env.store.recorded_effects(run_id, 1)["k1"].result == "the call happened"
    assert env.seqs(run_id) == [0, 1, 2]


def test_a_claim_skips_a_live_lease_and_takes_the_oldest_first(env: Env) -> None:
    first, second = env.start("a"), env.start("b")
    [one] = env.store.claim_runs("w1", 30)
    [two] = env.store.claim_runs("w2", 30, limit=5)
    assert (one.run_id, two.run_id) == (first, second)
    assert env.store.claim_runs("w3", 30) == []
    assert env.store.claim_run(first, "w3", 30) is None
    run = env.run(first)
    assert (run.status, run.lease_owner, run.attempt, run.stalled_claims) == (
        RunStatus.RUNNING,
        "w1",
        1,
        1,
    )


def test_an_expired_lease_makes_the_run_claimable(env: Env) -> None:
    run_id = env.start()
    env.claim(run_id)
    assert env.store.claim_runs("w2", 30) == []
    env.expire(run_id)
    [again] = env.store.claim_runs("w2", 30)
    assert (again.run_id, again.owner, again.attempt) == (run_id, "w2", 2)
    assert env.run(run_id).stalled_claims == 2  # no step in between: a stalled claim


def test_the_heartbeat_names_cancelled_and_lost_runs(env: Env) -> None:
    ids = [env.start(f"t{i}") for i in range(4)]
    claims = env.store.claim_runs("w1", 30, limit=4)
    assert [c.run_id for c in claims] == ids
    cancelled, lost, finished, held = claims
    assert env.store.cancel_run(cancelled.run_id)
    env.expire(lost.run_id)
    env.claim(lost.run_id, "w2")
    assert env.store.finish_run(finished, RunStatus.SUCCEEDED, result="done")  # its own slot
    answer = env.store.renew_leases("w1", claims, 60)
    assert answer == {cancelled.run_id: LeaseLoss.CANCELLED, lost.run_id: LeaseLoss.LOST}
    assert env.store.renew_leases("w1", [], 60) == {}
    assert env.run(held.run_id).lease_owner == "w1"
    assert env.store.append_step(held, 1, StepKind.MODEL_TURN, "{}")


def test_the_last_step_ends_the_run(env: Env) -> None:
    run_id = env.start()
    claim = env.claim(run_id)
    assert env.store.append_step(
        claim, 1, StepKind.MODEL_TURN, "{}", finish=(RunStatus.SUCCEEDED, "done")
    )
    run = env.run(run_id)
    assert (run.status, run.result, run.lease_owner, run.lease_until) == (
        RunStatus.SUCCEEDED,
        "done",
        None,
        None,
    )
    assert run.finished_at is not None
    assert not env.store.append_step(claim, 2, StepKind.TOOL_RESULT, "[]")
    assert not env.store.cancel_run(run_id)
