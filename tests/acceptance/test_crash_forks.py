"""Forks made while workers are being SIGKILLed end with every invariant of the crash tests.

Sixteen runs of the thinking agent (pure, non-idempotent and irreversible calls over five
turns) are worked by three ``runagents`` subprocesses, one of which is SIGKILLed, and replaced
by a new one, every second or so. Meanwhile the test process forks: runs still at work (at a
step they have committed), finished runs at the model turn whose two charges they recorded,
forks of forks, with an edited batch of tool results, and one with an edited task. It approves
each irreversible call as it is asked (and settles one a kill left unknown by what the
receiver saw), until every run and fork has ended.

Then, for each of them: it succeeded; its whole log has seqs 0..last_seq once each; a fork's
steps before its fork point are its parent's bytes (the edited step is the edit); the receiver
(outside the database) applied exactly the calls each run made itself, each under that run's
own key (at a fork's fork-point turn, its parent's key), once, and the ledger holds a row per
call under the run's own key; a fork made none of the calls before its
fork point, nor those of the fork-point turn its parent had recorded; every request the fake
API answered passed the offline model's checks (thinking signatures included).
"""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pytest
from django.contrib.auth.models import User

import durable_agents
from durable_agents._internal.deepjson import loads_deep
from durable_agents.engine import effects
from durable_agents.forks.planning import calls_made_by
from durable_agents.models import (
    ENDED_STATUSES,
    AgentRun,
    AgentStep,
    IntentStatus,
    RunStatus,
    StepKind,
    ToolEffect,
    ToolIntent,
    steps_of,
)
from durable_agents.testing import plan
from tests.conftest import Receiver, WorkerProcess, approver
from tests.fakeserver import FakeAnthropic, Recorded

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True),
]

ROOTS = 16
WORKERS = 3
LEASE = "2"  # seconds: how long a killed worker's runs stay unclaimable
KILL_EVERY = 1.0  # seconds between two SIGKILLs
MIN_KILLS = 6
MAX_KILLS = 14
SEED = 20261204
SIGKILLED = -9
# The tools whose calls carry an idempotency key, and the receiver's name for each.
KEYED = {"charge": "charge", "drop_table": "drop"}
# seq 5 is the model turn asking for two charges (see root_task).
TWO_CHARGES_TURN = 5
AT_WORK = (RunStatus.PENDING, RunStatus.RUNNING, RunStatus.WAITING)


def root_task(i: int) -> str:
    """seq 1: lookup + charge, 3: slow, 5: two charges, 7: drop_table (every fourth run) or a
    lookup, 9: the end. Every charge has its own payload, so the receiver tells them apart."""
    last: Any = ("drop_table", {"table": f"t{i}"}) if i % 4 == 0 else ("lookup", {"key": f"z{i}"})
    return plan(
        [("lookup", {"key": f"r{i}"}), ("charge", {"customer": f"r{i}-a", "cents": 100 + i})],
        ("slow", {"seconds": 0.3}),
        [
            ("charge", {"customer": f"r{i}-b", "cents": 200 + i}),
            ("charge", {"customer": f"r{i}-c", "cents": 300 + i}),
        ],
        last,
        task=f"Chaos run {i}.",
    )


# The forks the test makes, in order: forks of runs at work come first, while there are runs at
# work; finished runs are forked once some have finished.
RECIPES = (
    "active",
    "active",
    "edit",
    "active",
    "fork-of-fork",
    "active",
    "active",
    "edit",
    "finished-turn",
    "fork-of-fork",
    "task",
    "finished-turn",
    "edit",
    "fork-of-fork",
    "finished-turn",
    "fork-of-fork",
)
EDITED_TASK = plan(("charge", {"customer": "edited-task", "cents": 1}), task="An edited task.")


@dataclass
class Fork:
    run_id: Any
    parent_id: Any
    at_seq: int
    recipe: str
    parent_was_active: bool
    edit: Any = None
    # The parent's calls of the fork-point model turn already in its ledger before fork_run
    # began: the fork must inherit them, never make them.
    recorded_before: set[int] = field(default_factory=set)


