"""The sections of docs/benchmarks.md for the fleet benchmarks: one model quota shared by a
fleet (bench/quota.py) and concurrency keys across a worker's crash (bench/keys_crash.py).
``bench/report.py`` calls them; each writes its lines through ``w``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def _v(ok: bool | None) -> str:
    return "n/a" if ok is None else ("**met**" if ok else "**MISSED**")


def quota_section(w: Any, results: dict[str, dict[str, Any]]) -> None:
    """bench/quota.py: ``results`` maps a scenario (``rpm``, ``itpm``) to its JSON."""
    w("## Many runs, one model quota")
    w("")
    w(
        "`bench/quota.py`: runs of 3 model turns on two `runagents` workers of 300 slots, then "
        "runs of priority 10 inserted ten seconds later, against `bench.slowapi` limiting "
        "requests (or input tokens, `--scenario itpm`) per minute as the API does, answering "
        "in 0.5-1.5 s. The workers learn the limits from the answers' headers (no "
        "`RATE_LIMITS`). The ideal makespan: the calls beyond the first burst at the limit's "
        "rate, plus one answer's latency."
    )
    w("")
    w(
        "| scenario | side | runs | dead or failed | 429s / answers | makespan (ideal) | ratio "
        "| priority p50 | verdict |"
    )
    w("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for scenario, res in sorted(results.items()):
        for side in ("before", "after"):
            s = res.get(side)
            if not s:
                continue
            limit = f"{res.get('rpm')} rpm" + (f", {res['itpm']:,} itpm" if res.get("itpm") else "")
            share = 100 * s["rejected_per_answered"]
            w(
                f"| {scenario} ({limit}) | {side} | {s['runs']} | {s['dead_or_failed']} "
                f"| {s['rejected_429']} / {s['answered']} ({share:.2f} %) "
                f"| {s['makespan_s']:.1f} s ({s['ideal_s']:.1f} s) | {s['makespan_ratio']:.2f} "
                f"| {s['priority_p50_s']:.1f} s | {_v(res['met']) if side == 'after' else '-'} |"
            )
    w("")
    w(f"Target: {next(iter(results.values())).get('target', '?')}.")
    w("")


def keys_crash_section(w: Any, kc: dict[str, Any], slow: dict[str, Any] | None) -> None:
    """bench/keys_crash.py's figures; ``slow``: the same with answers slower than the lease
    minus a heartbeat (measured by hand: ``--quick --latency 3-8 --out keys_crash_slow``)."""
    w("## Concurrency keys across a crash")
    w("")
    w(
        f"`bench/keys_crash.py`: {kc['keys']} concurrency keys of limit {kc['limit']} "
        f"(`CONCURRENCY_LIMITS`), {kc['runs_per_key']} runs of {kc['turns']} model turns per "
        f"key ({kc['runs']} runs, inserted at once), {kc['procs']} `runagents` workers of "
        f"{kc['slots']} slots, `LEASE_SECONDS` {kc['lease_s']:g} (heartbeat "
        f"{kc['heartbeat_s']:g} s), `bench.slowapi` answering in {kc['latency']} s and counting "
        "the requests in flight per key (the `[key:k<i>]` in each task). Once 30 % of the runs "
        "finished, the worker holding the most running runs is SIGKILLed."
    )
    w("")
    sides = [kc] + ([slow] if slow else [])
    w("| | " + " | ".join(f"answers in {r['latency']} s" for r in sides) + " |")
    w("| --- |" + " --- |" * len(sides))
    for label, cell in _KEYS_CRASH_ROWS:
        w(f"| {label} | " + " | ".join(cell(res) for res in sides) + " |")
    w("")
    w(f"Target: {kc['target']}.")
    w("")
    w(
        "A request the killed worker had sent stays in flight at the fake until its answer is "
        "due, while the run goes to another worker once its lease runs out. The lease was "
        "renewed at most a heartbeat before the kill, so the two cannot overlap while the "
        "longest model call is shorter than the lease minus the heartbeat period (the margin "
        "above). With calls longer than that they do"
        + (
            f": with answers in {slow['latency']} s, {len(slow['keys_over_limit'])} of "
            f"{slow['keys']} keys saw {slow['max_peak']} requests in flight"
            if slow
            else ""
        )
        + ". The limit bounds the runs running at once; a dead worker's last request is not "
        "one of them."
    )
    w("")


def _kill(r: dict[str, Any]) -> str:
    k = r.get("killed") or {}
    taken = r.get("takeover_s") or [float("nan")]
    return (
        f"{r['killed_runs']} running runs of {len(k.get('keys', []))} keys; their leases ran "
        f"out {k.get('lease_left_min_s', float('nan')):.2f}-"
        f"{k.get('lease_left_max_s', float('nan')):.2f} s later, taken over "
        f"{min(taken):.2f}-{max(taken):.2f} s after the kill"
    )


# The rows of the keys_crash table: a label, and its cell for one result.
_KEYS_CRASH_ROWS: tuple[tuple[str, Callable[[dict[str, Any]], str]], ...] = (
    (
        "per-key peak in flight",
        lambda r: (
            f"max {r['max_peak']}; {r['keys_at_limit']} of {r['keys']} keys reached "
            f"{r['limit']}, {len(r['keys_over_limit'])} went over"
        ),
    ),
    (
        "runs",
        lambda r: (
            f"{r['succeeded']} of {r['runs']} succeeded, {r['dead_or_failed']} dead or "
            f"failed, {r['unfinished']} unfinished"
        ),
    ),
    ("the kill", _kill),
    (
        "margin: the first lease's end minus the latest an abandoned answer was due",
        lambda r: (
            f"{r['margin_s']:.2f} s; {r['takeovers_before_abandoned_ended']} take-overs "
            "before the abandoned answers were due"
        ),
    ),
    (
        "makespan (no crash, at the limits)",
        lambda r: f"{r['makespan_s']:.1f} s ({r['ideal_s']:.1f} s)",
    ),
    ("verdict", lambda r: _v(r["met"])),
)
