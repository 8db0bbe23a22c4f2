"""The contract every store keeps, run against ``InMemoryStore`` and the real store of the
test database (``PostgresStore`` on PostgreSQL, ``PortableStore`` on SQLite): the fence, the
seq order, the effect ledger, claims and leases, the heartbeat's answer."""

from __future__ import annotations

import dataclasses
import datetime
import json
import uuid
from collections.abc import Callable, Iterator
from decimal import Decimal
from typing import Any

import pytest
from django.db import connection
from django.db.models.functions import Now
from django.test.utils import CaptureQueriesContext

from durable_agents.declare.agents import Agent, registry
from durable_agents.exceptions import RunBusy, RunFinished, RunNotFound
from durable_agents.flow.pricing import Usage, add_cost
from durable_agents.models import (
    AgentRun,
    AgentUsageDay,
    QuestionStatus,
    RunStatus,
    StepKind,
    ToolEffect,
    WaitKind,
)
from durable_agents.store import (
    Claim,
    InMemoryStore,
    LeaseLoss,
    PortableStore,
    PostgresStore,
    StepWrite,
    Store,
    postgres_steps,
    store_for,
)
from durable_agents.store.base import ForkWrite, Parked, WaitRefused, WaitSpec
from durable_agents.store.memory import ManualClock
from durable_agents.store.postgres_cursor import positional
from durable_agents.store.transitions import made_transition


@dataclasses.dataclass
class Env:
    store: Store
    run: Callable[[Any], AgentRun]
    expire: Callable[[Any], None]
    # Time passes: every waiting run's timer or timeout is due.
    time_passes: Callable[[], None]

    def start(self, task: str = "t", priority: int = 0) -> Any:
        run = AgentRun(id=uuid.uuid4(), agent="contract", prompt_version="v1", model="m", task=task)
        run.priority = priority
        return self.store.create_run(run, json.dumps(task)).pk

    def start_keyed(self, key: str, task: str = "t", agent: str = "contract") -> Any:
        run = AgentRun(
            id=uuid.uuid4(), agent=agent, prompt_version="v1", model="m", task=task, start_key=key
        )
        return self.store.create_run(run, json.dumps(task)).pk

    def task_steps(self, run_id: Any) -> list[str]:
        """The payloads of the run's task steps (one, however often it was started)."""
        return [row[2] for row in self.store.load_log_rows(run_id) if row[1] == StepKind.TASK]

    def spawn(self, parent: Any, key: str, limit: int = 10) -> tuple[Any, bool]:
        child = AgentRun(
            id=uuid.uuid4(), agent="contract", prompt_version="v1", model="m", task=key
        )
        child.parent_id, child.spawn_key, child.depth = parent, key, 1
        run, created = self.store.spawn_run(child, json.dumps(key), limit)
        return run.pk, created

    def claim(self, run_id: Any, owner: str = "w1") -> Claim:
        claim = self.store.claim_run(run_id, owner, 30)
        assert claim is not None
        return claim

    def seqs(self, run_id: Any) -> list[int]:
        return [row[0] for row in self.store.load_log_rows(run_id)]

    def usage(self) -> dict[tuple[str, str], tuple[Any, ...]]:
        """The rollup summed over days and shards: (agent, model) -> (turns, input, output,
        cache reads, cache writes, cost)."""
        rows = (
            list(self.store.usage_days.values())
            if isinstance(self.store, InMemoryStore)
            else list(AgentUsageDay.objects.all())
        )
        found: dict[tuple[str, str], tuple[Any, ...]] = {}
        for row in rows:
            turns, read, out, cached, written, cost = found.get((row.agent, row.model), (0,) * 6)
            found[(row.agent, row.model)] = (
                turns + row.turns,
                read + row.input_tokens,
                out + row.output_tokens,
                cached + row.cache_read_tokens,
                written + row.cache_write_tokens,
                add_cost(cost or None, row.cost_usd),
            )
        return found


def memory_env() -> Env:
    store = InMemoryStore(now=ManualClock())

    def expire(run_id: Any) -> None:
        store.runs[run_id].lease_until = store.now() - datetime.timedelta(seconds=1)

    def time_passes() -> None:
        assert isinstance(store.now, ManualClock)
        store.now.advance(10_000)

    return Env(store, store.run, expire, time_passes)


def database_env() -> Env:
    store = store_for(connection)
    expected = PostgresStore if connection.vendor == "postgresql" else PortableStore
    assert type(store) is expected

    def expire(run_id: Any) -> None:
        AgentRun.objects.filter(pk=run_id).update(lease_until=Now() - datetime.timedelta(seconds=1))

    def time_passes() -> None:
        AgentRun.objects.filter(wake_at__isnull=False).update(
            wake_at=Now() - datetime.timedelta(seconds=1)
        )

    return Env(store, lambda run_id: AgentRun.objects.get(pk=run_id), expire, time_passes)


