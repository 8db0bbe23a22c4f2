"""Durable waits: what waiting runs cost the claim, and how fast an event wakes them.

1. **claim**: ``PostgresStore().claim_runs(owner, 60, limit)`` in two databases that both hold
   the same 10,000 pending runs (``--pending``, each with its task step); one of them also holds
   100,000 waiting runs (``--waiting``): 40 % on timers due in 1 h to 8 days, 40 % on events
   not sent yet with a timeout (``wake_at`` in 1 to 8 days), 20 % on events without a timeout
   (``wake_at`` NULL), on 5,000 event names with their unsent ``agent_event`` rows, each run
   with its task and the model turn that asked for the wait. Both are bulk-loaded with
   INSERT ... SELECT generate_series and VACUUM ANALYZEd. One long-lived child process per
   database (bench settings, warmed up) times each claim in the client and then hands the run
   back (``release_lease(count_claim=False)``, the worker's own hand-back), so every claim
   takes the same oldest pending run: an identical workload. Blocks of claims alternate
   between the two (the order swapped every block), each block after a VACUUM of agent_run in
   both databases, so that machine noise and dead tuples hit both alike. Target: claim p99
   with 100,000 waiting / p99 with none <= 1.2. The claim's EXPLAIN (ANALYZE, BUFFERS) with
   100,000 waiting shows the partial indexes agent_run_wake (CTE ``due``) and
   agent_run_claim (CTE ``ready``); the EXPLAIN of send_event's UPDATE there shows
   agent_run_wait_event. Both plans are kept, and whether the UPDATE reads agent_run with a
   Seq Scan (the planner's choice for a small table: it expects a tenth of the pending runs
   from the CTEs, whose LIMIT is not a constant) rather than by primary key.

2. **wake**: a real worker (``runagents --concurrency 1000 --poll-interval 30`` in its own
   process, LISTEN on) against a fake Messages API (this module's ``api``: the zero-latency
   answers of ``bench.fakeapi`` in one asyncio process, recording the arrival time of every
   request with the turn it asks for). 1,000 runs of the ``bench_wait`` agent park on one
   event through a real tool call (``await_bench_event`` raises ``Wait(event=...,
   timeout=3600)``); then ``durable_agents.send_event`` wakes them, under Django's
   CaptureQueriesContext (the UPDATE agent_run statements are counted: one). Per run: its
   first model request after the wake (the request that carries turn 1) minus the time
   send_event returned, i.e. just after its commit; p50, p99, max over the 1,000 runs. A
   warm-up round of 50 runs comes first, not counted. Also kept: how long parking took, when
   the last run finished, and the CPU time meanwhile of the worker, of the fake API and of the
   PostgreSQL server's processes (which share this machine's cores). With ``--timer-in S``
   the 1,000 runs park instead on one timer (``await_bench_timer``: ``Wait(until=...)``) due
   S seconds after they start parking, and every time is counted from its due time.

PostgreSQL only: without a reachable PostgreSQL server (``BENCH_PG``), it says so and writes
``{"skipped": ...}``.

    python -m bench.waits                          # about 2.5 minutes on 2 CPUs
    python -m bench.waits --claims 600 --blocks 3  # fewer claims (run_all --quick)
    python -m bench.waits --skip wake              # the claim only (or --skip claim)
    BENCH_PERF=/tmp/perf python -m bench.waits --skip claim   # and where the worker's CPU goes
    BENCH_PGSS=1 python -m bench.waits --skip claim   # and the server's time by statement
                                                     # (shared_preload_libraries must hold
                                                     # pg_stat_statements)
    python -m bench.waits --skip claim --timer-in 40 --poll-interval 1   # woken by one timer
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench import common
from bench.common import log
from durable_agents import Agent, Wait, tool

NONE_DB, WAITING_DB, WAKE_DB = "da_bench_waits_none", "da_bench_waits_100k", "da_bench_waits_wake"
LOGFILE = common.OUT / "waits_worker.log"
MODEL = "claude-bench-1"
EVENT_NAMES = 5000  # distinct events the waiting rows of the claim benchmark wait on


# --- the agent of the wake benchmark (registered in every process that imports this module) ---


@tool(effect="pure")
def await_bench_event(name: str, *, woken_by: dict[str, Any] | None = None) -> Any:
    """Wait for the event ``name`` (at most an hour), then return what woke the run."""
    if woken_by is None:
        raise Wait(event=name, timeout=3600)
    return woken_by


@tool(effect="pure")
def await_bench_timer(at: str, *, woken_by: dict[str, Any] | None = None) -> Any:
    """Wait until ``at`` (an ISO 8601 time with its offset), then return what woke the run."""
    if woken_by is None:
        raise Wait(until=datetime.datetime.fromisoformat(at))
    return woken_by


bench_wait = Agent(
    name="bench_wait",
    version="1",
    model=MODEL,
    system="You are a benchmark agent.",
    tools=[await_bench_event, await_bench_timer],
    max_tokens=256,
)


def wait_task(label: str, i: int, event: str, at: str | None = None) -> str:
    """A run that waits on ``event`` (or until ``at``) in its first turn and ends in its
    second."""
    if at is not None:
        return f'{label} run {i}.\n@await_bench_timer {{"at": "{at}"}}'
    return f'{label} run {i}.\n@await_bench_event {{"name": "{event}"}}'


# --- 1. the claim with and without waiting runs -----------------------------------------------

_RUN_COLUMNS = (
    "id, agent, prompt_version, fingerprint, model, task, status, attempt, stalled_claims, "
    "last_seq, tokens_used, error, created_at, updated_at, started_at, depth, waiting_for, "
    "waiting_since, wake_at, wait_event, wait_key"
)

# The model turn that asked for the wait, as the fake API sends it, for every waiting run (r):
# its content span is computed as the worker records it (character offsets of the array).
_TURN_SQL = """
INSERT INTO agent_step (run_id, seq, kind, payload, content_start, content_end, request_id,
                        attempt, worker, created_at)
