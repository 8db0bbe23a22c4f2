"""Forks of a long run: the time of ``fork_run`` at a late step, the bytes a fork adds, the
rebuild of a fork's log against its parent's, and what retention would pay to keep a fork.

The parent is built directly in the database, in bulk: a finished run of the ``bench_long``
agent with ``--steps`` steps (2,000: the task, then model turns and tool results in turn, the
last a final answer) and about 20 MB of payloads. Each model turn is the message body as the
worker records it (~10 KB: a text block of prose and one ``noop`` call, its content array's
span in ``content_start``/``content_end``), each tool result batch ~10 KB, and each call has
its ``tool_effect`` row.

Printed:

- ``fork_run`` at the model turn before the final answer (its recorded call is inherited),
  ``--forks`` times: median and p95;
- the bytes of the rows one fork adds (``pg_column_size`` of its ``agent_run`` row, its
  ``agent_step_share`` rows, its ``agent_step`` rows and its ``tool_effect`` rows), for a fork
  at that model turn and for one with an edited batch of tool results, against the parent's;
- ``history.load_log`` of a fork (and of a fork of a fork of a fork) against the parent's, on
  fresh connections, interleaved: medians and the ratio;
- ``forks.keep_shared_steps([parent])`` with one fork reading the parent (what retention does
  before deleting the parent), in a transaction rolled back afterwards.

PostgreSQL only: the script makes the database ``da_bench_fork`` on the server of ``BENCH_PG``
(default ``postgres://root@127.0.0.1:5432``) and drops it at the end::

    python -m bench.fork                     # 2,000 steps, 20 forks, 15 rebuilds each
    python -m bench.fork --steps 500 --forks 10 --reps 5   # quicker
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
import uuid
from typing import Any

from bench import common
from bench.common import log

DB = "da_bench_fork"
TURN_BYTES = 10_000  # a model turn's body, about
RESULT_BYTES = 10_000  # a batch of tool results, about
LETTERS = "etaoinshrdlucmfwypvbgkjqxz"


def vocabulary(rng: random.Random, size: int = 3000) -> list[str]:
    """Words of 2 to 10 letters, more frequent letters more often: text that compresses about
    as prose does (pglz finds far fewer repeats than in one repeated character)."""
    weights = [len(LETTERS) - i for i in range(len(LETTERS))]
    return ["".join(rng.choices(LETTERS, weights, k=rng.randint(2, 10))) for _ in range(size)]


WORDS = vocabulary(random.Random(1))


def prose(rng: random.Random, size: int) -> str:
    """About ``size`` characters of words."""
    words: list[str] = []
    length = 0
    while length < size:
        word = rng.choice(WORDS)
        words.append(word)
        length += len(word) + 1
    return " ".join(words)


def turn_row(rng: random.Random, seq: int, final: bool) -> tuple[str, int, int]:
    """A model turn's payload and its content span, as the worker records it: the message body,
    with the content array at characters [start, end)."""
    content: list[dict[str, Any]] = [{"type": "text", "text": prose(rng, TURN_BYTES - 400)}]
    if not final:
        content.append(
            {
                "type": "tool_use",
                "id": f"toolu_{seq:08d}",
                "name": "noop",
                "input": {"key": f"k{seq}"},
            }
        )
    head = (
        f'{{"id": "msg_{seq:08d}", "type": "message", "role": "assistant", '
        f'"model": "claude-bench-1", "content": '
    )
    array = json.dumps(content, ensure_ascii=False)
    tail = (
        f', "stop_reason": "{"end_turn" if final else "tool_use"}", "stop_sequence": null, '
        '"usage": {"input_tokens": 1200, "output_tokens": 2400}}'
    )
    return head + array + tail, len(head), len(head) + len(array)


def result_text(rng: random.Random, seq: int) -> str:
    return f"ok-k{seq} " + prose(rng, RESULT_BYTES - 200)


def build_parent(steps: int) -> uuid.UUID:
    """A finished run of ``steps`` steps (an even number: the last is a final answer), inserted
    in bulk; its id."""
    from django.db import transaction
    from django.utils import timezone

    from bench.benchapp.agents import bench_long
    from durable_agents._internal.text import json_text
    from durable_agents.models import AgentRun, AgentStep, RunStatus, StepKind, ToolEffect

    rng = random.Random(7)
    task = "A long benchmark run."
    now = timezone.now()
    run = AgentRun(
        agent=bench_long.name,
        prompt_version=bench_long.version,
        fingerprint=bench_long.fingerprint(bench_long.model),
        model=bench_long.model,
        task=task,
        status=RunStatus.SUCCEEDED,
        attempt=1,
        last_seq=steps - 1,
        result="done",
        started_at=now,
        finished_at=now,
    )
    rows = [AgentStep(run=run, seq=0, kind=StepKind.TASK, payload=json.dumps(task))]
    calls: list[ToolEffect] = []
    for seq in range(1, steps):
        if seq % 2:  # a model turn
            payload, start, end = turn_row(rng, seq, final=seq == steps - 1)
            rows.append(
                AgentStep(
                    run=run,
                    seq=seq,
                    kind=StepKind.MODEL_TURN,
                    payload=payload,
                    content_start=start,
                    content_end=end,
                    request_id=f"req_{seq:08d}",
                    attempt=1,
                    worker="bench",
                )
            )
        else:  # the results of the turn before
            text = result_text(rng, seq - 1)
            block = {"type": "tool_result", "tool_use_id": f"toolu_{seq - 1:08d}", "content": text}
            rows.append(
                AgentStep(
                    run=run,
                    seq=seq,
                    kind=StepKind.TOOL_RESULT,
                    payload=json_text([block]),
                    attempt=1,
                    worker="bench",
                )
            )
            calls.append(
                ToolEffect(
                    key=uuid.uuid4().hex + uuid.uuid4().hex,
                    run=run,
                    seq=seq - 1,
                    call_index=0,
                    tool="noop",
                    result=text,
                )
            )
    with transaction.atomic():
        run.save(force_insert=True)
        AgentStep.objects.bulk_create(rows, batch_size=200)
        ToolEffect.objects.bulk_create(calls, batch_size=500)
    return run.pk


def row_bytes(sql: str, run_id: uuid.UUID) -> int:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(sql, [run_id])
        return int(cursor.fetchone()[0] or 0)


def bytes_of(run_id: uuid.UUID) -> dict[str, int]:
    """The bytes of a run's rows in each table (``pg_column_size`` of each whole row)."""
    return {
        "agent_run": row_bytes(
            "SELECT sum(pg_column_size(r.*)) FROM agent_run r WHERE id = %s", run_id
        ),
        "agent_step_share": row_bytes(
            "SELECT sum(pg_column_size(h.*)) FROM agent_step_share h WHERE fork_id = %s", run_id
        ),
        "agent_step": row_bytes(
            "SELECT sum(pg_column_size(s.*)) FROM agent_step s WHERE run_id = %s", run_id
        ),
        "tool_effect": row_bytes(
            "SELECT sum(pg_column_size(e.*)) FROM tool_effect e WHERE run_id = %s", run_id
        ),
    }


