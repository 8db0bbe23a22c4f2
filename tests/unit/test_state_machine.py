"""The state machine of a run (``runner.advance_run``) against an ``InMemoryStore`` and the
offline scripted model: every branch, no database, a few milliseconds each.

The task's ``@`` lines are the model's turns (see ``durable_agents.offline``). The ``hook``
tool runs a test's function from inside a run, to change the store while a step is in flight
(a cancel, another worker's claim)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from django.contrib.auth import get_user_model

from durable_agents.declare.agents import Agent
from durable_agents.declare.tools import tool
from durable_agents.engine import runner
from durable_agents.engine.runner import Disposition, advance_run
from durable_agents.models import IntentStatus, RunStatus, StepKind, WaitKind
from durable_agents.store import Claim, InMemoryStore
from durable_agents.store.memory import ManualClock
from tests.unit.conftest import RegisterAgent, claimed, start

HOOKS: dict[str, Callable[[], None]] = {}
LAUNCHES: list[str] = []
HOOKED: list[str] = []


@tool(effect="pure")
def lookup(key: str) -> str:
    """Read a value by key."""
    return f"value-of-{key}"


@tool(effect="pure")
def hook(name: str) -> str:
    """Run the test's hook of this name."""
    HOOKED.append(name)
    HOOKS[name]()
    return f"hooked {name}"


@tool(effect="irreversible")
def launch(target: str, *, idempotency_key: str) -> str:
    """Launch a rocket. Needs a person's approval."""
    LAUNCHES.append(target)
    return f"launched to {target}"


TOOLS = [lookup, hook, launch]


@pytest.fixture
def agents(register_agent: RegisterAgent) -> dict[str, Agent]:
    made = {
        "main": register_agent(
            name="unit-state-machine",
            system="You are the unit test agent.",
            tools=TOOLS,
            max_turns=10,
        ),
        "short": register_agent(
            name="unit-state-machine-short",
            system="You have one turn.",
            tools=TOOLS,
            max_turns=1,
        ),
    }
    HOOKS.clear()
    LAUNCHES.clear()
    HOOKED.clear()
    return made


def kinds(store: InMemoryStore, run_id: Any) -> list[str]:
    return [step.kind for step in store.steps_of(run_id)]


def payload(store: InMemoryStore, run_id: Any, seq: int) -> Any:
    return json.loads(store.steps_of(run_id)[seq].payload)


def test_a_final_turn_succeeds(store: InMemoryStore, agents: dict[str, Agent]) -> None:
    run_id = start(store, agents["main"], "Say hello.")
    assert advance_run(claimed(store, run_id), store=store) is Disposition.SUCCEEDED
    run = store.run(run_id)
    assert (run.status, run.last_seq, run.lease_owner, run.lease_until) == (
        RunStatus.SUCCEEDED,
        1,
        None,
        None,
    )
    assert run.result
    assert run.finished_at is not None
    assert run.tokens_used > 0
    assert run.stalled_claims == 0
    assert kinds(store, run_id) == [StepKind.TASK, StepKind.MODEL_TURN]


def test_a_tool_call_then_a_final_turn(store: InMemoryStore, agents: dict[str, Agent]) -> None:
    run_id = start(store, agents["main"], 'Look it up.\n@lookup {"key": "a"}')
    assert advance_run(claimed(store, run_id), store=store) is Disposition.SUCCEEDED
    assert kinds(store, run_id) == [
        StepKind.TASK,
        StepKind.MODEL_TURN,
        StepKind.TOOL_RESULT,
        StepKind.MODEL_TURN,
    ]
    [block] = payload(store, run_id, 2)
    assert block["content"] == "value-of-a"
    assert "is_error" not in block
    # The call's effect was recorded with the step that carried its result.
    [effect] = store.recorded_effects(run_id, 1).values()
    assert (effect.tool, effect.result, effect.is_error) == ("lookup", "value-of-a", False)


