"""Crash recovery with real worker processes: contention, SIGKILL at chosen points, intents
across a crash, the dead letter, and a graceful SIGTERM.

Every test here runs ``manage.py runagents`` as subprocesses against the test database, so
all data a worker must see is committed (``transaction=True``). Workers get short leases so a
killed worker's run becomes claimable again within ~2 s.

The tests marked with ``ROUTES`` run twice: their worker subprocesses connect to PostgreSQL
``direct``, then through a private PgBouncer in transaction pooling mode (``pgbouncer``; see
tests/pgbouncer.py). The test process itself always connects directly.
"""

from __future__ import annotations

import json
import threading
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.db import connection

import durable_agents
from durable_agents.engine import effects
from durable_agents.models import (
    AgentRun,
    AgentStep,
    IntentStatus,
    RunStatus,
    StepKind,
    ToolEffect,
    ToolIntent,
)
from tests.conftest import (
    Receiver,
    WorkerProcess,
    approver,
    database_url,
    own_steps,
    run_worker,
    wait_for,
)
from tests.fakeserver import FakeAnthropic, Recorded
from tests.pgbouncer import PgBouncer, running_pgbouncer

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True),
]

Spawn = Callable[..., WorkerProcess]
SIGKILLED = -9
LEASE = "2"  # seconds: how long a killed worker's run stays unclaimable


# --------------------------------------------------------------------------- routes

# Runs a test with its worker subprocesses connected directly, then through PgBouncer.
ROUTES = pytest.mark.parametrize("route", ["direct", "pgbouncer"], indirect=True)


@pytest.fixture(scope="module")
def pgbouncer() -> Iterator[PgBouncer]:
    """A private PgBouncer (transaction pooling) in front of the test database's server.

    Module-scoped, so it is stopped, and its server connections closed, before pytest-django
    drops the test database at the end of the session. Skips the ``pgbouncer`` variants when
    the binary is missing (fails them with DA_REQUIRE_PGBOUNCER=1).
    """
    s = connection.settings_dict
    with running_pgbouncer(s.get("HOST") or "127.0.0.1", int(s.get("PORT") or 5432)) as bouncer:
        yield bouncer


@pytest.fixture
def route(request: pytest.FixtureRequest) -> str:
    """How worker subprocesses reach the database: ``direct`` unless a test says ``ROUTES``."""
    return getattr(request, "param", "direct")


@pytest.fixture
def spawn_worker(
    spawn_worker: Spawn, route: str, request: pytest.FixtureRequest
) -> Iterator[Spawn]:
    """conftest's ``spawn_worker``, with DATABASE_URL pointed at PgBouncer on that route.

    On the ``pgbouncer`` route the test also fails unless the workers' transactions really
    went through PgBouncer (its own count of transactions for the test database grew).
    """
    if route == "direct":
        yield spawn_worker
        return
    bouncer: PgBouncer = request.getfixturevalue("pgbouncer")
    s = connection.settings_dict
    dbname = s["NAME"]
    before = bouncer.transactions(dbname)
    # LISTEN cannot go through transaction pooling: the worker's one listener connection goes
    # around PgBouncer, as docs/howto/database.md advises (read by tests/settings.py, if it does).
    listen = {"HOST": s.get("HOST") or "127.0.0.1", "PORT": int(s.get("PORT") or 5432)}
    routed = {"DATABASE_URL": bouncer.url(database_url()), "DA_LISTEN": json.dumps(listen)}

    def spawn(*args: str, env: dict[str, str] | None = None) -> WorkerProcess:
        return spawn_worker(*args, env={**routed, **(env or {})})

    yield spawn
    assert bouncer.transactions(dbname) > before, "no worker transaction went through PgBouncer"


# --------------------------------------------------------------------------- helpers


def assert_contiguous(steps: list[AgentStep]) -> None:
    assert [s.seq for s in steps] == list(range(len(steps)))


def claimable(run_id: Any) -> bool:
    return AgentRun.objects.claimable().filter(pk=run_id).exists()


