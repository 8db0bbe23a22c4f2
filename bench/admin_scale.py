"""The admin at production size: every page an operator opens, timed on a table of
10,000 runs and on one of 1,000,000 (``--sizes``), side by side in one invocation.

The workload is a production table that grew at a constant rate (10,000 runs a day, retention
off): the 10,000-run database holds a day of runs, the 1,000,000-run one a hundred days, so
that the windows an operator looks at ("finished in the last 24 hours") hold the same rows in
both and only the history behind them differs. In both:

- 1 % of runs dead, spread over the whole history, with seven causes whose reasons each carry
  the failing call's provider request id (and a number that varies: tokens, an invoice, a
  count), 1 % waiting (timers and events), 0.5 % failed, 0.5 % cancelled (every status fills
  a page of the list at 10,000 runs too), the newest 20 runs pending and the 10 before them
  running, the rest succeeded;
- five agents, three models; tasks of 70 to 110 characters ("Task number 4242: ...");
- three steps per run (the task, a model turn with its request id, a tool result);
- one intent per 100 runs (the newest 50 pending approval);
- one metrics snapshot (``housekeeping.snapshot_metrics``, as the schedule takes them).

The databases (``da_bench_admin_<size>``) are bulk-loaded with INSERT ... SELECT
generate_series, VACUUM ANALYZEd, and kept between invocations: a table ``bench_admin_fill``
records the fill's version, and a database whose version differs is filled again (``--refill``
forces it). Each invocation migrates them first, so a new migration meets a full table.

One long-lived child process per database (bench settings, DEBUG off, a logged-in superuser
through Django's test client) serves requests the parent asks for. Per page: two warm-up
requests each, then ``--reps`` rounds that alternate the databases (the order swapped every
round) and time one request each in the child (server time: the test client's whole request,
middleware, queries and rendering, no network). The queries of one more request are counted
with CaptureQueriesContext, and the HTML's size is kept. Targets per page: 1M median / 10k
median <= 1.5, at most 15 queries and 500 kB at the largest size.

    python -m bench.admin_scale                        # 10k and 1M (fills once: ~3 min)
    python -m bench.admin_scale --sizes 10000,10000000 --reps 5   # the 10M measurement
    python -m bench.admin_scale --explain              # also EXPLAIN (ANALYZE) the list queries
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

from bench import common
from bench.common import log

FILL_VERSION = 4
RUNS_PER_DAY = 10_000
CHUNK = 500_000
MAX_RATIO = 1.5
MAX_QUERIES = 15
MAX_HTML_BYTES = 500_000

AGENTS = ("triage", "billing", "migrations", "support", "reports")
MODELS = ("claude-sonnet-4-5", "claude-opus-4-1", "claude-haiku-4-5")

# Seven causes of death; each reason carries its request id (``r``) and most a varying number
# (``n``), which the stored cause must fold into one group each.
DEAD_REASONS = (
    "Model API error: 529 overloaded_error: Overloaded (request_id: {r})",
    "Model API error: 500 api_error: Internal server error (request_id: {r})",
    "Model not found: the pinned model is retired (404 not_found_error, request_id: {r})",
    "Budget exceeded: {n} tokens used of a budget of 200000 (last request {r})",
    "Tool lookup_invoice raised ValueError: invoice {n} not found (request_id: {r})",
    "Stalled: claimed {n} times without committing a step (last request {r})",
    "Invalid request: 400 invalid_request_error: tool_use ids must be unique (request_id: {r})",
)
TASKS = (
    "reconcile the invoice batch of customer acme and report the differences",
    "triage the support ticket about a failed payment and draft an answer",
    "plan the schema migration of the orders table and list its risks",
    "summarise yesterday's incidents for the on-call handover",
    "check the refunds queue for duplicates and flag them",
)


def _sql_array(values: tuple[str, ...]) -> str:
    return "ARRAY[" + ", ".join("'" + v.replace("'", "''") + "'" for v in values) + "]"


def _dead_reason_sql() -> str:
    """A CASE over g: the reason of dead run g, its request id and number filled in."""
    request_id = "'req_011C' || substr(md5('rq' || g), 1, 22)"
    number = "(100 + g %% 997)::text"
    cases = []
    for i, reason in enumerate(DEAD_REASONS):
        parts = (
            reason.replace("'", "''")
            .replace("{r}", "' || {r} || '")
            .replace("{n}", "' || {n} || '")
        )
        cases.append(f"WHEN {i} THEN '{parts}'".replace("{r}", request_id).replace("{n}", number))
    return f"CASE (g / 1000) %% {len(DEAD_REASONS)} " + " ".join(cases) + " END"


def run_id_sql(expr: str = "g") -> str:
    return f"md5('run' || {expr})::uuid"


def part_sql(url: str) -> str:
    """A step's partition, from its run's id as the CHECK on agent_step computes it (an md5
    id is no time-ordered id, but 1 in 64 looks like one and has a day of its own)."""
    import django
    from django.conf import settings

    if not settings.configured:  # the SQL text only: any bench database will do
        os.environ.update(common.bench_env(url))
        django.setup()
    from durable_agents.models.step_partitions import part_of_run

    return part_of_run(run_id_sql())


def fill(url: str, size: int) -> float:
    """Bulk-load ``size`` runs (and their steps and intents) into the migrated database."""
    import psycopg

    started = time.perf_counter()
    part = part_sql(url)
    seconds_apart = 86_400 / RUNS_PER_DAY
    agents, models, tasks = _sql_array(AGENTS), _sql_array(MODELS), _sql_array(TASKS)
    # g = 1 is the oldest run, g = size the newest (created now).
    status = (
        f"CASE WHEN g > {size} - 20 THEN 'pending' WHEN g > {size} - 30 THEN 'running'"
        " WHEN g %% 1000 < 10 THEN 'dead' WHEN g %% 1000 < 20 THEN 'waiting'"
        " WHEN g %% 1000 < 25 THEN 'failed' WHEN g %% 1000 < 30 THEN 'cancelled'"
        " ELSE 'succeeded' END"
    )
    created = f"(now() - ({size} - g) * interval '{seconds_apart} seconds')"
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SET synchronous_commit = off")
        conn.execute("SET maintenance_work_mem = '512MB'")
        for low in range(1, size + 1, CHUNK):
            high = min(size, low + CHUNK - 1)
            conn.execute(
                "INSERT INTO agent_run (id, agent, prompt_version, fingerprint, model, task,"
                " status, lease_owner, lease_until, attempt, stalled_claims, last_seq,"
                " tokens_used, result, error, created_at, updated_at, started_at, finished_at,"
                " waiting_for, waiting_since, wake_at, wait_event, depth) "
                f"SELECT {run_id_sql()}, ({agents})[1 + g %% 5], 'v' || (1 + g %% 3),"
                f" 'fp', ({models})[1 + (g / 7) %% 3],"
                f" 'Task number ' || g || ': ' || ({tasks})[1 + (g / 3) %% 5] || '.', s,"
                " CASE WHEN s = 'running' THEN 'bench-worker' END,"
                " CASE WHEN s = 'running' THEN now() + interval '1 minute' END,"
                " CASE WHEN s = 'pending' THEN 0 ELSE 1 + (g %% 17 = 0)::int END, 0,"
                " CASE WHEN s = 'pending' THEN 0 ELSE 2 END, 1200 + g %% 5000,"
                " CASE WHEN s = 'succeeded' THEN 'done: ' || g END,"
                f" CASE WHEN s = 'dead' THEN {_dead_reason_sql()}"
                "      WHEN s = 'failed' THEN 'Tool charge_card failed: card declined'"
                "      WHEN s = 'cancelled' THEN 'cancelled by an operator' ELSE '' END,"
                " c, c + interval '30 seconds', CASE WHEN s <> 'pending' THEN c END,"
                " CASE WHEN s IN ('succeeded', 'failed', 'cancelled') THEN c + interval '30s' END,"
                " CASE WHEN s = 'waiting' THEN"
                "   CASE WHEN g %% 2 = 0 THEN 'timer' ELSE 'event' END ELSE '' END,"
                " CASE WHEN s = 'waiting' THEN c + interval '1 minute' END,"
                " CASE WHEN s = 'waiting' AND g %% 2 = 0 THEN now() + interval '7 days' END,"
                " CASE WHEN s = 'waiting' AND g %% 2 = 1 THEN 'invoice-paid-' || g END, 0"
                f" FROM (SELECT g, {status} AS s, {created} AS c"
                "       FROM generate_series(%s::int, %s::int) g) runs",
                (low, high),
            )
            conn.execute(
                "INSERT INTO agent_step (run_id, seq, part, kind, payload, request_id, attempt,"
                " worker, created_at) "
                f"SELECT {run_id_sql()}, 0, {part}, 'task', to_json(r.task)::text, NULL, 0, '',"
                " r.created_at FROM generate_series(%s::int, %s::int) g"
                f" JOIN agent_run r ON r.id = {run_id_sql()}",
                (low, high),
            )
            conn.execute(
                "INSERT INTO agent_step (run_id, seq, part, kind, payload, request_id, attempt,"
                " worker, created_at) "
                f"SELECT {run_id_sql()}, t.seq, {part}, t.kind,"
                " CASE WHEN t.seq = 1 THEN"
                '  \'{"id":"msg_\' || substr(md5(\'m\' || g), 1, 20) || \'","type":"message",'
                '"role":"assistant","model":"claude-sonnet-4-5","content":[{"type":'
                '"tool_use","id":"toolu_\' || g || \'","name":"lookup","input":{"n":\''
                ' || g || \'}}],"stop_reason":"tool_use","usage":{"input_tokens":900,'
                '"output_tokens":40}}\''
                '  ELSE \'[{"type":"tool_result","tool_use_id":"toolu_\' || g ||'
                '  \'","content":"found \' || g || \'"}]\' END,'
                " CASE WHEN t.seq = 1 THEN 'req_011C' || substr(md5('st' || g), 1, 22) END, 1,"
                f" 'bench-worker', {created} + t.seq * interval '5 seconds'"
                " FROM generate_series(%s::int, %s::int) g"
                " CROSS JOIN (VALUES (1, 'model_turn'), (2, 'tool_result')) t(seq, kind)"
                f" WHERE g <= {size} - 20",
                (low, high),
            )
            conn.execute(
                "INSERT INTO tool_intent (run_id, seq, call_index, tool, input, key, status,"
                " reason, created_at, updated_at, decided_at) "
                f"SELECT {run_id_sql()}, 1, 0, 'refund_payment',"
                " '{\"payment\": \"pay_' || g || '\", \"amount_cents\": ' || (g %% 9000) || '}',"
                " 'key-' || g,"
                f" CASE WHEN g > {size} - 5000 THEN 'pending' ELSE 'done' END, '',"
                f" {created}, {created},"
                f" CASE WHEN g > {size} - 5000 THEN NULL ELSE {created} END"
                " FROM generate_series(%s::int, %s::int) g WHERE g %% 100 = 50",
                (low, high),
            )
            log(f"  {url.rsplit('/', 1)[1]}: {high:,} of {size:,} runs")
        conn.execute("VACUUM ANALYZE")
        conn.execute("CREATE TABLE IF NOT EXISTS bench_admin_fill (version int, runs bigint)")
        conn.execute("DELETE FROM bench_admin_fill")
        conn.execute("INSERT INTO bench_admin_fill VALUES (%s, %s)", (FILL_VERSION, size))
    return time.perf_counter() - started


def filled(url: str, size: int) -> bool:
    import psycopg

    try:
        with psycopg.connect(url, autocommit=True) as conn:
            row = conn.execute("SELECT version, runs FROM bench_admin_fill").fetchone()
    except psycopg.Error:
        return False
    return row == (FILL_VERSION, size)


DB_PREFIX = os.environ.get("DA_BENCH_ADMIN_PREFIX", "da_bench_admin")


def db_name(size: int) -> str:
    """The database of one size; DA_BENCH_ADMIN_PREFIX (--db-prefix) keeps another set, e.g.
    for measuring an older ref on databases that never saw this tree's migrations."""
    return f"{DB_PREFIX}_{size}"


