"""Run every benchmark and write docs/benchmarks.md and docs/img/*.png.

    python -m bench.run_all            # full sizes: about 20 minutes (in flight alone ~10)
    python -m bench.run_all --quick    # small sizes: about 6 minutes
    python -m bench.run_all --only loop,commit
    python -m bench.run_all --only waits       # durable waits: about 2 minutes
    python -m bench.run_all --only admin_scale # the admin at 10,000 vs 1,000,000 runs
    python -m bench.run_all --only keys        # concurrency keys: claim cost, fair share
    python -m bench.run_all --only quota       # many runs, one rate-limited model quota
    python -m bench.run_all --only keys_crash  # keys of limit 2, one of 3 workers SIGKILLed
    python -m bench.run_all --only batches     # runs in batches: commit rate, claim, cost
    python -m bench.run_all --before 14be984   # also measure git ref 14be984 first
    python -m bench.run_all --help             # lists every benchmark --only accepts

failover needs a private PostgreSQL cluster (tests/pgcluster.py: the server binaries and the
postgres OS user); without them run_all skips it and says why.

Each benchmark runs in its own process (each configures Django for its own da_bench_*
database) and leaves its figures in bench/out/<name>.json; bench/report.py renders them.

--before REF measures REF first, then the current tree, in the same invocation: REF is
checked out with `git worktree add --detach /tmp/da-bench-before-<sha> REF`, and that
checkout's own `python -m bench.run_all` (same --quick/--only, never the in-flight, waits,
compaction or admin_scale benchmarks, which older refs lack) runs inside it with this
interpreter, so its bench code and durable_agents are REF's. Its bench/out/*.json are copied to
bench/out/before/ (emptied first) with bench/out/before/ref.json naming REF, and the
worktree is removed. If that run fails, it says so loudly and the current tree is measured
anyway. The report then adds a "Before and after" table of targets 1-7. The before run
roughly doubles the time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
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
    "inflight": ["--inflight", "100,500,1000"],
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
    "inflight": ["--quick", "--inflight", "100,300"],
}
FULL["waits"] = []  # its defaults: 100,000 waiting runs, 1,000 claims a side, 1,000 woken
QUICK["waits"] = ["--claims", "600", "--blocks", "3"]
FULL["compaction"] = []
QUICK["compaction"] = ["--turns", "1000", "--every", "100"]
# The admin at production size: 10,000 vs 1,000,000 runs (the filled databases are kept between
# invocations; the first fill takes about 2 minutes). 10,000,000 is measured by hand, once:
# python -m bench.admin_scale --sizes 10000,10000000 --reps 5 --out admin_scale_10m
# Concurrency keys: the claim with 1,000 keys against none, and fair share (about 4 minutes).
FULL["keys"] = []
QUICK["keys"] = ["--quick"]
# Many runs, one model quota: two workers against a fake that rate-limits like the API (about
# 2 minutes; 1 with --quick).
FULL["quota"] = []
QUICK["quota"] = ["--quick"]
# Concurrency keys across a crash: 50 keys of limit 2, three workers, one SIGKILLed (about 30 s).
FULL["keys_crash"] = []
QUICK["keys_crash"] = ["--quick"]
FULL["admin_scale"] = []
QUICK["admin_scale"] = ["--sizes", "10000,100000", "--reps", "3"]
# Encryption at rest on the commit path and the rebuild (about a minute).
FULL["encryption"] = []
QUICK["encryption"] = ["--n", "400", "--reps", "10"]
# The claim ordered by priority against all at 0 (100,000 pending runs a side; about 2 minutes).
FULL["priority"] = []
QUICK["priority"] = ["--quick", "--pending", "20000"]
# The step commit through Django's cursor wrapper against the bare psycopg cursor (seconds).
FULL["instrumented_commit"] = []
QUICK["instrumented_commit"] = ["--steps", "600", "--blocks", "4"]
# Debounced starts: many start_run calls on one key make one run (about 15 s).
FULL["debounce"] = []
QUICK["debounce"] = ["--calls", "200", "--over", "1", "--debounce", "2", "--poll-interval", "0.5"]
# Replay of a 200-turn recorded run (seconds).
FULL["replay"] = []
QUICK["replay"] = ["--repeat", "3"]
# Forks of a long run: fork_run, the bytes a fork adds, its rebuild (about a minute).
FULL["fork"] = []
QUICK["fork"] = ["--steps", "500", "--forks", "10", "--reps", "5"]
# A big tree's cancel and a big event (111,111 runs; 11,111 with --generations 4).
FULL["trees_events"] = []
QUICK["trees_events"] = ["--generations", "4"]
# Live streams: readers of live runs in one asyncio process (about 2 minutes).
FULL["live"] = []
QUICK["live"] = ["--runs", "20", "--readers", "200", "--turns", "10", "--away", "3"]
# Live readers through the real view under uvicorn: the connections they hold, an admin page
# beside them, the caps' 503s (about a minute at 1,000 readers).
FULL["live_readers"] = []
QUICK["live_readers"] = ["--readers", "300", "--runs", "30", "--over", "20", "--pings", "20"]
# Schedules: one run per slot under worker kills, and what firing costs the claims.
FULL["schedules"] = []
QUICK["schedules"] = ["--quick"]
FULL["compression"] = []
QUICK["compression"] = ["--steps", "4000", "--blocks", "4"]
# The step log at scale: 10 days of a million steps against one (the 50-day figure of
# docs/howto/sizing.md is `python -m bench.step_log`, its fill about 15 minutes), and
# migration 0025 on a filled table while a connection commits.
FULL["step_log"] = ["--days", "1,10", "--rounds", "3"]
QUICK["step_log"] = ["--days", "1,2", "--rounds", "1"]
FULL["step_log_upgrade"] = ["--steps", "2000000"]
QUICK["step_log_upgrade"] = ["--steps", "200000"]
# upgrade_runs over a whole agent version: 10,000 runs in flight moved (about 30 s).
FULL["upgrade_runs"] = []
QUICK["upgrade_runs"] = ["--runs", "2000", "--reps", "1"]
# The database cut in the middle of a burst: needs a private PostgreSQL cluster (below).
# Calls from services: 1,000 callback URLs completed at once, replayed, forged, posted twice
# (about 30 s).
FULL["callbacks"] = []
QUICK["callbacks"] = ["--runs", "300"]
FULL["get_result"] = []
QUICK["get_result"] = ["--runs", "300"]
# A run's inbox: the worker's look before each model call with 100,000 messages stored, a send,
# a fold (about 30 s).
FULL["messages"] = []
QUICK["messages"] = ["--runs", "500", "--sends", "200"]
FULL["versions"] = []  # 100,000 pending runs, five pairs of 1,000 claims
QUICK["versions"] = ["--quick"]
# Runs in batches: 10,000 turns committed from one Message Batch, the claim while they wait,
# the same workload's cost directly and in batches (about 3 minutes; 45 s with --quick).
FULL["batches"] = []
QUICK["batches"] = ["--quick"]
# The CPU of one resume: a woken run's last two steps in one slot (about 30 s).
FULL["resume"] = []
QUICK["resume"] = ["--runs", "100"]
FULL["failover"] = []
QUICK["failover"] = [
    "--runs", "60", "--slots", "20", "--outage", "5", "--timeout", "120",
]  # fmt: skip

# bench/*.py scripts with a main that are not benchmarks: the fake APIs the benchmarks serve
# (tests/unit/test_bench_reachable.py checks every other one is in FULL and QUICK).
NOT_BENCHES = {"run_all": "this script", "fakeapi": "a fake API", "slowapi": "a fake API"}


def _failover_unavailable() -> str | None:
    from bench.failover import unavailable

    return unavailable()


# What a benchmark needs beyond the PostgreSQL server of BENCH_PG: a function that says why it
# cannot run here (run_all then skips it, saying so), or None.
REQUIRES = {"failover": _failover_unavailable}


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
    try:
        head = _git_out("rev-parse", "--short", "HEAD")
    except (OSError, subprocess.CalledProcessError):
        head = ""
    # Not _git_out(): its strip() would eat the first line's leading status column.
    try:
        status = subprocess.run(
            ["git", "status", "--porcelain", "--", "durable_agents"],
            cwd=common.ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        status = ""
    dirty = [ln[3:] for ln in status.splitlines() if ln.strip()]
    return {"head": head, "durable_agents_dirty": dirty}


BEFORE = common.OUT / "before"
# Benchmarks never run for --before: the in-flight one did not exist before the rewrite, nor
# waits, compaction, keys, quota and keys_crash before their features (quota measures a
# checkout before its own way: python -m bench.quota --before DIR).
NOT_BEFORE = {
    "inflight",
    "waits",
    "compaction",
    "admin_scale",
    "keys",
    "quota",
    "keys_crash",
    "encryption",  # the ref before it has no encryption
    # Reachable from run_all only since r33 (older refs run them by hand, if at all).
    "priority",
    "instrumented_commit",
    "debounce",
    "replay",
    "fork",
    "trees_events",
    "live",
    "live_readers",
    "schedules",
    "failover",
    "compression",
    "step_log",
    "step_log_upgrade",
    "upgrade_runs",
    "batches",  # runs in batches are newer than any ref measured before
    "resume",  # newer than any ref measured before
}


def _loud(msg: str) -> None:
    bar = "!" * 78
    print(f"{bar}\n!! {msg}\n{bar}", file=sys.stderr, flush=True)


def _git_out(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=common.ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()


def _remove_worktree(path: Path) -> None:
    subprocess.run(
        ["git", "worktree", "remove", "--force", str(path)], cwd=common.ROOT, check=False
    )
    if path.exists():
        shutil.rmtree(path, ignore_errors=True)
    subprocess.run(["git", "worktree", "prune"], cwd=common.ROOT, check=False)


def run_before(ref: str, quick: bool, names: list[str], invocation: str) -> dict[str, object]:
    """Measure git ``ref`` in a temporary worktree; results go to bench/out/before/."""
    if BEFORE.exists():
        shutil.rmtree(BEFORE)
    BEFORE.mkdir(parents=True)
    names = [n for n in names if n not in NOT_BEFORE]
    result: dict[str, object] = {
        "ref": ref,
        "invocation": invocation,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "names": names,
    }
    if not names:
        _loud(f"--before {ref}: nothing to run (only {sorted(NOT_BEFORE)} selected)")
        shutil.rmtree(BEFORE)
        return {**result, "error": "nothing to run"}
    try:
        sha = _git_out("rev-parse", "--verify", f"{ref}^{{commit}}")
        short = _git_out("rev-parse", "--short", sha)
    except (OSError, subprocess.CalledProcessError) as e:
        _loud(f"--before {ref}: not a git commit here ({e}); measuring the current tree only")
        shutil.rmtree(BEFORE)
        return {**result, "error": f"cannot resolve {ref}"}
    result.update(sha=sha, short_sha=short)
    wt = Path(f"/tmp/da-bench-before-{short}")
    if wt.exists():
        _remove_worktree(wt)
    t = time.perf_counter()
    rc: int | None = None
    try:
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(wt), sha], cwd=common.ROOT, check=True
        )
        args = ["--only", ",".join(names)] + (["--quick"] if quick else [])
        print(f"== before: {ref} ({short}) in {wt}: bench.run_all {' '.join(args)}", flush=True)
        proc = subprocess.run(
            [sys.executable, "-m", "bench.run_all", *args],
            cwd=wt,
            env={**os.environ, "PYTHONPATH": str(wt)},
        )
        rc = proc.returncode
        copied = []
        for f in sorted((wt / "bench" / "out").glob("*.json")):
            shutil.copy2(f, BEFORE / f.name)
            copied.append(f.stem)
        result["copied"] = copied
    except (OSError, subprocess.CalledProcessError) as e:
        result["error"] = str(e)
    finally:
        _remove_worktree(wt)
    result.update(returncode=rc, seconds=time.perf_counter() - t)
    missing = [n for n in names if n not in result.get("copied", [])]
    result["failed"] = bool(result.get("error") or rc or missing)
    (BEFORE / "ref.json").write_text(json.dumps(result, indent=2))
    if result["failed"]:
        _loud(
            f"--before {ref} ({short}) FAILED: exit code {rc}, error {result.get('error')}, "
            f"missing results {missing}; going on with the current tree"
        )
    else:
        print(f"== before: {ref} ({short}) done in {result['seconds']:.0f}s", flush=True)
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description="Run the benchmarks and render docs/benchmarks.md.",
        epilog="benchmarks, in the order they run: " + ", ".join(FULL),
    )
    p.add_argument("--quick", action="store_true", help="the small sizes (QUICK)")
    p.add_argument(
        "--only",
        default="",
        metavar="NAME[,NAME...]",
        help="only these benchmarks, of: " + ", ".join(FULL),
    )
    p.add_argument(
        "--before",
        metavar="REF",
        default="",
        help="first measure git REF in a temporary worktree (bench/out/before/)",
    )
    a = p.parse_args(argv)
    sizes = QUICK if a.quick else FULL
    only = [n for n in a.only.split(",") if n]
    unknown = [n for n in only if n not in sizes]
    if unknown:
        p.error(f"--only: unknown {', '.join(unknown)}; benchmarks: {', '.join(sizes)}")
    names = [n for n in sizes if not only or n in only]
    common.OUT.mkdir(parents=True, exist_ok=True)
    invocation = time.strftime("%Y-%m-%dT%H:%M:%S") + f"-{os.getpid()}"
    before = run_before(a.before, a.quick, names, invocation) if a.before else None
    info = machine()
    info["invocation"] = invocation
    if before is not None:
        info["before"] = before
    info["mode"] = "quick" if a.quick else "full"
    timings: dict[str, float] = {}
    failures: dict[str, str] = {}
    t_all = time.perf_counter()
    skipped: dict[str, str] = {}
    for name in names:
        why = REQUIRES[name]() if name in REQUIRES else None
        if why:
            skipped[name] = why
            print(f"== {name} skipped: {why}", flush=True)
            continue
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
    if before is not None and (
        before.get("failed") or before.get("error") not in (None, "nothing to run")
    ):
        failures["before"] = f"--before {a.before}: see bench/out/before/ref.json"
        _loud(f"the --before {a.before} run failed; its column is partial or missing")
    info["failures"] = failures
    info["skipped"] = skipped
    info["ran"] = names
    (common.OUT / "machine.json").write_text(json.dumps(info, indent=2, default=str))
    from bench import report

    report.render()
    print(f"== done in {info['total_seconds']:.0f}s; wrote docs/benchmarks.md", flush=True)
    if failures:
        sys.exit(1)


if __name__ == "__main__":
    main()
