"""Where the time of a durable step goes.

Runs the standard workload in this process, one run at a time, the way a worker slot does
(``Store.claim_runs``, then ``runner.advance_run`` whose last step claims the next run, with a
listener feeding the inbox hint as a worker's does), with:
  * the CPU time of this process per step, nothing patched (the fake API answers from a
    process of its own, so this is the worker path's CPU: claim, rebuild, request body, the
    SDK call, parsing, commit), the least of three passes;
  * wall-clock buckets around claim, step-log load, pinning (fingerprint), model call (SDK +
    HTTP + fake server), tool dispatch (effect lookup + the tool), commit (``append_step``),
    finish; the rest of ``advance_run`` is "runner overhead";
  * the exact number of client/server round trips per run and per step, counted from libpq's
    protocol trace (each Query or Sync message from the client is one round trip);
  * cProfile of the whole, top functions by cumulative and by own time;
  * the cost of the INFO log line per step (the default level outside the benchmarks).

``--calls N``: each turn but the last asks for N calls of the pure tool instead of one (a turn
of several calls still makes one tool_result step, so the figures stay per step).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import logging
import os
import pstats
import re
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

from bench import common
from bench.common import log

DB = "da_bench_profile"


class Buckets:
    def __init__(self) -> None:
        self.t: dict[str, float] = defaultdict(float)
        self.n: dict[str, int] = defaultdict(int)

    def wrap(self, name: str, fn: Any) -> Any:
        def wrapped(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.t[name] += time.perf_counter() - t
                self.n[name] += 1

        wrapped.__wrapped__ = fn  # type: ignore[attr-defined]
        return wrapped


def _patch(buckets: Buckets) -> list[tuple[Any, str, Any]]:
    from durable_agents import llm, store
    from durable_agents.engine import runner

    undo = []

    def patch(obj: Any, attr: str, name: str) -> None:
        orig = getattr(obj, attr)
        undo.append((obj, attr, orig))
        setattr(obj, attr, buckets.wrap(name, orig))

    # The worker claims, and the runner commits and reads, through the chosen store's methods.
    chosen = store.current()
    patch(chosen, "claim_runs", "claim")
    patch(runner, "load_log", "load_log")
    patch(llm, "create_turn", "model_call")
    patch(chosen, "append_step", "commit")
    patch(chosen, "append_turn_and_results", "commit")
    patch(chosen, "finish_run", "finish")
    patch(chosen, "recorded_effects", "tool:recorded_effects")
    patch(runner.RunAdvancer, "_call_tool", "tool:call")
    patch(runner.RunAdvancer, "_pinned_agent", "pin+fingerprint")
    patch(runner, "advance_run", "advance_run")
    return undo


def _unpatch(undo: list[tuple[Any, str, Any]]) -> None:
    for obj, attr, orig in reversed(undo):
        setattr(obj, attr, orig)


# The worker's knowledge of queued messages, fed by a real listener (``_listening``): a
# model call skips the inbox's look while nothing was heard for the run, as in a worker.
_INBOX: Any = None


@contextlib.contextmanager
def _listening() -> Iterator[None]:
    """A LISTEN connection on its own thread and an ``InboxHint`` it feeds, as a worker has."""
    global _INBOX
    from durable_agents._internal import db
    from durable_agents.engine.inbox_hint import InboxHint

    stopping = threading.Event()
    listener = db.Listener(on_run=lambda: None, on_cancel=lambda run_id: None, stopping=stopping)
    hint = InboxHint(lambda: listener.generation if listener.listening.is_set() else None)
    listener.on_inbox = hint.heard
    thread = threading.Thread(target=listener.serve, name="bench-listener", daemon=True)
    thread.start()
    if not listener.listening.wait(30):
        raise RuntimeError("the listener never listened")
    _INBOX = hint
    try:
        yield
    finally:
        _INBOX = None
        stopping.set()
        thread.join(10)


def _marking(marks: list[Any]) -> Any:
    """A ``NextClaim.take`` that notes the inbox hint's mark before the claim goes out."""

    def take() -> bool:
        marks.append(None if _INBOX is None else _INBOX.mark())
        return True

    return take


def _drain(owner: str) -> int:
    from durable_agents import store
    from durable_agents.engine import runner

    def looked(claim: Any, mark: Any) -> None:
        # As the worker does: what the claim saw in the inbox is the run's last look, begun
        # at the mark taken before the claim went out.
        if _INBOX is not None and mark is not None:
            _INBOX.looked(claim.run_id, mark, found=claim.messages_waiting)

    done = 0
    claim = None
    while True:
        if claim is None:
            mark = None if _INBOX is None else _INBOX.mark()
            claims = store.current().claim_runs(owner, 60, 1)
            if not claims:
                return done
            claim = claims[0]
            looked(claim, mark)
        # As a worker slot does: the last step of a run may claim the next one.
        marks: list[Any] = []
        then = store.NextClaim(owner, 60, take=_marking(marks), give_back=lambda: None)
        disposition = runner.advance_run(claim, then_claim=then, inbox=_INBOX)
        if _INBOX is not None:
            _INBOX.forget(claim.run_id)
        assert disposition == "succeeded", disposition
        done += 1
        claim = then.claim
        if claim is not None and marks:
            looked(claim, marks[-1])


