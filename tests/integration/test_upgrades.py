"""``upgrade_runs`` and ``carry_over_runs``: runs moved in place to another version of their
agent where their history allows it, refused with a reason where it does not; fenced against
workers and against each other; audited. Runs and their logs are written directly (model turns
with thinking blocks as the API returns them); one test drives an upgraded run to its end
through the real SDK against the fake API, which checks every thinking signature it reads."""

from __future__ import annotations

import datetime
import json
import logging
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from django.contrib.auth.models import Permission, User
from django.core.exceptions import PermissionDenied
from django.utils import timezone

import durable_agents
from durable_agents import Agent, api, signals, tool
from durable_agents.declare.agents import registry
from durable_agents.exceptions import InvalidArgument
from durable_agents.forks.upgrades import BATCH, carries_over
from durable_agents.housekeeping import sweeps
from durable_agents.models import (
    AgentRun,
    AgentStep,
    IntentStatus,
    RunStatus,
    StepKind,
    ToolIntent,
    WaitKind,
    new_run_id,
)
from durable_agents.store.workers import record_versions
from durable_agents.testing import plan
from tests.conftest import run_worker
from tests.fakeserver import FakeAnthropic
from tests.integration.conftest import agents_registered, call_at_once

pytestmark = pytest.mark.django_db


@tool(effect="pure")
def lookup(order: str) -> dict[str, Any]:
    """Look an order up."""
    return {"order": order, "total": 120}


@tool(effect="non_idempotent")
def charge(order: str, cents: int, *, idempotency_key: str) -> str:
    """Charge a card."""
    return f"charged {cents} for {order}"


@tool(effect="idempotent", name="lookup")
def lookup_idempotent(order: str) -> dict[str, Any]:
    """Look an order up."""
    return {"order": order, "total": 120}


THINKING = {"type": "enabled", "budget_tokens": 1024}
SYSTEM = "You settle orders."


def version(name: str, **changes: Any) -> Agent:
    options: dict[str, Any] = {
        "name": "upgrader",
        "version": name,
        "model": "claude-test-1",
        "system": SYSTEM,
        "tools": [lookup, charge],
        "thinking": THINKING,
        "max_tokens": 2048,
        "register": False,
    }
    return Agent(**{**options, **changes})


V1 = version("1")
# Only max_tokens differs: nothing signed thinking binds.
ROOMIER = version("1-roomier", max_tokens=4096)
# Another system prompt: bound by signed thinking.
REWORDED = version("2", system="You settle orders, politely.")
# lookup is idempotent here: its input schema and description are the same, so the request
# (and the binding) is too, but a pending call of it would run under another effect class.
RECLASSED = version("3", tools=[lookup_idempotent, charge])
# No charge tool (the request changes too).
NO_CHARGE = version("4", tools=[lookup])
OTHER = Agent(name="other-agent", version="1", model="claude-test-1", register=False)
AGENTS = [V1, ROOMIER, REWORDED, RECLASSED, NO_CHARGE, OTHER]


@pytest.fixture(autouse=True)
def registered() -> Iterator[None]:
    with agents_registered(*AGENTS):
        yield


THOUGHT = {"type": "thinking", "thinking": "Let me look the order up.", "signature": "c2lnbmVk"}
REDACTED = {"type": "redacted_thinking", "data": "ZW5jcnlwdGVk"}
COMPACTION = {"type": "compaction", "content": "The order was looked up."}


def use(name: str, **tool_input: Any) -> dict[str, Any]:
    return {"type": "tool_use", "id": f"toolu_{name}", "name": name, "input": tool_input}


def text(words: str) -> dict[str, Any]:
    return {"type": "text", "text": words}


def turn(*blocks: dict[str, Any]) -> tuple[str, str]:
    """A model turn's step: the response body as the API returns it."""
    asks = any(block["type"] == "tool_use" for block in blocks)
    body = {
        "id": f"msg_{uuid.uuid4().hex[:12]}",
        "type": "message",
        "role": "assistant",
        "model": "claude-test-1",
        "content": list(blocks),
        "stop_reason": "tool_use" if asks else "end_turn",
        "usage": {"input_tokens": 10, "output_tokens": 5},
    }
    return StepKind.MODEL_TURN, json.dumps(body)


