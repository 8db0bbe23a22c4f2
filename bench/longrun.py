"""Target 6, long runs: time per step at step ~2,000 vs step ~10, and the cold rebuild of a
2,000-step run (``history.load_log``, up to the request-ready messages text) vs a raw psycopg
SELECT of its rows.

Side by side, because absolute times on a shared machine drift: one long run of the
``bench_long`` agent is advanced in slices of 40 steps (each slice a claim of its own, ended
by the worker's drain flag), and between two slices a fresh 11-turn run is advanced from its
start. So every stretch of the long run has a fresh run's steps 2-21 timed next to it. The
figure compares the long run's steps 1,902-2,101 with the fresh runs timed in the same slices.

A step's time is the gap between two consecutive commits of one claim; it is split into the
model call (building the body, HTTP, the fake API) and the rest (commit, tool, runner:
durable_agents' own part). The first step of each claim (it includes the claim and the
rebuild) is left out. The seed's loop in memory is timed at the same turns for reference.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from typing import Any

from bench import common
from bench.common import log

DB = "da_bench_longrun"
SLICE_STEPS = 40
FRESH_TURNS = 11  # steps 1..21; steps 2..21 are timed (seq 1 opens the claim)


def window_for(turns: int) -> tuple[int, int]:
    """The 200 steps before the last 100 (1,902-2,101 for the default 1,101 turns)."""
    last = 2 * turns - 1
    return max(2, last - 299), last - 100


def _mean_ms(values: list[float]) -> float:
    return statistics.fmean(values) * 1000 if values else float("nan")


def _median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1000 if values else float("nan")


class _Timer(common.StepHooks):
    """Times every commit of the claim in progress."""

    def __init__(self) -> None:
        super().__init__()
        self.commits: dict[int, tuple[float, float, float]] = {}  # seq -> (end, commit, model)
        self.model_s = 0.0

    def append(self, claim: Any, step: Any, *a: Any, **k: Any) -> bool:
        t = time.perf_counter()
        ok = self.orig_append(claim, step, *a, **k)
        end = time.perf_counter()
        self.commits[step.seq] = (end, end - t, self.model_s)
        self.model_s = 0.0
        if len(self.commits) >= self.limit:
            self.drain.set()
        return ok

    def create(self, *a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        out = self.orig_create(*a, **k)
        self.model_s = time.perf_counter() - t
        return out

    def advance(self, run_id: Any, limit: int) -> tuple[str, dict[int, dict[str, float]]]:
        """One claim of ``run_id``, stopped after ``limit`` commits; the timed steps."""
        from durable_agents import store
        from durable_agents.engine import runner

        self.commits, self.limit, self.drain = {}, limit, threading.Event()
        claim = store.current().claim_run(run_id, "longrun", 3600)
        assert claim is not None
        disposition = runner.advance_run(claim, drain=self.drain)
        steps = {
            seq: {"step": end - self.commits[seq - 1][0], "commit": commit, "model": model}
            for seq, (end, commit, model) in self.commits.items()
            if seq - 1 in self.commits
        }
        return disposition, steps


def _summary(steps: list[dict[str, float]], prefix: str) -> dict[str, float]:
    models = [s for s in steps if s["model"] > 0]
    tools = [s for s in steps if s["model"] == 0]
    return {
        f"step_ms_at_{prefix}": _mean_ms([s["step"] for s in steps]),
        f"model_step_ms_at_{prefix}": _median_ms([s["step"] for s in models]),
        f"tool_step_ms_at_{prefix}": _median_ms([s["step"] for s in tools]),
        f"durable_part_ms_at_{prefix}": _mean_ms([s["step"] - s["model"] for s in steps]),
        f"commit_ms_at_{prefix}": _median_ms([s["commit"] for s in steps]),
        f"model_call_ms_at_{prefix}": _median_ms([s["model"] for s in models]),
    }


def run(turns: int, rebuild_reps: int) -> dict[str, Any]:
    import psycopg

    window = window_for(turns)
    url = common.fresh_db(DB)
    with common.fake_api() as base_url:
        common.setup_django(url, base_url)
        from durable_agents import store
        from durable_agents.engine import runner
        from durable_agents.engine.history import load_log

        common.start_runs(1, agent="bench_long", turns=5)  # warm-up run (SDK, connections)
        warm = store.current().claim_runs("longrun-warm", 3600, 1)[0]
        assert runner.advance_run(warm) == "succeeded"
        run_id = common.start_runs(1, agent="bench_long", turns=turns)[0]
        slices: list[dict[str, Any]] = []
        started = time.perf_counter()
        with _Timer() as timer:
            while True:
                disposition, long_steps = timer.advance(run_id, SLICE_STEPS)
                fresh_id = common.start_runs(1, agent="bench_long", turns=FRESH_TURNS)[0]
                fresh_disposition, fresh_steps = timer.advance(fresh_id, 10**6)
                assert fresh_disposition == "succeeded", fresh_disposition
                slices.append({"long": long_steps, "fresh": fresh_steps})
                if disposition == "succeeded":
                    break
                assert disposition == "released", disposition
        total = time.perf_counter() - started
        from durable_agents.models import AgentRun

        steps = AgentRun.objects.get(pk=run_id).last_seq
        curve = {seq: v for sl in slices for seq, v in sl["long"].items()}
        paired = [sl for sl in slices if any(window[0] <= q <= window[1] for q in sl["long"])]
        end_steps = [v for seq, v in curve.items() if window[0] <= seq <= window[1]]
        fresh_paired = [v for sl in paired for v in sl["fresh"].values()]
        first_slices = slices[:5]
        fresh_first = [v for sl in first_slices for v in sl["fresh"].values()]
        fresh_curve = {
            str(int(statistics.median(sl["long"]))): _mean_ms(
                [v["step"] for v in sl["fresh"].values()]
            )
            for sl in slices
            if sl["long"]
        }
        slice_ratios = [
            statistics.fmean(v["step"] for v in sl["long"].values())
            / statistics.fmean(v["step"] for v in sl["fresh"].values())
            for sl in paired
            if sl["long"]
        ]
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
            assert len(rebuilt.conversation) == steps + 1
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

    inmem_early = [v for seq, v in im.items() if 2 <= seq <= 2 * FRESH_TURNS - 1]
    inmem_end = [v for seq, v in im.items() if window[0] <= seq <= window[1]]
    res: dict[str, Any] = {
        "turns": turns,
        "steps": steps,
        "run_s": total,
        "slices": len(slices),
        "slice_steps": SLICE_STEPS,
        "window": list(window),
        "fresh_turns": FRESH_TURNS,
        "paired_slices": len(paired),
        "inmemory_run_s": inmem_total,
        # Means over both step kinds (model-turn and tool-result steps alternate).
        **_summary(fresh_paired, "10"),
        **_summary(end_steps, "end"),
        "first_slices_step_ms_at_10": _mean_ms([v["step"] for v in fresh_first]),
        "slice_ratio_median": statistics.median(slice_ratios) if slice_ratios else float("nan"),
        "inmemory_call_ms_at_10": _median_ms(inmem_early),
        "inmemory_call_ms_at_end": _median_ms(inmem_end),
        "curve": {
            str(seq): {
                "step_ms": v["step"] * 1000,
                "commit_ms": v["commit"] * 1000,
                "model_ms": v["model"] * 1000,
            }
            for seq, v in sorted(curve.items())
        },
        "fresh_curve": fresh_curve,
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
        f"[longrun] step time at ~10 (fresh runs' steps 2-21, in between): "
        f"{res['step_ms_at_10']:.2f} ms, at steps {window[0]}-{window[1]}: "
        f"{res['step_ms_at_end']:.2f} ms: ratio {res['step_ratio']:.2f} -> "
        f"{common.verdict(res['step_met'])} (<= 1.2); median of the {len(paired)} paired "
        f"slices' ratios {res['slice_ratio_median']:.2f}"
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
    p.add_argument("--turns", type=int, default=1101)
    p.add_argument("--rebuild-reps", type=int, default=15)
    p.add_argument("--gc-off", action="store_true", help="diagnosis: run with gc disabled")
    p.add_argument("--out", default="longrun")
    a = p.parse_args(argv)
    if a.gc_off:
        import gc

        gc.disable()
    res = run(a.turns, a.rebuild_reps)
    res["gc_off"] = a.gc_off
    return common.finish(a.out, res, DB)


if __name__ == "__main__":
    main()
