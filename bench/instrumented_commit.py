"""What routing the step commit through Django's cursor wrapper costs.

The step commit binds on the server (so psycopg can prepare it) and goes through Django's
``CursorWrapper`` (so ``execute_wrapper`` hooks, ``connection.queries`` and instrumentations
see it). This times the same fenced ``APPEND_STEP_SQL`` on one connection, alternating blocks:
through ``store.postgres.binding_cursor()`` (what ships) and on the bare psycopg cursor (what
shipped before), with and without an ``execute_wrapper`` installed (what Sentry or
OpenTelemetry's Django instrumentation add). Prints p50/p99 per step commit and the ratios.

    python -m bench.instrumented_commit [--steps 3000] [--blocks 6]
"""

from __future__ import annotations

import argparse
import time
import uuid
from typing import Any

from bench import common

DB = "da_bench_instrumented"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3000, help="commits per variant")
    p.add_argument("--blocks", type=int, default=6)
    a = p.parse_args(argv)
    url = common.fresh_db(DB)
    common.setup_django(url)
    import psycopg
    from django.db import connection

    from durable_agents.models import AgentRun
    from durable_agents.store import PostgresStore
    from durable_agents.store.postgres import APPEND_STEP_SQL, binding_cursor

    store = PostgresStore()
    run = store.create_run(
        AgentRun(id=uuid.uuid4(), agent="bench", prompt_version="1", model="m", task="t"), '"t"'
    )
    [claim] = store.claim_runs("bench", 3600)
    seq = 0

    def params() -> dict[str, Any]:
        nonlocal seq
        seq += 1
        return {
            "run_id": run.pk,
            "owner": claim.owner,
            "attempt": claim.attempt,
            "lease": 3600.0,
            "seq": seq,
            "kind": "model_turn",
            "payload": '{"content":[]}',
            "content_start": None,
            "content_end": None,
            "request_id": None,
            "tokens": 0,
            "cost": None,  # an unpriced step, as bench/commit.py's
        }

    def wrapped() -> float:
        t = time.perf_counter()
        with binding_cursor() as cursor:
            cursor.execute(APPEND_STEP_SQL, params())
            assert cursor.rowcount == 1
        return time.perf_counter() - t

    def bare() -> float:
        t = time.perf_counter()
        connection.ensure_connection()
        with connection.wrap_database_errors, psycopg.Cursor(connection.connection) as cursor:
            cursor.execute(APPEND_STEP_SQL, params())
            assert cursor.rowcount == 1
        return time.perf_counter() - t

    def hooked() -> float:
        def passthrough(execute: Any, sql: str, p: Any, many: bool, context: Any) -> Any:
            return execute(sql, p, many, context)

        with connection.execute_wrapper(passthrough):
            return wrapped()

    variants = {"bare psycopg cursor": bare, "binding_cursor": wrapped, "with a hook": hooked}
    for _ in range(50):
        for fn in variants.values():
            fn()
    per_block = max(1, a.steps // a.blocks)
    lat = common.interleaved(
        a.blocks,
        {name: (lambda fn=fn: [fn() for _ in range(per_block)]) for name, fn in variants.items()},
    )
    res: dict[str, Any] = {name: common.summary_ms(v) for name, v in lat.items()}
    base = res["bare psycopg cursor"]
    for name in variants:
        r = res[name]
        common.log(
            f"[instrumented_commit] {name}: p50 {r['p50_ms']:.3f} ms, p99 {r['p99_ms']:.3f} ms "
            f"(p50 ratio to bare {r['p50_ms'] / base['p50_ms']:.3f})"
        )
    connection.close()
    return common.finish("instrumented_commit", res, DB)


if __name__ == "__main__":
    main()
