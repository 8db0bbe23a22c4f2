"""Concurrency keys across a crash: 50 keys with a limit of 2, three workers, one SIGKILLed.

The fake (``bench.slowapi``, answers after 0.5-1.5 s, no rate limit) counts, per concurrency
key read from the ``[key:k<i>]`` marker in each task, the requests in flight and their peak.
``--keys`` keys (50) of ``--runs-per-key`` runs (10) of 3 model turns each are inserted at once,
each with ``concurrency_key="k<i>"`` and its fair-share turn as ``start_run`` gives it; the
limit, 2 per key, comes from ``CONCURRENCY_LIMITS``. Three ``runagents`` processes of 50 slots
(150 slots for at most 100 runs the limits let run), with ``LEASE_SECONDS`` 5 and a heartbeat
of 1.5 s. Once ``--kill-after`` of the runs have finished, the worker holding the most running
runs is SIGKILLed; its runs come back when their leases run out. Target: every key's peak in
flight at the fake <= 2, and every run succeeded (none dead, failed or unfinished).

Can the crash itself push a key to 3? A request the killed worker had sent stays in flight at
the fake until its answer is due (the fake notices the closed socket only when it writes), while
another worker may take the run over once its lease runs out and send the call again. The lease
was renewed at most a heartbeat before the kill, so it runs out at least ``lease - heartbeat``
(3.5 s) after it, and the abandoned request ends at most ``max latency`` (1.5 s) after it: 2 s
apart unless the killed worker's heartbeat was already 2 s late. The bench measures that margin
(the killed runs' leases against the kill) and, polling every 50 ms, when each killed run was
taken over, and counts the take-overs that came before an abandoned request could have ended.

    python -m bench.keys_crash --quick
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench import common
from bench.common import log

DB = "da_bench_keys_crash"
TURNS = 3
LIMIT = 2
LEASE = 5.0
HEARTBEAT = 1.5
FINISHED = ("succeeded", "failed", "dead", "cancelled")


def key_name(i: int) -> str:
    return f"k{i}"


def task(key: str, j: int) -> str:
    lines = [f"Keys crash run {key}/{j} [key:{key}]."]
    lines += [f'@noop {{"key": "{key}-{j}-{t}"}}' for t in range(TURNS - 1)]
    return "\n".join(lines)


def insert_runs(url: str, keys: int, per_key: int) -> None:
    """``per_key`` pending runs of each of ``keys`` keys, in one transaction: key k's j-th run
    has its turn (``fair_at``) j seconds after the insert, as ``start_run`` spaces a key's runs,
    and each key its row (its next turn after them). Inserted round-robin over the keys."""
    import psycopg

    from bench.benchapp.agents import bench

    fp = bench.fingerprint(bench.model)
    with psycopg.connect(url) as conn, conn.cursor() as cur:
        cur.executemany(
            "INSERT INTO agent_concurrency_key (key, next_fair_at)"
            " VALUES (%s, now() + %s * interval '1 second')",
            [(key_name(i), per_key) for i in range(keys)],
        )
        cur.executemany(
            "WITH r AS (INSERT INTO agent_run (id, agent, prompt_version, fingerprint, model,"
            " task, status, attempt, stalled_claims, last_seq, error, created_at, updated_at,"
            " priority, concurrency_key, concurrency_limit, fair_at) VALUES (gen_random_uuid(),"
            " 'bench', '1', %s, %s, %s, 'pending', 0, 0, 0, '', clock_timestamp(), now(), 0,"
            " %s, NULL, now() + %s * interval '1 second') RETURNING id, task)"
            " INSERT INTO agent_step (run_id, seq, kind, payload, attempt, worker, created_at)"
            " SELECT id, 0, 'task', %s, 0, '', now() FROM r",
            [
                (fp, bench.model, text, key_name(i), j, json.dumps(text))
                for j in range(per_key)
                for i in range(keys)
                for text in (task(key_name(i), j),)
            ],
        )
        conn.commit()


def wait_listening(conn: Any, procs: list[subprocess.Popen[bytes]], limit: float = 60.0) -> None:
    """Until every worker process listens for new runs (its LISTEN connection is up)."""
    deadline = time.monotonic() + limit
    while True:
        dead = [p.pid for p in procs if p.poll() is not None]
        if dead:
            raise RuntimeError(f"worker processes {dead} exited at start-up")
        (n,) = conn.execute(
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE datname = current_database() AND query LIKE 'LISTEN %%'"
        ).fetchone()
        if n >= len(procs):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{n} of {len(procs)} workers listening after {limit} s")
        time.sleep(0.1)


def counts(conn: Any) -> dict[str, int]:
    return dict(conn.execute("SELECT status, count(*) FROM agent_run GROUP BY 1").fetchall())


def kill_busiest(
    conn: Any, procs: list[subprocess.Popen[bytes]], base_url: str
) -> dict[str, Any] | None:
    """SIGKILL the worker holding the most running runs, if any holds one; what it held."""
    by_pid = {str(p.pid): p for p in procs if p.poll() is None}
    held = conn.execute(
        "SELECT split_part(lease_owner, ':', 2), count(*) FROM agent_run"
        " WHERE status = 'running' AND lease_until >= now() GROUP BY 1 ORDER BY 2 DESC"
    ).fetchall()
    busiest = next((pid for pid, _ in held if pid in by_pid), None)
    if busiest is None:
        return None
    victim = by_pid[busiest]
    before = common.get_json(base_url, "/stats")
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    killed_at = time.time()
    runs = conn.execute(
        "SELECT id, lease_owner, concurrency_key, EXTRACT(EPOCH FROM lease_until) FROM agent_run"
        " WHERE status = 'running' AND split_part(lease_owner, ':', 2) = %s",
        (busiest,),
    ).fetchall()
    margins = [float(until) - killed_at for *_, until in runs]
    return {
        "pid": victim.pid,
        "killed_at": killed_at,
        "in_flight_at_fake_before": int(before.get("in_flight", 0)),
        "runs": {str(rid): owner for rid, owner, _, _ in runs},
        "keys": sorted({key for _, _, key, _ in runs}),
        "lease_left_min_s": min(margins, default=float("nan")),
        "lease_left_max_s": max(margins, default=float("nan")),
    }


def track_takeovers(conn: Any, killed: dict[str, Any], taken: dict[str, float]) -> None:
    """Note when each of the killed worker's runs got another owner (or ended)."""
    left = [rid for rid in killed["runs"] if rid not in taken]
    if not left:
        return
    now = time.time()
    for rid, owner, status in conn.execute(
        "SELECT id::text, lease_owner, status FROM agent_run WHERE id::text = ANY(%s)", (left,)
    ):
        if owner != killed["runs"][rid] or status != "running":
            taken[rid] = now - killed["killed_at"]