SELECT id, 1, 'model_turn', head || content || tail, length(head),
       length(head) + length(content), 'req_bench_' || n, 1, 'bench-worker', created_at
  FROM (SELECT id, created_at, n,
               '{"id": "msg_bench_' || n || '", "type": "message", "role": "assistant", '
               || '"model": "claude-bench-1", "content": ' AS head,
               '[{"type": "text", "text": "Step 1: waiting."}, {"type": "tool_use", "id": '
               || '"toolu_' || n || '", "name": '
               || CASE WHEN waiting_for = 'timer' THEN '"nap", "input": {"seconds": 86400}}]'
                       ELSE '"await_bench_event", "input": {"name": "' || wait_event || '"}}]'
                  END AS content,
               ', "stop_reason": "tool_use", "stop_sequence": null, "usage": '
               || '{"input_tokens": 120, "output_tokens": 12}}' AS tail
          FROM (SELECT id, created_at, waiting_for, wait_event,
                       lpad((row_number() OVER (ORDER BY created_at))::text, 14, '0') AS n
                  FROM agent_run WHERE status = 'waiting') AS w) AS r"""


def load(url: str, pending: int, waiting: int, fingerprint: str) -> float:
    """``pending`` pending runs and ``waiting`` waiting runs, with their steps; seconds."""
    import psycopg

    t = time.perf_counter()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("TRUNCATE agent_run, agent_event CASCADE")
        if waiting:
            # 40 % timers, 40 % events with a timeout, 20 % events without; created over the
            # last two days, parked after their first turn; nothing due for 1 h at least.
            conn.execute(
                f"INSERT INTO agent_run ({_RUN_COLUMNS}) "
                "SELECT gen_random_uuid(), 'bench_wait', '1', %(fp)s, %(model)s,"
                " 'Waiting run ' || g || '.', 'waiting', 1, 0, 1, 132, '',"
                " now() - interval '2 days' + g * interval '1 ms',"
                " now() - interval '1 day' + g * interval '1 ms',"
                " now() - interval '2 days' + g * interval '1 ms', 0,"
                " CASE WHEN g %% 5 < 2 THEN 'timer' ELSE 'event' END,"
                " now() - interval '1 day' + g * interval '1 ms',"
                " now() + CASE WHEN g %% 5 < 2 THEN interval '1 hour'"
                "              WHEN g %% 5 < 4 THEN interval '1 day' END"
                "       + (g %% 604800) * interval '1 s',"
                " CASE WHEN g %% 5 >= 2 THEN 'order-' || (g %% %(names)s) END,"
                " md5(g::text) || md5((-g)::text) "
                "FROM generate_series(1, %(n)s) g",
                {"fp": fingerprint, "model": MODEL, "n": waiting, "names": EVENT_NAMES},
            )
            conn.execute(_TURN_SQL)
            conn.execute(
                "INSERT INTO agent_event (name, created_at) SELECT 'order-' || g,"
                " now() - interval '2 days' FROM generate_series(0, %s) g",
                (EVENT_NAMES - 1,),
            )
        conn.execute(
            f"INSERT INTO agent_run ({_RUN_COLUMNS}) "
            "SELECT gen_random_uuid(), 'bench_wait', '1', %(fp)s, %(model)s,"
            " 'Pending run ' || g || '.', 'pending', 0, 0, 0, 0, '',"
            " now() - interval '1 day' + g * interval '1 ms',"
            " now() - interval '1 day' + g * interval '1 ms', NULL, 0, '', NULL, NULL, NULL, NULL "
            "FROM generate_series(1, %(n)s) g",
            {"fp": fingerprint, "model": MODEL, "n": pending},
        )
        # Every run's task, as start_run stores it (a JSON string).
        conn.execute(
            "INSERT INTO agent_step (run_id, seq, kind, payload, attempt, worker, created_at)"
            " SELECT id, 0, 'task', to_json(task)::text, 0, '', created_at FROM agent_run"
        )
        conn.execute("VACUUM ANALYZE agent_run")
        conn.execute("VACUUM ANALYZE agent_step")
        conn.execute("VACUUM ANALYZE agent_event")
    return time.perf_counter() - t


def counts(url: str) -> dict[str, Any]:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        by_status = dict(
            conn.execute("SELECT status, count(*) FROM agent_run GROUP BY status").fetchall()
        )
        kinds = dict(
            conn.execute(
                "SELECT waiting_for || CASE WHEN wake_at IS NULL THEN '' ELSE '+wake_at' END,"
                " count(*) FROM agent_run WHERE status = 'waiting' GROUP BY 1"
            ).fetchall()
        )
        steps = conn.execute("SELECT count(*) FROM agent_step").fetchone()[0]
        sizes = dict(
            conn.execute(
                "SELECT c.relname, pg_size_pretty(pg_relation_size(c.oid)) FROM pg_class c"
                " WHERE c.relname = 'agent_run' OR c.oid IN (SELECT indexrelid FROM pg_index"
                " WHERE indrelid = 'agent_run'::regclass) ORDER BY pg_relation_size(c.oid) DESC"
            ).fetchall()
        )
    return {"statuses": by_status, "waiting_kinds": kinds, "steps": steps, "sizes": sizes}


# The claim statement of 25467b5, before durable waits (no due-waits CTE): the "before" side of
# the hot-path comparison (same database, same rows, alternating blocks).
CLAIM_SQL_BEFORE_WAITS = """
UPDATE agent_run AS run
   SET status = 'running',
       lease_owner = %(owner)s,
       lease_until = now() + make_interval(secs => %(lease)s),
       attempt = run.attempt + 1,
       stalled_claims = run.stalled_claims + 1,
       started_at = coalesce(run.started_at, now()),
       updated_at = now()
 WHERE run.id IN (
SELECT id FROM agent_run
 WHERE status IN ('pending', 'running')
   AND (lease_until IS NULL OR lease_until < now())
 ORDER BY created_at
 LIMIT %(limit)s
   FOR NO KEY UPDATE SKIP LOCKED)
