"""Long transcripts: one run of 5,000 model turns with server-side compaction about every 200
turns, through the real runner and store, the offline model behind the SDK (its in-process
transport: it checks every thinking signature it reads and drops what precedes the last
compaction block, as the API does).

    python -m bench.compaction                    # PostgreSQL (BENCH_PG, or DATABASE_URL's server)
    DATABASE_URL=sqlite:////tmp/x.sqlite3 python -m bench.compaction   # SQLite
    python -m bench.compaction --turns 1000 --every 100

What it shows: with compaction, the cost of a call does not grow with the run. Figures:

- input tokens billed per call (input, cache writes and reads, of every pass) at turns ~50,
  ~2,500 and ~5,000, and their mean over the 200 turns up to each (a whole compaction cycle);
  next to them what the last call would bill without compaction (the whole transcript);
- time per step around turn 50 (turns 25-75) and around turn 5,000 (the last 50 turns) and
  their ratio (target: within 1.2x), also split into the model call (offline model included)
  and the rest (durable_agents: commit, history, tool); and the same over a whole compaction
  cycle at each end (turns 1-200 vs the last 200), where the size of what is sent is
  comparable: the target's like-for-like figure.

The trigger is calibrated first, without the database, from the offline model's own token
estimate of a few turns, so that one compaction falls about every ``--every`` turns.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from bench import common
from bench.common import log

DB = "da_bench_compaction"
SQLITE_PATH = Path("/tmp/da_bench_compaction.sqlite3")
MODEL = "claude-bench-1"
COMPACT_BETA = "compact-2026-01-12"
SYSTEM = "You are a benchmark agent."
THINKING = {"type": "enabled", "budget_tokens": 128}


def task_text(turns: int) -> str:
    """``turns`` model turns: ``turns - 1`` calls of the pure tool, then the final answer."""
    return f'Compaction benchmark.\n@@repeat {turns - 1} @noop {{"key": "k"}}'


def compaction_params(trigger: int) -> dict[str, Any]:
    return {
        "context_management": {
            "edits": [
                {
                    "type": "compact_20260112",
                    "trigger": {"type": "input_tokens", "value": trigger},
                    "pause_after_compaction": False,
                }
            ]
        }
    }


def calibrate(every: int, thinking: bool) -> int:
    """A trigger that compacts about every ``every`` turns: the offline model's estimate (the
    JSON of the messages it reads, / 4) after ``every`` turns, measured on a short run played
    in memory (no database) from a compaction on."""
    from durable_agents.offline import ScriptedModel, canonical_bytes

    model = ScriptedModel()
    request: dict[str, Any] = {"model": MODEL, "max_tokens": 256, "system": SYSTEM}
    if thinking:
        request["thinking"] = THINKING
    messages: list[dict[str, Any]] = [{"role": "user", "content": task_text(100)}]
    sizes = []
    for _ in range(40):
        body = json.dumps({**request, "messages": messages}, separators=(",", ":")).encode()
        status, _, out = model.respond("POST", "/v1/messages", {}, body)
        assert status == 200, out
        answer = json.loads(out)
        messages.append({"role": "assistant", "content": answer["content"]})
        calls = [b for b in answer["content"] if b["type"] == "tool_use"]
        messages.append(
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": b["id"], "content": "ok-k"}
                    for b in calls
                ],
            }
        )
        sizes.append(len(canonical_bytes(messages[-2])) + len(canonical_bytes(messages[-1])) + 2)
    per_turn = statistics.fmean(sizes[5:])
    summary = 600  # the compaction block the view starts with (summary and state), in bytes
    return int((summary + every * per_turn) / 4)


class _Probe(common.StepHooks):
    """Times every commit and model call of a claim, and stops the claim (the worker's drain
    flag) after ``limit`` commits."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[tuple[int, str, float, float]] = []  # seq, kind, commit end, commit s
        self.calls: list[tuple[float, int]] = []  # per model call: seconds, bytes of messages

    def append(self, claim: Any, step: Any, *a: Any, **k: Any) -> bool:
        started = time.perf_counter()
        ok = self.orig_append(claim, step, *a, **k)
        end = time.perf_counter()
        self.steps.append((step.seq, str(step.kind), end, end - started))
        if len(self.steps) >= self.limit:
            self.drain.set()
        return ok

    def create(self, params: Any, messages: Any, *a: Any, **k: Any) -> Any:
        started = time.perf_counter()
        out = self.orig_create(params, messages, *a, **k)
        self.calls.append((time.perf_counter() - started, len(messages)))
        return out

    def advance(self, run_id: Any, limit: int) -> tuple[str, list[dict[str, Any]]]:
        """One claim of ``run_id``, stopped after ``limit`` commits. Returns its disposition
        and its steps but the first (which also pays for the claim and the rebuild): seq,
        seconds since the commit before, commit seconds, and for a model turn the call's
        seconds and the bytes of its messages."""
        from durable_agents import store
        from durable_agents.engine import runner

        self.steps, self.calls, self.limit = [], [], limit
        self.drain = threading.Event()
        claim = store.current().claim_run(run_id, "bench-compaction", 3600)
        assert claim is not None
        disposition = runner.advance_run(claim, drain=self.drain)
        calls = iter(self.calls)
        if self.steps and self.steps[0][1] == "model_turn":
            next(calls)  # the first step's call
        out = []
        for (seq, kind, end, commit), (_, _, before, _) in zip(
            self.steps[1:], self.steps, strict=False
        ):
            step: dict[str, Any] = {"seq": seq, "s": end - before, "commit_s": commit}
            step["model_s"], step["bytes"] = next(calls) if kind == "model_turn" else (0.0, 0)
            out.append(step)
        return disposition, out