def _ts(text: str) -> float:
    hms = text.split(" ")[-1]
    h, m, sec = hms.split(":")
    return int(h) * 3600 + int(m) * 60 + float(sec)


def parse_trace(text: str) -> tuple[int, dict[str, int], dict[str, float]]:
    """libpq trace -> (round trips, round trips by statement, server+network ms by statement).
    A round trip starts at a client Query or Sync and ends at the server's ReadyForQuery."""
    count: dict[str, int] = defaultdict(int)
    ms: dict[str, float] = defaultdict(float)
    total = 0
    last_sql = ""
    prepared: dict[str, str] = {}
    pending: tuple[float, str] | None = None
    records: list[str] = []
    for line in text.splitlines():
        if re.match(r"\d{4}-\d\d-\d\d ", line) or not records:
            records.append(line)
        else:  # a multi-line statement continues the previous record
            records[-1] += " " + line
    for line in records:
        parts = line.split("\t", 4)
        if len(parts) < 4:
            continue
        ts, direction, _length, msg = parts[:4]
        rest = parts[4] if len(parts) > 4 else ""
        if direction == "F" and msg == "Query":
            last_sql = " ".join(rest.strip().strip('"').split())
        elif direction == "F" and msg == "Parse":
            # Parse "name" "query" ...: a prepared statement is parsed once, then only bound.
            found = re.match(r'\s*"([^"]*)"\s+"(.*)', rest)
            if found:
                last_sql = " ".join(found.group(2).split())
                prepared[found.group(1)] = last_sql
        elif direction == "F" and msg == "Bind":
            found = re.match(r'\s*"[^"]*"\s+"([^"]*)"', rest)
            if found and found.group(1):
                # Prepared before the trace began (warm-up): only the step commit runs on a
                # preparing cursor; every other statement goes through Django's cursor.
                last_sql = prepared.get(found.group(1), "WITH fence (prepared earlier)")
        if direction == "F" and msg in ("Query", "Sync"):
            total += 1
            kind = _classify(last_sql)
            count[kind] += 1
            pending = (_ts(ts), kind)
        elif direction == "B" and msg == "ReadyForQuery" and pending:
            ms[pending[1]] += (_ts(ts) - pending[0]) * 1000
            pending = None
    return total, dict(count), dict(ms)


def count_round_trips(runs: int, calls: int = 1) -> dict[str, Any]:
    """Trace libpq on the Django connection while ``runs`` runs execute."""
    from django.db import connection

    common.start_runs(runs, calls=calls)
    connection.ensure_connection()
    pgconn = connection.connection.pgconn
    fd, path = tempfile.mkstemp(prefix="da_bench_trace")
    try:
        pgconn.trace(fd)
        _drain("bench-trace")
        pgconn.untrace()
        os.close(fd)
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    finally:
        os.unlink(path)
    total, kinds, ms = parse_trace(text)
    steps = runs * (2 * common.TURNS - 1)
    return {
        "runs": runs,
        "round_trips": total,
        "per_run": total / runs,
        "per_step": total / steps,
        "by_statement_per_run": {
            k: v / runs for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])
        },
        "db_ms_per_run_by_statement": {
            k: v / runs for k, v in sorted(ms.items(), key=lambda kv: -kv[1])
        },
        "db_ms_per_run": sum(ms.values()) / runs,
    }


def _classify(sql: str) -> str:
    s = sql.upper()
    if s.startswith("BEGIN"):
        return "BEGIN"
    if s.startswith("COMMIT"):
        return "COMMIT"
    if "WITH FENCE" in s and "TAKEN AS" in s:
        return "append_step of a last step + next claim (CTE)"
    if "WITH FENCE" in s:
        return "append_step (CTE)"
    if "FOR NO KEY UPDATE" in s or ("SELECT" in s and "SKIP LOCKED" in s):
        return "claim (... FOR NO KEY UPDATE SKIP LOCKED)"
    if s.startswith("SET "):
        return "SET"
    if "STRING_AGG" in s or s.startswith('SELECT "AGENT_STEP"'):
        return "load_log SELECT"
    if s.startswith('SELECT "AGENT_RUN"'):
        return "SELECT agent_run"
    if s.startswith('SELECT "TOOL_EFFECT"'):
        return "recorded_effects SELECT"
    if s.startswith('UPDATE "AGENT_RUN"'):
        return "UPDATE agent_run (finish_run, renew, release)"
    if s.startswith('UPDATE "AGENT_RUN"') or s.startswith("UPDATE AGENT_RUN"):
        return "UPDATE agent_run"
    return sql[:50]