RETURNING run.*,
          -- A run with nothing but its task: its log comes with the claim (no second read).
          (SELECT payload FROM agent_step
            WHERE run_id = run.id AND seq = 0 AND kind = 'task' AND run.last_seq = 0
          ) AS task_payload"""


def claim_child() -> None:
    """A bench-settings process on one database: ``block N LIMIT`` times N claims (each handed
    back at once), ``explain LIMIT`` prints the plans; one RESULT line per command."""
    import django

    django.setup()
    from django.db import connection, transaction
    from django.test.utils import CaptureQueriesContext

    from durable_agents.store.postgres import CLAIM_SQL, PostgresStore

    store = PostgresStore()
    owner = f"bench-waits-{os.getpid()}"

    def once(limit: int) -> float:
        t = time.perf_counter()
        claims = store.claim_runs(owner, 60, limit)
        dt = time.perf_counter() - t
        if len(claims) != limit:
            raise RuntimeError(f"claimed {len(claims)} runs, wanted {limit}")
        for claim in claims:
            if not store.release_lease(claim, count_claim=False):
                raise RuntimeError("could not hand a claimed run back")
        return dt

    def once_before(limit: int) -> float:
        """The same claim and hand-back with the statement of before durable waits."""
        from durable_agents.models import AgentRun
        from durable_agents.store import Claim

        params = {"owner": owner, "lease": 60.0, "limit": limit}
        t = time.perf_counter()
        runs = list(AgentRun.objects.raw(CLAIM_SQL_BEFORE_WAITS, params))
        dt = time.perf_counter() - t
        if len(runs) != limit:
            raise RuntimeError(f"claimed {len(runs)} runs, wanted {limit}")
        for run in runs:
            if not store.release_lease(Claim(run, owner, run.attempt, 60), count_claim=False):
                raise RuntimeError("could not hand a claimed run back")
        return dt

    for _ in range(50):  # warm-up: connection, caches, the statement's first plans
        once(1)
        once_before(1)
    print("READY", flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "block":
            n, limit = int(cmd[1]), int(cmd[2])
            out: dict[str, Any] = {"lat": [once(limit) for _ in range(n)]}
        elif cmd[0] == "block-before":
            n, limit = int(cmd[1]), int(cmd[2])
            out = {"lat": [once_before(limit) for _ in range(n)]}
        elif cmd[0] == "explain":
            limit = int(cmd[1])
            params = {"owner": owner, "lease": 60.0, "limit": limit}
            out = {"claim": _explain(CLAIM_SQL, params)}
            # send_event's UPDATE, as the ORM writes it: captured in a rolled-back send.
            with transaction.atomic(), CaptureQueriesContext(connection) as ctx:
                store.send_event("order-17", {"bench": True})
                transaction.set_rollback(True)
            sql = next(
                q["sql"] for q in ctx.captured_queries if q["sql"].startswith('UPDATE "agent_run"')
            )
            out["send_event_sql"] = sql
            out["send_event"] = _explain(sql, None)
        else:
            raise SystemExit(f"unknown command {line!r}")
        print("RESULT " + json.dumps(out), flush=True)


def _explain(sql: str, params: dict[str, Any] | None) -> str:
    """EXPLAIN (ANALYZE, BUFFERS) of ``sql`` in a transaction that is rolled back."""
    from django.db import connection, transaction

    with transaction.atomic(), connection.cursor() as cur:
        cur.execute("EXPLAIN (ANALYZE, BUFFERS) " + sql, params)
        plan = "\n".join(r[0] for r in cur.fetchall())
        transaction.set_rollback(True)
    return plan


class Child:
    """A running ``claim_child`` on the database ``url``."""

    def __init__(self, url: str) -> None:
        self.proc = subprocess.Popen(
            [common.PY, "-m", "bench.waits", "claim-child"],
            cwd=common.ROOT,
            env=common.bench_env(url),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.expect("READY")

    def expect(self, prefix: str) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line[len(prefix) :].strip()
        raise RuntimeError(f"claim child exited ({self.proc.wait()}) before {prefix!r}")

    def ask(self, command: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return json.loads(self.expect("RESULT "))

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def vacuum(url: str) -> None:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("VACUUM agent_run")


def clone_db(name: str, template: str) -> str:
    """Database ``name`` as a copy of the migrated, unused ``template`` (no second migrate)."""
    import psycopg

    assert name.startswith("da_bench"), name
    assert template.startswith("da_bench"), template
    with psycopg.connect(common.ADMIN_DSN, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
    return common.db_url(name)


def claim_bench(
    pending: int, waiting: int, claims: int, blocks: int, limit: int, fingerprint: str
) -> dict[str, Any]:
    # Copies of the wake benchmark's database, migrated and not used yet.
    urls = {"none": clone_db(NONE_DB, WAKE_DB), "waiting": clone_db(WAITING_DB, WAKE_DB)}
    load_s = {
        "none": load(urls["none"], pending, 0, fingerprint),
        "waiting": load(urls["waiting"], pending, waiting, fingerprint),
    }
    log(
        f"  loaded {pending:,} pending runs in {load_s['none']:.1f} s; {pending:,} pending + "
        f"{waiting:,} waiting in {load_s['waiting']:.1f} s"
    )
    phases = {"load_s": sum(load_s.values())}
    t = time.perf_counter()
    children = {side: Child(url) for side, url in urls.items()}
    phases["children_start_s"] = time.perf_counter() - t
    phases["vacuum_s"] = phases["claims_s"] = 0.0
    lat: dict[str, list[float]] = {"none": [], "waiting": [], "before": []}
    try:
        per_block = max(1, claims // blocks)
        for b in range(blocks):
            order = ["none", "waiting"] if b % 2 == 0 else ["waiting", "none"]
            t = time.perf_counter()
            for side in order:
                vacuum(urls[side])
            phases["vacuum_s"] += time.perf_counter() - t
            t = time.perf_counter()
            for side in order:
                lat[side] += children[side].ask(f"block {per_block} {limit}")["lat"]
            # The hot path before and after: the statement of before durable waits, on the
            # same database as "none" (nothing waiting), right after it.
            lat["before"] += children["none"].ask(f"block-before {per_block} {limit}")["lat"]
            phases["claims_s"] += time.perf_counter() - t
        t = time.perf_counter()
        explain = children["waiting"].ask(f"explain {limit}")
        explain_none = children["none"].ask(f"explain {limit}")
        phases["explain_s"] = time.perf_counter() - t
    finally:
        for child in children.values():
            child.close()
    res: dict[str, Any] = {
        "pending": pending,
        "waiting": waiting,
        "limit": limit,
        "blocks": blocks,
        "load_s": load_s,
        "phases": phases,
        "none": common.summary_ms(lat["none"]),
        "with_waiting": common.summary_ms(lat["waiting"]),
        "explain_waiting": explain["claim"],
        "explain_none": explain_none["claim"],
        "send_event_sql": explain["send_event_sql"],
        "send_event_explain_waiting": explain["send_event"],
        "counts_waiting": counts(urls["waiting"]),
        "counts_none": counts(urls["none"]),
    }
    res["before_waits"] = common.summary_ms(lat["before"])
    res["hot_path_p50_ratio"] = res["none"]["p50_ms"] / res["before_waits"]["p50_ms"]
    res["hot_path_p99_ratio"] = res["none"]["p99_ms"] / res["before_waits"]["p99_ms"]
    res["p99_ratio"] = res["with_waiting"]["p99_ms"] / res["none"]["p99_ms"]
    res["p50_ratio"] = res["with_waiting"]["p50_ms"] / res["none"]["p50_ms"]
    res["target"] = f"claim p99 with {waiting:,} waiting / with none <= 1.2"
    res["met"] = res["p99_ratio"] <= 1.2
    plan = res["explain_waiting"]
    res["indexes_used"] = {name: name in plan for name in ("agent_run_wake", "agent_run_claim")} | {
        "agent_run_wait_event": "agent_run_wait_event" in res["send_event_explain_waiting"]
    }
    # The UPDATE's join to agent_run: by primary key (a Nested Loop), or a Seq Scan of the
    # table when the planner expects many rows from the CTEs (their LIMIT is not a constant).
    res["seq_scan"] = {
        side: "Seq Scan on agent_run" in res[key]
        for side, key in (("none", "explain_none"), ("waiting", "explain_waiting"))
    }
    n, w = res["none"], res["with_waiting"]
    log(
        f"[waits] claim_runs(limit={limit}) p50/p99: {n['p50_ms']:.3f}/{n['p99_ms']:.3f} ms "
        f"with none waiting, {w['p50_ms']:.3f}/{w['p99_ms']:.3f} ms with {waiting:,} waiting "
        f"({w['n']} claims each): p99 ratio {res['p99_ratio']:.2f} -> "
        f"{common.verdict(res['met'])} (<= 1.2)"
    )
    bw = res["before_waits"]
    log(
        f"[waits] the claim statement before durable waits (25467b5), same database, none "
        f"waiting: p50/p99 {bw['p50_ms']:.3f}/{bw['p99_ms']:.3f} ms; now / before: p50 "
        f"{res['hot_path_p50_ratio']:.2f}, p99 {res['hot_path_p99_ratio']:.2f}"
    )
    log(f"[waits] EXPLAIN (ANALYZE, BUFFERS) of the claim with {waiting:,} waiting:\n{plan}")
    log(f"[waits] partial indexes in the plans: {res['indexes_used']}")
    if not all(res["indexes_used"].values()):
        log("  !! a partial index is missing from the plans above")
    for side, seq in res["seq_scan"].items():
        if seq:
            log(f"  !! the claim's plan with {side} waiting reads agent_run with a Seq Scan")
    common.drop_db(NONE_DB)
    common.drop_db(WAITING_DB)
    return res


# --- 2. send_event waking 1,000 runs ----------------------------------------------------------


def api_main(argv: list[str]) -> None:
    """``python -m bench.waits api``: the zero-latency fake, recording every request's arrival
    (``GET /_arrivals``: [[first line of the task, time.time(), turn], ...]; ``GET /_cpu``: its
    own CPU time so far, in seconds)."""
    from bench.gate import Gate
    from bench.slowapi import SlowAPI, first_line, raise_nofile

    class RecordingAPI(SlowAPI):
        def __init__(self) -> None:
            super().__init__(Gate())
            self.arrivals: list[tuple[str | None, float, int]] = []

        async def answer(
            self, method: str, path: str, headers: dict[str, str], body: bytes, arrived: float
        ) -> tuple[int, dict[str, str], bytes]:
            if method == "GET" and path == "/_arrivals":
                data = json.dumps(self.arrivals).encode()
                return 200, {"content-type": "application/json"}, data
            if method == "GET" and path == "/_cpu":
                data = json.dumps(time.process_time()).encode()
                return 200, {"content-type": "application/json"}, data
            if method == "POST":
                # The turn the request asks for: the assistant turns it carries.
                turn = body.count(b'"role":"assistant"') + body.count(b'"role": "assistant"')
                self.arrivals.append((first_line(body), arrived, turn))
            return await super().answer(method, path, headers, body, arrived)

    async def serve() -> None:
        api = RecordingAPI()
        server = await asyncio.start_server(api.handle, "127.0.0.1", 0, backlog=4096)
        print(f"PORT {server.sockets[0].getsockname()[1]}", flush=True)
        sys.stdout.close()
        async with server:
            await server.serve_forever()

    raise_nofile()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve())


def recording_api() -> contextlib.AbstractContextManager[str]:
    """``python -m bench.waits api`` in its own process; yields its base URL."""
    return common.serving(["bench.waits", "api"], "the recording fake API")


def worker_main(argv: list[str]) -> None:
    """``python -m bench.waits worker --concurrency N ...``: ``runagents`` in a process where
    the ``bench_wait`` agent (this module) is registered."""
    import django

    django.setup()
    from django.core.management import call_command

    p = argparse.ArgumentParser()
    p.add_argument("--concurrency", type=int, required=True)
    p.add_argument("--poll-interval", type=float, required=True)
    a = p.parse_args(argv)
    profile_to = os.environ.get("BENCH_YAPPI")  # a file: the worker's CPU profile, all threads
    if profile_to:
        import signal

        import yappi

        def save(*_: Any) -> None:  # SIGUSR2, sent by wake_bench before it stops the worker
            yappi.stop()
            yappi.get_func_stats().save(profile_to, type="pstat")

        signal.signal(signal.SIGUSR2, save)
        yappi.set_clock_type("cpu")
        yappi.start()
    call_command(
        "runagents", concurrency=a.concurrency, poll_interval=a.poll_interval, lease_seconds=60
    )


def _wait_listening(url: str, worker: subprocess.Popen[bytes], limit: float = 60.0) -> float:
    import psycopg

    t0 = time.perf_counter()
    with psycopg.connect(url, autocommit=True) as conn:
        while time.perf_counter() - t0 < limit:
            if worker.poll() is not None:
                raise RuntimeError(f"the worker exited while starting; see {LOGFILE}")
            listening = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                " AND query ILIKE 'LISTEN%'"
            ).fetchone()[0]
            if listening:
                return time.perf_counter() - t0
            time.sleep(0.05)
    raise RuntimeError(f"the worker did not LISTEN within {limit:.0f} s; see {LOGFILE}")


def _until(url: str, sql: str, params: tuple[Any, ...], want: int, limit: float) -> int:
    """Poll ``sql`` (a count) until it reaches ``want`` or ``limit`` seconds pass."""
    import psycopg

    deadline = time.perf_counter() + limit
    with psycopg.connect(url, autocommit=True) as conn:
        while True:
            got = conn.execute(sql, params).fetchone()[0]
            if got >= want or time.perf_counter() > deadline:
                return got
            time.sleep(0.1)


def cpu_split(pid: int) -> tuple[float, float]:
    """User and system CPU time of process ``pid`` so far (its threads included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def postgres_cpu_seconds() -> float:
    """User + system CPU time so far of every process of this machine named ``postgres`` (the
    server's backends and helpers). A backend that exits meanwhile takes its time with it: the
    worker's pooled connections stay, the benchmark's polling connection (a count every 0.1 s)
    is left out."""
    total = 0.0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "comm").read_text().strip() == "postgres":
                total += cpu_seconds(int(entry.name))
        except OSError:
            continue  # it exited meanwhile
    return total