def results(*names: str) -> tuple[str, str]:
    blocks = [{"type": "tool_result", "tool_use_id": f"toolu_{n}", "content": "ok"} for n in names]
    return StepKind.TOOL_RESULT, json.dumps(blocks)


def run_with(
    *steps: tuple[str, str],
    on: Agent = V1,
    status: str = RunStatus.PENDING,
    model: str | None = None,
    **columns: Any,
) -> AgentRun:
    """A run of ``on`` whose log is the task and ``steps``, in ``status``."""
    run = api.start_run(on.name, "Settle order o-1.", version=on.version, model=model)
    for seq, (kind, payload) in enumerate(steps, start=1):
        AgentStep.objects.create(run=run, seq=seq, kind=kind, payload=payload)
    AgentRun.objects.filter(pk=run.pk).update(last_seq=len(steps), status=status, **columns)
    run.refresh_from_db()
    return run


# A log with signed thinking in its first turn, its calls answered: nothing pending.
THOUGHT_LOG = (turn(THOUGHT, use("lookup", order="o-1")), results("lookup"))
PLAIN_LOG = (turn(text("Looking."), use("lookup", order="o-1")), results("lookup"))


def upgrade(to: str, *runs: AgentRun, **options: Any) -> api.UpgradeReport:
    ids = [run.pk for run in runs] if runs else None
    return durable_agents.upgrade_runs("upgrader", "1", to, run_ids=ids, **options)


def pinned(run: AgentRun) -> tuple[str, str]:
    run.refresh_from_db()
    return run.prompt_version, run.fingerprint


# -- what the history allows ---------------------------------------------------------------


def test_signed_thinking_refuses_another_system_prompt_naming_the_step_and_block() -> None:
    thought = run_with(*THOUGHT_LOG)
    redacted = run_with(turn(text("Hm."), REDACTED, use("lookup", order="o-1")), results("lookup"))
    before = {run.pk: pinned(run) for run in (thought, redacted)}

    report = upgrade("2", thought, redacted)

    assert report.upgraded == []
    assert "different system prompt" in report.refused[thought.pk]
    assert "step 1 (a model turn), content block 0 (thinking)" in report.refused[thought.pk]
    assert (
        "step 1 (a model turn), content block 1 (redacted_thinking)"
        in (report.refused[redacted.pk])
    )
    assert {run.pk: pinned(run) for run in (thought, redacted)} == before


def test_unchanged_binding_upgrades_a_run_with_thinking() -> None:
    thought = run_with(*THOUGHT_LOG, model="claude-test-2")
    report = upgrade("1-roomier", thought)
    assert (report.upgraded, report.refused) == ([thought.pk], {})
    # Pinned anew, for the run's own model.
    assert pinned(thought) == ("1-roomier", ROOMIER.fingerprint("claude-test-2"))
    assert thought.model == "claude-test-2"
    assert thought.status == RunStatus.PENDING


def test_a_run_without_thinking_upgrades_across_another_system_prompt() -> None:
    plain = run_with(*PLAIN_LOG)
    report = upgrade("2", plain)
    assert report.upgraded == [plain.pk]
    assert pinned(plain) == ("2", REWORDED.fingerprint())


def test_thinking_before_the_newest_compaction_block_binds_nothing() -> None:
    compacted = run_with(
        *THOUGHT_LOG, turn(COMPACTION, text("Summed up."), use("lookup", order="o-1")),
        results("lookup"),
    )  # fmt: skip
    thought_after = run_with(*THOUGHT_LOG, turn(COMPACTION, THOUGHT, use("lookup", order="o-1")))
    report = upgrade("2", compacted, thought_after)
    assert report.upgraded == [compacted.pk]
    assert "step 3 (a model turn), content block 1 (thinking)" in report.refused[thought_after.pk]