@pytest.fixture(
    params=[
        pytest.param("memory", id="memory"),
        pytest.param("database", id="database", marks=pytest.mark.django_db(transaction=True)),
    ]
)
def env(request: pytest.FixtureRequest) -> Iterator[Env]:
    # Claims take only runs of the agent versions this process defines: the contract's runs'.
    defined = [Agent(name=name, version="v1", model="m", register=False) for name in AGENTS]
    for agent in defined:
        registry.register(agent)
    yield memory_env() if request.param == "memory" else database_env()
    for agent in defined:
        registry.unregister(agent.name, agent.version)


# The agents of the contract's runs.
AGENTS = ("contract", "other")


def effect(run_id: Any, key: str, result: str) -> ToolEffect:
    return ToolEffect(key=key, run_id=run_id, seq=1, call_index=0, tool="t", result=result)


def test_the_fence_refuses_a_stale_attempt(env: Env) -> None:
    run_id = env.start()
    stale = env.claim(run_id)
    env.expire(run_id)
    fresh = env.claim(run_id, "w1")  # the same worker name, a new attempt
    assert fresh.attempt == stale.attempt + 1
    assert not env.store.append_step(stale, StepWrite(1, StepKind.MODEL_TURN, "{}"))
    assert not env.store.renew_lease(stale)
    assert not env.store.finish_run(stale, RunStatus.SUCCEEDED, result="stolen")
    assert not env.store.release_lease(stale)
    assert env.store.append_step(fresh, StepWrite(1, StepKind.MODEL_TURN, "{}"))
    run = env.run(run_id)
    assert (run.status, run.last_seq, run.lease_owner) == (RunStatus.RUNNING, 1, "w1")


def test_a_seq_gap_or_repeat_is_refused(env: Env) -> None:
    run_id = env.start()
    claim = env.claim(run_id)
    assert not env.store.append_step(claim, StepWrite(2, StepKind.MODEL_TURN, "{}"))  # gap
    assert env.store.append_step(claim, StepWrite(1, StepKind.MODEL_TURN, "{}"))
    env.expire(run_id)
    other = env.claim(run_id, "w2")
    assert not env.store.append_step(other, StepWrite(1, StepKind.MODEL_TURN, "{}"))  # again
    assert env.store.append_step(other, StepWrite(2, StepKind.TOOL_RESULT, "[]", tokens=7))
    assert env.seqs(run_id) == [0, 1, 2]
    run = env.run(run_id)
    assert (run.last_seq, run.stalled_claims, run.tokens_used) == (2, 0, 7)


def test_a_commit_tried_again_after_its_first_try_landed_is_its_own_step(env: Env) -> None:
    """A commit whose answer was lost with the connection is sent again: the store finds the
    step in the log as this claim's (its attempt, its worker) and says it is committed,
    without writing or counting it twice. The same step by another claim is refused."""
    run_id = env.start()
    claim = env.claim(run_id)
    turn = StepWrite(
        1, StepKind.MODEL_TURN, "{}", tokens=5, usage=Usage(input_tokens=5), cost=Decimal("0.5")
    )
    assert env.store.append_step(claim, turn)
    assert env.store.append_step(claim, turn)
    run = env.run(run_id)
    assert (run.last_seq, run.tokens_used, run.cost_usd) == (1, 5, Decimal("0.5"))
    assert env.usage()[("contract", "m")][0] == 1  # one turn in the rollup
    last = StepWrite(2, StepKind.TOOL_RESULT, "[]", finish=(RunStatus.SUCCEEDED, "done"))
    assert env.store.append_step(claim, last)
    assert env.store.append_step(claim, last)
    assert env.seqs(run_id) == [0, 1, 2]
    assert env.run(run_id).status == RunStatus.SUCCEEDED
    stranger = dataclasses.replace(claim, owner="w2")
    assert not env.store.append_step(stranger, last)


