"""A rolling deploy in CI: runs of version 1 in flight while the three workers of code A are
replaced, one at a time, by workers of code B (version 2 only, ``upgrades_from=["1"]``), one
of them killed midway. Once no worker of code A is live, code B's workers carry the runs they
can over to version 2 (durable_agents/housekeeping/serving.py, ``upgrade_runs``); those whose
signed thinking binds version 1's system prompt are refused and wait until a worker of code A
comes back for them.

The two codes are tests/testapp/rollout_agents.py under DA_ROLLOUT_CODE=A or B; the test
process defines both versions and starts the runs. Every worker is a real ``manage.py
runagents`` subprocess talking to the fake Messages API (tests/fakeserver.py) over HTTP, which
signs thinking blocks and answers 400 to a history whose signed thinking comes back with
another system prompt than it was signed with (durable_agents/offline/signatures.py).

Where the runs are when each worker stops is set by gates in the fake API, not by timing: a
request of a version-1 run carrying as many assistant turns as a closed gate's waits until the
test opens it. Every run of version 1 reaches the first gate before the deploy starts (so each
thinking run holds signed thinking bound to version 1's system prompt); the second charge of
each charging run waits for the crash, which then kills a worker of code A while a charge it
delivered is not recorded yet; every run of version 1 waits before its last two turns until no
worker of code A is live.
"""

from __future__ import annotations

import json
import threading
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import pytest

import durable_agents
from durable_agents.engine import effects
from durable_agents.models import (
    AgentRun,
    AgentStep,
    AgentWorker,
    RunStatus,
    StepKind,
    ToolEffect,
)
from tests.conftest import Receiver, WorkerProcess, own_steps, wait_for
from tests.fakeserver import FakeAnthropic
from tests.testapp.rollout_agents import CODE_ENV, SYSTEM, THINKING_SYSTEM

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True),
]

Spawn = Callable[..., WorkerProcess]

LEASE = "2"  # seconds: a killed worker's runs and row are free again this soon
GRACE = "1"  # seconds a draining worker gives its steps in flight (a held call is abandoned)
CONCURRENCY = "7"  # all three workers of code A are needed to hold every run of version 1
LATENCY = 0.1  # seconds before each answer of the fake API
CHARGE_DELAY = "1.5"  # seconds a charge takes after its effect was delivered, on a0 to a2
BOUND = 45.0  # seconds any one condition may take before the test fails
# Seconds between two claims of an idle worker (LISTEN wakes it sooner): seven processes on two
# cores, most of them idle most of the time, and the test's own waits, which poll the database.
POLL = "0.25"
WAIT = 0.05

# The runs of version 1: (kind, agent, how many). Thinking runs cannot be upgraded.
MIX = [
    ("plain", "deploying", 6),
    ("charge", "deploying", 6),
    ("thinking", "deploying_thinking", 4),
    ("thinking-charge", "deploying_thinking", 4),
]
CHARGING = {"charge", "thinking-charge"}
THINKING = {"thinking", "thinking-charge"}

# The gates, by the number of assistant turns of the requests they hold: FIRST holds every run
# of version 1 until the deploy starts; CHARGE, a charging run's request whose answer is its
# second charge, until the crash; LAST, every run of version 1 before its last two turns until
# no worker of code A is live.
FIRST, CHARGE, LAST = 2, 3, 4

IN_FLIGHT = (RunStatus.PENDING, RunStatus.RUNNING, RunStatus.WAITING)
ENDED = (RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED, RunStatus.DEAD)


@dataclass
class Run:
    tag: str  # the first line of its task, in brackets: how the fake API knows the run
    kind: str
    run: AgentRun


def plan(tag: str, kind: str) -> str:
    """Five tool turns, then the final one; a charging run charges at turns 1 and 3."""
    number = int(tag.split()[-1])
    lines = [f"[{tag}]", f"@@latency {LATENCY}"]
    for turn in range(5):
        if kind in CHARGING and turn in (1, 3):
            cents = 100 * turn + number
            lines.append(f'@charge {{"customer": "cus_{number}", "cents": {cents}}}')
        else:
            lines.append(f'@lookup {{"key": "{tag}:{turn}"}}')
    return "\n".join(lines)


def tag_of(body: dict[str, Any]) -> str | None:
    """The run a request is for: the ``[tag]`` first line of its task."""
    content = body["messages"][0]["content"]
    if isinstance(content, list):
        content = "".join(b.get("text", "") for b in content if isinstance(b, dict))
    first = str(content).split("\n", 1)[0]
    return first[1:-1] if first.startswith("[") and first.endswith("]") else None


def turn_of(body: dict[str, Any]) -> int:
    return sum(1 for m in body["messages"] if m["role"] == "assistant")