# -- what moves, and how -----------------------------------------------------------------


def test_every_run_in_flight_of_the_version_moves_and_nothing_else() -> None:
    pending = run_with(*PLAIN_LOG)
    waiting = run_with(*PLAIN_LOG, status=RunStatus.WAITING, waiting_for=WaitKind.TIMER)
    succeeded = run_with(*PLAIN_LOG, status=RunStatus.SUCCEEDED)
    dead = run_with(*PLAIN_LOG, status=RunStatus.DEAD, error="boom")
    other_version = run_with(*PLAIN_LOG, on=ROOMIER)

    report = upgrade("2")  # every run of upgrader@1 in flight

    assert sorted(report.upgraded) == sorted([pending.pk, waiting.pk])
    assert report.refused == {}
    assert pinned(waiting)[0] == "2"
    assert waiting.status == RunStatus.WAITING
    for untouched, was in ((succeeded, "1"), (dead, "1"), (other_version, "1-roomier")):
        assert pinned(untouched)[0] == was


def test_a_run_waiting_for_a_worker_becomes_claimable_at_once() -> None:
    hold = timezone.now() + datetime.timedelta(hours=1)
    for_worker = run_with(*PLAIN_LOG, waiting_for=WaitKind.WORKER, lease_until=hold)
    for_capacity = run_with(*PLAIN_LOG, waiting_for=WaitKind.CAPACITY, lease_until=hold)
    report = upgrade("2", for_worker, for_capacity)
    assert len(report.upgraded) == 2
    for_worker.refresh_from_db()
    for_capacity.refresh_from_db()
    assert (for_worker.status, for_worker.waiting_for, for_worker.lease_until) == (
        RunStatus.PENDING,
        "",
        None,
    )
    assert AgentRun.objects.claimable().filter(pk=for_worker.pk).exists()
    # A wait for model capacity is not about the version: it keeps its hold.
    assert (for_capacity.waiting_for, for_capacity.lease_until) == (WaitKind.CAPACITY, hold)


def test_a_running_run_whose_lease_expired_is_handed_back_and_its_holder_fenced_off() -> None:
    expired = timezone.now() - datetime.timedelta(seconds=30)
    run = run_with(
        *PLAIN_LOG, status=RunStatus.RUNNING, lease_owner="w-gone", lease_until=expired, attempt=3
    )
    report = upgrade("2", run)
    assert report.upgraded == [run.pk]
    run.refresh_from_db()
    assert (run.status, run.lease_owner, run.lease_until, run.attempt) == (
        RunStatus.PENDING,
        None,
        None,
        3,
    )
    # The old holder's fence (owner, attempt, running) finds no row any more.
    assert not AgentRun.objects.filter(
        pk=run.pk, lease_owner="w-gone", attempt=3, status=RunStatus.RUNNING
    ).exists()


def test_a_run_held_by_a_live_lease_is_refused_naming_the_worker() -> None:
    held = run_with(
        *PLAIN_LOG,
        status=RunStatus.RUNNING,
        lease_owner="worker-7",
        lease_until=timezone.now() + datetime.timedelta(minutes=5),
        attempt=1,
    )
    report = upgrade("2", held)
    assert report.upgraded == []
    assert "held by worker 'worker-7'" in report.refused[held.pk]
    assert pinned(held)[0] == "1"


def test_intents_waiting_for_a_person_or_in_doubt_refuse() -> None:
    asked = (turn(use("charge", order="o-1", cents=5)),)
    runs = {status: run_with(*asked, status=RunStatus.WAITING) for status in IntentStatus}
    for status, run in runs.items():
        ToolIntent.objects.create(  # type: ignore[misc]  # a JSONTextField takes any JSON value; the stubs say str
            run=run,
            seq=1,
            call_index=0,
            tool="charge",
            input={"order": "o-1", "cents": 5},
            key=uuid.uuid4().hex,
            status=status,
        )
    report = upgrade("1-roomier", *runs.values())
    refused = {status for status, run in runs.items() if run.pk in report.refused}
    assert refused == {IntentStatus.PENDING, IntentStatus.UNKNOWN, IntentStatus.EXECUTING}
    reason = report.refused[runs[IntentStatus.PENDING].pk]
    assert "(charge, call 0 of step 1)" in reason
    assert "decide it first" in reason
    assert "unknown outcome" in report.refused[runs[IntentStatus.UNKNOWN].pk]


