"""Runs in batches: 10,000 model turns through one Message Batch, the claim of ordinary runs
while they wait, and what the same workload costs directly and in batches.

The offline model answers in this process, through the real SDK (its in-process transport),
and its ``BatchDesk`` plays the Message Batches API; the database is PostgreSQL.

1. **cost** (first, so that its finished runs are in both databases of 3): ``--cost-runs``
   runs (default 1,000) of ``--cost-turns`` model turns each (default 3: two tool turns, then
   the answer) driven directly, and the same tasks in batches (each round: every pending run
   claimed and advanced until it parks on its next turn, the waiting requests submitted, the
   batch polled), with ``PRICES`` of 3 / 15 USD per million input / output tokens. Printed:
   each set's ``cost_usd`` and tokens summed, and the ratio batched / direct (target: 0.5, the
   fake billing the same tokens either way).
2. **commit**: ``--runs`` runs (default 10,000) of one tool turn then the answer, started in
   batches (``Store.create_runs``, a thousand a statement) and each parked on its first turn
   by ``--threads`` threads (default 6) claiming (``claim_runs``) and advancing
   (``advance_run``) as a worker's slots do; then ``Submitter.submit_due(force=True)`` with
   ``BATCH_MAX_REQUESTS`` = ``--runs`` (one batch) and one ``poll_due(force=True)``, the
   timed one: it retrieves the batch once and commits its ``--runs`` answers. The fake
   answers a batch's requests when the batch ends, which happens before the timed poll (a
   look at its queue), so the poll times what the fleet does: the retrieve, the results
   download and the commits. Printed: batches created and their sizes, the retrieves per
   batch in that poll (from the desk's statistics: 1), the commit rate in turns per second
   (target: at least 1,000), and how much of the poll went in statements to PostgreSQL
   (counted by an execute wrapper), by kind of statement; then the same results downloaded
   and read alone (``read_line``, no database): the floor under the poll. ``--profile`` runs
   that poll under cProfile and prints where the time went (the rate is then the profiled
   one). Before the submit, agent_run and agent_batch_request are ANALYZEd, as autovacuum
   does minutes after such a burst (the batch's answers come minutes to hours later);
   ``--stale-stats`` leaves that out: the planner, which then knows of no waiting batched
   run, may read every one of them for each request the submitter takes and for each
   answer's fence (agent_run_waiting rather than the primary key), and both grow with the
   square of the runs.
3. **claim**: between the submit and the poll of 2, the claim of ordinary runs while the
   ``--runs`` batched runs wait, against the same claim in a copy of the database made before
   they were started (the runs of 1 in both, no batched run waiting): ``--ordinary`` pending
   runs (default 1,000) in each, ``--claims`` claims a side (default 2,000) in ``--blocks``
   blocks (default 4), alternating between the two databases in this one process (the order
   swapped every block, agent_run vacuumed in both before each block), each claim
   ``claim_runs(owner, 60, 1)`` timed in the client, then handed back
   (``release_lease(count_claim=False)``) so that every claim takes the same oldest run.
   Printed: p50 and p99 a side and the ratio of the p99s (target: at most 1.2).

    python -m bench.batches              # about 3 minutes on 2 CPUs
    python -m bench.batches --quick      # 1,000 runs in batches, 100 a side of the cost

PostgreSQL only (``BENCH_PG``); it creates and drops ``da_bench_batches`` and
``da_bench_batches_none``.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import pstats
import threading
import time
from collections.abc import Callable, Iterator
from decimal import Decimal
from typing import Any

from bench import common
from bench.common import log

DB = "da_bench_batches"
NONE_DB = "da_bench_batches_none"  # the same database with no batched run waiting
AGENT = "bench"
MODEL = "claude-bench-1"
PRICES = {MODEL: {"input": 3.0, "output": 15.0}}
TARGET_COMMITS_PER_S = 1000.0
TARGET_P99_RATIO = 1.2
TARGET_COST_RATIO = 0.5
CREATE_CHUNK = 1000
OWNER = "bench-batches"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=None, help="runs in one batch (10,000)")
    parser.add_argument("--threads", type=int, default=6, help="threads that park the runs")
    parser.add_argument("--ordinary", type=int, default=1000, help="pending ordinary runs")
    parser.add_argument("--claims", type=int, default=None, help="claims a side (2,000)")
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--cost-runs", type=int, default=None, help="runs a side (1,000)")
    parser.add_argument("--cost-turns", type=int, default=3, help="model turns of a run")
    parser.add_argument("--quick", action="store_true", help="small sizes, for CI")
    parser.add_argument("--profile", action="store_true", help="cProfile the timed poll")
    parser.add_argument(
        "--stale-stats",
        action="store_true",
        help="no ANALYZE after the runs parked: submit and poll with the planner unaware of them",
    )
    a = parser.parse_args(argv)
    quick = {"runs": 1000, "claims": 400, "cost_runs": 100}
    full = {"runs": 10_000, "claims": 2000, "cost_runs": 1000}
    for name, value in (quick if a.quick else full).items():
        if getattr(a, name) is None:
            setattr(a, name, value)
    if a.quick:
        a.blocks = min(a.blocks, 2)
    if (why := common.postgres_unavailable()) is not None:
        raise SystemExit(why)
    url = common.fresh_db(DB)
    try:
        common.setup_django(url)
        result = measure(a)
    finally:
        from django.db import connections

        connections.close_all()
    return common.finish("batches", result, DB, NONE_DB)


# -- plumbing -------------------------------------------------------------------------------


@contextlib.contextmanager
def offline_in_batches(max_requests: int) -> Iterator[None]:
    """The offline model (its batch desk reset), the prices, one batch for ``max_requests``."""
    from django.conf import settings
    from django.test import override_settings

    from durable_agents import llm
    from durable_agents.offline import shared_batch_desk

    shared_batch_desk().reset()
    with override_settings(
        DURABLE_AGENTS={
            **settings.DURABLE_AGENTS,
            "OFFLINE": True,
            "CLIENT_FACTORY": "durable_agents.llm.default_client",
            "PRICES": PRICES,
            "BATCH_MAX_REQUESTS": max_requests,
        }
    ):
        llm.reset_clients()
        try:
            yield
        finally:
            llm.reset_clients()


def create_runs(label: str, count: int, turns: int, *, batch: bool) -> list[Any]:
    """``count`` pending runs of the bench agent (the same tasks whatever ``label``), created
    ``CREATE_CHUNK`` a statement through ``Store.create_runs``; their ids."""
    from durable_agents import api, store

    ids: list[Any] = []
    for low in range(0, count, CREATE_CHUNK):
        runs = []
        for i in range(low, min(count, low + CREATE_CHUNK)):
            task = common.task_text(i, turns)
            run = api._new_run(AGENT, task, None, None)
            run.batch = batch
            run.start_key = f"{label}-{i}"
            runs.append((run, json.dumps(task, ensure_ascii=False)))
        ids += [run.pk for run in store.current().create_runs(runs)]
    return ids


def advance_all(threads: int) -> int:
    """Claim and advance every claimable run from ``threads`` threads (each with its own
    connection), as a worker's slots would, until none is left; the runs advanced."""
    from django.db import connections

    from durable_agents import store
    from durable_agents._internal.interrupt import Interrupt
    from durable_agents.engine.runner import advance_run

    advanced: list[int] = []
    errors: list[BaseException] = []

    def slot(n: int) -> None:
        done = 0
        try:
            while True:
                claims = store.current().claim_runs(f"{OWNER}-{n}", 60, 10)
                if not claims:
                    break
                for claim in claims:
                    advance_run(claim, Interrupt())
                    done += 1
        except BaseException as exc:  # noqa: BLE001 - raised below
            errors.append(exc)
        finally:
            advanced.append(done)
            connections.close_all()

    workers = [threading.Thread(target=slot, args=(n,)) for n in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    if errors:
        raise errors[0]
    return sum(advanced)


class Statements:
    """Statements sent on this thread's connection, the seconds spent in them, and both by
    kind (the statement's verb and first table)."""

    def __init__(self) -> None:
        self.count = 0
        self.seconds = 0.0
        self.kinds: dict[str, list[float]] = {}

    def __call__(
        self, execute: Callable[..., Any], sql: str, params: Any, many: bool, ctx: Any
    ) -> Any:
        started = time.perf_counter()
        try:
            return execute(sql, params, many, ctx)
        finally:
            took = time.perf_counter() - started
            self.seconds += took
            self.count += 1
            self.kinds.setdefault(kind_of(sql), []).append(took)

    def top(self, n: int = 5) -> list[dict[str, Any]]:
        """The ``n`` kinds of statement that took longest: count and seconds."""
        ranked = sorted(self.kinds.items(), key=lambda item: -sum(item[1]))[:n]
        return [
            {"kind": kind, "count": len(times), "seconds": round(sum(times), 3)}
            for kind, times in ranked
        ]


def kind_of(sql: str) -> str:
    """``UPDATE agent_run``, ``SELECT agent_batch_request``...: the verb and the first table."""
    words = sql.replace('"', " ").replace("(", " ").split()
    verb = words[0].upper() if words else "?"
    marker = {"SELECT": "FROM", "INSERT": "INTO", "DELETE": "FROM"}.get(verb)
    table = "?"
    if marker is None and len(words) > 1:
        table = words[1]
    elif marker is not None and marker in (w.upper() for w in words):
        at = [w.upper() for w in words].index(marker)
        table = words[at + 1] if at + 1 < len(words) else "?"
    return f"{verb} {table}"


def show(statements: Statements) -> str:
    return ", ".join(f"{k['kind']} x{k['count']} {k['seconds']:.2f} s" for k in statements.top())


def retrieves_per_batch(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {bid: n - before.get(bid, 0) for bid, n in after.items() if n - before.get(bid, 0)}


# -- 1. cost --------------------------------------------------------------------------------


def cost_bench(runs: int, turns: int, threads: int) -> dict[str, Any]:
    from django.db.models import Count, Sum

    from durable_agents.batches import Submitter, poll_due
    from durable_agents.models import AgentRun, RunStatus, WaitKind
    from durable_agents.offline import shared_batch_desk

    desk = shared_batch_desk()
    t = time.perf_counter()
    direct_ids = create_runs("direct", runs, turns, batch=False)
    advance_all(threads)
    direct_s = time.perf_counter() - t

    t = time.perf_counter()
    batched_ids = create_runs("batched", runs, turns, batch=True)
    submitter = Submitter(OWNER)
    rounds = polls = 0
    most_retrieves = 0
    for rounds in range(1, turns + 3):  # noqa: B007 - the rounds it took are reported
        advance_all(threads)
        waiting = AgentRun.objects.filter(
            pk__in=batched_ids, status=RunStatus.WAITING, waiting_for=WaitKind.BATCH
        ).count()
        if not waiting:
            break
        submitter.submit_due(force=True)
        desk.queued_requests()  # the fake ends the batch (its answers made) before the poll
        before = desk.stats().retrieves
        poll_due(OWNER, force=True)
        polls += 1
        per_batch = retrieves_per_batch(before, desk.stats().retrieves)
        most_retrieves = max([most_retrieves, *per_batch.values()])
    batched_s = time.perf_counter() - t

    def totals(ids: list[Any]) -> dict[str, Any]:
        row = AgentRun.objects.filter(pk__in=ids).aggregate(
            cost=Sum("cost_usd"), tokens=Sum("tokens_used"), runs=Count("id")
        )
        succeeded = AgentRun.objects.filter(pk__in=ids, status=RunStatus.SUCCEEDED).count()
        return {
            "runs": row["runs"],
            "succeeded": succeeded,
            "cost_usd": row["cost"] or Decimal(0),
            "tokens": row["tokens"] or 0,
        }

    direct, batched = totals(direct_ids), totals(batched_ids)
    ratio = float(batched["cost_usd"] / direct["cost_usd"]) if direct["cost_usd"] else float("nan")
    stats = desk.stats()
    data = {
        "runs_a_side": runs,
        "turns_a_run": turns,
        "direct": {**direct, "cost_usd": str(direct["cost_usd"]), "seconds": round(direct_s, 1)},
        "batched": {
            **batched,
            "cost_usd": str(batched["cost_usd"]),
            "seconds": round(batched_s, 1),
            "rounds": rounds,
            "polls": polls,
            "batches": stats.creates,
            "batch_sizes": stats.batch_sizes,
            "most_retrieves_per_batch_per_poll": most_retrieves,
            "paid_twice": len(stats.paid_twice),
            "desk_usage": stats.usage,
        },
        "cost_ratio": round(ratio, 6),
        "target_ratio": TARGET_COST_RATIO,
        "verdict": common.verdict(
            abs(ratio - TARGET_COST_RATIO) < 1e-6
            and direct["tokens"] == batched["tokens"]
            and direct["succeeded"] == batched["succeeded"] == runs
        ),
    }
    log(
        f"cost: {runs} runs of {turns} turns a side. directly: {direct['succeeded']} succeeded,"
        f" {direct['tokens']} tokens, ${direct['cost_usd']:.6f} ({direct_s:.1f} s). in batches:"
        f" {batched['succeeded']} succeeded, {batched['tokens']} tokens,"
        f" ${batched['cost_usd']:.6f} ({batched_s:.1f} s; {stats.creates} batches of"
        f" {stats.batch_sizes}, at most {most_retrieves} retrieve per batch per poll,"
        f" {len(stats.paid_twice)} paid twice). batched / direct = {ratio:.4f}"
        f" ({data['verdict']}: {TARGET_COST_RATIO}, same tokens)"
    )
    return data


# -- 3. claim -------------------------------------------------------------------------------


def clone_db(name: str, template: str) -> str:
    """Database ``name`` as a copy of ``template`` (no connection to it may be open)."""
    import psycopg

    assert name.startswith("da_bench"), name
    assert template.startswith("da_bench"), template
    with psycopg.connect(common.ADMIN_DSN, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
    return common.db_url(name)


class TwoDatabases:
    """This thread's ``default`` connection, switched between the bench database and the copy
    of it made before the batched runs (``NONE_DB``): the store's own code runs on either."""

    def __init__(self) -> None:
        import copy

        from django.db import connections
        from django.db.utils import load_backend

        self.main = connections["default"]
        settings = copy.deepcopy(self.main.settings_dict)
        settings["NAME"] = NONE_DB
        self.none = load_backend(settings["ENGINE"]).DatabaseWrapper(settings, "default")

    @contextlib.contextmanager
    def on(self, which: str) -> Iterator[None]:
        from django.db import connections

        connections["default"] = self.none if which == "none" else self.main
        try:
            yield
        finally:
            connections["default"] = self.main

    def close(self) -> None:
        self.none.close()


def claim_bench(dbs: TwoDatabases, claims: int, blocks: int) -> dict[str, Any]:
    from django.db import connection

    from durable_agents import store
    from durable_agents.models import AgentRun, RunStatus, WaitKind

    def vacuum() -> None:
        for which in ("none", "batched"):
            with dbs.on(which), connection.cursor() as cursor:
                cursor.execute("VACUUM agent_run")

    def block(n: int) -> list[float]:
        the_store = store.current()
        out = []
        for _ in range(n):
            started = time.perf_counter()
            taken = the_store.claim_runs(OWNER, 60, 1)
            out.append(time.perf_counter() - started)
            if len(taken) != 1 or taken[0].run.batch:
                raise RuntimeError(f"the claim took {taken!r}, not one ordinary run")
            if not the_store.release_lease(taken[0], count_claim=False):
                raise RuntimeError("could not hand a claimed run back")
        return out

    waiting = {}
    for which in ("none", "batched"):
        with dbs.on(which):
            waiting[which] = AgentRun.objects.filter(
                status=RunStatus.WAITING, waiting_for=WaitKind.BATCH
            ).count()
            block(50)  # warm-up: the connection, its prepared statements, the plans
    per_block = max(1, claims // blocks)

    def side(which: str) -> Callable[[], list[float]]:
        def measure() -> list[float]:
            vacuum()
            with dbs.on(which):
                return block(per_block)

        return measure

    lat = common.interleaved(blocks, {"none": side("none"), "batched": side("batched")})
    none, batched = common.summary_ms(lat["none"]), common.summary_ms(lat["batched"])
    ratio = batched["p99_ms"] / none["p99_ms"]
    data = {
        "batched_runs_waiting": waiting,
        "claims_a_side": per_block * blocks,
        "blocks": blocks,
        "no_batched_waiting": none,
        "batched_waiting": batched,
        "p99_ratio": round(ratio, 3),
        "p50_ratio": round(batched["p50_ms"] / none["p50_ms"], 3),
        "target_p99_ratio": TARGET_P99_RATIO,
        "verdict": common.verdict(ratio <= TARGET_P99_RATIO),
    }
    log(
        f"claim of an ordinary run, {per_block * blocks} a side in {blocks} alternating blocks:"
        f" no batched run waiting p50 {none['p50_ms']:.3f} ms p99 {none['p99_ms']:.3f} ms;"
        f" {waiting['batched']} batched runs waiting p50 {batched['p50_ms']:.3f} ms p99"
        f" {batched['p99_ms']:.3f} ms; p99 ratio {ratio:.3f} ({data['verdict']}:"
        f" <= {TARGET_P99_RATIO})"
    )
    return data


# -- 2. commit ------------------------------------------------------------------------------


def commit_bench(a: argparse.Namespace) -> dict[str, Any]:
    from django.db import connection, connections

    from durable_agents.batches import Submitter, poll_due
    from durable_agents.models import AgentRun, RunStatus, WaitKind
    from durable_agents.offline import shared_batch_desk

    desk = shared_batch_desk()
    desk.reset()
    # The copy without batched runs: made now, with the runs of the cost benchmark in it.
    connections.close_all()
    clone_db(NONE_DB, DB)
    data: dict[str, Any] = {"runs": a.runs}

    t = time.perf_counter()
    run_ids = create_runs("commit", a.runs, 2, batch=True)
    data["start_s"] = round(time.perf_counter() - t, 2)
    t = time.perf_counter()
    parked = advance_all(a.threads)
    park_s = time.perf_counter() - t
    waiting = AgentRun.objects.filter(
        pk__in=run_ids, status=RunStatus.WAITING, waiting_for=WaitKind.BATCH
    ).count()
    if waiting != a.runs:
        raise RuntimeError(f"{waiting} of {a.runs} runs parked on their batched turn")
    data.update(park_s=round(park_s, 2), parked_per_s=round(parked / park_s, 1))
    log(
        f"commit: {a.runs} runs started in batches in {data['start_s']:.1f} s, parked on their"
        f" first turn in {park_s:.1f} s ({parked / park_s:.0f} runs/s, {a.threads} threads)"
    )

    if not a.stale_stats:
        # What autovacuum does minutes after such a burst (a batch takes minutes to hours at
        # the API): without it the planner knows of no waiting batched run, and reads every
        # one of them for each request taken and each answer's fence (--stale-stats shows it).
        with connection.cursor() as cursor:
            cursor.execute("ANALYZE agent_run, agent_batch_request")
    data["analyzed"] = not a.stale_stats
    at_submit = Statements()
    with connection.execute_wrapper(at_submit):
        t = time.perf_counter()
        submitted = Submitter(OWNER).submit_due(force=True)
        data["submit_s"] = round(time.perf_counter() - t, 2)
    stats = desk.stats()
    data.update(
        batches=stats.creates,
        requests_per_batch=stats.batch_sizes,
        submit_statements=at_submit.top(),
    )
    log(
        f"submitted in {data['submit_s']:.2f} s: {stats.creates} batch(es) of"
        f" {stats.batch_sizes} requests (Tally: {submitted.batches} batches,"
        f" {submitted.requests} requests); its statements: {show(at_submit)}"
    )

    # 3, while the runs wait on their batch: the same ordinary runs in both databases.
    create_runs("ordinary", a.ordinary, 2, batch=False)
    dbs = TwoDatabases()
    try:
        with dbs.on("none"):
            create_runs("ordinary", a.ordinary, 2, batch=False)
        claim = claim_bench(dbs, a.claims, a.blocks)
    finally:
        dbs.close()

    desk.queued_requests()  # the fake answers the batch's requests now, out of the timed poll
    before = desk.stats().retrieves
    statements = Statements()
    profile = cProfile.Profile() if a.profile else None
    with connection.execute_wrapper(statements):
        if profile is not None:
            profile.enable()
        t = time.perf_counter()
        tally = poll_due(OWNER, force=True)
        poll_s = time.perf_counter() - t
        if profile is not None:
            profile.disable()
    stats = desk.stats()
    per_batch = retrieves_per_batch(before, stats.retrieves)
    rate = tally.committed / poll_s
    pending = AgentRun.objects.filter(pk__in=run_ids, status=RunStatus.PENDING, last_seq=1).count()
    data.update(
        poll_s=round(poll_s, 3),
        committed=tally.committed,
        pending_after=pending,
        retrieves_per_batch_in_poll=per_batch,
        tally_retrieves=tally.retrieves,
        paid_twice=len(stats.paid_twice),
        commits_per_s=round(rate, 1),
        statements=statements.count,
        statements_per_turn=round(statements.count / max(1, tally.committed), 2),
        statement_s=round(statements.seconds, 3),
        poll_statements=statements.top(),
        profiled=a.profile,
        target_commits_per_s=TARGET_COMMITS_PER_S,
        verdict=common.verdict(rate >= TARGET_COMMITS_PER_S and not a.profile),
    )
    log(
        f"poll: {tally.retrieves} retrieve(s) ({per_batch}: retrieves per batch in this poll),"
        f" {tally.committed} answers committed in {poll_s:.2f} s = {rate:.0f} turns/s"
        f"{' (under cProfile)' if a.profile else ''} ({data['verdict']}:"
        f" >= {TARGET_COMMITS_PER_S:.0f}/s); {pending} runs pending at turn 1;"
        f" {statements.count} statements ({data['statements_per_turn']} a turn) took"
        f" {statements.seconds:.2f} s of the poll, the rest ({poll_s - statements.seconds:.2f}"
        f" s) in Python; {len(stats.paid_twice)} turns paid twice"
    )
    log(f"the poll's statements: {show(statements)}")
    data["read_only"] = read_only(next(iter(per_batch)))
    log(
        f"the same results downloaded and read alone (no database; one more retrieve, after"
        f" the timed poll): {data['read_only']['lines']} lines in"
        f" {data['read_only']['seconds']:.2f} s = {data['read_only']['lines_per_s']:.0f} lines/s"
    )
    if profile is not None:
        data["profile"] = profile_text(profile)
        log(data["profile"])
    return {"commit": data, "claim": claim}


def read_only(provider_id: str) -> dict[str, Any]:
    """Download the results of batch ``provider_id`` and read each line as the poller does
    (``read_line``), committing nothing: the floor under the poll's time."""
    from durable_agents.batches.results import Problem, read_line
    from durable_agents.llm import batches as endpoints

    url = endpoints.retrieve_batch(provider_id)["results_url"]
    t = time.perf_counter()
    lines = problems = 0
    for line in endpoints.result_lines(url):
        lines += 1
        problems += isinstance(read_line(line, provider_id), Problem)
    took = time.perf_counter() - t
    return {
        "lines": lines,
        "problems": problems,
        "seconds": round(took, 3),
        "lines_per_s": round(lines / took, 1),
    }


def profile_text(profile: cProfile.Profile) -> str:
    out = io.StringIO()
    stats = pstats.Stats(profile, stream=out)
    stats.sort_stats("cumulative").print_stats(r"durable_agents|django/db/models/query\.py", 30)
    stats.sort_stats("tottime").print_stats(15)
    return out.getvalue()


def measure(a: argparse.Namespace) -> dict[str, Any]:
    t = time.perf_counter()
    with offline_in_batches(max(a.runs, a.cost_runs)):
        cost = cost_bench(a.cost_runs, a.cost_turns, a.threads)
        result = commit_bench(a)
    return {
        "commit": result["commit"],
        "claim": result["claim"],
        "cost": cost,
        "seconds": round(time.perf_counter() - t, 1),
    }


if __name__ == "__main__":
    main()
