"""Target 4, scale: ``Store.claim_runs`` latency with 1,000 vs 1,000,000 finished runs, both
with 10,000 pending runs. Two databases are bulk-loaded (INSERT ... SELECT generate_series),
vacuumed and analysed; then blocks of claims alternate between them (each block in a fresh
worker-like process, warmed up first) so that machine noise hits both alike. Each claimed run
is finished at once (``finish_run``), as a worker would, so the pending queue stays realistic.
Prints the claim query's EXPLAIN (ANALYZE, BUFFERS) and table and index sizes.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from bench import common
from bench.common import log

SMALL, LARGE = "da_bench_scale_1k", "da_bench_scale_1m"

_COLUMNS = (
    "id, agent, prompt_version, fingerprint, model, task, status, attempt, stalled_claims, "
    "last_seq, error, created_at, updated_at"
)


def load(url: str, finished: int, pending: int) -> float:
    import psycopg

    t = time.perf_counter()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("TRUNCATE agent_run CASCADE")
        conn.execute(
            f"INSERT INTO agent_run ({_COLUMNS}, finished_at, result) "
            "SELECT gen_random_uuid(), 'bench', '1', 'x', 'claude-bench-1', 'finished run ' || g,"
            " (ARRAY['succeeded','succeeded','succeeded','failed','cancelled'])[1 + g %% 5],"
            " 1, 0, 19, '', now() - interval '30 days' + g * interval '1 ms',"
            " now() - interval '30 days' + g * interval '1 ms',"
            " now() - interval '30 days' + g * interval '1 ms', 'done' "
            "FROM generate_series(1, %s) g",
            (finished,),
        )
        conn.execute(
            f"INSERT INTO agent_run ({_COLUMNS}) "
            "SELECT gen_random_uuid(), 'bench', '1', 'x', 'claude-bench-1', 'pending run ' || g,"
            " 'pending', 0, 0, 0, '', now() - interval '1 day' + g * interval '1 ms',"
            " now() - interval '1 day' + g * interval '1 ms' "
            "FROM generate_series(1, %s) g",
            (pending,),
        )
        conn.execute("VACUUM ANALYZE agent_run")
    return time.perf_counter() - t


def sizes(url: str) -> dict[str, Any]:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT c.relname, pg_relation_size(c.oid), pg_size_pretty(pg_relation_size(c.oid))"
            " FROM pg_class c WHERE c.relname = 'agent_run' OR c.oid IN "
            "(SELECT indexrelid FROM pg_index WHERE indrelid = 'agent_run'::regclass)"
            " ORDER BY 2 DESC"
        ).fetchall()
        total = conn.execute(
            "SELECT pg_size_pretty(pg_total_relation_size('agent_run')),"
            " (SELECT count(*) FROM agent_run), (SELECT count(*) FROM agent_run"
            "  WHERE status IN ('pending', 'running'))"
        ).fetchone()
    return {
        "relations": {name: {"bytes": b, "pretty": p} for name, b, p in rows},
        "total_pretty": total[0],
        "rows": total[1],
        "active_rows": total[2],
    }


def child(nclaims: int, explain: bool) -> None:
    """In a bench-settings Django process: warm up, then time ``nclaims`` claims."""
    import django

    django.setup()
    from django.db import connection, transaction

    from durable_agents.store import current

    for _ in range(20):
        for c in current().claim_runs("scale-warm", 60, 1):
            current().finish_run(c, "succeeded")
    lat = []
    for _ in range(nclaims):
        t = time.perf_counter()
        claims = current().claim_runs("scale", 60, 1)
        lat.append(time.perf_counter() - t)
        assert claims, "no pending run left"
        current().finish_run(claims[0], "succeeded")
    out: dict[str, Any] = {"lat": lat}
    if explain:
        # The claim statement with a claim's parameters, in a transaction rolled back (the
        # claim binds on the server, so the text Django logs for it has no values).
        from durable_agents.store import postgres

        params = {**postgres.key_limits(), "owner": "scale-explain", "lease": 60.0, "limit": 1}
        with transaction.atomic(), connection.cursor() as cur:
            cur.execute("EXPLAIN (ANALYZE, BUFFERS) " + postgres.CLAIM_SQL, params)
            plan = "\n".join(r[0] for r in cur.fetchall())
            transaction.set_rollback(True)
        out["sql"] = postgres.CLAIM_SQL
        out["explain"] = plan
    common.print_result(out)


def claims_in(url: str, n: int, explain: bool = False, root: Path = common.ROOT) -> dict[str, Any]:
    """The child (warm up, then time ``n`` claims on ``url``) with the code of the checkout
    ``root``: its latencies, and with ``explain`` the claim's SQL and plan. bench.priority and
    bench.keys time their claims with it too."""
    return common.child_result(
        ["bench.scale", "child", str(n), "1" if explain else "0"],
        common.bench_env(url, PYTHONPATH=str(root)),
        cwd=root,
        what="scale child",
    )


def reads_in_order(plan: str, index: str) -> bool:
    """Whether the claim's CTE ``ready`` (the pending runs: up to the next CTE or node of the
    statement's top level) in the EXPLAIN ``plan`` reads ``index``, with no Sort."""
    ready = plan.partition("CTE ready")[2].split("\n  CTE ", 1)[0].split("\n  ->", 1)[0]
    return index in ready and "Sort" not in ready


