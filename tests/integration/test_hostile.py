"""Hostile tool code and setups at run time, one regression test each: tool code that hangs,
exits or raises secrets; poison runs that cannot even be dead-lettered; races between a
person's decision, a worker that parks a run, a worker that lost its lease and a cancel.

The races are made deterministic: an interleaving is injected at the point where it used to
go wrong, or a row lock held from a second connection stops a statement where it must wait.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from django.contrib.auth import get_user_model
from django.db import connection

from durable_agents import Agent, store, tool
from durable_agents.api import approve_intent, cancel_run, resolve_intent, start_run
from durable_agents.engine import effects
from durable_agents.engine import worker as worker_module
from durable_agents.engine.worker import Worker
from durable_agents.models import AgentRun, AgentStep, IntentStatus, ToolEffect, ToolIntent
from tests.conftest import (
    backend_waits_on_lock,
    database_url,
    run_worker,
    steps_refused,
    wait_for,
)
from tests.fakeserver import FakeAnthropic

pytestmark = pytest.mark.django_db(transaction=True)

# Set at the end of each test: a hung tool's thread returns then, not at interpreter exit.
RELEASE = threading.Event()
STARTED = threading.Event()


def _hang() -> str:
    STARTED.set()
    RELEASE.wait(60)
    return "finished after all"


@tool(effect="pure", timeout=0.5)
def hang() -> str:
    """Never answers in time."""
    return _hang()


@tool(effect="pure", timeout=30)
def hang_long() -> str:
    """Has a generous timeout of its own; the TOOL_TIMEOUT ceiling wins."""
    return _hang()


@tool(effect="non_idempotent", timeout=0.5)
def hang_charge(cents: int, *, idempotency_key: str) -> str:
    """A payment call that hangs."""
    return _hang()


@tool(effect="irreversible", timeout=0.5)
def hang_drop(table: str) -> str:
    """A DROP TABLE that hangs."""
    return _hang()


@tool(effect="pure")
def hang_default() -> str:
    """Sets no timeout: the agent's tool_timeout applies."""
    return _hang()


@tool(effect="pure")
def exit_now(code: int) -> str:
    """Calls sys.exit, as careless tool code does."""
    sys.exit(code)


@tool(effect="pure")
def leak_secret() -> str:
    """Fails with a secret in its message."""
    raise RuntimeError("could not connect: password=hunter2")


@tool(effect="irreversible")
def drop(table: str) -> str:
    """Drop a table (counts its calls)."""
    DROPS.append(table)
    return f"dropped {table}"


DROPS: list[str] = []

hostile = Agent(
    name="hostile",
    version="v1",
    model="claude-test-1",
    system="You meet hostile tools.",
    tools=[hang, hang_long, hang_charge, hang_drop, hang_default, exit_now, leak_secret, drop],
    max_tokens=512,
    max_turns=10,
    tool_timeout=0.4,
)


def redact(tool_name: str, exc: BaseException) -> str:
    return f"{tool_name} failed ({type(exc).__name__}); details are in the worker's log"


def broken_formatter(tool_name: str, exc: BaseException) -> str:
    raise ValueError("the formatter itself fails")


@pytest.fixture(autouse=True)
def _release_hung_tools() -> Iterator[None]:
    RELEASE.clear()
    STARTED.clear()
    DROPS.clear()
    yield
    RELEASE.set()


def reload(run: AgentRun) -> AgentRun:
    return AgentRun.objects.get(pk=run.pk)


def results_sent(run: AgentRun) -> list[dict[str, Any]]:
    """The tool_result blocks of the run's first tool_result step."""
    step = AgentStep.objects.filter(run_id=run.pk, kind="tool_result").order_by("seq").first()
    assert step is not None
    return json.loads(step.payload)


def approver() -> Any:
    return get_user_model().objects.create_superuser("boss", "boss@example.com", "pw")


def parked_drop() -> tuple[AgentRun, ToolIntent]:
    """A run parked on the pending intent of its ``drop`` call."""
    run = start_run("hostile", '@drop {"table": "orders"}')
    run_worker()
    return run, ToolIntent.objects.get(run_id=run.pk)


# -- 5. tool timeouts -------------------------------------------------------------------------


def test_a_hung_tool_times_out_the_model_is_told_and_the_run_goes_on(
    fake_api: FakeAnthropic,
) -> None:
    run = start_run("hostile", "@hang {}")
    worker = run_worker()
    run = reload(run)
    assert (run.status, worker.stats.dispositions) == ("succeeded", {"succeeded": 1})
    [block] = results_sent(run)
    assert block["is_error"] is True
    assert block["content"].startswith("hang timed out after 0.5s")
    # The model saw it, and the call is recorded: a later claim never runs it again.
    assert fake_api.requests[1].json()["messages"][-1]["content"] == [block]
    assert ToolEffect.objects.get(run_id=run.pk).is_error


