"""Target 7, memory: the RSS of one ``runagents --burst`` worker process over N runs.

N one-step runs (a task without a plan: one model call, one committed step, claim and finish)
are bulk-inserted, then one worker processes them; /proc/<pid>/status VmRSS is sampled
together with the number of finished runs. Growth is measured from a warm baseline (the RSS
when 1 % of the runs are done: imports, connections and caches are in place by then) to the end;
the growth from the first sample is reported too.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from bench import common
from bench.common import log

DB = "da_bench_memory"


def bulk_runs(url: str, n: int) -> None:
    import psycopg

    from bench.benchapp.agents import bench
    from durable_agents.models.step_partitions import part_of_run

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO agent_run (id, agent, prompt_version, fingerprint, model, task, status,"
            " attempt, stalled_claims, last_seq, error, created_at, updated_at) "
            f"SELECT {common.TIME_ORDERED_ID_SQL}, 'bench', '1', %s, %s,"
            " 'Memory run ' || g || '.', 'pending',"
            " 0, 0, 0, '', now() + g * interval '1 us', now() FROM generate_series(1, %s) g",
            (bench.fingerprint(bench.model), bench.model, n),
        )
        conn.execute(
            "INSERT INTO agent_step (run_id, seq, part, kind, payload, attempt, worker,"
            f" created_at) SELECT id, 0, {part_of_run('id')}, 'task', to_json(task)::text, 0,"
            " '', now() FROM agent_run"
        )
        conn.execute("VACUUM ANALYZE")


def rss_kb(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except FileNotFoundError:
        return None
    return None


def run(n: int, concurrency: int) -> dict[str, Any]:
    import psycopg

    url = common.fresh_db(DB)
    with common.fake_api() as base_url:
        common.setup_django(url, base_url)
        bulk_runs(url, n)
        proc = common.runagents(url, base_url, "--burst", "--concurrency", str(concurrency))
        samples: list[tuple[float, int, int]] = []
        t0 = time.perf_counter()
        with psycopg.connect(url, autocommit=True) as conn:
            while proc.poll() is None:
                rss = rss_kb(proc.pid)
                done = conn.execute(
                    "SELECT count(*) FROM agent_run WHERE status = 'succeeded'"
                ).fetchone()[0]
                if rss:
                    samples.append((time.perf_counter() - t0, done, rss))
                time.sleep(0.25)
            bad = conn.execute(
                "SELECT count(*) FROM agent_run WHERE status <> 'succeeded'"
            ).fetchone()[0]
        wall = time.perf_counter() - t0
    if proc.returncode or bad:
        raise RuntimeError(f"worker exit {proc.returncode}, {bad} runs not succeeded")
    started = [s for s in samples if s[1] > 0]
    warm = next(s for s in started if s[1] >= max(1, n // 100))
    end = samples[-1]
    res = {
        "runs": n,
        "concurrency": concurrency,
        "wall_s": wall,
        "runs_per_s": n / wall,
        "rss_first_kb": started[0][2],
        "rss_warm_kb": warm[2],
        "rss_warm_at_runs": warm[1],
        "rss_end_kb": end[2],
        "rss_max_kb": max(s[2] for s in samples),
        "growth_from_warm": end[2] / warm[2] - 1,
        "growth_from_first": end[2] / started[0][2] - 1,
        "samples": samples,
        "target": "worker RSS growth over the runs <= 10 %",
    }
    res["met"] = res["growth_from_warm"] <= 0.10
    log(
        f"[memory] worker RSS {res['rss_warm_kb'] / 1024:.1f} MB after {warm[1]} runs -> "
        f"{res['rss_end_kb'] / 1024:.1f} MB after {n} runs: {res['growth_from_warm'] * 100:+.1f} % "
        f"(from the first sample {res['growth_from_first'] * 100:+.1f} %) -> "
        f"{common.verdict(res['met'])} (<= 10 %)"
    )
    return res


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=10_000)
    p.add_argument("--concurrency", type=int, default=1)
    a = p.parse_args(argv)
    res = run(a.runs, a.concurrency)
    return common.finish("memory", res, DB)


if __name__ == "__main__":
    main()
