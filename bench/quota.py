"""Many runs, one model quota: a fleet against a fake API that rate-limits like the real one.

The fake (``bench.slowapi`` behind ``bench.gate``) limits the organisation to ``--rpm``
requests a minute (token buckets holding ``--burst-seconds`` of the limit, refilled
continuously, 429 with ``retry-after`` and ``anthropic-ratelimit-*`` headers) and answers
after 0.5-1.5 s. Two ``runagents`` processes of 300 slots each; 600 runs of 3 model turns are
inserted at once, then 20 runs at priority 10 ten seconds later. Measured from the fake's
counts and the database:

- runs dead-lettered or failed (target 0);
- 429s per answered call (target <= 1 %; ``--itpm``-bound scenario <= 2 %);
- the makespan against the limit-bound ideal: the calls beyond the first burst at the
  limit's rate, plus one answer's latency (target <= 1.1x);
- the priority runs' time from insert to finish, p50 (target < 20 s).

``--before DIR`` runs the same scenario first with the code of another checkout (its workers
retry 429s each on its own): the before and after of one machine, in one run.
``--scenario itpm``: long transcripts, input tokens per minute bind instead of requests.

    python -m bench.quota --quick
    python -m bench.quota --before /path/to/checkout-before
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from bench import common
from bench.common import log

# Its own database (another benchmark running meanwhile has its own name too).
DB = os.environ.get("BENCH_QUOTA_DB", "da_bench_quota")
TURNS = 3
PRIORITY = 10


def task(i: int, padding: int) -> str:
    lines = [f"Quota run {i}." + (" pad" * (padding // 4))]
    lines += [f'@noop {{"key": "q{i}-{t}"}}' for t in range(TURNS - 1)]
    return "\n".join(lines)


def insert_runs(url: str, first: int, n: int, priority: int, padding: int) -> None:
    """``n`` pending runs of the ``bench`` agent at ``priority``, in one transaction."""
    import psycopg

    from bench.benchapp.agents import bench

    fp = bench.fingerprint(bench.model)
    with psycopg.connect(url) as conn, conn.cursor() as cur:
        cur.executemany(
            "WITH r AS (INSERT INTO agent_run (id, agent, prompt_version, fingerprint, model,"
            " task, status, attempt, stalled_claims, last_seq, error, created_at, updated_at,"
            " priority) VALUES (gen_random_uuid(), 'bench', '1', %s, %s, %s, 'pending', 0, 0,"
            " 0, '', clock_timestamp(), now(), %s) RETURNING id, task)"
            " INSERT INTO agent_step (run_id, seq, kind, payload, attempt, worker, created_at)"
            " SELECT id, 0, 'task', %s, 0, '', now() FROM r",
            [
                (fp, bench.model, text, priority, json.dumps(text, ensure_ascii=False))
                for text in (task(first + i, padding) for i in range(n))
            ],
        )
        conn.commit()


def scenario(root: Path, args: argparse.Namespace, label: str) -> dict[str, Any]:
    import psycopg

    url = common.recreate_db(DB)
    common.migrate(url, root)
    fake = [
        "bench.slowapi",
        "--port",
        "0",
        "--latency",
        args.latency,
        "--rpm",
        str(args.rpm),
        "--burst-seconds",
        str(args.burst_seconds),
    ]
    if args.itpm:
        fake += ["--itpm", str(args.itpm)]
    # The app as a new user runs it: default MODEL_RETRIES and MAX_ATTEMPTS, no RATE_LIMITS
    # unless asked (the limits are learned from the answers' headers).
    env = {"DA_BENCH_MODEL_RETRIES": "8"}
    if args.configured:
        limits = {"requests_per_minute": args.rpm, "burst_seconds": args.burst_seconds}
        if args.itpm:
            limits["input_tokens_per_minute"] = args.itpm
        env["DA_BENCH_RATE_LIMITS"] = json.dumps({"*": limits})
    with common.serving(fake, "rate-limited fake API") as base_url:
        procs = common.fleet(url, base_url, args.procs, args.slots, root=root, **env)
        try:
            time.sleep(3)  # the workers connect and start listening
            t0 = time.perf_counter()
            insert_runs(url, 0, args.runs, 0, args.padding)
            priority_inserted = False
            deadline = t0 + args.timeout
            with psycopg.connect(url, autocommit=True) as conn:
                while True:
                    now = time.perf_counter()
                    if not priority_inserted and now - t0 >= args.priority_after:
                        insert_runs(url, args.runs, args.priority_runs, PRIORITY, args.padding)
                        priority_inserted = True
                    active = conn.execute(
                        "SELECT count(*) FROM agent_run WHERE status NOT IN"
                        " ('succeeded', 'failed', 'dead', 'cancelled')"
                    ).fetchone()[0]
                    if priority_inserted and active == 0:
                        break
                    if now > deadline:
                        log(f"[quota] {label}: {active} runs still active after {args.timeout} s")
                        break
                    time.sleep(0.2)
            stats = common.get_json(base_url, "/stats")
        finally:
            common.stop_all(procs, 30)
    return measure(url, stats, args, label)


def measure(
    url: str, stats: dict[str, Any], args: argparse.Namespace, label: str
) -> dict[str, Any]:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        by_status = dict(
            conn.execute("SELECT status, count(*) FROM agent_run GROUP BY 1").fetchall()
        )
        (span,) = conn.execute(
            "SELECT EXTRACT(EPOCH FROM max(finished_at) - min(created_at)) FROM agent_run"
        ).fetchone()
        priority_latency = [
            float(s)
            for (s,) in conn.execute(
                "SELECT EXTRACT(EPOCH FROM finished_at - created_at) FROM agent_run"
                " WHERE priority = %s AND finished_at IS NOT NULL",
                (PRIORITY,),
            )
        ]
        # Model turns committed in each 5 s from the first insert: where the time went.
        timeline = [
            int(n)
            for (_, n) in conn.execute(
                "SELECT floor(EXTRACT(EPOCH FROM s.created_at - f.t0) / 5) AS slot, count(*)"
                " FROM agent_step s, (SELECT min(created_at) AS t0 FROM agent_run) f"
                " WHERE s.kind = 'model_turn' GROUP BY 1 ORDER BY 1"
            )
        ]
        events = (
            [
                f"{kind} at {float(offset):.1f}s for {seconds}s"
                for kind, offset, seconds in conn.execute(
                    "SELECT kind, EXTRACT(EPOCH FROM at - (SELECT min(created_at) FROM agent_run)),"
                    " seconds FROM capacity_event ORDER BY at LIMIT 10"
                )
            ]
            if _has_table(conn, "capacity_event")
            else []
        )
        waits = (
            conn.execute(
                "SELECT coalesce(sum(capacity_waits), 0), coalesce(sum(pauses), 0)"
                " FROM model_capacity"
            ).fetchone()
            if _has_table(conn, "model_capacity")
            else (0, 0)
        )
    calls = (args.runs + args.priority_runs) * TURNS
    burst = args.rpm * args.burst_seconds / 60
    low, _, high = args.latency.partition("-")
    latency = (float(low) + float(high or low)) / 2
    ideal = max(calls - burst, 0) / (args.rpm / 60) + latency
    if args.itpm:
        per_call = _input_tokens_per_call(args)
        ideal = max(
            ideal,
            max(calls * per_call - args.itpm * args.burst_seconds / 60, 0) / (args.itpm / 60)
            + latency,
        )
    answered = int(stats.get("answered", 0))
    rejected = int(stats.get("rejected_429", 0))
    res = {
        "label": label,
        "runs": args.runs + args.priority_runs,
        "by_status": by_status,
        "dead_or_failed": by_status.get("dead", 0) + by_status.get("failed", 0),
        "unfinished": sum(
            n for s, n in by_status.items() if s not in ("succeeded", "failed", "dead", "cancelled")
        ),
        "answered": answered,
        "rejected_429": rejected,
        "rejected_per_answered": rejected / answered if answered else float("nan"),
        "makespan_s": float(span or 0),
        "ideal_s": ideal,
        "makespan_ratio": float(span or 0) / ideal,
        "priority_p50_s": common.pct(priority_latency, 50),
        "priority_p95_s": common.pct(priority_latency, 95),
        "turns_per_5s": timeline,
        "capacity_events": events,
        "capacity_waits": int(waits[0]),
        "pauses": int(waits[1]),
    }
    log(
        f"[quota] {label}: {res['dead_or_failed']} dead or failed, {res['unfinished']} unfinished;"
        f" {rejected} 429s for {answered} answers ({100 * res['rejected_per_answered']:.2f} %);"
        f" makespan {res['makespan_s']:.1f} s vs ideal {ideal:.1f} s"
        f" ({res['makespan_ratio']:.2f}x);"
        f" priority runs p50 {res['priority_p50_s']:.1f} s, p95 {res['priority_p95_s']:.1f} s;"
        f" waits for capacity {res['capacity_waits']}, pauses {res['pauses']};"
        f" model turns per 5 s: {timeline}; 429s, 529s and pauses: {events or 'none'}"
    )
    return res


def _has_table(conn: Any, name: str) -> bool:
    return bool(conn.execute("SELECT to_regclass(%s) IS NOT NULL", (name,)).fetchone()[0])


def _input_tokens_per_call(args: argparse.Namespace) -> float:
    # The fake charges len(body) // 4; a call's body grows with the turns: the average over
    # a run's three calls, measured once from the bodies the bench sends (about 1 kB of
    # request besides the task).
    return (len(task(0, args.padding)) + 1500) / 4


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=600)
    p.add_argument("--priority-runs", type=int, default=20)
    p.add_argument("--priority-after", type=float, default=10.0)
    p.add_argument("--procs", type=int, default=2)
    p.add_argument("--slots", type=int, default=300)
    p.add_argument("--rpm", type=int, default=1200)
    p.add_argument("--itpm", type=int, default=None)
    p.add_argument("--burst-seconds", type=float, default=10.0)
    p.add_argument("--latency", default="0.5-1.5")
    p.add_argument("--padding", type=int, default=0, help="bytes added to each task")
    p.add_argument("--scenario", choices=("rpm", "itpm"), default="rpm")
    p.add_argument("--configured", action="store_true", help="RATE_LIMITS as the fake's")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--before", type=Path, help="a checkout whose code runs the scenario first")
    p.add_argument("--quick", action="store_true", help="200 + 10 runs, 600 requests a minute")
    a = p.parse_args(argv)
    if a.scenario == "itpm":
        # Long transcripts: about 5,000 input tokens a call; input tokens bind at 10 calls a
        # second, half the request limit.
        a.padding = a.padding or 20_000
        a.itpm = a.itpm or int(10 * 60 * _input_tokens_per_call(a))
    if a.quick:
        a.runs, a.priority_runs, a.rpm = 200, 10, 600
    results: dict[str, Any] = {"scenario": a.scenario, "rpm": a.rpm, "itpm": a.itpm}
    if a.before is not None:
        results["before"] = scenario(a.before, a, "before")
    results["after"] = scenario(common.ROOT, a, "after")
    after = results["after"]
    allowed = 0.02 if a.scenario == "itpm" else 0.01
    results["target"] = (
        f"0 dead or failed; 429s <= {allowed:.0%} of answers; makespan <= 1.1x ideal;"
        " priority p50 < 20 s"
    )
    results["met"] = (
        after["dead_or_failed"] == 0
        and after["unfinished"] == 0
        and after["rejected_per_answered"] <= allowed
        and after["makespan_ratio"] <= 1.1
        and (a.scenario == "itpm" or after["priority_p50_s"] < 20)
    )
    log(f"[quota] {a.scenario}: {common.verdict(results['met'])} ({results['target']})")
    return common.finish(f"quota_{a.scenario}", results, DB)


if __name__ == "__main__":
    main()