def test_the_tool_timeout_setting_is_the_ceiling(fake_api: FakeAnthropic, da_settings) -> None:
    da_settings(TOOL_TIMEOUT=0.3)
    run = start_run("hostile", "@hang_long {}")
    run_worker()
    [block] = results_sent(reload(run))
    assert block["content"].startswith("hang_long timed out after 0.3s")


def test_the_agents_tool_timeout_applies_to_tools_without_one(fake_api: FakeAnthropic) -> None:
    run = start_run("hostile", "@hang_default {}")
    run_worker()
    [block] = results_sent(reload(run))
    assert block["content"].startswith("hang_default timed out after 0.4s")


def test_a_hung_non_idempotent_call_is_an_error_result_recorded_once(
    fake_api: FakeAnthropic,
) -> None:
    run = start_run("hostile", '@hang_charge {"cents": 100}')
    run_worker()
    run = reload(run)
    assert run.status == "succeeded"
    [effect] = ToolEffect.objects.filter(run_id=run.pk)
    assert effect.is_error
    assert "timed out" in effect.result


def test_a_hung_irreversible_call_leaves_its_intent_unknown_for_a_person(
    fake_api: FakeAnthropic,
) -> None:
    run = start_run("hostile", '@hang_drop {"table": "orders"}')
    run_worker()
    intent = ToolIntent.objects.get(run_id=run.pk)
    user = approver()
    approve_intent(intent.pk, user=user)
    run_worker()
    intent.refresh_from_db()
    run = reload(run)
    # Never retried blindly, never recorded as a plain failure: a person must say.
    assert (intent.status, run.status) == (IntentStatus.UNKNOWN, "waiting")
    assert not ToolEffect.objects.filter(run_id=run.pk).exists()

    resolve_intent(intent.pk, user=user, happened=True, result="dropped after all")
    run_worker()
    assert reload(run).status == "succeeded"
    [block] = results_sent(run)
    assert block["content"] == "dropped after all"


def test_cancel_frees_the_slot_of_a_hung_tool(fake_api: FakeAnthropic) -> None:
    run = start_run("hostile", "@hang_long {}")
    worker = Worker(burst=True, handle_signals=False, heartbeat_seconds=0.2)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    assert STARTED.wait(15)
    assert cancel_run(run.pk)
    thread.join(15)
    assert not thread.is_alive(), "the slot stayed in the hung tool"
    assert worker.stats.dispositions == {"cancelled": 1}
    assert not ToolEffect.objects.filter(run_id=run.pk).exists()


# -- 6. tool code that exits; a slot that dies -------------------------------------------------


def test_sys_exit_in_a_tool_is_a_tool_error_and_the_worker_goes_on(
    fake_api: FakeAnthropic,
) -> None:
    first = start_run("hostile", '@exit_now {"code": 3}')
    second = start_run("hostile", '@exit_now {"code": 0}')
    worker = Worker(burst=True, handle_signals=False)
    assert worker.run() == 0
    assert worker.stats.dispositions == {"succeeded": 2}
    for run in (first, second):
        [block] = results_sent(reload(run))
        assert block["is_error"] is True
        assert block["content"].startswith("exit_now raised SystemExit")


