"""Target 2, peers: the same workload through DBOS Transact, and one-step runs through django-q2.

* DBOS (``dbos`` from PyPI, system database on PostgreSQL ``da_bench_dbos``): one workflow per
  run, one ``@DBOS.step`` per model call and one per tool call, run one workflow at a time in
  one thread (like one durable worker slot). The model step makes the same SDK call as the
  durable runner (``with_raw_response``, body parsed with json.loads) against the same fake API.
  DBOS runs in its own subprocess so its global state never meets Django's.
* django-q2 (ORM broker on the same PostgreSQL): N tasks, each one model call (``async_task``),
  processed by ``manage.py qcluster`` with one worker; throughput is N over the span from the
  first task's start to the last task's stop (as django-q2 records them), plus the wall clock
  from cluster start. durable_agents does N one-step runs (a task without a plan: one model
  turn, end_turn) with one worker (``--concurrency 1``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from typing import Any

from bench import common
from bench.common import log

# How many times faster than DBOS Transact the app must be on this workload (median of ten runs).
DBOS_TARGET = 2.5

DB = "da_bench_peers"
DBOS_DB = "da_bench_dbos"


# ---------------------------------------------------------------------------------------------
# DBOS child process


def dbos_child(base_url: str, sys_url: str, runs: int, reps: int) -> None:
    import anthropic
    from dbos import DBOS

    # The same request as the durable runner sends (agent.request_params), built without Django.
    params = {
        "model": "claude-bench-1",
        "max_tokens": 256,
        "system": "You are a benchmark agent.",
        "tools": [
            {
                "name": "noop",
                "description": "Return the key (a trivial pure tool).",
                "input_schema": {
                    "type": "object",
                    "properties": {"key": {"type": "string"}},
                    "required": ["key"],
                    "additionalProperties": False,
                },
            }
        ],
    }
    client = anthropic.Anthropic(api_key="bench-key", base_url=base_url, max_retries=0)

    @DBOS.step()
    def model_call(messages: list) -> dict:
        raw = client.messages.with_raw_response.create(messages=messages, **params)
        return json.loads(raw.http_response.content.decode("utf-8"))

    @DBOS.step()
    def noop_tool(key: str) -> str:
        return f"ok-{key}"

    @DBOS.workflow()
    def agent_workflow(task: str) -> str:
        messages: list = [{"role": "user", "content": task}]
        while True:
            msg = model_call(messages)
            messages.append({"role": "assistant", "content": msg["content"]})
            if msg["stop_reason"] != "tool_use":
                return msg["content"][0].get("text", "")
            results = []
            for block in msg["content"]:
                if block["type"] == "tool_use":
                    out = noop_tool(**block["input"])
                    results.append(
                        {"type": "tool_result", "tool_use_id": block["id"], "content": out}
                    )
            messages.append({"role": "user", "content": results})

    DBOS(
        config={
            "name": "da_bench",
            "system_database_url": sys_url,
            "log_level": "WARNING",
            "enable_otlp": False,
        }
    )
    DBOS.launch()
    for i in range(3):
        agent_workflow(common.task_text(-1 - i))
    times = []
    for rep in range(reps):
        t = time.perf_counter()
        for i in range(runs):
            agent_workflow(common.task_text(rep * runs + i))
        times.append(time.perf_counter() - t)
    DBOS.destroy()
    common.print_result({"times": times})


def time_dbos(base_url: str, runs: int, reps: int) -> list[float]:
    sys_url = common.recreate_db(DBOS_DB)
    return common.child_result(
        ["bench.peers", "dbos-child", base_url, sys_url, str(runs), str(reps)],
        {**os.environ, "PYTHONPATH": str(common.ROOT)},
        what="DBOS child",
    )["times"]


# ---------------------------------------------------------------------------------------------
# durable_agents side (in this process)


def time_durable(runs: int, turns: int, offset: int) -> float:
    import durable_agents
    from durable_agents.engine.worker import Worker
    from durable_agents.models import AgentRun

    for i in range(runs):
        durable_agents.start_run("bench", common.task_text(offset + i, turns))
    worker = Worker(concurrency=1, burst=True, handle_signals=False, poll_interval=0.05)
    t = time.perf_counter()
    worker.run()
    elapsed = time.perf_counter() - t
    bad = AgentRun.objects.exclude(status="succeeded").count()
    if bad:
        raise RuntimeError(f"{bad} durable runs did not succeed")
    return elapsed


# ---------------------------------------------------------------------------------------------
# django-q2 side


def time_q2(url: str, base_url: str, n: int) -> dict[str, Any]:
    from django_q.models import OrmQ, Task
    from django_q.tasks import async_task

    Task.objects.all().delete()
    OrmQ.objects.all().delete()
    for i in range(n):
        async_task("bench.benchapp.tasks.one_step", common.task_text(i, 1))
    proc = subprocess.Popen(
        [common.PY, "manage.py", "qcluster"],
        cwd=common.ROOT,
        env=common.bench_env(url, base_url, BENCH_Q_WORKERS="1"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    t0 = time.perf_counter()
    deadline = t0 + 300
    try:
        while Task.objects.count() < n:
            if time.perf_counter() > deadline or proc.poll() is not None:
                raise RuntimeError(
                    f"qcluster: {Task.objects.count()}/{n} tasks done; "
                    f"{proc.stderr.read().decode()[-2000:] if proc.poll() is not None else ''}"
                )
            time.sleep(0.02)
        wall = time.perf_counter() - t0
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        _wait_for_group_exit(proc.pid)
    failed = Task.objects.filter(success=False).count()
    if failed:
        raise RuntimeError(
            f"{failed} django-q2 tasks failed: {Task.objects.filter(success=False).first().result}"
        )
    span = Task.objects.order_by("-stopped").values_list("stopped", flat=True).first() - (
        Task.objects.order_by("started").values_list("started", flat=True).first()
    )
    return {"n": n, "wall_s": wall, "span_s": span.total_seconds()}


def _wait_for_group_exit(pgid: int, timeout: float = 15.0) -> None:
    """The cluster's worker processes outlive its main process briefly; measuring the next
    system while they still poll the database would charge it their CPU."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    os.killpg(pgid, signal.SIGKILL)


