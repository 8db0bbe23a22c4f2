"""The database restarts, or fails over to its standby, in the middle of a burst: nothing that
was paid for is thrown away.

Each test starts PostgreSQL clusters of its own (tests/pgcluster.py: a primary, and for a
failover a streaming standby), real ``runagents`` subprocesses against them, and the fake
Messages API over HTTP answering slowly, with 429s and 529s mixed in. Mid-burst the primary is
restarted, or stopped (``-m immediate``, a crash) and its standby promoted; the workers know
both hosts (``HOST="h1,h2"``, ``target_session_attrs=read-write``) and go on against the new
primary without a restart. The fake counts every answered model request per (run, turn): a
turn answered twice was paid for twice (re-asked). The non-idempotent tool records each call
in files, outside the database, with its idempotency key.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, WorkerProcess, wait_for
from tests.fakeserver import FakeAnthropic, Recorded, api_error
from tests.pgcluster import Cluster, Clusters, clusters

pytestmark = [pytest.mark.postgres, pytest.mark.slow, pytest.mark.failover]

DB = "da_failover_test"
RUNS = 24
# Model turns per run: five that call a tool, then the final answer.
TURNS = 6
LEASE_SECONDS = "20"
# Where commits are lost with the old primary, a worker's runs are behind it and it lets them
# go: they wait out their lease before another claim. A short one keeps that wait short (the
# test allows turns asked again there).
LOST_COMMITS_LEASE_SECONDS = "5"
# Seconds the fake takes to answer each call: the burst lasts long enough to cut in.
LATENCY = 0.4


def task(i: int) -> str:
    return "\n".join(
        [
            f"Failover run {i}.",
            f'@lookup {{"key": "a{i}"}}',
            f'@charge {{"customer": "c{i}", "cents": 100}}',
            f'@lookup {{"key": "b{i}"}}',
            f'@set_flag {{"name": "f{i}", "value": true}}',
            f'@lookup {{"key": "c{i}"}}',
        ]
    )


def first_text(record: Recorded) -> str:
    """The task's first line: which run a request is for."""
    content = record.json()["messages"][0]["content"]
    text = content if isinstance(content, str) else content[0]["text"]
    return str(text).split("\n", 1)[0]


def answered_per_turn(api: FakeAnthropic) -> collections.Counter[tuple[str, int]]:
    """Answered (paid) model requests per (run, turn)."""
    return collections.Counter((first_text(r), r.turn) for r in api.ok_requests())


def reasked(api: FakeAnthropic) -> dict[tuple[str, int], int]:
    return {key: n for key, n in answered_per_turn(api).items() if n > 1}


@pytest.fixture
def slow_api() -> Iterator[FakeAnthropic]:
    """The fake API, answering after LATENCY, with a 529 and a 429 now and then."""
    api = FakeAnthropic()
    api.before_answer = lambda body: time.sleep(LATENCY)
    stop = threading.Event()

    def faults() -> None:
        overloaded = api_error(529, "overloaded_error", "Overloaded")
        limited = api_error(429, "rate_limit_error", "Slow down", **{"retry-after": "1"})
        while not stop.wait(1.5):
            api.fail_next(overloaded)
            if stop.wait(1.5):
                break
            api.fail_next(limited)

    thread = threading.Thread(target=faults, daemon=True)
    thread.start()
    yield api
    stop.set()
    thread.join(5)
    api.close()


def run_manage(command: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "manage.py"), *command],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def prepare(primary: Cluster, worker_env: dict[str, str]) -> None:
    """The app's tables on ``primary`` and the burst's runs, started through the public API
    (a subprocess of the app, as an application would)."""
    primary.execute(f"CREATE DATABASE {DB}")
    env = {**worker_env, "DA_FAILOVER_TASKS": json.dumps([task(i) for i in range(RUNS)])}
    for command in (
        ["migrate", "--verbosity", "0"],
        [
            "shell",
            "-c",
            "import json, os, durable_agents\n"
            "for t in json.loads(os.environ['DA_FAILOVER_TASKS']):\n"
            "    durable_agents.start_run('tester', t)\n",
        ],
    ):
        done = run_manage(command, env)
        assert done.returncode == 0, done.stderr


def base_env(api: FakeAnthropic, receiver_dir: Path, hosts: list[Cluster]) -> dict[str, str]:
    return {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "DATABASE_URL": hosts[0].url(DB),
        "DA_DB_HOSTS": ",".join("127.0.0.1" for _ in hosts),
        "DA_DB_PORTS": ",".join(str(c.port) for c in hosts),
        "DURABLE_AGENTS_OFFLINE": "0",
        "ANTHROPIC_BASE_URL": api.base_url,
        "ANTHROPIC_API_KEY": "sk-test-not-a-real-key",
        "DA_RECEIVER_DIR": str(receiver_dir),
        "PYTHONUNBUFFERED": "1",
    }


