"""Runs in flight: how many runs one worker holds at once while they wait on the model.

Workload: runs of 3 model turns, one pure tool call per turn but the last, against
``bench/slowapi.py``, a fake Messages API that answers every call after a uniform random
2-6 s delay (mean 4 s). At each size N ("runs in flight"), R = 2N runs (``--runs-factor``)
are processed by, side by side in this one invocation:

  * ``app``: ``manage.py runagents --concurrency N --burst --lease-seconds 60`` in a
    subprocess over R bulk-inserted runs. Its figure is max(finished_at) - min(started_at)
    from the database (the launch-to-exit wall is kept too);
  * ``loop``: the seed's agent loop as N asyncio tasks over one ``AsyncAnthropic`` client, in
    this process, from the first request to the last finish (no database at all);
  * the ideal: R x turns x mean latency / N.

While a worker runs, a sampler reads every 50 ms the PostgreSQL connections to the bench
database (from its own connection, opened before the worker starts and excluded), and the
worker's VmRSS and Threads in /proc/<pid>/status; the peak RSS is the kernel's ru_maxrss of the
child (wait4), or the samples' maximum.

``pickup``: an idle ``runagents --concurrency 10 --poll-interval 30`` and the fake at zero
latency; 50 ``start_run`` 100 ms apart; pickup = the fake's time of a run's first request minus
the time start_run returned (committed). ``fleet``: 4 x ``runagents --concurrency 500 --burst``
over 4,000 runs in one database; peak connections against 4 x DB_POOL_SIZE (all a worker holds).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import resource
import signal
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench import common
from bench.common import log

DB = "da_bench_inflight"
TURNS = 3
LOGS = common.OUT / "inflight_logs"
DEFAULT_POOL_SIZE = 8  # the worker's DURABLE_AGENTS["DB_POOL_SIZE"] default


# --- the slow fake API -------------------------------------------------------------------


def slow_api(
    min_latency: float, max_latency: float, seed: int | None
) -> contextlib.AbstractContextManager[str]:
    """``python -m bench.slowapi`` in its own process; yields its base URL."""
    args = ["bench.slowapi", "--port", "0"]
    args += ["--latency", f"{min_latency}-{max_latency}"]
    if seed is not None:
        args += ["--seed", str(seed)]
    return common.serving(args, "slow fake API")


# --- sampling ----------------------------------------------------------------------------


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS, VmHWM (kB) and Threads of ``pid``; {} once it is gone (or a zombie)."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key = line.split(":", 1)[0]
                if key in ("VmRSS", "VmHWM", "Threads"):
                    out[key] = int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError, ValueError):
        return {}
    return out


class Sampler(threading.Thread):
    """Every ``interval`` s: PostgreSQL connections to the database of ``url`` (if given) and
    the summed VmRSS/Threads of ``pids``. The database connection is opened by the caller's
    thread in ``__init__``, before any worker starts, and is excluded from the count."""

    def __init__(self, pids: list[int], url: str | None, interval: float = 0.05) -> None:
        super().__init__(daemon=True)
        self.pids = pids
        self.interval = interval
        self.stop = threading.Event()
        self.conn = None
        if url:
            import psycopg

            self.conn = psycopg.connect(url, autocommit=True)
        self.samples = 0
        self.pg_max = 0
        self.pg_sum = 0
        self.rss_max_kb = 0  # summed over pids
        self.threads_max = 0  # summed over pids
        self.hwm_kb: dict[int, int] = {}  # last VmHWM seen, per pid
        self.rss_max_by_pid: dict[int, int] = {}

    def sample(self) -> None:
        if self.conn is not None:
            n = self.conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                " AND pid <> pg_backend_pid()"
            ).fetchone()[0]
            self.pg_max = max(self.pg_max, n)
            self.pg_sum += n
        rss = threads = 0
        for pid in self.pids:
            st = proc_status(pid)
            if "VmRSS" in st:
                rss += st["VmRSS"]
                self.rss_max_by_pid[pid] = max(self.rss_max_by_pid.get(pid, 0), st["VmRSS"])
            if "VmHWM" in st:
                self.hwm_kb[pid] = st["VmHWM"]
            threads += st.get("Threads", 0)
        self.rss_max_kb = max(self.rss_max_kb, rss)
        self.threads_max = max(self.threads_max, threads)
        self.samples += 1

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                self.sample()
                self.stop.wait(self.interval)
        finally:
            if self.conn is not None:
                self.conn.close()

    def finish(self) -> None:
        self.stop.set()
        self.join()


def wait_children(
    procs: list[subprocess.Popen[bytes]], timeout: float
) -> tuple[dict[int, float], dict[int, int], bool]:
    """Reap ``procs`` with wait4 (for ru_maxrss, the child's exact peak RSS in kB), polling
    every 10 ms; after ``timeout`` s, SIGTERM then SIGKILL. Returns exit times (perf_counter)
    and ru_maxrss by pid, and whether the timeout struck. Sets each Popen's returncode."""
    deadline = time.perf_counter() + timeout
    ended: dict[int, float] = {}
    maxrss: dict[int, int] = {}
    timed_out = False
    pending = {p.pid: p for p in procs}
    while pending:
        for pid, p in list(pending.items()):
            got, status, usage = os.wait4(pid, os.WNOHANG)
            if got:
                ended[pid] = time.perf_counter()
                maxrss[pid] = usage.ru_maxrss
                p.returncode = os.waitstatus_to_exitcode(status)
                del pending[pid]
        if not pending:
            break
        if not timed_out and time.perf_counter() > deadline:
            timed_out = True
            log(f"  !! timeout after {timeout:.0f} s: SIGTERM to {sorted(pending)}")
            for p in pending.values():
                p.send_signal(signal.SIGTERM)
            deadline = time.perf_counter() + 20
        elif timed_out and time.perf_counter() > deadline:
            for p in pending.values():
                p.kill()
            deadline = float("inf")
        time.sleep(0.01)
    return ended, maxrss, timed_out


def scan_log(path: Path) -> dict[str, Any]:
    """Counts of ERROR / WARNING / Traceback lines in a worker's log, and the first few."""
    counts: Counter[str] = Counter()
    first: list[str] = []
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return {"lines": 0, "counts": {}, "first": []}
    lines = text.splitlines()
    for line in lines:
        for word in ("Traceback", "CRITICAL", "ERROR", "WARNING"):
            if word in line:
                counts[word] += 1
                if len(first) < 8:
                    first.append(line[:300])
                break
    return {"lines": len(lines), "counts": dict(counts), "first": first}


# --- the worker sides (app, fleet) -------------------------------------------------------


def worker_env(url: str, base_url: str, pool_size: int | None) -> dict[str, str]:
    extra = {"ANTHROPIC_API_KEY": "x"}
    if pool_size is not None:
        extra["DA_BENCH_POOL_SIZE"] = str(pool_size)
    return common.bench_env(url, base_url, **extra)


def worker_cmd(n: int, *args: str) -> list[str]:
    """``runagents --concurrency n``: by default a burst worker (60 s leases), else ``args``."""
    args = args or ("--burst", "--lease-seconds", "60")
    return [common.PY, "manage.py", "runagents", "--concurrency", str(n), *args]


def db_outcome(url: str) -> dict[str, Any]:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        statuses = dict(
            conn.execute("SELECT status, count(*) FROM agent_run GROUP BY status").fetchall()
        )
        span, first_start, last_finish = conn.execute(
            "SELECT EXTRACT(EPOCH FROM max(finished_at) - min(started_at)),"
            " EXTRACT(EPOCH FROM min(started_at)), EXTRACT(EPOCH FROM max(finished_at))"
            " FROM agent_run"
        ).fetchone()
        steps = conn.execute("SELECT count(*) FROM agent_step WHERE seq > 0").fetchone()[0]
        errors = [
            r[0][:300]
            for r in conn.execute(
                "SELECT DISTINCT error FROM agent_run WHERE error <> '' LIMIT 5"
            ).fetchall()
        ]
    return {
        "statuses": statuses,
        "span_s": float(span) if span is not None else None,
        "first_start": float(first_start) if first_start is not None else None,
        "last_finish": float(last_finish) if last_finish is not None else None,
        "steps": steps,
        "run_errors": errors,
    }


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def worker_side(
    kind: str,
    n: int,
    runs: int,
    base_url: str,
    pool_size: int | None,
    timeout: float,
    procs: int = 1,
    db: str | None = None,
) -> dict[str, Any]:
    """``procs`` worker processes of ``kind`` with ``n`` slots each, over ``runs`` runs."""
    url = common.fresh_db(db or f"{DB}_{kind}")
    common.bulk_insert_runs(url, runs, TURNS)
    LOGS.mkdir(parents=True, exist_ok=True)
    env = worker_env(url, base_url, pool_size)
    sampler = Sampler([], url)  # connects now, before any worker
    logs = [LOGS / f"{kind}_{n}{f'_{i}' if procs > 1 else ''}.log" for i in range(procs)]
    files = [path.open("wb") for path in logs]
    t0, t0_epoch = time.perf_counter(), time.time()
    children = [
        subprocess.Popen(
            worker_cmd(n),
            cwd=common.ROOT,
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
        )
        for f in files
    ]
    sampler.pids = [c.pid for c in children]
    sampler.start()
    try:
        ended, maxrss, timed_out = wait_children(children, timeout)
    finally:
        sampler.finish()
        for f in files:
            f.close()
    wall = max(ended.values()) - t0
    out = db_outcome(url)
    res: dict[str, Any] = {
        "side": kind,
        "procs": procs,
        "concurrency": n,
        "runs": runs,
        "wall_s": out["span_s"],
        "process_wall_s": wall,
        "process_wall_each_s": [ended[c.pid] - t0 for c in children],
        # Start-up (interpreter, Django, first claim) and the way out (burst exit, shutdown).
        "launch_to_first_claim_s": _minus(out["first_start"], t0_epoch),
        "last_finish_to_exit_s": _minus(t0_epoch + wall, out["last_finish"]),
        "exit_codes": [c.returncode for c in children],
        "timed_out": timed_out,
        "statuses": out["statuses"],
        "steps": out["steps"],
        "run_errors": out["run_errors"],
        "peak_pg_connections": sampler.pg_max,
        "mean_pg_connections": sampler.pg_sum / max(1, sampler.samples),
        "peak_threads": sampler.threads_max,
        # ru_maxrss of each child is exact; fall back on the last VmHWM / samples.
        "peak_rss_kb": max(
            (
                maxrss.get(c.pid)
                or max(sampler.hwm_kb.get(c.pid, 0), sampler.rss_max_by_pid.get(c.pid, 0))
                for c in children
            ),
            default=0,
        ),
        "peak_rss_kb_each": [maxrss.get(c.pid, 0) for c in children],
        "peak_rss_kb_sum_sampled": sampler.rss_max_kb,
        "samples": sampler.samples,
        "logs": [str(p.relative_to(common.ROOT)) for p in logs],
        "log_scan": [scan_log(p) for p in logs],
    }
    succeeded = out["statuses"].get("succeeded", 0)
    problems = []
    if succeeded != runs:
        problems.append(f"{succeeded}/{runs} runs succeeded ({out['statuses']})")
    if any(res["exit_codes"]):
        problems.append(f"exit codes {res['exit_codes']}")
    if timed_out:
        problems.append(f"timed out after {timeout:.0f} s")
    if problems:
        res["error"] = "; ".join(problems)
    common.drop_db(db or f"{DB}_{kind}")
    return res


# --- the loop side -----------------------------------------------------------------------


async def _loop_runs(base_url: str, n: int, runs: int) -> dict[str, Any]:
    import anthropic
    import httpx2

    from bench.benchapp.agents import bench, noop

    params = bench.request_params(bench.model)
    client = anthropic.AsyncAnthropic(
        base_url=base_url,
        api_key="x",
        max_retries=0,
        http_client=anthropic.DefaultAsyncHttpxClient(
            limits=httpx2.Limits(max_connections=None, max_keepalive_connections=n)
        ),
    )
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(runs):
        queue.put_nowait(i)
    first: list[float] = []
    finishes: list[float] = []
    errors: list[str] = []

    async def slot() -> None:
        while True:
            try:
                i = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            messages: list[dict[str, Any]] = [
                {"role": "user", "content": common.task_text(i, TURNS)}
            ]
            try:
                while True:
                    if not first:
                        first.append(time.perf_counter())
                    resp = await client.messages.create(messages=messages, **params)
                    messages.append({"role": "assistant", "content": resp.content})
                    if resp.stop_reason != "tool_use":
                        break
                    results = [
                        {
                            "type": "tool_result",
                            "tool_use_id": block.id,
                            "content": noop.func(**block.input),
                        }
                        for block in resp.content
                        if block.type == "tool_use"
                    ]
                    messages.append({"role": "user", "content": results})
                if resp.stop_reason != "end_turn" or len(messages) != 2 * TURNS:
                    errors.append(f"run {i}: {resp.stop_reason} after {len(messages)} messages")
            except Exception as exc:  # noqa: BLE001 - counted and reported, fails the side
                errors.append(f"run {i}: {type(exc).__name__}: {exc}")
            finishes.append(time.perf_counter())

    async with client:
        await asyncio.gather(*(slot() for _ in range(n)))
    return {
        "wall_s": max(finishes) - first[0],
        "done": len(finishes),
        "errors": errors[:5],
        "error_count": len(errors),
    }


def loop_side(n: int, runs: int, base_url: str) -> dict[str, Any]:
    pid = os.getpid()
    before = proc_status(pid)
    sampler = Sampler([pid], None)
    sampler.start()
    try:
        out = asyncio.run(_loop_runs(base_url, n, runs))
    finally:
        sampler.finish()
    res: dict[str, Any] = {
        "side": "loop",
        "procs": 1,
        "concurrency": n,
        "runs": runs,
        "wall_s": out["wall_s"],
        "peak_pg_connections": 0,
        # The event loop's thread (asyncio's resolver pool adds a few); not the sampler's.
        "peak_threads": sampler.threads_max - 1,
        "peak_rss_kb": sampler.rss_max_kb,
        "rss_before_kb": before.get("VmRSS", 0),
        "rss_delta_kb": sampler.rss_max_kb - before.get("VmRSS", 0),
        "samples": sampler.samples,
        "error_count": out["error_count"],
    }
    if out["error_count"] or out["done"] != runs:
        res["error"] = f"{out['error_count']} of {out['done']}/{runs} runs failed: {out['errors']}"
    return res


# --- sizes ---------------------------------------------------------------------------------


def ideal_s(runs: int, n: int, mean_latency: float) -> float:
    return runs * TURNS * mean_latency / n


def one_size(n: int, a: argparse.Namespace, sides: list[str]) -> dict[str, Any]:
    runs = max(1, round(n * a.runs_factor))
    mean = (a.min_latency + a.max_latency) / 2
    ideal = ideal_s(runs, n, mean)
    timeout = max(180.0, 6 * ideal + 60)
    log(f"[inflight] {n} in flight: {runs} runs x {TURNS} turns, ideal {ideal:.1f} s")
    res: dict[str, Any] = {"inflight": n, "runs": runs, "ideal_s": ideal, "sides": {}}
    for side in sides:
        # A fresh fake per side, same seed: the same sequence of latencies for every side.
        with slow_api(a.min_latency, a.max_latency, a.seed) as base_url:
            if side == "loop":
                r = loop_side(n, runs, base_url)
            else:
                r = worker_side(side, n, runs, base_url, a.pool_size, timeout)
            r["fake_stats"] = common.get_json(base_url, "/_stats")
        r["ratio_to_ideal"] = r["wall_s"] / ideal if r.get("wall_s") else None
        res["sides"][side] = r
        extra = (
            f" (launch-to-exit {r['process_wall_s']:.2f} s: first claim "
            f"{_f(r['launch_to_first_claim_s'])} s after launch, exit "
            f"{_f(r['last_finish_to_exit_s'])} s after the last finish)"
            if "process_wall_s" in r
            else ""
        )
        log(
            f"  {side}: {_f(r.get('wall_s'))} s{extra}; peak PG {r['peak_pg_connections']}, "
            f"threads {r['peak_threads']}, RSS {r['peak_rss_kb'] / 1024:.0f} MB; "
            f"fake late max {r['fake_stats']['late_max_ms']:.0f} ms"
        )
        if r.get("error"):
            log(f"  !! {side} at {n} in flight FAILED: {r['error']}")
        for scan in r.get("log_scan", []):
            if scan["counts"]:
                log(f"  !! {side} worker log: {scan['counts']}; first: {scan['first'][:3]}")
    loop_wall = res["sides"].get("loop", {}).get("wall_s")
    for r in res["sides"].values():
        r["ratio_to_loop"] = r["wall_s"] / loop_wall if loop_wall and r.get("wall_s") else None
    return res


# --- pickup ----------------------------------------------------------------------------------


def _wait_ready(sampler_url: str, pid: int, limit: float = 30.0) -> str:
    """Until the idle worker is ready: a backend of the bench database is LISTENing, or the
    number of its connections has been stable (and > 0) for 2 s."""
    import psycopg

    t0 = time.perf_counter()
    last, since = -1, t0
    with psycopg.connect(sampler_url, autocommit=True) as conn:
        while time.perf_counter() - t0 < limit:
            if not proc_status(pid):
                raise RuntimeError("the pickup worker exited while starting")
            n, listening = conn.execute(
                "SELECT count(*), count(*) FILTER (WHERE query ILIKE 'LISTEN%')"
                " FROM pg_stat_activity WHERE datname = current_database()"
                " AND pid <> pg_backend_pid()"
            ).fetchone()
            if listening:
                return f"LISTEN seen after {time.perf_counter() - t0:.1f} s"
            now = time.perf_counter()
            if n != last:
                last, since = n, now
            elif n > 0 and now - since >= 2.0:
                return f"{n} connections stable for 2 s after {now - t0:.1f} s (no LISTEN)"
            time.sleep(0.05)
    return f"not ready after {limit:.0f} s (starting anyway)"


def pickup(count: int, interval: float, poll: float, warmup: int) -> dict[str, Any]:
    import psycopg

    url = common.fresh_db(f"{DB}_pickup")
    LOGS.mkdir(parents=True, exist_ok=True)
    logpath = LOGS / "pickup.log"
    with slow_api(0, 0, None) as base_url:
        common.setup_django(url, base_url)
        import durable_agents

        with logpath.open("wb") as f:
            worker = subprocess.Popen(
                worker_cmd(10, "--poll-interval", str(poll)),
                cwd=common.ROOT,
                env=worker_env(url, base_url, None),
                stdout=f,
                stderr=subprocess.STDOUT,
            )
        try:
            ready = _wait_ready(url, worker.pid)
            log(f"[pickup] worker ready: {ready}")
            # Warm-up runs, not counted: a fresh worker's first model call pays one-off costs
            # (the SDK's lazy imports, the first connection) that are not pickup.
            with psycopg.connect(url, autocommit=True) as conn:
                for j in range(warmup):
                    durable_agents.start_run("bench", f"Warm-up run {j}.")
                deadline = time.perf_counter() + 2 * poll + 60
                while (
                    conn.execute(
                        "SELECT count(*) FROM agent_run WHERE status <> 'succeeded'"
                    ).fetchone()[0]
                    and time.perf_counter() < deadline
                ):
                    time.sleep(0.05)
            time.sleep(0.5)
            commits: dict[str, float] = {}
            calls: dict[str, float] = {}
            t0 = time.perf_counter()
            for i in range(count):
                delay = t0 + i * interval - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                key = f"Benchmark run {i}."
                calls[key] = time.time()
                durable_agents.start_run("bench", common.task_text(i, 1))
                commits[key] = time.time()
            deadline = time.perf_counter() + 2 * poll + 60
            with psycopg.connect(url, autocommit=True) as conn:
                while True:
                    done = conn.execute(
                        "SELECT count(*) FROM agent_run WHERE status = 'succeeded'"
                    ).fetchone()[0]
                    if done >= count + warmup or time.perf_counter() > deadline:
                        break
                    time.sleep(0.1)
            first_seen = common.get_json(base_url, "/_log")
        finally:
            code = common.stop(worker, 60)
    from django.db import connection

    connection.close()
    lat = [(first_seen[k] - t) * 1000 for k, t in commits.items() if k in first_seen]  # ms
    # From the call instead of its return: start_run's commit lies in between, so a worker
    # woken by the commit's notification may send its request before start_run has returned
    # (a negative pickup above).
    lat_call = [(first_seen[k] - t) * 1000 for k, t in calls.items() if k in first_seen]
    done -= warmup
    res = {
        "runs": count,
        "warmup_runs": warmup,
        "interval_s": interval,
        "poll_interval_s": poll,
        "ready": ready,
        "succeeded": done,
        "from_call_p50_ms": common.pct(lat_call, 50),
        "from_call_p95_ms": common.pct(lat_call, 95),
        "start_run_ms": [(commits[k] - calls[k]) * 1000 for k in commits],
        "picked_up": len(lat),
        "latencies_ms": lat,
        "p50_ms": common.pct(lat, 50),
        "p95_ms": common.pct(lat, 95),
        "max_ms": max(lat) if lat else float("nan"),
        "min_ms": min(lat) if lat else float("nan"),
        "worker_exit_code": code,
        "log": str(logpath.relative_to(common.ROOT)),
        "log_scan": scan_log(logpath),
    }
    problems = []
    if done < count or len(lat) < count:
        problems.append(f"{done}/{count} succeeded, {len(lat)} seen by the fake")
    if code:
        problems.append(f"worker exit code {code} after SIGTERM")
    if problems:
        res["error"] = "; ".join(problems)
    log(
        f"[pickup] {len(lat)}/{count} runs: start_run commit -> first model request "
        f"p50 {res['p50_ms']:.0f} ms, p95 {res['p95_ms']:.0f} ms, max {res['max_ms']:.0f} ms "
        f"(poll interval {poll:g} s; from the call to start_run: p50 "
        f"{res['from_call_p50_ms']:.0f} ms, p95 {res['from_call_p95_ms']:.0f} ms)"
    )
    if res.get("error"):
        log(f"  !! pickup: {res['error']}")
    if res["log_scan"]["counts"]:
        log(f"  !! pickup worker log: {res['log_scan']['counts']}: {res['log_scan']['first'][:3]}")
    common.drop_db(f"{DB}_pickup")
    return res


# --- fleet -----------------------------------------------------------------------------------


def fleet(a: argparse.Namespace) -> dict[str, Any]:
    mean = (a.min_latency + a.max_latency) / 2
    n, procs, runs = a.fleet_concurrency, a.fleet_procs, a.fleet_runs
    ideal = ideal_s(runs, n * procs, mean)
    log(f"[fleet] {procs} x runagents --concurrency {n} --burst, {runs} runs, ideal {ideal:.1f} s")
    with slow_api(a.min_latency, a.max_latency, a.seed) as base_url:
        r = worker_side(
            "app",
            n,
            runs,
            base_url,
            a.pool_size,
            max(240.0, 6 * ideal + 90),
            procs=procs,
            db=f"{DB}_fleet",
        )
        r["fake_stats"] = common.get_json(base_url, "/_stats")
    pool = a.pool_size if a.pool_size is not None else DEFAULT_POOL_SIZE
    r.update(
        side="fleet",
        ideal_s=ideal,
        ratio_to_ideal=r["wall_s"] / ideal if r.get("wall_s") else None,
        pool_size=pool,
        pg_connection_limit=procs * pool,
        target=f"peak PG connections <= {procs} x DB_POOL_SIZE = {procs * pool}",
    )
    r["met"] = r["peak_pg_connections"] <= r["pg_connection_limit"] and not r.get("error")
    log(
        f"[fleet] {_f(r.get('wall_s'))} s (ideal {ideal:.1f}), peak PG connections "
        f"{r['peak_pg_connections']} (target <= {r['pg_connection_limit']}) -> "
        f"{common.verdict(r['met'])}; peak RSS/process {r['peak_rss_kb'] / 1024:.0f} MB, "
        f"threads (all) {r['peak_threads']}"
    )
    if r.get("error"):
        log(f"  !! fleet FAILED: {r['error']}")
    for scan in r["log_scan"]:
        if scan["counts"]:
            log(f"  !! fleet worker log: {scan['counts']}; first: {scan['first'][:3]}")
    return r


# --- output ----------------------------------------------------------------------------------


def _f(v: float | None, fmt: str = ".2f") -> str:
    return "-" if v is None else format(v, fmt)


def table(sizes: list[dict[str, Any]]) -> list[str]:
    head = (
        "in flight | side | wall s | ideal s | ratio to loop | ratio to ideal "
        "| peak PG connections | peak threads | peak RSS MB"
    )
    rows = [head, re.sub(r"[^|]", "-", head)]
    for s in sizes:
        for side, r in s["sides"].items():
            rows.append(
                f"{s['inflight']} | {side}{' (FAILED)' if r.get('error') else ''} "
                f"| {_f(r.get('wall_s'))} | {s['ideal_s']:.2f} | {_f(r.get('ratio_to_loop'))} "
                f"| {_f(r.get('ratio_to_ideal'))} | {r['peak_pg_connections']} "
                f"| {r['peak_threads']} | {r['peak_rss_kb'] / 1024:.0f}"
            )
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--inflight", default=None, help="sizes, e.g. 100,500,1000")
    p.add_argument("--quick", action="store_true", help="sizes 100,500 and no fleet")
    p.add_argument("--runs-factor", type=float, default=2.0, help="runs = factor x in flight")
    p.add_argument("--sides", default="app,loop", help="comma list of: app, loop")
    p.add_argument("--skip", default="", help="comma list of: sizes, pickup, fleet")
    p.add_argument("--min-latency", type=float, default=2.0)
    p.add_argument("--max-latency", type=float, default=6.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--pool-size",
        type=int,
        default=None,
        help="DURABLE_AGENTS['DB_POOL_SIZE'] of the workers (via DA_BENCH_POOL_SIZE; "
        "default: the worker's own default)",
    )
    p.add_argument("--pickup-runs", type=int, default=50)
    p.add_argument("--pickup-interval", type=float, default=0.1)
    p.add_argument("--pickup-poll", type=float, default=30.0)
    p.add_argument("--pickup-warmup", type=int, default=1, help="uncounted runs first")
    p.add_argument("--fleet-procs", type=int, default=4)
    p.add_argument("--fleet-concurrency", type=int, default=500)
    p.add_argument("--fleet-runs", type=int, default=4000)
    a = p.parse_args(argv)
    sizes_arg = a.inflight or ("100,500" if a.quick else "100,500,1000")
    skip = {s for s in a.skip.split(",") if s}
    if a.quick:
        skip.add("fleet")
    sides = [s for s in a.sides.split(",") if s]
    if unknown := set(sides) - {"app", "loop"}:
        p.error(f"unknown sides: {', '.join(sorted(unknown))}")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:  # the workers and the loop hold thousands of sockets; children inherit it
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    res: dict[str, Any] = {
        "turns": TURNS,
        "latency_s": [a.min_latency, a.max_latency],
        "mean_latency_s": (a.min_latency + a.max_latency) / 2,
        "runs_factor": a.runs_factor,
        "seed": a.seed,
        "pool_size": a.pool_size,
        "sides": sides,
        "nofile": resource.getrlimit(resource.RLIMIT_NOFILE)[0],
        "sizes": [],
    }
    failures: list[str] = []
    if "sizes" not in skip:
        for n in (int(x) for x in sizes_arg.split(",") if x):
            s = one_size(n, a, sides)
            res["sizes"].append(s)
            failures += [f"{side}@{n}" for side, r in s["sides"].items() if r.get("error")]
            common.write_result("inflight", res)  # keep what is done if a later size dies
        log("")
        for row in table(res["sizes"]):
            log(row)
        log("")
    if "pickup" not in skip:
        res["pickup"] = pickup(a.pickup_runs, a.pickup_interval, a.pickup_poll, a.pickup_warmup)
        if res["pickup"].get("error"):
            failures.append("pickup")
    if "fleet" not in skip:
        res["fleet"] = fleet(a)
        if res["fleet"].get("error"):
            failures.append("fleet")
    res["failures"] = failures
    path = common.write_result("inflight", res)
    log(f"[inflight] wrote {path.relative_to(common.ROOT)}")
    if failures:
        raise SystemExit(f"[inflight] FAILED: {', '.join(failures)}")
    return res


if __name__ == "__main__":
    main()
