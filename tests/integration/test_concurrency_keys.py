"""The contract of concurrency keys, kept by every store (``InMemoryStore`` and the store of the
test database, as in test_store_contract.py): at most a key's limit of runs with one key run
at once, the setting over the agent's limit, a pause at 0, a lease that runs out frees its
slot, children have their parent's key, and claims go fairly across keys within a priority."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from django.test import override_settings

from durable_agents.models import AgentRun, RunStatus, StepKind, WaitKind
from durable_agents.store import NextClaim, StepWrite
from durable_agents.store.base import WaitSpec
from tests.integration.test_store_contract import Env, env

__all__ = ["env"]  # the fixture, shared with the store contract


def start(
    env: Env, key: str | None, limit: int | None = None, task: str = "t", priority: int = 0
) -> Any:
    run = AgentRun(id=uuid.uuid4(), agent="contract", prompt_version="v1", model="m", task=task)
    run.concurrency_key, run.concurrency_limit, run.priority = key, limit, priority
    return env.store.create_run(run, json.dumps(task)).pk


def claimed(env: Env, owner: str = "w", limit: int = 1) -> list[Any]:
    return [claim.run_id for claim in env.store.claim_runs(owner, 30, limit)]


def running(env: Env, run_ids: list[Any]) -> int:
    return sum(env.run(run_id).status == RunStatus.RUNNING for run_id in run_ids)


def test_a_key_at_its_limit_is_skipped_for_other_keys_and_runs_without_one(env: Env) -> None:
    a = [start(env, "tenant:a", limit=2) for _ in range(4)]
    free = start(env, None)
    b = start(env, "tenant:b", limit=2)
    taken = claimed(env, limit=10)
    assert sorted(map(str, taken)) == sorted(map(str, [a[0], a[1], free, b]))  # a[2:] wait
    assert env.store.claim_runs("w2", 30, 10) == []
    assert running(env, a) == 2


def test_a_slot_frees_when_a_run_ends_parks_or_is_handed_back(env: Env) -> None:
    runs = [start(env, "k", limit=1) for _ in range(4)]
    [first] = env.store.claim_runs("w", 30, 5)
    assert env.store.claim_runs("w", 30, 5) == []
    assert env.store.finish_run(first, RunStatus.SUCCEEDED, result="done")
    [second] = env.store.claim_runs("w", 30, 5)
    assert second.run_id == runs[1]
    parked, _ = env.store.park_on_wait(second, WaitSpec(WaitKind.EVENT, key="w1", event="e"))
    assert parked.value == "parked"
    [third] = env.store.claim_runs("w", 30, 5)
    assert third.run_id == runs[2]
    assert env.store.release_lease(third)
    [again] = env.store.claim_runs("w", 30, 5)
    assert again.run_id == runs[2]  # handed back: pending again, and first in its turn
    assert env.store.cancel_run(again.run_id)
    assert [c.run_id for c in env.store.claim_runs("w", 30, 5)] == [runs[3]]


def test_a_lease_that_runs_out_frees_its_slot(env: Env) -> None:
    """A worker killed mid-run: its run stops holding the slot when its lease runs out, and
    the run itself is claimable again."""
    dead, waiting = start(env, "k", limit=1), start(env, "k", limit=1)
    [held] = env.store.claim_runs("w-killed", 30)
    assert held.run_id == dead
    assert env.store.claim_runs("w", 30) == []
    env.expire(dead)
    [taken] = env.store.claim_runs("w", 30)
    assert taken.run_id == dead  # its turn came first; the slot is its own again
    env.expire(dead)
    env.store.finish_run(taken, RunStatus.SUCCEEDED)  # the fence: attempt 2 still holds it
    assert claimed(env) == [waiting]


def test_the_setting_overrides_the_agents_limit_and_zero_holds_the_key(env: Env) -> None:
    runs = [start(env, "tenant:x", limit=1) for _ in range(3)]
    with override_settings(DURABLE_AGENTS={"CONCURRENCY_LIMITS": {"tenant:x": 3}}):
        assert claimed(env, limit=5) == runs
    paused = start(env, "tenant:p", limit=5)
    unlimited = start(env, "tenant:u")  # neither a setting nor an agent limit: no limit
    with override_settings(DURABLE_AGENTS={"CONCURRENCY_LIMITS": {"tenant:p": 0}}):
        assert claimed(env, limit=5) == [unlimited]
        assert env.store.claim_run(paused, "w", 30) is None
    assert claimed(env, limit=5) == [paused]


def test_claim_run_keeps_the_limit_too(env: Env) -> None:
    first, second = start(env, "k", limit=1), start(env, "k", limit=1)
    assert env.store.claim_run(first, "w", 30) is not None
    assert env.store.claim_run(second, "w", 30) is None


def test_a_due_timer_waits_for_its_keys_slot(env: Env) -> None:
    timed, other = start(env, "k", limit=1), start(env, "k", limit=1)
    claim = env.claim(timed)
    env.store.park_on_wait(claim, WaitSpec(WaitKind.TIMER, key="t1", seconds=60))
    [holder] = env.store.claim_runs("w", 30)
    assert holder.run_id == other
    env.time_passes()
    assert env.store.renew_lease(holder)  # (the in-memory clock moved on the lease too)
    assert env.store.claim_runs("w", 30) == []  # due, but its key's slot is held
    env.store.finish_run(holder, RunStatus.SUCCEEDED)
    [woken] = env.store.claim_runs("w", 30)
    assert (woken.run_id, env.run(timed).woken_by) == (timed, {"timer": True})


@override_settings(DURABLE_AGENTS={"CONCURRENCY_LIMITS": {"tenant:a": 1}})
def test_a_child_has_its_parents_key(env: Env) -> None:
    parent = start(env, "tenant:a")
    claim = env.claim(parent)
    child, _ = env.spawn(parent, "c")
    assert env.run(child).concurrency_key == "tenant:a"
    assert claimed(env) == []  # the parent holds the key's one slot
    env.store.park_on_wait(claim, WaitSpec(WaitKind.RUNS, key="r", runs=(str(child),)))
    assert claimed(env) == [child]  # a waiting parent holds none


def test_finish_and_claim_hands_the_slot_to_the_keys_next_run(env: Env) -> None:
    first, second = start(env, "k", limit=1), start(env, "k", limit=1)
    claim = env.claim(first)
    given_back: list[bool] = []
    then = NextClaim("w", 30, take=lambda: True, give_back=lambda: given_back.append(True))
    step = StepWrite(1, StepKind.MODEL_TURN, "{}", finish=(RunStatus.SUCCEEDED, "ok"))
    assert env.store.append_step(claim, step, then_claim=then)
    if then.claim is None:  # PortableStore claims the next run by itself, not with the step
        assert given_back or env.store.claim_runs("w", 30)[0].run_id == second
    else:
        assert then.claim.run_id == second
    assert env.run(second).status == RunStatus.RUNNING


def test_within_a_priority_a_key_that_starts_later_is_not_held_back(env: Env) -> None:
    """Key A queues 30 runs, key B starts 3 a little later: B's runs are claimed among A's
    first, not after all of them; a more urgent run still goes first."""
    a = [start(env, "A", task=f"a{i}") for i in range(30)]
    b = [start(env, "B", task=f"b{i}") for i in range(3)]
    urgent = start(env, "A", priority=50)
    order = claimed(env, limit=40)
    assert order[0] == urgent
    positions = [order.index(run) for run in b]
    assert max(positions) < 8, positions
    assert [run for run in order if run in a] == a  # each key's own runs in their order


def test_runs_without_a_key_keep_their_order(env: Env) -> None:
    runs = [start(env, None, task=f"r{i}") for i in range(5)]
    assert claimed(env, limit=10) == runs


@pytest.mark.parametrize("limit", [1, 3])
def test_a_claim_of_several_never_takes_more_than_the_limit_of_one_key(
    env: Env, limit: int
) -> None:
    runs = [start(env, "k", limit=limit) for _ in range(6)]
    assert claimed(env, limit=10) == runs[:limit]
    assert claimed(env, limit=10) == []
