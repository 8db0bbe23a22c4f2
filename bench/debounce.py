"""Debounced starts: 1,000 ``start_run(key=same, debounce=5)`` from 10 threads over 3 s make
one run, started 5 s after the last call, with the last call's task.

A real worker (``manage.py runagents`` in its own process, against the zero-latency fake
Messages API of ``bench.fakeapi``) is started first and polls the database every
``--poll-interval`` seconds (default: 1.0, the product's POLL_INTERVAL default; the claim of
a due wait comes from polling, not from a notification). Then 10 threads, each with its own
database connection, call ``durable_agents.start_run("bench", task, key=..., debounce=5)``
100 times each, on a fixed schedule spread evenly over 3 s (call n, of 1,000, at n * 3 ms;
thread n % 10 makes it), each task naming its call. Once the worker has run the run to its
end, the benchmark reports:

- runs: the number of runs with the key (target: 1) and of runs in the database;
- the delay between the last call and the start: the run's ``started_at`` (its claim, on the
  database clock) minus the last call's commit (its ``waiting_since``, which each call that
  pushes the window sets, on the same clock), and minus the moment the last call returned to
  its thread (the client clock; same machine); target: 5 s, plus at most the poll interval
  (and the claim's own time);
- whether the run's task, and the task step the model was sent, are the last call's: the
  call that returned last, or, as concurrent calls commit in any order, one that overlapped
  it; strictly, no call began after the call whose task the run has returned.

    python -m bench.debounce                      # about 15 s
    python -m bench.debounce --poll-interval 0.05

PostgreSQL only (``BENCH_PG``); it creates and drops the database ``da_bench_debounce``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import threading
import time
from typing import Any

from bench import common
from bench.common import log

DB = "da_bench_debounce"
KEY = "ticket:bench"
LOGFILE = common.OUT / "debounce_worker.log"


def call_all(calls: int, threads: int, over: float, debounce: float) -> list[dict[str, Any]]:
    """``calls`` debounced starts from ``threads`` threads, call n at ``n * over / calls`` s
    from the start; each call's task, thread, and when it was made and returned (time.time)."""
    from django.db import connections

    import durable_agents

    made: list[dict[str, Any]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    barrier = threading.Barrier(threads)
    start_at: list[float] = []

    def caller(thread: int) -> None:
        try:
            barrier.wait(30)
            if thread == 0:
                start_at.append(time.perf_counter())
            while not start_at:
                time.sleep(0.0005)
            for n in range(thread, calls, threads):
                delay = start_at[0] + n * over / calls - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                task = f"Summarise ticket bench as of call {n} (thread {thread})."
                called = time.time()
                run = durable_agents.start_run("bench", task, key=KEY, debounce=debounce)
                returned = time.time()
                with lock:
                    made.append(
                        {"n": n, "task": task, "run": run.pk, "called": called, "at": returned}
                    )
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            connections.close_all()

    workers = [threading.Thread(target=caller, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if errors:
        raise errors[0]
    return made


def wait_for_end(run_id: Any, limit: float) -> Any:
    from durable_agents.models import AgentRun

    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        run = AgentRun.objects.get(pk=run_id)
        if run.is_finished or run.status == "dead":
            return run
        time.sleep(0.05)
    raise RuntimeError(f"run {run_id} did not end within {limit} s; see {LOGFILE}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=1000)
    p.add_argument("--threads", type=int, default=10)
    p.add_argument("--over", type=float, default=3.0, help="seconds the calls are spread over")
    p.add_argument("--debounce", type=float, default=5.0)
    p.add_argument("--poll-interval", type=float, default=1.0)
    a = p.parse_args(argv)

    url = common.fresh_db(DB)
    common.OUT.mkdir(parents=True, exist_ok=True)
    try:
        with common.fake_api() as base_url:
            common.setup_django(url, base_url)
            worker = common.runagents(
                url,
                base_url,
                "--concurrency",
                "4",
                "--poll-interval",
                str(a.poll_interval),
                log=LOGFILE,
            )
            try:
                time.sleep(2)  # the worker is up and polling (an empty queue meanwhile)
                if worker.poll() is not None:
                    raise RuntimeError(f"the worker exited at start; see {LOGFILE}")
                made = call_all(a.calls, a.threads, a.over, a.debounce)
                result = report(made, a)
            finally:
                code = common.stop(worker, 10)
            result["worker_exit_code"] = code
    finally:
        from django.db import connections

        connections.close_all()
        common.drop_db(DB)
    common.write_result("debounce", result)
    return result


def report(made: list[dict[str, Any]], a: argparse.Namespace) -> dict[str, Any]:
    from durable_agents.models import AgentRun, AgentStep

    made.sort(key=lambda call: call["at"])
    last = made[-1]
    # The calls that returned after the last one was made: any of them may have committed
    # last (their transactions overlapped).
    overlapping = [c for c in made if c["at"] >= last["called"]]
    ids = {c["run"] for c in made}
    run = wait_for_end(last["run"], a.debounce + a.poll_interval + 60)
    step = json.loads(AgentStep.objects.get(run_id=run.pk, seq=0).payload)
    last_returned = datetime.datetime.fromtimestamp(last["at"], tz=datetime.UTC)
    result = {
        "calls": len(made),
        "threads": a.threads,
        "calls_spread_over_s": round(made[-1]["at"] - min(c["called"] for c in made), 3),
        "debounce_s": a.debounce,
        "poll_interval_s": a.poll_interval,
        "runs_returned": len(ids),
        "runs_with_the_key": AgentRun.objects.filter(start_key=KEY).count(),
        "runs_in_the_database": AgentRun.objects.count(),
        "status": run.status,
        "attempt": run.attempt,
        # Both on the database clock: the claim, and the last call's commit.
        "start_after_last_commit_s": round((run.started_at - run.waiting_since).total_seconds(), 3),
        # The claim on the database clock, the last call's return on this process's clock.
        "start_after_last_return_s": round((run.started_at - last_returned).total_seconds(), 3),
        "last_call": last["n"],
        "calls_overlapping_the_last": len(overlapping),
        # The last call to return; calls that overlap it may commit after it.
        "task_is_the_last_returned_calls": run.task == last["task"],
        "task_is_one_of_the_overlapping_last_calls": run.task in {c["task"] for c in overlapping},
        # Whether the run's task is a last call's, strictly: no call began after the call
        # whose task the run carries had returned (such a call would have come later).
        "no_call_began_after_the_winning_call_returned": not any(
            c["called"] > winner["at"]
            for c in made
            for winner in made
            if winner["task"] == run.task
        ),
        "task_step_is_the_runs_task": step == run.task,
        "run_task": run.task,
    }
    delay = result["start_after_last_commit_s"]
    result["target_met"] = (
        result["runs_with_the_key"] == 1
        and result["no_call_began_after_the_winning_call_returned"]
        and step == run.task
        and a.debounce <= delay <= a.debounce + a.poll_interval + 0.5
    )
    for name, value in result.items():
        log(f"{name:45} {value}")
    log("target:", common.verdict(result["target_met"]))
    return result


if __name__ == "__main__":
    main()
