"""durable_agents.api: starting, cancelling and requeueing runs; deciding tool intents.

Intents are produced the real way, by an in-process worker running a ``drop_table`` call
(an irreversible tool) against the fake API, so those tests use ``transaction=True``.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import AnonymousUser, Permission
from django.core.exceptions import PermissionDenied
from django.db import connection

import durable_agents
from durable_agents import api
from durable_agents.api import (
    approve_intent,
    cancel_run,
    reject_intent,
    requeue_run,
    resolve_intent,
    start_run,
)
from durable_agents.declare.agents import AgentNotFound, registry
from durable_agents.engine import effects
from durable_agents.models import AgentRun, AgentStep, RunStatus, ToolEffect, ToolIntent
from tests.conftest import run_worker
from tests.fakeserver import FakeAnthropic
from tests.integration.conftest import call_at_once

DROP_TASK = 'Drop the orders table.\n@drop_table {"table": "orders"}'


def reload(run: AgentRun) -> AgentRun:
    return AgentRun.objects.get(pk=run.pk)


def make_user(username: str, *, can_approve: bool = False) -> Any:
    user = get_user_model().objects.create_user(username, f"{username}@example.com", "pw")
    if can_approve:
        user.user_permissions.add(
            Permission.objects.get(
                content_type__app_label="durable_agents", codename="approve_toolintent"
            )
        )
    # A fresh instance: permissions are cached on the object.
    return get_user_model().objects.get(pk=user.pk)


def intent_snapshot(intent_id: int) -> tuple[Any, ...]:
    i = ToolIntent.objects.get(pk=intent_id)
    return (i.status, i.decided_by_id, i.decided_at, i.reason, i.updated_at)


def tool_result_of(run: AgentRun) -> list[dict[str, Any]]:
    """The content of the run's (only) tool_result step."""
    return json.loads(AgentStep.objects.get(run_id=run.pk, kind="tool_result").payload)


# --------------------------------------------------------------------------- start_run


@pytest.mark.django_db
def test_start_run_pins_agent_version_model_and_fingerprint() -> None:
    task = 'Überprüfe die Tabelle 😀\n@lookup {"key": "a"}'
    run = start_run("tester", task)
    agent = registry.get("tester", "v1")
    assert isinstance(run, AgentRun)
    assert (run.agent, run.prompt_version, run.model) == ("tester", "v1", "claude-test-1")
    assert run.fingerprint == agent.fingerprint("claude-test-1")
    assert len(run.fingerprint) == 64
    assert (run.status, run.task, run.attempt, run.stalled_claims, run.last_seq) == (
        "pending",
        task,
        0,
        0,
        0,
    )
    assert (run.lease_owner, run.lease_until, run.result, run.error) == (None, None, None, "")
    assert run.created_at is not None
    assert run.finished_at is None
    steps = list(AgentStep.objects.filter(run_id=run.pk))
    assert [(s.seq, s.kind, s.payload, s.attempt) for s in steps] == [
        (0, "task", json.dumps(task, ensure_ascii=False), 0)
    ]
    assert "😀" in steps[0].payload


@pytest.mark.django_db
def test_start_run_with_explicit_version_and_model() -> None:
    run = start_run("tester", "hello", version="v1", model="claude-other-9")
    agent = registry.get("tester", "v1")
    assert (run.prompt_version, run.model) == ("v1", "claude-other-9")
    assert run.fingerprint == agent.fingerprint("claude-other-9")
    assert run.fingerprint != agent.fingerprint("claude-test-1")


@pytest.mark.django_db
def test_start_run_is_exported_by_the_package() -> None:
    assert durable_agents.start_run is api.start_run
    assert durable_agents.cancel_run is api.cancel_run
    assert durable_agents.requeue_run is api.requeue_run
    assert durable_agents.messages_for is api.messages_for
    assert durable_agents.resolve_intent is api.resolve_intent