def canonical(body: bytes | dict[str, Any]) -> str:
    """A request body as compact JSON in its own key order: equal iff the same values in the
    same order (what a thinking signature binds); insensitive only to whitespace."""
    value = json.loads(body) if isinstance(body, bytes) else body
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def api_env(fake_api: FakeAnthropic) -> dict[str, str]:
    return {"ANTHROPIC_BASE_URL": fake_api.base_url, "ANTHROPIC_API_KEY": "sk-test"}


def finish(worker: WorkerProcess, timeout: float = 60) -> None:
    rc = worker.wait(timeout)
    assert rc == 0, worker.output()


class HoldTurn:
    """A ``before_answer`` hook that holds the first request carrying ``turn`` assistant
    turns until released, so the test knows exactly where the worker is when it kills it."""

    def __init__(self, turn: int) -> None:
        self.turn = turn
        self.arrived = threading.Event()
        self.release = threading.Event()
        self.held_body: str | None = None
        self._lock = threading.Lock()

    def __call__(self, body: dict[str, Any]) -> None:
        turn = sum(1 for m in body["messages"] if m["role"] == "assistant")
        with self._lock:
            if turn != self.turn or self.held_body is not None:
                return
            self.held_body = canonical(body)
        self.arrived.set()
        self.release.wait(60)  # bounded: a failing test must not hang the server thread

    def let_go(self, fake_api: FakeAnthropic) -> None:
        """Answer the held request (to a dead socket) and wait until it is recorded."""
        count = len(fake_api.requests)
        self.release.set()
        wait_for(lambda: len(fake_api.requests) > count, timeout=10)


def assert_resent_bodies_identical(requests: list[Recorded]) -> None:
    """Every 200 request that carried k assistant turns is the same body, for every k."""
    by_turn: dict[int, set[str]] = defaultdict(set)
    for r in requests:
        by_turn[r.turn].add(canonical(r.body))
    different = {k: len(v) for k, v in by_turn.items() if len(v) != 1}
    assert not different, f"turns sent with differing bodies: {different}"


# --------------------------------------------------------------------------- 1. contention


@ROUTES
def test_many_workers_advance_200_runs_each_exactly_once(spawn_worker: Spawn) -> None:
    runs = [
        durable_agents.start_run(
            "tester", f'run {i}\n@lookup {{"key": "a{i}"}}\n@lookup {{"key": "b{i}"}}'
        )
        for i in range(200)
    ]
    # A lease far longer than the test: no claim can expire, so any second claim of a run
    # would be a SKIP LOCKED bug, not a legitimate takeover.
    workers = [
        spawn_worker(
            "--burst",
            "--lease-seconds",
            "60",
            "--worker-id",
            f"w{i}",
            *(("--concurrency", "2") if i % 2 else ()),
        )
        for i in range(4)
    ]
    for worker in workers:
        finish(worker, timeout=90)

    ids = [r.pk for r in runs]
    by_run = {r.pk: r for r in AgentRun.objects.filter(pk__in=ids)}
    assert Counter(r.status for r in by_run.values()) == {RunStatus.SUCCEEDED: 200}
    assert {r.attempt for r in by_run.values()} == {1}
    assert {r.result for r in by_run.values()} == {"Done. 2 planned turns completed."}

    steps: dict[Any, list[AgentStep]] = defaultdict(list)
    for step in AgentStep.objects.filter(run_id__in=ids).order_by("run_id", "seq"):
        steps[step.run_id].append(step)
    advanced_by: Counter[str] = Counter()
    for run_id in ids:
        log = steps[run_id]
        # task, turn, results, turn, results, final turn
        assert [s.seq for s in log] == list(range(6)), run_id
        assert by_run[run_id].last_seq == 5
        writers = {(s.worker, s.attempt) for s in log[1:]}
        assert len(writers) == 1, (run_id, writers)
        worker_id, attempt = writers.pop()
        assert attempt == 1
        advanced_by[worker_id] += 1
    # The runs really were shared out: otherwise nothing above tested contention.
    assert len(advanced_by) >= 2, advanced_by
    assert set(advanced_by) <= {"w0", "w1", "w2", "w3"}