def _billed(message: dict[str, Any]) -> int:
    """Input tokens billed for one call: uncached, cache writes and reads, of every pass."""
    usage = message.get("usage") or {}
    passes = usage.get("iterations") or [usage]
    keys = ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")
    return sum(int(p.get(k) or 0) for p in passes for k in keys)


def _setup(turns: int) -> tuple[str, str]:
    """Configure Django for a fresh database; returns (engine, url)."""
    url = os.environ.get("DATABASE_URL", "")
    if url.startswith("sqlite"):
        SQLITE_PATH.unlink(missing_ok=True)
        os.environ.update(
            DATABASE_URL=f"sqlite:///{SQLITE_PATH}",
            DJANGO_SETTINGS_MODULE="project.settings",
            DJANGO_DEBUG="0",
        )
        import django
        from django.core.management import call_command

        django.setup()
        call_command("migrate", verbosity=0)
        return "sqlite", os.environ["DATABASE_URL"]
    import psycopg

    base = common.PG_BASE
    if url.startswith("postgres"):
        parts = urlsplit(url)
        base = f"{parts.scheme}://{parts.netloc}"
    with psycopg.connect(f"{base}/postgres", autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{DB}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{DB}"')
    db_url = f"{base}/{DB}"
    common.migrate(db_url)
    common.setup_django(db_url)
    return "postgresql", db_url


def _drop(engine: str, url: str) -> None:
    if engine == "sqlite":
        SQLITE_PATH.unlink(missing_ok=True)
        return
    import psycopg
    from django.db import connections

    connections.close_all()
    base = url.rsplit("/", 1)[0]
    with psycopg.connect(f"{base}/postgres", autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{DB}" WITH (FORCE)')


def _window(values: dict[int, float], first: int, last: int) -> dict[str, Any]:
    picked = [v for t, v in values.items() if first <= t <= last]
    return {
        "turns": [first, last],
        "mean": statistics.fmean(picked) if picked else float("nan"),
        "max": max(picked) if picked else float("nan"),
    }


def _steps(steps: list[dict[str, Any]], first_turn: int, last_turn: int) -> dict[str, float]:
    """Per-step figures (ms) of the steps of turns ``first_turn``..``last_turn`` (a turn t is
    the model turn, seq 2t - 1, and its tool results, seq 2t)."""
    picked = [s for s in steps if 2 * first_turn - 1 <= s["seq"] <= 2 * last_turn]
    n = len(picked)
    total = sum(s["s"] for s in picked)
    model = sum(s["model_s"] for s in picked)
    return {
        "steps": n,
        "step_ms": total / n * 1000,
        # What durable_agents adds: the step less the model call (SDK, transport, the
        # offline model's own work, which grows with what it reads).
        "durable_ms": (total - model) / n * 1000,
        "commit_ms": statistics.median(s["commit_s"] for s in picked) * 1000,
        "model_call_ms": statistics.median(s["model_s"] for s in picked if s["model_s"]) * 1000,
    }


def run(turns: int, every: int, thinking: bool, tail: int, slice_turns: int) -> dict[str, Any]:
    trigger = calibrate(every, thinking)
    engine, url = _setup(turns)
    import logging

    from django.conf import settings

    from durable_agents import Agent, llm, tool
    from durable_agents.api import messages_for, start_run
    from durable_agents.engine.history import load_log
    from durable_agents.models import AgentRun, AgentStep, StepKind

    logging.getLogger("durable_agents").setLevel(logging.WARNING)
    settings.DURABLE_AGENTS = {**settings.DURABLE_AGENTS, "OFFLINE": True, "NOTIFY": False}
    llm.reset_clients()

    @tool(effect="pure")
    def noop(key: str) -> str:
        """Return the key (a trivial pure tool)."""
        return f"ok-{key}"

    agent = Agent(
        name="bench_compaction",
        version="1",
        model=MODEL,
        system=SYSTEM,
        tools=[noop],
        max_tokens=256,
        thinking=THINKING if thinking else None,
        params=compaction_params(trigger),
        betas=[COMPACT_BETA],
        cache=True,
        max_turns=turns + 10,
    )
    with _Probe() as probe:
        warm = start_run(agent.name, task_text(5)).pk  # the SDK, connections, caches
        assert probe.advance(warm, 10**6)[0] == "succeeded"
        long_id = start_run(agent.name, task_text(turns)).pk
        started = time.perf_counter()
        disposition, head = probe.advance(long_id, 2 * (turns - tail) - 1)
        assert disposition == "released", disposition
        # The last ``tail`` turns of the long run, in slices, each next to a slice of a fresh
        # run's first turns: both measured in the same minutes of the same machine.
        fresh_id = start_run(agent.name, task_text(tail + 2 * slice_turns)).pk
        long_tail: list[dict[str, Any]] = []
        fresh: list[dict[str, Any]] = []
        while disposition != "succeeded":
            fresh += probe.advance(fresh_id, 2 * slice_turns)[1]
            disposition, steps = probe.advance(long_id, 2 * slice_turns)
            assert disposition in ("released", "succeeded"), disposition
            long_tail += steps
        run_s = time.perf_counter() - started
    run = AgentRun.objects.get(pk=long_id)
    assert run.status == "succeeded", run.error

    rows = list(
        AgentStep.objects.filter(run_id=long_id, kind=StepKind.MODEL_TURN)
        .order_by("seq")
        .values_list("payload", flat=True)
    )
    assert len(rows) == turns, (len(rows), turns)
    billed: dict[int, float] = {}
    compactions: list[int] = []
    for number, payload in enumerate(rows, 1):
        message = json.loads(payload)
        billed[number] = _billed(message)
        if any(b.get("type") == "compaction" for b in message["content"]):
            compactions.append(number)
    sent = {(s["seq"] + 1) // 2: s["bytes"] for s in head + long_tail if s["bytes"]}
    transcript = messages_for(long_id)
    whole_tokens = len(json.dumps(transcript, ensure_ascii=False, separators=(",", ":"))) // 4

    # A claim's rebuild of the long run: trimmed (what a claim sends) and whole.
    rebuild: dict[str, list[float]] = {"trimmed": [], "whole": []}
    for _ in range(5):
        for kind, trim in (("trimmed", True), ("whole", False)):
            t = time.perf_counter()
            load_log(long_id, trim=trim).conversation.json()
            rebuild[kind].append(time.perf_counter() - t)

    points = [50, turns // 2, turns]
    own_early = _steps(head, 25, 75)
    fresh_early = _steps(fresh, 25, 75)
    late = _steps(long_tail, turns - 50, turns)
    fresh_cycle = _steps(fresh, 1, tail)
    # The same context size as the fresh runs' turns 25-75: turns 25-75 after a compaction of
    # the tail (what is sent, and so the model's own work, rises and falls with each cycle).
    phase = [c for c in compactions if c + 25 >= turns - tail + 1 and c + 75 <= turns]
    same_phase = _steps(long_tail, phase[-1] + 25, phase[-1] + 75) if phase else None
    late_cycle = _steps(long_tail, turns - tail + 1, turns)
    res: dict[str, Any] = {
        "turns": turns,
        "steps": run.last_seq,
        "engine": engine,
        "thinking": thinking,
        "trigger_input_tokens": trigger,
        "every_target": every,
        "compactions": len(compactions),
        "compaction_turns": compactions,
        "turns_between_compactions": statistics.fmean(
            b - a for a, b in itertools.pairwise(compactions)
        )
        if len(compactions) > 1
        else float("nan"),
        "run_s": run_s,
        "tokens_used": run.tokens_used,
        "billed_input_tokens_at": {str(t): billed[t] for t in points},
        "billed_input_tokens_cycle": {
            str(t): _window(billed, max(1, t - every + 1), t) for t in points
        },
        "request_messages_bytes_at": {str(t): sent.get(t) for t in points},
        "whole_transcript_tokens": whole_tokens,
        "around_50_fresh": fresh_early,
        "around_50_own": own_early,
        "around_end": late,
        "same_phase_end": same_phase,
        "cycle_fresh": fresh_cycle,
        "cycle_end": late_cycle,
        "rebuild_trimmed": common.summary_ms(rebuild["trimmed"]),
        "rebuild_whole": common.summary_ms(rebuild["whole"]),
        "tail_turns": tail,
        "slice_turns": slice_turns,
    }
    res["step_ratio"] = late["step_ms"] / fresh_early["step_ms"]
    res["durable_ratio"] = late["durable_ms"] / fresh_early["durable_ms"]
    res["same_phase_ratio"] = (
        same_phase["step_ms"] / fresh_early["step_ms"] if same_phase else float("nan")
    )
    res["cycle_ratio"] = late_cycle["step_ms"] / fresh_cycle["step_ms"]
    res["cycle_durable_ratio"] = late_cycle["durable_ms"] / fresh_cycle["durable_ms"]
    res["step_target"] = "time per step around turn 5,000 / around turn 50 <= 1.2"
    res["step_met"] = res["step_ratio"] <= 1.2
    res["cycle_met"] = res["cycle_ratio"] <= 1.2
    b, cyc = res["billed_input_tokens_at"], res["billed_input_tokens_cycle"]
    log(
        f"[compaction] {turns} turns ({res['steps']} steps, {engine}, thinking "
        f"{'on' if thinking else 'off'}) in {run_s:.1f}s: {len(compactions)} compactions "
        f"(trigger {trigger} tokens), one every {res['turns_between_compactions']:.0f} turns"
    )
    log(
        "[compaction] input tokens billed per call at turns "
        + ", ".join(f"{t}: {b[str(t)]:.0f}" for t in points)
        + f"; mean (max) over the {every} turns up to each: "
        + ", ".join(f"{cyc[str(t)]['mean']:.0f} ({cyc[str(t)]['max']:.0f})" for t in points)
        + f"; the whole transcript is {whole_tokens} tokens"
    )
    log(
        f"[compaction] time per step around turn 50 (fresh runs' turns 25-75, in between): "
        f"{fresh_early['step_ms']:.2f} ms, around turn {turns} (turns {turns - 50}-{turns}): "
        f"{late['step_ms']:.2f} ms: ratio {res['step_ratio']:.2f} -> "
        f"{common.verdict(res['step_met'])} (<= 1.2); durable_agents' part "
        f"{fresh_early['durable_ms']:.2f} -> {late['durable_ms']:.2f} ms "
        f"({res['durable_ratio']:.2f}x); model call {fresh_early['model_call_ms']:.2f} -> "
        f"{late['model_call_ms']:.2f} ms; commit {fresh_early['commit_ms']:.2f} -> "
        f"{late['commit_ms']:.2f} ms (the long run's own turns 25-75, at its start: "
        f"{own_early['step_ms']:.2f} ms/step)"
    )
    if same_phase and phase:
        log(
            f"[compaction] at the same place in a compaction cycle: turns {phase[-1] + 25}-"
            f"{phase[-1] + 75} (25-75 turns after the compaction of turn {phase[-1]}) "
            f"{same_phase['step_ms']:.2f} ms/step vs the fresh runs' turns 25-75 "
            f"{fresh_early['step_ms']:.2f}: ratio {res['same_phase_ratio']:.2f} -> "
            f"{common.verdict(res['same_phase_ratio'] <= 1.2)} (<= 1.2); model call "
            f"{same_phase['model_call_ms']:.2f} ms"
        )
    log(
        f"[compaction] over a compaction cycle: fresh runs' turns 1-{tail} "
        f"{fresh_cycle['step_ms']:.2f} ms/step, turns {turns - tail + 1}-{turns} "
        f"{late_cycle['step_ms']:.2f} ms/step: ratio {res['cycle_ratio']:.2f} -> "
        f"{common.verdict(res['cycle_met'])} (<= 1.2); durable_agents' part "
        f"{res['cycle_durable_ratio']:.2f}x"
    )
    log(
        f"[compaction] rebuild of the {res['steps'] + 1}-step log by a claim: p50 "
        f"{res['rebuild_trimmed']['p50_ms']:.1f} ms trimmed (what is sent), "
        f"{res['rebuild_whole']['p50_ms']:.1f} ms whole"
    )
    _drop(engine, url)
    return res


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser()
    p.add_argument("--turns", type=int, default=5000)
    p.add_argument("--every", type=int, default=200, help="turns between compactions, about")
    p.add_argument("--no-thinking", action="store_true")
    p.add_argument("--tail", type=int, default=200, help="last turns timed next to fresh runs")
    p.add_argument("--slice", type=int, default=25, help="turns per slice in the tail")
    p.add_argument("--out", default="compaction")
    a = p.parse_args(argv)
    if a.turns < a.tail + 100 or a.tail < 75:
        p.error("--turns must be at least --tail + 100, and --tail at least 75")
    res = run(a.turns, a.every, not a.no_thinking, a.tail, a.slice)
    common.write_result(a.out, res)
    return res


if __name__ == "__main__":
    main()