def run(runs: int, calls: int = 1) -> dict[str, Any]:
    url = common.fresh_db(DB)
    with common.fake_api() as base_url, contextlib.ExitStack() as stack:
        common.setup_django(url, base_url)
        stack.enter_context(_listening())
        common.start_runs(3)
        _drain("warm")  # imports, connection, SDK client

        # 0. CPU of this process (the worker path: the fake API is a process of its own),
        # nothing patched; the least of three passes.
        cpu_passes = []
        for n in range(3):
            common.start_runs(runs, calls=calls)
            cpu = time.process_time()
            _drain(f"bench-cpu-{n}")
            cpu_passes.append(time.process_time() - cpu)

        # 1. buckets
        buckets = Buckets()
        common.start_runs(runs, calls=calls)
        undo = _patch(buckets)
        t = time.perf_counter()
        _drain("bench-buckets")
        wall = time.perf_counter() - t
        _unpatch(undo)

        # 2. round trips
        trips = count_round_trips(max(5, runs // 10), calls)

        # 3. cProfile
        common.start_runs(runs, calls=calls)
        prof = cProfile.Profile()
        prof.enable()
        _drain("bench-cprofile")
        prof.disable()
        out = io.StringIO()
        st = pstats.Stats(prof, stream=out)
        st.sort_stats("cumulative").print_stats(40)
        out.write("\n---- by own time ----\n")
        st.sort_stats("tottime").print_stats(25)
        (common.OUT / "profile_step.txt").parent.mkdir(parents=True, exist_ok=True)
        (common.OUT / "profile_step.txt").write_text(out.getvalue())

        # 4. logging at INFO (to a null handler-less stream) vs WARNING
        da_logger = logging.getLogger("durable_agents")
        devnull = open(os.devnull, "w")  # noqa: SIM115 - closed below
        handler = logging.StreamHandler(devnull)
        handler.setFormatter(
            logging.Formatter("%(asctime)s %(levelname)s [run=%(run_id)s] %(name)s: %(message)s")
        )
        from durable_agents.logging import RunIdFilter

        handler.addFilter(RunIdFilter())
        timings = {}
        for level in ("WARNING", "INFO", "WARNING", "INFO"):
            common.start_runs(runs, calls=calls)
            da_logger.setLevel(level)
            saved = da_logger.handlers[:]
            da_logger.handlers = [handler]
            da_logger.propagate = False
            t = time.perf_counter()
            _drain(f"bench-log-{level}")
            timings.setdefault(level, []).append(time.perf_counter() - t)
            da_logger.handlers = saved
            da_logger.propagate = True
        da_logger.setLevel("WARNING")
        devnull.close()

    steps = runs * (2 * common.TURNS - 1)
    total_ms = wall * 1000
    named = {k: v * 1000 for k, v in buckets.t.items()}
    inner = sum(v for k, v in named.items() if k not in ("advance_run", "claim"))
    per_step = {k: named[k] / steps for k in named if k != "advance_run"}
    per_step["runner overhead (rest of advance_run)"] = (named["advance_run"] - inner) / steps
    per_step["outside advance_run (loop)"] = (
        total_ms - named["advance_run"] - named["claim"]
    ) / steps
    res = {
        "runs": runs,
        "calls_per_turn": calls,
        "steps": steps,
        "wall_ms_per_run": total_ms / runs,
        "wall_ms_per_step": total_ms / steps,
        "cpu_ms_per_step": min(cpu_passes) * 1000 / steps,
        "cpu_ms_per_step_passes": [c * 1000 / steps for c in cpu_passes],
        "ms_per_step": dict(sorted(per_step.items(), key=lambda kv: -kv[1])),
        "ms_per_run": {k: v / runs for k, v in named.items()},
        "calls_per_run": {k: v / runs for k, v in buckets.n.items()},
        "round_trips": trips,
        "log_info_ms_per_step": (min(timings["INFO"]) - min(timings["WARNING"])) * 1000 / steps,
        "log_runs_s": timings,
    }
    log(
        f"[profile] CPU of the worker path {res['cpu_ms_per_step']:.3f} ms/step"
        + (f" ({calls} calls a turn)" if calls != 1 else "")
        + " (least of "
        + ", ".join(f"{c:.3f}" for c in res["cpu_ms_per_step_passes"])
        + ")"
    )
    log(f"[profile] {res['wall_ms_per_run']:.2f} ms/run, {res['wall_ms_per_step']:.3f} ms/step:")
    for k, v in res["ms_per_step"].items():
        log(f"    {k:42s} {v:7.3f} ms/step")
    log(f"  round trips: {trips['per_run']:.1f}/run, {trips['per_step']:.2f}/step")
    for k, v in trips["by_statement_per_run"].items():
        log(
            f"    {k:50s} {v:5.1f}/run  {trips['db_ms_per_run_by_statement'].get(k, 0):7.2f} ms/run"
        )
    log(f"  INFO logging adds {res['log_info_ms_per_step']:.3f} ms/step")
    return res


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=100)
    p.add_argument("--calls", type=int, default=1, help="pure calls a turn asks for")
    a = p.parse_args(argv)
    res = run(a.runs, a.calls)
    return common.finish("profile_step", res, DB)


if __name__ == "__main__":
    main()
