"""``upgrade_runs`` over a whole agent version: how long moving 10,000 runs in flight takes.

The runs are built directly in the database, in bulk: ``--runs`` pending runs of the ``bench``
agent at version 1 (half of them waiting for a worker that defines their version), each with a
log of three steps (the task, a model turn asking for ``noop``, its result); every
``--thinking-every``-th turn starts with a signed thinking block. Two more versions are defined
in this process: ``roomier`` (another max_tokens: nothing thinking binds changes) and
``reworded`` (another system prompt: thinking binds it).

Printed:

- ``upgrade_runs("bench", "1", "roomier")`` and back, ``--reps`` times each: every run moves,
  no step is read (the binding is unchanged); the target is under 5 s for 10,000 runs;
- ``upgrade_runs("bench", "1", "reworded")`` once: every run's model turns are read (the
  binding changed), the runs with thinking stay, the others move.

PostgreSQL only: the script makes the database ``da_bench_upgrade_runs`` on the server of
``BENCH_PG`` (default ``postgres://root@127.0.0.1:5432``) and drops it at the end::

    python -m bench.upgrade_runs                      # 10,000 runs, 3 reps
    python -m bench.upgrade_runs --runs 2000 --reps 1 # quicker
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from bench import common
from bench.common import log

DB = "da_bench_upgrade_runs"
TARGET_SECONDS = 5.0  # for 10,000 runs whose binding is unchanged


def turn(thinking: bool) -> str:
    content: list[dict[str, Any]] = []
    if thinking:
        content.append({"type": "thinking", "thinking": "Let me call noop.", "signature": "c2ln"})
    content += [
        {"type": "text", "text": "Calling noop."},
        {"type": "tool_use", "id": "toolu_1", "name": "noop", "input": {"key": "k"}},
    ]
    return json.dumps(
        {
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "model": "claude-bench-1",
            "content": content,
            "stop_reason": "tool_use",
            "usage": {"input_tokens": 10, "output_tokens": 5},
        }
    )


def bulk_runs(url: str, n: int, thinking_every: int) -> None:
    """``n`` pending runs of bench@1 and their three steps, in one statement."""
    import psycopg

    from bench.benchapp.agents import bench
    from durable_agents.models.step_partitions import part_of_run

    result = json.dumps([{"type": "tool_result", "tool_use_id": "toolu_1", "content": "ok-k"}])
    every = thinking_every if thinking_every > 0 else n + 1
    with psycopg.connect(url) as conn:
        conn.execute(
            "WITH r AS (INSERT INTO agent_run (id, agent, prompt_version, fingerprint, model,"
            " task, status, attempt, stalled_claims, last_seq, error, waiting_for, lease_until,"
            " created_at, updated_at)"
            f" SELECT {common.TIME_ORDERED_ID_SQL}, 'bench', '1', %(fp)s, %(model)s,"
            " 'Upgrade run ' || g, 'pending', 0, 0, 2, '',"
            " CASE WHEN g %% 2 = 0 THEN 'worker' ELSE '' END,"
            " CASE WHEN g %% 2 = 0 THEN now() + interval '1 hour' END,"
            " clock_timestamp(), now() FROM generate_series(1, %(n)s) AS g"
            " RETURNING id, task)"
            " INSERT INTO agent_step (run_id, seq, part, kind, payload, attempt, worker,"
            f" created_at) SELECT r.id, s.seq, {part_of_run('r.id')}, s.kind,"
            " CASE s.seq WHEN 0 THEN to_json(r.task)::text WHEN 2 THEN %(result)s"
            " ELSE CASE WHEN split_part(r.task, ' ', 3)::int %% %(every)s = 0"
            " THEN %(thought)s ELSE %(plain)s END END, 0, '', now()"
            " FROM r CROSS JOIN (VALUES (0, 'task'), (1, 'model_turn'), (2, 'tool_result'))"
            " AS s(seq, kind)",
            {
                "fp": bench.fingerprint(bench.model),
                "model": bench.model,
                "n": n,
                "result": result,
                "every": every,
                "thought": turn(True),
                "plain": turn(False),
            },
        )
        conn.commit()


def timed(agent: str, old: str, new: str) -> tuple[float, Any]:
    import durable_agents

    started = time.perf_counter()
    report = durable_agents.upgrade_runs(agent, old, new)
    return time.perf_counter() - started, report


def measure(runs: int, thinking_every: int, reps: int, url: str) -> dict[str, Any]:
    from bench.benchapp.agents import bench, noop
    from durable_agents import Agent
    from durable_agents.models import AgentRun

    definition = {
        "name": "bench",
        "model": bench.model,
        "system": bench.system,
        "tools": [noop],
        "max_tokens": bench.max_tokens,
    }
    Agent(**{**definition, "version": "roomier", "max_tokens": 512})
    Agent(**{**definition, "version": "reworded", "system": "You are a reworded agent."})

    started = time.perf_counter()
    bulk_runs(url, runs, thinking_every)
    thinking = sum(1 for g in range(1, runs + 1) if thinking_every > 0 and g % thinking_every == 0)
    log(
        f"{runs:,} pending runs of bench@1 ({runs // 2:,} waiting for a worker), 3 steps each, "
        f"{thinking:,} with signed thinking, built in {time.perf_counter() - started:.1f}s"
    )

    unchanged: list[float] = []
    for _ in range(reps):
        for old, new in (("1", "roomier"), ("roomier", "1")):
            seconds, report = timed("bench", old, new)
            assert not report.refused, report.refused
            assert len(report.upgraded) == runs, len(report.upgraded)
            unchanged.append(seconds)
            log(
                f"upgrade_runs bench {old} -> {new} (binding unchanged): {len(report.upgraded):,} "
                f"moved in {seconds:.2f}s ({runs / seconds:,.0f} runs/s)"
            )
    waiting = AgentRun.objects.filter(waiting_for="worker").count()
    assert waiting == 0, waiting  # the first upgrade made them plainly pending

    changed_seconds, report = timed("bench", "1", "reworded")
    assert len(report.refused) == thinking, len(report.refused)
    log(
        f"upgrade_runs bench 1 -> reworded (system prompt changed, every log read): "
        f"{len(report.upgraded):,} moved, {len(report.refused):,} refused (signed thinking) in "
        f"{changed_seconds:.2f}s"
    )
    median = statistics.median(unchanged)
    scaled = median * 10_000 / runs
    log(
        f"median of {len(unchanged)} (binding unchanged): {median:.2f}s for {runs:,} runs, "
        f"{scaled:.2f}s per 10,000 ({common.verdict(scaled < TARGET_SECONDS)}, goal < "
        f"{TARGET_SECONDS:g} s)"
    )
    return {
        "runs": runs,
        "thinking": thinking,
        "unchanged_seconds": unchanged,
        "unchanged_median_s": median,
        "per_10000_s": scaled,
        "target_met": scaled < TARGET_SECONDS,
        "still_waiting_for_a_worker": waiting,
        "changed_seconds": changed_seconds,
        "changed_moved": len(report.upgraded),
        "changed_refused": len(report.refused),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=10_000)
    parser.add_argument("--thinking-every", type=int, default=10)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    if args.runs < 1 or args.reps < 1:
        parser.error("--runs and --reps are at least 1")
    why = common.postgres_unavailable()
    if why:
        parser.error(why)
    url = common.fresh_db(DB)
    common.setup_django(url)
    try:
        data = measure(args.runs, args.thinking_every, args.reps, url)
        common.write_result("upgrade_runs", data)
    finally:
        from django.db import connections

        connections.close_all()
        common.drop_db(DB)


if __name__ == "__main__":
    main()
