"""Target 6, long runs: time per step at step ~2,000 vs step ~10 of one run, and the cold
rebuild of a 2,000-step run (``history.load_log``, up to the request-ready messages text) vs a
raw psycopg SELECT of its rows.

One run of the ``bench_long`` agent (1,000 tool turns then a final turn: 2,001 worker steps)
is advanced in this process with the commit and the model call timed at every step. A step's
time is the gap between two consecutive commits; it is split into the model call (the SDK
serialising the whole history, HTTP, the fake API parsing it: this part grows with the history
for any agent loop, durable or not) and the rest (commit, tool, runner: durable_agents' part).
The same loop in memory (no database) is timed at the same turns for reference.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from bench import common
from bench.common import log

DB = "da_bench_longrun"


def _window(values: dict[int, float], lo: int, hi: int, mean: bool = False) -> float:
    picked = [v for s, v in values.items() if lo <= s <= hi]
    if not picked:
        return float("nan")
    return (statistics.fmean(picked) if mean else statistics.median(picked)) * 1000


def run(turns: int, rebuild_reps: int) -> dict[str, Any]:
    import psycopg

    url = common.fresh_db(DB)
    with common.fake_api() as base_url:
        common.setup_django(url, base_url)
        from durable_agents import leases, llm, runner
        from durable_agents.history import load_log

        common.start_runs(1, agent="bench_long", turns=5)  # warm-up run (SDK, connections)
        warm = leases.claim_runs("longrun-warm", 3600, 1)[0]
        assert runner.advance_run(warm) == "succeeded"
        run_id = common.start_runs(1, agent="bench_long", turns=turns)[0]
        commit_end: dict[int, float] = {}
        commit_ms: dict[int, float] = {}
        model_s: list[float] = []
        model_at: dict[int, float] = {}
        orig_append, orig_create = leases.append_step, llm.create_turn

        def append(claim: Any, seq: int, *a: Any, **k: Any) -> bool:
            t = time.perf_counter()
            ok = orig_append(claim, seq, *a, **k)
            commit_end[seq] = time.perf_counter()
            commit_ms[seq] = commit_end[seq] - t
            if model_s:
                model_at[seq] = model_s.pop()
            return ok

        def create(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            out = orig_create(*a, **k)
            model_s.append(time.perf_counter() - t)
            return out

        leases.append_step, llm.create_turn = append, create
        try:
            claim = leases.claim_runs("longrun", 3600, 1)[0]
            t = time.perf_counter()
            assert runner.advance_run(claim) == "succeeded"
            total = time.perf_counter() - t
        finally:
            leases.append_step, llm.create_turn = orig_append, orig_create
        steps = max(commit_end)
        step_s = {s: commit_end[s] - commit_end[s - 1] for s in commit_end if s - 1 in commit_end}
        rest_s = {s: step_s[s] - model_at.get(s, 0.0) for s in step_s}
        lo = (5, 55)  # medians over 50 steps around step 10..50 and the last 50 steps
        hi = (steps - 50, steps)

        # The same loop in memory, same SDK, same server: per model call at the same turns.
        import anthropic

        from bench.benchapp.agents import bench_long, noop
        from bench.loop import inmemory_loop

        client = anthropic.Anthropic(api_key="bench-key", base_url=base_url, max_retries=0)
        inmem_calls: list[float] = []
        orig_msgs_create = client.messages.create

        def timed_create(**k: Any) -> Any:
            t = time.perf_counter()
            out = orig_msgs_create(**k)
            inmem_calls.append(time.perf_counter() - t)
            return out

        client.messages.create = timed_create  # type: ignore[method-assign]
        t = time.perf_counter()
        inmemory_loop(client, bench_long.request_params(), noop.func, common.task_text(7, turns))
        inmem_total = time.perf_counter() - t
        im = {2 * i + 1: v for i, v in enumerate(inmem_calls)}  # the seq a model turn would have

        # Cold rebuild vs raw SELECT, interleaved, fresh connections each time.
        import json

        from django.db import connection

        rebuild, raw, raw_json = [], [], []
        for _ in range(rebuild_reps):
            connection.close()
            connection.ensure_connection()
            t = time.perf_counter()
            rebuilt = load_log(run_id)
            rebuilt.conversation.json()
            rebuild.append(time.perf_counter() - t)
            assert rebuilt.steps == len(rebuilt.conversation) == steps + 1
            with psycopg.connect(url) as conn:
                t = time.perf_counter()
                rows = conn.execute(
                    "SELECT seq, kind, payload FROM agent_step WHERE run_id = %s ORDER BY seq",
                    (run_id,),
                ).fetchall()
                raw.append(time.perf_counter() - t)
                assert len(rows) == steps + 1
                t = time.perf_counter()
                rows = conn.execute(
                    "SELECT seq, kind, payload FROM agent_step WHERE run_id = %s ORDER BY seq",
                    (run_id,),
                ).fetchall()
                [json.loads(r[2]) for r in rows]
                raw_json.append(time.perf_counter() - t)
        connection.close()

    res: dict[str, Any] = {
        "turns": turns,
        "steps": steps,
        "run_s": total,
        "inmemory_run_s": inmem_total,
        # Means over the window: model-turn (odd seq) and tool-result steps alternate, and a
        # median would pick one kind.
        "step_ms_at_10": _window(step_s, *lo, mean=True),
        "step_ms_at_end": _window(step_s, *hi, mean=True),
        "model_step_ms_at_10": _window({s: v for s, v in step_s.items() if s % 2}, *lo),
        "model_step_ms_at_end": _window({s: v for s, v in step_s.items() if s % 2}, *hi),
        "tool_step_ms_at_10": _window({s: v for s, v in step_s.items() if not s % 2}, *lo),
        "tool_step_ms_at_end": _window({s: v for s, v in step_s.items() if not s % 2}, *hi),
        "durable_part_ms_at_10": _window(rest_s, *lo, mean=True),
        "durable_part_ms_at_end": _window(rest_s, *hi, mean=True),
        "commit_ms_at_10": _window(commit_ms, *lo),
        "commit_ms_at_end": _window(commit_ms, *hi),
        "model_call_ms_at_10": _window(model_at, *lo),
        "model_call_ms_at_end": _window(model_at, *hi),
        "inmemory_call_ms_at_10": _window(im, *lo),
        "inmemory_call_ms_at_end": _window(im, *hi),
        "curve": {
            str(s): {
                "step_ms": step_s[s] * 1000,
                "commit_ms": commit_ms[s] * 1000,
                "model_ms": model_at.get(s, 0.0) * 1000,
            }
            for s in sorted(step_s)
        },
        "inmemory_curve": {str(s): v * 1000 for s, v in im.items()},
        "rebuild": common.summary_ms(rebuild),
        "raw_select": common.summary_ms(raw),
        "raw_select_plus_json_loads": common.summary_ms(raw_json),
    }
    res["step_ratio"] = res["step_ms_at_end"] / res["step_ms_at_10"]
    res["durable_part_ratio"] = res["durable_part_ms_at_end"] / res["durable_part_ms_at_10"]
    res["commit_ratio"] = res["commit_ms_at_end"] / res["commit_ms_at_10"]
    res["step_target"] = "time per step at step 2,000 / at step 10 <= 1.2"
    res["step_met"] = res["step_ratio"] <= 1.2
    res["rebuild_ratio"] = res["rebuild"]["p50_ms"] / res["raw_select"]["p50_ms"]
    res["rebuild_target"] = "cold rebuild / raw SELECT <= 1.5"
    res["rebuild_met"] = res["rebuild_ratio"] <= 1.5
    log(
        f"[longrun] step time at ~10: {res['step_ms_at_10']:.2f} ms, at ~{steps}: "
        f"{res['step_ms_at_end']:.2f} ms: ratio {res['step_ratio']:.2f} -> "
        f"{common.verdict(res['step_met'])} (<= 1.2)"
    )
    log(
        f"[longrun]   model call {res['model_call_ms_at_10']:.2f} -> "
        f"{res['model_call_ms_at_end']:.2f} ms (in memory: {res['inmemory_call_ms_at_10']:.2f} -> "
        f"{res['inmemory_call_ms_at_end']:.2f} ms); durable part (commit+tool+runner) "
        f"{res['durable_part_ms_at_10']:.2f} -> {res['durable_part_ms_at_end']:.2f} ms "
        f"({res['durable_part_ratio']:.2f}x); commit {res['commit_ms_at_10']:.2f} -> "
        f"{res['commit_ms_at_end']:.2f} ms ({res['commit_ratio']:.2f}x)"
    )
    log(
        f"[longrun] cold rebuild of {steps + 1} steps p50 {res['rebuild']['p50_ms']:.1f} ms vs raw "
        f"SELECT {res['raw_select']['p50_ms']:.1f} ms (raw SELECT + json.loads "
        f"{res['raw_select_plus_json_loads']['p50_ms']:.1f} ms): "
        f"ratio {res['rebuild_ratio']:.2f} -> "
        f"{common.verdict(res['rebuild_met'])} (<= 1.5)"
    )
    return res


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser()
    p.add_argument("--turns", type=int, default=1001)
    p.add_argument("--rebuild-reps", type=int, default=15)
    p.add_argument("--gc-off", action="store_true", help="diagnosis: run with gc disabled")
    p.add_argument("--out", default="longrun")
    a = p.parse_args(argv)
    if a.gc_off:
        import gc

        gc.disable()
    res = run(a.turns, a.rebuild_reps)
    res["gc_off"] = a.gc_off
    common.write_result(a.out, res)
    common.drop_db(DB)
    return res


if __name__ == "__main__":
    main()