def settle_intents(user: User, receiver: Receiver) -> int:
    """Approve every irreversible call waiting for a person; settle one a kill left unknown by
    what the receiver saw (applied: it happened, with the tool's own result; else run it)."""
    decided = 0
    for intent in ToolIntent.objects.filter(status=IntentStatus.PENDING):
        durable_agents.approve_intent(intent.pk, user=user)
        decided += 1
    for intent in ToolIntent.objects.filter(status=IntentStatus.UNKNOWN):
        applied = {a["key"] for a in receiver.applied("drop")}
        if intent.key in applied:
            table = intent.input["table"]
            durable_agents.resolve_intent(
                intent.pk, user=user, happened=True, result=f"dropped {table}"
            )
        else:
            durable_agents.resolve_intent(intent.pk, user=user, happened=False)
        decided += 1
    return decided


def log_of(run_id: Any) -> list[AgentStep]:
    return list(steps_of(run_id).order_by("seq"))


def calls_of(step: AgentStep) -> list[dict[str, Any]]:
    content = loads_deep(step.payload).get("content") or []
    return [b for b in content if isinstance(b, dict) and b.get("type") == "tool_use"]


class Chaos:
    """The forks the test makes, one recipe at a time, from what the runs have committed."""

    def __init__(self, roots: list[AgentRun]) -> None:
        self.rng = random.Random(SEED)
        self.roots = [r.pk for r in roots]
        self.forks: list[Fork] = []
        self.recipes = list(RECIPES)

    def all_ids(self) -> list[Any]:
        return [*self.roots, *(f.run_id for f in self.forks)]

    def step(self) -> None:
        """Make the next fork of the list, if some run can be forked that way now."""
        if not self.recipes:
            return
        recipe = self.recipes[0]
        made = getattr(self, "_" + recipe.replace("-", "_"))()
        if made is not None:
            self.forks.append(made)
            self.recipes.pop(0)

    def _pick(self, ids: list[Any], **filters: Any) -> AgentRun | None:
        found = list(AgentRun.objects.filter(pk__in=ids, **filters).order_by("pk"))
        return self.rng.choice(found) if found else None

    def _fork(self, parent: AgentRun, at_seq: int, recipe: str, edit: Any = None) -> Fork:
        step = steps_of(parent.pk).get(seq=at_seq)
        recorded: set[int] = set()
        if edit is None and step.kind == StepKind.MODEL_TURN:
            # Recorded by the run that made the turn's calls: the parent, or the run it was
            # forked from when the turn predates the parent's own fork point.
            caller = calls_made_by(parent, at_seq)
            recorded = set(
                ToolEffect.objects.filter(run=caller, seq=at_seq, tool__in=KEYED).values_list(
                    "call_index", flat=True
                )
            )
        fork = durable_agents.fork_run(parent.pk, at_seq, edit=edit)
        return Fork(
            fork.pk,
            parent.pk,
            at_seq,
            recipe,
            parent.status not in ENDED_STATUSES,
            edit,
            recorded,
        )

    def _active(self) -> Fork | None:
        parent = self._pick(self.all_ids(), last_seq__gte=1, status__in=AT_WORK)
        if parent is None:
            return None
        return self._fork(parent, self.rng.randint(1, parent.last_seq), "active")

    def _edit(self) -> Fork | None:
        parent = self._pick(self.all_ids(), last_seq__gte=2)
        if parent is None:
            return None
        results = list(
            steps_of(parent.pk).filter(kind=StepKind.TOOL_RESULT, seq__lte=parent.last_seq)
        )
        step = self.rng.choice(results)
        edit = [
            {**block, "content": f"edited by the test ({len(self.forks)}, {index})"}
            for index, block in enumerate(json.loads(step.payload))
        ]
        return self._fork(parent, step.seq, "edit", edit)

    def _fork_of_fork(self) -> Fork | None:
        parent = self._pick([f.run_id for f in self.forks], last_seq__gte=1)
        if parent is None:
            return None
        return self._fork(parent, self.rng.randint(1, parent.last_seq), "fork-of-fork")

    def _finished_turn(self) -> Fork | None:
        parent = self._pick(self.roots, status=RunStatus.SUCCEEDED, last_seq__gt=TWO_CHARGES_TURN)
        if parent is None:
            return None
        return self._fork(parent, TWO_CHARGES_TURN, "finished-turn")

    def _task(self) -> Fork | None:
        parent = self._pick(self.roots, status=RunStatus.SUCCEEDED)
        if parent is None:
            return None
        return self._fork(parent, 0, "task", EDITED_TASK)


