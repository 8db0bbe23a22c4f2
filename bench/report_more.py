"""The sections of docs/benchmarks.md for the benchmarks run_all reaches since r33: priority,
instrumented_commit, debounce, replay, fork, trees_events, live, schedules and failover.
``bench/report.py`` calls ``sections``; each section writes its lines through ``w``.

A section whose JSON this renderer does not know (written by another version of the
benchmark) gets a pointer to the file instead of its figures."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

W = Callable[[str], None]


def _v(ok: bool | None) -> str:
    return "n/a" if ok is None else ("**met**" if ok else "**MISSED**")


def _ms(s: dict[str, Any]) -> str:
    return f"p50 {s['p50_ms']:.2f} ms, p99 {s['p99_ms']:.2f} ms"


def _priority(r: dict[str, Any]) -> list[str]:
    return [
        f"`bench/priority.py`: `claim_runs` in two databases of {r['pending']:,} pending runs, "
        f"one spread over priorities {r['levels']}, one all at 0, in alternating blocks (each "
        f"in a fresh worker-like process: `bench.scale`'s child).",
        "",
        f"Claim with priorities {_ms(r['spread'])}; all at 0 {_ms(r['flat'])}: p99 ratio "
        f"{r['p99_ratio']:.2f} (goal <= 1.2); the claim reads `agent_run_claim_fair` (priority "
        f"first) in order, no Sort: {r['index_in_order']} ({_v(r['met'])}).",
    ]


def _instrumented(r: dict[str, Any]) -> list[str]:
    base = r["bare psycopg cursor"]["p50_ms"]
    lines = [
        "`bench/instrumented_commit.py`: the fenced step commit on one connection, in "
        "alternating blocks: through `binding_cursor()` (Django's cursor wrapper, what ships), "
        "on the bare psycopg cursor, and with an `execute_wrapper` hook installed.",
        "",
        "| path | p50 | p99 | p50 ratio to bare |",
        "| --- | --- | --- | --- |",
    ]
    for name, s in r.items():
        lines.append(
            f"| {name} | {s['p50_ms']:.3f} ms | {s['p99_ms']:.3f} ms | {s['p50_ms'] / base:.3f} |"
        )
    return lines


def _debounce(r: dict[str, Any]) -> list[str]:
    return [
        f"`bench/debounce.py`: {r['calls']:,} `start_run(key=same, debounce={r['debounce_s']:g})`"
        f" from {r['threads']} threads over {r['calls_spread_over_s']:.1f} s, one `runagents` "
        f"polling every {r['poll_interval_s']:g} s.",
        "",
        f"Runs with the key: {r['runs_with_the_key']} (goal 1); the run started "
        f"{r['start_after_last_commit_s']:.2f} s after the last call's commit (goal: "
        f"{r['debounce_s']:g} s plus at most the poll interval); its task is the last call's "
        f"(or an overlapping one's): {r['task_is_one_of_the_overlapping_last_calls']} "
        f"({_v(r['target_met'])}).",
    ]


def _replay(r: dict[str, Any]) -> list[str]:
    worst = max(r["seconds"]) * 1000
    return [
        f"`bench/replay.py`: `durable_agents.testing.replay` of a recorded run of {r['turns']} "
        f"model turns ({r['calls']} tool calls), no model call allowed: slowest of "
        f"{len(r['seconds'])} replays {worst:.0f} ms, {r['queries']} queries "
        f"({_v(worst < 1000)}, goal < 1 s for 200 turns).",
    ]


def _fork(r: dict[str, Any]) -> list[str]:
    added = sum(r["bytes_at_turn"].values())
    parent = sum(r["parent_bytes"].values())
    return [
        f"`bench/fork.py`: a finished run of {r['steps']:,} steps "
        f"({r['payload_bytes'] / 1e6:.1f} MB of payloads) built in bulk, then forked at step "
        f"{r['fork_seq']}.",
        "",
        f"- `fork_run`: p50 {r['fork_p50_ms']:.1f} ms, p95 {r['fork_p95_ms']:.1f} ms;",
        f"- bytes one fork adds: {added:,} (the parent's rows: {parent:,}, ratio "
        f"{added / parent:.5f}); with an edited batch of results "
        f"{sum(r['bytes_with_edit'].values()):,};",
        f"- `load_log` of a fork against its parent's: ratio {r['rebuild_ratio_fork']:.2f} "
        f"(a fork of a fork of a fork: {r['rebuild_ratio_fork3']:.2f}; goal: near 1);",
        f"- `forks.keep_shared_steps` before deleting the parent: "
        f"{r['keep_shared_steps_ms']:.0f} ms, {r['keep_shared_steps_copied']} steps copied.",
    ]


def _upgrade_runs(r: dict[str, Any]) -> list[str]:
    return [
        f"`bench/upgrade_runs.py`: `upgrade_runs` of every run in flight of an agent version, "
        f"{r['runs']:,} runs built in bulk (half waiting for a worker, {r['thinking']:,} with "
        "signed thinking in their log):",
        "",
        f"- to a version whose binding is unchanged: median {r['unchanged_median_s']:.2f} s "
        f"of {len(r['unchanged_seconds'])}, {r['per_10000_s']:.2f} s per 10,000 runs "
        f"({_v(r['target_met'])}, goal < 5 s);",
        f"- to a version with another system prompt (every log read): {r['changed_seconds']:.2f} "
        f"s, {r['changed_moved']:,} moved, {r['changed_refused']:,} refused (signed thinking).",
    ]


def _trees_events(r: dict[str, Any]) -> list[str]:
    c, e = r["cancel"], r["event"]
    return [
        f"`bench/trees_events.py`: `cancel_run` of a tree of {c['tree_runs']:,} runs "
        f"({r['generations']} generations of {r['fanout']} children): {c['total_s']:.2f} s in "
        f"all, its longest transaction {c['longest_transaction_s'] * 1000:.0f} ms, "
        f"{c['not_cancelled']} runs left uncancelled. `send_event` of "
        f"{e['payload_bytes'] / 2**20:.0f} MB to {e['waiters']} waiting runs: agent_run and "
        f"agent_event grew by {e['tables_grew_bytes'] / 2**20:.1f} MB (the payload once, not "
        f"once per run).",
    ]


def _live(r: dict[str, Any]) -> list[str]:
    lat, live = r["live"]["latency"], r["live"]
    return [
        f"`bench/live.py`: {r['readers']:,} readers (`durable_agents.live.stream`) of "
        f"{r['runs']} live runs of {r['turns']} turns in one asyncio process, the model "
        f"answering in {r['model_latency_s']} s; the same workload without readers side by "
        f"side.",
        "",
        f"- step commit to reader: p50 {lat['p50_ms']:.0f} ms, p99 {lat['p99_ms']:.0f} ms "
        f"({_v(r['met_latency'])}, p99 < 250 ms);",
        f"- connections of the readers' process: at most {live['peak_connections']} "
        f"({_v(r['met_connections'])}, <= 2);",
        f"- readers that went away and resumed: missed {live['resume_missed']}, twice "
        f"{live['resume_twice']} ({_v(r['met_resume'])});",
        f"- the worker alone / with the readers: {r['slowdown']:.3f}x "
        f"({_v(r['met_throughput'])}, <= 1.1x).",
    ]


def _live_readers(r: dict[str, Any]) -> list[str]:
    page = r["admin_page_ms"]
    return [
        f"`bench/live_readers.py`: {r['readers']:,} readers through the events view under "
        f"uvicorn (token holders and staff sessions), caps raised to admit them; "
        f"{r['served']:,} served in {r['seconds_to_admit_all']} s.",
        "",
        f"- database connections while they read: {r['backends_peak_while_reading']} "
        f"(target at most 2), with admin pages served beside them: "
        f"{r['backends_peak_with_admin_pages']}, after they left: "
        f"{r['backends_after_readers_left']};",
        f"- an admin page while they read: p50 {page['p50_ms']} ms, p95 {page['p95_ms']} ms "
        f"(target under 200 ms);",
        f"- readers past the cap answered 503 with Retry-After: "
        f"{r['over_cap_refused_503_retry_after']} of {r['over_cap']}.",
    ]


def _schedules(r: dict[str, Any]) -> list[str]:
    lines = ["`bench/schedules.py`:", ""]
    if r.get("chaos"):
        c = r["chaos"]
        lines.append(
            f"- chaos: a schedule every {c['every_s']:g} s for {c['duration_s']:.0f} s, "
            f"{c['workers']} workers, {c['kills']} SIGKILLed: {c['slots']} slots, {c['runs']} "
            f"runs, runs per slot {c['runs_per_slot']}, {c['missed']} missed; slot to run "
            f"created p95 {c['created_p95_ms']:.0f} ms ({_v(c['met'])}: one run a slot, none "
            f"missed, p95 < 1 s);"
        )
    if r.get("scale"):
        s = r["scale"]
        lines.append(
            f"- scale: {s['schedules']:,} schedules, {s['due_per_second']} due a second, "
            f"{s['pending_runs']:,} pending runs: claim {_ms(s['claim_firing'])} firing, "
            f"{_ms(s['claim_not_firing'])} not: p99 ratio {s['p99_ratio']:.2f} "
            f"({_v(s['met'])}, <= 1.2); statements on agent_schedule per firing "
            f"{s['schedule_statements_per_firing']}."
        )
    return lines


def _failover(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "`bench/failover.py`: a private PostgreSQL cluster (tests/pgcluster.py), the slow fake "
        "API and two `runagents`; once a third of the turns were answered the database is cut "
        "(`restart`: a crash and recovery; `outage`: stopped for a while). Paid turns asked "
        "again, and how long after the database was back the fleet resumed. run_all skips it "
        "where the server binaries or the postgres OS user are missing.",
        "",
        "| side | scenario | turns asked again | extra answers | answered | resumed after |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for x in rows:
        lines.append(
            f"| {x['label']} | {x['scenario']} | {x['turns_reasked']} | {x['extra_answers']} "
            f"| {x['answered']} | {x['resumed_after_s']} s |"
        )
    return lines


SECTIONS: tuple[tuple[str, str, Callable[[Any], list[str]]], ...] = (
    ("priority", "Run priorities", _priority),
    ("instrumented_commit", "The step commit through Django's cursor", _instrumented),
    ("debounce", "Debounced starts", _debounce),
    ("replay", "Replay of a recorded run", _replay),
    ("fork", "Forks of a long run", _fork),
    ("upgrade_runs", "Upgrades of the runs of a version", _upgrade_runs),
    ("trees_events", "A big tree's cancel, a big event", _trees_events),
    ("live", "Live streams", _live),
    ("live_readers", "Live readers through the view", _live_readers),
    ("schedules", "Agent schedules", _schedules),
    ("failover", "The database cut in a burst", _failover),
)
NAMES = tuple(name for name, _, _ in SECTIONS)


def sections(w: W, r: dict[str, Any]) -> None:
    """The sections of the benchmarks in ``r`` (name -> its JSON), in SECTIONS' order."""
    for name, title, build in SECTIONS:
        if not r.get(name):
            continue
        try:
            lines = build(r[name])
        except (KeyError, TypeError, ValueError, IndexError, ZeroDivisionError, AttributeError):
            lines = [
                f"Its figures are in `bench/out/{name}.json` (this renderer does not know them)."
            ]
        w(f"## {title}")
        w("")
        for line in lines:
            w(line)
        w("")
