"""Shared plumbing: bench databases, the fake API servers, Django setup, step hooks, stats,
JSON results."""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Self

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out"
PY = sys.executable
PG_BASE = os.environ.get("BENCH_PG", "postgres://root@127.0.0.1:5432")
ADMIN_DSN = f"{PG_BASE}/postgres"

# The workload: runs of 10 model turns, one trivial pure tool call per turn but the last.
TURNS = 10


def task_text(i: int, turns: int = TURNS) -> str:
    lines = [f"Benchmark run {i}."]
    lines += [f'@noop {{"key": "k{i}-{t}"}}' for t in range(turns - 1)]
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


def migrate(url: str) -> None:
    subprocess.run(
        [PY, "manage.py", "migrate", "--verbosity", "0"],
        cwd=ROOT,
        env=bench_env(url),
        check=True,
    )


def fresh_db(name: str) -> str:
    url = recreate_db(name)
    migrate(url)
    return url


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


def fake_api() -> contextlib.AbstractContextManager[str]:
    """``python -m bench.fakeapi`` (zero latency) in its own process; yields its base URL."""
    return serving(["bench.fakeapi", "--port", "0"], "fake API")


def get_json(base_url: str, path: str) -> Any:
    """GET ``path`` of a fake API's own endpoints (its statistics, its request log)."""
    with urllib.request.urlopen(base_url + path, timeout=30) as resp:
        return json.loads(resp.read())


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


def start_runs(n: int, agent: str = "bench", turns: int = TURNS) -> list[Any]:
    """Create ``n`` pending runs through the public API (after django.setup())."""
    import durable_agents

    return [durable_agents.start_run(agent, task_text(i, turns)).pk for i in range(n)]


def bulk_insert_runs(url: str, n: int, turns: int = TURNS, offset: int = 0) -> None:
    """Insert ``n`` pending runs of the ``bench`` agent (and their task steps) in one
    transaction, so that they all become claimable at the same instant."""
    import psycopg

    from bench.benchapp.agents import bench

    fp = bench.fingerprint(bench.model)
    with psycopg.connect(url) as conn, conn.cursor() as cur:
        cur.execute("CREATE TEMP TABLE new_runs (id uuid) ON COMMIT DROP")
        cur.executemany(
            "WITH r AS (INSERT INTO agent_run (id, agent, prompt_version, fingerprint, model,"
            " task, status, attempt, stalled_claims, last_seq, error, created_at, updated_at)"
            " VALUES (gen_random_uuid(), 'bench', '1', %s, %s, %s, 'pending', 0, 0, 0, '',"
            " clock_timestamp(), now()) RETURNING id, task)"
            " INSERT INTO agent_step (run_id, seq, kind, payload, attempt, worker, created_at)"
            " SELECT id, 0, 'task', %s, 0, '', now() FROM r",
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

    def append(self, claim: Any, seq: int, *a: Any, **k: Any) -> bool:
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


def verdict(ok: bool) -> str:
    return "MET" if ok else "MISSED"


def log(*args: Any) -> None:
    print(*args, flush=True)
