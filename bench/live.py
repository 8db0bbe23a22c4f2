"""Live streams: 1,000 readers of 100 live runs in one asyncio process (PostgreSQL only).

    python -m bench.live                      # 100 runs of 45 turns, 1,000 readers: ~2 min
    python -m bench.live --runs 20 --readers 200 --turns 10     # a quick look

Workload: ``--runs`` runs of the ``bench`` agent (``--turns`` model turns, one pure tool call
per turn but the last; the agent stops at 50) against ``bench/slowapi.py`` answering each call
after a uniform random ``--latency`` (0.3-0.5 s by default), so that a run stays live for tens
of seconds. One worker process, ``runagents --concurrency <runs>``, advances them all at once.
The same workload runs twice, side by side in this one invocation:

  * ``no readers``: the runs are bulk-inserted, then the worker is started;
  * ``readers``: the runs are bulk-inserted, ``--readers`` asyncio tasks of this process
    follow them (``durable_agents.live.stream``, the same number on each run) and, once every
    reader has had the runs' first status event, the worker is started.

Figures:

  * latency, per step and reader: the time the reader was given the step event minus the
    step's ``agent_step.created_at`` (the database clock; its offset to this process's clock
    is read once, from the midpoint of a ``SELECT clock_timestamp()``), for the steps the
    worker committed (seq > 0). Target p99 < 250 ms;
  * connections: the most PostgreSQL backends with this process's hub ``application_name``
    seen while the readers followed (sampled every 50 ms). Target <= 2;
  * resuming: ``--resumers`` readers more each read a few events, go away for ``--away``
    seconds (10 by default) and resume after the last id they had; each must end with every
    step of its run in the database exactly once, in order;
  * the worker's throughput: committed steps over the span from the first worker-committed
    step to the last finished run (database clock), with and without the readers, as a ratio.
    Target within 1.1x. With the latency the worker waits on the model most of the time: the
    ratio says whether readers slow the worker's commits, not how fast a worker is.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import threading
import time
from collections import defaultdict
from typing import Any

from bench import common
from bench.common import log

DB = "da_bench_live"
APP_NAME = "da_bench_live_readers"
POLL_MS = 100  # durable_agents.live.hub.POLL_SECONDS


class ConnectionSampler(threading.Thread):
    """The most backends of the readers' process (by application_name) seen at once."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.stop = threading.Event()
        self.peak = 0
        self.samples = 0

    def run(self) -> None:
        import psycopg

        with psycopg.connect(self.url, autocommit=True) as conn:
            while not self.stop.is_set():
                n = conn.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s",
                    [APP_NAME],
                ).fetchone()[0]
                self.peak = max(self.peak, n)
                self.samples += 1
                time.sleep(0.05)


def clock_offset(url: str) -> float:
    """The database clock minus this process's clock (seconds), from a midpoint read."""
    import psycopg

    best: tuple[float, float] | None = None
    with psycopg.connect(url, autocommit=True) as conn:
        for _ in range(20):
            t0 = time.time()
            db = conn.execute("SELECT EXTRACT(EPOCH FROM clock_timestamp())").fetchone()[0]
            t1 = time.time()
            if best is None or t1 - t0 < best[0]:
                best = (t1 - t0, float(db) - (t0 + t1) / 2)
    assert best is not None
    return best[1]


def start_worker(url: str, base_url: str, slots: int) -> subprocess.Popen[Any]:
    worker = common.runagents(url, base_url, "--concurrency", str(slots), "--poll-interval", "0.05")
    common.wait_backends(url, 1)
    return worker


def wait_done(url: str, limit: float = 600) -> None:
    common.wait_finished(url, limit)


throughput = common.throughput


def run_ids(url: str) -> list[Any]:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        return [r[0] for r in conn.execute("SELECT id FROM agent_run ORDER BY id")]


def steps_by_run(url: str) -> dict[Any, dict[int, float]]:
    """Every worker-committed step's created_at (epoch seconds, database clock), by run."""
    import psycopg

    out: dict[Any, dict[int, float]] = defaultdict(dict)
    with psycopg.connect(url, autocommit=True) as conn:
        for run_id, seq, at in conn.execute(
            "SELECT run_id, seq, EXTRACT(EPOCH FROM created_at) FROM agent_step"
        ):
            out[run_id][seq] = float(at)
    return out


def fresh_runs(url: str, runs: int, turns: int) -> None:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("TRUNCATE agent_run CASCADE")
    common.bulk_insert_runs(url, runs, turns)