def test_forks_made_while_workers_are_sigkilled(
    receiver: Receiver, fake_api: FakeAnthropic, spawn_worker: Any
) -> None:
    roots = [durable_agents.start_run("thinker", root_task(i)) for i in range(ROOTS)]
    chaos = Chaos(roots)
    kills = make_chaos(chaos, receiver, fake_api, spawn_worker)

    forks = {f.run_id: f for f in chaos.forks}
    ids = chaos.all_ids()
    runs = {r.pk: r for r in AgentRun.objects.filter(pk__in=ids)}
    # The scenario happened as meant: kills landed mid-run, every kind of fork was made, and
    # some forks were of runs still at work, some at a turn whose calls were recorded.
    assert len(kills) >= MIN_KILLS
    assert any(r.attempt > 1 for r in runs.values()), "no run was taken over after a kill"
    assert Counter(f.recipe for f in chaos.forks) == Counter(RECIPES)
    assert any(f.parent_was_active for f in chaos.forks)
    assert any(f.recorded_before for f in chaos.forks)
    assert any(f.parent_id in forks for f in chaos.forks)

    # Every run and fork succeeded, and no intent is left open.
    assert {r.status for r in runs.values()} == {RunStatus.SUCCEEDED}, {
        r.pk: (r.status, r.error) for r in runs.values() if r.status != RunStatus.SUCCEEDED
    }
    assert not ToolIntent.objects.exclude(status=IntentStatus.DONE).exists()

    logs = {run_id: log_of(run_id) for run_id in ids}
    check_logs(runs, logs, chaos.forks)
    check_calls(logs, forks, receiver)

    # Every request answered carried a history the offline model accepted.
    assert fake_api.requests
    # (A worker SIGKILLed while it sent a request leaves the server a body cut short, which
    # the fake API, reading to the end of the connection, refuses to nobody: not a history.)
    whole = [r for r in fake_api.requests if len(r.body) == int(r.headers["content-length"])]
    refused = [r for r in whole if r.status != 200]
    assert not refused, [_refusal(fake_api, r) for r in refused]
    assert len(fake_api.requests) - len(whole) <= len(kills)


