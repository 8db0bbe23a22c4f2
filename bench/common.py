"""Shared plumbing: bench databases, the fake API servers, Django setup, worker processes
(``runagents``) and child processes, waits on the runs, step hooks, stats, JSON results."""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Self, TypeVar

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out"
PY = sys.executable
PG_BASE = os.environ.get("BENCH_PG", "postgres://root@127.0.0.1:5432")
ADMIN_DSN = f"{PG_BASE}/postgres"

K = TypeVar("K")

# The workload: runs of 10 model turns, one trivial pure tool call per turn but the last.
TURNS = 10


def task_text(i: int, turns: int = TURNS, calls: int = 1) -> str:
    """The script of run ``i``: ``turns`` model turns, each but the last asking for ``calls``
    calls of the pure ``noop`` tool."""
    lines = [f"Benchmark run {i}."]
    for t in range(turns - 1):
        keys = [f"k{i}-{t}" if calls == 1 else f"k{i}-{t}-{c}" for c in range(calls)]
        lines.append("@" + " && ".join(f'noop {{"key": "{key}"}}' for key in keys))
    return "\n".join(lines)


def db_url(name: str) -> str:
    assert name.startswith("da_bench"), name
    return f"{PG_BASE}/{name}"


def recreate_db(name: str) -> str:
    """Drop and create database ``name`` (da_bench* only); returns its URL."""
    import psycopg

    assert name.startswith("da_bench"), name
    with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')
    return db_url(name)


def drop_db(name: str) -> None:
    import psycopg

    assert name.startswith("da_bench"), name
    with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def bench_env(url: str, base_url: str | None = None, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        DATABASE_URL=url,
        DJANGO_SETTINGS_MODULE="bench.settings",
        ANTHROPIC_API_KEY="bench-key",
        PYTHONPATH=str(ROOT),
    )
    if base_url:
        env["ANTHROPIC_BASE_URL"] = base_url
    env.update(extra)
    return env


def migrate(url: str, root: Path = ROOT) -> None:
    """``manage.py migrate`` on ``url`` with the code (and migrations) of the checkout ``root``."""
    subprocess.run(
        [PY, "manage.py", "migrate", "--verbosity", "0"],
        cwd=root,
        env=bench_env(url, PYTHONPATH=str(root)),
        check=True,
    )


def fresh_db(name: str) -> str:
    url = recreate_db(name)
    migrate(url)
    return url


def postgres_unavailable() -> str | None:
    """Why no benchmark can run here (they need the PostgreSQL server of ``BENCH_PG``), or None."""
    if not PG_BASE.startswith(("postgres://", "postgresql://")):
        return f"BENCH_PG={PG_BASE!r} is not PostgreSQL"
    try:
        import psycopg

        with psycopg.connect(ADMIN_DSN, autocommit=True, connect_timeout=5) as conn:
            conn.execute("SELECT 1")
    except Exception as exc:  # noqa: BLE001 - any failure means: no PostgreSQL to measure
        return f"no PostgreSQL at {PG_BASE}: {type(exc).__name__}: {exc}"
    return None


def setup_django(url: str, base_url: str | None = None) -> None:
    """Configure this process for ``url`` and the fake API, then django.setup()."""
    os.environ.update(bench_env(url, base_url))
    import django

    django.setup()