# --------------------------------------------------------------------------- 3. SIGKILL mid-run

# 6 planned turns: seq 1,3,5,7,9,11 are turns asking for tools, 2,4,...,12 their results, seq
# 13 the final turn. Charges 1 and 4 have the same arguments at different positions, so they
# must get different keys and both be applied.
KILL_PLAN = """crash between steps 3 and 4
@lookup {"key": "a"}
@lookup {"key": "b"} && charge {"customer": "c1", "cents": 100}
@charge {"customer": "c2", "cents": 250}
@lookup {"key": "c"} && charge {"customer": "c3", "cents": 300}
@charge {"customer": "c1", "cents": 100}
@lookup {"key": "d"}"""
KILL_PLAN_CHARGES = 4
KILL_PLAN_LAST_SEQ = 13


@ROUTES
@pytest.mark.parametrize("point", ["model-call", "tool-call"])
def test_sigkill_between_steps_resumes_byte_identically(
    point: str, receiver: Receiver, fake_api: FakeAnthropic, spawn_worker: Spawn
) -> None:
    """Two clean kill points around "steps 3 and 4":

    - ``model-call``: seq 0..2 committed (steps 1..3 counted from one); the model call that
      would produce seq 3 is held open by the fake API. The second worker must re-send that
      request byte-identical (thinking signatures bind it).
    - ``tool-call``: seq 0..3 committed; the turn at seq 3 is running its calls (the lookup
      finished and is in the ledger, the charge delivered and sleeps); seq 4 not committed.
    """
    run = durable_agents.start_run("thinker", KILL_PLAN)
    hold = HoldTurn(1)
    env = api_env(fake_api)
    if point == "model-call":
        fake_api.before_answer = hold
        first = spawn_worker("--burst", "--lease-seconds", LEASE, "--worker-id", "w1", env=env)
        assert hold.arrived.wait(30), first.output()
        killed_after = 2
    else:
        # The charge delivers, then sleeps: the kill lands after the effect, before its step.
        first = spawn_worker(
            "--burst",
            "--lease-seconds",
            LEASE,
            "--worker-id",
            "w1",
            env={**env, "DA_CHARGE_DELAY": "60"},
        )
        wait_for(lambda: receiver.applied("charge"), timeout=30)
        killed_after = 3
    # With overlapped commits the results of seq 2 commit while the held call is in flight:
    # the request can arrive before that commit lands.
    wait_for(lambda: AgentRun.objects.get(pk=run.pk).last_seq >= killed_after, timeout=30)
    run.refresh_from_db()
    assert run.last_seq == killed_after
    if point == "tool-call":
        # The finished first call of the interrupted turn was recorded on its own.
        assert list(
            ToolEffect.objects.filter(run=run, seq=3).values_list("call_index", "tool")
        ) == [(0, "lookup")]
    sent_before_kill = [r.body for r in fake_api.requests]
    assert first.kill() == SIGKILLED
    if point == "model-call":
        hold.let_go(fake_api)  # recorded now, answered to nobody

    wait_for(lambda: claimable(run.pk), timeout=10)
    finish(spawn_worker("--burst", "--lease-seconds", LEASE, "--worker-id", "w2", env=env))

    run.refresh_from_db()
    assert run.status == RunStatus.SUCCEEDED, run.error
    assert run.attempt == 2
    assert run.last_seq == KILL_PLAN_LAST_SEQ
    steps = own_steps(run.pk)
    assert_contiguous(steps)
    assert [(s.worker, s.attempt) for s in steps[1:]] == [("w1", 1)] * killed_after + [
        ("w2", 2)
    ] * (KILL_PLAN_LAST_SEQ - killed_after)

    # Every charge call applied exactly once, one key per call of the plan.
    applied = receiver.applied("charge")
    assert len(applied) == KILL_PLAN_CHARGES
    assert len({a["key"] for a in applied}) == KILL_PLAN_CHARGES
    attempts = Counter(a["key"] for a in receiver.attempts("charge"))
    if point == "model-call":
        assert set(attempts.values()) == {1}
    else:
        # Only the charge the kill interrupted was delivered twice, with the same key.
        assert sorted(attempts.values()) == [1, 1, 1, 2]

    # Byte-identical resume: no 400 (signatures verified), each turn's body sent once, or
    # twice identically when the kill interrupted that very call.
    assert {r.status for r in fake_api.requests} == {200}
    requests = fake_api.ok_requests()
    assert_resent_bodies_identical(requests)
    expected_calls = Counter(range(KILL_PLAN_LAST_SEQ // 2 + 1))
    if point == "model-call":
        expected_calls[1] += 1
        assert hold.held_body is not None
        resent = [canonical(r.body) for r in requests if r.turn == 1]
        assert resent == [hold.held_body, hold.held_body]
    assert Counter(r.turn for r in requests) == expected_calls
    # What the first worker sent is a prefix of everything sent.
    assert [r.body for r in requests[: len(sent_before_kill)]] == sent_before_kill


# --------------------------------------------------------------------------- 4. non-idempotent


def test_sigkill_while_non_idempotent_tool_runs_reapplies_nothing(
    receiver: Receiver, spawn_worker: Spawn
) -> None:
    tool_input = {"customer": "c9", "cents": 999}
    run = durable_agents.start_run("tester", f"charge once\n@charge {json.dumps(tool_input)}")
    first = spawn_worker(
        "--burst", "--lease-seconds", LEASE, "--worker-id", "w1", env={"DA_CHARGE_DELAY": "60"}
    )
    wait_for(lambda: receiver.marker("charge-started"), timeout=30)
    # Applied (not only attempted: the receiver logs the attempt first), now sleeping.
    wait_for(lambda: receiver.applied("charge"), timeout=10)
    assert first.kill() == SIGKILLED
    run.refresh_from_db()
    assert run.last_seq == 1  # the turn asking for the charge, not its result
    assert not ToolEffect.objects.filter(run=run).exists()

    wait_for(lambda: claimable(run.pk), timeout=10)
    finish(spawn_worker("--burst", "--lease-seconds", LEASE, "--worker-id", "w2"))

    key = effects.idempotency_key(run.pk, 1, 0, "charge", tool_input)
    attempts = receiver.attempts("charge")
    assert [a["key"] for a in attempts] == [key, key]
    assert attempts[0]["pid"] == first.pid
    assert attempts[1]["pid"] != first.pid
    assert [a["key"] for a in receiver.applied("charge")] == [key]

    run.refresh_from_db()
    assert run.status == RunStatus.SUCCEEDED, run.error
    assert run.attempt == 2
    steps = own_steps(run.pk)
    assert_contiguous(steps)
    assert [(s.kind, s.attempt) for s in steps] == [
        (StepKind.TASK, 0),
        (StepKind.MODEL_TURN, 1),
        (StepKind.TOOL_RESULT, 2),
        (StepKind.MODEL_TURN, 2),
    ]
    # The model is told what the receiver answered the retry: the same key was already
    # applied. Recorded once in the ledger, with that same text.
    duplicate = {"kind": "charge", "key": key, "applied": False, "duplicate": True}
    [result] = steps[2].data()
    assert result["content"] == json.dumps(duplicate)
    assert "is_error" not in result
    effect = ToolEffect.objects.get(key=key)
    assert (effect.seq, effect.call_index, effect.tool) == (1, 0, "charge")
    assert json.loads(effect.result) == duplicate


# --------------------------------------------------------------------------- 5. intents


def drop_run(table: str) -> tuple[AgentRun, dict[str, str], str]:
    tool_input = {"table": table}
    run = durable_agents.start_run("tester", f"drop it\n@drop_table {json.dumps(tool_input)}")
    return run, tool_input, effects.idempotency_key(run.pk, 1, 0, "drop_table", tool_input)


def park_on_intent(run: AgentRun) -> ToolIntent:
    run_worker(lease_seconds=2)
    run.refresh_from_db()
    assert run.status == RunStatus.WAITING
    assert (run.lease_owner, run.lease_until, run.last_seq) == (None, None, 1)
    [intent] = ToolIntent.objects.filter(run=run)
    return intent


def test_intent_approved_runs_the_tool_once(receiver: Receiver) -> None:
    run, tool_input, key = drop_run("t1")
    intent = park_on_intent(run)
    assert (intent.status, intent.tool, intent.input, intent.key) == (
        IntentStatus.PENDING,
        "drop_table",
        tool_input,
        key,
    )
    assert receiver.attempts("drop") == []
    run_worker(lease_seconds=2)  # a waiting run is not claimable: nothing changes
    assert AgentRun.objects.get(pk=run.pk).status == RunStatus.WAITING

    user = approver()
    durable_agents.approve_intent(intent.pk, user=user)
    run.refresh_from_db()
    assert run.status == RunStatus.PENDING
    run_worker(lease_seconds=2)

    run.refresh_from_db()
    intent.refresh_from_db()
    assert run.status == RunStatus.SUCCEEDED, run.error
    assert (intent.status, intent.decided_by_id) == (IntentStatus.DONE, user.pk)
    assert [a["key"] for a in receiver.attempts("drop")] == [key]
    assert [a["key"] for a in receiver.applied("drop")] == [key]
    [result] = own_steps(run.pk)[2].data()
    assert result["content"] == "dropped t1"
    assert "is_error" not in result


def test_intent_rejected_tells_the_model_who_and_why(receiver: Receiver) -> None:
    run, _, _ = drop_run("t1")
    intent = park_on_intent(run)
    durable_agents.reject_intent(intent.pk, user=approver("bob"), reason="production table")
    run_worker(lease_seconds=2)

    run.refresh_from_db()
    intent.refresh_from_db()
    assert run.status == RunStatus.SUCCEEDED, run.error
    assert intent.status == IntentStatus.REJECTED
    assert receiver.attempts("drop") == []
    steps = own_steps(run.pk)
    assert [s.kind for s in steps] == [
        StepKind.TASK,
        StepKind.MODEL_TURN,
        StepKind.TOOL_RESULT,
        StepKind.MODEL_TURN,
    ]
    tool_use_id = next(b["id"] for b in steps[1].data()["content"] if b["type"] == "tool_use")
    assert steps[2].data() == [
        {
            "type": "tool_result",
            "tool_use_id": tool_use_id,
            "content": "drop_table was not run: rejected by bob: production table",
            "is_error": True,
        }
    ]


@ROUTES
@pytest.mark.parametrize("happened", [True, False])
def test_crash_while_irreversible_tool_runs_asks_a_person(
    happened: bool, receiver: Receiver, fake_api: FakeAnthropic, spawn_worker: Spawn
) -> None:
    run, _, key = drop_run("t2")
    intent = park_on_intent(run)
    user = approver()
    durable_agents.approve_intent(intent.pk, user=user)

    first = spawn_worker(
        "--burst",
        "--lease-seconds",
        LEASE,
        env={**api_env(fake_api), "DA_DROP_DELAY": "60"},
    )
    wait_for(lambda: receiver.marker("drop-started"), timeout=30)
    wait_for(lambda: receiver.attempts("drop"), timeout=10)
    intent.refresh_from_db()
    assert intent.status == IntentStatus.EXECUTING
    assert first.kill() == SIGKILLED

    # The next worker must not guess: it parks the run on the now-unknown intent.
    wait_for(lambda: claimable(run.pk), timeout=10)
    run_worker(lease_seconds=2)
    run.refresh_from_db()
    intent.refresh_from_db()
    assert intent.status == IntentStatus.UNKNOWN
    assert (run.status, run.last_seq) == (RunStatus.WAITING, 1)
    assert len(receiver.attempts("drop")) == 1
    calls_before = len(fake_api.requests)

    if happened:
        durable_agents.resolve_intent(intent.pk, user=user, happened=True, result="dropped by hand")
    else:
        durable_agents.resolve_intent(intent.pk, user=user, happened=False)
    run_worker(lease_seconds=2)

    run.refresh_from_db()
    intent.refresh_from_db()
    assert run.status == RunStatus.SUCCEEDED, run.error
    assert intent.status == IntentStatus.DONE
    expected = "dropped by hand" if happened else "dropped t2"
    assert [a["key"] for a in receiver.attempts("drop")] == [key] * (1 if happened else 2)
    assert [a["key"] for a in receiver.applied("drop")] == [key]
    assert ToolEffect.objects.get(key=key).result == expected
    steps = own_steps(run.pk)
    assert_contiguous(steps)
    assert len(steps) == 4
    # The model saw the result: the one call made after the decision carries it.
    [final_call] = fake_api.ok_requests()[calls_before:]
    [result] = final_call.json()["messages"][-1]["content"]
    assert (result["type"], result["content"]) == ("tool_result", expected)
    assert "is_error" not in result


# --------------------------------------------------------------------------- 6. dead letter

MAX_ATTEMPTS = 2


def test_poison_run_is_dead_lettered_and_healthy_runs_finish(spawn_worker: Spawn) -> None:
    # Created first, so the first worker claims it first and dies on it.
    poison = durable_agents.start_run("tester", "die\n@poison")
    healthy = [
        durable_agents.start_run("tester", f'ok {i}\n@lookup {{"key": "k{i}"}}') for i in range(5)
    ]
    exit_codes: list[int] = []
    while AgentRun.objects.active().exists():
        assert len(exit_codes) < 10, exit_codes
        # Wait out the dead worker's lease instead of spawning workers that find nothing.
        wait_for(
            lambda: AgentRun.objects.claimable().exists() or not AgentRun.objects.active().exists(),
            timeout=10,
        )
        worker = spawn_worker(
            "--burst",
            "--lease-seconds",
            LEASE,
            env={"DURABLE_AGENTS_MAX_ATTEMPTS": str(MAX_ATTEMPTS)},
        )
        exit_codes.append(worker.wait(60))

    # Claim 1 commits the turn asking for poison (progress), claims 2..MAX+1 die without
    # progress, and the next claim dead-letters the run instead of running the tool.
    assert exit_codes.count(SIGKILLED) == MAX_ATTEMPTS + 1, exit_codes
    assert set(exit_codes) == {0, SIGKILLED}
    poison.refresh_from_db()
    assert poison.status == RunStatus.DEAD
    assert poison.attempt == MAX_ATTEMPTS + 2
    assert (poison.lease_owner, poison.last_seq) == (None, 1)
    assert f"{MAX_ATTEMPTS} claims in a row" in poison.error
    assert f"MAX_ATTEMPTS={MAX_ATTEMPTS}" in poison.error
    assert "tool call(s): poison" in poison.error
    for run in healthy:
        run.refresh_from_db()
        assert (run.status, run.attempt) == (RunStatus.SUCCEEDED, 1), run.error
        assert_contiguous(own_steps(run.pk))


# --------------------------------------------------------------------------- 7. SIGTERM


@ROUTES
@pytest.mark.parametrize("grace", ["0.5", "3600"])
def test_sigterm_during_a_model_call_hands_the_run_back_at_once(
    grace: str, fake_api: FakeAnthropic, spawn_worker: Spawn
) -> None:
    """SIGTERM while the first model call is held open by the fake API.

    - grace 0.5 s: the call outlives the grace period and is abandoned: nothing committed;
      the worker exits while the call is still held.
    - grace 3600 s: the call is answered during the drain: its turn commits, then the run is
      handed back before the next step, and the worker exits without waiting out the hour.
    (tests/acceptance/test_shutdown.py covers the same for a tool in flight.)
    """
    abandon = grace == "0.5"
    run = durable_agents.start_run(
        "thinker", 'stop politely\n@lookup {"key": "a"}\n@lookup {"key": "b"}'
    )
    # Hold the very first model call: the claim has no committed step yet, so a claim
    # counted against MAX_ATTEMPTS would leave stalled_claims at 1.
    hold = HoldTurn(0)
    fake_api.before_answer = hold
    env = api_env(fake_api)
    # A lease far longer than the test: the run can only become claimable by being released.
    first = spawn_worker(
        "--burst", "--lease-seconds", "60", "--grace-seconds", grace, "--worker-id", "w1", env=env
    )
    assert hold.arrived.wait(30), first.output()
    run.refresh_from_db()
    assert (run.status, run.lease_owner, run.stalled_claims) == (RunStatus.RUNNING, "w1", 1)

    first.terminate()
    if not abandon:
        wait_for(lambda: "draining" in first.output(), timeout=5)
        hold.let_go(fake_api)  # answered within the grace period
    assert first.wait(60) == 0, first.output()
    if abandon:
        # The worker left while the fake API still held its call: nothing was answered.
        assert fake_api.requests == []
    run.refresh_from_db()
    assert (run.status, run.lease_owner, run.lease_until) == (RunStatus.PENDING, None, None)
    assert run.stalled_claims == 0
    assert claimable(run.pk)
    committed = 0 if abandon else 1
    assert run.last_seq == committed
    assert [(s.worker, s.attempt) for s in own_steps(run.pk)[1:]] == [("w1", 1)] * committed
    if abandon:
        hold.let_go(fake_api)  # the answer finds no one: nothing may be committed from it

    finish(spawn_worker("--burst", "--lease-seconds", LEASE, "--worker-id", "w2", env=env))
    run.refresh_from_db()
    assert run.status == RunStatus.SUCCEEDED, run.error
    assert run.attempt == 2
    steps = own_steps(run.pk)
    assert_contiguous(steps)
    assert [(s.worker, s.attempt) for s in steps[1:]] == [("w1", 1)] * committed + [("w2", 2)] * (
        5 - committed
    )
    requests = fake_api.ok_requests()
    assert {r.status for r in fake_api.requests} == {200}
    assert_resent_bodies_identical(requests)
    assert Counter(r.turn for r in requests) == {0: 2 if abandon else 1, 1: 1, 2: 1}


# --------------------------------------------------------------------------- 8. PgBouncer


@pytest.mark.parametrize("route", ["pgbouncer"], indirect=True)
def test_pgbouncer_route_reaches_postgres_only_through_pgbouncer(
    route: str, pgbouncer: PgBouncer, spawn_worker: Spawn
) -> None:
    """What the ``pgbouncer`` variants rely on: the worker is PgBouncer's client, and every
    PostgreSQL backend of the test database, except this test's own, is one of PgBouncer's
    server connections (``SHOW SERVERS`` gives their backend pids). A LISTEN connection is
    allowed to go around the pooler (``DURABLE_AGENTS["LISTEN"]`` overrides)."""
    dbname = connection.settings_dict["NAME"]
    run = durable_agents.start_run("tester", 'via the pooler\n@lookup {"key": "a"}')
    worker = spawn_worker("--lease-seconds", LEASE, "--concurrency", "2", "--worker-id", "w1")
    wait_for(lambda: AgentRun.objects.get(pk=run.pk).status == RunStatus.SUCCEEDED, timeout=30)

    def clients() -> list[dict[str, Any]]:
        return [c for c in pgbouncer.show("CLIENTS") if c["database"] == dbname]

    assert wait_for(clients, timeout=10), worker.output()

    def backends_outside_pgbouncer() -> set[int] | None:
        servers = {s["remote_pid"] for s in pgbouncer.show("SERVERS") if s["database"] == dbname}
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT pid FROM pg_stat_activity WHERE datname = %s"
                " AND backend_type = 'client backend' AND pid <> pg_backend_pid()"
                " AND query NOT ILIKE 'LISTEN %%'",
                [dbname],
            )
            backends = {pid for (pid,) in cursor.fetchall()}
        # Backends of earlier tests' killed workers may take a moment to go away.
        return None if servers and not backends - servers else backends - servers

    assert wait_for(lambda: backends_outside_pgbouncer() is None, timeout=10)
    worker.terminate()
    finish(worker, timeout=20)
    assert [s.worker for s in own_steps(run.pk)[1:]] == ["w1"] * 3
