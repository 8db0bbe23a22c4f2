"""The database goes away in the middle of a burst: how many paid turns are asked again?

A private PostgreSQL cluster (tests/pgcluster.py: initdb on a spare port, run as the postgres
user; the shared server is never touched), the slow fake API (``bench.slowapi``: answers after
0.3-0.8 s, some 529s, a requests-per-minute limit that answers 429s) and two ``runagents``
processes of 40 slots with the bench's settings (LEASE_SECONDS=60, HEARTBEAT_SECONDS=20).
Once a third of the turns were answered, step commits are held (a lock on agent_step) until
``--hold`` of them wait, as they do on a busy database, and the database is cut:

- ``restart``: ``pg_ctl restart -m immediate`` (a crash and recovery, about a second);
- ``outage``: ``pg_ctl stop -m immediate``, 20 s (``--outage``) without a database, start.

The fake counts its answered (200, paid) requests per (run, turn) (``GET /_turns``). Printed
per scenario: turns asked again (a turn answered more than once) and the extra answers they
cost, runs by status, and how long after the database was back the first step was committed
(the fleet resumed).

``--before REF`` measures git ``REF`` first (its workers, in a temporary worktree; the fake
and this script from the current tree): the before and after of one machine, in one run.

    python -m bench.failover
    python -m bench.failover --before main --runs 200
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import common
from bench.common import log
from tests import pgcluster

DB = "da_bench_failover"
TURNS = 4


def answered(base_url: str) -> list[tuple[str, int, int]]:
    return [tuple(row) for row in common.get_json(base_url, "/_turns")]  # type: ignore[misc]


def over(url: str) -> tuple[int, dict[str, int]]:
    import psycopg

    try:
        with psycopg.connect(url, autocommit=True, connect_timeout=2) as conn:
            rows = conn.execute("SELECT status, count(*) FROM agent_run GROUP BY 1").fetchall()
    except psycopg.Error:
        return 0, {}
    counts = {str(s): int(n) for s, n in rows}
    done = sum(counts.get(s, 0) for s in ("succeeded", "failed", "dead", "cancelled"))
    return done, counts


def hold_commits(primary: pgcluster.Cluster, at_least: int) -> Any:
    """A connection that locks agent_step against inserts until ``at_least`` step commits wait
    for it (then the cut lands in the middle of commits, as on a busy database); None when
    ``at_least`` is 0."""
    import psycopg

    if at_least <= 0:
        return None
    holder = psycopg.connect(primary.url(DB))
    holder.execute("LOCK TABLE agent_step IN SHARE ROW EXCLUSIVE MODE")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        (waiting,) = primary.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            " AND datname = current_database()",
            DB,
        )[0]
        if int(waiting) >= at_least:  # type: ignore[call-overload]
            break
        time.sleep(0.02)
    return holder


def cut(primary: pgcluster.Cluster, kind: str, outage: float) -> float:
    """Cut the database; returns when it is back (time.time())."""
    if kind == "restart":
        primary.restart("immediate")
    else:
        primary.stop("immediate")
        time.sleep(outage)
        primary.start()
    return time.time()


def scenario(root: Path, kind: str, args: argparse.Namespace, label: str) -> dict[str, Any]:
    import psycopg

    with pgcluster.clusters() as made, tempfile.TemporaryDirectory() as logs:
        primary = made.primary()
        primary.execute(f"CREATE DATABASE {DB}")
        url = primary.url(DB)
        common.migrate(url, root)
        fake = ["bench.slowapi", "--port", "0", "--latency", args.latency]
        fake += ["--rpm", str(args.rpm), "--burst-seconds", "2"]
        fake += ["--overloaded-rate", str(args.overloaded_rate)]
        with common.serving(fake, "slow fake API") as base_url:
            procs = common.fleet(url, base_url, args.procs, args.slots, root=root, logs=Path(logs))
            try:
                time.sleep(2)  # the workers connect
                common.bulk_insert_runs(url, args.runs, TURNS)
                total = args.runs * TURNS
                while sum(n for _, _, n in answered(base_url)) < total // 3:
                    time.sleep(0.05)
                holder = hold_commits(primary, args.hold)
                cut_at = time.time()
                back_at = cut(primary, kind, args.outage)
                if holder is not None:
                    holder.close()
                deadline = time.monotonic() + args.timeout
                while over(url)[0] < args.runs and time.monotonic() < deadline:
                    time.sleep(0.2)
                with psycopg.connect(url, autocommit=True) as conn:
                    (resumed,) = conn.execute(
                        "SELECT extract(epoch FROM min(created_at)) FROM agent_step"
                        " WHERE created_at > to_timestamp(%s)",
                        (back_at,),
                    ).fetchone()
                turns = answered(base_url)
                stats = common.get_json(base_url, "/stats")
                statuses = over(url)[1]
            finally:
                common.stop_all(procs, 30)
            worker_log = "".join(p.read_text(errors="replace") for p in Path(logs).glob("*.log"))
    again = [n for _, _, n in turns if n > 1]
    result = {
        "label": label,
        "scenario": kind,
        "runs": args.runs,
        "statuses": statuses,
        "answered": sum(n for _, _, n in turns),
        "turns_reasked": len(again),
        "extra_answers": sum(n - 1 for n in again),
        "rejected_429": stats.get("rejected_429"),
        "overloaded_529": stats.get("overloaded_529"),
        "cut_seconds": round(back_at - cut_at, 2),
        "resumed_after_s": None if resumed is None else round(float(resumed) - back_at, 2),
        "commit_retries": worker_log.count("retrying on a fresh connection"),
        "handed_back_on_error": worker_log.count("unexpected error"),
    }
    return result


def measure(root: Path, args: argparse.Namespace, label: str) -> list[dict[str, Any]]:
    results = []
    for kind in args.scenarios:
        result = scenario(root, kind, args, label)
        log(f"[failover] {json.dumps(result)}")
        results.append(result)
    return results


def checkout(ref: str) -> Path:
    sha = subprocess.run(
        ["git", "rev-parse", ref], cwd=common.ROOT, check=True, capture_output=True, text=True
    ).stdout.strip()
    path = Path(tempfile.gettempdir()) / f"da-bench-failover-{sha[:12]}"
    if not path.exists():
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(path), sha], cwd=common.ROOT, check=True
        )
    return path


def unavailable() -> str | None:
    """Why the private cluster cannot be made here (tests/pgcluster.py's requirements: the
    server binaries, the postgres OS user), or None."""
    import pytest

    try:
        pgcluster.require_binaries()
    except (pytest.skip.Exception, pytest.fail.Exception) as exc:
        return str(exc.msg)
    return None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=240)
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--slots", type=int, default=40)
    parser.add_argument("--latency", default="0.3-0.8")
    parser.add_argument("--rpm", type=int, default=6000, help="the fake's limit (429s)")
    parser.add_argument("--overloaded-rate", type=float, default=0.02, help="529s")
    parser.add_argument("--outage", type=float, default=20.0, help="seconds without a database")
    parser.add_argument("--timeout", type=float, default=240.0)
    parser.add_argument(
        "--hold",
        type=int,
        default=6,
        help="step commits held in flight at the cut (0: cut whenever the third is reached)",
    )
    parser.add_argument("--scenarios", nargs="+", default=["restart", "outage"])
    parser.add_argument("--before", metavar="REF", help="measure git REF first")
    args = parser.parse_args(argv)
    why = unavailable()
    if why:
        raise SystemExit(f"[failover] cannot run here: {why}")
    rows = []
    if args.before:
        path = checkout(args.before)
        try:
            rows += measure(path, args, f"before ({args.before})")
        finally:
            subprocess.run(
                ["git", "worktree", "remove", "--force", str(path)], cwd=common.ROOT, check=False
            )
    rows += measure(common.ROOT, args, "after")
    log("")
    log(
        f"{'':22} {'scenario':9} {'re-asked':>8} {'extra':>6} {'answered':>9} {'429':>5} "
        f"{'529':>5} {'retries':>7} {'resumed':>8}"
    )
    for r in rows:
        log(
            f"{r['label'][:22]:22} {r['scenario']:9} {r['turns_reasked']:>8} "
            f"{r['extra_answers']:>6} {r['answered']:>9} {r['rejected_429']!s:>5} "
            f"{r['overloaded_529']!s:>5} {r['commit_retries']:>7} {r['resumed_after_s']!s:>7}s"
        )
    common.write_result("failover", rows)  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