def test_effects_are_recorded_even_when_the_fence_fails(env: Env) -> None:
    run_id = env.start()
    stale = env.claim(run_id)
    assert env.store.append_step(stale, StepWrite(1, StepKind.MODEL_TURN, "{}"))
    env.expire(run_id)
    fresh = env.claim(run_id, "w2")
    first = effect(run_id, "k1", "the call happened")
    assert not env.store.append_step(
        stale, StepWrite(2, StepKind.TOOL_RESULT, "[]", effects=[first])
    )
    assert env.store.recorded_effects(run_id, 1)["k1"].result == "the call happened"
    # A second recording of the key changes nothing (ON CONFLICT DO NOTHING).
    again = effect(run_id, "k1", "a second run of the call")
    assert env.store.append_step(fresh, StepWrite(2, StepKind.TOOL_RESULT, "[]", effects=[again]))
    env.store.record_effect(again)
    assert env.store.recorded_effects(run_id, 1)["k1"].result == "the call happened"
    assert env.seqs(run_id) == [0, 1, 2]


def test_recorded_effects_read_back_every_field_as_the_orm_loads_it(env: Env) -> None:
    """The store reads the ledger with its own statement, not the ORM: every field comes back
    as the ORM would load it (the result decrypted, the flag a bool, the time aware)."""
    run_id = env.start()
    claim = env.claim(run_id)
    assert env.store.append_step(claim, StepWrite(1, StepKind.MODEL_TURN, "{}"))
    calls = [
        ToolEffect(key="k0", run_id=run_id, seq=1, call_index=0, tool="t", result="ok \u00e9"),
        ToolEffect(
            key="k1", run_id=run_id, seq=1, call_index=1, tool="u", result="", is_error=True
        ),
    ]
    assert env.store.append_step(claim, StepWrite(2, StepKind.TOOL_RESULT, "[]", effects=calls))
    read = env.store.recorded_effects(run_id, 1)
    assert sorted(read) == ["k0", "k1"]
    assert env.store.recorded_effects(run_id, 2) == {}
    if isinstance(env.store, InMemoryStore):
        return
    fields = ToolEffect._meta.concrete_fields
    for key, got in read.items():
        loaded = ToolEffect.objects.get(pk=key)
        assert [getattr(got, f.attname) for f in fields] == [
            getattr(loaded, f.attname) for f in fields
        ]
        assert got._state.adding is False
    assert (read["k0"].result, read["k1"].is_error) == ("ok \u00e9", True)
    assert read["k0"].created_at.tzinfo is not None


def test_a_call_recorded_on_its_own_reads_back_and_is_recorded_once(env: Env) -> None:
    run_id = env.start()
    claim = env.claim(run_id)
    assert env.store.append_step(claim, StepWrite(1, StepKind.MODEL_TURN, "{}"))
    charged = ToolEffect(
        key="k-charge", run_id=run_id, seq=1, call_index=0, tool="charge", result="ch_1 \u00e9"
    )
    if isinstance(env.store, PostgresStore):
        # One statement of its own, sent as the step commits are (not the ORM's INSERT).
        with CaptureQueriesContext(connection) as sent:
            env.store.record_effect(charged)
        assert [q["sql"] for q in sent.captured_queries] == [
            positional(postgres_steps.RECORD_EFFECT_SQL)[0]
        ]
    else:
        env.store.record_effect(charged)
    again = ToolEffect(
        key="k-charge", run_id=run_id, seq=1, call_index=0, tool="charge", result="again"
    )
    env.store.record_effect(again)
    read = env.store.recorded_effects(run_id, 1)
    assert list(read) == ["k-charge"]
    got = read["k-charge"]
    assert (got.seq, got.call_index, got.tool, got.result, got.is_error) == (
        1,
        0,
        "charge",
        "ch_1 \u00e9",
        False,
    )


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


def test_a_claim_takes_the_highest_priority_first_then_the_oldest(env: Env) -> None:
    low = env.start("low", priority=10)
    high = env.start("high", priority=90)
    low_again = env.start("low again", priority=10)
    default = env.start("default")
    claimed = [env.store.claim_runs("w1", 30)[0].run_id for _ in range(4)]
    assert claimed == [high, low, low_again, default]


def test_a_claim_of_several_takes_the_most_urgent(env: Env) -> None:
    default = env.start("default")
    low = env.start("low", priority=1)
    high = env.start("high", priority=100)
    claims = env.store.claim_runs("w1", 30, limit=2)
    assert [claim.run_id for claim in claims] == [high, low]
    assert env.run(default).status == RunStatus.PENDING


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
    assert env.store.append_step(held, StepWrite(1, StepKind.MODEL_TURN, "{}"))


def test_the_last_step_ends_the_run(env: Env) -> None:
    run_id = env.start()
    claim = env.claim(run_id)
    assert env.store.append_step(
        claim, StepWrite(1, StepKind.MODEL_TURN, "{}", finish=(RunStatus.SUCCEEDED, "done"))
    )
    run = env.run(run_id)
    assert (run.status, run.result, run.lease_owner, run.lease_until) == (
        RunStatus.SUCCEEDED,
        "done",
        None,
        None,
    )
    assert run.finished_at is not None
    assert not env.store.append_step(claim, StepWrite(2, StepKind.TOOL_RESULT, "[]"))
    assert not env.store.cancel_run(run_id)