def payload_bytes(run_id: uuid.UUID) -> int:
    """The payloads of the run's own steps, uncompressed (octet_length)."""
    return row_bytes("SELECT sum(octet_length(payload)) FROM agent_step WHERE run_id = %s", run_id)


def timed_rebuilds(ids: dict[str, uuid.UUID], reps: int) -> dict[str, list[float]]:
    """``load_log`` of each run, ``reps`` rounds, interleaved, each on a fresh connection."""
    from django.db import connection

    from durable_agents.engine.history import load_log

    seconds: dict[str, list[float]] = {name: [] for name in ids}
    for _ in range(reps):
        for name, run_id in ids.items():
            connection.close()
            connection.ensure_connection()
            started = time.perf_counter()
            load_log(run_id)
            seconds[name].append(time.perf_counter() - started)
    return seconds


def measure(steps: int, forks: int, reps: int) -> dict[str, Any]:
    from django.db import transaction

    from durable_agents.api import fork_run
    from durable_agents.engine.history import load_log
    from durable_agents.forks import planning as fork_logic
    from durable_agents.models import AgentStep, steps_of

    started = time.perf_counter()
    parent = build_parent(steps)
    parent_payloads = payload_bytes(parent)
    log(
        f"parent: {steps} steps, {parent_payloads / 1e6:.1f} MB of payloads, built in "
        f"{time.perf_counter() - started:.1f}s"
    )
    late = steps - 3  # the model turn before the final answer: its call is recorded

    # One fork reading the parent: what retention would copy into it.
    kept = fork_run(parent, late)
    with transaction.atomic():
        started = time.perf_counter()
        copied = fork_logic.keep_shared_steps([parent])
        keep_seconds = time.perf_counter() - started
        transaction.set_rollback(True)
    log(
        f"retention with one fork reading the parent: keep_shared_steps copies {copied} steps "
        f"in {keep_seconds * 1000:.0f} ms (rolled back)"
    )

    fork_seconds: list[float] = []
    made = []
    for _ in range(forks):
        started = time.perf_counter()
        made.append(fork_run(parent, late))
        fork_seconds.append(time.perf_counter() - started)
    summary = common.summary_ms(fork_seconds)
    p95 = common.pct([s * 1000 for s in fork_seconds], 95)
    log(
        f"fork_run at step {late} of {steps}: median {summary['p50_ms']:.1f} ms, "
        f"p95 {p95:.1f} ms, max {summary['max_ms']:.1f} ms ({forks} forks)"
    )

    at_turn = bytes_of(made[0].pk)
    last_results = AgentStep.objects.get(run_id=parent, seq=late - 1)
    [block] = json.loads(last_results.payload)
    edited = fork_run(parent, late - 1, edit=[{**block, "content": "an edited result"}])
    with_edit = bytes_of(edited.pk)
    parent_bytes = bytes_of(parent)
    for name, sizes in (("at the model turn", at_turn), ("with an edited result", with_edit)):
        log(
            f"bytes one fork adds ({name}): {sum(sizes.values())} "
            + "("
            + ", ".join(f"{table} {size}" for table, size in sizes.items())
            + f"); the parent's rows: {sum(parent_bytes.values()) / 1e6:.1f} MB, ratio "
            f"{sum(sizes.values()) / sum(parent_bytes.values()):.5f}"
        )

    # A fork of a fork of a fork: its log reads three stretches.
    deep = made[1]
    for _ in range(2):
        deep = fork_run(deep.pk, late)
    assert steps_of(deep.pk).count() == late + 1
    assert len(load_log(deep.pk).conversation) == len(load_log(parent).conversation) - 2

    rebuilds = timed_rebuilds({"parent": parent, "fork": made[2].pk, "fork^3": deep.pk}, reps)
    medians = {name: statistics.median(values) for name, values in rebuilds.items()}
    log(
        f"load_log, median of {reps} on fresh connections: parent ({steps} steps) "
        f"{medians['parent'] * 1000:.1f} ms, fork ({late + 1} steps, 1 stretch) "
        f"{medians['fork'] * 1000:.1f} ms (ratio {medians['fork'] / medians['parent']:.2f}), "
        f"fork of a fork of a fork (3 stretches) {medians['fork^3'] * 1000:.1f} ms "
        f"(ratio {medians['fork^3'] / medians['parent']:.2f}); target: ratio near 1"
    )
    return {
        "steps": steps,
        "payload_bytes": parent_payloads,
        "fork_seq": late,
        "fork_seconds": fork_seconds,
        "fork_p50_ms": summary["p50_ms"],
        "fork_p95_ms": p95,
        "bytes_at_turn": at_turn,
        "bytes_with_edit": with_edit,
        "parent_bytes": parent_bytes,
        "rebuild_seconds": rebuilds,
        "rebuild_ratio_fork": medians["fork"] / medians["parent"],
        "rebuild_ratio_fork3": medians["fork^3"] / medians["parent"],
        "keep_shared_steps_ms": keep_seconds * 1000,
        "keep_shared_steps_copied": copied,
        "kept_fork": str(kept.pk),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--forks", type=int, default=20)
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    if args.steps % 2 or args.steps < 6:
        parser.error("--steps is an even number, at least 6")
    common.setup_django(common.fresh_db(DB))
    try:
        common.write_result("fork", measure(args.steps, args.forks, args.reps))
    finally:
        from django.db import connections

        connections.close_all()
        common.drop_db(DB)


if __name__ == "__main__":
    main()