def statement_times(url: str, reset: bool) -> list[dict[str, Any]] | None:
    """The server's time by statement since the last reset (``reset``: reset it now, answer
    nothing), when the server preloads ``pg_stat_statements`` (``BENCH_PGSS=1`` asks for it);
    None otherwise. The ten costliest statements, each its calls, total and mean ms."""
    if not os.environ.get("BENCH_PGSS"):
        return None
    import psycopg

    try:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            if reset:
                conn.execute("SELECT pg_stat_statements_reset()")
                return None
            rows = conn.execute(
                "SELECT calls, total_exec_time, query FROM pg_stat_statements"
                " WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())"
                " ORDER BY total_exec_time DESC LIMIT 10"
            ).fetchall()
    except psycopg.Error as exc:
        log(f"  (pg_stat_statements: {type(exc).__name__}: {exc})")
        return None
    return [
        {
            "calls": calls,
            "total_ms": round(total, 1),
            "mean_ms": round(total / max(calls, 1), 3),
            "query": " ".join(query.split())[:160],
        }
        for calls, total, query in rows
    ]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far (its threads included)."""
    return sum(cpu_split(pid))


def py_spy(worker_pid: int, label: str) -> subprocess.Popen[bytes] | None:
    """A sampling profile of process ``worker_pid`` from now until the caller interrupts it
    (here the worker during the wake alone, not the parking; bench/resume.py its own timed
    part), when asked:
    ``BENCH_PYSPY=DIR`` writes py-spy's collapsed stacks to ``DIR/<label>.txt`` (with
    ``BENCH_PYSPY_GIL=1``, only the thread holding the interpreter lock); ``BENCH_PERF=DIR``
    writes ``perf record -g`` to ``DIR/<label>.data`` (where the CPU goes outside Python: the
    kernel, libpq). py-spy or perf must be installed."""
    to = os.environ.get("BENCH_PYSPY") or os.environ.get("BENCH_PERF")
    if not to or label == "Warm-up":
        return None
    Path(to).mkdir(parents=True, exist_ok=True)
    pid = str(worker_pid)
    if os.environ.get("BENCH_PERF"):
        command = ["perf", "record", "-F", "999", "-g", "-p", pid, "-o", f"{to}/{label}.data"]
    else:
        command = ["py-spy", "record", "--pid", pid, "--rate", "250", "--format", "raw"]
        command += ["--output", f"{to}/{label}.txt", "--nonblocking"]
        if os.environ.get("BENCH_PYSPY_GIL"):
            command.append("--gil")
    spy = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # the profiler attaches
    return spy


def _round(
    url: str,
    url_of_api: str,
    label: str,
    event: str,
    n: int,
    limit: float,
    worker_pid: int,
    timer_in: float | None = None,
) -> dict[str, Any]:
    """Park ``n`` runs on ``event``, send it, and time each run's first request after it.
    With ``timer_in`` (seconds), the runs park on one timer due that long after the first is
    started instead, and the times are counted from the timer's due time."""
    from django.db import connection, transaction
    from django.test.utils import CaptureQueriesContext

    import durable_agents

    t_start = time.perf_counter()
    due = None if timer_in is None else time.time() + timer_in
    at = None if due is None else datetime.datetime.fromtimestamp(due, datetime.UTC).isoformat()
    with transaction.atomic():  # one commit: the worker hears of all of them at once
        for i in range(n):
            durable_agents.start_run("bench_wait", wait_task(label, i, event, at))
    parked = _until(
        url,
        "SELECT count(*) FROM agent_run WHERE status = 'waiting' AND task LIKE %s",
        (f"{label} run %",),
        n,
        limit,
    )
    if parked < n:
        raise RuntimeError(f"{label}: only {parked}/{n} runs parked in {limit:.0f} s")
    park_s = time.perf_counter() - t_start
    if due is not None and time.time() > due - 1.5:
        raise RuntimeError(
            f"{label}: parking took {park_s:.1f} s, past the timer: raise --timer-in"
        )
    time.sleep(1.0)  # let the worker go idle
    spy = py_spy(worker_pid, label)
    if due is not None:
        time.sleep(max(0.0, due - 0.5 - time.time()))
    user_before, sys_before = cpu_split(worker_pid)
    api_before, pg_before = common.get_json(url_of_api, "/_cpu"), postgres_cpu_seconds()
    statement_times(url, reset=True)
    with CaptureQueriesContext(connection) as ctx:
        if due is None:
            t_call = time.time()
            durable_agents.send_event(event, {"bench": label})
            t_commit = time.time()
        else:
            t_call = t_commit = due
    updates = [q["sql"] for q in ctx.captured_queries if q["sql"].startswith('UPDATE "agent_run"')]
    done = _until(
        url,
        "SELECT count(*) FROM agent_run WHERE status = 'succeeded' AND task LIKE %s",
        (f"{label} run %",),
        n,
        limit,
    )
    done_s = time.time() - t_commit
    user_after, sys_after = cpu_split(worker_pid)
    api_after, pg_after = common.get_json(url_of_api, "/_cpu"), postgres_cpu_seconds()
    statements = statement_times(url, reset=False)
    if spy is not None:
        spy.send_signal(signal.SIGINT)  # the profiler writes its file when interrupted
        spy.wait(60)
    return {
        "worker_cpu_s": user_after + sys_after - user_before - sys_before,
        "api_cpu_s": api_after - api_before,
        "postgres_cpu_s": pg_after - pg_before,
        "statements": statements,
        "worker_user_s": user_after - user_before,
        "worker_sys_s": sys_after - sys_before,
        "park_s": park_s,
        "done_s": done_s,
        "event": event,
        "runs": n,
        "parked": parked,
        "succeeded": done,
        "t_call": t_call,
        "t_commit": t_commit,
        "queries": len(ctx.captured_queries),
        "agent_run_updates": len(updates),
        "update_sql": updates[0] if updates else None,
    }