# --------------------------------------------------------------------------- waits


def park(env: Env, run_id: Any, spec: WaitSpec) -> tuple[Parked, Any]:
    return env.store.park_on_wait(env.claim(run_id), spec)


def test_a_start_key_starts_one_run_per_agent_and_the_first_task_wins(env: Env) -> None:
    first = env.start_keyed("ticket-1", task="first")
    again = env.start_keyed("ticket-1", task="second")
    assert again == first
    assert env.run(first).task == "first"
    assert env.task_steps(first) == [json.dumps("first")]
    assert env.run(first).start_key == "ticket-1"
    # The key is per agent; other keys and no key start runs of their own.
    other_agent = env.start_keyed("ticket-1", agent="other")
    other_key = env.start_keyed("ticket-2")
    assert len({first, other_agent, other_key}) == 3
    assert env.start("no key") != env.start("no key")


def _to_status(env: Env, run_id: Any, status: str) -> None:
    """Take a fresh run to ``status`` through the store's own transitions."""
    if status == RunStatus.CANCELLED:
        assert env.store.cancel_run(run_id)
    elif status == RunStatus.WAITING:
        assert park(env, run_id, WaitSpec(WaitKind.TIMER, "k", seconds=60))[0] == Parked.PARKED
    elif status != RunStatus.PENDING:
        claim = env.claim(run_id)
        if status != RunStatus.RUNNING:
            assert env.store.finish_run(claim, status)


@pytest.mark.parametrize("status", list(RunStatus))
def test_a_start_key_finds_its_run_whatever_its_status(env: Env, status: str) -> None:
    first = env.start_keyed("order-42", task="first")
    _to_status(env, first, status)
    assert env.run(first).status == status
    assert env.start_keyed("order-42", task="second") == first
    assert env.task_steps(first) == [json.dumps("first")]
    assert env.run(first).status == status  # found, not changed


def test_a_timer_parks_the_run_and_the_claim_takes_it_when_due_first(env: Env) -> None:
    pending = env.start("pending")
    timed = env.start("timed")
    assert park(env, timed, WaitSpec(WaitKind.TIMER, "k", seconds=60)) == (Parked.PARKED, None)
    run = env.run(timed)
    assert (run.status, run.waiting_for, run.wait_key) == (RunStatus.WAITING, "timer", "k")
    assert (run.lease_owner, run.lease_until, run.stalled_claims) == (None, None, 0)
    assert run.wake_at is not None
    env.store.release_lease(env.claim(pending))  # pending again, older than the timer's run
    assert env.store.claim_run(timed, "w2", 30) is None  # not due
    env.time_passes()
    [first] = env.store.claim_runs("w2", 30, limit=1)  # due waits first
    [second] = env.store.claim_runs("w2", 30, limit=5)
    assert (first.run_id, second.run_id) == (timed, pending)
    assert first.run.woken_by == {"timer": True}
    assert first.run.wake_at is None
    assert second.run.woken_by is None


def test_an_event_wakes_its_waiters_once(env: Env) -> None:
    waiting, other = env.start("a"), env.start("b")
    spec = WaitSpec(WaitKind.EVENT, "k", event="ev", seconds=60)
    assert park(env, waiting, spec)[0] is Parked.PARKED
    assert park(env, other, WaitSpec(WaitKind.EVENT, "k2", event="other"))[0] is Parked.PARKED
    event, woken = env.store.send_event("ev", {"n": 1})
    assert woken == 1
    assert event.payload == {"n": 1}
    assert event.sent_at is not None
    run = env.run(waiting)
    assert run.status == RunStatus.PENDING
    assert run.wake_at is None
    # A reference to the event: its payload is stored once, on the event.
    assert run.woken_by == {"event": "ev", "at": event.sent_at.isoformat()}
    sent = env.store.sent_event("ev")
    assert sent is not None
    assert sent.payload == {"n": 1}
    assert env.run(other).status == RunStatus.WAITING
    again, woken = env.store.send_event("ev", {"n": 2})
    assert (again.pk, again.payload, woken) == (event.pk, {"n": 1}, 0)
    # Sent before the wait: no park at all.
    late = env.start("c")
    outcome, woken_by = park(env, late, WaitSpec(WaitKind.EVENT, "k3", event="ev"))
    assert outcome is Parked.READY
    assert woken_by["payload"] == {"n": 1}
    assert env.run(late).status == RunStatus.RUNNING