def test_an_unknown_tool_gets_an_error_result(
    store: InMemoryStore, agents: dict[str, Agent]
) -> None:
    run_id = start(store, agents["main"], "@nope {}")
    assert advance_run(claimed(store, run_id), store=store) is Disposition.SUCCEEDED
    [block] = payload(store, run_id, 2)
    assert block["is_error"] is True
    assert block["content"] == "unknown tool 'nope'; the tools are: hook, launch, lookup"


# A turn whose calls are all pure waits for them to go with their results (runner.py's
# FUSE_WITHIN_SECONDS, made long enough here that no scheduling outlasts it); with
# OVERLAP_SAFE_COMMITS off it is committed before they run.


@pytest.fixture
def together(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, settings: Any
) -> bool:
    if request.param:
        monkeypatch.setattr(runner, "FUSE_WITHIN_SECONDS", 60.0)
    else:
        settings.DURABLE_AGENTS = {**settings.DURABLE_AGENTS, "OVERLAP_SAFE_COMMITS": False}
    return bool(request.param)


@pytest.mark.parametrize("together", [True, False], indirect=True, ids=["together", "turn-first"])
def test_a_fence_lost_mid_run_appends_nothing_and_the_new_holder_goes_on(
    store: InMemoryStore, clock: ManualClock, agents: dict[str, Agent], together: bool
) -> None:
    # The second turn calls the hook: a claim's first turn is always committed before its
    # calls, a later one may wait to go with their results.
    run_id = start(store, agents["main"], '@lookup {"key": "a"}\n@hook {"name": "steal"}')
    stolen: list[Claim] = []

    def steal() -> None:
        # The lease expires while the call runs and another worker claims the run (once).
        if not stolen:
            clock.advance(31)
            stolen.append(claimed(store, run_id, "thief"))

    HOOKS["steal"] = steal
    assert advance_run(claimed(store, run_id), store=store) is Disposition.LOST
    run = store.run(run_id)
    before = [StepKind.TASK, StepKind.MODEL_TURN, StepKind.TOOL_RESULT]
    if together:
        # The turn waited for its call's result: neither is appended; the turn counts as paid.
        assert kinds(store, run_id) == before
        assert (run.lease_owner, run.attempt, run.last_seq) == ("thief", 2, 2)
        assert run.tokens_used > 0
    else:
        assert kinds(store, run_id) == [*before, StepKind.MODEL_TURN]  # nothing appended
        assert (run.lease_owner, run.attempt, run.last_seq) == ("thief", 2, 3)
    recorded = [e.result for e in store.recorded_effects(run_id, 3).values()]
    if together:
        # Its result went nowhere: the new holder's model asks again, and the call, pure, runs
        # again.
        assert recorded == []
        assert advance_run(stolen[0], store=store) is Disposition.SUCCEEDED
        assert HOOKED == ["steal", "steal"]
    else:
        # The call happened: its effect is recorded although the commit was refused ...
        assert recorded == ["hooked steal"]
        # ... so the new holder continues from the log and does not run it again.
        assert advance_run(stolen[0], store=store) is Disposition.SUCCEEDED
        assert HOOKED == ["steal"]
    first_of_thief = 3 if together else 4
    workers = [step.worker for step in store.steps_of(run_id)]
    assert workers[first_of_thief:] == ["thief"] * (6 - first_of_thief)


@pytest.mark.parametrize("together", [True, False], indirect=True, ids=["together", "turn-first"])
def test_a_cancel_mid_run_stops_it(
    store: InMemoryStore, agents: dict[str, Agent], together: bool
) -> None:
    run_id = start(
        store,
        agents["main"],
        '@lookup {"key": "a"}\n@hook {"name": "cancel"}\n@lookup {"key": "b"}',
    )

    def cancel() -> None:
        store.cancel_run(run_id)

    HOOKS["cancel"] = cancel
    assert advance_run(claimed(store, run_id), store=store) is Disposition.CANCELLED
    run = store.run(run_id)
    last = 2 if together else 3
    assert (run.status, run.lease_owner, run.last_seq) == (RunStatus.CANCELLED, None, last)
    assert run.finished_at is not None
    every = [StepKind.TASK, StepKind.MODEL_TURN, StepKind.TOOL_RESULT, StepKind.MODEL_TURN]
    assert kinds(store, run_id) == every[: last + 1]


