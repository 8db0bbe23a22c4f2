"""Target 1, loop overhead: the seed's in-memory ``while True`` loop vs the durable worker.

Both use the same real SDK (anthropic over httpx2) against the same fake API process, one run
at a time. The durable side is measured four ways:
  * ``durable_worker``: ``Worker(concurrency=1, burst=True).run()`` in this process, timed from
    the call to its return (claims, steps, commits, the burst exit poll);
  * ``durable_strict``: the same with ``OVERLAP_SAFE_COMMITS`` off (every step committed before
    the next call, two flushed commits per turn in the step's path instead of one);
  * ``durable_start``: ``start_run`` of the same runs (the enqueue the in-memory loop has not);
  * ``runagents_burst``: ``manage.py runagents --burst`` as a subprocess, wall clock including
    interpreter and Django start-up.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time
from typing import Any

from bench import common
from bench.common import log

DB = "da_bench_loop"


def inmemory_loop(client: Any, params: dict[str, Any], tool_fn: Any, task: str) -> Any:
    """The seed's loop: call, append, execute the tools, repeat."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": task}]
    while True:
        resp = client.messages.create(messages=messages, **params)
        messages.append({"role": "assistant", "content": resp.content})
        if resp.stop_reason != "tool_use":
            return resp
        results = []
        for block in resp.content:
            if block.type == "tool_use":
                results.append(
                    {
                        "type": "tool_result",
                        "tool_use_id": block.id,
                        "content": tool_fn(**block.input),
                    }
                )
        messages.append({"role": "user", "content": results})


def time_inmemory(base_url: str, runs: int, offset: int) -> float:
    import anthropic

    from bench.benchapp.agents import bench, noop

    client = anthropic.Anthropic(api_key="bench-key", base_url=base_url, max_retries=0)
    params = bench.request_params(bench.model)
    inmemory_loop(client, params, noop.func, common.task_text(-1))  # warm the connection
    started = time.perf_counter()
    for i in range(runs):
        resp = inmemory_loop(client, params, noop.func, common.task_text(offset + i))
        assert resp.stop_reason == "end_turn", resp.stop_reason
    return time.perf_counter() - started


def _check_all_succeeded() -> int:
    from durable_agents.models import AgentRun

    bad = AgentRun.objects.exclude(status="succeeded").count()
    if bad:
        raise RuntimeError(f"{bad} runs did not succeed")
    return AgentRun.objects.count()


def time_durable_worker(runs: int, offset: int, overlap: bool = True) -> tuple[float, float]:
    from django.conf import settings
    from django.test.utils import override_settings

    with override_settings(
        DURABLE_AGENTS={**settings.DURABLE_AGENTS, "OVERLAP_SAFE_COMMITS": overlap}
    ):
        return _time_durable_worker(runs, offset)


def _time_durable_worker(runs: int, offset: int) -> tuple[float, float]:
    import durable_agents
    from durable_agents.engine.worker import Worker

    started = time.perf_counter()
    for i in range(runs):
        durable_agents.start_run("bench", common.task_text(offset + i))
    start_s = time.perf_counter() - started
    worker = Worker(concurrency=1, burst=True, handle_signals=False, poll_interval=0.05)
    started = time.perf_counter()
    worker.run()
    work_s = time.perf_counter() - started
    _check_all_succeeded()
    return start_s, work_s


def time_runagents(url: str, base_url: str, runs: int, offset: int) -> float:
    import durable_agents

    for i in range(runs):
        durable_agents.start_run("bench", common.task_text(offset + i))
    started = time.perf_counter()
    subprocess.run(
        [common.PY, "manage.py", "runagents", "--burst", "--concurrency", "1"],
        cwd=common.ROOT,
        env=common.bench_env(url, base_url),
        check=True,
    )
    wall = time.perf_counter() - started
    _check_all_succeeded()
    return wall


def run(runs: int, reps: int) -> dict[str, Any]:
    url = common.fresh_db(DB)
    with common.fake_api() as base_url:
        common.setup_django(url, base_url)
        # Warm-up of the durable path (imports, connections, the SDK client).
        time_durable_worker(3, 10_000_000)
        inmem, start, work, strict, burst = [], [], [], [], []
        for rep in range(reps):
            inmem.append(time_inmemory(base_url, runs, rep * runs))
            s, w = time_durable_worker(runs, 1_000_000 + rep * runs)
            start.append(s)
            work.append(w)
            strict.append(time_durable_worker(runs, 3_000_000 + rep * runs, overlap=False)[1])
            log(
                f"  rep {rep}: in-memory {inmem[-1]:.3f}s  durable worker {w:.3f}s "
                f"(+start {s:.3f}s)  strict {strict[-1]:.3f}s"
            )
        burst.append(time_runagents(url, base_url, runs, 2_000_000))
    steps = runs * (2 * common.TURNS - 1)
    m_in, m_work, m_start, m_strict = (statistics.median(x) for x in (inmem, work, start, strict))
    ratio = m_work / m_in
    ratio_incl = (m_work + m_start) / m_in
    res = {
        "runs": runs,
        "turns_per_run": common.TURNS,
        "steps_per_run": 2 * common.TURNS - 1,
        "reps": reps,
        "inmemory_s": inmem,
        "durable_worker_s": work,
        "durable_strict_s": strict,
        "durable_strict_ms_per_run": m_strict / runs * 1000,
        "ratio_strict": m_strict / m_in,
        "durable_start_s": start,
        "runagents_burst_wall_s": burst[0],
        "inmemory_ms_per_run": m_in / runs * 1000,
        "durable_ms_per_run": m_work / runs * 1000,
        "start_run_ms": m_start / runs * 1000,
        "inmemory_model_calls_per_s": runs * common.TURNS / m_in,
        "durable_steps_per_s": steps / m_work,
        "durable_model_calls_per_s": runs * common.TURNS / m_work,
        "ratio": ratio,
        "ratio_incl_start": ratio_incl,
        "ratio_runagents_wall": burst[0] / m_in,
        "target": "durable / in-memory <= 1.5",
        "met": ratio <= 1.5,
    }
    log(
        f"[loop] in-memory {res['inmemory_ms_per_run']:.2f} ms/run, durable "
        f"{res['durable_ms_per_run']:.2f} ms/run (+{res['start_run_ms']:.2f} ms start_run): "
        f"ratio {ratio:.2f} (incl. start_run {ratio_incl:.2f}; runagents --burst wall "
        f"{res['ratio_runagents_wall']:.2f}; OVERLAP_SAFE_COMMITS off "
        f"{res['ratio_strict']:.2f}) -> {common.verdict(res['met'])} (<= 1.5)"
    )
    return res


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=100)
    p.add_argument("--reps", type=int, default=4)
    a = p.parse_args(argv)
    res = run(a.runs, a.reps)
    return common.finish("loop", res, DB)


if __name__ == "__main__":
    main()