def test_runs_woken_by_an_event_are_claimed_by_priority(env: Env) -> None:
    pending = env.start("pending, the oldest")
    low = env.start("low", priority=20)
    high = env.start("high", priority=80)
    for run_id in (low, high):
        assert park(env, run_id, WaitSpec(WaitKind.EVENT, "k", event="go"))[0] is Parked.PARKED
    assert env.store.send_event("go", None)[1] == 2
    claimed = [env.store.claim_runs("w1", 30)[0].run_id for _ in range(3)]
    assert claimed == [high, low, pending]


def test_a_timeout_is_told_from_a_timer(env: Env) -> None:
    run_id = env.start()
    park(env, run_id, WaitSpec(WaitKind.EVENT, "k", event="never", seconds=5))
    env.time_passes()
    [claim] = env.store.claim_runs("w2", 30)
    assert claim.run.woken_by == {"timeout": True}
    # The event comes too late: the run is not waiting any more, nothing changes.
    assert env.store.send_event("never", 1)[1] == 0
    assert env.run(run_id).status == RunStatus.RUNNING


def test_a_question_is_answered_once_and_wakes_the_run(env: Env) -> None:
    run_id = env.start()
    assert env.store.answer_question(run_id, None, "early") is None  # nothing asked
    spec = WaitSpec(WaitKind.QUESTION, "qk", question="Go?")
    assert park(env, run_id, spec)[0] is Parked.PARKED
    answered = env.store.answer_question(run_id, None, "yes")
    assert answered is not None
    assert answered.status == QuestionStatus.ANSWERED
    run = env.run(run_id)
    assert run.status == RunStatus.PENDING
    assert run.woken_by["answer"] == "yes"
    again = env.store.answer_question(run_id, None, "no")
    assert again is not None
    assert again.answer == "yes"
    # Asked again by the same call (a crash after the wake): answered already, no park.
    assert park(env, run_id, spec) == (Parked.READY, answered.woken_by())


def test_children_wake_their_parent_when_all_ended(env: Env) -> None:
    parent = env.start("parent")
    claim = env.claim(parent)
    a, created = env.spawn(parent, "a")
    assert created
    assert env.spawn(parent, "a") == (a, False)  # once per key
    b, _ = env.spawn(parent, "b")
    stranger = env.start("stranger")
    with pytest.raises(WaitRefused, match="spawned"):
        env.store.park_on_wait(claim, WaitSpec(WaitKind.RUNS, "k", runs=(str(stranger),)))
    spec = WaitSpec(WaitKind.RUNS, "k", runs=(str(a), str(b)))
    assert env.store.park_on_wait(claim, spec) == (Parked.PARKED, None)
    a_claim = env.claim(a, "w2")
    assert env.store.finish_run(a_claim, RunStatus.SUCCEEDED, result="A")
    assert env.run(parent).status == RunStatus.WAITING  # b is still going
    assert env.store.cancel_run(b)
    run = env.run(parent)
    assert run.status == RunStatus.PENDING
    outcomes = run.woken_by["runs"]
    assert outcomes[str(a)] == {"status": "succeeded", "result": "A", "error": "", "task": "a"}
    assert outcomes[str(b)]["status"] == "cancelled"
    assert env.store.wake_parent(parent) is False  # not waiting any more


def test_spawn_is_refused_past_the_limit_or_for_a_parent_that_is_over(env: Env) -> None:
    parent = env.start()
    env.spawn(parent, "one", limit=1)
    with pytest.raises(WaitRefused, match="MAX_CHILD_RUNS"):
        env.spawn(parent, "two", limit=1)
    assert env.spawn(parent, "one", limit=1)[1] is False  # an existing key is no new child
    env.store.cancel_run(parent)
    with pytest.raises(WaitRefused, match="cancelled"):
        env.spawn(parent, "three")


def test_a_child_has_its_parents_priority(env: Env) -> None:
    parent = env.start(priority=70)
    child, _ = env.spawn(parent, "c")  # built with the default priority
    grandchild, _ = env.spawn(child, "g")
    assert (env.run(child).priority, env.run(grandchild).priority) == (70, 70)


def test_a_cancel_takes_the_unfinished_descendants_with_it(env: Env) -> None:
    parent = env.start()
    child, _ = env.spawn(parent, "c")
    grandchild, _ = env.spawn(child, "g")
    done, _ = env.spawn(parent, "d")
    env.store.finish_run(env.claim(done), RunStatus.SUCCEEDED, result="ok")
    assert env.store.cancel_run(parent)
    statuses = [env.run(r).status for r in (parent, child, grandchild, done)]
    assert statuses == ["cancelled", "cancelled", "cancelled", "succeeded"]