def prepare(size: int, refill: bool) -> dict[str, Any]:
    name = db_name(size)
    url = common.db_url(name)
    if refill or not filled(url, size):
        log(f"filling {name} with {size:,} runs")
        url = common.fresh_db(name)
        seconds = fill(url, size)
        common.migrate(url)
        subprocess.run(
            [common.PY, "-m", "bench.admin_scale", "--after-fill"],
            cwd=common.ROOT,
            env=common.bench_env(url),
            check=True,
        )
        vacuum(url)
        return {"filled_seconds": round(seconds, 1), "kept": False}
    started = time.perf_counter()
    common.migrate(url)  # a new migration meets the full table here
    seconds = time.perf_counter() - started
    vacuum(url)
    return {"migrate_seconds": round(seconds, 1), "kept": True}


def vacuum(url: str) -> None:
    """VACUUM ANALYZE, as autovacuum would have by the time an operator looks: a migration's
    backfill or the after-fill updates leave pages that index-only scans must visit."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE")


def after_fill() -> None:
    """In the filled database: what a running deployment would have done meanwhile."""
    import django

    django.setup()
    from django.contrib.auth import get_user_model

    from durable_agents.housekeeping import sweeps as housekeeping

    user_model = get_user_model()
    if not user_model.objects.filter(username="bench-admin").exists():
        user_model.objects.create_superuser("bench-admin", "bench@example.com", "bench-admin")
    try:  # the stored cause of a dead run (absent when --before measures an older ref)
        from durable_agents.causes import backfill_causes
        from durable_agents.models import AgentRun
    except ImportError:
        pass
    else:  # the bulk load bypasses the store, which sets it when a run is dead-lettered
        backfill_causes(AgentRun)
    housekeeping.snapshot_metrics()


# --- the child: one per database, serving the parent's requests --------------------------------


@dataclass
class Page:
    name: str
    path: str  # may hold {run}, {short}, {request}, {dead_request}, {intent}, {agent}, {model}


def pages() -> list[Page]:
    runs = "/admin/durable_agents/agentrun/"
    listed = [
        Page("index", "/admin/"),
        Page("runs list", runs),
        *(
            Page(f"runs, status = {s}", f"{runs}?status__exact={s}")
            for s in ("pending", "running", "waiting", "succeeded", "failed", "cancelled", "dead")
        ),
        Page("runs, agent", f"{runs}?agent={{agent}}"),
        Page("runs, model", f"{runs}?model={{model}}"),
        Page(
            "runs, created today", f"{runs}?created_at__gte={{today}}&created_at__lt={{tomorrow}}"
        ),
        Page("search: full run id", f"{runs}?q={{run}}"),
        Page("search: short id", f"{runs}?q={{short}}"),
        Page("search: request id", f"{runs}?q={{request}}"),
        Page("search: request id of a dead reason", f"{runs}?q={{dead_request}}"),
        Page('search: "Task number 4242"', f"{runs}?q=Task+number+4242"),
        # A number followed by punctuation: "4242:" is the start of a whole word.
        Page('search: "Task number 4242:"', f"{runs}?q=Task+number+4242%3A"),
        Page("dead letter", f"{runs}dead-letter/"),
        Page("operations", f"{runs}operations/"),
        Page("intents list", "/admin/durable_agents/toolintent/"),
        Page("run page", f"{runs}{{run}}/change/"),
        Page("intent page", "/admin/durable_agents/toolintent/{intent}/change/"),
        # The pages the later capabilities added (the fill gives most of them few rows of
        # their own: what they read of agent_run is what grows).
        Page("capacity", f"{runs}capacity/"),
        *(
            Page(f"list: {name}", f"/admin/durable_agents/{model}/")
            for name, model in (
                ("questions", "agentquestion"),
                ("events", "agentevent"),
                ("concurrency keys", "concurrencykey"),
                ("schedules", "agentschedule"),
                ("workers", "agentworker"),
                ("agent versions", "agentversion"),
                ("webhook deliveries", "webhookdelivery"),
                ("batches", "agentbatch"),
            )
        ),
    ]
    return listed


def _fixtures() -> dict[str, str]:
    """The ids the pages ask for, picked alike in every database (by position, not by value)."""
    from django.db import connection

    from durable_agents.models import short_id

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT id, error FROM agent_run WHERE status = 'dead'"
            " ORDER BY created_at DESC OFFSET 37 LIMIT 1"
        )
        run_id, error = cursor.fetchone()
        cursor.execute(
            "SELECT request_id FROM agent_step WHERE run_id = %s AND request_id IS NOT NULL",
            [run_id],
        )
        (request_id,) = cursor.fetchone()
        cursor.execute("SELECT id FROM tool_intent ORDER BY created_at DESC OFFSET 7 LIMIT 1")
        (intent_id,) = cursor.fetchone()
    import re

    dead_request = re.search(r"req_[A-Za-z0-9]+", error)
    assert dead_request, error
    from django.utils import timezone

    today = timezone.now().date()
    return {
        "run": str(run_id),
        "short": short_id(run_id),
        "request": request_id,
        "dead_request": dead_request.group(),
        "intent": str(intent_id),
        "agent": AGENTS[1],
        "model": MODELS[0],
        # DateFieldListFilter's "Today" link: midnight to midnight (UTC), URL-encoded.
        "today": f"{today.isoformat()}+00%3A00%3A00%2B00%3A00",
        "tomorrow": f"{(today + datetime.timedelta(days=1)).isoformat()}+00%3A00%3A00%2B00%3A00",
    }


def child() -> None:
    import django

    django.setup()
    from django.contrib.auth import get_user_model
    from django.db import connection
    from django.test import Client
    from django.test.utils import CaptureQueriesContext, setup_test_environment

    setup_test_environment()  # 'testserver' in ALLOWED_HOSTS; DEBUG stays off
    client = Client()
    client.force_login(get_user_model().objects.get(username="bench-admin"))
    fixtures = _fixtures()
    for line in sys.stdin:
        request = json.loads(line)
        path = request["path"].format(**fixtures)
        if request["op"] == "time":
            times = []
            for _ in range(request.get("n", 1)):
                started = time.perf_counter()
                response = client.get(path)
                times.append(time.perf_counter() - started)
                assert response.status_code == 200, (path, response.status_code)
            print(json.dumps({"times": times}), flush=True)
        elif request["op"] == "inspect":
            with CaptureQueriesContext(connection) as queries:
                response = client.get(path)
            body = response.content
            print(
                json.dumps(
                    {
                        "status": response.status_code,
                        "queries": len(queries),
                        "sql": [q["sql"][:300] for q in queries.captured_queries],
                        "bytes": len(body),
                        "path": path,
                        "rows": body.count(b'class="action-select"'),
                    }
                ),
                flush=True,
            )
        elif request["op"] == "explain":
            print(json.dumps({"plans": _explain_list(client, path)}), flush=True)


def _explain_list(client: Any, path: str) -> list[str]:
    """EXPLAIN (ANALYZE, BUFFERS) of the slowest queries of one request."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    with CaptureQueriesContext(connection) as queries:
        client.get(path)
    slowest = sorted(queries.captured_queries, key=lambda q: -float(q["time"]))[:2]
    plans = []
    with connection.cursor() as cursor:
        for query in slowest:
            if not query["sql"].lstrip().upper().startswith(("SELECT", "WITH")):
                continue
            cursor.execute("EXPLAIN (ANALYZE, BUFFERS) " + query["sql"])
            plans.append(query["time"] + " s\n" + "\n".join(r[0] for r in cursor.fetchall()))
    return plans