def test_a_last_turn_asking_for_a_tool_the_target_lacks_or_declares_otherwise_refuses() -> None:
    charging = run_with(turn(use("charge", order="o-1", cents=5)))
    looking = run_with(turn(use("lookup", order="o-1")))
    answered = run_with(turn(use("charge", order="o-1", cents=5)), results("charge"))

    report = upgrade("4", charging, looking, answered)
    assert sorted(report.upgraded) == sorted([looking.pk, answered.pk])
    assert report.refused == {
        charging.pk: "step 1 (a model turn) asks for tool 'charge', which version '4' does not have"
    }

    # The same request (binding unchanged), but lookup's effect class differs.
    looking = run_with(turn(THOUGHT, use("lookup", order="o-1")))
    charging = run_with(turn(THOUGHT, use("charge", order="o-1", cents=5)))
    report = upgrade("3", looking, charging)
    assert report.upgraded == [charging.pk]
    assert (
        "tool 'lookup', which version '3' declares with another effect class"
        in (report.refused[looking.pk])
    )


def test_bad_input_raises_before_anything_moves(django_user_model: Any) -> None:
    run = run_with(*PLAIN_LOG)
    cases: list[tuple[dict[str, Any], str]] = [
        ({"to_version": "9"}, "has no version '9' registered in this process"),
        ({"to_version": "1"}, "from_version and to_version are both '1'"),
        ({"agent": 7}, "agent is a string, not int"),
        ({"agent": " "}, "agent cannot be empty"),
        ({"from_version": None}, "from_version is a string, not NoneType"),
        ({"run_ids": [run.pk, "not-a-uuid"]}, "'not-a-uuid', which is not a run id"),
        ({"run_ids": str(run.pk)}, "run_ids is a list of run ids"),
        ({"run_ids": 5}, "run_ids is a list of run ids"),
    ]
    for change, message in cases:
        arguments: dict[str, Any] = {
            "agent": "upgrader",
            "from_version": "1",
            "to_version": "2",
            "run_ids": [run.pk],
            **change,
        }
        with pytest.raises(InvalidArgument, match=message):
            durable_agents.upgrade_runs(
                arguments.pop("agent"),
                arguments.pop("from_version"),
                arguments.pop("to_version"),
                **arguments,
            )
    nobody = django_user_model.objects.create_user("nobody", is_staff=True)
    with pytest.raises(PermissionDenied, match="change_agentrun"):
        upgrade("2", run, user=nobody)
    assert pinned(run)[0] == "1"
    # Ids as text are ids.
    assert upgrade_ids(str(run.pk)).upgraded == [run.pk]


def upgrade_ids(*ids: Any) -> api.UpgradeReport:
    return durable_agents.upgrade_runs("upgrader", "1", "2", run_ids=list(ids))


def test_ids_of_runs_that_cannot_move_are_each_refused_with_why() -> None:
    other_agent = api.start_run("other-agent", "Hello.")
    other_version = run_with(*PLAIN_LOG, on=ROOMIER)
    succeeded = run_with(*PLAIN_LOG, status=RunStatus.SUCCEEDED)
    dead = run_with(*PLAIN_LOG, status=RunStatus.DEAD, error="boom")
    missing = new_run_id()
    report = upgrade_ids(other_agent.pk, other_version.pk, succeeded.pk, dead.pk, missing)
    assert report.upgraded == []
    assert report.refused == {
        other_agent.pk: "it is a run of agent 'other-agent', not 'upgrader'",
        other_version.pk: "it is on version '1-roomier', not '1' (upgraded already, or never "
        "on it)",
        succeeded.pk: "it is succeeded: only runs in flight (pending, waiting, running) are "
        "upgraded",
        dead.pk: "it is dead: carry it over instead (the dead letter offers it when its "
        "version is not deployed or drifted), or requeue it",
        missing: "there is no run with this id",
    }