def fork_of(env: Env, run_id: Any, **limits: int) -> Any:
    """A fork of ``run_id`` at its task, as ``forks.plan_fork`` builds it: in the run's tree."""
    source = env.run(run_id)
    fork = AgentRun(
        id=uuid.uuid4(),
        agent="contract",
        prompt_version="v1",
        model="m",
        task="t",
        forked_from_id=run_id,
        fork_seq=0,
        parent_id=source.parent_id,
        root_id=source.root_id,
        depth=source.depth,
    )
    return env.store.create_fork(fork, ForkWrite([(run_id, 0, 1)], None, [], **limits)).pk


def test_a_fork_of_a_child_run_is_counted_and_cancelled_in_its_tree(env: Env) -> None:
    root = env.start()
    child, _ = env.spawn(root, "c")
    fork = fork_of(env, child, max_children=10, max_tree_runs=3)
    assert (env.run(fork).parent_id, env.run(fork).root_id) == (root, root)
    with pytest.raises(WaitRefused, match="MAX_TREE_RUNS=3"):
        fork_of(env, child, max_children=10, max_tree_runs=3)
    with pytest.raises(WaitRefused, match="MAX_CHILD_RUNS"):
        fork_of(env, child, max_children=2, max_tree_runs=10)
    assert env.store.cancel_run(root)
    assert env.run(fork).status == RunStatus.CANCELLED
    with pytest.raises(WaitRefused, match="cancelled"):
        fork_of(env, child, max_children=10, max_tree_runs=10)


def test_a_park_is_fenced(env: Env) -> None:
    run_id = env.start()
    stale = env.claim(run_id)
    env.expire(run_id)
    env.claim(run_id, "w2")
    spec = WaitSpec(WaitKind.TIMER, "k", seconds=1)
    assert env.store.park_on_wait(stale, spec) == (Parked.FENCE_FAILED, None)
    assert env.run(run_id).status == RunStatus.RUNNING


def test_a_dead_run_carries_its_cause_until_it_leaves_the_dead_letter(env: Env) -> None:
    """What the dead-letter page groups on: the reason without its variable parts, written by
    every way into the dead letter and cleared by every way out of it."""
    cause = "overloaded_error (request id <id>) after <n> tries"
    by_worker, by_housekeeping = env.start("a"), env.start("b")
    claim = env.claim(by_worker)
    reason = "overloaded_error (request id req_011CXa) after 3 tries\nTraceback (most recent ..."
    assert env.store.finish_run(claim, RunStatus.DEAD, error=reason)
    assert env.store.dead_letter(
        by_housekeeping, "overloaded_error (request id req_9) after 12 tries"
    )
    assert [env.run(r).dead_cause for r in (by_worker, by_housekeeping)] == [cause, cause]
    assert env.store.requeue_run(by_worker)
    assert env.store.cancel_run(by_housekeeping)
    assert [env.run(r).dead_cause for r in (by_worker, by_housekeeping)] == ["", ""]
    # Any other end leaves it empty.
    failed = env.claim(env.start("c"))
    assert env.store.finish_run(failed, RunStatus.FAILED, error="tool raised")
    assert env.run(failed.run_id).dead_cause == ""


# --------------------------------------------------------------------------- costs


def turn(seq: int, cost: str | None, **usage: int) -> StepWrite:
    counted = Usage(**usage)
    return StepWrite(
        seq,
        StepKind.MODEL_TURN,
        "{}",
        tokens=counted.total,
        usage=counted,
        cost=None if cost is None else Decimal(cost),
    )


def test_a_turn_adds_its_cost_to_the_run_and_the_days_rollup(env: Env) -> None:
    run_id = env.start()
    claim = env.claim(run_id)
    assert env.run(run_id).cost_usd is None  # nothing paid yet
    assert env.store.append_step(claim, turn(1, "0.012345678", input_tokens=100, output_tokens=7))
    assert env.store.append_step(claim, StepWrite(2, StepKind.TOOL_RESULT, "[]"))
    last = dataclasses.replace(
        turn(3, "0.5", input_tokens=5, cache_read_tokens=40, cache_write_5m_tokens=9),
        finish=(RunStatus.SUCCEEDED, "done"),
    )
    assert env.store.append_step(claim, last)
    run = env.run(run_id)
    assert (run.cost_usd, run.tokens_used) == (Decimal("0.512345678"), 161)
    # The tool result is no turn: two turns, their tokens by kind and their cost.
    assert env.usage() == {("contract", "m"): (2, 105, 7, 40, 9, Decimal("0.512345678"))}