def scenario(args: argparse.Namespace) -> dict[str, Any]:
    """Insert the runs, kill the busiest worker once ``--kill-after`` of them finished, wait
    until every run finished (or ``--timeout``); the fake's counts and what the kill took."""
    import psycopg

    url = common.fresh_db(DB)
    limits = {key_name(i): LIMIT for i in range(args.keys)}
    env = {
        "DA_BENCH_CONCURRENCY_LIMITS": json.dumps(limits),
        "DA_BENCH_LEASE_SECONDS": str(args.lease),
        "DA_BENCH_HEARTBEAT_SECONDS": str(HEARTBEAT),
    }
    total = args.keys * args.runs_per_key
    fake = ["bench.slowapi", "--port", "0", "--latency", args.latency]
    killed: dict[str, Any] | None = None
    taken: dict[str, float] = {}
    with common.serving(fake, "slow fake API") as base_url:
        procs = common.fleet(url, base_url, args.procs, args.slots, logs=args.logs, **env)
        try:
            with psycopg.connect(url, autocommit=True) as conn:
                wait_listening(conn, procs)
                insert_runs(url, args.keys, args.runs_per_key)
                deadline = time.monotonic() + args.timeout
                while True:
                    by_status = counts(conn)
                    done = sum(n for s, n in by_status.items() if s in FINISHED)
                    if killed is None and done >= args.kill_after * total:
                        killed = kill_busiest(conn, procs, base_url)
                    if killed is not None:
                        track_takeovers(conn, killed, taken)
                    if done == total:
                        break
                    if time.monotonic() > deadline:
                        log(f"[keys_crash] {total - done} runs unfinished after {args.timeout} s")
                        break
                    time.sleep(0.05)
            stats = common.get_json(base_url, "/stats")
            loop = common.get_json(base_url, "/_stats")
        finally:
            common.stop_all(procs, 30)
    return measure(url, args, stats, loop, killed, taken)


