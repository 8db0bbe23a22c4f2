"""The step log at scale: the same operations on 50 million steps (1,000,000 runs over 50
days) and on 1 million (20,000 runs, one day), side by side in one invocation.

The workload is a fleet that starts 20,000 runs of 50 steps a day (a million steps a day:
the task, then model turns of about 400 bytes and tool results of about 200 alternating), with
time-ordered run ids of their day, so that each day is one partition of agent_step. The small
database holds one such day, the large one fifty: the newest day is alike in both, only the
history behind it differs, which is what the partitions are meant to make cheap. In both, the
newest 300 runs are pending, one in a hundred of the days after the first is dead and one
waiting; one run of the newest day has 200 steps (the rebuild). The oldest day's runs all
ended long ago (the day retention drops).

Measured in each database, alternating between them round by round (one child process per
database serves the parent's requests; the figures are the child's own clock):

    claim       claim_runs(limit=1) of a pending run (then handed back): p50, p99
    commit      append_step of a tool result of ~200 bytes to a held run: p50, p99
    rebuild     load_log_rows of the 200-step run: p50
    start       start_run in a loop (its task step, and with NOTIFY on its notification):
                runs a second, 1 and 4 threads, NOTIFY off and on
    admin       the runs list and the operations page (Django's test client): p50, queries
    retention   last, once: apply_retention with the cutoff just after the oldest day, while
                another connection commits a step every 5 ms: the wall time, the time of the
                DETACH and DROP, and the longest commit meanwhile (the day is filled again
                afterwards, so the next invocation finds the same database)

The databases (da_bench_steps_1m, da_bench_steps_50m) are filled once with INSERT ... SELECT
and kept (a table bench_steps_fill records the fill); --refill fills again. Filling the large
one takes a while (about 15 minutes here) and about 20 GB of disk.

    python -m bench.step_log                       # both sizes
    python -m bench.step_log --days 1,5 --rounds 3 # a quick look at smaller sizes
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

from bench import common
from bench.common import log

FILL_VERSION = 1
RUNS_PER_DAY = 20_000
STEPS_PER_RUN = 50
PENDING = 300
REBUILD_STEPS = 200

# --- the fill (in a child with Django set up for its database) --------------------------------


def _run_id_sql(day_ms: str, g: str) -> str:
    """A time-ordered id of the g-th run of the day that starts at ``day_ms``."""
    ms = f"({day_ms} + ({g}) * {86_400_000 // RUNS_PER_DAY})"
    return (
        f"(lpad(to_hex({ms}), 12, '0') || '7' || substr(md5('a' || {g} || '-' || {day_ms}), 1, 3)"
        f" || '8' || substr(md5('b' || {g} || '-' || {day_ms}), 1, 15))::uuid"
    )


def fill_day(cursor: Any, index: int, days: int, fingerprint: str) -> None:
    """Day ``index`` of ``days`` (0 is the oldest, ``days`` - 1 is yesterday). Rows already
    there are kept (a day filled again after the retention measurement)."""
    from django.db import connection

    from durable_agents.models import step_partitions
    from durable_agents.models.ids import part_of_day

    today = datetime.datetime.now(datetime.UTC).date()
    day = today - datetime.timedelta(days=days - index)
    part = part_of_day(day)
    day_ms = part * 86_400_000
    step_partitions.ensure_days(connection, part, part)
    rid = _run_id_sql(str(day_ms), "g")
    created = f"to_timestamp(({day_ms} + g * {86_400_000 // RUNS_PER_DAY}) / 1000.0)"
    kept = "FALSE" if index == 0 else "TRUE"  # the oldest day: every run ended
    status = (
        f"CASE WHEN {kept} AND g % 100 = 7 THEN 'dead' WHEN {kept} AND g % 100 = 8 THEN 'waiting'"
        " ELSE 'succeeded' END"
    )
    cursor.execute(
        "INSERT INTO agent_run (id, agent, prompt_version, fingerprint, model, task, status,"
        " attempt, stalled_claims, last_seq, tokens_used, result, error, created_at, updated_at,"
        " started_at, finished_at, waiting_for, depth, priority, dead_cause, fair_at)"
        f" SELECT {rid}, 'bench', '1', '{fingerprint}', 'claude-bench-1', 'Step log run ' || g, s,"
        " CASE WHEN s = 'pending' THEN 0 ELSE 1 END, 0,"
        f" CASE WHEN s = 'pending' THEN 0 ELSE {STEPS_PER_RUN - 1} END, 1000,"
        " CASE WHEN s = 'succeeded' THEN 'done' END,"
        " CASE WHEN s = 'dead' THEN 'bench: dead' ELSE '' END, c, c,"
        " CASE WHEN s <> 'pending' THEN c END,"
        " CASE WHEN s = 'succeeded' THEN c + interval '10 minutes' END,"
        " CASE WHEN s = 'waiting' THEN 'event' ELSE '' END, 0, 0, '', c"
        f" FROM (SELECT g, {created} AS c, {status} AS s"
        f"       FROM generate_series(0, {RUNS_PER_DAY - 1}) g) runs"
        " ON CONFLICT DO NOTHING"
    )
    payload = (
        "CASE WHEN t.seq = 0 THEN '\"Step log run ' || g || '\"'"
        " WHEN t.seq % 2 = 1 THEN '{\"id\":\"msg_' || md5(g || 'm' || t.seq) ||"
        ' \'","type":"message","role":"assistant","model":"claude-bench-1",'
        '"content":[{"type":"text","text":"Looking at item \' || t.seq || \' of run \' || g ||'
        ' \'."},{"type":"tool_use","id":"toolu_\' || md5(g || \'t\' || t.seq) ||'
        ' \'","name":"noop","input":{"key":"k\' || t.seq || \'"}}],'
        '"stop_reason":"tool_use","usage":{"input_tokens":1200,"output_tokens":60}}\''
        ' ELSE \'[{"type":"tool_result","tool_use_id":"toolu_\' || md5(g || \'t\' ||'
        " (t.seq - 1)) || '\",\"content\":\"ok-k' || t.seq || ' ' || repeat('.', 60) || '\"}]'"
        " END"
    )
    cursor.execute(
        "INSERT INTO agent_step (run_id, seq, part, kind, payload, request_id, attempt, worker,"
        " created_at)"
        f" SELECT {rid}, t.seq, {part},"
        " CASE WHEN t.seq = 0 THEN 'task' WHEN t.seq % 2 = 1 THEN 'model_turn'"
        " ELSE 'tool_result' END,"
        f" {payload},"
        " CASE WHEN t.seq % 2 = 1 THEN 'req_' || substr(md5(g || 'r' || t.seq), 1, 24) END,"
        f" 1, 'bench', {created} + t.seq * interval '5 seconds'"
        f" FROM generate_series(0, {RUNS_PER_DAY - 1}) g"
        f" CROSS JOIN generate_series(0, {STEPS_PER_RUN - 1}) t(seq)"
        " ON CONFLICT DO NOTHING"
    )


def fill(days: int) -> float:
    """Fill the migrated database of this process with ``days`` days; seconds taken."""
    from django.db import connection

    started = time.perf_counter()
    fingerprint = bench_fingerprint()
    with connection.cursor() as cursor:
        cursor.execute("SET synchronous_commit = off")
        for index in range(days):
            fill_day(cursor, index, days, fingerprint)
            log(f"  {days} days: day {index + 1} filled")
        _add_today()
        cursor.execute("VACUUM ANALYZE")
        cursor.execute("CREATE TABLE IF NOT EXISTS bench_steps_fill (version int, days int)")
        cursor.execute("DELETE FROM bench_steps_fill")
        cursor.execute("INSERT INTO bench_steps_fill VALUES (%s, %s)", [FILL_VERSION, days])
    return time.perf_counter() - started


def bench_fingerprint() -> str:
    """The fingerprint of the bench agent as this code computes it (runs filled with another
    would be dead-lettered for prompt drift when claimed)."""
    from durable_agents.declare.agents import registry

    return registry.get("bench").fingerprint()


def _add_today() -> None:
    """Today's runs: PENDING runs waiting for a worker, and one of REBUILD_STEPS steps (the
    rebuild's), through the app as a fleet would start them."""
    import durable_agents
    from durable_agents.models import AgentRun, AgentStep

    for i in range(PENDING):
        durable_agents.start_run("bench", f"Pending run {i}")
    run = durable_agents.start_run("bench", "The long run.", key="bench-rebuild")
    AgentStep.objects.bulk_create(
        AgentStep(
            run_id=run.pk,
            seq=seq,
            kind="model_turn" if seq % 2 else "tool_result",
            payload=json.dumps({"step": seq, "text": "x" * 300}),
        )
        for seq in range(1, REBUILD_STEPS)
    )
    AgentRun.objects.filter(pk=run.pk).update(status="waiting", last_seq=REBUILD_STEPS - 1)