# -- a version this process does not define: its agent_version record ---------------------


def recorded(agent: Agent) -> None:
    record_versions(
        [{"agent": agent.name, "version": agent.version, **agent.digests()}], timezone.now()
    )


def test_an_undefined_version_is_judged_by_its_record() -> None:
    # Version 1 as the fleet recorded it: the binding of version 1 (and of 1-roomier), another
    # fingerprint than the one this process defines.
    as_recorded = version("1", max_tokens=3000)
    recorded(as_recorded)
    thought = run_with(*THOUGHT_LOG)
    toward_2 = run_with(*THOUGHT_LOG)
    AgentRun.objects.filter(pk__in=[thought.pk, toward_2.pk]).update(
        fingerprint=as_recorded.fingerprint()
    )
    # Started on another model: no record holds its fingerprint; the newest record of the
    # version stands for it.
    on_other_model = run_with(*THOUGHT_LOG, model="claude-test-9")
    registry.unregister("upgrader", "1")

    report = upgrade("1-roomier", thought, on_other_model)
    assert sorted(report.upgraded) == sorted([thought.pk, on_other_model.pk])
    report = upgrade("2", toward_2)
    assert "different system prompt or tools: step 1" in report.refused[toward_2.pk]


def test_what_an_unknown_version_sent_counts_as_changed() -> None:
    thought = run_with(*THOUGHT_LOG)
    plain = run_with(*PLAIN_LOG)
    asking = run_with(turn(use("lookup", order="o-1")))
    registry.unregister("upgrader", "1")
    report = upgrade("1-roomier", thought, plain, asking)
    assert report.upgraded == [plain.pk]
    assert "what version '1' sent is not known here" in report.refused[thought.pk]
    assert "step 1 (a model turn), content block 0 (thinking)" in report.refused[thought.pk]
    assert "the tools version '1' declared are not known here" in report.refused[asking.pk]


# -- the dead letter: a carry over ---------------------------------------------------------

# The sweep's reason (housekeeping.sweeps.dead_letter_undeployed), and those of earlier
# releases still found in dead letters.
UNDEPLOYED = (
    "agent version upgrader@1 has not been defined by any live worker since 2026-11-20 10:00 "
    "UTC (UNDEPLOYED_GRACE is 7 days): deploy it again, or upgrade the run to another version, "
    "or cancel it"
)
OLD_UNDEPLOYED = (
    "prompt version '1' of agent 'upgrader' is no longer deployed; deploy it again to resume "
    "the run, or cancel it"
)
STALLED = (
    "6 claims in a row ended without committing a step (MAX_ATTEMPTS=5); last committed step: "
    "seq 2; the step in flight was a model call; last error: prompt version '1' of agent "
    "'upgrader' is not deployed on worker w-1 (agent 'upgrader' has no version '1'); deploy "
    "it again or cancel the run"
)
DRIFT = (
    "prompt drift: agent upgrader@1 on this worker has fingerprint 0123456789ab, the run was "
    "started with ba9876543210; its system prompt, tools or parameters changed"
)


def test_reasons_a_carry_over_is_for() -> None:
    assert carries_over(UNDEPLOYED)
    assert carries_over(OLD_UNDEPLOYED)
    assert carries_over(STALLED)
    assert carries_over(DRIFT)
    assert not carries_over("the model stopped with stop_reason='refusal'")
    assert not carries_over("")


