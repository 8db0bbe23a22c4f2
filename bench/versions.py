"""Routing by version: what claiming only the runs of the agent versions a worker defines costs
the claim.

Two databases of ``--pending`` pending runs (100,000), bulk-loaded and VACUUM ANALYZEd: in one
every run is of one agent version (``bench``@1, the plain case); in the other they are spread,
interleaved in creation order, over 10 versions of 5 agents (``fleet0``@1 ... ``fleet4``@2),
which every worker of the fleet defines (the code deployed to the 4 workers defines all 10), so
the claim compares each candidate with 10 versions where the plain case compares it with one.
Then ``--pairs`` alternating pairs of blocks, each block a fresh worker-like process (warmed up,
then ``--claims`` timed claims, each claimed run finished at once): the claim's p99 with the
fleet over its p99 with one version, per pair. Target: the median of the pairs' ratios <= 1.2.
Also prints the fleet claim's EXPLAIN: it must still read the claim index in order
(agent_run_claim_fair), with no Sort.

``--defines 0,3,6``: the timed worker defines only those of the 10 (a fleet whose workers run
different code). With no other worker draining the rest here, its claims read past more and
more of the others' runs as it goes: an upper bound, not a fleet's steady state (there, the
workers' passes park the runs of versions no live worker defines: housekeeping/serving.py).

    python -m bench.versions --quick
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

from bench import common
from bench.common import log
from bench.scale import reads_in_order

ONE, FLEET = "da_bench_versions_one", "da_bench_versions_fleet"
VERSIONS = [(f"fleet{a}", str(v)) for a in range(5) for v in (1, 2)]
# The versions of the timed worker (indexes into VERSIONS): all 10 unless --defines says.
ALL = ",".join(str(i) for i in range(len(VERSIONS)))

_COLUMNS = (
    "id, agent, prompt_version, fingerprint, model, task, status, attempt, stalled_claims, "
    "last_seq, error, created_at, updated_at, priority"
)


def load(url: str, pending: int, spread: bool) -> float:
    import psycopg

    agents = [a for a, _ in VERSIONS] if spread else ["bench"]
    versions = [v for _, v in VERSIONS] if spread else ["1"]
    t = time.perf_counter()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("TRUNCATE agent_run CASCADE")
        conn.execute(
            f"INSERT INTO agent_run ({_COLUMNS}) "
            f"SELECT {common.TIME_ORDERED_ID_SQL}, (%(a)s::text[])[1 + g %% %(n)s],"
            " (%(v)s::text[])[1 + g %% %(n)s], 'x', 'claude-bench-1', 'pending run ' || g,"
            " 'pending', 0, 0, 0, '', now() - interval '1 day' + g * interval '1 ms',"
            " now() - interval '1 day' + g * interval '1 ms', 0 "
            "FROM generate_series(1, %(pending)s) g",
            {"a": agents, "v": versions, "n": len(agents), "pending": pending},
        )
        conn.execute("VACUUM ANALYZE agent_run")
    return time.perf_counter() - t


def child(nclaims: int, explain: bool) -> None:
    """In a bench-settings Django process: warm up, then time ``nclaims`` claims."""
    import django

    django.setup()
    from django.db import connection, transaction

    from durable_agents.store import current

    for _ in range(20):
        for c in current().claim_runs("versions-warm", 60, 1):
            current().finish_run(c, "succeeded")
    lat = []
    for _ in range(nclaims):
        t = time.perf_counter()
        claims = current().claim_runs("versions", 60, 1)
        lat.append(time.perf_counter() - t)
        assert claims, "no pending run of this worker's versions left"
        current().finish_run(claims[0], "succeeded")
    out: dict[str, Any] = {"lat": lat}
    if explain:
        from durable_agents.store import postgres

        params = {**postgres.key_limits(), "owner": "versions-explain", "lease": 60.0, "limit": 1}
        with transaction.atomic(), connection.cursor() as cur:
            cur.execute("EXPLAIN (ANALYZE, BUFFERS) " + postgres.CLAIM_SQL, params)
            out["explain"] = "\n".join(r[0] for r in cur.fetchall())
            transaction.set_rollback(True)
    common.print_result(out)


def claims_in(url: str, n: int, defines: str, explain: bool = False) -> dict[str, Any]:
    return common.child_result(
        ["bench.versions", "child", str(n), "1" if explain else "0"],
        common.bench_env(url, DA_BENCH_FLEET_DEFINES=defines),
        what="versions child",
    )


def run(pending: int, claims: int, pairs: int, defines: str = ALL) -> dict[str, Any]:
    one_url, fleet_url = common.fresh_db(ONE), common.fresh_db(FLEET)
    loaded = {"one": load(one_url, pending, False), "fleet": load(fleet_url, pending, True)}
    log(f"  loaded {pending:,} runs twice in {loaded['one']:.1f}s / {loaded['fleet']:.1f}s")
    ratios, lat_one, lat_fleet = [], [], []
    for i in range(pairs):
        sides = [("one", one_url, ""), ("fleet", fleet_url, defines)]
        if i % 2:
            sides.reverse()
        got: dict[str, list[float]] = {}
        for name, url, its_versions in sides:
            got[name] = claims_in(url, claims, its_versions)["lat"]
        p99 = {k: common.pct(v, 99) for k, v in got.items()}
        ratios.append(p99["fleet"] / p99["one"])
        lat_one += got["one"]
        lat_fleet += got["fleet"]
        log(
            f"  pair {i + 1}: claim p99 one version {p99['one'] * 1e3:.3f} ms, fleet "
            f"{p99['fleet'] * 1e3:.3f} ms: {ratios[-1]:.2f}x"
        )
    explain = claims_in(fleet_url, 1, defines, explain=True)["explain"]
    res: dict[str, Any] = {
        "pending": pending,
        "claims_per_block": claims,
        "pairs": pairs,
        "defines": defines,
        "one_version": common.summary_ms(lat_one),
        "fleet": common.summary_ms(lat_fleet),
        "p99_ratios": ratios,
        "median_p99_ratio": statistics.median(ratios),
        "explain_fleet": explain,
        "reads_index_in_order": reads_in_order(explain, "agent_run_claim_fair"),
        "target": "claim p99, 10 versions of 5 agents across 4 workers / one version <= 1.2",
    }
    res["met"] = res["median_p99_ratio"] <= 1.2 and res["reads_index_in_order"]
    log(
        f"[versions] claim p50/p99 one version {res['one_version']['p50_ms']:.3f}/"
        f"{res['one_version']['p99_ms']:.3f} ms, fleet {res['fleet']['p50_ms']:.3f}/"
        f"{res['fleet']['p99_ms']:.3f} ms; median p99 ratio {res['median_p99_ratio']:.2f} over "
        f"{pairs} pairs -> {common.verdict(res['met'])} (<= 1.2); index read in order: "
        f"{res['reads_index_in_order']}"
    )
    log("[versions] EXPLAIN of the fleet's claim:\n" + explain)
    return res


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser()
    p.add_argument("--pending", type=int, default=100_000)
    p.add_argument("--claims", type=int, default=1000)
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--defines", default=ALL, help="indexes of the versions the worker defines")
    p.add_argument("--quick", action="store_true", help="20,000 runs, 400 claims a block")
    p.add_argument("--keep", action="store_true")
    a = p.parse_args(argv)
    if a.quick:
        a.pending, a.claims = 20_000, 400
    res = run(a.pending, a.claims, a.pairs, a.defines)
    return common.finish("versions", res, ONE, FLEET, keep=a.keep)


if __name__ == "__main__":
    if sys.argv[1:2] == ["child"]:
        child(int(sys.argv[2]), sys.argv[3] == "1")
    else:
        main(sys.argv[1:])
