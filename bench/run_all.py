"""Run every benchmark and write docs/benchmarks.md and docs/img/*.png.

    python -m bench.run_all            # full sizes, under 10 minutes on 2 cores
    python -m bench.run_all --quick    # small sizes, about 3 minutes
    python -m bench.run_all --only loop,commit

Each benchmark runs in its own process (each configures Django for its own da_bench_*
database) and leaves its figures in bench/out/<name>.json; bench/report.py renders them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from bench import common

FULL = {
    "loop": ["--runs", "50", "--reps", "3"],
    "commit": ["--n", "2000", "--rounds", "10"],
    "peers": ["--runs", "50", "--reps", "2", "--q2-n", "300"],
    "scale": ["--large", "1000000", "--claims", "1600", "--blocks", "4"],
    "workers": ["--runs", "50"],
    "profile_step": ["--runs", "40"],
    "longrun": ["--turns", "1101", "--rebuild-reps", "15"],
    "memory": ["--runs", "10000", "--concurrency", "4"],
}
QUICK = {
    "loop": ["--runs", "20", "--reps", "2"],
    "commit": ["--n", "500", "--rounds", "5"],
    "peers": ["--runs", "20", "--reps", "1", "--q2-n", "100"],
    "scale": ["--large", "100000", "--claims", "400", "--blocks", "2"],
    "workers": ["--runs", "15"],
    "profile_step": ["--runs", "20"],
    "longrun": ["--turns", "201", "--rebuild-reps", "5"],
    "memory": ["--runs", "2000", "--concurrency", "4"],
}


def _version(pkg: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(pkg)
    except PackageNotFoundError:
        return "not installed"


def machine() -> dict[str, object]:
    import psycopg

    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gb = None
    try:
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem_gb = round(kb / 1024 / 1024, 1)
    except (OSError, ValueError, IndexError):
        pass
    with psycopg.connect(common.ADMIN_DSN, autocommit=True) as conn:
        pg = conn.execute("SELECT version()").fetchone()[0]
        settings = {
            name: conn.execute(f"SHOW {name}").fetchone()[0]
            for name in ("synchronous_commit", "fsync", "wal_sync_method", "shared_buffers")
        }
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "memory_gb": mem_gb,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "postgresql": pg.split(" on ")[0],
        "pg_settings": settings,
        "versions": {
            p: _version(p)
            for p in ("Django", "anthropic", "httpx2", "psycopg", "dbos", "django-q2", "matplotlib")
        },
        "loadavg_start": os.getloadavg(),
        "git": _git(),
    }


def _git() -> dict[str, object]:
    def out(*args: str) -> str:
        try:
            return subprocess.run(
                ["git", *args], cwd=common.ROOT, capture_output=True, text=True, check=True
            ).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return ""

    dirty = [ln[3:] for ln in out("status", "--porcelain", "--", "durable_agents").splitlines()]
    return {"head": out("rev-parse", "--short", "HEAD"), "durable_agents_dirty": dirty}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", default="")
    a = p.parse_args(argv)
    sizes = QUICK if a.quick else FULL
    names = [n for n in sizes if not a.only or n in a.only.split(",")]
    common.OUT.mkdir(parents=True, exist_ok=True)
    info = machine()
    info["mode"] = "quick" if a.quick else "full"
    timings: dict[str, float] = {}
    failures: dict[str, str] = {}
    t_all = time.perf_counter()
    for name in names:
        print(f"== {name} {' '.join(sizes[name])}", flush=True)
        t = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", f"bench.{name}", *sizes[name]],
            cwd=common.ROOT,
            env={**os.environ, "PYTHONPATH": str(common.ROOT)},
        )
        timings[name] = time.perf_counter() - t
        if proc.returncode:
            failures[name] = f"exit code {proc.returncode}"
            print(f"!! {name} failed ({proc.returncode})", flush=True)
    info["bench_seconds"] = timings
    info["total_seconds"] = time.perf_counter() - t_all
    info["loadavg_end"] = os.getloadavg()
    info["failures"] = failures
    info["ran"] = names
    (common.OUT / "machine.json").write_text(json.dumps(info, indent=2, default=str))
    from bench import report

    report.render()
    print(f"== done in {info['total_seconds']:.0f}s; wrote docs/benchmarks.md", flush=True)
    if failures:
        sys.exit(1)


if __name__ == "__main__":
    main()
