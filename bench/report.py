# ruff: noqa: E501 - a renderer of long Markdown lines
"""Render bench/out/*.json into docs/benchmarks.md and docs/img/bench_*.png."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any, NamedTuple

from bench import common
from bench.encryption import section as encryption_section
from bench.peers import DBOS_TARGET
from bench.report_fleet import keys_crash_section, quota_section
from bench.report_more import NAMES as MORE_NAMES
from bench.report_more import sections as more_sections

DOCS = common.ROOT / "docs"
IMG = DOCS / "img"


class FrozenInflight(NamedTuple):
    """One size of the in-flight benchmark for a side that no longer runs."""

    inflight: int
    wall_s: float
    ideal_s: float
    ratio_to_loop: float
    ratio_to_ideal: float
    peak_pg_connections: int
    peak_threads: int
    peak_rss_mb: int


# The asyncio prototype worker, measured side by side with the shipped worker before choosing
# between them (bench/inflight.py's full sizes, seed 1). The prototype has since been removed,
# so these rows are kept as they were measured; each ratio to the loop is against that run's
# loop.
PROTOTYPE_COMMIT = "5b5a19e"
PROTOTYPE_DATE = "2026-12-03"
PROTOTYPE_INFLIGHT = (
    FrozenInflight(100, 31.74, 24.00, 0.97, 1.32, 4, 7, 118),
    FrozenInflight(500, 37.91, 24.00, 1.14, 1.58, 8, 7, 138),
    FrozenInflight(1000, 83.18, 24.00, 1.20, 3.47, 8, 8, 163),
)


def _save(plt: Any, fig: Any, name: str) -> str:
    """Lay ``fig`` out, write it to docs/img/``name`` and free it; returns the name."""
    fig.tight_layout()
    fig.savefig(IMG / name, dpi=110)
    plt.close(fig)
    return name


def _load(name: str) -> dict[str, Any] | None:
    path = common.OUT / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _v(ok: bool | None) -> str:
    return "n/a" if ok is None else ("**met**" if ok else "**MISSED**")


def _plots(r: dict[str, Any]) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    IMG.mkdir(parents=True, exist_ok=True)
    made = []
    loop, peers = r.get("loop"), r.get("peers")
    if loop or peers:
        made.append(_systems_plot(plt, loop, peers))
    scale = r.get("scale")
    if scale:
        made.append(_claim_latency_plot(plt, scale))
    workers = r.get("workers")
    if workers:
        made.append(_workers_plot(plt, workers))
    longrun = r.get("longrun")
    if longrun:
        made.append(_long_run_plot(plt, longrun))
    memory = r.get("memory")
    if memory:
        made.append(_memory_plot(plt, memory))
    inflight = r.get("inflight")
    if inflight and inflight.get("sizes"):
        made.append(_inflight_plot(plt, inflight))
    return made


def _systems_plot(plt: Any, loop: dict[str, Any] | None, peers: dict[str, Any] | None) -> str:
    """Steps per second against the in-memory loop and the peers; one-step runs against django-q2."""
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    labels, vals = [], []
    if loop:
        spr = loop["steps_per_run"]
        labels += ["in-memory loop", "durable_agents"]
        vals += [
            spr * loop["runs"] / statistics.median(loop["inmemory_s"]),
            loop["durable_steps_per_s"],
        ]
    if peers:
        labels += ["durable_agents\n(peers run)", "DBOS Transact"]
        vals += [peers["durable_steps_per_s"], peers["dbos_steps_per_s"]]
    ax1.bar(labels, vals, color=["#999", "#2a7", "#2a7", "#c63"][: len(vals)])
    ax1.set_ylabel("steps/s (one worker, 10-turn runs)")
    ax1.set_title("10-turn runs: steps per second")
    ax1.tick_params(axis="x", labelsize=8)
    if peers:
        ax2.bar(
            ["durable_agents", "django-q2"],
            [peers["durable_one_step_runs_per_s"], peers["q2_tasks_per_s"]],
            color=["#2a7", "#c63"],
        )
        ax2.set_ylabel("runs (tasks)/s, one worker")
        ax2.set_title("one-step runs")
    return _save(plt, fig, "bench_systems.png")


def _claim_latency_plot(plt: Any, scale: dict[str, Any]) -> str:
    """Claim latency against the size of agent_run."""
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [1000, scale["finished_large"]]
    for key, style in (("p50_ms", "o-"), ("p99_ms", "s--")):
        ax.plot(xs, [scale["small"][key], scale["large"][key]], style, label=key[:3])
    ax.set_xscale("log")
    ax.set_xlabel("finished runs in agent_run (plus 10,000 pending)")
    ax.set_ylabel("claim_runs latency (ms)")
    ax.set_ylim(bottom=0)
    ax.legend()
    ax.set_title("claim latency vs table size")
    return _save(plt, fig, "bench_claim_latency.png")


def _workers_plot(plt: Any, workers: dict[str, Any]) -> str:
    """Throughput against processes and slots."""
    fig, ax = plt.subplots(figsize=(6, 4))
    procs = [c for c in workers["configs"] if c["concurrency"] == 1]
    slots = [c for c in workers["configs"] if c["procs"] == 1]
    ax.plot(
        [c["workers"] for c in procs],
        [c["steps_per_s"] for c in procs],
        "o-",
        label="N processes x 1 slot",
    )
    ax.plot(
        [c["workers"] for c in slots],
        [c["steps_per_s"] for c in slots],
        "s--",
        label="1 process x N slots (--concurrency)",
    )
    ax.set_xscale("log", base=2)
    ax.set_xticks([1, 2, 4, 8], ["1", "2", "4", "8"])
    ax.set_xlabel(f"workers ({workers['cpus']} CPUs)")
    ax.set_ylabel("committed steps/s")
    ax.set_ylim(bottom=0)
    ax.legend()
    ax.set_title("throughput vs workers")
    return _save(plt, fig, "bench_workers.png")


def _long_run_plot(plt: Any, longrun: dict[str, Any]) -> str:
    """Per-step time along one long run."""
    fig, ax = plt.subplots(figsize=(7, 4))
    curve = {int(k): v for k, v in longrun["curve"].items()}
    seqs = sorted(curve)

    def rolling(vals: list[float], w: int = 25) -> list[float]:
        # Mean, not median: model-turn and tool-result steps alternate.
        return [statistics.fmean(vals[max(0, i - w) : i + w + 1]) for i in range(len(vals))]

    ax.plot(seqs, rolling([curve[s]["step_ms"] for s in seqs]), label="durable step (total)")
    ax.plot(
        seqs,
        rolling([curve[s]["step_ms"] - curve[s]["model_ms"] for s in seqs]),
        label="durable step minus model call",
    )
    ax.plot(seqs, rolling([curve[s]["commit_ms"] for s in seqs]), label="append_step")
    fresh = {int(k): v for k, v in longrun.get("fresh_curve", {}).items()}
    if fresh:
        fs = sorted(fresh)
        ax.plot(fs, [fresh[s] for s in fs], "--", label="fresh runs' steps 2-21, in between")
    im = {int(k): v for k, v in longrun["inmemory_curve"].items()}
    ims = sorted(im)
    ax.plot(ims, rolling([im[s] for s in ims]), ":", label="in-memory loop: model call")
    ax.set_xlabel("step (seq) in one run")
    ax.set_ylabel("ms (rolling mean of 51 steps)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    ax.set_title("per-step time vs run length")
    return _save(plt, fig, "bench_long_run.png")


def _memory_plot(plt: Any, memory: dict[str, Any]) -> str:
    """A worker's RSS over the runs it finished."""
    fig, ax = plt.subplots(figsize=(6, 3.5))
    s = memory["samples"]
    ax.plot([x[1] for x in s], [x[2] / 1024 for x in s])
    ax.set_xlabel("runs finished")
    ax.set_ylabel("worker RSS (MB)")
    ax.set_ylim(bottom=0)
    ax.set_title("worker memory over runs")
    return _save(plt, fig, "bench_memory.png")