@pytest.mark.django_db
def test_start_run_unknown_agent_or_version() -> None:
    with pytest.raises(AgentNotFound, match="no agent named 'nobody' is registered"):
        start_run("nobody", "do something")
    with pytest.raises(AgentNotFound, match="agent 'tester' has no version 'v99'"):
        start_run("tester", "do something", version="v99")
    assert AgentRun.objects.count() == 0
    assert AgentStep.objects.count() == 0


@pytest.mark.django_db
@pytest.mark.parametrize("task", ["", "   ", "\n\t ", None, 42])
def test_start_run_needs_a_non_empty_task(task: Any) -> None:
    with pytest.raises(ValueError, match=r"^a run needs a non-empty task$"):
        start_run("tester", task)
    assert AgentRun.objects.count() == 0


@pytest.mark.django_db
@pytest.mark.parametrize("task", ["drop\x00everything", "lone \ud800 surrogate"])
def test_start_run_refuses_a_task_the_database_cannot_store(task: str) -> None:
    with pytest.raises(ValueError, match="NUL characters or lone surrogates"):
        start_run("tester", task)
    assert AgentRun.objects.count() == 0


# --------------------------------------------------------------------------- start_run(key=)


@pytest.mark.django_db
def test_a_start_key_returns_the_first_run_and_its_task_wins() -> None:
    first = start_run("tester", "Refund ticket 7", key="ticket-7")
    again = start_run("tester", "Refund ticket 7, again", key="ticket-7")
    assert again.pk == first.pk
    assert again.task == "Refund ticket 7"
    assert again.start_key == "ticket-7"
    assert AgentRun.objects.count() == 1
    assert AgentStep.objects.filter(run_id=first.pk).count() == 1


@pytest.mark.django_db
def test_a_start_key_is_per_agent_and_no_key_starts_a_run_each_time() -> None:
    mine = start_run("tester", "t", key="ticket-7")
    theirs = start_run("thinker", "t", key="ticket-7")
    assert mine.pk != theirs.pk
    assert start_run("tester", "t").pk != start_run("tester", "t").pk
    assert AgentRun.objects.count() == 4


