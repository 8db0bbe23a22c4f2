"""Waiting for results: 1,000 ``aget_result`` waiters on one process, their runs ended in
batches, and how long after each run's end its waiter had it.

``--runs`` runs (default 1,000) are started through the public API; one event loop awaits
``aget_result`` for every one of them (timeout 120 s). Once all are registered, a thread
ends the runs ``--batch`` at a time (default 50, one UPDATE each, as a worker's commits end
runs: the end trigger notifies at commit) every ``--every`` seconds (default 0.02). For
each run: the latency from the commit of its end to the return of its ``aget_result``.
Printed: p50, p95, p99 and max of those latencies, and the queries the results service sent
while the runs ended (on PostgreSQL: none but its look after connecting; never one per
waiter). Target: p95 at most 100 ms.

    python -m bench.get_result                 # about 10 s
    python -m bench.get_result --runs 300

PostgreSQL only (``BENCH_PG``); it creates and drops the database ``da_bench_results``.
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
from typing import Any

from bench import common
from bench.common import log

DB = "da_bench_results"
TARGET_P95_MS = 100.0


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=50)
    parser.add_argument("--every", type=float, default=0.02)
    a = parser.parse_args(argv)
    if (why := common.postgres_unavailable()) is not None:
        raise SystemExit(why)
    url = common.fresh_db(DB)
    try:
        common.setup_django(url)
        result = measure(a)
    finally:
        from django.db import connections

        from durable_agents import results

        results.close_services()
        connections.close_all()
    return common.finish("get_result", result, DB)


def measure(a: argparse.Namespace) -> dict[str, Any]:
    from asgiref.sync import sync_to_async

    import durable_agents
    from durable_agents import results
    from durable_agents.models import AgentRun, RunStatus

    run_ids = common.start_runs(a.runs)
    service = results.service()
    ended_at: dict[Any, float] = {}
    returned_at: dict[Any, float] = {}

    def end_all() -> None:
        from django.db import connection

        try:
            for start in range(0, len(run_ids), a.batch):
                batch = run_ids[start : start + a.batch]
                AgentRun.objects.filter(pk__in=batch).update(status=RunStatus.SUCCEEDED)
                now = time.perf_counter()  # committed (autocommit): the end trigger fired
                for run_id in batch:
                    ended_at[run_id] = now
                time.sleep(a.every)
        finally:
            connection.close()

    async def wait_one(run_id: Any) -> None:
        run = await durable_agents.aget_result(run_id, timeout=120)
        returned_at[run_id] = time.perf_counter()
        assert run.status == RunStatus.SUCCEEDED

    async def everything() -> tuple[float, int]:
        waiting = [asyncio.ensure_future(wait_one(run_id)) for run_id in run_ids]
        while service.waiters() < len(run_ids):
            await asyncio.sleep(0.01)
        # Each waiter's first read (has it ended already?) goes through Django's one
        # executor thread for async code: this call queues behind all of them.
        await sync_to_async(lambda: None)()
        await asyncio.to_thread(service.ready.wait, 30)
        queries_before = service.queries
        started = time.perf_counter()
        ender = threading.Thread(target=end_all)
        ender.start()
        await asyncio.gather(*waiting)
        wall = time.perf_counter() - started
        await asyncio.to_thread(ender.join)
        return wall, service.queries - queries_before

    wall, queries = asyncio.run(everything())
    latencies = [returned_at[r] - ended_at[r] for r in run_ids]
    summary = common.summary_ms(latencies)
    p95 = common.pct([s * 1000 for s in latencies], 95)
    data = {
        "runs": a.runs,
        "batch": a.batch,
        "every_s": a.every,
        "wall_s": round(wall, 3),
        "latency_ms": summary,
        "p95_ms": p95,
        "service_queries_while_ending": queries,
        "target_p95_ms": TARGET_P95_MS,
        "verdict": common.verdict(p95 <= TARGET_P95_MS),
    }
    log(
        f"{a.runs} waiters, runs ended {a.batch} at a time every {a.every * 1000:.0f} ms: "
        f"latency p50 {summary['p50_ms']:.1f} ms, p95 {p95:.1f} ms, p99 "
        f"{summary['p99_ms']:.1f} ms, max {summary['max_ms']:.1f} ms; the service sent "
        f"{queries} queries meanwhile ({data['verdict']}: p95 <= {TARGET_P95_MS:.0f} ms)"
    )
    return data


if __name__ == "__main__":
    common.print_result(main())
