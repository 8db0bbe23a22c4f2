"""Agent schedules: exactly one run per slot under chaos, and what firing costs at scale.

chaos   three ``runagents`` processes (4 slots each, the zero-latency fake API) and a
        schedule every 2 s (``--every``) for 60 s (``--duration``); every 10 s
        (``--kill-every``) one worker is SIGKILLed and started again. Then: the runs of each
        slot (target: exactly 1), the slots missed (target: 0; ``catch_up`` is off, so a slot
        the fleet did not fire in time is skipped for good and shows here) and the delay of
        each slot's run after its slot: its ``created_at`` (the firing) and its
        ``started_at`` (its first claim), p95 and max (target: created p95 < 1 s).
scale   10,000 schedules (every hour, so each fires once in the bench), 100 due each second,
        and 20,000 pending runs. In this process, as in a worker, a claimer thread times
        ``claim_runs`` (one run a claim, ~200 claims a second) while blocks of ``--block``
        seconds alternate: schedules firing (a firer thread calling ``fire_due`` as a worker's
        does, the next 100 x block schedules made due 100 per second) and not firing (no
        firer); with ``--compare-start`` a third kind of block starts the same 100 runs a
        second with ``start_run`` and no schedule (what creating the runs costs the claims,
        whoever creates them). Target: claim p99 firing / not firing <= 1.2. Each firing's
        statements are counted (on agent_schedule, and in all): on PostgreSQL the look that
        takes a batch and the one statement that fires it (target: one statement a batch).
        ``--firer-process`` fires from another process instead (what the GIL shared with the
        claimer costs).

    python -m bench.schedules              # both, full sizes
    python -m bench.schedules --quick      # chaos 20 s, scale 4 blocks of 3 s
    python -m bench.schedules --only scale --compare-start
    python -m bench.schedules --only scale
"""

from __future__ import annotations

import argparse
import datetime as dt
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from typing import Any

from bench import common
from bench.common import log
from bench.keys_crash import wait_listening

DB = "da_bench_schedules"
TICK = 0.25


# -- chaos ----------------------------------------------------------------------------------


def start_worker(url: str, base_url: str, i: int) -> subprocess.Popen[bytes]:
    return common.runagents(
        url,
        base_url,
        "--concurrency",
        "4",
        "--worker-id",
        f"w{i}",
        quiet=True,
        DA_BENCH_LEASE_SECONDS="5",
    )