@pytest.mark.django_db
@pytest.mark.parametrize("status", list(RunStatus))
def test_a_start_key_finds_its_run_in_every_status(status: str) -> None:
    first = start_run("tester", "t", key="order-42")
    AgentRun.objects.filter(pk=first.pk).update(status=status)
    again = start_run("tester", "another task", key="order-42")
    assert (again.pk, again.status) == (first.pk, status)
    assert AgentRun.objects.count() == 1


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("key", "message"),
    [
        ("", "non-empty string"),
        ("   ", "non-empty string"),
        (42, "non-empty string"),
        (b"ticket-7", "non-empty string"),
        ("k" * 201, "at most 200 characters; this one has 201"),
        ("k" * 10_000, "at most 200 characters; this one has 10000"),
        ("ticket\x007", "NUL characters or lone surrogates"),
        ("ticket \ud800", "NUL characters or lone surrogates"),
    ],
)
def test_a_bad_start_key_is_refused_and_starts_nothing(key: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        start_run("tester", "t", key=key)
    assert AgentRun.objects.count() == 0


@pytest.mark.django_db
def test_a_start_key_of_200_characters_is_stored_whole() -> None:
    key = "é" * 200
    assert start_run("tester", "t", key=key).start_key == key
    assert start_run("tester", "t", key=key).pk == AgentRun.objects.get(start_key=key).pk


def _start_at_once(callers: int, at_once: int) -> tuple[list[Any], list[BaseException]]:
    """``callers`` threads call ``start_run(key=...)`` with one key, released together; at
    most ``at_once`` hold a database connection at a time. Each closes its connection."""
    return call_at_once(
        lambda i: start_run("tester", f"attempt {i}", key="ticket-100").pk,
        callers,
        at_once=at_once,
        join_seconds=60,
    )


# The test server's max_connections is 100, shared with the test's own connection and other
# clients: at most this many of the callers hold a connection at the same time.
PG_CALLERS_AT_ONCE = 40


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_concurrent_starts_with_one_key_make_one_run_on_postgres() -> None:
    got, errors = _start_at_once(callers=100, at_once=PG_CALLERS_AT_ONCE)
    assert errors == []
    assert len(got) == 100
    [run] = AgentRun.objects.filter(start_key="ticket-100")
    assert set(got) == {run.pk}
    assert AgentStep.objects.filter(run_id=run.pk).count() == 1
    assert AgentRun.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_concurrent_starts_with_one_key_make_one_run() -> None:
    got, errors = _start_at_once(callers=8, at_once=8)
    assert errors == []
    assert len(got) == 8
    [run] = AgentRun.objects.filter(start_key="ticket-100")
    assert set(got) == {run.pk}
    assert AgentStep.objects.filter(run_id=run.pk).count() == 1


# --------------------------------------------------------------------------- start_run(priority=)


@pytest.mark.django_db
@pytest.mark.parametrize("priority", [0, 1, 50, 100])
def test_start_run_stores_its_priority(priority: int) -> None:
    run = start_run("tester", "hello", priority=priority)
    assert reload(run).priority == priority


@pytest.mark.django_db
def test_start_run_defaults_to_priority_0() -> None:
    assert reload(start_run("tester", "hello")).priority == 0


@pytest.mark.django_db
@pytest.mark.parametrize("priority", [-1, 101, 32768, 10**12])
def test_start_run_refuses_a_priority_out_of_range(priority: int) -> None:
    with pytest.raises(ValueError, match=r"^a priority is between 0 and 100 inclusive"):
        start_run("tester", "hello", priority=priority)
    assert AgentRun.objects.count() == 0


@pytest.mark.django_db
@pytest.mark.parametrize("priority", [True, False, 5.0, "5", None])
def test_start_run_refuses_a_priority_that_is_not_an_int(priority: Any) -> None:
    with pytest.raises(ValueError, match=r"^a priority is an int, not "):
        start_run("tester", "hello", priority=priority)
    assert AgentRun.objects.count() == 0


@pytest.mark.django_db
def test_a_run_inserted_without_a_priority_gets_0() -> None:
    # Code deployed before the column existed (a rolling deploy) inserts without it.
    run = start_run("tester", "hello", priority=30)
    new_id = uuid.uuid4()
    id_field = AgentRun._meta.get_field("id")
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO agent_run (id, agent, prompt_version, fingerprint, model, task, status,"
            " attempt, stalled_claims, last_seq, error)"
            " SELECT %s, agent, prompt_version, fingerprint, model, task, status, 0, 0, 0, ''"
            " FROM agent_run WHERE id = %s",
            [
                id_field.get_db_prep_value(new_id, connection),
                id_field.get_db_prep_value(run.pk, connection),
            ],
        )
    assert AgentRun.objects.get(pk=new_id).priority == 0


# --------------------------------------------------------------------------- cancel / requeue


@pytest.mark.django_db
def test_cancel_pending_run() -> None:
    run = start_run("tester", "hello")
    assert cancel_run(run.pk) is True
    run = reload(run)
    assert run.status == "cancelled"
    assert run.finished_at is not None
    assert (run.lease_owner, run.lease_until) == (None, None)
    # Cancelling again changes nothing.
    finished_at = run.finished_at
    assert cancel_run(run.pk) is False
    assert reload(run).finished_at == finished_at


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("status", "cancellable"),
    [
        ("pending", True),
        ("running", True),
        ("waiting", True),
        ("succeeded", False),
        ("failed", False),
        ("cancelled", False),
        ("dead", True),  # closing a dead run is part of triage
    ],
)
def test_cancel_by_status(status: str, cancellable: bool) -> None:
    run = start_run("tester", "hello")
    AgentRun.objects.filter(pk=run.pk).update(status=status)
    assert cancel_run(run.pk) is cancellable
    assert reload(run).status == ("cancelled" if cancellable else status)


@pytest.mark.django_db
def test_cancel_unknown_run() -> None:
    assert cancel_run("00000000-0000-0000-0000-000000000000") is False