def make_chaos(
    chaos: Chaos, receiver: Receiver, fake_api: FakeAnthropic, spawn_worker: Any
) -> list[str]:
    """Work the runs with workers SIGKILLed and replaced, fork them, approve their irreversible
    calls, until every fork is made and every run has ended; the names of the killed workers."""
    env = {
        "ANTHROPIC_BASE_URL": fake_api.base_url,
        "ANTHROPIC_API_KEY": "sk-test",
        "DA_POLL_INTERVAL": "0.05",
        # A charge sleeps after its delivery: a kill can land between the effect and its step.
        "DA_CHARGE_DELAY": "0.1",
    }
    workers: dict[str, WorkerProcess] = {}

    def spawn() -> None:
        name = f"w{len(kills) + len(workers) + 1}"
        workers[name] = spawn_worker(
            "--concurrency", "2", "--lease-seconds", LEASE, "--worker-id", name, env=env
        )

    kills: list[str] = []
    for _ in range(WORKERS):
        spawn()
    user = approver("chaos-approver")
    rng = random.Random(SEED + 1)
    next_kill = time.monotonic() + KILL_EVERY
    deadline = time.monotonic() + 100

    def everything_ended() -> bool:
        ids = chaos.all_ids()
        ended = AgentRun.objects.filter(pk__in=ids, status__in=ENDED_STATUSES).count()
        return not chaos.recipes and ended == len(ids)

    while not everything_ended():
        assert time.monotonic() < deadline, (
            chaos.recipes,
            Counter(
                AgentRun.objects.filter(pk__in=chaos.all_ids()).values_list("status", flat=True)
            ),
        )
        settle_intents(user, receiver)
        chaos.step()
        if time.monotonic() >= next_kill and (
            len(kills) < MIN_KILLS or (chaos.recipes and len(kills) < MAX_KILLS)
        ):
            # A worker holding a lease when there is one: its runs are cut mid-way.
            holders = {
                owner
                for owner in AgentRun.objects.filter(status=RunStatus.RUNNING).values_list(
                    "lease_owner", flat=True
                )
                if owner in workers
            }
            victim = rng.choice(sorted(holders) or sorted(workers))
            assert workers.pop(victim).kill() == SIGKILLED
            kills.append(victim)
            spawn()
            next_kill = time.monotonic() + KILL_EVERY
        time.sleep(0.05)
    for worker in workers.values():
        worker.terminate()
    for worker in workers.values():
        assert worker.wait(30) == 0, worker.output()
    return kills


def check_logs(
    runs: dict[Any, AgentRun], logs: dict[Any, list[AgentStep]], forks: list[Fork]
) -> None:
    """Every log is seqs 0..last_seq once each and ends with a final answer; a fork's steps
    before its fork point are its parent's bytes, and an edited step is the edit."""
    for run_id, log in logs.items():
        # No gap, no duplicate (own rows and shared stretches).
        assert [s.seq for s in log] == list(range(runs[run_id].last_seq + 1)), run_id
        assert log[-1].kind == StepKind.MODEL_TURN
        assert not calls_of(log[-1])
    for fork in forks:
        log, parent_log = logs[fork.run_id], logs[fork.parent_id]
        cut = fork.at_seq if fork.edit is not None else fork.at_seq + 1
        assert runs[fork.run_id].fork_seq == fork.at_seq
        assert [_bytes(s) for s in log[:cut]] == [_bytes(s) for s in parent_log[:cut]], fork
        # Shared, not copied: those rows are the runs' it descends from.
        assert all(s.run_id != fork.run_id for s in log[:cut]), fork
        if fork.edit is not None:
            # The task as a JSON string, or the batch of tool_result blocks.
            assert json.loads(log[fork.at_seq].payload) == fork.edit
            assert log[fork.at_seq].run_id == fork.run_id  # the fork's own row


