"""The worker (claims, slots, hand-back, drain, a dead slot, the heartbeat) against an
``InMemoryStore`` and the offline scripted model: no database, no sleeps.

A run's task is its script (see ``durable_agents.offline``): ``@gate {"name": "a"}`` calls the
``gate`` tool, which says it was entered and then blocks until the test opens it. Every wait
in these tests is on an event with a bound; none of them passes by time alone."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

from durable_agents.declare.agents import Agent
from durable_agents.declare.tools import tool
from durable_agents.engine.worker import Worker
from durable_agents.models import RunStatus, StepKind
from durable_agents.store import Claim, InMemoryStore, LeaseLoss
from durable_agents.store.memory import ManualClock
from tests.unit.conftest import RegisterAgent, start

# A bound for every wait on another thread: a broken worker fails the test, never hangs it.
BOUND = 5.0


class Gate:
    """One call of ``gate``: ``entered`` when the call started, ``opened`` lets it return,
    ``returned`` once it did."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.opened = threading.Event()
        self.returned = threading.Event()


GATES: dict[str, Gate] = {}


@tool(effect="pure")
def gate(name: str) -> str:
    """Wait until the test opens the gate of this name."""
    this = GATES[name]
    this.entered.set()
    this.opened.wait(BOUND)
    this.returned.set()
    return f"passed {name}"


@pytest.fixture
def agent(register_agent: RegisterAgent) -> Iterator[Agent]:
    made = register_agent(
        name="unit-worker", system="You are the worker's unit test agent.", tools=[gate]
    )
    GATES.clear()
    yield made
    for each in GATES.values():
        each.opened.set()  # no tool thread outlives its test (the agent is unregistered next)


def gated(store: InMemoryStore, agent: Agent, name: str) -> Any:
    """A run whose first turn calls the gate ``name``."""
    GATES[name] = Gate()
    return start(store, agent, f'@gate {{"name": "{name}"}}')


def worker(store: InMemoryStore, **options: Any) -> Worker:
    options = {
        "worker_id": "w1",
        "handle_signals": False,
        "lease_seconds": 60,
        "heartbeat_seconds": 60,  # the tests beat themselves (Worker.beat)
        "poll_interval": 0.01,
        "grace_seconds": BOUND,
        **options,
    }
    return Worker(store=store, **options)


class Running:
    """``Worker.run()`` on its own thread; ``result()`` joins it (bounded) for the exit code."""

    def __init__(self, target: Worker) -> None:
        self.worker = target
        self.code: list[int] = []
        self.thread = threading.Thread(target=lambda: self.code.append(target.run()))
        self.thread.start()

    def result(self) -> int:
        self.thread.join(BOUND)
        assert not self.thread.is_alive(), "the worker did not stop"
        [code] = self.code
        return code


def entered(*names: str) -> bool:
    return all(GATES[name].entered.wait(BOUND) for name in names)


def test_a_burst_worker_claims_advances_and_ends(store: InMemoryStore, agent: Agent) -> None:
    run_ids = [start(store, agent, f"Say hello {i}.") for i in range(2)]
    idle = start(store, agent, "Not yet.")
    store.cancel_run(idle)  # not claimable: the worker must leave it alone
    done = worker(store, burst=True)
    assert done.run() == 0
    for run_id in run_ids:
        run = store.run(run_id)
        assert (run.status, run.attempt, run.lease_owner) == (RunStatus.SUCCEEDED, 1, None)
        assert [step.worker for step in store.steps_of(run_id)][1:] == ["w1"]
    assert store.run(idle).attempt == 0
    assert (done.stats.claims, done.stats.dispositions) == (2, {"succeeded": 2})


def test_n_slots_advance_n_runs_at_once(store: InMemoryStore, agent: Agent) -> None:
    names = ["a", "b", "c"]
    run_ids = [gated(store, agent, name) for name in names]
    running = Running(worker(store, concurrency=3, burst=True))
    # All three calls are in flight together: one slot would leave two gates unentered.
    assert entered(*names)
    assert running.worker.in_flight() == 3
    for name in names:
        GATES[name].opened.set()
    assert running.result() == 0
    assert {store.run(run_id).status for run_id in run_ids} == {RunStatus.SUCCEEDED}


def test_a_second_signal_hands_the_runs_in_flight_back(store: InMemoryStore, agent: Agent) -> None:
    run_id = gated(store, agent, "held")
    running = Running(worker(store))
    assert entered("held")
    running.worker.stop()  # the first signal: drain ...
    running.worker.abandon.set()  # ... the second: abandon what is in flight
    assert running.result() == 0
    run = store.run(run_id)
    # Handed back uncounted, claimable at once by the next worker, the call's step unwritten.
    assert (run.status, run.lease_owner, run.lease_until) == (RunStatus.PENDING, None, None)
    assert (run.last_seq, run.stalled_claims) == (1, 0)
    assert running.worker.in_flight() == 0
    assert store.claim_run(run_id, "w2", 60) is not None


