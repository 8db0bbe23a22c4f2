"""Concurrency limits under races, on PostgreSQL: many threads, each with its own connection,
claim at the same instant (a barrier releases them together), and the database itself is
asked after every round how many runs of each key hold a slot. A claim whose count of a key
reads the statement's snapshot lets two claims take the key's last slot together; these tests
catch that (without the update of the key's row in the claim they fail within a few rounds)."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from typing import Any

import pytest
from django.db import connection, connections
from django.test import override_settings

import durable_agents
from durable_agents.models import RunStatus, StepKind, WaitKind
from durable_agents.store import NextClaim, StepWrite, current
from durable_agents.store.base import WaitSpec

# A connection per thread (``unpooled``), not the worker's pool of 6.
pytestmark = [
    pytest.mark.postgres,
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("unpooled"),
]

THREADS = 16
KEYS = 20
LIMIT = 2
LIMITS = {f"tenant:{k}": LIMIT for k in range(KEYS)}
# The most runs of one key holding a slot (running, live lease), read in one statement.
OVER_LIMIT_SQL = """
SELECT concurrency_key, count(*) FROM agent_run
 WHERE status = 'running' AND lease_until >= now() AND concurrency_key IS NOT NULL
 GROUP BY concurrency_key ORDER BY count(*) DESC LIMIT 1"""


def most_holders() -> tuple[str | None, int]:
    with connection.cursor() as cursor:
        cursor.execute(OVER_LIMIT_SQL)
        row = cursor.fetchone()
    return (None, 0) if row is None else (row[0], row[1])


def start_keyed(per_key: int) -> None:
    for i in range(per_key):
        for k in range(KEYS):
            durable_agents.start_run("tester", f"run {i}", concurrency_key=f"tenant:{k}")


def in_threads(body: Callable[[int], Any], threads: int = THREADS) -> list[BaseException]:
    """``body(i)`` on ``threads`` threads, each on its own database connection; their
    exceptions."""
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            body(i)
        except BaseException as exc:  # noqa: BLE001 (reported by the test, whatever it is)
            errors.append(exc)
        finally:
            connections.close_all()

    pool = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join(120)
    return errors


@override_settings(
    DURABLE_AGENTS={"CONCURRENCY_LIMITS": {f"tenant:{k}": LIMIT for k in range(KEYS)}}
)
def test_claims_at_the_same_instant_never_exceed_a_keys_limit() -> None:
    """16 threads x 12 rounds of simultaneous claims of 1 to 3 runs, 20 keys at limit 2, runs
    kept: every key ends with exactly its 2 runs running, and no round ever saw a third."""
    start_keyed(per_key=10)
    rounds = 12
    barrier = threading.Barrier(THREADS)
    worst: list[tuple[int, str | None, int]] = []

    def claimer(i: int) -> None:
        for r in range(rounds):
            barrier.wait(60)
            current().claim_runs(f"w{i}", 60, limit=1 + (i + r) % 3)
            barrier.wait(60)
            if i == 0:
                key, count = most_holders()
                worst.append((r, key, count))

    assert in_threads(claimer) == []
    assert max(count for _, _, count in worst) <= LIMIT, worst
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT concurrency_key, count(*) FROM agent_run WHERE status = 'running'"
            " GROUP BY concurrency_key"
        )
        running = dict(cursor.fetchall())
    assert running == {f"tenant:{k}": LIMIT for k in range(KEYS)}


def _finish(claim: Any, rng: random.Random) -> None:
    """End, park, hand back or cancel a claimed run, at random; some ends claim the next run
    in the same statement (FINISH_AND_CLAIM_SQL), which then ends too."""
    store = current()
    while claim is not None:
        what = rng.random()
        if what < 0.35:
            then = NextClaim(claim.owner, 60, take=lambda: True, give_back=lambda: None)
            step = StepWrite(1, StepKind.MODEL_TURN, "{}", finish=(RunStatus.SUCCEEDED, "ok"))
            store.append_step(claim, step, then_claim=then if rng.random() < 0.7 else None)
            claim = then.claim
            continue
        if what < 0.55:
            spec = WaitSpec(WaitKind.EVENT, key=f"wait-{claim.run_id}", event="later")
            store.park_on_wait(claim, spec)
        elif what < 0.8:
            store.release_lease(claim)
        else:
            store.cancel_run(claim.run_id)
        claim = None


@override_settings(
    DURABLE_AGENTS={"CONCURRENCY_LIMITS": {f"tenant:{k}": LIMIT for k in range(KEYS)}}
)
def test_limits_hold_while_runs_end_park_and_go_back_concurrently() -> None:
    """16 threads claim, then end, park, release or cancel what they hold (or end it and claim
    the next in one statement) at the same instants, while a watcher reads the holders per key
    from the database without pause: never more than 2 for a key."""
    start_keyed(per_key=15)
    rounds = 15
    barrier = threading.Barrier(THREADS)
    stop = threading.Event()
    seen: list[tuple[str | None, int]] = []

    def watcher() -> None:
        try:
            while not stop.is_set():
                seen.append(most_holders())
        finally:
            connections.close_all()

    def worker(i: int) -> None:
        rng = random.Random(i)
        for _ in range(rounds):
            barrier.wait(60)
            claims = current().claim_runs(f"w{i}", 60, limit=rng.randint(1, 3))
            seen.append(most_holders())
            barrier.wait(60)
            for claim in claims:
                _finish(claim, rng)

    watching = threading.Thread(target=watcher)
    watching.start()
    try:
        errors = in_threads(worker)
    finally:
        stop.set()
        watching.join(30)
    assert errors == []
    assert len(seen) > THREADS * rounds
    assert max(count for _, count in seen) <= LIMIT, max(seen, key=lambda s: s[1])
    assert most_holders()[1] <= LIMIT


def test_one_thread_reads_the_keys_limits_again_while_the_others_take_the_last_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Slots that end runs together each claim the next with the keys' limits: when the
    limits are due to be read again, one of them reads while the others go on with the last
    read, instead of a thousand reads at once."""
    import psycopg

    from durable_agents.models import ConcurrencyKey
    from durable_agents.store import key_rows
    from tests.conftest import backend_waits_on_lock, database_url, wait_for

    key_rows.set_limit("tenant:x", 3)
    assert key_rows.limit_overrides() == {"tenant:x": 3}
    monkeypatch.setattr(key_rows, "LIMIT_OVERRIDES_TTL", 0.0)  # every call finds them due
    ConcurrencyKey.objects.filter(key="tenant:x").update(concurrency_limit=5)
    results: dict[str, Any] = {}

    def read(name: str) -> threading.Thread:
        def body() -> None:
            try:
                results[name] = key_rows.limit_overrides()
            finally:
                connections.close_all()

        thread = threading.Thread(target=body, daemon=True)
        thread.start()
        return thread

    with psycopg.connect(database_url()) as locker:
        locker.execute("LOCK TABLE agent_concurrency_key IN ACCESS EXCLUSIVE MODE")
        reader = read("reader")
        wait_for(lambda: backend_waits_on_lock("agent_concurrency_key"), what="the reader")
        other = read("other")
        other.join(30)  # not held by the reader's read
        assert results == {"other": {"tenant:x": 3}}
    reader.join(30)
    assert results["reader"] == {"tenant:x": 5}
    assert key_rows.limit_overrides() == {"tenant:x": 5}
    key_rows.forget_limit_overrides()