class Gates:
    """A ``before_answer`` hook: a request of one of a gate's tags that carries the gate's
    number of assistant turns waits while that gate is closed (bounded: a failing test must
    not hang the server's threads). ``arrived(turn)``: the tags that came to it closed."""

    def __init__(self, gates: dict[int, Iterable[str]]) -> None:
        self._tags = {turn: set(tags) for turn, tags in gates.items()}
        self._open = {turn: threading.Event() for turn in gates}
        self._arrived: dict[int, set[str]] = defaultdict(set)
        self._lock = threading.Lock()

    def __call__(self, body: dict[str, Any]) -> None:
        tag, turn = tag_of(body), turn_of(body)
        gate = self._open.get(turn)
        if gate is None or tag not in self._tags[turn] or gate.is_set():
            return
        with self._lock:
            self._arrived[turn].add(tag)
        gate.wait(2 * BOUND)

    def arrived(self, turn: int) -> set[str]:
        with self._lock:
            return set(self._arrived[turn])

    def open(self, turn: int) -> None:
        self._open[turn].set()

    def open_all(self) -> None:
        for gate in self._open.values():
            gate.set()


@dataclass
class Deploy:
    """The runs and the workers of one rolling deploy, and what happened to them."""

    runs: list[Run]  # of version 1
    new_runs: list[Run] = field(default_factory=list)  # started on version 2 by the new code
    a: dict[str, WorkerProcess] = field(default_factory=dict)  # worker id -> process, code A
    b: dict[str, WorkerProcess] = field(default_factory=dict)  # code B
    victim: str = ""  # the worker of code A killed with a charge in flight
    killed_key: str = ""  # the key of that charge

    def all_runs(self) -> list[Run]:
        return [*self.runs, *self.new_runs]

    def ids(self, kinds: Iterable[str] | None = None) -> list[Any]:
        wanted = None if kinds is None else set(kinds)
        return [r.run.pk for r in self.runs if wanted is None or r.kind in wanted]


def finish(worker: WorkerProcess) -> None:
    rc = worker.wait(BOUND)
    assert rc == 0, worker.output()


def live(worker_id: str) -> bool:
    return AgentWorker.objects.live().filter(pk=worker_id).exists()


def started_up(worker_id: str) -> None:
    wait_for(lambda: live(worker_id), BOUND, WAIT, what=f"worker {worker_id}'s row")


def charge_in_flight(receiver: Receiver, workers: dict[int, str]) -> tuple[str, str] | None:
    """(worker id, key) of a charge delivered by one of ``workers`` (pid -> worker id) whose
    result is not recorded yet: the call is in flight there."""
    attempts = [a for a in receiver.attempts("charge") if a["pid"] in workers]
    if not attempts:
        return None
    keys = [a["key"] for a in attempts]
    recorded = set(ToolEffect.objects.filter(key__in=keys).values_list("key", flat=True))
    for attempt in attempts:
        if attempt["key"] not in recorded:
            return workers[attempt["pid"]], attempt["key"]
    return None


def blocks(step: AgentStep) -> list[dict[str, Any]]:
    """The content blocks of a model turn, as the provider sent them."""
    content: list[dict[str, Any]] = json.loads(step.payload)["content"]
    return content


def charges_of(run_id: Any) -> dict[str, dict[str, Any]]:
    """The key and input of every charge the run's committed model turns asked for."""
    calls: dict[str, dict[str, Any]] = {}
    for step in own_steps(run_id):
        if step.kind != StepKind.MODEL_TURN:
            continue
        uses = [b for b in blocks(step) if b["type"] == "tool_use"]
        for index, use in enumerate(uses):
            if use["name"] == "charge":
                key = effects.idempotency_key(run_id, step.seq, index, "charge", use["input"])
                calls[key] = use["input"]
    return calls


def test_a_rolling_deploy_with_a_crash_finishes_every_run_once(
    spawn_worker: Spawn, fake_api: FakeAnthropic, receiver: Receiver
) -> None:
    runs: list[Run] = []
    for kind, agent, count in MIX:
        for _ in range(count):
            tag = f"v1 {kind} {len(runs)}"
            runs.append(
                Run(tag, kind, durable_agents.start_run(agent, plan(tag, kind), version="1"))
            )
    deploy = Deploy(runs)
    v1 = {r.tag for r in runs}
    gates = Gates({FIRST: v1, CHARGE: {r.tag for r in runs if r.kind in CHARGING}, LAST: v1})
    fake_api.before_answer = gates
    try:
        roll_out(deploy, gates, spawn_worker, fake_api, receiver)
    finally:
        gates.open_all()

    check_runs(deploy)
    check_requests(deploy, fake_api)
    check_charges(deploy, receiver)
    # The worker rows: every worker stopped cleanly took its row with it; the killed one's
    # stays (gone) until housekeeping removes it.
    ids = [*deploy.a, *deploy.b]
    assert list(AgentWorker.objects.filter(pk__in=ids).values_list("pk", flat=True)) == [
        deploy.victim
    ]
    assert not live(deploy.victim)