def measure(
    url: str,
    args: argparse.Namespace,
    stats: dict[str, Any],
    loop: dict[str, Any],
    killed: dict[str, Any] | None,
    taken: dict[str, float],
) -> dict[str, Any]:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        by_status = counts(conn)
        (waits,) = conn.execute(
            "SELECT coalesce(sum(capacity_waits), 0) FROM model_capacity"
        ).fetchone()
        (span,) = conn.execute(
            "SELECT EXTRACT(EPOCH FROM max(finished_at) - min(created_at)) FROM agent_run"
        ).fetchone()
        attempts = dict(
            conn.execute("SELECT attempt, count(*) FROM agent_run GROUP BY 1 ORDER BY 1").fetchall()
        )
        again = [rid for (rid,) in conn.execute("SELECT id::text FROM agent_run WHERE attempt > 1")]
    total = args.keys * args.runs_per_key
    peaks = {k: int(v["peak_in_flight"]) for k, v in stats.get("keys", {}).items()}
    expected = [key_name(i) for i in range(args.keys)]
    bounds = [float(x) for x in args.latency.split("-")]
    max_latency = max(bounds)
    late_s = float(loop.get("late_max_ms", 0.0)) / 1000
    # A take-over before the abandoned request's answer was due: the fake may have seen both.
    early = [s for s in taken.values() if s < max_latency + late_s]
    ideal = args.runs_per_key * TURNS * (min(bounds) + max_latency) / 2 / LIMIT
    lease_left = killed["lease_left_min_s"] if killed else float("nan")
    res: dict[str, Any] = {
        "keys": args.keys,
        "runs_per_key": args.runs_per_key,
        "runs": total,
        "turns": TURNS,
        "limit": LIMIT,
        "procs": args.procs,
        "slots": args.slots,
        "lease_s": args.lease,
        "heartbeat_s": HEARTBEAT,
        "latency": args.latency,
        "by_status": by_status,
        "succeeded": by_status.get("succeeded", 0),
        "dead_or_failed": by_status.get("dead", 0) + by_status.get("failed", 0),
        "unfinished": total - sum(n for s, n in by_status.items() if s in FINISHED),
        "peaks": peaks,
        "keys_seen": sum(1 for k in expected if k in peaks),
        "max_peak": max(peaks.values(), default=0),
        "keys_at_limit": sum(1 for k in expected if peaks.get(k) == LIMIT),
        "keys_over_limit": sorted(k for k in expected if peaks.get(k, 0) > LIMIT),
        "answered": int(stats.get("answered", 0)),
        "calls_expected": total * TURNS,
        "peak_in_flight": int(stats.get("peak_in_flight", 0)),
        "fake_late_max_ms": late_s * 1000,
        "attempts": attempts,
        "capacity_waits": int(waits),
        "runs_claimed_again": len(again),
        "claimed_again_not_killed": len(set(again) - set(killed["runs"] if killed else ())),
        "makespan_s": float(span or 0),
        "ideal_s": ideal,
        "killed": killed,
        "killed_runs": len(killed["runs"]) if killed else 0,
        "takeover_s": sorted(taken.values()),
        # How long after the last abandoned request was due the first take-over could come:
        # negative, the fake may see both the abandoned request and the one sent again.
        "margin_s": lease_left - max_latency - late_s,
        "takeovers_before_abandoned_ended": len(early),
    }
    return res


