"""The worker process: flags, progress lines, database outages, concurrency."""

from __future__ import annotations

import re
from typing import Any

import pytest
from django.db import connection

import durable_agents
from durable_agents.models import AgentRun, AgentStep, RunStatus
from tests.conftest import run_worker, wait_for


@pytest.mark.django_db(transaction=True)
def test_max_runs_stops_after_that_many_claims() -> None:
    runs = [durable_agents.start_run("tester", f't{i}\n@lookup {{"key": "{i}"}}') for i in range(3)]
    worker = run_worker(max_runs=2)
    assert worker.stats.claims == 2
    statuses = [AgentRun.objects.get(pk=r.pk).status for r in runs]
    assert statuses.count(RunStatus.SUCCEEDED) == 2
    assert statuses.count(RunStatus.PENDING) == 1


@pytest.mark.django_db(transaction=True)
def test_concurrency_runs_every_run_once() -> None:
    runs = [
        durable_agents.start_run("tester", f't{i}\n@@latency 0.02\n@lookup {{"key": "{i}"}}')
        for i in range(12)
    ]
    worker = run_worker(concurrency=3)
    assert worker.stats.dispositions == {"succeeded": 12}
    for run in runs:
        run.refresh_from_db()
        assert run.status == RunStatus.SUCCEEDED
        assert run.attempt == 1
        assert list(AgentStep.objects.filter(run=run).values_list("seq", flat=True)) == [0, 1, 2, 3]


@pytest.mark.postgres
@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_progress_lines_and_a_killed_database_connection(spawn_worker: Any, receiver: Any) -> None:
    """The database drops every connection while a tool runs (a failover, a restart): the
    worker logs it, hands the run back, claims it again and finishes; it never crashes."""
    run = durable_agents.start_run(
        "tester", 'Survive.\n@slow {"seconds": 1.5}\n@lookup {"key": "after"}'
    )
    worker = spawn_worker("--burst", "--lease-seconds", "3")
    wait_for(lambda: receiver.marker("slow-started"), timeout=30)
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        (terminated,) = cursor.fetchone()
    assert terminated >= 1
    assert worker.wait(60) == 0
    run.refresh_from_db()
    assert run.status == RunStatus.SUCCEEDED, (run.error, worker.output())
    assert list(AgentStep.objects.filter(run=run).values_list("seq", flat=True)) == [
        0,
        1,
        2,
        3,
        4,
        5,
    ]
    output = worker.output()
    # Either the slot met a dead connection when it committed, logged it and handed the run
    # back, or the pool had already dropped the dead connections and handed out a new one
    # (the worker holds no connection during the tool call). Never a crash, never a lost step.
    if f"run {run.id}: unexpected error" in output:
        assert "terminating connection due to administrator command" in output
    # A progress line per committed step: run id, seq, kind, tool, milliseconds.
    line = re.compile(
        rf"run {run.id} seq (\d+) (model_turn|tool_result)( tool=\w+)? committed \([\d.]+ ms\)"
    )
    seqs = sorted({int(m.group(1)) for m in line.finditer(output)})
    assert seqs == [1, 2, 3, 4, 5]
    assert f"[run={run.id}]" in output


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a_database_that_goes_away_is_one_error_line_not_a_traceback_per_poll(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import logging
    import threading

    from durable_agents.engine.worker import Worker

    worker = Worker(handle_signals=False, poll_interval=0.05)
    with connection.cursor() as cursor:
        cursor.execute("ALTER TABLE agent_run RENAME TO agent_run_away")
    try:
        with caplog.at_level(logging.DEBUG, logger="durable_agents.worker"):
            thread = threading.Thread(target=worker.run, daemon=True)
            thread.start()

            def failures() -> list[logging.LogRecord]:
                return [r for r in caplog.records if r.getMessage().startswith("claim failed")]

            wait_for(lambda: len(failures()) >= 3, timeout=30)
            with connection.cursor() as cursor:
                cursor.execute("ALTER TABLE agent_run_away RENAME TO agent_run")
            wait_for(
                lambda: any("claims work again" in r.getMessage() for r in caplog.records),
                timeout=30,
            )
            worker.stop()
            thread.join(30)
    finally:
        with connection.cursor() as cursor:
            cursor.execute("ALTER TABLE IF EXISTS agent_run_away RENAME TO agent_run")
    assert not thread.is_alive()
    errors = [r for r in failures() if r.levelno >= logging.ERROR]
    assert len(errors) == 1
    assert "agent_run" in errors[0].getMessage()
