"""Replay of a long recorded run: the time and the queries of ``durable_agents.testing.replay``.

A run of ``--turns`` model turns (one pure ``noop`` call per turn but the last) is recorded with
the offline model, then replayed to today's tool code. The replay must make no model call: a
client factory that raises is configured around it. Target: under 1 s for 200 turns.

    python -m bench.replay          # on a fresh da_bench_replay database, dropped at the end
"""

from __future__ import annotations

import argparse
import time
from typing import Any, NoReturn

from bench import common
from bench.common import log

DB = "da_bench_replay"


def no_client() -> NoReturn:
    raise AssertionError("the replay created a model client")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    common.setup_django(common.fresh_db(DB))
    try:
        measure(args.turns, args.repeat)
    finally:
        from django.db import connections

        connections.close_all()
        common.drop_db(DB)


def measure(turns: int, repeat: int) -> None:

    from django.db import connection
    from django.test import override_settings
    from django.test.utils import CaptureQueriesContext

    from durable_agents import llm
    from durable_agents.testing import replay, run_agent

    task = common.task_text(0, turns)
    started = time.perf_counter()
    recorded = run_agent("bench_long", task)
    log(f"recorded {recorded.run.last_seq} steps in {time.perf_counter() - started:.2f}s")
    assert recorded.status == "succeeded", recorded.error

    seconds: list[float] = []
    queries = 0
    report: Any = None
    with override_settings(
        DURABLE_AGENTS={"OFFLINE": False, "CLIENT_FACTORY": f"{__name__}.no_client"}
    ):
        llm.reset_clients()
        for _ in range(repeat):
            with CaptureQueriesContext(connection) as captured:
                started = time.perf_counter()
                report = replay(recorded.run.pk)
                seconds.append(time.perf_counter() - started)
            queries = len(captured)
    assert report is not None
    assert report.ok, str(report)
    summary = common.summary_ms(seconds)
    log(
        f"replay of {turns} turns ({report.calls} calls, {report.matches} same): "
        f"median {summary['p50_ms']:.1f} ms, max {max(seconds) * 1000:.1f} ms, {queries} queries, "
        f"target < 1000 ms: {common.verdict(max(seconds) < 1.0)}"
    )
    common.write_result(
        "replay",
        {"turns": turns, "calls": report.calls, "seconds": seconds, "queries": queries},
    )


if __name__ == "__main__":
    main()