def no_readers(url: str, base_url: str, runs: int, turns: int) -> dict[str, Any]:
    fresh_runs(url, runs, turns)
    worker = start_worker(url, base_url, runs)
    try:
        wait_done(url)
    finally:
        code = common.stop(worker, 30)
    if code:
        raise RuntimeError(f"worker exit code {code}")
    return throughput(url)


async def _follow(run_id: Any, got: list[tuple[Any, int, float]], ready: asyncio.Event) -> int:
    from durable_agents.live import stream

    n = 0
    async for event in stream(run_id):
        if event.type == "status":
            ready.set()
        elif event.type == "step":
            got.append((run_id, event.data["seq"], time.time()))
        n += 1
    return n


async def _resume(run_id: Any, away: float, started: asyncio.Event) -> tuple[list[int], int]:
    """Read until the worker committed a step, go away, come back after the last id."""
    from durable_agents.live import stream

    seqs: list[int] = []
    last: str | None = None
    events = stream(run_id)
    async for event in events:
        last = event.id
        if event.type == "step":
            seqs.append(event.data["seq"])
            if event.data["seq"] >= 1:
                break
        if event.type == "status":
            started.set()
    await events.aclose()
    gone_at = len(seqs)
    await asyncio.sleep(away)
    async for event in stream(run_id, after=last):
        if event.type == "step":
            seqs.append(event.data["seq"])
    return seqs, gone_at