def statuses(cluster: Cluster) -> collections.Counter[str]:
    rows = cluster.execute("SELECT status, count(*) FROM agent_run GROUP BY status", DB)
    return collections.Counter({str(status): int(n) for status, n in rows})  # type: ignore[call-overload]


def all_over(cluster: Cluster) -> bool:
    try:
        counts = statuses(cluster)
    except Exception:  # noqa: BLE001 - the database may be restarting: not over yet
        return False
    return sum(counts[s] for s in ("succeeded", "failed", "dead", "cancelled")) == RUNS


def burst(
    tmp_path: Path,
    api: FakeAnthropic,
    hosts: list[Cluster],
    cut: Callable[[], Cluster],
    hold: bool = True,
    lease_seconds: str = LEASE_SECONDS,
) -> tuple[Cluster, list[WorkerProcess], tuple[float, float]]:
    """Start the runs and two workers, call ``cut`` once a third of the turns were answered
    (it returns the primary from then on; with ``hold``, while step commits are held in
    flight), and wait for every run to end. Returns the primary,
    the workers (stopped), how long the cut took and how long after it the first step was
    committed again."""
    receiver_dir = tmp_path / "receiver"
    receiver_dir.mkdir()
    env = base_env(api, receiver_dir, hosts)
    prepare(hosts[0], env)
    workers = [
        WorkerProcess(
            ["--concurrency", "6", "--lease-seconds", lease_seconds],
            env,
            tmp_path / f"worker-{n}.log",
        )
        for n in range(2)
    ]
    try:
        wait_for(lambda: len(api.ok_requests()) >= RUNS * TURNS // 3, timeout=60)
        with commits_held(hosts[0]) if hold else contextlib.nullcontext():
            cut_at = time.time()
            primary = cut()
            back_at = time.time()
        wait_for(lambda: all_over(primary), timeout=90, interval=0.2)
        resumed = primary.execute(
            "SELECT extract(epoch FROM min(created_at)) FROM agent_step "
            f"WHERE created_at > to_timestamp({back_at})",
            DB,
        )[0][0]
        for worker in workers:
            worker.terminate()
        for worker in workers:
            assert worker.wait(30) == 0, worker.output()[-3000:]
    finally:
        for worker in workers:
            if worker.proc.poll() is None:
                worker.proc.kill()
                worker.wait(10)
    return primary, workers, (back_at - cut_at, float(resumed) - back_at)  # type: ignore[arg-type]


@contextlib.contextmanager
def commits_held(primary: Cluster, at_least: int = 3) -> Iterator[None]:
    """Hold every step commit (a lock on agent_step that inserts wait for) until at least
    ``at_least`` are waiting, then let the block cut them: the cut lands in the middle of
    commits for certain, not only when the timing happens to be right."""
    import psycopg

    holder = psycopg.connect(primary.url(DB))
    try:
        holder.execute("LOCK TABLE agent_step IN SHARE ROW EXCLUSIVE MODE")

        def waiting() -> bool:
            rows = primary.execute(
                # Only commits insert into agent_step; the statement's text is too long for
                # pg_stat_activity to show where it does.
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND datname = current_database()",
                DB,
            )
            return int(rows[0][0]) >= at_least  # type: ignore[call-overload]

        wait_for(waiting, timeout=30, interval=0.05)
        yield
    finally:
        with contextlib.suppress(Exception):  # the cut closed it already
            holder.close()


def charges(receiver_dir: Path) -> dict[str, list[str]]:
    """The keys of every charge attempt, by customer (from the receiver's files)."""
    from tests.testapp import receiver

    by_customer: dict[str, list[str]] = collections.defaultdict(list)
    for attempt in receiver.attempts(receiver_dir):
        by_customer[attempt["payload"]["customer"]].append(attempt["key"])
    return by_customer


def assert_nothing_lost_or_repeated(
    primary: Cluster, api: FakeAnthropic, receiver_dir: Path, workers: list[WorkerProcess]
) -> None:
    logs = "\n".join(w.output()[-2000:] for w in workers)
    assert statuses(primary) == {"succeeded": RUNS}, logs
    # No turn was paid for twice.
    again = reasked(api)
    assert again == {}, f"{len(again)} turns re-asked: {again}"
    # Every paid turn is in a log: as many model turns stored as answered.
    stored = primary.execute("SELECT count(*) FROM agent_step WHERE kind = 'model_turn'", DB)[0][0]
    assert stored == RUNS * TURNS == len(api.ok_requests())
    # Each charge ran once, with one key.
    keys = charges(receiver_dir)
    assert sorted(keys) == sorted(f"c{i}" for i in range(RUNS))
    assert all(len(k) == 1 for k in keys.values()), keys


def test_a_restart_mid_burst_reasks_no_turn(
    tmp_path: Path, slow_api: FakeAnthropic, record_property: Any
) -> None:
    """``pg_ctl restart -m immediate`` while runs are in flight: every commit cut by it is
    committed again on a new connection, so no turn is re-asked and every run succeeds."""
    with clusters() as made:
        primary = made.primary()

        def restart() -> Cluster:
            primary.restart("immediate")
            return primary

        primary_now, workers, resumed = burst(tmp_path, slow_api, [primary], restart)
        record_property("cut_and_resumed_seconds", [round(t, 2) for t in resumed])
        assert_nothing_lost_or_repeated(primary_now, slow_api, tmp_path / "receiver", workers)
        assert any("retrying on a fresh connection" in w.output() for w in workers)


def _fail_over(made: Clusters, synchronous: bool) -> tuple[Cluster, Cluster]:
    primary = made.primary(synchronous_standby="standby" if synchronous else None)
    standby = made.standby(primary)
    # The standby streams before the burst starts (a synchronous one is needed to commit).
    from tests.pgcluster import wait_for_sql

    wait_for_sql(
        primary,
        "SELECT count(*) FROM pg_stat_replication WHERE application_name = 'standby' "
        "AND state = 'streaming'",
    )
    return primary, standby


def test_a_failover_to_a_synchronous_standby_loses_and_repeats_nothing(
    tmp_path: Path, slow_api: FakeAnthropic, record_property: Any
) -> None:
    """The primary crashes mid-burst and its synchronous standby is promoted: the workers go
    on against it without a restart; nothing is lost, nothing repeated, no turn re-asked."""
    with clusters() as made:
        primary, standby = _fail_over(made, synchronous=True)

        def fail_over() -> Cluster:
            primary.stop("immediate")
            standby.promote()
            return standby

        primary_now, workers, resumed = burst(tmp_path, slow_api, [primary, standby], fail_over)
        record_property("cut_and_resumed_seconds", [round(t, 2) for t in resumed])
        assert_nothing_lost_or_repeated(primary_now, slow_api, tmp_path / "receiver", workers)
        # Housekeeping, with the same two hosts, writes to the promoted standby (its metrics
        # snapshot): the old primary, first in the list, is skipped.
        housekeeping = run_manage(
            ["durable_agents_housekeeping", "--metrics"],
            base_env(slow_api, tmp_path / "receiver", [primary, standby]),
        )
        assert housekeeping.returncode == 0, housekeeping.stderr
        assert "snapshot" in housekeeping.stdout


def test_a_failover_to_an_asynchronous_standby_never_repeats_a_call_with_a_new_key(
    tmp_path: Path, slow_api: FakeAnthropic, record_property: Any
) -> None:
    """Asynchronous replication: the last commits before the crash may be lost with the old
    primary (here for certain: the standby is stopped while the primary commits a few more
    steps), so turns are asked again and calls run again. Even then every run ends, and a
    non-idempotent call that runs again carries the key it had (its receiver applies it
    once)."""
    with clusters() as made:
        primary, standby = _fail_over(made, synchronous=False)

        def steps() -> int:
            return int(primary.execute("SELECT count(*) FROM agent_step", DB)[0][0])  # type: ignore[call-overload]

        def fail_over() -> Cluster:
            standby.stop("fast")
            behind = steps()
            wait_for(lambda: steps() >= behind + 10, timeout=60, interval=0.05)
            primary.stop("immediate")  # with the steps the standby never received
            standby.start()
            standby.promote()
            return standby

        primary_now, workers, resumed = burst(
            tmp_path,
            slow_api,
            [primary, standby],
            fail_over,
            hold=False,
            lease_seconds=LOST_COMMITS_LEASE_SECONDS,
        )
        record_property("cut_and_resumed_seconds", [round(t, 2) for t in resumed])
        record_property("reasked", len(reasked(slow_api)))
        # The lost commits cost turns: what the asynchronous standby risks, shown.
        assert reasked(slow_api)
        logs = "\n".join(w.output()[-2000:] for w in workers)
        assert statuses(primary_now) == {"succeeded": RUNS}, logs
        keys = charges(tmp_path / "receiver")
        assert sorted(keys) == sorted(f"c{i}" for i in range(RUNS))
        assert all(len(set(k)) == 1 for k in keys.values()), keys
        from tests.testapp import receiver

        applied = collections.Counter(
            a["payload"]["customer"] for a in receiver.applied(tmp_path / "receiver")
        )
        assert set(applied.values()) == {1}
