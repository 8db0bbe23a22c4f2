"""A worker SIGKILLed between a tool raising ``Wait`` and the commit of the park: the call was
never recorded, so the next worker runs it again, with the same idempotency key, and then
parks; the event wakes the run once. Real ``runagents`` subprocesses on PostgreSQL."""

from __future__ import annotations

import json

import psycopg
import pytest

import durable_agents
from durable_agents.engine import effects
from durable_agents.models import AgentRun, RunStatus, ToolEffect, WaitKind
from tests.conftest import Receiver, backend_waits_on_lock, database_url, wait_for

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True),
]

SIGKILLED = -9
LEASE = "2"


def test_sigkill_between_wait_and_park_runs_the_call_again_with_the_same_key(
    receiver: Receiver, spawn_worker: object
) -> None:
    tool_input = {"name": "refund:o-9"}
    run = durable_agents.start_run(
        "waiter", f"Refund order o-9.\n@await_event {json.dumps(tool_input)}"
    )
    key = effects.idempotency_key(run.pk, 1, 0, "await_event", tool_input)
    first = spawn_worker(  # type: ignore[operator]
        "--burst", "--lease-seconds", LEASE, "--worker-id", "w1", env={"DA_WAIT_PAUSE": "60"}
    )
    wait_for(lambda: receiver.marker("await-event-raising"), timeout=30)
    # The side effect happened; the tool is about to raise Wait. Hold the run's row so the
    # park cannot commit, let the tool raise, and kill the worker while the park waits.
    with psycopg.connect(database_url()) as holder:
        holder.execute("SELECT 1 FROM agent_run WHERE id = %s FOR UPDATE", [run.pk])
        (receiver.directory / "wait-release").touch()
        wait_for(lambda: backend_waits_on_lock("FOR NO KEY UPDATE"), timeout=30)
        assert first.kill() == SIGKILLED
        holder.rollback()
    (receiver.directory / "wait-release").unlink()

    run.refresh_from_db()
    assert run.status == RunStatus.RUNNING
    assert run.waiting_for == ""  # never parked
    assert not ToolEffect.objects.filter(run_id=run.pk).exists()

    # The lease runs out; the next worker calls the tool again (same key) and parks.
    wait_for(lambda: AgentRun.objects.claimable().filter(pk=run.pk).exists(), timeout=30)
    second = spawn_worker("--burst", "--lease-seconds", LEASE, "--worker-id", "w2")  # type: ignore[operator]
    assert second.wait(60) == 0, second.output()
    run.refresh_from_db()
    assert (run.status, run.waiting_for, run.wait_event) == (
        RunStatus.WAITING,
        WaitKind.EVENT,
        "refund:o-9",
    )
    assert run.wait_key == key

    durable_agents.send_event("refund:o-9", {"status": "refunded"})
    durable_agents.send_event("refund:o-9", {"status": "refunded"})  # delivered twice
    third = spawn_worker("--burst", "--lease-seconds", LEASE, "--worker-id", "w3")  # type: ignore[operator]
    assert third.wait(60) == 0, third.output()

    run.refresh_from_db()
    assert run.status == RunStatus.SUCCEEDED, run.error
    calls = receiver.calls("await_event")
    assert [c["key"] for c in calls] == [key, key, key]
    assert [c["woken_by"] is None for c in calls] == [True, True, False]
    assert calls[0]["pid"] == first.pid
    assert calls[1]["pid"] == second.pid
    assert calls[2]["woken_by"]["payload"] == {"status": "refunded"}
    # The provider saw the request twice with one key and applied it once.
    assert [a["key"] for a in receiver.attempts("request")] == [key, key]
    assert [a["key"] for a in receiver.applied("request")] == [key]
    assert AgentRun.objects.filter(pk=run.pk, attempt=3).exists()