def run(runs: int, reps: int, q2_n: int) -> dict[str, Any]:
    url = common.fresh_db(DB)
    with common.fake_api() as base_url:
        common.setup_django(url, base_url)
        time_durable(3, common.TURNS, 9_000_000)  # warm-up
        dbos_times, durable_times = [], []
        for rep in range(reps):  # alternate, so that machine noise hits both alike
            dbos_times += time_dbos(base_url, runs, 1)
            durable_times.append(time_durable(runs, common.TURNS, rep * runs))
            log(f"  rep {rep}: DBOS {dbos_times[-1]:.2f}s, durable {durable_times[-1]:.2f}s")
        # one-step runs
        q2 = time_q2(url, base_url, q2_n)
        one = [time_durable(q2_n, 1, 5_000_000 + rep * q2_n) for rep in range(2)]
        t = time.perf_counter()
        common.start_runs(q2_n, turns=1)
        burst = subprocess.run(
            [common.PY, "manage.py", "runagents", "--burst"],
            cwd=common.ROOT,
            env=common.bench_env(url, base_url),
            check=True,
        )
        del burst
        burst_wall = time.perf_counter() - t
    steps = runs * (2 * common.TURNS - 1)
    d, b = statistics.median(durable_times), statistics.median(dbos_times)
    one_s = min(one)
    res = {
        "workload": f"{runs} runs x {common.TURNS} model turns (9 with one noop tool call)",
        "durable_s": durable_times,
        "dbos_s": dbos_times,
        "durable_steps_per_s": steps / d,
        "dbos_steps_per_s": steps / b,
        "dbos_speedup": b / d,
        "dbos_target": f"durable_agents at least {DBOS_TARGET:g}x faster than DBOS",
        "dbos_met": b / d >= DBOS_TARGET,
        "q2": q2,
        "q2_tasks_per_s": q2_n / q2["span_s"],
        "q2_tasks_per_s_wall": q2_n / q2["wall_s"],
        "durable_one_step_s": one,
        "durable_one_step_runs_per_s": q2_n / one_s,
        "durable_one_step_runs_per_s_runagents_wall_incl_start": q2_n / burst_wall,
        "q2_speedup": (q2_n / one_s) / (q2_n / q2["span_s"]),
        "q2_target": "durable_agents throughput at least 3x django-q2's",
    }
    res["q2_met"] = res["q2_speedup"] >= 3
    log(
        f"[peers] DBOS {res['dbos_steps_per_s']:.0f} steps/s vs durable "
        f"{res['durable_steps_per_s']:.0f} steps/s: durable {res['dbos_speedup']:.2f}x faster -> "
        f"{common.verdict(res['dbos_met'])} (>= {DBOS_TARGET:g}x)"
    )
    log(
        f"[peers] one-step runs: django-q2 {res['q2_tasks_per_s']:.1f} tasks/s "
        f"(wall {res['q2_tasks_per_s_wall']:.1f}/s incl. cluster start), durable "
        f"{res['durable_one_step_runs_per_s']:.1f} runs/s (runagents wall incl. start "
        f"{res['durable_one_step_runs_per_s_runagents_wall_incl_start']:.1f}/s): "
        f"{res['q2_speedup']:.2f}x -> {common.verdict(res['q2_met'])} (>= 3x)"
    )
    return res


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=100)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--q2-n", type=int, default=500)
    a = p.parse_args(argv)
    res = run(a.runs, a.reps, a.q2_n)
    return common.finish("peers", res, DB, DBOS_DB)


if __name__ == "__main__":
    if sys.argv[1:2] == ["dbos-child"]:
        base_url, sys_url, runs, reps = sys.argv[2:6]
        dbos_child(base_url, sys_url, int(runs), int(reps))
    else:
        main()
