"""Target 5, workers: throughput with 1, 2, 4 and 8 workers, as processes (``runagents``
each) and as ``--concurrency`` slots of one process, on this machine's cores.

The worker processes (``runagents --concurrency C``, not burst) are started first and left to
connect; then all the runs are inserted in one transaction, and the workers are stopped with
SIGTERM once every run succeeded. Throughput is taken from the database clock: committed
worker steps over the span from the first worker-committed step to the last finished run, so
process start-up (several seconds of CPU for 8 processes on 2 cores) is not counted. While
the workers run, a sampler polls pg_stat_activity and pg_locks every few milliseconds and
records every backend of the bench database that waits on a lock (wait_event_type = 'Lock'),
by statement.
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from collections import Counter
from typing import Any

from bench import common
from bench.common import log

DB = "da_bench_workers"
CONFIGS = [(1, 1), (2, 1), (4, 1), (8, 1), (1, 2), (1, 4), (1, 8)]


class LockSampler(threading.Thread):
    def __init__(self, url: str, interval: float = 0.005) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.interval = interval
        self.stop = threading.Event()
        self.samples = 0
        self.active = 0
        self.lock_waits: Counter[str] = Counter()
        self.ungranted = 0
        self.wait_events: Counter[str] = Counter()

    def run(self) -> None:
        import psycopg

        with psycopg.connect(self.url, autocommit=True) as conn:
            while not self.stop.is_set():
                rows = conn.execute(
                    "SELECT state, wait_event_type, wait_event, left(query, 70) "
                    "FROM pg_stat_activity WHERE datname = current_database() "
                    "AND pid <> pg_backend_pid() AND backend_type = 'client backend'"
                ).fetchall()
                ungranted = conn.execute(
                    "SELECT count(*) FROM pg_locks l JOIN pg_database d ON d.oid = l.database "
                    "WHERE d.datname = current_database() AND NOT l.granted"
                ).fetchone()[0]
                self.samples += 1
                self.ungranted += ungranted
                for state, wtype, wevent, query in rows:
                    if state == "active":
                        self.active += 1
                        if wtype:
                            self.wait_events[f"{wtype}:{wevent}"] += 1
                    if wtype == "Lock":
                        self.lock_waits[" ".join((query or "").split())[:70]] += 1
                time.sleep(self.interval)


def one_config(url: str, base_url: str, procs: int, conc: int, runs: int) -> dict[str, Any]:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("TRUNCATE agent_run CASCADE")
    workers = [
        common.runagents(url, base_url, "--concurrency", str(conc), "--poll-interval", "0.05")
        for _ in range(procs)
    ]
    try:
        common.wait_backends(url, procs * conc)
        time.sleep(0.5)
        sampler = LockSampler(url)
        sampler.start()
        t = time.perf_counter()
        common.bulk_insert_runs(url, runs)
        common.wait_finished(url, 300, interval=0.02)
        wall = time.perf_counter() - t
        sampler.stop.set()
        sampler.join()
    finally:
        codes = common.stop_all(workers, 600)
    if any(codes):
        raise RuntimeError(f"worker exit codes {codes}")
    tp = common.throughput(url)
    steps, span = tp["steps"], tp["span_s"]
    return {
        "procs": procs,
        "concurrency": conc,
        "workers": procs * conc,
        "runs": runs,
        "steps": steps,
        "span_s": float(span),
        "wall_s": wall,
        "steps_per_s": steps / float(span),
        "steps_per_s_wall": steps / wall,
        "lock_samples": sampler.samples,
        "lock_wait_samples": sum(sampler.lock_waits.values()),
        "lock_waits_by_query": dict(sampler.lock_waits.most_common(5)),
        "ungranted_lock_samples": sampler.ungranted,
        "active_backend_samples": sampler.active,
        "wait_events": dict(sampler.wait_events.most_common(6)),
        "claim_waited_on_lock": any(
            "SKIP LOCKED" in q.upper() or "FOR NO KEY" in q.upper() for q in sampler.lock_waits
        ),
    }


def run(runs: int) -> dict[str, Any]:
    url = common.fresh_db(DB)
    results: list[dict[str, Any]] = []
    baselines: list[float] = []
    with common.fake_api() as base_url:
        common.setup_django(url, base_url)
        # Every configuration is timed right after a one-worker run, and its speedup is
        # taken against that run: the machine's speed drifts within minutes.
        for procs, conc in CONFIGS:
            if (procs, conc) != (1, 1):
                baseline = one_config(url, base_url, 1, 1, runs)
                baselines.append(baseline["steps_per_s"])
            r = one_config(url, base_url, procs, conc, runs)
            if (procs, conc) == (1, 1):
                baselines.append(r["steps_per_s"])
            r["baseline_steps_per_s"] = baselines[-1]
            r["speedup"] = r["steps_per_s"] / baselines[-1]
            results.append(r)
            log(
                f"  {procs} proc x {conc} slot: {r['steps_per_s']:.0f} steps/s "
                f"(insert-to-done wall {r['steps_per_s_wall']:.0f}/s; one worker just before "
                f"{baselines[-1]:.0f}/s: {r['speedup']:.2f}x); lock-wait samples "
                f"{r['lock_wait_samples']}/{r['lock_samples']}, "
                f"ungranted {r['ungranted_lock_samples']}"
            )
    best8 = max(r["speedup"] for r in results if r["workers"] == 8)
    res = {
        "cpus": os.cpu_count(),
        "configs": results,
        "one_worker_runs_steps_per_s": baselines,
        "speedup_8_procs": next(r["speedup"] for r in results if r["procs"] == 8),
        "speedup_8_slots": next(r["speedup"] for r in results if r["concurrency"] == 8),
        "best_speedup_8": best8,
        "target": "8 workers >= 1.6x one worker",
        "met": best8 >= 1.6,
        "any_claim_lock_wait": any(r["claim_waited_on_lock"] for r in results),
        "any_lock_wait": any(r["lock_wait_samples"] for r in results),
    }
    log(
        f"[workers] 8 processes {res['speedup_8_procs']:.2f}x, 8 slots "
        f"{res['speedup_8_slots']:.2f}x one worker on {res['cpus']} CPUs -> "
        f"{common.verdict(res['met'])} (>= 1.6x); claims waited on a lock: "
        f"{'yes' if res['any_claim_lock_wait'] else 'no'}; any lock wait seen: "
        f"{'yes' if res['any_lock_wait'] else 'no'}"
    )
    return res


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=100)
    a = p.parse_args(argv)
    res = run(a.runs)
    return common.finish("workers", res, DB)


if __name__ == "__main__":
    main()
