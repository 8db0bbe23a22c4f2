"""Target 3, commit floor: one ``append_step`` vs a raw psycopg transaction (INSERT + UPDATE).

All against the same tables of one bench database, synchronous_commit on, one connection each,
interleaved in rounds so that background noise hits both alike. Also measured, to split the
cost: a ``SELECT 1`` round trip, the append_step SQL through raw psycopg (Django's share), and
append_step with synchronous_commit off (the WAL flush's share).

``append_step`` commits a step that is no model turn (a tool result's statement);
``append_turn`` the same step as a model turn, priced, whose statement also upserts the day's
rollup row (agent_usage_day): the two side by side are the rollup's cost on the commit.
``BENCH_COMMIT_DB`` names another bench database (``da_bench*``), for runs side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import uuid
from decimal import Decimal
from typing import Any

from bench import common
from bench.common import log

DB = os.environ.get("BENCH_COMMIT_DB", "da_bench_commit")

# A model turn's body as the fake API sends it (~700 bytes), stored verbatim by append_step.
PAYLOAD = json.dumps(
    {
        "id": "msg_offline_0123456789abcdef01234567",
        "type": "message",
        "role": "assistant",
        "model": "claude-bench-1",
        "content": [
            {"type": "text", "text": "Step 3: calling noop."},
            {
                "type": "tool_use",
                "id": "toolu_0123456789abcdef01234567",
                "name": "noop",
                "input": {"key": "k1-2"},
            },
        ],
        "stop_reason": "tool_use",
        "stop_sequence": None,
        "usage": {"input_tokens": 400, "output_tokens": 40, "service_tier": "standard"},
        "container": None,
    }
)


def _new_claim(owner: str) -> Any:
    import durable_agents
    from durable_agents import store

    run = durable_agents.start_run("bench", "commit floor")
    claims = store.current().claim_runs(owner, 3600, 1)
    assert claims, "claimed no run"
    assert claims[0].run_id == run.pk, "claimed another run"
    return claims[0]


def run(n: int, rounds: int) -> dict[str, Any]:
    import psycopg

    url = common.fresh_db(DB)
    common.setup_django(url)
    from django.db import connection

    from durable_agents import store
    from durable_agents.flow.pricing import Usage
    from durable_agents.models import step_part
    from durable_agents.store import StepWrite
    from durable_agents.store.postgres import APPEND_STEP_SQL

    claim = _new_claim("bench-commit")
    turn_claim = _new_claim("bench-commit-turn")
    cte_run = _new_claim("bench-commit-cte")
    async_claim = _new_claim("bench-commit-async")
    raw_run = uuid.uuid4()
    raw = psycopg.connect(url)  # not autocommit: a transaction per commit()
    raw_auto = psycopg.connect(url, autocommit=True)
    with raw_auto.cursor() as cur:
        cur.execute(
            "INSERT INTO agent_run (id, agent, prompt_version, fingerprint, model, task, status,"
            " attempt, stalled_claims, last_seq, error, created_at, updated_at)"
            " VALUES (%s, 'bench', '1', '', 'm', 't', 'running', 1, 0, 0, '', now(), now())",
            (raw_run,),
        )

    seq = {"da": 0, "turn": 0, "raw": 0, "cte": 0, "async": 0}
    series = ("append_step", "append_turn", "raw_tx", "raw_cte", "append_step_async", "select1")
    times: dict[str, list[float]] = {k: [] for k in series}
    usage = Usage(input_tokens=400, output_tokens=40, cache_read_tokens=2000)
    cost = Decimal("0.00126")

    def da_once() -> None:
        seq["da"] += 1
        t = time.perf_counter()
        ok = store.current().append_step(
            claim, StepWrite(seq["da"], "model_turn", PAYLOAD, "req_x")
        )
        times["append_step"].append(time.perf_counter() - t)
        assert ok

    def turn_once() -> None:
        seq["turn"] += 1
        step = StepWrite(
            seq["turn"], "model_turn", PAYLOAD, "req_x", tokens=usage.total, usage=usage, cost=cost
        )
        t = time.perf_counter()
        ok = store.current().append_step(turn_claim, step)
        times["append_turn"].append(time.perf_counter() - t)
        assert ok

    def raw_once() -> None:
        seq["raw"] += 1
        t = time.perf_counter()
        with raw.cursor() as cur:
            cur.execute(
                "INSERT INTO agent_step (run_id, seq, part, kind, payload, request_id, attempt,"
                " worker, created_at)"
                " VALUES (%s, %s, %s, 'model_turn', %s, 'req_x', 1, 'w', now())",
                (raw_run, seq["raw"], step_part(raw_run), PAYLOAD),
            )
            cur.execute(
                "UPDATE agent_run SET last_seq = %s, lease_until = now() + interval '60 s',"
                " updated_at = now() WHERE id = %s",
                (seq["raw"], raw_run),
            )
        raw.commit()
        times["raw_tx"].append(time.perf_counter() - t)

    sql = APPEND_STEP_SQL

    def cte_once() -> None:
        seq["cte"] += 1
        params = {
            "run_id": cte_run.run_id,
            "owner": cte_run.owner,
            "attempt": cte_run.attempt,
            "lease": 3600.0,
            "seq": seq["cte"],
            "part": step_part(cte_run.run_id),
            "kind": "model_turn",
            "payload": PAYLOAD,
            "content_start": None,
            "content_end": None,
            "request_id": "req_x",
            "tokens": 0,
            "cost": None,
        }
        t = time.perf_counter()
        with raw_auto.cursor() as cur:
            cur.execute(sql, params)
            assert cur.rowcount == 1
        times["raw_cte"].append(time.perf_counter() - t)

    def async_once() -> None:
        seq["async"] += 1
        with connection.cursor() as cur:
            cur.execute("SET synchronous_commit = off")
        t = time.perf_counter()
        ok = store.current().append_step(
            async_claim, StepWrite(seq["async"], "model_turn", PAYLOAD, "req_x")
        )
        times["append_step_async"].append(time.perf_counter() - t)
        with connection.cursor() as cur:
            cur.execute("SET synchronous_commit = on")
        assert ok

    def select1_once() -> None:
        t = time.perf_counter()
        raw_auto.execute("SELECT 1").fetchone()
        times["select1"].append(time.perf_counter() - t)

    interleaved = (da_once, turn_once, raw_once, cte_once, async_once, select1_once)
    for _ in range(50):  # warm-up
        for once in interleaved:
            once()
    for k in times:
        times[k].clear()
    for _ in range(rounds):
        for once in interleaved:
            for _ in range(n // rounds):
                once()
    raw.close()
    raw_auto.close()
    connection.close()
    res: dict[str, Any] = {k: common.summary_ms(v) for k, v in times.items()}
    a, r = res["append_step"]["p50_ms"], res["raw_tx"]["p50_ms"]
    res["ratio_p50"] = a / r
    res["ratio_mean"] = res["append_step"]["mean_ms"] / res["raw_tx"]["mean_ms"]
    res["turn_ratio_p50"] = res["append_turn"]["p50_ms"] / r
    res["turn_over_step_p50"] = res["append_turn"]["p50_ms"] / a
    res["target"] = "append_step / raw INSERT+UPDATE transaction <= 2"
    res["met"] = res["ratio_p50"] <= 2
    res["n"] = n
    log(
        f"[commit] append_step p50 {a:.3f} ms (mean {res['append_step']['mean_ms']:.3f}), raw tx "
        f"p50 {r:.3f} ms (mean {res['raw_tx']['mean_ms']:.3f}): ratio {res['ratio_p50']:.2f} -> "
        f"{common.verdict(res['met'])} (<= 2)"
    )
    log(
        f"[commit] model turn with the rollup upsert p50 {res['append_turn']['p50_ms']:.3f} ms "
        f"(mean {res['append_turn']['mean_ms']:.3f}): ratio to raw tx "
        f"{res['turn_ratio_p50']:.2f}, to append_step {res['turn_over_step_p50']:.2f}"
    )
    log(
        f"[commit] split: same SQL via raw psycopg {res['raw_cte']['p50_ms']:.3f} ms, "
        f"synchronous_commit=off {res['append_step_async']['p50_ms']:.3f} ms, "
        f"SELECT 1 {res['select1']['p50_ms']:.3f} ms"
    )
    return res


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=10)
    a = p.parse_args(argv)
    res = run(a.n, a.rounds)
    return common.finish("commit", res, DB)


if __name__ == "__main__":
    main()