@pytest.mark.django_db
def test_requeue_dead_run() -> None:
    run = start_run("tester", "hello")
    AgentRun.objects.filter(pk=run.pk).update(
        status="dead", stalled_claims=9, attempt=9, error="it broke", lease_owner=None
    )
    assert requeue_run(run.pk) is True
    run = reload(run)
    assert (run.status, run.stalled_claims, run.attempt) == ("pending", 0, 9)
    assert run.error == "it broke"  # kept as history
    assert (run.finished_at, run.lease_owner, run.lease_until) == (None, None, None)
    assert AgentRun.objects.claimable().filter(pk=run.pk).exists()


@pytest.mark.django_db
@pytest.mark.parametrize("status", ["pending", "running", "waiting", "succeeded", "cancelled"])
def test_requeue_only_dead_runs(status: str) -> None:
    run = start_run("tester", "hello")
    AgentRun.objects.filter(pk=run.pk).update(status=status, stalled_claims=3)
    assert requeue_run(run.pk) is False
    run = reload(run)
    assert (run.status, run.stalled_claims) == (status, 3)


# --------------------------------------------------------------------------- intents


@pytest.fixture
def waiting(fake_api: FakeAnthropic, receiver: Any) -> tuple[AgentRun, ToolIntent]:
    """A run parked on a pending drop_table intent."""
    run = start_run("tester", DROP_TASK)
    worker = run_worker()
    assert worker.stats.dispositions == {"waiting": 1}
    run = reload(run)
    assert run.status == "waiting"
    intent = ToolIntent.objects.get(run_id=run.pk)
    assert intent.status == "pending"
    assert intent.key == effects.idempotency_key(run.pk, 1, 0, "drop_table", {"table": "orders"})
    assert receiver.attempts() == []
    return run, intent


@pytest.mark.django_db(transaction=True)
def test_approve_runs_the_tool_once(waiting: Any, receiver: Any) -> None:
    run, intent = waiting
    alice = make_user("alice", can_approve=True)
    decided = approve_intent(intent.pk, user=alice)
    assert (decided.status, decided.decided_by_id, decided.reason) == ("approved", alice.pk, "")
    assert decided.decided_at is not None
    assert reload(run).status == "pending"

    worker = run_worker()
    assert worker.stats.dispositions == {"succeeded": 1}
    assert reload(run).status == "succeeded"
    assert ToolIntent.objects.get(pk=intent.pk).status == "done"
    assert [(a["kind"], a["key"]) for a in receiver.attempts()] == [("drop", intent.key)]
    ((call_id,),) = [
        [b["id"] for b in json.loads(s.payload)["content"] if b["type"] == "tool_use"]
        for s in AgentStep.objects.filter(run_id=run.pk, seq=1)
    ]
    assert tool_result_of(run) == [
        {"type": "tool_result", "tool_use_id": call_id, "content": "dropped orders"}
    ]
    effect = ToolEffect.objects.get(key=intent.key)
    assert (effect.result, effect.is_error) == ("dropped orders", False)


@pytest.mark.django_db(transaction=True)
def test_reject_gives_the_model_an_error_naming_who_and_why(waiting: Any, receiver: Any) -> None:
    run, intent = waiting
    alice = make_user("alice", can_approve=True)
    decided = reject_intent(intent.pk, user=alice, reason="too risky")
    assert (decided.status, decided.decided_by_id, decided.reason) == (
        "rejected",
        alice.pk,
        "too risky",
    )
    assert reload(run).status == "pending"

    run_worker()
    run = reload(run)
    assert (run.status, run.result) == ("succeeded", "Done. 1 planned turns completed.")
    assert receiver.attempts() == []
    (block,) = tool_result_of(run)
    assert block["content"] == "drop_table was not run: rejected by alice: too risky"
    assert block["is_error"] is True
    assert ToolIntent.objects.get(pk=intent.pk).status == "rejected"