def filled(url: str, days: int) -> bool:
    import psycopg

    try:
        with psycopg.connect(url, autocommit=True) as conn:
            row = conn.execute("SELECT version, days FROM bench_steps_fill").fetchone()
    except psycopg.Error:
        return False
    return row == (FILL_VERSION, days)


# --- the child: serves the parent's measurements -------------------------------------------------


class Child:
    def __init__(self, days: int) -> None:
        from django.contrib.auth import get_user_model
        from django.test import Client

        from durable_agents.models import AgentRun

        self.days = days
        user_model = get_user_model()
        user = user_model.objects.filter(username="bench-admin").first()
        if user is None:
            user = user_model.objects.create_superuser("bench-admin", "b@example.com", "pw")
        self.client = Client()
        self.client.force_login(user)
        self.rebuild_run = AgentRun.objects.get(start_key="bench-rebuild").pk
        self.held: Any = None
        self.seq = 0

    def claim(self, n: int = 100) -> dict[str, Any]:
        from durable_agents.store import current

        store = current()
        times = []
        for _ in range(n):
            t = time.perf_counter()
            (claim,) = store.claim_runs("bench-claimer", 60, 1)
            times.append(time.perf_counter() - t)
            store.release_lease(claim, count_claim=False)
        return {"ms": [s * 1000 for s in times]}

    def commit(self, n: int = 200) -> dict[str, Any]:
        import durable_agents
        from durable_agents.store import StepWrite, current

        store = current()
        if self.held is None:
            durable_agents.start_run("bench", "commit target", priority=100)
            (self.held,) = store.claim_runs("bench-committer", 3600, 1)
            self.seq = self.held.run.last_seq
        times = []
        for _ in range(n):
            self.seq += 1
            payload = json.dumps([{"type": "tool_result", "content": "ok " + "." * 160}])
            t = time.perf_counter()
            ok = store.append_step(self.held, StepWrite(self.seq, "tool_result", payload))
            times.append(time.perf_counter() - t)
            assert ok
        return {"ms": [s * 1000 for s in times]}

    def throughput(self, threads: int = 4, seconds: float = 3.0) -> dict[str, Any]:
        """Steps committed a second by ``threads`` threads, each on a run of its own, and the
        WAL written per step (pg_current_wal_lsn before and after)."""
        from django.db import connection

        import durable_agents
        from durable_agents.store import StepWrite, current

        store = current()
        claims = []
        for i in range(threads):
            durable_agents.start_run("bench", f"throughput {i}", priority=90)
            (claim,) = store.claim_runs("bench-throughput", 3600, 1)
            claims.append(claim)
        counts = [0] * threads
        payload = json.dumps([{"type": "tool_result", "content": "ok " + "." * 160}])

        def lsn() -> int:
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn")
                return int(cursor.fetchone()[0])

        def committing(i: int) -> None:
            claim, seq = claims[i], claims[i].run.last_seq
            try:
                while time.perf_counter() < deadline:
                    seq += 1
                    assert store.append_step(claim, StepWrite(seq, "tool_result", payload))
                    counts[i] += 1
            finally:
                connection.close()

        before = lsn()
        began = time.perf_counter()
        deadline = began + seconds
        workers = [threading.Thread(target=committing, args=(i,)) for i in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        elapsed = time.perf_counter() - began
        total = sum(counts)
        for claim in claims:
            store.finish_run(claim, "succeeded", result="done")
        return {
            "commits_per_second": total / elapsed,
            "wal_bytes_per_step": (lsn() - before) / total,
            "payload_bytes": len(payload),
        }

    def rebuild(self, n: int = 30) -> dict[str, Any]:
        from durable_agents.store import current

        store = current()
        times = []
        for _ in range(n):
            t = time.perf_counter()
            # As a claim rebuilds a run that is no fork (runner.py: shares=False).
            rows = store.load_log_rows(self.rebuild_run, shares=False)
            times.append(time.perf_counter() - t)
            assert len(rows) == REBUILD_STEPS
        return {"ms": [s * 1000 for s in times]}

    def start(self, threads: int = 1, notify: bool = False, seconds: float = 2.0) -> dict[str, Any]:
        from django.conf import settings
        from django.db import connection
        from django.utils import timezone

        import durable_agents
        from durable_agents.models import AgentRun

        settings.DURABLE_AGENTS["NOTIFY"] = notify
        counts = [0] * threads
        deadline = time.perf_counter() + seconds

        def starting(i: int) -> None:
            try:
                while time.perf_counter() < deadline:
                    durable_agents.start_run("bench", "started")
                    counts[i] += 1
            finally:
                connection.close()

        workers = [threading.Thread(target=starting, args=(i,)) for i in range(threads)]
        began = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        per_second = sum(counts) / (time.perf_counter() - began)
        settings.DURABLE_AGENTS["NOTIFY"] = False
        # Ended at once, so that both databases keep the same pending runs for the claims.
        AgentRun.objects.filter(task="started", status="pending").update(
            status="cancelled", finished_at=timezone.now()
        )
        return {"per_second": per_second}

    def admin(self, page: str, n: int = 5) -> dict[str, Any]:
        from django.db import connection
        from django.test.utils import CaptureQueriesContext

        path = {
            "runs list": "/admin/durable_agents/agentrun/",
            "operations": "/admin/durable_agents/agentrun/operations/",
        }[page]
        self.client.get(path)
        times = []
        for _ in range(n):
            t = time.perf_counter()
            response = self.client.get(path)
            times.append(time.perf_counter() - t)
            assert response.status_code == 200, response.status_code
        with CaptureQueriesContext(connection) as queries:
            self.client.get(path)
        return {"ms": [s * 1000 for s in times], "queries": len(queries)}

    def retention(self) -> dict[str, Any]:
        """Drop the oldest day while another connection commits steps."""
        import psycopg
        from django.conf import settings
        from django.db import connection

        from durable_agents.housekeeping import step_log as step_log_module
        from durable_agents.housekeeping import sweeps

        oldest_end = datetime.datetime.combine(
            datetime.datetime.now(datetime.UTC).date() - datetime.timedelta(days=self.days - 1),
            datetime.time(),
            tzinfo=datetime.UTC,
        )
        # The cutoff a little after the oldest day's end: its runs ended 10 minutes after
        # they started, those of the next day have not all ended by then.
        cutoff = oldest_end + datetime.timedelta(minutes=30)
        settings.DURABLE_AGENTS["RETENTION_DAYS"] = None
        drop_seconds: list[float] = []
        original = step_log_module.DayPartitions.drop_days

        def timed(self: Any, days: set[int]) -> list[int]:
            t = time.perf_counter()
            try:
                return original(self, days)
            finally:
                drop_seconds.append(time.perf_counter() - t)

        step_log_module.DayPartitions.drop_days = timed  # type: ignore[method-assign]
        stop = threading.Event()
        commit_ms: list[float] = []
        url = common.db_url(connection.settings_dict["NAME"])

        def committing() -> None:
            with psycopg.connect(url, autocommit=True) as conn:
                (run_id,) = conn.execute(
                    "SELECT id FROM agent_run WHERE start_key = 'bench-rebuild'"
                ).fetchone()
                seq = 100_000
                while not stop.is_set():
                    t = time.perf_counter()
                    conn.execute(
                        "INSERT INTO agent_step (run_id, seq, part, kind, payload, attempt,"
                        " worker) VALUES (%s, %s, %s, 'tool_result', '\"x\"', 0, '')",
                        [run_id, seq, _part(run_id)],
                    )
                    commit_ms.append((time.perf_counter() - t) * 1000)
                    seq += 1
                    time.sleep(0.005)

        committer = threading.Thread(target=committing)
        committer.start()
        t = time.perf_counter()
        try:
            settings.DURABLE_AGENTS["RETENTION_DAYS"] = (
                datetime.datetime.now(datetime.UTC) - cutoff
            ).total_seconds() / 86_400
            deleted = sweeps.apply_retention()
        finally:
            total = time.perf_counter() - t
            stop.set()
            committer.join()
            step_log_module.DayPartitions.drop_days = original  # type: ignore[method-assign]
            settings.DURABLE_AGENTS["RETENTION_DAYS"] = None
        with connection.cursor() as cursor:
            cursor.execute("DELETE FROM agent_step WHERE seq >= 100000")
            for index in range(min(2, self.days)):  # what retention deleted, back
                fill_day(cursor, index, self.days, bench_fingerprint())
            cursor.execute("VACUUM ANALYZE agent_run")
        return {
            "runs_deleted": deleted,
            "seconds": total,
            "drop_seconds": sum(drop_seconds),
            "commits_meanwhile": len(commit_ms),
            "longest_commit_ms": max(commit_ms) if commit_ms else None,
            "commit_p50_ms": statistics.median(commit_ms) if commit_ms else None,
        }


def _part(run_id: Any) -> int:
    from durable_agents.models.ids import step_part

    return step_part(run_id)


def serve(days: int) -> None:
    import django

    django.setup()
    child = Child(days)
    print("READY", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        result = getattr(child, request["op"])(**request.get("args", {}))
        print(json.dumps(result), flush=True)


# --- the parent --------------------------------------------------------------------------------


def prepare(days: int, refill: bool) -> tuple[str, dict[str, Any]]:
    name = f"da_bench_steps_{days}d"
    url = common.db_url(name)
    if refill or not filled(url, days):
        log(f"filling {name}: {days} days of {RUNS_PER_DAY:,} runs of {STEPS_PER_RUN} steps")
        url = common.fresh_db(name)
        subprocess.run(
            [common.PY, "-m", "bench.step_log", "--fill", str(days)],
            cwd=common.ROOT,
            env=common.bench_env(url),
            check=True,
        )
    common.migrate(url)
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("ANALYZE agent_step")
        size = conn.execute("SELECT pg_database_size(current_database())").fetchone()[0]
        count = sum(
            int(r[0])
            for r in conn.execute(
                "SELECT c.reltuples FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid"
                " WHERE i.inhparent = 'agent_step'::regclass"
            ).fetchall()
        )
    return url, {"steps": count, "database_bytes": size}


def report(results: dict[str, Any], sizes: list[int]) -> str:
    """The figures, one line each: the small database against the large."""
    small, large = sizes[0], sizes[-1]
    lines = [
        f"step log: {results['sizes'][small]['steps']:,} steps ({small} d) vs "
        f"{results['sizes'][large]['steps']:,} ({large} d)"
    ]
    for label, row in results["ops"].items():
        a, b = row[small], row[large]
        if "per_second" in a:
            lines.append(
                f"  {label:<26} {a['per_second']:8.0f}/s vs {b['per_second']:8.0f}/s"
                f"  ratio {b['per_second'] / a['per_second']:.2f}"
            )
        else:
            lines.append(
                f"  {label:<26} p50 {a['p50_ms']:7.2f} vs {b['p50_ms']:7.2f} ms"
                f" (x{b['p50_ms'] / a['p50_ms']:.2f}), p99 {a['p99_ms']:7.2f} vs"
                f" {b['p99_ms']:7.2f} ms (x{b['p99_ms'] / a['p99_ms']:.2f})"
                + (f", queries {a.get('queries')} / {b.get('queries')}" if "queries" in a else "")
            )
    for days, r in results["throughput"].items():
        lines.append(
            f"  4 committers ({days} d): {r['commits_per_second']:.0f} steps/s,"
            f" {r['wal_bytes_per_step']:.0f} B of WAL a step ({r['payload_bytes']} B payload)"
        )
    for days, r in results["retention"].items():
        lines.append(
            f"  retention ({days} d): {r['runs_deleted']:,} runs, {r['seconds']:.2f} s, drop"
            f" {r['drop_seconds']:.3f} s; {r['commits_meanwhile']} commits meanwhile, longest"
            f" {r['longest_commit_ms']:.1f} ms, p50 {r['commit_p50_ms']:.2f} ms"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--days", default="1,50", help="days of runs in each database")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--refill", action="store_true")
    parser.add_argument("--only", help="measure these operations only (claim,rebuild,...)")
    parser.add_argument(
        "--no-retention", action="store_true", help="leave out the retention measurement"
    )
    parser.add_argument("--fill", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.fill:
        import django

        django.setup()
        seconds = fill(args.fill)
        log(f"  filled in {seconds:.0f} s")
        return
    if args.serve:
        serve(args.serve)
        return
    sizes = [int(d) for d in args.days.split(",")]
    children: dict[int, subprocess.Popen[str]] = {}
    facts: dict[int, dict[str, Any]] = {}
    for days in sizes:
        url, facts[days] = prepare(days, args.refill)
        proc = subprocess.Popen(
            [common.PY, "-m", "bench.step_log", "--serve", str(days)],
            cwd=common.ROOT,
            env=common.bench_env(url),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "READY"
        children[days] = proc

    def ask(days: int, op: str, **op_args: Any) -> dict[str, Any]:
        proc = children[days]
        assert proc.stdin is not None
        assert proc.stdout is not None
        proc.stdin.write(json.dumps({"op": op, "args": op_args}) + "\n")
        proc.stdin.flush()
        return json.loads(proc.stdout.readline())

    ops: list[tuple[str, str, dict[str, Any]]] = [
        ("claim", "claim", {}),
        ("commit", "commit", {}),
        ("rebuild", "rebuild", {}),
        ("runs list", "admin", {"page": "runs list"}),
        ("operations", "admin", {"page": "operations"}),
        ("start, 1 thread", "start", {"threads": 1}),
        ("start, 4 threads", "start", {"threads": 4}),
        ("start, 1 thread, NOTIFY", "start", {"threads": 1, "notify": True}),
        ("start, 4 threads, NOTIFY", "start", {"threads": 4, "notify": True}),
    ]
    if args.only:
        wanted = set(args.only.split(","))
        ops = [op for op in ops if op[1] in wanted or op[0] in wanted]
    samples: dict[str, dict[int, list[dict[str, Any]]]] = {
        label: {d: [] for d in sizes} for label, _, _ in ops
    }
    for round_no in range(args.rounds):
        order = sizes if round_no % 2 == 0 else list(reversed(sizes))
        for label, op, op_args in ops:
            for days in order:
                samples[label][days].append(ask(days, op, **op_args))
        log(f"round {round_no + 1} of {args.rounds}")
    final = not (args.only or args.no_retention)
    throughput = {days: ask(days, "throughput") for days in sizes} if final else {}
    retention = {days: ask(days, "retention") for days in sizes} if final else {}
    for proc in children.values():
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(60)

    results: dict[str, Any] = {"sizes": {d: facts[d] for d in sizes}, "ops": {}}
    for label, op, _ in ops:
        row: dict[str, Any] = {}
        for days in sizes:
            got = samples[label][days]
            if op == "start":
                row[days] = {"per_second": statistics.median(g["per_second"] for g in got)}
            else:
                ms = [m for g in got for m in g["ms"]]
                row[days] = {
                    "p50_ms": common.pct(ms, 50),
                    "p99_ms": common.pct(ms, 99),
                    **({"queries": got[-1]["queries"]} if "queries" in got[-1] else {}),
                }
        results["ops"][label] = row
    results["retention"] = retention
    results["throughput"] = throughput
    print(report(results, sizes))
    common.write_result("step_log", results)


if __name__ == "__main__":
    main()