def chaos(url: str, args: argparse.Namespace) -> dict[str, Any]:
    import psycopg

    from durable_agents.schedules.defining import schedule, slot_key

    every = dt.timedelta(seconds=args.every)
    kills = 0
    with common.fake_api() as base_url:
        procs = [start_worker(url, base_url, i) for i in range(3)]
        try:
            with psycopg.connect(url, autocommit=True) as conn:
                wait_listening(conn, procs)
                row = schedule("chaos", "bench", "A scheduled run.", every=every)
                first = row.next_slot
                assert first is not None
                began = time.monotonic()
                while time.monotonic() - began < args.duration:
                    time.sleep(min(args.kill_every, args.duration - (time.monotonic() - began)))
                    if time.monotonic() - began >= args.duration:
                        break
                    victim = kills % len(procs)
                    procs[victim].send_signal(signal.SIGKILL)
                    procs[victim].wait()
                    procs[victim] = start_worker(url, base_url, victim)
                    kills += 1
                (until,) = conn.execute("SELECT now()").fetchone()
                slots = []
                slot = first
                while slot <= until:
                    slots.append(slot)
                    slot += every
                # The slots up to the end: fired by now, or a moment later (at most a tick).
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    (fired,) = conn.execute(
                        "SELECT count(*) FROM agent_run WHERE start_key = ANY(%s)",
                        ([slot_key("chaos", s) for s in slots],),
                    ).fetchone()
                    if fired >= len(slots):
                        break
                    time.sleep(0.2)
                schedule("chaos", "bench", "A scheduled run.", every=every, enabled=False)
                # Their runs get done (the killed workers' after their leases ran out).
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    (left,) = conn.execute(
                        "SELECT count(*) FROM agent_run WHERE status <> 'succeeded'"
                    ).fetchone()
                    if not left:
                        break
                    time.sleep(0.2)
                rows = conn.execute(
                    "SELECT start_key, created_at, started_at, status FROM agent_run"
                ).fetchall()
        finally:
            common.stop_all(procs, 30)
    per_slot: Counter[dt.datetime] = Counter()
    created: list[float] = []
    started: list[float] = []
    wanted = set(slots)
    for key, created_at, started_at, _ in rows:
        slot = dt.datetime.fromisoformat(key.split("@", 1)[1])
        per_slot[slot] += 1
        if slot in wanted:
            created.append((created_at - slot).total_seconds())
            if started_at is not None:
                started.append((started_at - slot).total_seconds())
    missed = [s for s in slots if per_slot[s] == 0]
    res: dict[str, Any] = {
        "every_s": args.every,
        "duration_s": args.duration,
        "workers": 3,
        "kills": kills,
        "slots": len(slots),
        "runs": len(rows),
        "runs_per_slot": sorted(set(per_slot[s] for s in slots)),
        "slots_twice": sum(1 for n in per_slot.values() if n > 1),
        "missed": len(missed),
        "unfinished": sum(1 for *_, status in rows if status != "succeeded"),
        "created_delay": common.summary_ms(created),
        "created_p95_ms": common.pct(created, 95) * 1000,
        "started_delay": common.summary_ms(started),
        "started_p95_ms": common.pct(started, 95) * 1000,
    }
    res["met"] = (
        res["runs_per_slot"] == [1]
        and res["missed"] == 0
        and res["runs"] == res["slots"]
        and res["created_p95_ms"] < 1000
    )
    log(
        f"[schedules chaos] a slot every {args.every:g} s for {args.duration:g} s, 3 workers,"
        f" {kills} SIGKILLed: {res['slots']} slots, {res['runs']} runs, runs per slot"
        f" {res['runs_per_slot']}, {res['missed']} missed, {res['slots_twice']} twice,"
        f" {res['unfinished']} unfinished"
    )
    log(
        f"[schedules chaos] slot -> run created p95 {res['created_p95_ms']:.0f} ms, max"
        f" {res['created_delay']['max_ms']:.0f} ms; slot -> run started p95"
        f" {res['started_p95_ms']:.0f} ms, max {res['started_delay']['max_ms']:.0f} ms"
        f" -> {common.verdict(res['met'])} (1 run per slot, none missed, created p95 < 1 s)"
    )
    return res


# -- scale ----------------------------------------------------------------------------------


def load_scale(url: str, schedules: int, pending: int) -> None:
    """``schedules`` hourly schedules, none due (their next slot tomorrow), and ``pending``
    pending runs of the bench agent."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("TRUNCATE agent_run CASCADE")
        conn.execute("TRUNCATE agent_schedule RESTART IDENTITY")
        conn.execute(
            "INSERT INTO agent_schedule (name, agent, task, cron, every, timezone, priority,"
            " catch_up, enabled, next_slot, broken, created_at, updated_at)"
            " SELECT 's' || g, 'bench', 'Scheduled run ' || g || '.', '', interval '1 hour',"
            " 'UTC', 0, false, true, date_trunc('hour', now()) + interval '1 day', '', now(),"
            " now() FROM generate_series(1, %s) g",
            (schedules,),
        )
        conn.execute(
            "INSERT INTO agent_run (id, agent, prompt_version, fingerprint, model, task, status,"
            " attempt, stalled_claims, last_seq, error, created_at, updated_at)"
            " SELECT gen_random_uuid(), 'bench', '1', 'x', 'claude-bench-1', 'pending run ' || g,"
            " 'pending', 0, 0, 0, '', now() - interval '1 day' + g * interval '1 ms',"
            " now() - interval '1 day' + g * interval '1 ms' FROM generate_series(1, %s) g",
            (pending,),
        )
        conn.execute("VACUUM ANALYZE agent_schedule")
        conn.execute("VACUUM ANALYZE agent_run")


def make_due(url: str, first_id: int, count: int, per_second: int) -> None:
    """Schedules ``first_id`` .. ``first_id + count - 1`` due ``per_second`` a second, from a
    moment from now."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            "UPDATE agent_schedule SET next_slot = date_trunc('second', now())"
            " + interval '1 second' + ((id - %(first)s) / %(rate)s) * interval '1 second'"
            " WHERE id >= %(first)s AND id < %(first)s + %(count)s",
            {"first": first_id, "count": count, "rate": per_second},
        )


