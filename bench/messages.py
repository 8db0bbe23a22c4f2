"""A run's inbox (``send_message``): what the worker's look at the inbox costs before each model
call, with a large ``agent_message`` table, and what a send and a fold cost.

``--runs`` runs (default 2,000) are started through the public API; each gets ``--folded``
messages (default 50) already folded (bulk-loaded: the history of a busy product), and every
tenth run one message waiting. Then, on one connection:

- probe: ``Store.has_waiting_messages`` of every run (what a worker asks before each model
  call): its latency, for the runs with nothing waiting and those with a message waiting;
- send: ``send_message`` to ``--sends`` runs (default 500), a fresh message each;
- fold: a claim of each such run, then the fold (``Store.fold_messages``: the fenced step and
  the rows marked folded, one transaction).

Target: the probe reads the partial index ``agent_message_waiting`` (its plan is printed) and
its median is under 1 ms: a round trip, nothing that grows with the messages stored (the p99
is printed too; on a shared machine it is the neighbours' noise).

    python -m bench.messages              # about 30 s
    python -m bench.messages --runs 500

PostgreSQL only (``BENCH_PG``); it creates and drops the database ``da_bench_messages``.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from bench import common
from bench.common import log

DB = "da_bench_messages"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2000)
    parser.add_argument("--folded", type=int, default=50)
    parser.add_argument("--sends", type=int, default=500)
    a = parser.parse_args(argv)
    if (why := common.postgres_unavailable()) is not None:
        raise SystemExit(why)
    url = common.fresh_db(DB)
    try:
        common.setup_django(url)
        result = measure(a)
    finally:
        from django.db import connections

        connections.close_all()
    return common.finish("messages", result, DB)


def measure(a: argparse.Namespace) -> dict[str, Any]:
    import durable_agents
    from durable_agents.models import AgentMessage, StepKind
    from durable_agents.store import current
    from durable_agents.store.base import StepWrite

    store = current()
    run_ids = common.start_runs(a.runs)
    AgentMessage.objects.bulk_create(
        (
            AgentMessage(run_id=run_id, text=f"an old message {i}", folded_seq=i + 1)
            for run_id in run_ids
            for i in range(a.folded)
        ),
        batch_size=10_000,
    )
    waiting = set(run_ids[::10])
    for run_id in waiting:
        durable_agents.send_message(run_id, "a message waiting")
    log(f"{len(run_ids)} runs, {AgentMessage.objects.count()} messages, {len(waiting)} waiting")

    plan = probe_plan(run_ids[1])
    log("probe plan:", plan)
    empty: list[float] = []
    full: list[float] = []
    for run_id in run_ids:
        started = time.perf_counter()
        found = store.has_waiting_messages(run_id)
        (full if found else empty).append(time.perf_counter() - started)
        assert found == (run_id in waiting)
    probe = {"nothing_waiting": common.summary_ms(empty), "waiting": common.summary_ms(full)}
    log("probe", probe)

    targets = [r for r in run_ids if r not in waiting][: a.sends]
    sends: list[float] = []
    for run_id in targets:
        started = time.perf_counter()
        durable_agents.send_message(run_id, "Also check the March invoice.")
        sends.append(time.perf_counter() - started)
    log("send", common.summary_ms(sends))

    folds: list[float] = []
    for run_id in targets:
        claim = store.claim_run(run_id, "bench", 60)
        assert claim is not None
        messages = store.waiting_messages(run_id)
        step = StepWrite(1, StepKind.MESSAGE, '[{"type":"text","text":"x"}]')
        started = time.perf_counter()
        assert store.fold_messages(claim, step, [m.pk for m in messages])
        folds.append(time.perf_counter() - started)
    log("fold", common.summary_ms(folds))
    met = "agent_message_waiting" in plan and probe["nothing_waiting"]["p50_ms"] < 1.0
    log("target:", common.verdict(met))
    return {
        "runs": len(run_ids),
        "messages": a.runs * a.folded + len(waiting),
        "probe": probe,
        "probe_plan": plan,
        "send": common.summary_ms(sends),
        "fold": common.summary_ms(folds),
        "target_met": met,
    }


def probe_plan(run_id: Any) -> str:
    """The plan of the worker's look at the inbox, as the ORM sends it."""
    from django.db import connection

    from durable_agents.models import AgentMessage

    query = AgentMessage.objects.filter(run_id=run_id, folded_seq__isnull=True)
    sql, params = query.values("id")[:1].query.sql_with_params()
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN " + sql, params)
        return " / ".join(row[0].strip() for row in cursor.fetchall())


if __name__ == "__main__":
    main()
