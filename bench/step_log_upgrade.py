"""Migration 0025 on a filled step log: a database migrated up to 0024 gets ``--steps`` steps
(random-id runs of 50 steps, ~300 bytes each) in its plain agent_step, then is migrated to the
day partitions while another connection commits a step every 2 ms with ``lock_timeout = 1s``
(so a commit that waits more than a second for a lock fails, and is counted).

Prints the migration's wall time, the commits made meanwhile, the longest one, and how many
failed. The database (da_bench_upgrade) is made again each time.

    python -m bench.step_log_upgrade --steps 10000000
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import threading
import time

from bench import common
from bench.common import log

NAME = "da_bench_upgrade"
STEPS_PER_RUN = 50


def migrate_to(url: str, target: str) -> None:
    subprocess.run(
        [common.PY, "manage.py", "migrate", "durable_agents", target, "--verbosity", "0"],
        cwd=common.ROOT,
        env=common.bench_env(url),
        check=True,
    )


def fill(url: str, steps: int) -> float:
    import psycopg

    runs = steps // STEPS_PER_RUN
    started = time.perf_counter()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SET synchronous_commit = off")
        conn.execute(
            "INSERT INTO agent_run (id, agent, prompt_version, fingerprint, model, task, status,"
            " attempt, stalled_claims, last_seq, tokens_used, error, created_at, updated_at,"
            " waiting_for, depth, priority, dead_cause, fair_at)"
            " SELECT md5('u' || g)::uuid, 'bench', '1', 'fp', 'm', 't', 'succeeded', 1, 0,"
            f" {STEPS_PER_RUN - 1}, 0, '', now(), now(), '', 0, 0, '', now()"
            " FROM generate_series(1, %s) g",
            [runs],
        )
        chunk = 20_000
        for low in range(1, runs + 1, chunk):
            high = min(runs, low + chunk - 1)
            conn.execute(
                "INSERT INTO agent_step (run_id, seq, kind, payload, request_id, attempt, worker)"
                " SELECT md5('u' || g)::uuid, s, CASE WHEN s = 0 THEN 'task' ELSE 'tool_result'"
                " END, repeat('x', 300), CASE WHEN s %% 2 = 1 THEN 'req_' || g || '_' || s END,"
                " 1, 'bench' FROM generate_series(%s::int, %s::int) g,"
                f" generate_series(0, {STEPS_PER_RUN - 1}) s",
                [low, high],
            )
            if (high // chunk) % 25 == 0:
                log(f"  {high * STEPS_PER_RUN:,} of {steps:,} steps")
        conn.execute("VACUUM ANALYZE agent_step")
    return time.perf_counter() - started


def main() -> None:
    import psycopg

    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=1_000_000)
    args = parser.parse_args()
    url = common.recreate_db(NAME)
    common.migrate(url)  # every app (auth's later migrations too), then back to before 0025
    migrate_to(url, "0024")
    log(f"filling {NAME} with {args.steps:,} steps")
    filled = fill(url, args.steps)
    with psycopg.connect(url, autocommit=True) as conn:
        (run_id,) = conn.execute("SELECT id FROM agent_run LIMIT 1").fetchone()
        size = conn.execute("SELECT pg_total_relation_size('agent_step')").fetchone()[0]
    stop = threading.Event()
    commit_ms: list[float] = []
    failures: list[str] = []

    def committing() -> None:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("SET lock_timeout = '1s'")
            seq = 1_000_000
            while not stop.is_set():
                t = time.perf_counter()
                try:
                    conn.execute(
                        "INSERT INTO agent_step (run_id, seq, kind, payload, attempt, worker)"
                        " VALUES (%s, %s, 'tool_result', 'x', 0, '')",
                        [run_id, seq],
                    )
                except psycopg.Error as exc:
                    failures.append(f"{type(exc).__name__}: {exc}")
                    continue
                finally:
                    seq += 1
                commit_ms.append((time.perf_counter() - t) * 1000)
                time.sleep(0.002)

    committer = threading.Thread(target=committing)
    committer.start()
    time.sleep(1)
    t = time.perf_counter()
    try:
        migrate_to(url, "0025")
    finally:
        migrated = time.perf_counter() - t
        time.sleep(1)
        stop.set()
        committer.join()
    with psycopg.connect(url, autocommit=True) as conn:
        legacy = conn.execute("SELECT count(*) FROM agent_step_legacy").fetchone()[0]
    print(
        f"upgrade of {args.steps:,} steps ({size / 1e9:.1f} GB with indexes, filled in"
        f" {filled:.0f} s): migration 0025 took {migrated:.1f} s; {len(commit_ms)} commits"
        f" meanwhile, longest {max(commit_ms):.0f} ms, p50 {statistics.median(commit_ms):.2f}"
        f" ms, {len(failures)} failed; {legacy:,} steps in agent_step_legacy"
    )
    for failure in failures[:5]:
        print("  failed:", failure)
    common.write_result(
        "step_log_upgrade",
        {
            "steps": args.steps,
            "bytes": size,
            "migration_seconds": migrated,
            "commits": len(commit_ms),
            "longest_commit_ms": max(commit_ms),
            "commit_p50_ms": statistics.median(commit_ms),
            "failed": len(failures),
        },
    )


if __name__ == "__main__":
    main()