def report(res: dict[str, Any]) -> None:
    k = res["killed"] or {}
    taken = res["takeover_s"]
    log(
        f"[keys_crash] {res['keys']} keys x {res['runs_per_key']} runs of {res['turns']} turns,"
        f" limit {res['limit']}, {res['procs']} workers x {res['slots']} slots,"
        f" lease {res['lease_s']:g} s, latency {res['latency']} s"
    )
    log(
        f"[keys_crash] killed pid {k.get('pid')} holding {res['killed_runs']} running runs of"
        f" {len(k.get('keys', []))} keys ({k.get('in_flight_at_fake_before', 0)} requests in"
        f" flight at the fake); their leases had {k.get('lease_left_min_s', float('nan')):.2f}"
        f"-{k.get('lease_left_max_s', float('nan')):.2f} s left; taken over after"
        f" {min(taken, default=float('nan')):.2f}-{max(taken, default=float('nan')):.2f} s;"
        f" {res['takeovers_before_abandoned_ended']} take-overs before an abandoned request"
        f" could have ended (max latency + the fake's lateness {res['fake_late_max_ms']:.0f} ms;"
        f" margin {res['margin_s']:.2f} s)"
    )
    log(
        f"[keys_crash] per-key peak in flight: max {res['max_peak']} over {res['keys_seen']}"
        f" keys seen; {res['keys_at_limit']} keys reached {res['limit']};"
        f" over the limit: {res['keys_over_limit'] or 'none'}"
    )
    log(
        f"[keys_crash] runs {res['by_status']}: {res['dead_or_failed']} dead or failed,"
        f" {res['unfinished']} unfinished; {res['runs_claimed_again']} claimed again"
        f" ({res['claimed_again_not_killed']} of them not the killed worker's: handed back to"
        f" wait for model capacity while the fleet learned the model's limits at the start,"
        f" {res['capacity_waits']} waits for capacity);"
        f" {res['answered']} answers for {res['calls_expected']} turns;"
        f" makespan {res['makespan_s']:.1f} s (no-crash ideal {res['ideal_s']:.1f} s)"
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser()
    p.add_argument("--keys", type=int, default=50)
    p.add_argument("--runs-per-key", type=int, default=10)
    p.add_argument("--procs", type=int, default=3)
    p.add_argument("--slots", type=int, default=50)
    p.add_argument("--latency", default="0.5-1.5")
    p.add_argument("--lease", type=float, default=LEASE, help="LEASE_SECONDS of the workers")
    p.add_argument("--kill-after", type=float, default=0.3, help="fraction of runs finished")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--quick", action="store_true", help="4 runs per key")
    p.add_argument("--out", default="keys_crash", help="bench/out/<OUT>.json")
    p.add_argument("--logs", type=Path, help="write the workers' logs (INFO) to this folder")
    p.add_argument("--keep-db", action="store_true", help="keep da_bench_keys_crash to look at")
    a = p.parse_args(argv)
    if a.quick:
        a.runs_per_key = 4
    res = scenario(a)
    report(res)
    res["target"] = (
        f"per-key peak in flight <= {LIMIT} for all {a.keys} keys; every run succeeded;"
        " a worker holding running runs was SIGKILLed"
    )
    res["met"] = (
        res["keys_seen"] == a.keys
        and res["max_peak"] <= LIMIT
        and res["succeeded"] == res["runs"]
        and res["killed_runs"] > 0
    )
    log(f"[keys_crash] {common.verdict(res['met'])} ({res['target']})")
    return common.finish(a.out, res, DB, keep=a.keep_db)


if __name__ == "__main__":
    sys.exit(0 if main()["met"] else 1)