class Child:
    def __init__(self, size: int) -> None:
        self.size = size
        self.proc = subprocess.Popen(
            [common.PY, "-m", "bench.admin_scale", "--child"],
            cwd=common.ROOT,
            env=common.bench_env(common.db_url(db_name(size))),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def ask(self, **request: Any) -> dict[str, Any]:
        assert self.proc.stdin
        assert self.proc.stdout
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the child of {self.size:,} runs died (see its stderr above)")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait(timeout=30)


def measure(sizes: list[int], reps: int, explain: bool, only: str = "") -> dict[str, Any]:
    children = [Child(size) for size in sizes]
    results: dict[str, Any] = {}
    try:
        for page in pages():
            if only and not any(text in page.name for text in only.split(",")):
                continue
            for c in children:
                c.ask(op="time", path=page.path, n=2)  # warm-up
            times: dict[int, list[float]] = {c.size: [] for c in children}
            for rep in range(reps):
                order = children if rep % 2 == 0 else children[::-1]
                for c in order:
                    times[c.size] += c.ask(op="time", path=page.path)["times"]
            inspected = {c.size: c.ask(op="inspect", path=page.path) for c in children}
            small, large = sizes[0], sizes[-1]
            medians = {s: statistics.median(t) for s, t in times.items()}
            ratio = medians[large] / medians[small]
            entry = {
                "path": inspected[large]["path"],
                "median_s": {str(s): round(m, 4) for s, m in medians.items()},
                "ratio": round(ratio, 2),
                "queries": {str(s): i["queries"] for s, i in inspected.items()},
                "html_bytes": {str(s): i["bytes"] for s, i in inspected.items()},
                "rows": {str(s): i["rows"] for s, i in inspected.items()},
                "sql_at_largest": inspected[large]["sql"],
            }
            entry["met"] = (
                ratio <= MAX_RATIO
                and inspected[large]["queries"] <= MAX_QUERIES
                and inspected[large]["bytes"] <= MAX_HTML_BYTES
            )
            if explain:
                entry["plans_at_largest"] = children[-1].ask(op="explain", path=page.path)["plans"]
            results[page.name] = entry
            log(
                f"{page.name:42} "
                + "  ".join(f"{s:>10,}: {medians[s] * 1000:7.1f} ms" for s in sizes)
                + f"  x{ratio:5.2f}  q={inspected[large]['queries']:2}"
                f"  {inspected[large]['bytes'] / 1000:6.1f} kB  {common.verdict(entry['met'])}"
            )
    finally:
        for c in children:
            c.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10000,1000000")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--refill", action="store_true")
    parser.add_argument("--explain", action="store_true")
    parser.add_argument("--out", default="admin_scale")
    parser.add_argument(
        "--pages", default="", help="only the pages whose name has one of these texts (commas)"
    )
    parser.add_argument("--db-prefix", default="", help="databases named <prefix>_<size>")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--after-fill", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.db_prefix:
        assert args.db_prefix.startswith("da_bench"), args.db_prefix
        os.environ["DA_BENCH_ADMIN_PREFIX"] = args.db_prefix  # the children's too
        global DB_PREFIX
        DB_PREFIX = args.db_prefix
    if args.child:
        return child()
    if args.after_fill:
        return after_fill()
    try:  # PostgreSQL is required: without it, say so and write why
        import psycopg

        psycopg.connect(common.ADMIN_DSN).close()
    except Exception as exc:  # noqa: BLE001
        log(f"admin_scale: no PostgreSQL at {common.PG_BASE} ({exc}); skipped")
        common.write_result(args.out, {"skipped": str(exc)})
        return None
    sizes = sorted(int(s) for s in args.sizes.split(","))
    prepared = {str(size): prepare(size, args.refill) for size in sizes}
    log(f"databases ready: {prepared}")
    pages_measured = measure(sizes, args.reps, args.explain, args.pages)
    data = {
        "sizes": sizes,
        "reps": args.reps,
        "prepared": prepared,
        "targets": {"ratio": MAX_RATIO, "queries": MAX_QUERIES, "html_bytes": MAX_HTML_BYTES},
        "pages": pages_measured,
        "all_met": all(p["met"] for p in pages_measured.values()),
        "sizes_of_tables": {str(s): _table_sizes(common.db_url(db_name(s))) for s in sizes},
    }
    path = common.write_result(args.out, data)
    met = sum(p["met"] for p in pages_measured.values())
    log(f"{met} of {len(pages_measured)} pages within target; wrote {path}")
    return None


def _table_sizes(url: str) -> dict[str, str]:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT relname, pg_size_pretty(pg_total_relation_size(oid)) FROM pg_class"
            " WHERE relname IN ('agent_run', 'agent_step', 'tool_intent')"
        ).fetchall()
    return dict(rows)


if __name__ == "__main__":
    main()