def test_a_claims_first_turn_is_committed_before_its_pure_calls(
    store: InMemoryStore, agents: dict[str, Agent], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A call that kills its process (a poison run) must find its turn committed, whatever
    # the window: the next claim neither pays for the turn again nor loses its name.
    monkeypatch.setattr(runner, "FUSE_WITHIN_SECONDS", 60.0)
    run_id = start(store, agents["main"], '@hook {"name": "look"}')
    seen: list[list[str]] = []
    HOOKS["look"] = lambda: seen.append(kinds(store, run_id))
    assert advance_run(claimed(store, run_id), store=store) is Disposition.SUCCEEDED
    assert seen == [[StepKind.TASK, StepKind.MODEL_TURN]]


def test_a_run_over_its_turn_budget_fails(store: InMemoryStore, agents: dict[str, Agent]) -> None:
    run_id = start(store, agents["short"], '@lookup {"key": "a"}\n@lookup {"key": "b"}')
    assert advance_run(claimed(store, run_id), store=store) is Disposition.FAILED
    run = store.run(run_id)
    assert run.status == RunStatus.FAILED
    assert run.error == "budget exceeded: max_turns (1) reached"
    # The results of the one turn were committed before the run ended.
    assert kinds(store, run_id)[-1] == StepKind.TOOL_RESULT


def test_an_irreversible_call_parks_until_approved_then_runs_once(
    store: InMemoryStore, agents: dict[str, Agent]
) -> None:
    run_id = start(store, agents["main"], '@launch {"target": "moon"}')
    assert advance_run(claimed(store, run_id), store=store) is Disposition.WAITING
    run = store.run(run_id)
    assert (run.status, run.lease_owner, run.lease_until, run.stalled_claims) == (
        RunStatus.WAITING,
        None,
        None,
        0,
    )
    [intent] = store.intents_of(run_id)
    assert (intent.status, intent.tool, intent.input) == (
        IntentStatus.PENDING,
        "launch",
        {"target": "moon"},
    )
    assert LAUNCHES == []
    assert store.claim_runs("w2", 30) == []  # a waiting run is not claimable

    person = get_user_model()(username="ada")
    decided = store.decide_intent(
        intent.pk, person, IntentStatus.PENDING, IntentStatus.APPROVED, ""
    )
    assert decided.status == IntentStatus.APPROVED
    assert store.run(run_id).status == RunStatus.PENDING  # woken

    assert advance_run(claimed(store, run_id, "w2"), store=store) is Disposition.SUCCEEDED
    assert LAUNCHES == ["moon"]
    [intent] = store.intents_of(run_id)
    assert intent.status == IntentStatus.DONE
    [block] = payload(store, run_id, 2)
    assert block["content"] == "launched to moon"


def test_a_rejected_call_is_an_error_result_naming_the_person(
    store: InMemoryStore, agents: dict[str, Agent]
) -> None:
    run_id = start(store, agents["main"], '@launch {"target": "sun"}')
    assert advance_run(claimed(store, run_id), store=store) is Disposition.WAITING
    [intent] = store.intents_of(run_id)
    person = get_user_model()(username="ada")
    store.decide_intent(intent.pk, person, IntentStatus.PENDING, IntentStatus.REJECTED, "too hot")
    assert advance_run(claimed(store, run_id), store=store) is Disposition.SUCCEEDED
    assert LAUNCHES == []
    [block] = payload(store, run_id, 2)
    assert block["is_error"] is True
    assert block["content"] == "launch was not run: rejected by ada: too hot"


def test_claims_that_commit_nothing_send_the_run_to_the_dead_letter(
    store: InMemoryStore, clock: ManualClock, agents: dict[str, Agent], settings: Any
) -> None:
    settings.DURABLE_AGENTS = {**settings.DURABLE_AGENTS, "MAX_ATTEMPTS": 2}
    run_id = start(store, agents["main"], "Say hello.")
    for _ in range(2):  # two workers die before committing anything: their leases expire
        claimed(store, run_id)
        clock.advance(31)
    last = claimed(store, run_id)
    assert last.run.stalled_claims == 3
    assert advance_run(last, store=store) is Disposition.DEAD
    run = store.run(run_id)
    assert (run.status, run.lease_owner, run.last_seq) == (RunStatus.DEAD, None, 0)
    assert run.error.startswith("2 claims in a row ended without committing a step")
    assert "the step in flight was a model call" in run.error


def test_a_run_of_another_definition_waits_for_a_worker_without_a_step_or_an_attempt(
    store: InMemoryStore, agents: dict[str, Agent]
) -> None:
    drifted = start(store, agents["main"], "Say hello.", fingerprint="0" * 64)
    served = start(store, agents["main"], "Say goodbye.")
    assert advance_run(claimed(store, drifted), store=store) is Disposition.WAITING
    run = store.run(drifted)
    assert run.status == RunStatus.WAITING
    assert run.waiting_for == WaitKind.WORKER
    assert run.stalled_claims == 0  # the claim cost no attempt
    assert "waiting for a worker whose unit-state-machine@v1 has fingerprint 000000000000" in (
        run.error
    )
    assert "upgrades_from=['v1']" in run.error  # what a person can do about it
    assert kinds(store, drifted) == [StepKind.TASK]
    # This process's claims skip that definition from now on; the others' runs go on.
    [claim] = store.claim_runs("w1", 30, limit=5)
    assert claim.run_id == served


def test_the_last_step_claims_the_next_run_in_memory_too(
    store: InMemoryStore, agents: dict[str, Agent]
) -> None:
    from durable_agents.store import NextClaim

    first = start(store, agents["main"], "Say hello.")
    second = start(store, agents["main"], "Say goodbye.")
    then = NextClaim("w1", 30, take=lambda: True, give_back=lambda: None)
    assert advance_run(claimed(store, first), store=store, then_claim=then) is Disposition.SUCCEEDED
    assert then.claim is not None
    assert then.claim.run_id == second
    assert then.claim.task_payload == json.dumps("Say goodbye.")
    assert advance_run(then.claim, store=store) is Disposition.SUCCEEDED


def test_a_read_that_fails_after_a_turn_went_with_its_results_loses_neither(
    store: InMemoryStore, agents: dict[str, Agent], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The turn waits for its pure call; the two are to commit while the next call is in
    # flight. The inbox's probe before that call fails (a lost connection, say): the run
    # stops, but the two are committed first, so the next claim does not ask for the turn again.
    monkeypatch.setattr(runner, "FUSE_WITHIN_SECONDS", 60.0)
    task = '@lookup {"key": "a"}\n@lookup {"key": "b"}\n@lookup {"key": "c"}'
    run_id = start(store, agents["main"], task)

    probes: list[Any] = []

    def probe_fails(run_id: Any) -> bool:
        probes.append(run_id)
        if len(probes) == 3:  # before the third call: turn 3 and its results are to go with it
            raise RuntimeError("the probe failed")
        return False

    monkeypatch.setattr(store, "has_waiting_messages", probe_fails)
    with pytest.raises(RuntimeError, match="the probe failed"):
        advance_run(claimed(store, run_id), store=store)
    assert kinds(store, run_id) == [StepKind.TASK] + [StepKind.MODEL_TURN, StepKind.TOOL_RESULT] * 2
    assert store.run(run_id).last_seq == 4
