"""Two measurements of a big tree's cancel and of a big event, before and after a change.

1. **cancel**: a tree of 111,111 runs (a waiting root, 10 children per run, 5 generations:
   10 + 100 + 1,000 + 10,000 + 100,000 pending descendants) inserted with INSERT ... SELECT,
   then ``durable_agents.cancel_run(root)``. A thread on a connection of its own polls
   ``pg_stat_activity`` every few milliseconds for the cancelling backend's
   ``now() - xact_start``: the longest transaction it saw, and the total time of the cancel.
2. **event**: 20 runs waiting on one event, then ``send_event`` with a 5 MB payload of
   incompressible text; the growth of ``pg_total_relation_size`` (TOAST included) of
   agent_run and agent_event.

It runs the ``durable_agents`` it imports, so the code before a change is measured by putting
an export of the old tree first on PYTHONPATH (the database must have the newest migrations;
the old code ignores the columns it does not know)::

    git archive REF durable_agents project | tar -x -C /tmp/da-before
    DATABASE_URL=postgres://.../db PYTHONPATH=/tmp/da-before python bench/trees_events.py
    DATABASE_URL=postgres://.../db PYTHONPATH=. python bench/trees_events.py

The tree and the event rows are deleted at the end. PostgreSQL only.

Without DATABASE_URL (as ``bench/run_all.py`` runs it: ``python -m bench.trees_events``), it
makes the database ``da_bench_trees_events`` on the server of ``BENCH_PG`` with the bench
settings, writes bench/out/trees_events.json and drops the database; ``--generations 4``
makes a tree of 11,111 runs (the quick size).
"""

from __future__ import annotations

import base64
import json
import os
import sys
import threading
import time
from typing import Any

FANOUT, GENERATIONS = 10, 5
WAITERS, PAYLOAD_BYTES = 20, 5 * 1024 * 1024


def _setup() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
    import django

    django.setup()


def _insert_tree() -> Any:
    from django.db import connection

    from durable_agents import api

    root = api.start_run("tester" if _has("tester") else _any_agent(), "The root of a tree.")
    with connection.cursor() as cursor:
        cursor.execute("UPDATE agent_run SET status = 'waiting' WHERE id = %s", [root.pk])
        cursor.execute("CREATE TEMP TABLE gen (id uuid)")
        cursor.execute("INSERT INTO gen VALUES (%s)", [root.pk])
        for depth in range(1, GENERATIONS + 1):
            cursor.execute(
                "CREATE TEMP TABLE nxt AS SELECT gen_random_uuid() AS id, gen.id AS parent,"
                " g.n AS i FROM gen, generate_series(1, %s) AS g(n)",
                [FANOUT],
            )
            cursor.execute(
                "INSERT INTO agent_run (id, agent, prompt_version, fingerprint, model, task,"
                " status, attempt, stalled_claims, last_seq, error, created_at, updated_at,"
                " parent_id, root_id, spawn_key, depth)"
                " SELECT nxt.id, r.agent, r.prompt_version, r.fingerprint, r.model, 'child',"
                " 'pending', 0, 0, 0, '', now(), now(), nxt.parent, %s, nxt.i::text, %s"
                " FROM nxt, agent_run AS r WHERE r.id = %s",
                [root.pk, depth, root.pk],
            )
            cursor.execute("DROP TABLE gen")
            cursor.execute("ALTER TABLE nxt RENAME TO gen")
        cursor.execute("DROP TABLE gen")
        cursor.execute("ANALYZE agent_run")
    return root


def _has(agent: str) -> bool:
    from durable_agents.declare.agents import registry

    return any(a.name == agent for a in registry.all())


def _any_agent() -> str:
    from durable_agents.declare.agents import registry

    return next(iter(registry.all())).name


class TransactionWatch(threading.Thread):
    """The longest transaction of one backend, seen from another connection."""

    def __init__(self, pid: int, url: str) -> None:
        super().__init__(daemon=True)
        self.pid, self.url = pid, url
        self.longest = 0.0
        self.samples = 0
        self.done = threading.Event()

    def run(self) -> None:
        import psycopg

        with psycopg.connect(self.url, autocommit=True) as conn:
            while not self.done.is_set():
                row = conn.execute(
                    "SELECT extract(epoch FROM clock_timestamp() - xact_start)"
                    " FROM pg_stat_activity WHERE pid = %s AND xact_start IS NOT NULL"
                    " AND state <> 'idle'",
                    [self.pid],
                ).fetchone()
                self.samples += 1
                if row and row[0] is not None:
                    self.longest = max(self.longest, float(row[0]))
                time.sleep(0.002)