def test_turns_without_a_price_leave_the_cost_unknown_not_zero(env: Env) -> None:
    run_id = env.start()
    claim = env.claim(run_id)
    assert env.store.append_step(claim, turn(1, None, input_tokens=10))
    assert env.run(run_id).cost_usd is None
    assert env.usage() == {("contract", "m"): (1, 10, 0, 0, 0, None)}
    # A priced turn after an unpriced one: what is known, not NULL.
    assert env.store.append_step(claim, StepWrite(2, StepKind.TOOL_RESULT, "[]"))
    assert env.store.append_step(claim, turn(3, "0.25", input_tokens=1))
    assert env.store.append_step(claim, StepWrite(4, StepKind.TOOL_RESULT, "[]"))
    assert env.store.append_step(claim, turn(5, None, input_tokens=1))
    assert env.run(run_id).cost_usd == Decimal("0.25")
    assert env.usage()[("contract", "m")][-1] == Decimal("0.25")


def test_a_paid_turn_whose_fence_failed_is_counted_once(env: Env) -> None:
    """The model was paid for the turn even though the run was taken over before its commit:
    its tokens and cost count (not its step); the new holder's turn counts once more."""
    run_id = env.start()
    stale = env.claim(run_id)
    env.expire(run_id)
    fresh = env.claim(run_id, "w2")
    assert not env.store.append_step(stale, turn(1, "0.1", input_tokens=3, output_tokens=4))
    assert env.seqs(run_id) == [0]
    assert (env.run(run_id).cost_usd, env.run(run_id).tokens_used) == (Decimal("0.1"), 7)
    assert env.store.append_step(fresh, turn(1, "0.1", input_tokens=3, output_tokens=4))
    assert (env.run(run_id).cost_usd, env.run(run_id).tokens_used) == (Decimal("0.2"), 14)
    assert env.usage() == {("contract", "m"): (2, 6, 8, 0, 0, Decimal("0.2"))}
    # A step that is no turn is never counted, committed or not.
    assert not env.store.append_step(stale, StepWrite(2, StepKind.TOOL_RESULT, "[]", tokens=5))
    assert env.run(run_id).tokens_used == 14


def test_only_the_call_that_made_a_transition_is_marked_as_its_maker(env: Env) -> None:
    # Two people deciding at once both get the decided object back; only the call that
    # decided may audit it (api.made_transition).
    waiting = env.start("a")
    assert park(env, waiting, WaitSpec(WaitKind.EVENT, "k", event="ev"))[0] is Parked.PARKED
    sent, _woken = env.store.send_event("ev", {"n": 1})
    again, _woken = env.store.send_event("ev", {"n": 1})
    assert (made_transition(sent), made_transition(again)) == (True, False)
    asking = env.start("b")
    spec = WaitSpec(WaitKind.QUESTION, "qk", question="Go?")
    assert park(env, asking, spec)[0] is Parked.PARKED
    answered = env.store.answer_question(asking, None, "yes")
    twice = env.store.answer_question(asking, None, "yes")
    assert (made_transition(answered), made_transition(twice)) == (True, False)


# -- debounced starts (start_run(..., key=, debounce=)) ------------------------------------


def debounce(env: Env, key: str, task: str, seconds: float = 60, priority: int = 0) -> AgentRun:
    run = AgentRun(
        id=uuid.uuid4(), agent="contract", prompt_version="v1", model="m", task=task, start_key=key
    )
    run.priority = priority
    return env.store.debounce_run(run, json.dumps(task), seconds)


def test_debounced_starts_collapse_into_one_run_with_the_last_task(env: Env) -> None:
    first = debounce(env, "ticket-7", "first", seconds=60)
    assert (first.status, first.waiting_for) == (RunStatus.WAITING, WaitKind.DEBOUNCE)
    assert first.wake_at is not None
    assert env.store.claim_run(first.pk, "w1", 30) is None  # its window is not over
    second = debounce(env, "ticket-7", "second", seconds=600, priority=7)
    assert second.pk == first.pk
    run = env.run(first.pk)
    assert (run.task, run.priority, run.status) == ("second", 7, RunStatus.WAITING)
    assert run.wake_at is not None
    assert run.wake_at > first.wake_at  # pushed back
    assert env.task_steps(first.pk) == [json.dumps("second")]
    env.time_passes()
    [claim] = env.store.claim_runs("w1", 30, limit=5)
    assert claim.run_id == first.pk
    # A start, not a wake: no woken_by, and the claim carries the last task as its log.
    assert (claim.run.woken_by, claim.run.wait_key, claim.run.wake_at) == (None, None, None)
    assert claim.run.started_at is not None
    if claim.task_payload is not None:
        assert claim.task_payload == json.dumps("second")


