"""Calls from services: 1,000 callback URLs completed at once, then 1,000 replayed, 1,000
forged and 1,000 URLs posted twice at the same instant, through the real view.

``--runs`` runs (default 1,000) are started through the public API, then set waiting on a
callback of one call each (the row a ``Wait(callback=True)`` leaves: ``waiting_for``
'callback', the call's key in ``wait_key``); their URLs are the ones ``callback_url()`` gives
the call. ``--threads`` threads (default 32), each with its own database connection, POST
through Django's test client (the whole request path: middleware, CSRF exemption, the view,
the store's transaction) in these rounds, all requests of a round released together:

- resume: one POST of a JSON body per URL. Target: every answer 200, every run pending once
  (its ``woken_by`` set), one ``agent_callback`` row per run;
- replay: the same URLs again. Target: every answer 409, nothing changed;
- forged: the same tokens with an altered signature. Target: every answer 403, nothing changed;
- twice: ``--runs`` fresh waiting runs, each URL posted by two threads at the same instant.
  Target: exactly one 200 and one 409 per URL, each run resumed once.

Each round prints its answers by status, its wall time and the latency of its requests.

    python -m bench.callbacks                 # about 30 s
    python -m bench.callbacks --runs 200

PostgreSQL only (``BENCH_PG``); it creates and drops the database ``da_bench_callbacks``.
"""

from __future__ import annotations

import argparse
import collections
import json
import threading
import time
from collections.abc import Callable
from typing import Any

from bench import common
from bench.common import log

DB = "da_bench_callbacks"


def park_on_callbacks(n: int, offset: int) -> list[tuple[Any, str]]:
    """``n`` runs waiting on a callback of one call each, and each call's URL path."""
    from django.db.models.functions import Now

    from durable_agents.callbacks import callback_token
    from durable_agents.models import AgentRun, RunStatus, WaitKind

    parked: list[tuple[Any, str]] = []
    for run_id in common.start_runs(n):
        key = f"{offset + len(parked):064x}"
        AgentRun.objects.filter(pk=run_id).update(
            status=RunStatus.WAITING,
            waiting_for=WaitKind.CALLBACK,
            waiting_since=Now(),
            wait_key=key,
        )
        parked.append((run_id, f"/agents/callbacks/{callback_token(run_id, key)}"))
    return parked


def post_all(paths: list[str], threads: int) -> dict[str, Any]:
    """POST a JSON body to every path from ``threads`` threads released together: the answers
    by status code (and by path), the round's wall time and each request's latency."""
    from django.db import connections
    from django.test import Client

    answers: list[tuple[str, int, float]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    barrier = threading.Barrier(threads + 1)

    def poster(thread: int) -> None:
        client = Client()
        mine: list[tuple[str, int, float]] = []
        try:
            barrier.wait(60)
            for path in paths[thread::threads]:
                body = json.dumps({"payment": path[-12:], "status": "paid", "amount": 12.5})
                started = time.perf_counter()
                response = client.post(path, body, content_type="application/json")
                mine.append((path, response.status_code, time.perf_counter() - started))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            connections.close_all()
            with lock:
                answers.extend(mine)

    workers = [threading.Thread(target=poster, args=(t,)) for t in range(threads)]
    for worker in workers:
        worker.start()
    barrier.wait(60)
    started = time.perf_counter()
    for worker in workers:
        worker.join()
    wall = time.perf_counter() - started
    if errors:
        raise errors[0]
    by_status = collections.Counter(status for _, status, _ in answers)
    by_path: dict[str, list[int]] = collections.defaultdict(list)
    for path, status, _ in answers:
        by_path[path].append(status)
    return {
        "requests": len(answers),
        "answers": {str(k): v for k, v in sorted(by_status.items())},
        "wall_s": round(wall, 3),
        "requests_per_s": round(len(answers) / wall, 1),
        "latency_ms": common.summary_ms([seconds for _, _, seconds in answers]),
        "_by_path": by_path,
    }


def state(run_ids: list[Any]) -> dict[str, int]:
    """How the runs stand: pending with a ``woken_by`` (resumed), still waiting, and their
    callbacks kept."""
    from durable_agents.models import AgentCallback, AgentRun, RunStatus

    runs = AgentRun.objects.filter(pk__in=run_ids)
    return {
        "resumed": runs.filter(status=RunStatus.PENDING, woken_by__isnull=False).count(),
        "waiting": runs.filter(status=RunStatus.WAITING).count(),
        "callbacks_kept": AgentCallback.objects.filter(run_id__in=run_ids).count(),
    }


def round_of(name: str, paths: list[str], threads: int, run_ids: list[Any]) -> dict[str, Any]:
    result = post_all(paths, threads)
    result["after"] = state(run_ids)
    shown = {k: v for k, v in result.items() if not k.startswith("_")}
    log(f"{name:8} {json.dumps(shown)}")
    return result


def forge(path: str) -> str:
    """The path with its signature's last character changed: a forged token."""
    last = path[-1]
    return path[:-1] + ("A" if last != "A" else "B")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=32)
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
    return common.finish("callbacks", result, DB)


def measure(a: argparse.Namespace) -> dict[str, Any]:
    n = a.runs
    parked = park_on_callbacks(n, 0)
    run_ids = [run_id for run_id, _ in parked]
    paths = [path for _, path in parked]
    checks: dict[str, Callable[[dict[str, Any]], bool]] = {
        "resume": lambda r: (
            r["answers"] == {"200": n}
            and r["after"] == {"resumed": n, "waiting": 0, "callbacks_kept": n}
        ),
        "replay": lambda r: (
            r["answers"] == {"409": n}
            and r["after"] == {"resumed": n, "waiting": 0, "callbacks_kept": n}
        ),
    }
    rounds: dict[str, dict[str, Any]] = {}
    rounds["resume"] = round_of("resume", paths, a.threads, run_ids)
    rounds["replay"] = round_of("replay", paths, a.threads, run_ids)

    fresh = park_on_callbacks(n, n)
    fresh_ids = [run_id for run_id, _ in fresh]
    rounds["forged"] = round_of("forged", [forge(p) for _, p in fresh], a.threads, fresh_ids)
    checks["forged"] = lambda r: (
        r["answers"] == {"403": n}
        and r["after"]
        == {
            "resumed": 0,
            "waiting": n,
            "callbacks_kept": 0,
        }
    )
    # Each URL twice, the two POSTs next to each other in the order the threads take them, so
    # that two threads send them at about the same instant.
    doubled = [p for _, p in fresh for _ in (0, 1)]
    rounds["twice"] = round_of("twice", doubled, a.threads, fresh_ids)
    checks["twice"] = lambda r: (
        r["answers"] == {"200": n, "409": n}
        and all(sorted(s) == [200, 409] for s in r["_by_path"].values())
        and r["after"] == {"resumed": n, "waiting": 0, "callbacks_kept": n}
    )
    result: dict[str, Any] = {"runs": n, "threads": a.threads}
    for name, data in rounds.items():
        met = checks[name](data)
        data.pop("_by_path")
        result[name] = {**data, "target_met": met}
        log(f"{name:8} target: {common.verdict(met)}")
    result["target_met"] = all(result[name]["target_met"] for name in rounds)
    log("target:", common.verdict(result["target_met"]))
    return result


if __name__ == "__main__":
    main()