def test_a_drain_finishes_the_step_in_flight_and_claims_nothing_new(
    store: InMemoryStore, agent: Agent
) -> None:
    first = gated(store, agent, "first")
    waiting = start(store, agent, "Claimed by nobody.")
    running = Running(worker(store, concurrency=1))
    assert entered("first")
    running.worker.stop()
    GATES["first"].opened.set()
    assert running.result() == 0
    run = store.run(first)
    # The tool's result was committed (seq 2), then the run was handed back before its next
    # model call.
    assert [step.kind for step in store.steps_of(first)][-1] == StepKind.TOOL_RESULT
    assert (run.status, run.last_seq, run.lease_owner) == (RunStatus.PENDING, 2, None)
    assert store.run(waiting).attempt == 0
    assert running.worker.stats.dispositions == {"released": 1}


class HandBackFails(InMemoryStore):
    """A store whose release raises what no store may raise: a bug."""

    def release_lease(self, claim: Claim, **options: Any) -> bool:
        raise RuntimeError("a bug while handing a run back")

    def wait_for_worker(self, claim: Claim, reason: str) -> bool:
        raise RuntimeError("a bug while parking a run")


def test_a_dead_slot_stops_the_worker_with_exit_code_1(agent: Agent) -> None:
    broken = HandBackFails(now=ManualClock())
    # A definition this process does not have: the runner hands the run back (and that
    # raises), then the worker's own hand-back after the error raises too, out of the slot.
    start(broken, agent, "Say hello.", fingerprint="started-with-another-definition")
    running = Running(worker(broken))  # not burst: only the dead slot can stop it
    assert running.result() == 1
    assert running.worker.slot_died.is_set()
    assert running.worker.stopping.is_set()


@pytest.mark.parametrize("loss", [LeaseLoss.CANCELLED, LeaseLoss.LOST])
def test_a_heartbeat_that_finds_the_run_gone_interrupts_its_slot(
    store: InMemoryStore, clock: ManualClock, agent: Agent, loss: LeaseLoss
) -> None:
    run_id = gated(store, agent, "beat")
    running = Running(worker(store, burst=True))
    assert entered("beat")
    if loss is LeaseLoss.CANCELLED:
        store.cancel_run(run_id)
    else:
        clock.advance(61)  # the lease expired and another worker took the run
        assert store.claim_run(run_id, "thief", 60) is not None
    assert running.worker.beat() == {run_id: loss}
    # The call is walked away from (it never returned) and the slot ends the run's claim.
    assert running.result() == 0
    assert not GATES["beat"].returned.is_set()
    assert running.worker.stats.dispositions == {loss.value: 1}
    assert store.run(run_id).last_seq == 1  # nothing committed after the loss


def test_a_drain_ends_a_pause_at_once_but_not_what_is_in_flight() -> None:
    from durable_agents._internal.interrupt import Interrupt

    interrupt = Interrupt()
    ended: list[bool] = []
    pausing = threading.Thread(target=lambda: ended.append(interrupt.wait_unless_draining(3600)))
    pausing.start()
    interrupt.drain()
    pausing.join(30)
    assert ended == [True]  # the pause ended, well before its hour
    assert not interrupt.is_set()  # a call in flight is not interrupted by a drain
    assert interrupt.wait_unless_draining(3600) is True  # a later pause ends at once
    assert Interrupt().wait_unless_draining(0.01) is False  # no drain: the time passes


def test_a_shutdown_says_why_to_the_calls_that_wait_it_out() -> None:
    from durable_agents._internal.interrupt import Interrupt
    from durable_agents.engine.runner import SHUTDOWN

    interrupt = Interrupt()
    call = interrupt.narrowed(SHUTDOWN)  # an irreversible call waits out anything else
    interrupt.trigger(SHUTDOWN, "the grace of 10s ran out")
    assert (call.is_set(), call.detail) == (True, "the grace of 10s ran out")
    late = interrupt.narrowed(SHUTDOWN)
    assert (late.is_set(), late.detail) == (True, "the grace of 10s ran out")


def test_a_stopping_claimer_does_not_wait_a_poll_after_its_claim() -> None:
    """stop() sets ``stopping`` then wakes the claimer; the claimer clears its wake-up before
    each claim, so a stop that lands just before that clear must still end the wait after the
    claim (a worker with a five-minute poll would otherwise linger that long)."""
    worker = Worker(store=InMemoryStore(), concurrency=1, handle_signals=False, poll_interval=300)
    assert worker._idle_wait() == 300  # no timer waits: the poll
    worker.stop()
    worker._wake.clear()  # the claim's clear, just after the stop's wake-up
    assert worker._idle_wait() == 0.0