def wake_bench(
    n: int,
    concurrency: int,
    poll: float,
    warmup: int,
    limit: float,
    timer_in: float | None = None,
) -> dict[str, Any]:
    import psycopg

    from durable_agents.conf import app_settings

    url = common.db_url(WAKE_DB)
    LOGFILE.parent.mkdir(parents=True, exist_ok=True)
    with recording_api() as base_url, LOGFILE.open("wb") as logf:
        worker = subprocess.Popen(
            [
                common.PY,
                "-m",
                "bench.waits",
                "worker",
                "--concurrency",
                str(concurrency),
                "--poll-interval",
                str(poll),
            ],
            cwd=common.ROOT,
            env=common.bench_env(url, base_url),
            stdout=logf,
            stderr=subprocess.STDOUT,
        )
        try:
            ready_s = _wait_listening(url, worker)
            log(f"  worker (concurrency {concurrency}) LISTENing after {ready_s:.1f} s")
            warm = None
            if warmup:
                warm = _round(url, base_url, "Warm-up", "bench-warmup", warmup, limit, worker.pid)
            measured = _round(url, base_url, "Wait", "bench-wake", n, limit, worker.pid, timer_in)
            arrivals = common.get_json(base_url, "/_arrivals")
        finally:
            if os.environ.get("BENCH_YAPPI"):
                worker.send_signal(signal.SIGUSR2)
                time.sleep(20)  # the profile of 2,000 threads takes a while to save
            code = common.stop(worker, 60)
    with psycopg.connect(url, autocommit=True) as conn:
        statuses = dict(
            conn.execute("SELECT status, count(*) FROM agent_run GROUP BY status").fetchall()
        )
        woken_by = '{"event": "bench-wake"%' if timer_in is None else '{"timer"%'
        woken = conn.execute(
            "SELECT count(*) FROM agent_run WHERE woken_by LIKE %s AND task LIKE 'Wait run %%'",
            (woken_by,),
        ).fetchone()[0]
    # Each run's first request for turn 1 (the one after the wake), by the task's first line.
    first: dict[str, float] = {}
    for key, arrived, turn in arrivals:
        if key and key.startswith("Wait run ") and turn >= 1:
            first[key] = min(arrived, first.get(key, arrived))
    t_commit, t_call = measured["t_commit"], measured["t_call"]
    lat = [(t - t_commit) * 1000 for t in first.values()]
    lat_call = [(t - t_call) * 1000 for t in first.values()]
    from bench.inflight import scan_log

    res: dict[str, Any] = {
        "runs": n,
        "concurrency": concurrency,
        "poll_interval_s": poll,
        "pool_size": app_settings.DB_POOL_SIZE,
        "listen": bool(app_settings.LISTEN),
        "warmup_runs": warmup,
        "worker_ready_s": ready_s,
        "park_s": measured["park_s"],
        "done_s": measured["done_s"],
        "worker_cpu_s": measured["worker_cpu_s"],
        "api_cpu_s": measured["api_cpu_s"],
        "postgres_cpu_s": measured["postgres_cpu_s"],
        "statements": measured["statements"],
        "worker_user_s": measured["worker_user_s"],
        "worker_sys_s": measured["worker_sys_s"],
        "send_event_ms": (t_commit - t_call) * 1000,
        "send_event_queries": measured["queries"],
        "agent_run_updates": measured["agent_run_updates"],
        "update_sql": measured["update_sql"],
        "woken": woken,
        "seen": len(lat),
        "latencies_ms": sorted(lat),
        "p50_ms": common.pct(lat, 50),
        "p90_ms": common.pct(lat, 90),
        "p99_ms": common.pct(lat, 99),
        "max_ms": max(lat) if lat else float("nan"),
        "min_ms": min(lat) if lat else float("nan"),
        "from_call_p50_ms": common.pct(lat_call, 50),
        "from_call_p99_ms": common.pct(lat_call, 99),
        "statuses": statuses,
        "warmup": warm and {k: v for k, v in warm.items() if k not in ("t_call", "t_commit")},
        "worker_exit_code": code,
        "log": str(LOGFILE.relative_to(common.ROOT)),
        "log_scan": scan_log(LOGFILE),
    }
    problems = []
    if timer_in is None and res["agent_run_updates"] != 1:
        problems.append(f"send_event ran {res['agent_run_updates']} UPDATE agent_run statements")
    if woken != n or len(lat) != n or measured["succeeded"] != n:
        problems.append(
            f"{woken}/{n} woken by the event, {len(lat)} seen by the fake after the wake, "
            f"{measured['succeeded']} succeeded"
        )
    if code:
        problems.append(f"worker exit code {code} after SIGTERM")
    if problems:
        res["error"] = "; ".join(problems)
    res["met"] = timer_in is not None or res["agent_run_updates"] == 1
    res["woken_by"] = "event" if timer_in is None else "timer"
    how = (
        f"send_event woke {woken} runs with {res['agent_run_updates']} UPDATE agent_run "
        f"statement(s) ({res['send_event_queries']} queries, {res['send_event_ms']:.1f} ms); "
        "event commit"
        if timer_in is None
        else f"one timer woke {woken} runs; the timer's due time"
    )
    log(
        f"[waits] {how} -> each run's first model request: p50 {res['p50_ms']:.0f} ms, p99 "
        f"{res['p99_ms']:.0f} ms, max {res['max_ms']:.0f} ms, min {res['min_ms']:.0f} ms "
        f"(worker --concurrency {concurrency}, DB_POOL_SIZE {res['pool_size']}, LISTEN, poll "
        f"{poll:g} s); all {n} finished {res['done_s']:.1f} s after "
        f"{'the commit' if timer_in is None else 'it'}, the worker "
        f"using {res['worker_cpu_s']:.1f} s of CPU meanwhile ({res['worker_user_s']:.1f} s user, "
        f"{res['worker_sys_s']:.1f} s system), the fake API {res['api_cpu_s']:.1f} s, the "
        f"PostgreSQL server {res['postgres_cpu_s']:.1f} s; parking them took "
        f"{res['park_s']:.1f} s"
    )
    for row in res["statements"] or []:
        log(
            f"  server {row['total_ms']:8.1f} ms in {row['calls']:5d} calls "
            f"({row['mean_ms']:.3f} ms each): {row['query'][:110]}"
        )
    if res.get("error"):
        log(f"  !! wake: {res['error']}")
    if res["log_scan"]["counts"]:
        log(f"  !! worker log: {res['log_scan']['counts']}: {res['log_scan']['first'][:3]}")
    return res