def test_a_debounced_start_after_the_claim_changes_nothing(env: Env) -> None:
    first = debounce(env, "ticket-8", "first")
    env.time_passes()
    claim = env.claim(first.pk)
    again = debounce(env, "ticket-8", "late", priority=9)
    assert again.pk == first.pk
    run = env.run(first.pk)
    assert (run.status, run.task, run.priority, run.attempt) == (
        RunStatus.RUNNING,
        "first",
        0,
        claim.attempt,
    )
    assert run.wake_at is None
    assert env.task_steps(first.pk) == [json.dumps("first")]


def test_a_cancelled_debounced_run_stays_cancelled(env: Env) -> None:
    first = debounce(env, "ticket-9", "first")
    assert env.store.cancel_run(first.pk)
    assert debounce(env, "ticket-9", "again").pk == first.pk
    env.time_passes()
    assert env.store.claim_runs("w1", 30, limit=5) == []
    run = env.run(first.pk)
    assert (run.status, run.task) == (RunStatus.CANCELLED, "first")
    assert env.task_steps(first.pk) == [json.dumps("first")]


def test_a_debounced_start_of_a_key_started_without_debounce_changes_nothing(env: Env) -> None:
    plain = env.start_keyed("ticket-10", task="plain")
    again = debounce(env, "ticket-10", "debounced")
    assert again.pk == plain
    run = env.run(plain)
    assert (run.status, run.task, run.wake_at) == (RunStatus.PENDING, "plain", None)


# --------------------------------------------------------------------------- the inbox


def test_messages_queue_once_per_key_and_fold_with_the_step_that_carries_them(env: Env) -> None:
    run_id = env.start()
    first, created = env.store.queue_message(run_id, "one", "k1")
    assert created
    again, created = env.store.queue_message(run_id, "one again", "k1")
    assert (again.pk, again.text, created) == (first.pk, "one", False)
    second, _ = env.store.queue_message(run_id, "two", None)
    assert env.store.has_waiting_messages(run_id)
    assert [m.text for m in env.store.waiting_messages(run_id)] == ["one", "two"]
    claim = env.claim(run_id)
    step = StepWrite(1, StepKind.MESSAGE, '[{"type":"text","text":"one"}]')
    # A stale claim folds nothing: the messages wait for the lease holder.
    env.expire(run_id)
    fresh = env.claim(run_id, "w2")
    assert not env.store.fold_messages(claim, step, [first.pk])
    assert [m.text for m in env.store.waiting_messages(run_id)] == ["one", "two"]
    assert env.store.fold_messages(fresh, step, [first.pk])
    assert [m.text for m in env.store.waiting_messages(run_id)] == ["two"]
    # A retry whose first try landed is the same fold, not a second delivery.
    assert env.store.fold_messages(fresh, step, [first.pk])
    assert env.seqs(run_id) == [0, 1]
    # The run cannot end while a message waits; once it is folded it can.
    last = StepWrite(2, StepKind.MODEL_TURN, "{}", finish=(RunStatus.SUCCEEDED, "done"))
    assert env.store.append_last_step(fresh, last) is None
    assert env.run(run_id).status == RunStatus.RUNNING
    fold = StepWrite(2, StepKind.MESSAGE, '[{"type":"text","text":"two"}]')
    assert env.store.fold_messages(fresh, fold, [second.pk])
    assert not env.store.has_waiting_messages(run_id)
    last = dataclasses.replace(last, seq=3)
    assert env.store.append_last_step(fresh, last) is True
    assert env.run(run_id).status == RunStatus.SUCCEEDED
    with pytest.raises(RunFinished, match=r"has ended \(succeeded\)"):
        env.store.queue_message(run_id, "late", None)
    # A retry of a message sent before the end still returns it.
    assert env.store.queue_message(run_id, "one", "k1")[0].pk == first.pk


def test_reject_refuses_a_working_run_and_an_unknown_run_is_not_found(env: Env) -> None:
    run_id = env.start()
    with pytest.raises(RunBusy):
        env.store.queue_message(run_id, "hi", None, busy_refused=True)
    assert park(env, run_id, WaitSpec(WaitKind.TIMER, "k", seconds=60))[0] == Parked.PARKED
    assert env.store.queue_message(run_id, "hi", None, busy_refused=True)[1]
    with pytest.raises(RunNotFound):
        env.store.queue_message(uuid.uuid4(), "hi", None)