def measure_cancel() -> dict[str, Any]:
    from django.db import connection

    from durable_agents import api

    root = _insert_tree()
    size = _count("SELECT count(*) + 1 FROM agent_run WHERE root_id = %s", root.pk)
    connection.ensure_connection()
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        pid = cursor.fetchone()[0]
    watch = TransactionWatch(pid, os.environ["DATABASE_URL"])
    watch.start()
    started = time.perf_counter()
    api.cancel_run(root.pk)
    total = time.perf_counter() - started
    watch.done.set()
    watch.join()
    left = _count(
        "SELECT count(*) FROM agent_run WHERE (root_id = %s OR id = %s) AND status <> 'cancelled'",
        root.pk,
        root.pk,
    )
    with connection.cursor() as cursor:
        # The old code's models do not know root_id: SQL, children first (ON DELETE SET NULL).
        cursor.execute(
            "DELETE FROM agent_step WHERE run_id IN (SELECT id FROM agent_run"
            " WHERE root_id = %s OR id = %s)",
            [root.pk, root.pk],
        )
        cursor.execute("DELETE FROM agent_run WHERE root_id = %s OR id = %s", [root.pk, root.pk])
    return {
        "tree_runs": size,
        "total_s": round(total, 2),
        "longest_transaction_s": round(watch.longest, 3),
        "samples": watch.samples,
        "not_cancelled": left,
    }


def _count(sql: str, *params: Any) -> int:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(sql, list(params))
        return int(cursor.fetchone()[0])


def _table_bytes() -> int:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pg_total_relation_size('agent_run') + pg_total_relation_size('agent_event')"
        )
        return int(cursor.fetchone()[0])


def measure_event() -> dict[str, Any]:
    from django.db import connection
    from django.test import override_settings

    from durable_agents import api
    from durable_agents.models import AgentEvent, AgentRun

    name = f"bench-big-{os.getpid()}"
    agent = "tester" if _has("tester") else _any_agent()
    runs = [api.start_run(agent, f"Waiter {i}.") for i in range(WAITERS)]
    ids = [run.pk for run in runs]
    AgentRun.objects.filter(pk__in=ids).update(
        status="waiting", waiting_for="event", wait_event=name, wait_key="k"
    )
    AgentEvent.objects.create(name=name)
    text = base64.b64encode(os.urandom(PAYLOAD_BYTES * 3 // 4)).decode()
    with connection.cursor() as cursor:
        cursor.execute("CHECKPOINT")
    before = _table_bytes()
    with override_settings(DURABLE_AGENTS={"MAX_EVENT_BYTES": 2 * PAYLOAD_BYTES}):
        api.send_event(name, {"blob": text})
    grown = _table_bytes() - before
    AgentRun.objects.filter(pk__in=ids).delete()
    AgentEvent.objects.filter(name=name).delete()
    return {"waiters": WAITERS, "payload_bytes": len(text), "tables_grew_bytes": grown}


def measure() -> dict[str, Any]:
    import durable_agents

    return {
        "code": os.path.dirname(durable_agents.__file__),
        "generations": GENERATIONS,
        "fanout": FANOUT,
        "cancel": measure_cancel(),
        "event": measure_event(),
    }


def main(argv: list[str] | None = None) -> None:
    global GENERATIONS
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--generations", type=int, default=GENERATIONS, help="of 10 children a run")
    GENERATIONS = p.parse_args(argv).generations
    if os.environ.get("DATABASE_URL"):  # a database of the caller's; the result on stdout
        _setup()
        json.dump(measure(), sys.stdout, indent=2)
        sys.stdout.write("\n")
        return
    from bench import common

    db = "da_bench_trees_events"
    common.setup_django(common.fresh_db(db))
    try:
        result = measure()
    finally:
        from django.db import connections

        connections.close_all()
    common.log(f"[trees_events] {json.dumps(result)}")
    common.finish("trees_events", result, db)


if __name__ == "__main__":
    main()