@pytest.mark.django_db(transaction=True)
def test_reject_without_reason(waiting: Any) -> None:
    run, intent = waiting
    reject_intent(intent.pk, user=make_user("bob", can_approve=True))
    run_worker()
    (block,) = tool_result_of(run)
    assert block["content"] == "drop_table was not run: rejected by bob: no reason given"


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("who", ["plain", "staff", "anonymous", "none"])
def test_deciding_needs_the_permission(waiting: Any, receiver: Any, who: str) -> None:
    run, intent = waiting
    if who == "plain":
        user: Any = make_user("mallory")
    elif who == "staff":
        user = make_user("stafford")
        user.is_staff = True
        user.save()
    elif who == "anonymous":
        user = AnonymousUser()
    else:
        user = None
    before = intent_snapshot(intent.pk)
    message = "deciding tool intents needs the durable_agents.approve_toolintent permission"
    with pytest.raises(PermissionDenied, match=message):
        approve_intent(intent.pk, user=user)
    with pytest.raises(PermissionDenied, match=message):
        reject_intent(intent.pk, user=user, reason="no")
    with pytest.raises(PermissionDenied, match=message):
        resolve_intent(intent.pk, user=user, happened=True, result="x")
    assert intent_snapshot(intent.pk) == before
    assert before[:4] == ("pending", None, None, "")
    assert reload(run).status == "waiting"
    assert ToolEffect.objects.filter(run_id=run.pk).count() == 0
    assert run_worker().stats.claims == 0
    assert receiver.attempts() == []


@pytest.mark.django_db(transaction=True)
def test_deciding_twice_is_harmless(waiting: Any, receiver: Any) -> None:
    run, intent = waiting
    alice = make_user("alice", can_approve=True)
    bob = make_user("bob", can_approve=True)
    approve_intent(intent.pk, user=alice)
    first = intent_snapshot(intent.pk)

    again = approve_intent(intent.pk, user=bob)
    assert (again.status, again.decided_by_id) == ("approved", alice.pk)
    late = reject_intent(intent.pk, user=bob, reason="changed my mind")
    assert (late.status, late.decided_by_id, late.reason) == ("approved", alice.pk, "")
    assert intent_snapshot(intent.pk) == first

    run_worker()
    assert reload(run).status == "succeeded"
    assert len(receiver.attempts("drop")) == 1
    # After the run, deciding still changes nothing and runs nothing.
    assert approve_intent(intent.pk, user=bob).status == "done"
    assert reject_intent(intent.pk, user=bob).status == "done"
    assert reload(run).status == "succeeded"
    assert len(receiver.attempts("drop")) == 1


@pytest.mark.django_db(transaction=True)
def test_reject_then_approve_stays_rejected(waiting: Any, receiver: Any) -> None:
    _run, intent = waiting
    alice = make_user("alice", can_approve=True)
    reject_intent(intent.pk, user=alice, reason="no")
    assert approve_intent(intent.pk, user=alice).status == "rejected"
    run_worker()
    assert receiver.attempts() == []


@pytest.mark.django_db(transaction=True)
def test_resolve_only_applies_to_unknown_intents(waiting: Any) -> None:
    run, intent = waiting
    alice = make_user("alice", can_approve=True)
    before = intent_snapshot(intent.pk)
    same = resolve_intent(intent.pk, user=alice, happened=True, result="it happened")
    assert same.status == "pending"
    assert intent_snapshot(intent.pk) == before
    assert ToolEffect.objects.count() == 0
    assert reload(run).status == "waiting"

    approve_intent(intent.pk, user=alice)
    resolve_intent(intent.pk, user=alice, happened=False)
    assert ToolIntent.objects.get(pk=intent.pk).status == "approved"


def _make_unknown(run: AgentRun, intent: ToolIntent, receiver: Any) -> Any:
    """Approve, then leave the intent as a worker that died mid-call would: ``executing``
    without an effect. The next worker must mark it unknown and wait for a person."""
    alice = make_user("alice", can_approve=True)
    approve_intent(intent.pk, user=alice)
    ToolIntent.objects.filter(pk=intent.pk).update(status="executing")
    worker = run_worker()
    assert worker.stats.dispositions == {"waiting": 1}
    assert reload(run).status == "waiting"
    assert ToolIntent.objects.get(pk=intent.pk).status == "unknown"
    assert receiver.attempts() == []  # never re-run blindly
    return alice


