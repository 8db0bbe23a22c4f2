"""Concurrency keys: what the limits and the fair share cost the claim, and how fair it is.

Claim cost: ``Store.claim_runs`` latency in two databases of 100,000 pending runs each
(``--pending``), both spread over 5 priorities (0, 25, 50, 75, 100, interleaved in creation
order): in one every run has one of 1,000 concurrency keys (``tenant:<g % 1000>``, limit 5
from its agent, the keys' rows and turns as ``start_run`` writes them), in the other none, the
plain case. Both are bulk-loaded and VACUUM ANALYZEd; then blocks of claims alternate between
them (each block in a fresh worker-like process, warmed up first: ``bench.scale``'s child), so
machine noise hits both alike. Each claimed run is finished at once, as a worker would.
Target: claim p99 with keys / p99 without <= 1.2, and the claim reads agent_run_claim_fair in
order (no Sort). Prints the claim's EXPLAIN (ANALYZE, BUFFERS) with keys.

Fairness: an in-process worker (``--slots`` slots) against the offline model (OFFLINE on, the
real SDK, the real store) works through key A's 1,000 runs (``--a-runs``); once it has finished
``--head-start`` of them, key B starts 10 runs (``--b-runs``) at the same priority. B's
latency (created to finished, database clock) p95 is compared with B's 10 runs on the same
worker with nothing else queued, alternating the two ``--reps`` times. Target: p95 with A
queued / p95 alone <= 1.5. Without fair share B would wait for A's whole queue; that figure
is printed beside it (A's remaining runs at A's throughput).

    python -m bench.keys --quick
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from typing import Any

from bench import common
from bench.common import log
from bench.priority import LEVELS
from bench.scale import alternate_claims, claims_in, reads_in_order

KEYED, PLAIN, FAIR = "da_bench_keys_keyed", "da_bench_keys_plain", "da_bench_keys_fair"
KEYS = 1000
KEY_LIMIT = 5

_COLUMNS = (
    "id, agent, prompt_version, fingerprint, model, task, status, attempt, stalled_claims, "
    "last_seq, error, created_at, updated_at, priority, concurrency_key, concurrency_limit, fair_at"
)


def load(url: str, pending: int, keys: int) -> float:
    """``pending`` pending runs over 5 priorities; with ``keys``, the g-th has the key
    ``tenant:<g % keys>`` (limit KEY_LIMIT) and the turn ``start_run`` gives it (a second after
    its key's previous run, or its creation if later), and each key its row."""
    import psycopg

    t = time.perf_counter()
    created = "now() - interval '1 day' + g * interval '1 ms'"
    if keys:
        key = f"'tenant:' || (g %% {keys})"
        turn = f"now() - interval '1 day' + (g %% {keys}) * interval '1 ms'"
        turn += f" + (g / {keys}) * interval '1 second'"
        keyed = f"{key}, {KEY_LIMIT}, greatest({created}, {turn})"
    else:
        keyed = f"NULL, NULL, {created}"
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("TRUNCATE agent_run, agent_concurrency_key CASCADE")
        conn.execute(
            f"INSERT INTO agent_run ({_COLUMNS}) "
            "SELECT gen_random_uuid(), 'bench', '1', 'x', 'claude-bench-1', 'pending run ' || g,"
            f" 'pending', 0, 0, 0, '', {created}, {created},"
            f" (%s::int[])[1 + g %% %s], {keyed} "
            "FROM generate_series(1, %s) g",
            (list(LEVELS), len(LEVELS), pending),
        )
        if keys:
            conn.execute(
                "INSERT INTO agent_concurrency_key (key, next_fair_at) SELECT concurrency_key,"
                " max(fair_at) + interval '1 second' FROM agent_run GROUP BY concurrency_key"
            )
        conn.execute("VACUUM ANALYZE agent_run")
        conn.execute("VACUUM ANALYZE agent_concurrency_key")
    return time.perf_counter() - t


def claim_cost(pending: int, claims: int, blocks: int) -> dict[str, Any]:
    urls = {"keyed": common.fresh_db(KEYED), "plain": common.fresh_db(PLAIN)}
    load(urls["keyed"], pending, KEYS)
    load(urls["plain"], pending, 0)
    log(f"  loaded {pending:,} pending runs in each ({KEYS:,} keys in one)")
    lat = alternate_claims(urls, claims, blocks)
    explained = claims_in(urls["keyed"], 1, explain=True)
    res: dict[str, Any] = {name: common.summary_ms(values) for name, values in lat.items()}
    res |= {
        "pending": pending,
        "keys": KEYS,
        "claim_sql": explained["sql"],
        "explain_keyed": explained["explain"],
        "p99_ratio": res["keyed"]["p99_ms"] / res["plain"]["p99_ms"],
        "p50_ratio": res["keyed"]["p50_ms"] / res["plain"]["p50_ms"],
    }
    plan = explained["explain"]
    res["index_in_order"] = reads_in_order(plan, "agent_run_claim_fair")
    for name in urls:
        log(
            f"[keys] claim p50/p99 {name:5s}: {res[name]['p50_ms']:.3f}/"
            f"{res[name]['p99_ms']:.3f} ms"
        )
    log(
        f"[keys] p99 ratio keyed/plain {res['p99_ratio']:.2f} (p50 {res['p50_ratio']:.2f});"
        f" ready reads agent_run_claim_fair in order, no Sort: {res['index_in_order']}"
        f" -> {common.verdict(res['p99_ratio'] <= 1.2 and res['index_in_order'])} (<= 1.2)"
    )
    log("[keys] EXPLAIN with keys:\n" + plan)
    return res


def _wait_for(condition: Any, limit: float = 600.0) -> None:
    deadline = time.monotonic() + limit
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError("the fairness round did not finish in time")
        time.sleep(0.01)


def _b_latencies(run_ids: list[Any]) -> list[float]:
    from durable_agents.models import AgentRun

    runs = AgentRun.objects.filter(pk__in=run_ids)
    assert all(run.status == "succeeded" for run in runs), [run.error for run in runs]
    return [(run.finished_at - run.created_at).total_seconds() for run in runs]


def _round(with_a: bool, a_runs: int, b_runs: int, head_start: int, turns: int) -> dict[str, Any]:
    """One round on the running worker: B alone, or B after A's head start."""
    import durable_agents
    from durable_agents.models import AgentRun

    AgentRun.objects.all().delete()
    a_ids: list[Any] = []
    t0 = time.perf_counter()
    if with_a:
        a_ids = [
            durable_agents.start_run("bench", common.task_text(i, turns), concurrency_key="A").pk
            for i in range(a_runs)
        ]
        done_a = AgentRun.objects.filter(pk__in=a_ids, status="succeeded")
        _wait_for(lambda: done_a.count() >= head_start)
    b_ids = [
        durable_agents.start_run("bench", common.task_text(i, turns), concurrency_key="B").pk
        for i in range(b_runs)
    ]
    done_b = AgentRun.objects.filter(pk__in=b_ids, status__in=("succeeded", "failed", "dead"))
    _wait_for(lambda: done_b.count() == b_runs)
    out: dict[str, Any] = {"b_latency_s": _b_latencies(b_ids)}
    if with_a:
        finished = AgentRun.objects.filter(pk__in=a_ids, status="succeeded").count()
        elapsed = time.perf_counter() - t0
        out |= {"a_finished": finished, "a_per_s": finished / elapsed}
        AgentRun.objects.filter(pk__in=a_ids, status="pending").update(status="cancelled")
        _wait_for(lambda: not AgentRun.objects.filter(status="running").exists())
    return out


def fairness(
    a_runs: int, b_runs: int, head_start: int, slots: int, reps: int, turns: int
) -> dict[str, Any]:
    """B's p95 latency with A queued over B alone, on one in-process worker."""
    url = common.fresh_db(FAIR)
    common.setup_django(url)
    from django.conf import settings

    from durable_agents import llm
    from durable_agents.engine.worker import Worker

    settings.DURABLE_AGENTS = {
        **settings.DURABLE_AGENTS,
        "OFFLINE": True,
        "NOTIFY": False,
        "POLL_INTERVAL": 0.01,
    }
    llm.reset_clients()
    worker = Worker(concurrency=slots, handle_signals=False, listen=False, poll_interval=0.01)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    alone: list[float] = []
    shared: list[float] = []
    a_rates: list[float] = []
    try:
        _round(False, a_runs, b_runs, head_start, turns)  # warm up
        for rep in range(reps):
            order = (False, True) if rep % 2 == 0 else (True, False)
            for with_a in order:
                out = _round(with_a, a_runs, b_runs, head_start, turns)
                (shared if with_a else alone).extend(out["b_latency_s"])
                if with_a:
                    a_rates.append(out["a_per_s"])
    finally:
        worker.stop()
        thread.join(60)
    p95_alone, p95_shared = common.pct(alone, 95), common.pct(shared, 95)
    a_per_s = sum(a_rates) / len(a_rates)
    res = {
        "a_runs": a_runs,
        "b_runs": b_runs,
        "slots": slots,
        "b_alone": common.summary_ms(alone),
        "b_with_a": common.summary_ms(shared),
        "p95_ratio": p95_shared / p95_alone,
        "fifo_wait_estimate_s": (a_runs - head_start) / a_per_s,
    }
    log(
        f"[keys] fairness: B's p95 alone {p95_alone * 1000:.0f} ms, with A's {a_runs:,} queued"
        f" {p95_shared * 1000:.0f} ms: ratio {res['p95_ratio']:.2f}"
        f" -> {common.verdict(res['p95_ratio'] <= 1.5)} (<= 1.5); oldest first, B would wait"
        f" about {res['fifo_wait_estimate_s']:.1f} s for A's queue"
    )
    return res


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser()
    p.add_argument("--pending", type=int, default=100_000)
    p.add_argument("--claims", type=int, default=2000)
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--a-runs", type=int, default=1000)
    p.add_argument("--b-runs", type=int, default=10)
    p.add_argument("--head-start", type=int, default=50)
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="400 claims in 2 blocks, 2 reps")
    p.add_argument("--keep", action="store_true")
    a = p.parse_args(argv)
    if a.quick:
        a.claims, a.blocks, a.reps = 400, 2, 2
    res = {"claims": claim_cost(a.pending, a.claims, a.blocks)}
    res["fairness"] = fairness(a.a_runs, a.b_runs, a.head_start, a.slots, a.reps, a.turns)
    res["met"] = (
        res["claims"]["p99_ratio"] <= 1.2
        and res["claims"]["index_in_order"]
        and res["fairness"]["p95_ratio"] <= 1.5
    )
    return common.finish("keys", res, KEYED, PLAIN, FAIR, keep=a.keep)


if __name__ == "__main__":
    sys.exit(0 if main()["met"] else 1)