def test_a_dead_run_of_an_undeployed_version_is_carried_over_to_pending() -> None:
    dead = {
        reason: run_with(
            *PLAIN_LOG, status=RunStatus.DEAD, error=reason, dead_cause="x", stalled_claims=6
        )
        for reason in (UNDEPLOYED, OLD_UNDEPLOYED, STALLED, DRIFT, "boom")
    }
    thought = run_with(*THOUGHT_LOG, status=RunStatus.DEAD, error=UNDEPLOYED)
    pending = run_with(*PLAIN_LOG)

    ids = [run.pk for run in (*dead.values(), thought, pending)]
    report = durable_agents.carry_over_runs("upgrader", "1", "2", run_ids=ids)

    carried = (UNDEPLOYED, OLD_UNDEPLOYED, STALLED, DRIFT)
    assert sorted(report.upgraded) == sorted(dead[r].pk for r in carried)
    assert "requeue it instead" in report.refused[dead["boom"].pk]
    assert "step 1 (a model turn), content block 0 (thinking)" in report.refused[thought.pk]
    assert "it is pending, not dead" in report.refused[pending.pk]
    run = dead[UNDEPLOYED]
    run.refresh_from_db()
    assert (run.status, run.prompt_version, run.dead_cause, run.stalled_claims) == (
        RunStatus.PENDING,
        "2",
        "",
        0,
    )
    assert (run.finished_at, run.lease_until) == (None, None)
    assert AgentRun.objects.claimable().filter(pk=run.pk).exists()
    # Without ids: every dead run of the version that died of it (none are left).
    assert durable_agents.carry_over_runs("upgrader", "1", "2").upgraded == []


def test_a_run_the_sweep_dead_lettered_for_its_undeployed_version_is_carried_over(
    da_settings: Any,
) -> None:
    da_settings(UNDEPLOYED_GRACE=0)
    run = run_with(*PLAIN_LOG)
    assert sweeps.dead_letter_undeployed(AgentRun.objects.not_leased()) == 1
    run.refresh_from_db()
    assert run.status == RunStatus.DEAD
    assert carries_over(run.error)
    # Every such dead run of the version, found without ids.
    report = durable_agents.carry_over_runs("upgrader", "1", "2")
    assert report.upgraded == [run.pk]
    assert pinned(run) == ("2", REWORDED.fingerprint())
    assert run.status == RunStatus.PENDING


# -- audit ---------------------------------------------------------------------------------


def test_every_upgraded_run_is_audited_with_who_asked(
    django_user_model: Any, caplog: pytest.LogCaptureFixture
) -> None:
    person = django_user_model.objects.create_user("operator", is_staff=True)
    person.user_permissions.add(
        Permission.objects.get(codename="change_agentrun", content_type__app_label="durable_agents")
    )
    person = User.objects.get(pk=person.pk)
    moved, held = run_with(*PLAIN_LOG), run_with(*PLAIN_LOG, status=RunStatus.SUCCEEDED)
    heard: list[dict[str, Any]] = []

    def listener(sender: Any, **kwargs: Any) -> None:
        heard.append(kwargs)

    signals.run_upgraded.connect(listener)
    try:
        with caplog.at_level(logging.INFO, logger="durable_agents.upgrades"):
            upgrade("2", moved, held, user=person)
            from_code = run_with(*PLAIN_LOG)
            upgrade("2", from_code)
    finally:
        signals.run_upgraded.disconnect(listener)
    assert [(h["run_id"], h["to_version"], h["user"]) for h in heard] == [
        (moved.pk, "2", person),
        (from_code.pk, "2", None),
    ]
    lines = [r.getMessage() for r in caplog.records if r.name == "durable_agents.upgrades"]
    assert lines == [
        f"run {moved.pk} upgraded: agent upgrader version 1 -> 2, by operator",
        f"run {from_code.pk} upgraded: agent upgrader version 1 -> 2, by code (no user)",
    ]


# -- many runs -----------------------------------------------------------------------------