def roll_out(
    deploy: Deploy, gates: Gates, spawn_worker: Spawn, fake_api: FakeAnthropic, receiver: Receiver
) -> None:
    env = {
        "ANTHROPIC_BASE_URL": fake_api.base_url,
        "ANTHROPIC_API_KEY": "sk-test",
        "DA_DB_POOL_SIZE": "4",  # seven workers on a shared server
    }

    def spawn(worker_id: str, code: str) -> WorkerProcess:
        code_env = {**env, CODE_ENV: code}
        if worker_id in ("a0", "a1", "a2"):  # the ones stopped or killed mid-flight
            code_env["DA_CHARGE_DELAY"] = CHARGE_DELAY
        worker = spawn_worker(
            *("--worker-id", worker_id, "--concurrency", CONCURRENCY, "--no-schedules"),
            *("--lease-seconds", LEASE, "--grace-seconds", GRACE, "--poll-interval", POLL),
            env=code_env,
        )
        (deploy.a if code == "A" else deploy.b)[worker_id] = worker
        return worker

    # -- code A takes every run of version 1 to the first gate -------------------------------
    for worker_id in ("a0", "a1", "a2"):
        spawn(worker_id, "A")
    v1 = {r.tag for r in deploy.runs}
    wait_for(lambda: gates.arrived(FIRST) == v1, timeout=BOUND, what="every run at gate FIRST")
    for r in deploy.runs:
        if r.kind in THINKING:  # what binds them to version 1's system prompt
            turns = AgentStep.objects.filter(run_id=r.run.pk, kind=StepKind.MODEL_TURN)
            assert [blocks(s)[0]["type"] for s in turns] == ["thinking"] * FIRST, r.tag
    gates.open(FIRST)

    # -- a0 drains, b0 comes -----------------------------------------------------------------
    deploy.a["a0"].terminate()
    spawn("b0", "B")
    finish(deploy.a["a0"])
    assert not AgentWorker.objects.filter(pk="a0").exists()  # a clean stop: its row went
    started_up("b0")
    # The new code's own runs: started on version 2, for code B alone.
    for tag in ("v2 new 20", "v2 new 21"):
        run = durable_agents.start_run("deploying", plan(tag, "charge"), version="2")
        deploy.new_runs.append(Run(tag, "new", run))

    # -- a crash midway: the worker of code A with a charge in flight is killed --------------
    pids = {deploy.a[w].pid: w for w in ("a1", "a2")}
    wait_for(
        lambda: AgentRun.objects.filter(
            pk__in=deploy.ids(CHARGING), status=RunStatus.RUNNING, lease_owner__in=pids.values()
        ).exists(),
        timeout=BOUND,
        interval=WAIT,
        what="a charging run held by a1 or a2",
    )
    gates.open(CHARGE)
    deploy.victim, deploy.killed_key = wait_for(
        lambda: charge_in_flight(receiver, pids), timeout=BOUND, what="a charge in flight"
    )
    assert deploy.a[deploy.victim].kill() == -9
    spawn("b1", "B")  # in the killed worker's place

    # -- meanwhile the deploy goes on: the last worker of code A drains, b2 comes ------------
    survivor = "a2" if deploy.victim == "a1" else "a1"
    deploy.a[survivor].terminate()
    spawn("b2", "B")
    finish(deploy.a[survivor])
    assert not AgentWorker.objects.filter(pk=survivor).exists()
    for worker_id in ("b1", "b2"):
        started_up(worker_id)
    # The killed worker's row stays: live until a lease after its last beat.
    wait_for(lambda: not live(deploy.victim), BOUND, WAIT, what="the killed worker's row")
    assert AgentWorker.objects.filter(pk=deploy.victim).exists()
    # No worker of code A is live, and every run of version 1 is in flight.
    assert not AgentRun.objects.filter(pk__in=deploy.ids(), status__in=ENDED).exists()
    gates.open(LAST)

    # -- code B carries over what it can: every run without thinking ------------------------
    wait_for(
        lambda: (
            not AgentRun.objects.filter(
                pk__in=deploy.ids({"plain", "charge"}), prompt_version="1"
            ).exists()
        ),
        timeout=BOUND,
        interval=WAIT,
        what="code B's workers to upgrade every run of version 1 without thinking",
    )

    # -- code A comes back for the rest ------------------------------------------------------
    spawn("a3", "A")
    every = [r.run.pk for r in deploy.all_runs()]
    wait_for(
        lambda: not AgentRun.objects.filter(pk__in=every, status__in=IN_FLIGHT).exists(),
        timeout=BOUND,
        interval=WAIT,
        what="every run to end",
    )
    serving = [deploy.b["b0"], deploy.b["b1"], deploy.b["b2"], deploy.a["a3"]]
    for worker in serving:
        worker.terminate()
    for worker in serving:
        finish(worker)