def _inflight_plot(plt: Any, inflight: dict[str, Any]) -> str:
    """Wall time and database connections against runs in flight."""
    sizes = inflight["sizes"]
    xs = [s["inflight"] for s in sizes]
    sides = [x for x in ("app", "loop") if any(x in s["sides"] for s in sizes)]
    labels = {"app": "durable_agents worker", "loop": "asyncio loop (seed)"}
    styles = {"app": "o-", "loop": "s--"}
    frozen_label = f"async prototype (frozen, {PROTOTYPE_COMMIT})"
    frozen_x = [row.inflight for row in PROTOTYPE_INFLIGHT]

    def series(side: str, key: str) -> tuple[list[int], list[float]]:
        pts = [
            (s["inflight"], s["sides"][side].get(key))
            for s in sizes
            if side in s["sides"] and s["sides"][side].get(key) is not None
        ]
        return [p[0] for p in pts], [p[1] for p in pts]

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for side in sides:
        ax1.plot(*series(side, "wall_s"), styles[side], label=labels[side])
    ax1.plot(frozen_x, [row.wall_s for row in PROTOTYPE_INFLIGHT], "^-.", label=frozen_label)
    ax1.plot(xs, [s["ideal_s"] for s in sizes], ":", color="#777", label="ideal")
    ax1.set_xlabel("runs in flight (slots / tasks)")
    ax1.set_ylabel(f"wall time (s); runs = {inflight['runs_factor']:g} x in flight")
    ax1.set_ylim(bottom=0)
    ax1.legend(fontsize=8)
    ax1.set_title("wall time vs runs in flight")
    for side in sides:
        ax2.plot(*series(side, "peak_pg_connections"), styles[side], label=labels[side])
    ax2.plot(
        frozen_x,
        [row.peak_pg_connections for row in PROTOTYPE_INFLIGHT],
        "^-.",
        label=frozen_label,
    )
    ax2.set_xlabel("runs in flight (slots / tasks)")
    ax2.set_ylabel("peak PostgreSQL connections")
    ax2.set_ylim(bottom=0)
    ax2.legend(fontsize=8)
    ax2.set_title("database connections vs runs in flight")
    return _save(plt, fig, "bench_inflight.png")


def render() -> Path:
    names = [
        "machine",
        "loop",
        "commit",
        "peers",
        "scale",
        "workers",
        "profile_step",
        "longrun",
        "memory",
        "inflight",
        "waits",
        "compaction",
        "admin_scale",
        "admin_scale_10m",
        "admin_scale_before",
        "quota_rpm",
        "quota_itpm",
        "keys_crash",
        "keys_crash_slow",
        "encryption",
        *MORE_NAMES,
    ]
    r = {n: d for n in names if (d := _load(n)) is not None}
    m = r.get("machine", {})
    made = _plots(r)
    L: list[str] = []
    w = L.append
    _header(w, m)
    _targets(w, r)
    w("")
    _before_after(w, r, m)
    for img in made:
        w(f"![{img}](img/{img})")
        w("")
    _numbered_sections(w, r)
    inf = r.get("inflight")
    if inf:
        _inflight_section(w, inf)
    if r.get("waits"):
        _waits_section(w, r["waits"])
    if r.get("compaction"):
        _compaction_section(w, r["compaction"])
    if r.get("admin_scale"):
        admin_scale_section(
            w, r["admin_scale"], r.get("admin_scale_10m"), r.get("admin_scale_before")
        )
    _fleet_sections(w, r)
    if r.get("encryption"):
        encryption_section(w, r["encryption"])
    more_sections(w, r)
    _fakes(w)
    _reproduce(w)
    out = DOCS / "benchmarks.md"
    out.write_text("\n".join(L))
    return out


def _fleet_sections(w: Any, r: dict[str, Any]) -> None:
    """One model quota shared by a fleet, and concurrency keys across a crash."""
    quotas = {n.removeprefix("quota_"): r[n] for n in ("quota_rpm", "quota_itpm") if r.get(n)}
    if quotas:
        quota_section(w, quotas)
    if r.get("keys_crash"):
        keys_crash_section(w, r["keys_crash"], r.get("keys_crash_slow"))


def _header(w: Any, m: dict[str, Any]) -> None:
    """The title, and the machine, software and workload the numbers come from."""
    w("# Benchmarks")
    w("")
    w(
        "Generated by `make bench` (`bench/run_all.py`); numbers, not tests. Every ratio is "
        "measured side by side in one run. Re-run to refresh; do not edit by hand."
    )
    w("")
    w(f"- date: {m.get('date')}, mode: {m.get('mode')}, total {m.get('total_seconds', 0):.0f} s")
    w(
        f"- machine: {m.get('cpu')}, {m.get('cpus')} CPUs, {m.get('memory_gb')} GB RAM, "
        f"Linux {m.get('kernel')}; load average at start {_la(m.get('loadavg_start'))}, "
        f"at end {_la(m.get('loadavg_end'))} (the machine is shared: other processes run too)"
    )
    w(
        f"- {m.get('postgresql')} on 127.0.0.1 ({', '.join(f'{k}={v}' for k, v in m.get('pg_settings', {}).items())})"
    )
    w(
        f"- Python {m.get('python')}; "
        + ", ".join(f"{k} {v}" for k, v in m.get("versions", {}).items())
    )
    w(
        "- fake Messages API: `bench/fakeapi.py`, a separate process (ThreadingHTTPServer, "
        "HTTP/1.1 keep-alive, TCP_NODELAY) answering as the offline scripted model does, with "
        "zero latency: it reads the whole body but decodes only the task and counts the turns "
        "in the raw bytes, so its own cost does not grow with the history (it does not "
        "validate requests; the test suite's offline model does)."
    )
    w(
        "- workload unless said otherwise: runs of 10 model turns, one trivial pure tool call per "
        "turn but the last (19 committed worker steps per run), durable_agents logging at WARNING."
    )
    g = m.get("git") or {}
    if g:
        dirty = g.get("durable_agents_dirty") or []
        w(
            f"- code measured: git {g.get('head')}"
            + (
                f" plus uncommitted changes to {', '.join(dirty)}"
                if dirty
                else " (clean durable_agents/)"
            )
        )
    if m.get("failures"):
        w(f"- **failed benchmarks**: {m['failures']}")
    if m.get("skipped"):
        w(f"- **skipped benchmarks** (a requirement missing here): {m['skipped']}")
    w("")


def _targets(w: Any, r: dict[str, Any]) -> None:
    """The table of targets: each ratio, its goal and its verdict."""
    w("## Targets")
    w("")
    w("| # | target | durable_agents | reference | ratio | goal | verdict |")
    w("| --- | --- | --- | --- | --- | --- | --- |")
    for row in target_rows(r):
        w("| " + " | ".join(row) + " |")


def _numbered_sections(w: Any, r: dict[str, Any]) -> None:
    """The sections of the benchmarks that ran (each needs its own results)."""
    loop, peers, c = r.get("loop"), r.get("peers"), r.get("commit")
    s, wk, lr, mem = r.get("scale"), r.get("workers"), r.get("longrun"), r.get("memory")
    p = r.get("profile_step")
    if loop:
        _loop_section(w, loop, c)
    if p:
        _profile_section(w, p)
    if c:
        _commit_section(w, c)
    if peers:
        _peers_section(w, peers)
    if s:
        _scale_section(w, s)
    if wk:
        _workers_section(w, wk)
    if lr:
        _longrun_section(w, lr)
    if mem:
        _memory_section(w, mem)