def alternate_claims(
    urls: dict[str, str], claims: int, blocks: int, roots: dict[str, Path] | None = None
) -> dict[str, list[float]]:
    """``claims`` claims on each database of ``urls``, in ``blocks`` blocks that alternate
    between them (each in a fresh child, with the code of ``roots[name]``): the latencies."""
    roots = roots or {}

    def side(name: str) -> Any:
        root = roots.get(name, common.ROOT)
        return lambda: claims_in(urls[name], claims // blocks, root=root)["lat"]

    return common.interleaved(blocks, {name: side(name) for name in urls})


def run(large: int, pending: int, claims: int, blocks: int) -> dict[str, Any]:
    small_url = common.fresh_db(SMALL)
    large_url = common.fresh_db(LARGE)
    load_s = {"small": load(small_url, 1000, pending), "large": load(large_url, large, pending)}
    log(
        f"  loaded 1,000 + {pending} runs in {load_s['small']:.1f}s, {large:,} + {pending} "
        f"in {load_s['large']:.1f}s"
    )
    lat = alternate_claims({"small": small_url, "large": large_url}, claims, blocks)
    ex_small = claims_in(small_url, 1, explain=True)
    ex_large = claims_in(large_url, 1, explain=True)
    res: dict[str, Any] = {
        "finished_small": 1000,
        "finished_large": large,
        "pending": pending,
        "load_s": load_s,
        "small": common.summary_ms(lat["small"]),
        "large": common.summary_ms(lat["large"]),
        "claim_select_sql": ex_large["sql"],
        "explain_small": ex_small["explain"],
        "explain_large": ex_large["explain"],
        "sizes_small": sizes(small_url),
        "sizes_large": sizes(large_url),
    }
    res["p99_ratio"] = res["large"]["p99_ms"] / res["small"]["p99_ms"]
    res["p50_ratio"] = res["large"]["p50_ms"] / res["small"]["p50_ms"]
    res["target"] = "claim p99 at 1M finished / at 1k finished <= 1.2"
    res["met"] = res["p99_ratio"] <= 1.2
    log(
        f"[scale] claim p50/p99: {res['small']['p50_ms']:.3f}/{res['small']['p99_ms']:.3f} ms at "
        f"1k finished, {res['large']['p50_ms']:.3f}/{res['large']['p99_ms']:.3f} ms at "
        f"{large:,} finished: p99 ratio {res['p99_ratio']:.2f} -> {common.verdict(res['met'])}"
        " (<= 1.2)"
    )
    log("[scale] claim SELECT: " + res["claim_select_sql"])
    log("[scale] EXPLAIN at the large size:\n" + res["explain_large"])
    for name, rel in res["sizes_large"]["relations"].items():
        log(
            f"    {name:32s} {rel['pretty']:>10s}   (1k db: "
            f"{res['sizes_small']['relations'].get(name, {}).get('pretty', '?')})"
        )
    return res


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser()
    p.add_argument("--large", type=int, default=1_000_000)
    p.add_argument("--pending", type=int, default=10_000)
    p.add_argument("--claims", type=int, default=2000)
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--keep", action="store_true")
    a = p.parse_args(argv)
    res = run(a.large, a.pending, a.claims, a.blocks)
    return common.finish("scale", res, SMALL, LARGE, keep=a.keep)


if __name__ == "__main__":
    if sys.argv[1:2] == ["child"]:
        child(int(sys.argv[2]), sys.argv[3] == "1")
    else:
        main()