def check_runs(deploy: Deploy) -> None:
    """Every run succeeded (none dead, none failed, no error left); each run of version 1 was
    upgraded to 2 or finished on 1, thinking runs on 1; who wrote each run's turns."""
    for r in deploy.all_runs():
        r.run.refresh_from_db()
    ended = {r.tag: (r.run.status, r.run.error) for r in deploy.all_runs()}
    assert ended == dict.fromkeys(ended, (RunStatus.SUCCEEDED, "")), ended
    writers = {
        r.tag: set(
            AgentStep.objects.filter(run_id=r.run.pk, kind=StepKind.MODEL_TURN).values_list(
                "worker", flat=True
            )
        )
        for r in deploy.all_runs()
    }
    upgraded = {r.tag for r in deploy.runs if r.run.prompt_version == "2"}
    for r in deploy.runs:
        if r.tag in upgraded:  # finished by code B
            last = AgentStep.objects.filter(run_id=r.run.pk).order_by("-seq").first()
            assert last is not None
            assert last.worker in deploy.b, (r.tag, last.worker)
        else:
            assert r.run.prompt_version == "1", r.tag
            assert writers[r.tag] <= set(deploy.a), (r.tag, writers[r.tag])  # code A alone
    # Their signed thinking binds version 1's prompt: never moved.
    assert not upgraded & {r.tag for r in deploy.runs if r.kind in THINKING}
    # Every run without thinking was in flight, with no worker of code A live, when code B's
    # workers carried runs over: each moved.
    assert upgraded == {r.tag for r in deploy.runs if r.kind not in THINKING}
    for r in deploy.new_runs:
        assert r.run.prompt_version == "2", r.tag
        assert writers[r.tag] <= set(deploy.b), (r.tag, writers[r.tag])  # code B alone


def check_requests(deploy: Deploy, fake_api: FakeAnthropic) -> None:
    """The fake API refused nothing (signed thinking sent back under another system prompt
    is a 400), and every request carried the system prompt of the run's version then: version
    1's, then, once upgraded, version 2's for good."""
    refused = [(r.status, r.body[:300]) for r in fake_api.requests if r.status != 200]
    assert not refused, refused
    sent: dict[str, list[tuple[int, str]]] = defaultdict(list)
    for request in fake_api.requests:
        body = request.json()
        tag = tag_of(body)
        assert tag is not None, body["messages"][0]
        sent[tag].append((turn_of(body), body["system"]))
    for r in deploy.all_runs():
        prompts = THINKING_SYSTEM if r.kind in THINKING else SYSTEM
        if r.run.prompt_version == "1" or r.kind == "new":  # one version all along
            version = r.run.prompt_version
            assert {s for _, s in sent[r.tag]} == {prompts[version]}, (r.tag, sent[r.tag])
            continue
        assert {s for _, s in sent[r.tag]} <= {prompts["1"], prompts["2"]}, (r.tag, sent[r.tag])
        last_v1 = max((t for t, s in sent[r.tag] if s == prompts["1"]), default=-1)
        first_v2 = min(t for t, s in sent[r.tag] if s == prompts["2"])
        assert last_v1 <= first_v2, (r.tag, sent[r.tag])  # never back to version 1


def check_charges(deploy: Deploy, receiver: Receiver) -> None:
    """Every charge the runs asked for was delivered under the key of its call position,
    applied once, and recorded; the one the crash cut was delivered again under its key."""
    expected: dict[str, dict[str, Any]] = {}
    for r in deploy.all_runs():
        expected.update(charges_of(r.run.pk))
    charging = sum(1 for r in deploy.all_runs() if r.kind in CHARGING | {"new"})
    assert len(expected) == 2 * charging, expected
    attempts = receiver.attempts("charge")
    assert {a["key"] for a in attempts} == set(expected)
    assert all(a["payload"] == expected[a["key"]] for a in attempts)
    applied = Counter(a["key"] for a in receiver.applied("charge"))
    assert applied == dict.fromkeys(expected, 1)
    recorded = dict(ToolEffect.objects.filter(key__in=list(expected)).values_list("key", "tool"))
    assert recorded == dict.fromkeys(expected, "charge")
    killed = [a["pid"] for a in attempts if a["key"] == deploy.killed_key]
    assert killed[0] == deploy.a[deploy.victim].pid, killed
    assert len(killed) >= 2, killed