def _loop_section(w: Any, loop: dict[str, Any], c: dict[str, Any] | None) -> None:
    """1. Loop overhead: the in-memory loop against the durable worker, and the commit floor."""
    w("## 1. Loop overhead")
    w("")
    w(
        f"{loop['runs']} runs x {loop['reps']} repetitions, medians. In-memory: the seed's "
        "`while True` loop with `client.messages.create`. Durable: `Worker(concurrency=1, "
        "burst=True).run()` in-process (the body of `runagents --burst`)."
    )
    w("")
    w("| measure | value |")
    w("| --- | --- |")
    w(
        f"| in-memory loop | {loop['inmemory_ms_per_run']:.2f} ms/run "
        f"({loop['inmemory_model_calls_per_s']:.0f} model calls/s) |"
    )
    w(
        f"| durable worker | {loop['durable_ms_per_run']:.2f} ms/run "
        f"({loop['durable_steps_per_s']:.0f} steps/s) |"
    )
    if "ratio_strict" in loop:
        w(
            f"| durable worker, `OVERLAP_SAFE_COMMITS` off (every step committed before the "
            f"next call) | {loop['durable_strict_ms_per_run']:.2f} ms/run, ratio "
            f"{loop['ratio_strict']:.2f} |"
        )
    w(f"| start_run (enqueue, not in the ratio) | {loop['start_run_ms']:.2f} ms/run |")
    w(f"| ratio incl. start_run | {loop['ratio_incl_start']:.2f} |")
    w(
        f"| `runagents --burst` subprocess wall (incl. ~interpreter + Django start-up) "
        f"| {loop['runagents_burst_wall_s']:.2f} s for {loop['runs']} runs, ratio "
        f"{loop['ratio_runagents_wall']:.2f} |"
    )
    w(
        f"| raw samples (s) | in-memory {_fl(loop['inmemory_s'])}; durable {_fl(loop['durable_worker_s'])} |"
    )
    w("")
    if c:
        turns = loop["turns_per_run"]
        floor = (loop["inmemory_ms_per_run"] + turns * c["append_step"]["p50_ms"]) / loop[
            "inmemory_ms_per_run"
        ]
        w(
            f"Arithmetic floor: each of the {turns} model turns must be committed before its "
            f"tools run, so {turns} flushed commits stay in the step's path; at the measured "
            f"append_step p50 ({c['append_step']['p50_ms']:.3f} ms, synchronous_commit on, "
            f"measured alone) they add {turns * c['append_step']['p50_ms']:.1f} ms to the "
            f"in-memory {loop['inmemory_ms_per_run']:.1f} ms/run ({floor:.2f}x) before any "
            "other cost. The other 9 commits (pure tool results) overlap the next model call. "
            "In the loop a commit costs more than alone: worker, fake API and PostgreSQL share "
            "the machine's 2 CPUs (see the profile below)."
        )
        w("")


def _profile_section(w: Any, p: dict[str, Any]) -> None:
    """Where the time of a durable step goes: buckets and database round trips."""
    w("## Where the time of a durable step goes")
    w("")
    w(
        f"`bench/profile_step.py`: {p['runs']} runs ({p['steps']} steps) advanced in-process "
        f"the way a worker slot does; {p['wall_ms_per_run']:.1f} ms/run, "
        f"{p['wall_ms_per_step']:.2f} ms/step."
    )
    w("")
    w("| bucket | ms/step | ms/run | calls/run |")
    w("| --- | --- | --- | --- |")
    for k, v in p["ms_per_step"].items():
        w(
            f"| {k} | {v:.3f} | {p['ms_per_run'].get(k, v * p['steps'] / p['runs']):.2f} "
            f"| {p['calls_per_run'].get(k, '')} |"
        )
    t = p["round_trips"]
    w("")
    w(
        f"Database round trips (libpq protocol trace, each client Query/Sync): "
        f"**{t['per_run']:.1f} per run, {t['per_step']:.2f} per step**; time from the "
        f"client's message to the server's ReadyForQuery, {t['db_ms_per_run']:.1f} ms/run in all:"
    )
    w("")
    w("| statement | round trips/run | ms/run |")
    w("| --- | --- | --- |")
    for k, v in t["by_statement_per_run"].items():
        w(f"| {k} | {v:.1f} | {t['db_ms_per_run_by_statement'].get(k, 0):.2f} |")
    w("")
    w(
        f"INFO logging (a line per committed step, the default level outside the benchmarks) "
        f"costs {p['log_info_ms_per_step']:.3f} ms/step (to /dev/null; negative = noise)."
    )
    w("The cProfile listing is in `bench/out/profile_step.txt`.")
    w("")


def _commit_section(w: Any, c: dict[str, Any]) -> None:
    """3. Commit floor: one step's commit, through Django and raw psycopg."""
    w("## 3. Commit floor")
    w("")
    w("| statement | p50 ms | mean ms | p99 ms |")
    w("| --- | --- | --- | --- |")
    for k, label in (
        ("append_step", "`Store.append_step` (Django, one CTE statement, autocommit)"),
        ("append_turn", "append_step of a priced model turn (and the day's rollup upsert)"),
        ("raw_tx", "raw psycopg: BEGIN; INSERT agent_step; UPDATE agent_run; COMMIT"),
        ("raw_cte", "append_step's SQL through raw psycopg (no Django)"),
        ("append_step_async", "append_step with synchronous_commit=off (no WAL flush wait)"),
        ("select1", "`SELECT 1` round trip"),
    ):
        x = c.get(k)
        if x is None:  # measured by a later release than these figures
            continue
        w(f"| {label} | {x['p50_ms']:.3f} | {x['mean_ms']:.3f} | {x['p99_ms']:.3f} |")
    w("")


def _peers_section(w: Any, peers: dict[str, Any]) -> None:
    """2. Peers: DBOS Transact and django-q2 on the same workload."""
    w("## 2. Peers")
    w("")
    w(
        f"- {peers['workload']}; DBOS: one workflow per run, `@DBOS.step` per model call and "
        f"per tool call, PostgreSQL system database, one workflow at a time. Samples (s): "
        f"durable {_fl(peers['durable_s'])}, DBOS {_fl(peers['dbos_s'])}."
    )
    q = peers["q2"]
    w(
        f"- django-q2 (ORM broker, `qcluster`, 1 worker, poll 0.05 s): {q['n']} tasks of one "
        f"model call each, {q['span_s']:.2f} s from first start to last stop "
        f"({q['wall_s']:.2f} s wall from cluster launch). durable_agents: {q['n']} one-step "
        f"runs with one in-process worker, {_fl(peers['durable_one_step_s'])} s; "
        f"`runagents --burst` subprocess incl. start-up and start_run: "
        f"{peers['durable_one_step_runs_per_s_runagents_wall_incl_start']:.1f} runs/s."
    )
    w("")