# --- main ---------------------------------------------------------------------------------------


def postgres_unavailable() -> str | None:
    """Why this benchmark cannot run here (it needs PostgreSQL), or None."""
    if not common.PG_BASE.startswith(("postgres://", "postgresql://")):
        return f"BENCH_PG={common.PG_BASE!r} is not PostgreSQL"
    try:
        import psycopg

        with psycopg.connect(common.ADMIN_DSN, autocommit=True, connect_timeout=5) as conn:
            conn.execute("SELECT 1")
    except Exception as exc:  # noqa: BLE001 - any failure means: no PostgreSQL to measure
        return f"no PostgreSQL at {common.PG_BASE}: {type(exc).__name__}: {exc}"
    return None


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--waiting", type=int, default=100_000)
    p.add_argument("--pending", type=int, default=10_000)
    p.add_argument("--claims", type=int, default=1000, help="claims per side")
    p.add_argument("--blocks", type=int, default=5)
    p.add_argument("--limit", type=int, default=1, help="runs per claim statement")
    p.add_argument("--wake-runs", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=1000)
    p.add_argument("--poll-interval", type=float, default=30.0)
    p.add_argument(
        "--timer-in",
        type=float,
        default=None,
        help="wake the runs by one timer due this many seconds after they start parking "
        "(more than parking takes), not by send_event",
    )
    p.add_argument("--warmup", type=int, default=50, help="uncounted runs woken first")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per wait for runs")
    p.add_argument("--skip", default="", help="comma list of: claim, wake")
    p.add_argument("--keep", action="store_true", help="keep the wake database")
    a = p.parse_args(argv)
    skip = {s for s in a.skip.split(",") if s}
    why = postgres_unavailable()
    if why:
        log(f"[waits] skipped: {why}")
        res: dict[str, Any] = {"skipped": why}
        common.write_result("waits", res)
        return res
    t0 = time.perf_counter()
    url = common.fresh_db(WAKE_DB)  # migrated once; the claim's databases are copies of it
    common.setup_django(url)  # no connection yet: it stays a valid template until the wake
    res = {}
    if "claim" not in skip:
        t = time.perf_counter()
        res["claim"] = claim_bench(
            a.pending, a.waiting, a.claims, a.blocks, a.limit, bench_wait.fingerprint()
        )
        res["claim"]["seconds"] = time.perf_counter() - t
        common.write_result("waits", res)
    if "wake" not in skip:
        t = time.perf_counter()
        res["wake"] = wake_bench(
            a.wake_runs, a.concurrency, a.poll_interval, a.warmup, a.timeout, a.timer_in
        )
        res["wake"]["seconds"] = time.perf_counter() - t
    res["seconds"] = time.perf_counter() - t0
    path = common.write_result("waits", res)
    from django.db import connection

    connection.close()
    if not a.keep:
        common.drop_db(WAKE_DB)
    log(f"[waits] wrote {path.relative_to(common.ROOT)} in {res['seconds']:.0f} s")
    if res.get("wake", {}).get("error"):
        raise SystemExit(f"[waits] FAILED: {res['wake']['error']}")
    return res


if __name__ == "__main__":
    if sys.argv[1:2] == ["claim-child"]:
        claim_child()
    elif sys.argv[1:2] == ["api"]:
        api_main(sys.argv[2:])
    elif sys.argv[1:2] == ["worker"]:
        worker_main(sys.argv[2:])
    else:
        main()