def test_a_slot_that_dies_makes_the_worker_exit_non_zero(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    start_run("hostile", "Nothing to do.")

    def broken(*args: Any, **kwargs: Any) -> str:
        raise SystemExit("a bug in the runtime, not in a tool")

    monkeypatch.setattr(worker_module, "advance_run", broken)
    worker = Worker(burst=True, handle_signals=False, grace_seconds=0)
    with caplog.at_level(logging.CRITICAL, logger="durable_agents.worker"):
        assert worker.run() == 1
    assert any("died" in r.getMessage() for r in caplog.records)


# -- the error text the model sees -------------------------------------------------------------


def test_the_default_error_text_names_the_type_and_message(fake_api: FakeAnthropic) -> None:
    run = start_run("hostile", "@leak_secret {}")
    run_worker()
    [block] = results_sent(reload(run))
    assert (
        block["content"] == "leak_secret raised RuntimeError: could not connect: password=hunter2"
    )


def test_tool_error_formatter_redacts_what_the_model_and_transcript_see(
    fake_api: FakeAnthropic, da_settings
) -> None:
    da_settings(TOOL_ERROR_FORMATTER="tests.integration.test_hostile.redact")
    run = start_run("hostile", "@leak_secret {}")
    run_worker()
    [block] = results_sent(reload(run))
    assert block["content"] == "leak_secret failed (RuntimeError); details are in the worker's log"
    assert "hunter2" not in ToolEffect.objects.get(run_id=run.pk).result
    assert "hunter2" not in json.dumps(fake_api.requests[1].json())


def test_a_broken_formatter_shows_only_the_error_type(fake_api: FakeAnthropic, da_settings) -> None:
    da_settings(TOOL_ERROR_FORMATTER="tests.integration.test_hostile.broken_formatter")
    run = start_run("hostile", "@leak_secret {}")
    run_worker()
    [block] = results_sent(reload(run))
    assert block["content"] == "leak_secret raised RuntimeError"


# -- 1. poison runs always end ------------------------------------------------------------------


@pytest.fixture
def refusing_trigger() -> Iterator[None]:
    """PostgreSQL refuses to store a dead-letter reason that holds 'trigger-refuses', as it
    refuses NUL: the first way of ending the run fails, the run must end all the same."""
    with connection.cursor() as cursor:
        cursor.execute(
            """
            CREATE FUNCTION da_refuse_reason() RETURNS trigger AS $$
            BEGIN
                IF NEW.status = 'dead' AND NEW.error LIKE '%trigger-refuses%' THEN
                    RAISE EXCEPTION 'refused by test trigger' USING ERRCODE = '22000';
                END IF;
                RETURN NEW;
            END $$ LANGUAGE plpgsql;
            CREATE TRIGGER da_refuse_reason BEFORE UPDATE ON agent_run
                FOR EACH ROW EXECUTE FUNCTION da_refuse_reason();
            """
        )
    yield
    with connection.cursor() as cursor:
        cursor.execute(
            "DROP TRIGGER da_refuse_reason ON agent_run; DROP FUNCTION da_refuse_reason();"
        )


@pytest.mark.postgres
def test_a_run_whose_dead_letter_reason_cannot_be_stored_still_ends(
    fake_api: FakeAnthropic, refusing_trigger: None, da_settings
) -> None:
    da_settings(MAX_ATTEMPTS=2)
    run = start_run("hostile", "@hang {}")
    # Claims in a row that committed nothing, the last of which failed with this error.
    AgentRun.objects.filter(pk=run.pk).update(stalled_claims=2, error="trigger-refuses")
    worker = run_worker(max_runs=3)
    run = reload(run)
    assert worker.stats.claims == 1
    assert run.status == "dead"
    assert run.error.startswith("dead-lettered; the reason could not be stored (DataError)")
    assert fake_api.requests == []  # ended without asking the model again


@pytest.mark.postgres
def test_a_step_the_database_refuses_ends_the_run_at_once(
    fake_api: FakeAnthropic, da_settings
) -> None:
    # Strict commits: no model call is in flight while the results commit.
    da_settings(OVERLAP_SAFE_COMMITS=False)
    with steps_refused("tool_result"):
        run = start_run("hostile", "@leak_secret {}")
        worker = run_worker(max_runs=5)
    run = reload(run)
    assert (worker.stats.claims, run.status) == (1, "dead")
    assert run.error.startswith("step 2 (tool_result) could not be stored: value out of range")
    assert len(fake_api.requests) == 1


def test_a_model_answer_nested_deeper_than_python_decodes_is_stored_and_answered(
    fake_api: FakeAnthropic,
) -> None:
    """3,000 levels: past the json module's recursion limit. The turn is stored byte for byte
    and the model is told its input is too deep; the run goes on (it used to cost
    MAX_ATTEMPTS paid calls, then a cryptic dead letter)."""
    deep = "[" * 3000 + "]" * 3000
    body = (
        '{"id":"msg_deep","type":"message","role":"assistant","model":"claude-test-1",'
        '"content":[{"type":"tool_use","id":"toolu_1","name":"hang","input":{"x":'
        + deep
        + '}}],"stop_reason":"tool_use","usage":{"input_tokens":1,"output_tokens":1}}'
    )
    headers = {"content-type": "application/json", "request-id": "req_deep"}
    fake_api.fail_next((200, headers, body.encode()))
    run = start_run("hostile", "@hang {}")
    worker = run_worker(max_runs=5)
    run = reload(run)
    assert (worker.stats.claims, run.status) == (1, "succeeded")
    assert AgentStep.objects.get(run_id=run.pk, seq=1).payload == body
    [block] = results_sent(run)
    assert block["is_error"] is True
    assert (
        block["content"] == "Invalid input for tool 'hang': the input nests deeper than 100 levels"
    )
    assert not STARTED.is_set()  # the tool never ran
    # The next request carried the deep turn back as received.
    assert deep in fake_api.requests[1].body.decode()


# -- 4. lost wake-ups ---------------------------------------------------------------------------


def test_a_late_completion_settles_an_unknown_intent_and_wakes_the_run(
    fake_api: FakeAnthropic,
) -> None:
    run, intent = parked_drop()
    approve_intent(intent.pk, user=approver())
    # Worker A claimed the run, marked the intent executing and called the tool; its lease
    # expired while the tool ran (the run is claimable again).
    ToolIntent.objects.filter(pk=intent.pk).update(status=IntentStatus.EXECUTING)
    AgentRun.objects.filter(pk=run.pk).update(status="pending")
    # Worker B finds the intent executing: outcome unknown, the run waits for a person.
    run_worker()
    assert (reload(run).status, ToolIntent.objects.get(pk=intent.pk).status) == (
        "waiting",
        IntentStatus.UNKNOWN,
    )
    # Worker A's call returns after all: its outcome is recorded and the run wakes.
    late = ToolEffect(
        key=intent.key,
        run_id=run.pk,
        seq=intent.seq,
        call_index=intent.call_index,
        tool="drop",
        result="dropped orders (late)",
    )
    effects.complete_intent(intent, late)
    assert ToolIntent.objects.get(pk=intent.pk).status == IntentStatus.DONE
    assert reload(run).status == "pending"

    run_worker()
    assert reload(run).status == "succeeded"
    assert DROPS == []  # B never ran it: A's recorded result was used
    [block] = results_sent(run)
    assert block["content"] == "dropped orders (late)"


def test_an_approval_between_reading_the_intent_and_parking_does_not_strand_the_run(
    fake_api: FakeAnthropic, monkeypatch: pytest.MonkeyPatch
) -> None:
    run, intent = parked_drop()
    # A requeued run: claimable while its intent is still pending.
    AgentRun.objects.filter(pk=run.pk).update(status="pending")
    user = approver()
    chosen = store.current()  # the runner reads intents through the chosen store
    read = chosen.intent_for_key

    def read_then_a_person_approves(key: str) -> ToolIntent | None:
        found = read(key)  # the worker sees "pending" ...
        approve_intent(intent.pk, user=user)  # ... and a person approves right then
        return found

    monkeypatch.setattr(chosen, "intent_for_key", read_then_a_person_approves)
    run_worker()
    assert reload(run).status == "succeeded"
    assert DROPS == ["orders"]
    assert ToolIntent.objects.get(pk=intent.pk).status == IntentStatus.DONE


# -- 7. a cancel racing the start of an approved irreversible call -----------------------------


@pytest.mark.postgres
def test_a_cancel_cannot_land_between_the_fence_and_an_approved_irreversible_call(
    fake_api: FakeAnthropic,
) -> None:
    run, intent = parked_drop()
    approve_intent(intent.pk, user=approver())

    # Stop the worker where it marks the intent executing: hold the intent's row lock.
    holder = psycopg.connect(database_url())
    holder.execute("SELECT 1 FROM tool_intent WHERE id = %s FOR UPDATE", (intent.pk,))
    worker = Worker(burst=True, handle_signals=False)
    worker_thread = threading.Thread(target=worker.run, daemon=True)
    worker_thread.start()
    try:
        wait_for(
            lambda: backend_waits_on_lock("tool_intent"), timeout=15, what="the worker to wait"
        )
        # A person cancels right now, while the worker is between its fence and the call.
        cancel_thread = threading.Thread(target=cancel_run, args=(run.pk,), daemon=True)
        cancel_thread.start()
        wait_for(
            lambda: not cancel_thread.is_alive() or backend_waits_on_lock("agent_run"),
            timeout=15,
            what="the cancel to finish or wait",
        )
        # The run row is locked by the worker's fenced statement: the cancel is ordered
        # after the call started. Before, the fence had already been let go, the cancel
        # committed, and the tool ran for a cancelled run.
        cancel_landed_first = not cancel_thread.is_alive()
    finally:
        holder.rollback()
        holder.close()
    worker_thread.join(15)
    cancel_thread.join(15)
    assert not cancel_landed_first
    assert reload(run).status == "cancelled"
    assert DROPS == ["orders"]  # it started before the cancel, so it ran, once
    assert ToolIntent.objects.get(pk=intent.pk).status == IntentStatus.DONE


def test_a_cancel_that_commits_first_means_the_approved_call_never_starts(
    fake_api: FakeAnthropic,
) -> None:
    run, intent = parked_drop()
    approve_intent(intent.pk, user=approver())
    AgentRun.objects.filter(pk=run.pk).update(status="pending")
    claim = store.current().claim_run(run.pk, "w", 30)
    assert claim is not None
    assert cancel_run(run.pk)
    assert not store.current().start_intent_execution(claim, intent)
    assert ToolIntent.objects.get(pk=intent.pk).status == IntentStatus.APPROVED