def _scale_section(w: Any, s: dict[str, Any]) -> None:
    """4. Claim latency at scale, with the claim query's plan and the table sizes."""
    w("## 4. Claim latency at scale")
    w("")
    w("| finished runs | p50 ms | p90 ms | p99 ms | max ms |")
    w("| --- | --- | --- | --- | --- |")
    for key, n in (("small", 1000), ("large", s["finished_large"])):
        x = s[key]
        w(
            f"| {n:,} | {x['p50_ms']:.3f} | {x['p90_ms']:.3f} | {x['p99_ms']:.3f} | {x['max_ms']:.3f} |"
        )
    w("")
    w(
        f"Both with {s['pending']:,} pending runs; {s['small']['n']} claims each, in alternating "
        "blocks, each block in a fresh process after 20 warm-up claims; each claim is "
        "`Store.claim_runs(owner, 60, 1)` timed in the client (round trips and Django "
        "included), and the run is then finished with `finish_run`."
    )
    w("")
    w("Claim query and its plan at the large size:")
    w("")
    w("```sql")
    w(s["claim_select_sql"])
    w("```")
    w("```")
    w(s["explain_large"])
    w("```")
    w("| relation | size at 1,000 | size at " + f"{s['finished_large']:,} |")
    w("| --- | --- | --- |")
    for name, rel in s["sizes_large"]["relations"].items():
        small = s["sizes_small"]["relations"].get(name, {}).get("pretty", "?")
        w(f"| {name} | {small} | {rel['pretty']} |")
    w("")


