"""The CPU of one resume: a parked run woken, its wait's call answered, one more model turn,
its end, in one worker slot.

In this process: ``--runs`` runs of the ``bench_wait`` agent (bench/waits.py) park on one event
through a real tool call (a worker of four slots, not timed); ``send_event`` wakes them; then
``Worker(concurrency=1, burst=True)`` resumes them one after another, each claimed by the last
commit of the one before (as a busy slot claims), against the zero-latency fake Messages API in
its own process. Printed: this process's CPU time (all its threads: the slot, its caller
thread, the heartbeat, the listener) and the wall time, per resume. ``--profile`` runs the
resume under yappi (CPU clock, every thread; yappi must be installed) and writes the functions
by total and by own time to bench/out/resume_profile_*.txt; its figures are yappi's, several
times the unprofiled ones. ``BENCH_PYSPY=DIR`` samples the timed part alone with py-spy instead
(``DIR/resume.txt``, collapsed stacks; py-spy must be installed): close to the unprofiled
figures, and where the CPU goes outside Python functions too.

One slot on purpose: the figure is the work of a resume, without the thread switching of a
thousand slots (``python -m bench.waits`` measures the burst). Compare two commits side by
side, alternating, in one session (a worktree and ``PYTHONPATH``): this machine's speed drifts.

    python -m bench.resume                 # 200 runs, about 30 s on 2 CPUs
    python -m bench.resume --runs 500 --profile
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from typing import Any

from bench import common
from bench.common import log

DB = "da_bench_resume"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=200)
    p.add_argument("--profile", action="store_true", help="under yappi (slower: its figures)")
    p.add_argument("--keep", action="store_true", help="keep the database")
    a = p.parse_args(argv)
    skipped = common.postgres_unavailable()
    if skipped:
        log("resume", skipped)
        return common.finish("resume", {"skipped": skipped})
    url = common.fresh_db(DB)
    with common.fake_api() as base_url:
        common.setup_django(url, base_url)
        data = _measure(a.runs, a.profile)
    log(
        "resume",
        f"{a.runs} runs woken by one event, resumed by one slot: "
        f"{data['cpu_ms_per_resume']:.3f} ms of CPU and {data['wall_ms_per_resume']:.3f} ms "
        f"of wall time a resume{' (under yappi)' if a.profile else ''}",
    )
    return common.finish("resume", data, DB, keep=a.keep)


def _measure(runs: int, profile: bool) -> dict[str, Any]:
    from django.db import connection

    import durable_agents
    from bench import waits
    from durable_agents.engine.worker import Worker
    from durable_agents.models import AgentRun, RunStatus

    for i in range(runs):
        durable_agents.start_run("bench_wait", waits.wait_task("Resume", i, "resume"))
    Worker(concurrency=4, burst=True, handle_signals=False, poll_interval=0.05).run()
    parked = AgentRun.objects.filter(status=RunStatus.WAITING).count()
    if parked != runs:
        raise RuntimeError(f"only {parked}/{runs} runs parked")
    durable_agents.send_event("resume", {"bench": "resume"})
    connection.close()
    worker = Worker(concurrency=1, burst=True, handle_signals=False, poll_interval=0.05)
    if profile:
        import yappi

        yappi.set_clock_type("cpu")
        yappi.start()
    spy = waits.py_spy(os.getpid(), "resume")
    cpu, wall = time.process_time(), time.perf_counter()
    worker.run()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    if spy is not None:
        spy.send_signal(signal.SIGINT)  # py-spy writes what it sampled and ends
        spy.wait()
    if profile:
        yappi.stop()
        _write_profile(yappi)
    ended = AgentRun.objects.filter(status=RunStatus.SUCCEEDED).count()
    if ended != runs:
        raise RuntimeError(f"only {ended}/{runs} runs ended")
    return {
        "runs": runs,
        "profiled": profile,
        "cpu_ms_per_resume": 1000 * cpu / runs,
        "wall_ms_per_resume": 1000 * wall / runs,
    }


def _write_profile(yappi: Any) -> None:
    common.OUT.mkdir(parents=True, exist_ok=True)
    columns = {0: ("name", 100), 1: ("ncall", 10), 2: ("ttot", 9), 3: ("tsub", 9)}
    stats = yappi.get_func_stats()
    for order in ("ttot", "tsub"):
        stats.sort(order)
        with open(common.OUT / f"resume_profile_{order}.txt", "w") as out:
            stats.print_all(out=out, columns=columns)


if __name__ == "__main__":
    main()