@contextlib.contextmanager
def serving(module_args: list[str], what: str) -> Iterator[str]:
    """Start ``python -m <module_args>`` in its own process, a server that prints ``PORT n``
    once it listens; yields its base URL and stops the process on the way out."""
    proc = subprocess.Popen(
        [PY, "-m", *module_args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        if not line.startswith("PORT "):
            raise RuntimeError(f"{what} did not start: {line!r}")
        yield f"http://127.0.0.1:{int(line.split()[1])}"
    finally:
        stop(proc, 5)


def stop(proc: subprocess.Popen[Any], grace: float) -> int:
    """SIGTERM, then SIGKILL if ``proc`` is still there after ``grace`` s; its exit code."""
    proc.terminate()
    try:
        return proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def stop_all(procs: list[subprocess.Popen[Any]], grace: float) -> list[int]:
    """``stop`` for several processes at once: SIGTERM to all first (they drain side by side),
    then each is waited on, SIGKILLed if still there ``grace`` s later; their exit codes."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()  # once: a worker's second SIGTERM abandons its steps in flight
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(grace))
        except subprocess.TimeoutExpired:
            proc.kill()
            codes.append(proc.wait())
    return codes


def runagents(
    url: str,
    base_url: str | None,
    *args: str,
    root: Path = ROOT,
    log: Path | None = None,
    quiet: bool = False,
    **env: str,
) -> subprocess.Popen[bytes]:
    """``manage.py runagents *args`` in its own process, on ``url`` against the fake API at
    ``base_url``, with the code of the checkout ``root`` and the bench settings (``env`` adds
    to its environment). Its output is appended to ``log``, discarded when ``quiet``, else
    shared with this process's."""
    cmd = [PY, "manage.py", "runagents", *args]
    environ = bench_env(url, base_url, PYTHONPATH=str(root), **env)
    if log is None:
        out = subprocess.DEVNULL if quiet else None
        return subprocess.Popen(cmd, cwd=root, env=environ, stdout=out, stderr=out)
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as f:  # the child holds its own copy of the descriptor
        return subprocess.Popen(cmd, cwd=root, env=environ, stdout=f, stderr=subprocess.STDOUT)


def fleet(
    url: str,
    base_url: str | None,
    procs: int,
    slots: int,
    *,
    root: Path = ROOT,
    logs: Path | None = None,
    **env: str,
) -> list[subprocess.Popen[bytes]]:
    """``procs`` workers of ``slots`` slots (``runagents --concurrency``): with ``logs``, each
    logs at INFO to ``logs``/worker-<n>.log, else quietly."""
    if logs is not None:
        env = {"BENCH_LOG_LEVEL": "INFO", **env}
    return [
        runagents(
            url,
            base_url,
            "--concurrency",
            str(slots),
            root=root,
            log=None if logs is None else logs / f"worker-{n}.log",
            quiet=logs is None,
            **env,
        )
        for n in range(procs)
    ]


def count_backends(url: str) -> int:
    """Client backends connected to ``url``'s database, this connection's left out."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        return conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND pid <> pg_backend_pid() AND backend_type = 'client backend'"
        ).fetchone()[0]


def wait_backends(url: str, at_least: int, limit: float = 60.0) -> None:
    """Until ``at_least`` client backends are connected to ``url`` (workers are up), or
    ``limit`` s."""
    deadline = time.perf_counter() + limit
    while count_backends(url) < at_least and time.perf_counter() < deadline:
        time.sleep(0.1)


FINISHED = ("succeeded", "failed", "dead", "cancelled")


def wait_finished(url: str, limit: float = 600.0, interval: float = 0.05) -> float:
    """Until no run of ``url`` is unfinished (RuntimeError after ``limit`` s); the seconds."""
    import psycopg

    t = time.perf_counter()
    with psycopg.connect(url, autocommit=True) as conn:
        while conn.execute(
            "SELECT count(*) FROM agent_run WHERE status <> ALL(%s)", [list(FINISHED)]
        ).fetchone()[0]:
            if time.perf_counter() - t > limit:
                raise RuntimeError(f"the runs did not finish in {limit} s")
            time.sleep(interval)
    return time.perf_counter() - t


def throughput(url: str) -> dict[str, Any]:
    """Worker-committed steps (seq > 0) over the span from the first of them to the last
    finished run (database clock); RuntimeError if a run did not succeed."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        bad, steps, span = conn.execute(
            "SELECT (SELECT count(*) FROM agent_run WHERE status <> 'succeeded'),"
            " (SELECT count(*) FROM agent_step WHERE seq > 0),"
            " EXTRACT(EPOCH FROM (SELECT max(finished_at) FROM agent_run)"
            "  - (SELECT min(created_at) FROM agent_step WHERE seq > 0))"
        ).fetchone()
    if bad:
        raise RuntimeError(f"{bad} runs did not succeed")
    return {"steps": steps, "span_s": float(span), "steps_per_s": steps / float(span)}


def child_result(
    args: list[str], env: dict[str, str], cwd: Path = ROOT, what: str = "child"
) -> Any:
    """Run ``python -m *args`` to its end; the JSON of the ``RESULT {...}`` line it prints."""
    proc = subprocess.run([PY, "-m", *args], cwd=cwd, env=env, capture_output=True, text=True)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        raise RuntimeError(f"{what} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return json.loads(line[len("RESULT ") :])


def print_result(data: Any) -> None:
    """The ``RESULT {...}`` line ``child_result`` reads."""
    print("RESULT " + json.dumps(data), flush=True)


def fake_api() -> contextlib.AbstractContextManager[str]:
    """``python -m bench.fakeapi`` (zero latency) in its own process; yields its base URL."""
    return serving(["bench.fakeapi", "--port", "0"], "fake API")


def get_json(base_url: str, path: str) -> Any:
    """GET ``path`` of a fake API's own endpoints (its statistics, its request log)."""
    with urllib.request.urlopen(base_url + path, timeout=30) as resp:
        return json.loads(resp.read())


def interleaved(blocks: int, sides: dict[K, Callable[[], list[float]]]) -> dict[K, list[float]]:
    """``blocks`` rounds in which each side measures once (a block: its values), the order
    reversed every other round, so that the machine's drift hits every side alike; each side's
    values, all blocks together."""
    values: dict[K, list[float]] = {name: [] for name in sides}
    order = list(sides)
    for block in range(blocks):
        for name in order if block % 2 == 0 else order[::-1]:
            values[name] += sides[name]()
    return values


def pct(values: list[float], p: float) -> float:
    """Percentile by linear interpolation (p in 0..100)."""
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summary_ms(seconds: list[float]) -> dict[str, float]:
    ms = [s * 1000 for s in seconds]
    return {
        "n": len(ms),
        "mean_ms": statistics.fmean(ms) if ms else float("nan"),
        "min_ms": min(ms) if ms else float("nan"),
        "p50_ms": pct(ms, 50),
        "p90_ms": pct(ms, 90),
        "p99_ms": pct(ms, 99),
        "max_ms": max(ms) if ms else float("nan"),
    }


def start_runs(n: int, agent: str = "bench", turns: int = TURNS, calls: int = 1) -> list[Any]:
    """Create ``n`` pending runs through the public API (after django.setup())."""
    import durable_agents

    return [durable_agents.start_run(agent, task_text(i, turns, calls)).pk for i in range(n)]


# A time-ordered run id made in SQL (as models.ids.new_run_id makes them: the millisecond, the
# version 7, random bits), so that bulk-loaded runs live in today's partition of the step log
# as runs started by the app do.
TIME_ORDERED_ID_SQL = (
    "(lpad(to_hex((extract(epoch FROM clock_timestamp()) * 1000)::bigint), 12, '0') || '7'"
    " || substr(md5(random()::text), 1, 3) || '8' || substr(md5(random()::text), 1, 15))::uuid"
)


def bulk_insert_runs(url: str, n: int, turns: int = TURNS, offset: int = 0) -> None:
    """Insert ``n`` pending runs of the ``bench`` agent (and their task steps) in one
    transaction, so that they all become claimable at the same instant."""
    import psycopg

    from bench.benchapp.agents import bench
    from durable_agents.models.step_partitions import part_of_run

    fp = bench.fingerprint(bench.model)
    with psycopg.connect(url) as conn, conn.cursor() as cur:
        cur.execute("CREATE TEMP TABLE new_runs (id uuid) ON COMMIT DROP")
        cur.executemany(
            "WITH r AS (INSERT INTO agent_run (id, agent, prompt_version, fingerprint, model,"
            " task, status, attempt, stalled_claims, last_seq, error, created_at, updated_at)"
            f" VALUES ({TIME_ORDERED_ID_SQL}, 'bench', '1', %s, %s, %s, 'pending', 0, 0, 0, '',"
            " clock_timestamp(), now()) RETURNING id, task)"
            " INSERT INTO agent_step (run_id, seq, part, kind, payload, attempt, worker,"
            f" created_at) SELECT id, 0, {part_of_run('id')}, 'task', %s, 0, '', now() FROM r",
            [
                (fp, bench.model, task, json.dumps(task, ensure_ascii=False))
                for task in (task_text(offset + i, turns) for i in range(n))
            ],
        )
        conn.commit()


class StepHooks:
    """Inside ``with``, the chosen store's ``append_step`` and the model-call layer's
    ``create_turn`` go through ``append`` and ``create`` (a subclass times them); ``drain``
    stops the claim in progress once the subclass has seen ``limit`` commits."""

    def __init__(self) -> None:
        from durable_agents import llm, store

        # The runner commits through the chosen store (an instance attribute shadows the
        # method for that instance only).
        self.store, self.llm = store.current(), llm
        self.orig_append, self.orig_create = self.store.append_step, llm.create_turn
        self.limit = 0
        self.drain = threading.Event()

    def append(self, claim: Any, step: Any, *a: Any, **k: Any) -> bool:
        """``append_step(claim, step, ...)``: ``step`` is a store.StepWrite (.seq, .kind)."""
        raise NotImplementedError

    def create(self, *a: Any, **k: Any) -> Any:
        raise NotImplementedError

    def __enter__(self) -> Self:
        self.store.append_step, self.llm.create_turn = self.append, self.create  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        del self.store.append_step  # type: ignore[attr-defined]
        self.llm.create_turn = self.orig_create


def write_result(name: str, data: dict[str, Any]) -> Path:
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"{name}.json"
    path.write_text(json.dumps(data, indent=2, default=str))
    return path


def finish(name: str, data: dict[str, Any], *dbs: str, keep: bool = False) -> dict[str, Any]:
    """The end of a benchmark's ``main``: ``data`` to bench/out/<name>.json, then its
    databases dropped (unless ``keep``); returns ``data``."""
    write_result(name, data)
    if not keep:
        for db in dbs:
            drop_db(db)
    return data


def verdict(ok: bool) -> str:
    return "MET" if ok else "MISSED"


def log(*args: Any) -> None:
    print(*args, flush=True)
