"""Run priorities: what ordering the claim by ``priority DESC, created_at`` costs it.

``Store.claim_runs`` latency in two databases of 100,000 pending runs each (``--pending``):
in one they are spread over 5 priorities (0, 25, 50, 75, 100, interleaved in creation order),
in the other all at priority 0, the plain case. Both are bulk-loaded (INSERT ... SELECT
generate_series) and VACUUM ANALYZEd; then blocks of claims alternate between them (each block
in a fresh worker-like process, warmed up first: ``bench.scale``'s child), so machine noise
hits both alike. Each claimed run is finished at once, as a worker would. Target: claim p99
with priorities / p99 all at 0 <= 1.2. Prints the claim's EXPLAIN (ANALYZE, BUFFERS) with
priorities: it must read the claim's index in order (agent_run_claim_fair since concurrency
keys: priority DESC first), with no Sort node.

``--before DIR``: also times the plain case with the code of another checkout (``DIR``, e.g.
the main branch before priorities), in a third database whose claim index is the old one,
``(created_at)``, in the same alternating blocks: the plain case before and after.

    python -m bench.priority --quick
    python -m bench.priority --before /path/to/checkout-of-main
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from bench import common
from bench.common import log
from bench.scale import alternate_claims, claims_in, reads_in_order

SPREAD, FLAT, BEFORE = "da_bench_priority_spread", "da_bench_priority_flat", "da_bench_priority_0"
LEVELS = (0, 25, 50, 75, 100)
INDEX = "agent_run_claim_fair"

_COLUMNS = (
    "id, agent, prompt_version, fingerprint, model, task, status, attempt, stalled_claims, "
    "last_seq, error, created_at, updated_at, priority"
)


def load(url: str, pending: int, levels: int) -> float:
    """``pending`` pending runs, the g-th at priority LEVELS[g % levels] (levels=1: all at 0)."""
    import psycopg

    t = time.perf_counter()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("TRUNCATE agent_run CASCADE")
        conn.execute(
            f"INSERT INTO agent_run ({_COLUMNS}) "
            "SELECT gen_random_uuid(), 'bench', '1', 'x', 'claude-bench-1', 'pending run ' || g,"
            " 'pending', 0, 0, 0, '', now() - interval '1 day' + g * interval '1 ms',"
            " now() - interval '1 day' + g * interval '1 ms', (%s::int[])[1 + g %% %s] "
            "FROM generate_series(1, %s) g",
            (list(LEVELS), levels, pending),
        )
        conn.execute("VACUUM ANALYZE agent_run")
    return time.perf_counter() - t


def old_claim_index(url: str) -> None:
    """The claim indexes as they were before priorities: ``agent_run_claim`` (``created_at``,
    active runs) alone."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("DROP INDEX IF EXISTS agent_run_claim_priority")
        conn.execute("ANALYZE agent_run")


def run(pending: int, claims: int, blocks: int, before: Path | None) -> dict[str, Any]:
    urls = {"spread": common.fresh_db(SPREAD), "flat": common.fresh_db(FLAT)}
    load(urls["spread"], pending, len(LEVELS))
    load(urls["flat"], pending, 1)
    roots = {"spread": common.ROOT, "flat": common.ROOT}
    if before is not None:
        urls["before"] = common.fresh_db(BEFORE)
        load(urls["before"], pending, 1)
        old_claim_index(urls["before"])
        roots["before"] = before
    log(f"  loaded {pending:,} pending runs in each of {', '.join(urls)}")
    lat = alternate_claims(urls, claims, blocks, roots)
    explained = claims_in(urls["spread"], 1, explain=True)
    res: dict[str, Any] = {name: common.summary_ms(values) for name, values in lat.items()}
    res |= {
        "pending": pending,
        "levels": list(LEVELS),
        "claim_sql": explained["sql"],
        "explain_spread": explained["explain"],
        "p99_ratio": res["spread"]["p99_ms"] / res["flat"]["p99_ms"],
        "p50_ratio": res["spread"]["p50_ms"] / res["flat"]["p50_ms"],
        "target": "claim p99 with 5 priorities / all at priority 0 <= 1.2",
    }
    plan = explained["explain"]
    # The claim's index since concurrency keys: (priority DESC, fair_at, created_at).
    res["index_in_order"] = reads_in_order(plan, INDEX)
    res["met"] = res["p99_ratio"] <= 1.2 and res["index_in_order"]
    for name in urls:
        log(
            f"[priority] claim p50/p99 {name:6s}: {res[name]['p50_ms']:.3f}/"
            f"{res[name]['p99_ms']:.3f} ms"
        )
    log(
        f"[priority] p99 ratio spread/flat {res['p99_ratio']:.2f} (p50 {res['p50_ratio']:.2f});"
        f" ready reads {INDEX} in order, no Sort: {res['index_in_order']}"
        f" -> {common.verdict(res['met'])} (<= 1.2)"
    )
    log("[priority] EXPLAIN with 5 priorities:\n" + plan)
    return res


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser()
    p.add_argument("--pending", type=int, default=100_000)
    p.add_argument("--claims", type=int, default=2000)
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--quick", action="store_true", help="400 claims in 2 blocks")
    p.add_argument("--before", type=Path, help="a checkout whose code times the plain case")
    p.add_argument("--keep", action="store_true")
    a = p.parse_args(argv)
    if a.quick:
        a.claims, a.blocks = 400, 2
    res = run(a.pending, a.claims, a.blocks, a.before)
    return common.finish("priority", res, SPREAD, FLAT, BEFORE, keep=a.keep)


if __name__ == "__main__":
    sys.exit(0 if main()["met"] else 1)