@pytest.mark.django_db(transaction=True)
def test_resolve_unknown_as_happened_uses_the_given_result(waiting: Any, receiver: Any) -> None:
    run, intent = waiting
    alice = _make_unknown(run, intent, receiver)

    resolved = resolve_intent(
        intent.pk,
        user=alice,
        happened=True,
        result={"dropped": "orders", "rows": 3},
        reason="checked",
    )
    assert (resolved.status, resolved.decided_by_id, resolved.reason) == (
        "done",
        alice.pk,
        "checked",
    )
    effect = ToolEffect.objects.get(key=intent.key)
    assert (effect.result, effect.is_error, effect.seq, effect.call_index, effect.tool) == (
        '{"dropped": "orders", "rows": 3}',
        False,
        1,
        0,
        "drop_table",
    )
    assert reload(run).status == "pending"

    # Resolving again changes nothing.
    assert resolve_intent(intent.pk, user=alice, happened=False).status == "done"
    assert ToolEffect.objects.get(key=intent.key).result == '{"dropped": "orders", "rows": 3}'

    run_worker()
    run = reload(run)
    assert run.status == "succeeded"
    assert receiver.attempts() == []
    (block,) = tool_result_of(run)
    assert block["content"] == '{"dropped": "orders", "rows": 3}'
    assert "is_error" not in block


@pytest.mark.django_db(transaction=True)
def test_resolve_unknown_as_happened_without_result(waiting: Any, receiver: Any) -> None:
    run, intent = waiting
    alice = _make_unknown(run, intent, receiver)
    resolve_intent(intent.pk, user=alice, happened=True)
    assert ToolEffect.objects.get(key=intent.key).result == ""
    run_worker()
    assert reload(run).status == "succeeded"
    assert receiver.attempts() == []


@pytest.mark.django_db(transaction=True)
def test_resolve_unknown_as_not_happened_runs_it_again(waiting: Any, receiver: Any) -> None:
    run, intent = waiting
    alice = _make_unknown(run, intent, receiver)
    resolved = resolve_intent(intent.pk, user=alice, happened=False, reason="nothing changed")
    assert (resolved.status, resolved.reason) == ("approved", "nothing changed")
    assert ToolEffect.objects.filter(key=intent.key).count() == 0
    assert reload(run).status == "pending"

    run_worker()
    assert reload(run).status == "succeeded"
    assert [a["key"] for a in receiver.attempts("drop")] == [intent.key]
    assert ToolIntent.objects.get(pk=intent.pk).status == "done"
    assert ToolEffect.objects.get(key=intent.key).result == "dropped orders"


@pytest.mark.django_db(transaction=True)
def test_cancel_waiting_run_then_decide(waiting: Any, receiver: Any) -> None:
    run, intent = waiting
    assert cancel_run(run.pk) is True
    approve_intent(intent.pk, user=make_user("alice", can_approve=True))
    # The approval does not wake a cancelled run.
    assert reload(run).status == "cancelled"
    assert run_worker().stats.claims == 0
    assert receiver.attempts() == []


# -------------------------------------------------------------------- start_run(concurrency_key=)


@pytest.mark.django_db
def test_start_run_stores_its_concurrency_key_and_the_agents_limit() -> None:
    run = reload(start_run("tester", "hello", concurrency_key="tenant:acme"))
    assert (run.concurrency_key, run.concurrency_limit) == ("tenant:acme", None)
    assert reload(start_run("tester", "hello")).concurrency_key is None


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("key", "message"),
    [
        ("", "^a concurrency key cannot be empty$"),
        ("k" * 10_000, "^a concurrency key has at most 200 characters; this one has 10000$"),
        ("a\x00b", "NUL characters or lone surrogates"),
        (7, "^a concurrency key is a string, not int$"),
        (b"tenant", "^a concurrency key is a string, not bytes$"),
    ],
)
def test_start_run_refuses_a_bad_concurrency_key(key: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        start_run("tester", "hello", concurrency_key=key)
    assert AgentRun.objects.count() == 0