def bulk_runs(count: int, *, thinking_every: int | None = None) -> list[uuid.UUID]:
    """``count`` pending runs of version 1 made in bulk; every ``thinking_every``-th one has
    signed thinking in its log, the others none. Each log: the task, a turn, its result."""
    runs = [
        AgentRun(
            id=new_run_id(),
            agent="upgrader",
            prompt_version="1",
            model="claude-test-1",
            fingerprint=V1.fingerprint(),
            task=f"Settle order o-{i}.",
            status=RunStatus.PENDING,
            last_seq=2,
        )
        for i in range(count)
    ]
    AgentRun.objects.bulk_create(runs, batch_size=500)
    thought, plain = THOUGHT_LOG[0][1], PLAIN_LOG[0][1]
    steps = []
    for i, run in enumerate(runs):
        steps += [
            AgentStep(run=run, seq=0, kind=StepKind.TASK, payload=json.dumps(run.task)),
            AgentStep(
                run=run,
                seq=1,
                kind=StepKind.MODEL_TURN,
                payload=thought if thinking_every and i % thinking_every == 0 else plain,
            ),
            AgentStep(run=run, seq=2, kind=StepKind.TOOL_RESULT, payload=results("lookup")[1]),
        ]
    AgentStep.objects.bulk_create(steps, batch_size=1000)
    return [run.pk for run in runs]


def test_thousands_of_runs_made_in_bulk_upgrade_in_batches() -> None:
    count = 2 * BATCH + 300
    ids = bulk_runs(count, thinking_every=4)
    thinking = set(ids[::4])

    report = upgrade("2")  # every run of the version, batch by batch

    assert len(report.upgraded) == count - len(thinking)
    assert set(report.refused) == thinking
    assert all("content block 0 (thinking)" in why for why in report.refused.values())
    assert AgentRun.objects.filter(prompt_version="2").count() == count - len(thinking)
    assert AgentRun.objects.filter(prompt_version="2", fingerprint=REWORDED.fingerprint()).count()
    # The rest: an unchanged binding takes them all, thinking or not.
    report = upgrade("1-roomier")
    assert (len(report.upgraded), report.refused) == (len(thinking), {})
    assert AgentRun.objects.filter(prompt_version="1").count() == 0


# -- races -----------------------------------------------------------------------------------


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_two_upgrades_at_once_move_each_run_once(unpooled: None) -> None:
    ids = bulk_runs(BATCH + 200)

    reports, errors = call_at_once(
        lambda i: durable_agents.upgrade_runs(
            "upgrader", "1", "1-roomier" if i == 0 else "2", run_ids=ids
        ),
        2,
    )

    assert errors == []
    first, second = reports
    moved = first.upgraded + second.upgraded
    assert sorted(moved) == sorted(ids)  # each run once, by one of them
    for report, other in ((first, second), (second, first)):
        assert set(report.refused) == set(other.upgraded)
        for reason in report.refused.values():
            assert reason.startswith(("busy: a worker is claiming it", "it is on version '")), (
                reason
            )
    final = dict(AgentRun.objects.filter(pk__in=ids).values_list("pk", "prompt_version"))
    for report in reports:
        targets = {final[pk] for pk in report.upgraded}
        assert len(targets) <= 1


# -- end to end ------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_an_upgraded_run_with_signed_thinking_finishes_on_the_new_version(
    fake_api: FakeAnthropic,
) -> None:
    """A fork of a finished run, pending at step 4 with signed thinking in the log it shares:
    upgraded where the binding is unchanged, it goes on under the new version, and the fake
    API accepts every signature (it answers 400 to any changed history)."""
    task = plan(
        ("lookup", {"order": "o-1"}),
        ("lookup", {"order": "o-2"}),
        ("lookup", {"order": "o-3"}),
        task="Settle order o-1.",
    )
    parent = api.start_run("upgrader", task, version="1")
    run_worker()
    parent.refresh_from_db()
    assert (parent.status, parent.error) == (RunStatus.SUCCEEDED, "")
    fork = api.fork_run(parent.pk, at_seq=4)

    report = upgrade("2", fork)
    assert "step 1 (a model turn), content block 0 (thinking)" in report.refused[fork.pk]
    report = upgrade("1-roomier", fork)
    assert report.upgraded == [fork.pk]

    run_worker()
    fork.refresh_from_db()
    assert (fork.status, fork.error, fork.prompt_version) == (
        RunStatus.SUCCEEDED,
        "",
        "1-roomier",
    )
    assert fake_api.ok_requests()[-1].json()["max_tokens"] == 4096