class Statements:
    """Counts the statements of one thread's connection, on agent_schedule and in all."""

    def __init__(self) -> None:
        self.total = 0
        self.on_schedules = 0

    def __call__(self, execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        self.total += 1
        if "agent_schedule" in sql:
            self.on_schedules += 1
        return execute(sql, params, many, context)


def firing(stop: threading.Event, batches: list[dict[str, int]], idle: list[int]) -> None:
    """What a worker's firer does (``ScheduleFirer``), counting each look's statements."""
    from django.db import connection

    from durable_agents.schedules.firing import fire_due

    try:
        while not stop.is_set():
            counter = Statements()
            with connection.execute_wrapper(counter):
                fired = fire_due()
            if fired.run_ids:
                batches.append(
                    {
                        "runs": len(fired.run_ids),
                        "schedules": fired.schedules,
                        "on_schedules": counter.on_schedules,
                        "total": counter.total,
                    }
                )
            else:
                idle.append(counter.total)
            wait = TICK if fired.next_in is None else min(TICK, fired.next_in)
            stop.wait(wait)
    finally:
        connection.close()


def starting(stop: threading.Event, rate: int, counter: list[int]) -> None:
    """The same load of new runs without schedules: ``rate`` ``start_run`` calls at each
    whole second, as the firing's slots come."""
    from django.db import connection

    import durable_agents

    try:
        while not stop.wait(1.0 - time.time() % 1.0):
            for _ in range(rate):
                counter[0] += 1
                durable_agents.start_run("bench", "A plain run.", key=f"plain:{counter[0]}")
    finally:
        connection.close()


def claiming(stop: threading.Event, latencies: list[float]) -> None:
    from django.db import connection

    from durable_agents.store import current

    try:
        while not stop.is_set():
            t = time.perf_counter()
            current().claim_runs("bench-claimer", 600.0, 1)
            latencies.append(time.perf_counter() - t)
            time.sleep(0.005)
    finally:
        connection.close()


def scale(url: str, args: argparse.Namespace) -> dict[str, Any]:
    load_scale(url, args.schedules, args.pending)
    modes = ("not_firing", "firing", "starting") if args.compare_start else ("not_firing", "firing")
    lat: dict[str, list[float]] = {mode: [] for mode in modes}
    batches: list[dict[str, int]] = []
    idle: list[int] = []
    next_id = 1
    plain = [0]
    for block in range(args.blocks):
        mode = modes[block % len(modes)]
        stop = threading.Event()
        threads = [threading.Thread(target=claiming, args=(stop, lat[mode]))]
        child = None
        if mode == "firing":
            count = int(args.block * args.rate)
            make_due(url, next_id, count, args.rate)
            next_id += count
            if args.firer_process:
                child = subprocess.Popen(
                    [common.PY, "-m", "bench.schedules", "--firer-child", str(args.block)],
                    cwd=common.ROOT,
                    env=common.bench_env(url),
                )
            else:
                threads.append(threading.Thread(target=firing, args=(stop, batches, idle)))
        elif mode == "starting":
            threads.append(threading.Thread(target=starting, args=(stop, args.rate, plain)))
        for thread in threads:
            thread.start()
        time.sleep(args.block)
        stop.set()
        for thread in threads:
            thread.join(60)
        if child is not None:
            child.wait(60)
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        (fired_runs,) = conn.execute(
            "SELECT count(*) FROM agent_run WHERE start_key LIKE 's%%@%%'"
        ).fetchone()
        rows = conn.execute(
            "SELECT EXTRACT(EPOCH FROM run.created_at - s.last_slot) FROM agent_run AS run"
            " JOIN agent_schedule AS s ON s.last_run_id = run.id"
        ).fetchall()
    delays = [float(d) for (d,) in rows]
    firing_ms = common.summary_ms(lat["firing"])
    quiet_ms = common.summary_ms(lat["not_firing"])
    per_schedule_stmts = sorted({b["on_schedules"] for b in batches})
    starting_ms = common.summary_ms(lat.get("starting", []))
    res: dict[str, Any] = {
        "claim_starting": starting_ms,
        "p99_ratio_starting": starting_ms["p99_ms"] / quiet_ms["p99_ms"],
        "plain_runs_started": plain[0],
        "schedules": args.schedules,
        "due_per_second": args.rate,
        "pending_runs": args.pending,
        "blocks": args.blocks,
        "block_s": args.block,
        "claim_firing": firing_ms,
        "claim_not_firing": quiet_ms,
        "p99_ratio": firing_ms["p99_ms"] / quiet_ms["p99_ms"],
        "p50_ratio": firing_ms["p50_ms"] / quiet_ms["p50_ms"],
        "firings": len(batches),
        "runs_fired": fired_runs,
        "schedules_made_due": next_id - 1,
        "runs_per_firing": common.summary_ms([b["runs"] / 1000 for b in batches]),
        "schedule_statements_per_firing": per_schedule_stmts,
        "statements_per_firing_max": max((b["total"] for b in batches), default=0),
        "statements_per_run": (
            sum(b["total"] - b["on_schedules"] for b in batches) / max(1, fired_runs)
        ),
        "idle_looks": len(idle),
        "idle_statements": sorted(set(idle)),
        "slot_to_created_p95_ms": common.pct(delays, 95) * 1000,
    }
    res["met"] = (
        res["p99_ratio"] <= 1.2
        # The look that takes the batch, the one statement that fires it, and (after a full
        # batch) the next look: the same for every firing, whatever its size.
        and max(per_schedule_stmts, default=0) <= 3
        and fired_runs == res["schedules_made_due"]
    )
    runs = [b["runs"] for b in batches]
    log(
        f"[schedules scale] {args.schedules:,} schedules, {args.rate} due a second,"
        f" {args.pending:,} pending runs; {len(batches)} firings of"
        f" {min(runs, default=0)}-{max(runs, default=0)} slots ({fired_runs} runs for"
        f" {res['schedules_made_due']} slots made due); statements on agent_schedule per"
        f" firing: {per_schedule_stmts}; in all up to {res['statements_per_firing_max']}"
        f" ({res['statements_per_run']:.1f} per run started); idle looks:"
        f" {res['idle_looks']} of {res['idle_statements']} statement(s)"
    )
    log(
        f"[schedules scale] claim p50/p99 not firing {quiet_ms['p50_ms']:.2f}/"
        f"{quiet_ms['p99_ms']:.2f} ms, firing {firing_ms['p50_ms']:.2f}/"
        f"{firing_ms['p99_ms']:.2f} ms: p99 ratio {res['p99_ratio']:.2f} (p50"
        f" {res['p50_ratio']:.2f}); slot -> run created p95"
        f" {res['slot_to_created_p95_ms']:.0f} ms -> {common.verdict(res['met'])} (<= 1.2)"
    )
    if "starting" in lat:
        log(
            f"[schedules scale] the same {args.rate} runs a second started with start_run, no"
            f" schedule: claim p50/p99 {starting_ms['p50_ms']:.2f}/{starting_ms['p99_ms']:.2f}"
            f" ms, p99 ratio {res['p99_ratio_starting']:.2f} (what creating the runs costs the"
            f" claims, whoever creates them)"
        )
    return res


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser()
    p.add_argument("--only", choices=("chaos", "scale"), default=None)
    p.add_argument("--every", type=float, default=2.0, help="chaos: seconds between slots")
    p.add_argument("--duration", type=float, default=60.0, help="chaos: seconds of firing")
    p.add_argument("--kill-every", type=float, default=10.0, help="chaos: seconds between kills")
    p.add_argument("--schedules", type=int, default=10_000)
    p.add_argument("--rate", type=int, default=100, help="scale: schedules due a second")
    p.add_argument("--pending", type=int, default=20_000)
    p.add_argument("--blocks", type=int, default=12, help="scale: alternating blocks")
    p.add_argument(
        "--compare-start",
        action="store_true",
        help="scale: a third kind of block, the same runs started by start_run (no schedule)",
    )
    p.add_argument("--block", type=float, default=5.0, help="scale: seconds per block")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default="schedules", help="bench/out/<OUT>.json")
    p.add_argument("--keep-db", action="store_true")
    p.add_argument(
        "--firer-process",
        action="store_true",
        help="scale: fire in another process than the claimer's (what the GIL costs)",
    )
    p.add_argument("--firer-child", type=float, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.firer_child is not None:
        import django

        django.setup()
        stop = threading.Event()
        threading.Timer(a.firer_child, stop.set).start()
        firing(stop, [], [])
        return {"met": True}
    if a.quick:
        a.duration, a.blocks, a.block = 20.0, 6 if a.compare_start else 4, 3.0
    url = common.fresh_db(DB)
    common.setup_django(url)
    res: dict[str, Any] = {}
    if a.only in (None, "chaos"):
        res["chaos"] = chaos(url, a)
    if a.only in (None, "scale"):
        res["scale"] = scale(url, a)
    res["met"] = all(part["met"] for part in res.values())
    common.write_result(a.out, res)
    if not a.keep_db:
        from django.db import connections

        connections.close_all()
        common.drop_db(DB)
    return res


if __name__ == "__main__":
    sys.exit(0 if main()["met"] else 1)