def check_calls(
    logs: dict[Any, list[AgentStep]], forks: dict[Any, Fork], receiver: Receiver
) -> None:
    """The keyed calls of every log: before a fork point, the parent's (the fork made none of
    them); at a fork-point turn, taken from the parent where it had recorded them; the rest
    the run's own, made under its own key, applied once at the receiver, in the ledger, and
    what the model was told."""
    attempted = Counter(a["key"] for a in receiver.attempts())
    applied = Counter(a["key"] for a in receiver.applied())
    ledger = {
        (e.run_id, e.seq, e.call_index): e
        for e in ToolEffect.objects.filter(run_id__in=list(logs), tool__in=KEYED)
    }
    own_keys: set[str] = set()
    # The input of each key the runs made calls under themselves: a fork's call of its
    # fork-point turn that its parent did not record carries the parent's key, so the two
    # calls are one at the receiver.
    own_inputs: dict[str, str] = {}
    own_calls = 0
    inherited = 0
    key_runs = dict(AgentRun.objects.filter(pk__in=list(logs)).values_list("pk", "fork_key_run_id"))
    for run_id, log in logs.items():
        fork = forks.get(run_id)
        fork_seq = -1 if fork is None else fork.at_seq
        for step in log:
            if step.kind != StepKind.MODEL_TURN:
                continue
            for index, call in enumerate(calls_of(step)):
                if call["name"] not in KEYED:
                    continue
                key = effects.idempotency_key(run_id, step.seq, index, call["name"], call["input"])
                if step.seq < fork_seq:
                    assert key not in attempted, (fork, step.seq, index)
                    assert (run_id, step.seq, index) not in ledger
                    continue
                effect = ledger.get((run_id, step.seq, index))
                assert effect is not None, ("no ledger row of the run's call", run_id, step.seq)
                # The ledger knows the call by the run's own key, never its parent's.
                assert (effect.key, effect.tool) == (key, call["name"])
                # The key the tool got: the run's own, but at a fork's fork-point turn the
                # parent's (the parent may have made the call without recording it).
                sent = key
                key_run = key_runs.get(run_id)
                if step.seq == fork_seq and key_run is not None:
                    sent = effects.idempotency_key(
                        key_run, step.seq, index, call["name"], call["input"]
                    )
                parents = (
                    None
                    if fork is None
                    else ledger.get((caller_in(forks, fork.parent_id, step.seq), step.seq, index))
                )
                if (
                    fork is not None
                    and step.seq == fork_seq
                    and parents is not None
                    and effect.result == parents.result
                ):
                    # Taken from the parent, whose recorded result the fork read (a call the
                    # fork made too would read "duplicate" on one side).
                    assert key not in attempted
                    inherited += 1
                else:
                    made_again = fork is not None and (step.seq, index) in {
                        (fork_seq, i) for i in fork.recorded_before
                    }
                    assert not made_again, ("a recorded call was made again", fork, index)
                    own_keys.add(sent)
                    own_inputs[sent] = _canonical(call["input"])
                    own_calls += 1
                    if call["name"] == "charge":
                        assert json.loads(effect.result)["key"] == sent
                # What the model was told is the ledger's result (the step after the turn is
                # the run's own: an edit is at or before the fork point).
                if step.seq + 1 < len(log) and step.seq + 1 > fork_seq:
                    [result] = [
                        b
                        for b in json.loads(log[step.seq + 1].payload)
                        if b["tool_use_id"] == call["id"]
                    ]
                    assert result["content"] == effect.result
    assert inherited >= sum(len(f.recorded_before) for f in forks.values()) > 0

    # Effects once: the receiver saw exactly the calls the runs made themselves, each applied
    # once under its own key; the ledger holds those and the inherited ones, nothing else.
    assert set(attempted) == own_keys
    assert set(applied) == own_keys
    assert set(applied.values()) == {1}
    assert len(ledger) == own_calls + inherited
    # Counted by what was charged or dropped: each input reached the receiver as many times as
    # keys it was made under (the parent's calls before a fork point, and the ones a fork
    # inherited or made under its parent's key, once for the whole line).
    assert Counter(_canonical(a["payload"]) for a in receiver.applied()) == Counter(
        own_inputs.values()
    )


def caller_in(forks: dict[Any, Fork], run_id: Any, seq: int) -> Any:
    """The run of the line that made the calls of model turn ``seq`` of ``run_id``'s log: the
    run itself, or, while the turn predates its fork point, the run it was forked from."""
    while run_id in forks and seq < forks[run_id].at_seq:
        run_id = forks[run_id].parent_id
    return run_id


def _refusal(fake_api: FakeAnthropic, request: Recorded) -> tuple[int, str, str]:
    """A refused request: its status, the offline model's reason (asked again: the answer
    depends on the body alone) and the body."""
    status, _, answer = fake_api.model.respond(
        "POST", "/v1/messages", request.headers, request.body
    )
    return status, answer.decode(errors="replace"), request.body.decode(errors="replace")


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def _bytes(step: AgentStep) -> tuple[Any, ...]:
    return (step.seq, step.kind, step.payload, step.content_start, step.content_end)