async def with_readers_async(
    url: str, base_url: str, readers: int, resumers: int, away: float, runs: int
) -> dict[str, Any]:
    from durable_agents.live.hub import Hub

    ids = run_ids(url)
    # How long each of the hub's polls takes (its query of the watched runs, a read of each
    # run that moved, the broadcast): a step waits for the poll after its commit, whole.
    ticks: list[float] = []
    poll_once = Hub._poll_once

    async def timed_poll(hub: Hub) -> None:
        t0 = time.perf_counter()
        await poll_once(hub)
        ticks.append(time.perf_counter() - t0)

    Hub._poll_once = timed_poll  # type: ignore[method-assign]
    # And how much of it is the reads themselves, on the hub's thread.
    from durable_agents.live import hub as live_hub

    read_time: list[float] = []
    events_after_many = live_hub.events_after_many

    def timed_read(*args: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return events_after_many(*args)
        finally:
            read_time.append(time.perf_counter() - t0)

    live_hub.events_after_many = timed_read  # type: ignore[assignment]
    got: list[tuple[Any, int, float]] = []
    readies = [asyncio.Event() for _ in range(readers + resumers)]
    tasks = [
        asyncio.ensure_future(_follow(ids[i % len(ids)], got, readies[i])) for i in range(readers)
    ]
    resuming = [
        asyncio.ensure_future(_resume(ids[i % len(ids)], away, readies[readers + i]))
        for i in range(resumers)
    ]
    t = time.perf_counter()
    for ready in readies:
        await asyncio.wait_for(ready.wait(), 120)
    joined = time.perf_counter() - t
    sampler = ConnectionSampler(url)
    sampler.start()
    worker = await asyncio.to_thread(start_worker, url, base_url, runs)
    try:
        counts = await asyncio.wait_for(asyncio.gather(*tasks), 600)
        resumed = await asyncio.wait_for(asyncio.gather(*resuming), 600)
        await asyncio.to_thread(wait_done, url)
    finally:
        code = await asyncio.to_thread(common.stop, worker, 30)
        sampler.stop.set()
    sampler.join()
    if code:
        raise RuntimeError(f"worker exit code {code}")
    hub = Hub.current()
    hub_left = len(hub.watches)
    await asyncio.to_thread(hub.close)
    return {
        "got": got,
        "events": sum(counts),
        "resumed": list(zip(ids[:resumers], resumed, strict=False)),
        "join_s": joined,
        "peak_connections": sampler.peak,
        "connection_samples": sampler.samples,
        "hub_watches_left": hub_left,
        "poll": common.summary_ms(ticks),
        "poll_total_s": sum(ticks),
        "reads": common.summary_ms(read_time),
        "reads_total_s": sum(read_time),
    }


def with_readers(
    url: str, base_url: str, runs: int, turns: int, readers: int, resumers: int, away: float
) -> dict[str, Any]:
    fresh_runs(url, runs, turns)
    offset = clock_offset(url)
    r = asyncio.run(with_readers_async(url, base_url, readers, resumers, away, runs))
    steps = steps_by_run(url)
    latencies = [at + offset - steps[run_id][seq] for run_id, seq, at in r.pop("got") if seq > 0]
    missed = 0
    twice = 0
    for run_id, (seqs, _gone_at) in r.pop("resumed"):
        expected = sorted(steps[run_id])
        missed += len(set(expected) - set(seqs))
        twice += len(seqs) - len(set(seqs))
        if seqs != expected:
            missed += 1 if set(seqs) == set(expected) else 0  # out of order counts too
    r.update(throughput(url))
    r["latency"] = common.summary_ms(latencies)
    r["negative_latencies"] = sum(1 for x in latencies if x < 0)
    r["clock_offset_ms"] = offset * 1000
    r["resume_missed"] = missed
    r["resume_twice"] = twice
    r["resumers"] = resumers
    return r


def run(a: argparse.Namespace) -> dict[str, Any]:
    url = common.fresh_db(DB)
    latency = ["--latency", a.latency]
    with common.serving(["bench.slowapi", "--port", "0", *latency], "slow fake API") as base_url:
        common.setup_django(url, base_url)
        from django.conf import settings

        # Before this process's first connection: its backends carry the name.
        settings.DATABASES["default"].setdefault("OPTIONS", {})["application_name"] = APP_NAME
        log(f"  {a.runs} runs x {a.turns} turns, model latency {a.latency} s")
        alone = no_readers(url, base_url, a.runs, a.turns)
        log(f"  no readers: {alone['steps_per_s']:.1f} steps/s ({alone['steps']} steps)")
        live = with_readers(url, base_url, a.runs, a.turns, a.readers, a.resumers, a.away)
        log(f"  {a.readers} readers: {live['steps_per_s']:.1f} steps/s ({live['steps']} steps)")
    lat = live["latency"]
    ratio = alone["steps_per_s"] / live["steps_per_s"]
    res = {
        "runs": a.runs,
        "turns": a.turns,
        "readers": a.readers,
        "model_latency_s": a.latency,
        "alone": alone,
        "live": live,
        "slowdown": ratio,
        "met_latency": lat["p99_ms"] < 250,
        "met_connections": live["peak_connections"] <= 2,
        "met_resume": live["resume_missed"] == 0 and live["resume_twice"] == 0,
        "met_throughput": ratio <= 1.1,
    }
    log(
        f"[live] {a.readers} readers of {a.runs} runs, {lat['n']} step deliveries: "
        f"p50 {lat['p50_ms']:.0f} ms, p90 {lat['p90_ms']:.0f} ms, p99 {lat['p99_ms']:.0f} ms, "
        f"max {lat['max_ms']:.0f} ms (clock offset {live['clock_offset_ms']:.2f} ms) -> "
        f"{common.verdict(res['met_latency'])} (p99 < 250 ms)"
    )
    poll = live["poll"]
    log(
        f"[live] the hub's polls ({poll['n']}): p50 {poll['p50_ms']:.0f} ms, p99 "
        f"{poll['p99_ms']:.0f} ms, max {poll['max_ms']:.0f} ms each (started {POLL_MS} ms "
        "apart); "
        f"of their {live['poll_total_s']:.1f} s, {live['reads_total_s']:.1f} s reading runs "
        f"({live['reads']['n']} reads, p50 {live['reads']['p50_ms']:.1f} ms; catch-ups included)"
    )
    log(
        f"[live] readers' process held at most {live['peak_connections']} PostgreSQL "
        f"connection(s) ({live['connection_samples']} samples) -> "
        f"{common.verdict(res['met_connections'])} (<= 2)"
    )
    log(
        f"[live] {a.resumers} readers away {a.away:.0f} s and resumed: missed "
        f"{live['resume_missed']}, twice {live['resume_twice']} -> "
        f"{common.verdict(res['met_resume'])}"
    )
    log(
        f"[live] worker {alone['steps_per_s']:.1f} steps/s alone, {live['steps_per_s']:.1f} "
        f"with {a.readers} readers: {ratio:.3f}x -> {common.verdict(res['met_throughput'])} "
        f"(<= 1.1x)"
    )
    return res


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=100)
    p.add_argument("--turns", type=int, default=45)
    p.add_argument("--readers", type=int, default=1000)
    p.add_argument("--resumers", type=int, default=10)
    p.add_argument("--away", type=float, default=10.0)
    p.add_argument("--latency", default="0.3-0.5")
    a = p.parse_args(argv)
    res = run(a)
    return common.finish("live", res, DB)


if __name__ == "__main__":
    main()