def _workers_section(w: Any, wk: dict[str, Any]) -> None:
    """5. Workers: throughput and lock waits per processes x slots."""
    w("## 5. Workers")
    w("")
    w(
        "Each configuration was timed right after a run of one worker, and its speedup is "
        "against that run (the machine's speed drifts within minutes)."
    )
    w("")
    w(
        "| processes x slots | steps/s (DB clock) | one worker just before | speedup "
        "| steps/s insert-to-done | lock-wait samples | ungranted-lock samples "
        "| top wait events (active backends) |"
    )
    w("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for x in wk["configs"]:
        w(
            f"| {x['procs']} x {x['concurrency']} | {x['steps_per_s']:.0f} "
            f"| {x.get('baseline_steps_per_s', x['steps_per_s']):.0f} | {x['speedup']:.2f} "
            f"| {x['steps_per_s_wall']:.0f} | {x['lock_wait_samples']}/{x['lock_samples']} "
            f"| {x['ungranted_lock_samples']} | {_ev(x['wait_events'])} |"
        )
    w("")
    w(
        f"Did any worker wait on a lock to claim? **{'yes' if wk['any_claim_lock_wait'] else 'no'}** "
        f"(any lock wait at all: {'yes' if wk['any_lock_wait'] else 'no'}); pg_stat_activity and "
        "pg_locks sampled every ~5 ms during each configuration. The wait events of active "
        "backends show what limits scaling: IO:WALSync / LWLock:WALWrite are commits waiting "
        "for the WAL flush (one flushed commit per step); the fake API, PostgreSQL and the "
        "workers share the same CPUs."
    )
    w("")


def _longrun_section(w: Any, lr: dict[str, Any]) -> None:
    """6. Long runs: step time at the start and at the end of a long run."""
    w("## 6. Long runs")
    w("")
    w(
        "| at step | mean step ms | model-turn step ms | tool-result step ms | model call ms "
        "| durable part ms (mean) | append_step ms | in-memory model call ms |"
    )
    w("| --- | --- | --- | --- | --- | --- | --- | --- |")
    window = lr.get("window", [lr["steps"] - 50, lr["steps"]])
    for label, sfx in (
        (f"steps 2-{2 * lr.get('fresh_turns', 11) - 1} of fresh runs (in between)", "10"),
        (f"steps {window[0]}-{window[1]} of the long run", "end"),
    ):
        w(
            f"| {label} | {lr[f'step_ms_at_{sfx}']:.2f} "
            f"| {lr.get(f'model_step_ms_at_{sfx}', float('nan')):.2f} "
            f"| {lr.get(f'tool_step_ms_at_{sfx}', float('nan')):.2f} "
            f"| {lr[f'model_call_ms_at_{sfx}']:.2f} | {lr[f'durable_part_ms_at_{sfx}']:.2f} "
            f"| {lr[f'commit_ms_at_{sfx}']:.2f} | {lr[f'inmemory_call_ms_at_{sfx}']:.2f} |"
        )
    w("")
    if "slices" in lr:
        w(
            f"Side by side: the {lr['steps'] + 1}-step run was advanced in {lr['slices']} "
            f"claims of {lr['slice_steps']} steps, and after each one a fresh "
            f"{lr.get('fresh_turns', 11)}-turn run was advanced from its start, so the two "
            f"windows were timed in the same stretches of time ({lr['paired_slices']} paired "
            f"slices; median of their per-slice ratios {lr['slice_ratio_median']:.2f}). The "
            "first step of each claim (claim + rebuild) is not counted."
        )
        w("")
    w(
        "Mean step time over both step kinds (the target's figure); medians per kind and per "
        "component. The request carries the whole history on every call, but it is built "
        "from stored JSON text (nothing is re-serialised or re-parsed), so only the bytes on "
        "the wire grow; the in-memory loop's column (the SDK serialising its message objects "
        "on every call) shows what re-serialising costs. The durable part is the step minus "
        "its model call: commit + tool + runner."
    )
    w(
        f"Cold rebuild of {lr['steps'] + 1} steps: `load_log` p50 "
        f"{lr['rebuild']['p50_ms']:.1f} ms (min {lr['rebuild']['min_ms']:.1f}); raw psycopg SELECT p50 {lr['raw_select']['p50_ms']:.1f} ms (min {lr['raw_select']['min_ms']:.1f}); "
        f"raw SELECT + json.loads of every payload p50 "
        f"{lr['raw_select_plus_json_loads']['p50_ms']:.1f} ms."
    )
    w("")


def _memory_section(w: Any, mem: dict[str, Any]) -> None:
    """7. Memory: a worker's RSS over many runs."""
    w("## 7. Memory")
    w("")
    w(
        f"One `runagents --burst --concurrency {mem.get('concurrency', 1)}` process, "
        f"{mem['runs']:,} one-step runs ({mem['runs_per_s']:.0f} runs/s): RSS "
        f"{mem['rss_first_kb'] / 1024:.1f} MB at the first sample, "
        f"{mem['rss_warm_kb'] / 1024:.1f} MB after {mem['rss_warm_at_runs']} runs, "
        f"{mem['rss_end_kb'] / 1024:.1f} MB at the end (max {mem['rss_max_kb'] / 1024:.1f} MB)."
    )
    w("")


_FAKE_FLAGS = [
    (
        "`--rpm N`, `--itpm N`, `--otpm N`",
        "unlimited",
        "requests, input tokens, output tokens per minute: token buckets that refill "
        "continuously (limit / 60 a second) up to their capacity, as the API's do",
    ),
    ("`--burst-seconds S`", "60", "a bucket holds S seconds of its limit (a burst's most)"),
    (
        "`--latency MIN-MAX`",
        "0 (fakeapi), 2-6 (slowapi)",
        "seconds before each answer, uniform (one figure: fixed)",
    ),
    (
        "`--overloaded-rate F`",
        "0",
        "the fraction of requests answered 529 `overloaded_error`, before any limit is charged",
    ),
    ("`--seed N`", "none", "the random sequences of the latencies and of the 529s"),
]


def _fakes(w: Any) -> None:
    """The fake APIs' flags and their /stats: how to run a benchmark under rate limits."""
    w("## The fake Messages APIs under rate limits")
    w("")
    w(
        "`bench/fakeapi.py` (zero latency, a thread per connection) and `bench/slowapi.py` "
        "(latency, one asyncio process) take the same flags (`bench/gate.py`), so that a "
        "benchmark can run against an API that limits it as the real one does:"
    )
    w("")
    w("| flag | default | what |")
    w("| --- | --- | --- |")
    for flag, default, what in _FAKE_FLAGS:
        w(f"| {flag} | {default} | {what} |")
    w("")
    w(
        "A request is charged `len(body) // 4` input tokens (what its usage reports: a long "
        "transcript costs ITPM by its size, though the fake never parses it) and its "
        "`max_tokens` of output, settled to the answer's output tokens (12) when it is sent. "
        "A request some bucket cannot serve gets a 429 `rate_limit_error` at once, with "
        "`retry-after` (whole seconds) and the `anthropic-ratelimit-*` headers every answer "
        "carries. The limiter is the offline model's (`durable_agents.offline.RateLimits`)."
    )
    w("")
    w(
        "`GET /stats` returns JSON: `answered`, `rejected_429`, `overloaded_529`, `in_flight`, "
        "`peak_in_flight`, `buckets` (per limited measure: limit, capacity, level, remaining, "
        "reset) and `keys`, the same counts per concurrency key, read from a `[key:NAME]` "
        "marker in the task (the first user message), so that a benchmark can show that no "
        "more than N requests of one key were ever in flight. `POST /stats/reset` zeroes the "
        "counts and fills the buckets. Without limits the fakes only count, a few "
        "microseconds a request."
    )
    w("")
    w("```")
    w("python -m bench.slowapi --port 0 --rpm 4000 --itpm 400000 --otpm 80000 --latency 0.5-1.5")
    w("curl -s http://127.0.0.1:PORT/stats")
    w("```")
    w("")


def _reproduce(w: Any) -> None:
    """The commands that produce these numbers."""
    w("## Reproduce")
    w("")
    w("```")
    w("make bench                       # full sizes (about 20 minutes on 2 cores)")
    w(".venv/bin/python -m bench.run_all --quick                 # about 6 minutes")
    w('make bench BENCH_ARGS="--before 14be984"   # also measure 14be984 first (twice as long)')
    w(".venv/bin/python -m bench.loop --runs 100   # any single benchmark")
    w(".venv/bin/python -m bench.admin_scale --sizes 10000,10000000 --reps 5 --out admin_scale_10m")
    w(".venv/bin/python -m bench.run_all --help   # every benchmark --only accepts")
    w("```")
    w("")
    w(
        "`bench.run_all` runs every benchmark script of `bench/` (a unit test keeps it so). "
        "`failover` needs a private PostgreSQL cluster (`tests/pgcluster.py`: the server "
        "binaries in `DA_PG_BIN`, default /usr/lib/postgresql/15/bin, and the `postgres` OS "
        "user); where they are missing, run_all skips it, prints why, and the header above "
        "lists it as skipped."
    )
    w("")


_INFLIGHT_HEAD = (
    "| in flight | side | wall s | ideal s | ratio to loop | ratio to ideal "
    "| peak PG connections | peak threads | peak RSS MB |"
)
_INFLIGHT_RULE = "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"


def _inflight_section(w: Any, inf: dict[str, Any]) -> None:
    lat = inf["latency_s"]
    pool = inf.get("pool_size")
    w("## In flight")
    w("")
    w(
        f"`bench/inflight.py`: runs of {inf['turns']} model turns (one pure tool call per turn "
        f"but the last) against `bench/slowapi.py`, a fake Messages API (one asyncio process) "
        f"that answers every call after a uniform random {lat[0]:g}-{lat[1]:g} s delay (mean "
        f"{inf['mean_latency_s']:g} s, the same seeded sequence for every side). At each size "
        f"N, {inf['runs_factor']:g} x N runs: **app** is `runagents --concurrency N --burst` "
        "over bulk-inserted runs, timed max(finished_at) - min(started_at) in the database; "
        "**loop** is the seed's agent loop as N asyncio tasks on one `AsyncAnthropic` client "
        "(no database), first request to last finish. Ideal: runs x turns x mean latency / N. "
        "Peaks sampled every 50 ms: connections to the bench database (pg_stat_activity), the "
        "worker's threads (/proc), its peak RSS (the child's ru_maxrss; the loop's is the bench "
        f"process's VmRSS). Worker pool: DB_POOL_SIZE {pool if pool is not None else 'default'}."
    )
    w("")
    w(_INFLIGHT_HEAD)
    w(_INFLIGHT_RULE)

    def f2(v: Any) -> str:
        return "-" if v is None else f"{v:.2f}"

    for s in inf.get("sizes", []):
        for side, x in s["sides"].items():
            w(
                f"| {s['inflight']} | {side}{' **(FAILED)**' if x.get('error') else ''} "
                f"| {f2(x.get('wall_s'))} | {s['ideal_s']:.2f} | {f2(x.get('ratio_to_loop'))} "
                f"| {f2(x.get('ratio_to_ideal'))} | {x['peak_pg_connections']} "
                f"| {x['peak_threads']} | {x['peak_rss_kb'] / 1024:.0f} |"
            )
    w("")
    w(
        f"**prototype** (frozen): an asyncio worker, timed like app on the same workload, "
        f"measured at {PROTOTYPE_COMMIT} on {PROTOTYPE_DATE}; the prototype has since been "
        "removed. Its ratio to the loop is against the loop of that run."
    )
    w("")
    w(_INFLIGHT_HEAD)
    w(_INFLIGHT_RULE)
    for row in PROTOTYPE_INFLIGHT:
        w(
            f"| {row.inflight} | prototype | {row.wall_s:.2f} | {row.ideal_s:.2f} "
            f"| {row.ratio_to_loop:.2f} | {row.ratio_to_ideal:.2f} | {row.peak_pg_connections} "
            f"| {row.peak_threads} | {row.peak_rss_mb} |"
        )
    w("")
    walls = [
        f"{s['inflight']}: {x['process_wall_s']:.1f} s"
        for s in inf.get("sizes", [])
        for side, x in s["sides"].items()
        if side == "app" and "process_wall_s" in x
    ]
    if walls:
        w(
            "`runagents` launch-to-exit wall (interpreter and Django start-up, burst exit "
            f"included): {', '.join(walls)}."
        )
        w("")
    w(
        "How to read it. **app** is the worker as shipped: a thread per run in flight (plus "
        "one that makes its calls), Django's psycopg pool of `DB_POOL_SIZE` - 2 connections "
        "that a thread holds only while it talks to the database, one heartbeat statement per "
        "beat, LISTEN for pickup, model calls spread over SDK clients of 64 threads each. "
        "**prototype** is the alternative that was measured before choosing: an asyncio worker "
        "(AsyncAnthropic, psycopg's AsyncConnectionPool, the same fenced statements) without "
        "overlapped commits or finish-and-claim. On this 2-CPU machine both are CPU-bound at "
        "1,000 in flight, like the loop itself (its ratio to the ideal); what decides the wall "
        "time there is the CPU each call costs. Most of the loop's and the prototype's goes to "
        "the HTTP pool under the SDK, which scans every connection it holds on each request: "
        "one client with a thousand connections pays that on every call, which is why the "
        "worker spreads its calls over several clients. Before many runs in flight shared a few "
        "connections (git 14be984), the worker held one PostgreSQL connection per run in "
        "flight: at 500 in flight it was capped at 99 connections and took 4.1x the loop's "
        "time (measured on this workload when the change was planned)."
    )
    w("")
    errors = [
        f"{side} at {s['inflight']}: {x['error']}"
        for s in inf.get("sizes", [])
        for side, x in s["sides"].items()
        if x.get("error")
    ]
    for e in errors:
        w(f"- **failed**: {e}")
    if errors:
        w("")
    pk = inf.get("pickup")
    if pk:
        w(
            f"Pickup: an idle `runagents --concurrency 10 --poll-interval "
            f"{pk['poll_interval_s']:g}` and the fake at zero latency; {pk['runs']} `start_run` "
            f"{pk['interval_s'] * 1000:.0f} ms apart (after {pk.get('warmup_runs', 0)} uncounted "
            f"warm-up run). From start_run's return (its commit) to the run's first model "
            f"request: **p50 {pk['p50_ms']:.0f} ms, p95 {pk['p95_ms']:.0f} ms**, max "
            f"{pk['max_ms']:.0f} ms ({pk['picked_up']}/{pk['runs']} seen)"
            + (f"; **{pk['error']}**" if pk.get("error") else "")
            + ". A pickup well under the poll interval means the worker was woken by the "
            "commit, not by its polling."
        )
        w("")
    fl = inf.get("fleet")
    if fl:
        w(
            f"Fleet: {fl['procs']} x `runagents --concurrency {fl['concurrency']} --burst` over "
            f"{fl['runs']:,} runs in one database: {f2(fl.get('wall_s'))} s (ideal "
            f"{fl['ideal_s']:.2f} s, ratio {f2(fl.get('ratio_to_ideal'))}); peak PostgreSQL "
            f"connections **{fl['peak_pg_connections']}** (target <= {fl['procs']} x "
            f"DB_POOL_SIZE {fl['pool_size']} = {fl['pg_connection_limit']}: {_v(fl['met'])}); "
            f"peak RSS per process {fl['peak_rss_kb'] / 1024:.0f} MB"
            + (f"; **failed: {fl['error']}**" if fl.get("error") else "")
            + "."
        )
        w("")


def _waits_section(w: Any, wt: dict[str, Any]) -> None:
    w("## Waits")
    w("")
    if wt.get("skipped"):
        w(f"`bench/waits.py` was skipped: {wt['skipped']} (it needs PostgreSQL).")
        w("")
        return
    c, k = wt.get("claim"), wt.get("wake")
    if c:
        n, x = c["none"], c["with_waiting"]
        w(
            f"Claim with waiting runs (`bench/waits.py`): `PostgresStore().claim_runs(owner, 60, "
            f"{c['limit']})` in two databases holding the same {c['pending']:,} pending runs "
            f"(each with its task step); one of them also holds {c['waiting']:,} waiting runs "
            "(40 % on timers due in 1 h to 8 days, 40 % on unsent events with a timeout, 20 % on "
            "unsent events without one, with their steps and events), bulk-loaded and vacuumed. "
            "One process per database times each claim in the client (commit, round trip and "
            "Django included) and hands the run back at once (`release_lease(count_claim=False)`), "
            "so every claim takes the same oldest pending run; blocks alternate between the two "
            f"databases ({c['blocks']} blocks, order swapped every block, agent_run vacuumed "
            "before each)."
        )
        w("")
        w("| waiting runs | claims | p50 ms | p90 ms | p99 ms | max ms |")
        w("| --- | --- | --- | --- | --- | --- |")
        for label, y in (("none", n), (f"{c['waiting']:,}", x)):
            w(
                f"| {label} | {y['n']} | {y['p50_ms']:.3f} | {y['p90_ms']:.3f} "
                f"| {y['p99_ms']:.3f} | {y['max_ms']:.3f} |"
            )
        w("")
        w(
            f"p99 ratio {c['p99_ratio']:.2f} (p50 ratio {c['p50_ratio']:.2f}); target "
            f"{c['target']}: {_v(c['met'])}. Partial indexes in the plans: "
            + ", ".join(
                f"{name} {'yes' if used else '**no**'}" for name, used in c["indexes_used"].items()
            )
            + "."
        )
        bw = c.get("before_waits")
        if bw:
            w("")
            w(
                "The worker's hot path before and after: the claim statement of 25467b5 (before "
                "durable waits: no `due` CTE) timed right after each block of the current one, "
                "in the same process on the same database with none waiting: "
                f"p50/p99 {bw['p50_ms']:.3f}/{bw['p99_ms']:.3f} ms before, "
                f"{n['p50_ms']:.3f}/{n['p99_ms']:.3f} ms now (now / before: p50 "
                f"{c['hot_path_p50_ratio']:.2f}, p99 {c['hot_path_p99_ratio']:.2f})."
            )
        seq = c.get("seq_scan") or {}
        if any(seq.values()):
            sides = " and ".join(
                "with none waiting" if side == "none" else f"with {c['waiting']:,} waiting"
                for side, on in seq.items()
                if on
            )
            w("")
            w(
                f"**The claim's plan {sides} reads agent_run with a Seq Scan**: the UPDATE joins "
                "the runs chosen by the CTEs `due` and `ready` by a hash join over the whole "
                "table, because the planner expects about a tenth of the pending runs from them "
                "(the LIMIT of `ready` is not a constant). A larger table tips it to the primary "
                "key (a Nested Loop), so this ratio compares two different plans."
            )
        w("")
        w(f"EXPLAIN (ANALYZE, BUFFERS) of the claim with {c['waiting']:,} waiting runs:")
        w("")
        w("```")
        w(c["explain_waiting"])
        w("```")
        w("")
        w(f"send_event's UPDATE with {c['waiting']:,} waiting runs (rolled back):")
        w("")
        w("```sql")
        w(c["send_event_sql"])
        w("```")
        w("```")
        w(c["send_event_explain_waiting"])
        w("```")
        w("")
    if k:
        w(
            f"Wake-up (`bench/waits.py`): {k['runs']:,} runs of an agent whose tool raises "
            "`Wait(event=..., timeout=3600)` are parked on one event by a real worker "
            f"(`runagents --concurrency {k['concurrency']} --poll-interval "
            f"{k['poll_interval_s']:g}`, DB_POOL_SIZE {k['pool_size']}, LISTEN "
            f"{'on' if k['listen'] else 'off'}) against a zero-latency fake Messages API that "
            "records the arrival of every request; then `durable_agents.send_event` wakes them "
            f"(after {k['warmup_runs']} uncounted warm-up runs). Per run: its first model "
            "request after the wake minus the moment send_event returned (its commit)."
        )
        w("")
        w("| measure | value |")
        w("| --- | --- |")
        w(
            f"| `UPDATE agent_run` statements in send_event (CaptureQueriesContext) "
            f"| **{k['agent_run_updates']}** ({k['send_event_queries']} queries in all, "
            f"{k['send_event_ms']:.1f} ms; {k['woken']:,} runs woken) |"
        )
        w(
            f"| event commit -> first model request, p50 / p90 / p99 "
            f"| **{k['p50_ms']:.0f} / {k['p90_ms']:.0f} / {k['p99_ms']:.0f} ms** |"
        )
        w(f"| min / max | {k['min_ms']:.0f} / {k['max_ms']:.0f} ms |")
        w(
            f"| commit -> all {k['runs']:,} runs finished | {k['done_s']:.1f} s "
            f"(worker CPU {k['worker_cpu_s']:.1f} s in that time) |"
        )
        w(f"| parking the {k['runs']:,} runs (start_run -> all waiting) | {k['park_s']:.1f} s |")
        w("")
        w(
            "The first woken run calls the model within the min above: the NOTIFY of the "
            "wake reaches the idle worker at once. The spread up to the max is the worker "
            "getting through a thousand runs at the same moment (claim, rebuild, the tool "
            "called again with `woken_by`, its result committed, the model call) on the CPUs "
            "it shares with PostgreSQL and the fake API."
            + (f" **Failed: {k['error']}.**" if k.get("error") else "")
        )
        w("")


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def admin_scale_section(
    w: Any,
    a: dict[str, Any],
    ten_million: dict[str, Any] | None = None,
    before: dict[str, Any] | None = None,
) -> None:
    """bench/admin_scale.py: every admin page at 10,000 vs 1,000,000 runs (and, measured once,
    10,000,000), with the same pages before the admin was reworked for that size when
    ``before`` is there."""
    w("## The admin at production size: a million runs, pages that stay fast")
    w("")
    if a.get("skipped"):
        w(f"`bench/admin_scale.py` was skipped: {a['skipped']} (it needs PostgreSQL).")
        w("")
        return
    small, large = (str(s) for s in (a["sizes"][0], a["sizes"][-1]))
    t = a["targets"]
    w(
        f"`bench/admin_scale.py`: each page an operator opens, through Django's test client "
        f"(server time: middleware, queries, rendering), on a table of {int(small):,} runs and "
        f"on one of {int(large):,} that grew at the same rate (10,000 runs a day): 1 % dead "
        "with seven causes whose reasons carry their request ids, 1 % waiting, three steps per "
        f"run. Median of {a['reps']} requests per page and size, the sizes alternating. Targets: "
        f"{int(large):,} / {int(small):,} <= {t['ratio']}, at most {t['queries']} queries and "
        f"{t['html_bytes'] // 1000} kB of HTML."
    )
    w("")
    head = f"| page | {int(small):,} runs | {int(large):,} runs | growth | queries | HTML |"
    rule = "| --- | --- | --- | --- | --- | --- |"
    if ten_million:
        head += " 10,000,000 runs |"
        rule += " --- |"
    if before:
        head += f" before ({int(small):,} / {int(large):,}) |"
        rule += " --- |"
    head += " verdict |"
    rule += " --- |"
    w(head)
    w(rule)
    for name, p in a["pages"].items():
        m = p["median_s"]
        row = (
            f"| {name} | {_ms(m[small])} | {_ms(m[large])} | {p['ratio']:.2f}x | "
            f"{p['queries'][large]} | {p['html_bytes'][large] / 1000:.0f} kB |"
        )
        if ten_million:
            q = ten_million["pages"].get(name)
            row += f" {_ms(q['median_s'][str(ten_million['sizes'][-1])])} |" if q else " - |"
        if before:
            b = before["pages"].get(name)
            row += (
                f" {_ms(b['median_s'][small])} / {_ms(b['median_s'][large])} ({b['ratio']:.1f}x) |"
                if b
                else " - |"
            )
        row += f" {_v(p['met'])} |"
        w(row)
    w("")
    met = sum(p["met"] for p in a["pages"].values())
    w(f"{met} of {len(a['pages'])} pages within target.")
    w("")


def _compaction_section(w: Any, cp: dict[str, Any]) -> None:
    """bench/compaction.py's figures, as far as this renderer knows its results (all lines or
    none: a result written by another version of the benchmark gets a pointer instead)."""
    lines: list[str] = []
    try:
        b = cp["billed_input_tokens_at"]
        lines += [
            f"`bench/compaction.py`: one run of {cp['turns']:,} model turns ({cp['engine']}, "
            f"thinking {'on' if cp['thinking'] else 'off'}) with server-side compaction: "
            f"{cp['compactions']} compactions, one every "
            f"{cp['turns_between_compactions']:.0f} turns (trigger "
            f"{cp['trigger_input_tokens']} input tokens).",
            "",
            "Input tokens billed per call at turns "
            + ", ".join(f"{t}: {v:.0f}" for t, v in b.items())
            + f"; the whole transcript is {cp['whole_transcript_tokens']} tokens.",
            "",
            f"Time per step around turn {cp['turns']:,} vs around turn 50: "
            f"{cp['around_end']['step_ms']:.2f} vs {cp['around_50_fresh']['step_ms']:.2f} ms, "
            f"ratio {cp['step_ratio']:.2f} ({_v(cp['step_met'])}, <= 1.2); over a compaction "
            f"cycle: ratio {cp['cycle_ratio']:.2f} ({_v(cp['cycle_met'])}).",
        ]
    except (KeyError, TypeError, ValueError, AttributeError):
        lines = [
            "Its figures are in `bench/out/compaction.json` (this renderer does not know them)."
        ]
    w("## Compaction")
    w("")
    for line in lines:
        w(line)
    w("")


class Row(NamedTuple):
    """One line of the Targets table, as rendered text."""

    id: str
    name: str
    value: str
    reference: str
    ratio: str
    goal: str
    verdict: str


def _row_1(r: dict[str, Any]) -> list[Row]:
    loop = r["loop"]
    return [
        Row(
            "1",
            "loop overhead vs in-memory loop",
            f"{loop['durable_ms_per_run']:.1f} ms/run",
            f"{loop['inmemory_ms_per_run']:.1f} ms/run",
            f"{loop['ratio']:.2f}",
            "<= 1.5",
            _v(loop["met"]),
        )
    ]


def _row_2a(r: dict[str, Any]) -> list[Row]:
    peers = r["peers"]
    return [
        Row(
            "2a",
            "speed vs DBOS Transact",
            f"{peers['durable_steps_per_s']:.0f} steps/s",
            f"{peers['dbos_steps_per_s']:.0f} steps/s",
            f"{peers['dbos_speedup']:.2f}x",
            f">= {DBOS_TARGET:g}x",
            _v(peers["dbos_met"]),
        )
    ]


def _row_2b(r: dict[str, Any]) -> list[Row]:
    peers = r["peers"]
    return [
        Row(
            "2b",
            "one-step throughput vs django-q2",
            f"{peers['durable_one_step_runs_per_s']:.1f} runs/s",
            f"{peers['q2_tasks_per_s']:.1f} tasks/s",
            f"{peers['q2_speedup']:.2f}x",
            ">= 3x",
            _v(peers["q2_met"]),
        )
    ]


def _row_3(r: dict[str, Any]) -> list[Row]:
    c = r["commit"]
    return [
        Row(
            "3",
            "commit floor: append_step vs raw INSERT+UPDATE tx (p50)",
            f"{c['append_step']['p50_ms']:.3f} ms",
            f"{c['raw_tx']['p50_ms']:.3f} ms",
            f"{c['ratio_p50']:.2f}",
            "<= 2",
            _v(c["met"]),
        )
    ]


def _row_4(r: dict[str, Any]) -> list[Row]:
    s = r["scale"]
    return [
        Row(
            "4",
            f"claim p99, {s['finished_large']:,} vs 1,000 finished runs",
            f"{s['large']['p99_ms']:.2f} ms",
            f"{s['small']['p99_ms']:.2f} ms",
            f"{s['p99_ratio']:.2f}",
            "<= 1.2",
            _v(s["met"]),
        )
    ]


def _row_5(r: dict[str, Any]) -> list[Row]:
    wk = r["workers"]
    best = max((x for x in wk["configs"] if x["workers"] == 8), key=lambda x: x["speedup"])
    return [
        Row(
            "5",
            f"8 workers vs 1 ({wk['cpus']} CPUs), best of processes/slots",
            f"{best['steps_per_s']:.0f} steps/s ({best['procs']}x{best['concurrency']})",
            f"{best.get('baseline_steps_per_s', wk['configs'][0]['steps_per_s']):.0f} steps/s",
            f"{wk['best_speedup_8']:.2f}x",
            ">= 1.6x",
            _v(wk["met"]),
        )
    ]


def _row_6a(r: dict[str, Any]) -> list[Row]:
    lr = r["longrun"]
    return [
        Row(
            "6a",
            f"time per step at steps {'-'.join(map(str, lr.get('window', [lr['steps']])))} vs 2-21",
            f"{lr['step_ms_at_end']:.2f} ms",
            f"{lr['step_ms_at_10']:.2f} ms",
            f"{lr['step_ratio']:.2f}",
            "<= 1.2",
            _v(lr["step_met"]),
        )
    ]


def _row_6b(r: dict[str, Any]) -> list[Row]:
    lr = r["longrun"]
    return [
        Row(
            "6b",
            f"cold rebuild of a {lr['steps'] + 1}-step run vs raw SELECT (p50)",
            f"{lr['rebuild']['p50_ms']:.1f} ms",
            f"{lr['raw_select']['p50_ms']:.1f} ms",
            f"{lr['rebuild_ratio']:.2f}",
            "<= 1.5",
            _v(lr["rebuild_met"]),
        )
    ]


def _row_7(r: dict[str, Any]) -> list[Row]:
    mem = r["memory"]
    return [
        Row(
            "7",
            f"worker RSS growth over {mem['runs']:,} runs",
            f"{mem['rss_end_kb'] / 1024:.1f} MB",
            f"{mem['rss_warm_kb'] / 1024:.1f} MB (after {mem['rss_warm_at_runs']} runs)",
            f"{mem['growth_from_warm'] * 100:+.1f} %",
            "<= 10 %",
            _v(mem["met"]),
        )
    ]


def _row_waits(r: dict[str, Any]) -> list[Row]:
    c, k = r["waits"].get("claim"), r["waits"].get("wake")
    rows = []
    if c:
        rows.append(
            Row(
                "W1",
                f"claim p99, {c['waiting']:,} waiting runs vs none",
                f"{c['with_waiting']['p99_ms']:.2f} ms",
                f"{c['none']['p99_ms']:.2f} ms",
                f"{c['p99_ratio']:.2f}",
                "<= 1.2",
                _v(c["met"]),
            )
        )
    if k:
        rows.append(
            Row(
                "W2",
                f"send_event waking {k['runs']:,} runs: UPDATE agent_run statements",
                f"{k['agent_run_updates']}",
                f"{k['woken']:,} runs woken",
                "-",
                "1",
                _v(k["agent_run_updates"] == 1),
            )
        )
    return rows


def _row_quota(r: dict[str, Any]) -> list[Row]:
    q = r["quota_rpm"]
    a = q["after"]
    return [
        Row(
            "Q",
            f"{a['runs']} runs on a {q['rpm']} rpm quota: makespan vs ideal",
            f"{a['makespan_s']:.1f} s, {a['rejected_429']} 429s, {a['dead_or_failed']} dead",
            f"{a['ideal_s']:.1f} s",
            f"{a['makespan_ratio']:.2f}",
            "<= 1.1",
            _v(q["met"]),
        )
    ]


def _row_keys_crash(r: dict[str, Any]) -> list[Row]:
    kc = r["keys_crash"]
    return [
        Row(
            "K",
            f"{kc['keys']} keys of limit {kc['limit']}, a worker SIGKILLed: peak in flight per key",
            f"{kc['max_peak']}",
            f"{kc['succeeded']} of {kc['runs']} runs succeeded",
            "-",
            f"<= {kc['limit']}, all succeed",
            _v(kc["met"]),
        )
    ]


_ROWS = (
    ("loop", _row_1),
    ("peers", _row_2a),
    ("peers", _row_2b),
    ("commit", _row_3),
    ("scale", _row_4),
    ("workers", _row_5),
    ("longrun", _row_6a),
    ("longrun", _row_6b),
    ("memory", _row_7),
    ("waits", _row_waits),
    ("quota_rpm", _row_quota),
    ("keys_crash", _row_keys_crash),
)


def target_rows(r: dict[str, Any], lenient: bool = False) -> list[Row]:
    """The Targets table's rows for the results ``r`` (benchmark name -> its JSON), in order.

    A benchmark without results gives no row. ``lenient`` skips a row whose figures are
    missing or malformed (results written by an older bench) instead of raising.
    """
    rows: list[Row] = []
    for name, build in _ROWS:
        if not r.get(name):
            continue
        try:
            rows += build(r)
        except (KeyError, TypeError, ValueError, IndexError):
            if not lenient:
                raise
    return rows


def _before_after(w: Any, r: dict[str, Any], m: dict[str, Any]) -> None:
    """The "Before and after" section, if bench/out/before/ holds results."""
    before_dir = common.OUT / "before"
    if not before_dir.is_dir():
        return
    b = {f.stem: json.loads(f.read_text()) for f in sorted(before_dir.glob("*.json"))}
    ref = b.pop("ref", {})
    b.pop("machine", None)
    if not b:
        return
    after = {row.id: row for row in target_rows(r)}
    pairs = [(row, after[row.id]) for row in target_rows(b, lenient=True) if row.id in after]
    if not pairs:
        return
    g = m.get("git") or {}
    dirty = g.get("durable_agents_dirty") or []
    w("## Before and after: many runs in flight on a few connections")
    w("")
    w(
        f"Before: git {ref.get('ref', '?')} ({ref.get('short_sha', '?')}), measured by that "
        f"commit's own bench code in a temporary worktree; after: git {g.get('head', '?')}"
        + (" plus uncommitted changes to durable_agents/" if dirty else "")
        + ", this tree."
        + (" **The before run failed: its column is partial.**" if ref.get("failed") else "")
    )
    w("")
    if ref.get("invocation") and ref.get("invocation") == m.get("invocation"):
        w(
            "Each column's ratios were measured side by side within its own run; both columns "
            "come from the same `make bench` invocation, minutes apart (before first)."
        )
    else:
        w(
            "Each column's ratios were measured side by side within its own run; **the before "
            f"column comes from an earlier invocation ({ref.get('date', 'date unknown')})**, "
            "not from the one that measured the after column."
        )
    w("")
    w(
        "| # | target | goal | before: ratio (value) | after: ratio (value) "
        "| before verdict | after verdict |"
    )
    w("| --- | --- | --- | --- | --- | --- | --- |")
    for old, new in pairs:
        w(
            f"| {new.id} | {new.name} | {new.goal} | {old.ratio} ({old.value}) "
            f"| {new.ratio} ({new.value}) | {old.verdict} | {new.verdict} |"
        )
    w("")


def _la(v: Any) -> str:
    return "/".join(f"{x:.2f}" for x in v) if v else "?"


def _fl(v: list[float]) -> str:
    return ", ".join(f"{x:.2f}" for x in v)


def _ev(d: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in list(d.items())[:3]) or "-"


def print_section(name: str) -> None:
    """Print one section (``admin_scale``, or ``fleet``: quota and keys_crash) for splicing into docs/benchmarks.md by hand: a
    fresh checkout lacks the older benchmarks' JSON, so the page is not re-rendered whole."""
    lines: list[str] = []
    if name == "fleet":
        r = {
            n: d
            for n in ("quota_rpm", "quota_itpm", "keys_crash", "keys_crash_slow")
            if (d := _load(n))
        }
        _fleet_sections(lines.append, r)
    if name == "encryption":
        e = _load("encryption")
        if e is None:
            raise SystemExit("no bench/out/encryption.json: run python -m bench.encryption")
        encryption_section(lines.append, e)
    if name in MORE_NAMES:
        more_sections(lines.append, {name: _load(name)})
    if name == "admin_scale":
        a = _load("admin_scale")
        if a is None:
            raise SystemExit("no bench/out/admin_scale.json: run python -m bench.admin_scale")
        admin_scale_section(lines.append, a, _load("admin_scale_10m"), _load("admin_scale_before"))
    print("\n".join(lines))


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["--section"]:
        print_section(sys.argv[2])
    else:
        print(render())
