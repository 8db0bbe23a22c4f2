"""The locking statements: claims, fencing, append-only commits, leases on the DB clock."""

from __future__ import annotations

import datetime
import re
import threading
import uuid
from typing import Any

import pytest
from django.db import IntegrityError, connection, connections, transaction
from django.db.models.functions import Now

import durable_agents
from durable_agents.models import (
    AgentRun,
    AgentStep,
    RunStatus,
    StepKind,
    ToolEffect,
    ToolIntent,
)
from durable_agents.store import Claim, NextClaim, Parked, StepWrite, current, postgres

pytestmark = pytest.mark.django_db(transaction=True)


def _runs(count: int) -> list[AgentRun]:
    return [durable_agents.start_run("tester", f"task {i}") for i in range(count)]


def _expire(run_id: uuid.UUID) -> None:
    AgentRun.objects.filter(pk=run_id).update(lease_until=Now() - datetime.timedelta(seconds=1))


def test_claim_takes_oldest_first_and_sets_the_fence() -> None:
    first, second = _runs(2)
    [claim] = current().claim_runs("w1", 30)
    assert claim.run_id == first.id
    run = AgentRun.objects.get(pk=first.id)
    assert (run.status, run.lease_owner, run.attempt, run.stalled_claims) == (
        RunStatus.RUNNING,
        "w1",
        1,
        1,
    )
    assert claim.attempt == 1
    [other] = current().claim_runs("w2", 30)
    assert other.run_id == second.id
    assert current().claim_runs("w3", 30) == []


def test_lease_expiry_comes_from_the_database_clock() -> None:
    _runs(1)
    [claim] = current().claim_runs("w1", 120)
    run = AgentRun.objects.get(pk=claim.run_id)
    db_now = AgentRun.objects.annotate(db_now=Now()).values_list("db_now", flat=True).first()
    assert run.lease_until is not None
    assert db_now is not None
    remaining = (run.lease_until - db_now).total_seconds()
    assert 110 < remaining <= 120


def test_waiting_finished_and_leased_runs_are_not_claimable() -> None:
    waiting, done, leased, expired = _runs(4)
    AgentRun.objects.filter(pk=waiting.id).update(status=RunStatus.WAITING)
    AgentRun.objects.filter(pk=done.id).update(status=RunStatus.SUCCEEDED)
    assert [c.run_id for c in current().claim_runs("w1", 30, limit=2)] == [leased.id, expired.id]
    _expire(expired.id)
    [again] = current().claim_runs("w2", 30, limit=5)
    assert again.run_id == expired.id
    assert again.attempt == 2


def test_fencing_a_worker_whose_lease_was_taken_over_cannot_commit() -> None:
    run = _runs(1)[0]
    [stale] = current().claim_runs("slow-worker", 30)
    assert current().append_step(stale, StepWrite(1, StepKind.MODEL_TURN, '{"content": []}'))
    _expire(run.id)
    [fresh] = current().claim_runs("new-worker", 30)
    assert fresh.attempt == stale.attempt + 1

    effect = ToolEffect(key="k" * 64, run_id=run.id, seq=1, call_index=0, tool="t", result="r")
    assert not current().append_step(
        stale, StepWrite(2, StepKind.TOOL_RESULT, "[]", effects=[effect])
    )
    assert not current().renew_lease(stale)
    assert not current().finish_run(stale, RunStatus.SUCCEEDED, result="stolen")
    assert not current().release_lease(stale)
    intent = ToolIntent(
        run_id=run.id,
        seq=1,
        call_index=0,
        tool="t",
        input={},
        key="i" * 64,  # type: ignore[misc]  # a JSONTextField takes any JSON value; the stubs say str
    )
    assert current().park_on_intent(stale, intent, new=True) is Parked.FENCE_FAILED
    assert not ToolIntent.objects.filter(key="i" * 64).exists()  # rolled back with the park
    # The effect happened, so it is recorded even though the step was refused.
    assert ToolEffect.objects.filter(key="k" * 64).exists()
    assert list(AgentStep.objects.filter(run_id=run.id).values_list("seq", flat=True)) == [0, 1]

    assert current().append_step(fresh, StepWrite(2, StepKind.TOOL_RESULT, "[]"))
    step = AgentStep.objects.get(run_id=run.id, seq=2)
    assert (step.worker, step.attempt) == ("new-worker", 2)
    assert AgentRun.objects.get(pk=run.id).status == RunStatus.RUNNING


def test_append_refuses_gaps_duplicates_and_cancelled_runs() -> None:
    run = _runs(1)[0]
    [claim] = current().claim_runs("w1", 30)
    assert not current().append_step(
        claim, StepWrite(2, StepKind.MODEL_TURN, "{}")
    )  # gap: seq 1 missing
    assert current().append_step(claim, StepWrite(1, StepKind.MODEL_TURN, "{}"))
    # Seq 1 again from the same claim is its own step (a retried commit whose first try
    # landed): reported committed, not written twice.
    assert current().append_step(claim, StepWrite(1, StepKind.MODEL_TURN, "{}"))
    assert AgentRun.objects.get(pk=run.id).last_seq == 1
    durable_agents.cancel_run(run.id)
    assert not current().append_step(claim, StepWrite(2, StepKind.TOOL_RESULT, "[]"))
    assert AgentStep.objects.filter(run_id=run.id).count() == 2


def test_the_primary_key_forbids_a_second_step_at_the_same_seq() -> None:
    run = _runs(1)[0]
    with pytest.raises(IntegrityError), transaction.atomic():
        AgentStep.objects.create(run_id=run.id, seq=0, kind=StepKind.TASK, payload='"again"')


def test_committing_a_step_resets_the_no_progress_count_and_renews() -> None:
    run = _runs(1)[0]
    for attempt in range(3):
        [claim] = current().claim_runs("w", 30)
        assert claim.attempt == attempt + 1
        _expire(run.id)
    assert AgentRun.objects.get(pk=run.id).stalled_claims == 3
    [claim] = current().claim_runs("w", 30)
    assert current().append_step(claim, StepWrite(1, StepKind.MODEL_TURN, "{}"))
    assert AgentRun.objects.get(pk=run.id).stalled_claims == 0


def test_release_without_counting_the_claim() -> None:
    run = _runs(1)[0]
    [claim] = current().claim_runs("w", 30)
    assert current().release_lease(claim, count_claim=False)
    run.refresh_from_db()
    assert (run.status, run.lease_owner, run.lease_until, run.stalled_claims) == (
        RunStatus.PENDING,
        None,
        None,
        0,
    )
    [again] = current().claim_runs("w2", 30)  # claimable at once, no expiry to wait for
    assert again.run_id == run.id


@pytest.mark.postgres
def test_concurrent_claimers_never_share_a_run() -> None:
    _runs(60)
    claimed: dict[str, list] = {}
    barrier = threading.Barrier(6)

    def claimer(name: str) -> None:
        barrier.wait()
        mine: list[uuid.UUID] = []
        try:
            while batch := current().claim_runs(name, 30, limit=2):
                mine.extend(c.run_id for c in batch)
        finally:
            connections.close_all()
        claimed[name] = mine

    threads = [threading.Thread(target=claimer, args=(f"w{i}",)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    everything = [run_id for ids in claimed.values() for run_id in ids]
    assert len(everything) == 60
    assert len(set(everything)) == 60
    assert AgentRun.objects.filter(attempt=1).count() == 60


@pytest.mark.postgres
def test_claim_skips_a_row_locked_by_another_transaction_without_waiting() -> None:
    locked, free = _runs(2)
    holding = threading.Event()
    done = threading.Event()

    def hold_lock() -> None:
        with transaction.atomic():
            list(AgentRun.objects.select_for_update().filter(pk=locked.id))
            holding.set()
            done.wait(10)
        connections.close_all()

    holder = threading.Thread(target=hold_lock)
    holder.start()
    assert holding.wait(10)
    try:
        [claim] = current().claim_runs("w", 30)
        assert claim.run_id == free.id
    finally:
        done.set()
        holder.join()


@pytest.mark.postgres
def test_claim_is_not_blocked_by_a_step_insert_in_flight() -> None:
    """Inserting a step takes FOR KEY SHARE on its run (the foreign key). The claim locks FOR
    NO KEY UPDATE, which does not conflict with it; a plain FOR UPDATE would skip the run."""
    run = _runs(1)[0]
    inserted = threading.Event()
    done = threading.Event()

    def insert_step() -> None:
        with transaction.atomic():
            AgentStep.objects.create(run_id=run.id, seq=5, kind=StepKind.TOOL_RESULT, payload="[]")
            inserted.set()
            done.wait(10)
            transaction.set_rollback(True)
        connections.close_all()

    inserter = threading.Thread(target=insert_step)
    inserter.start()
    assert inserted.wait(10)
    try:
        claims = current().claim_runs("w", 30)
        assert [c.run_id for c in claims] == [run.id]
    finally:
        done.set()
        inserter.join()


@pytest.mark.postgres
def test_the_claim_query_can_use_the_partial_index() -> None:
    _runs(3)
    subquery = postgres.CLAIMABLE_SQL
    # The plain index on (status, created_at) covers the claimable rows too, and on a table
    # this small the planner may take it instead (by the sizes earlier tests left): it is
    # dropped for the EXPLAIN, in a transaction rolled back after it, so the question is
    # whether a partial index serves the claim, not which of two serves a tiny table.
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("DROP INDEX agent_run_status")
        cursor.execute("SET LOCAL enable_seqscan = off")
        cursor.execute(
            "EXPLAIN " + subquery.replace("%(limit)s", "1"),
            {"limit_keys": ["tenant:a"], "limit_values": [2], "serves": ["a\x1fv1"], "refuses": []},
        )
        plan = "\n".join(row[0] for row in cursor.fetchall())
        transaction.set_rollback(True)
    # One of the partial indexes of the claimable runs (status pending or running): all three
    # cover the same rows, and which the planner takes for a bitmap scan of a small table
    # depends on their sizes, which earlier tests on the same database leave as they may.
    claim_indexes = {"agent_run_claim_fair", "agent_run_claim_priority", "agent_run_claim"}
    used = set(re.findall(r"Index Scan (?:using|on) (agent_run_claim\w*)", plan))
    assert used, plan
    assert used <= claim_indexes, plan
    assert "agent_run_wake" in plan
    assert "LockRows" in plan
    assert "Seq Scan" not in plan


@pytest.mark.postgres
def test_agent_run_keeps_free_space_for_hot_updates() -> None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT reloptions FROM pg_class WHERE relname = 'agent_run'")
        (options,) = cursor.fetchone()
    assert "fillfactor=70" in (options or [])


def _prepared_appends() -> int:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_prepared_statements WHERE statement LIKE %s",
            ["%INSERT INTO agent_step%"],
        )
        return cursor.fetchone()[0]


@pytest.mark.postgres
@pytest.mark.parametrize("threshold", [None, 0])
def test_the_step_commit_is_prepared_when_the_database_options_allow(threshold: int | None) -> None:
    """Django's default (prepare_threshold None) prepares nothing, for poolers; a project that
    sets OPTIONS["prepare_threshold"] gets the step commit prepared."""
    run = _runs(1)[0]
    connection.ensure_connection()
    connection.connection.prepare_threshold = threshold
    try:
        [claim] = current().claim_runs("w", 30)
        for seq in range(1, 9):
            assert current().append_step(claim, StepWrite(seq, StepKind.MODEL_TURN, "{}"))
        assert _prepared_appends() == (0 if threshold is None else 1)
    finally:
        connection.connection.prepare_threshold = None
    assert AgentRun.objects.get(pk=run.id).last_seq == 8


@pytest.mark.postgres
def test_database_instrumentation_sees_every_step_commit() -> None:
    """Sentry, OpenTelemetry's Django instrumentation and connection.queries hook Django's
    cursors (execute_wrapper): the step commit, the finish-and-claim included, goes through
    one of them although it binds on the server."""
    from django.test.utils import CaptureQueriesContext

    first, second = _runs(2)
    [claim] = current().claim_runs("w", 30)
    seen: list[str] = []

    def spy(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        seen.append(sql)
        return execute(sql, params, many, context)

    next_claim = NextClaim("w", 30, take=lambda: True, give_back=lambda: None)
    with connection.execute_wrapper(spy), CaptureQueriesContext(connection) as logged:
        assert current().append_step(claim, StepWrite(1, StepKind.MODEL_TURN, "{}"))
        assert current().append_step(
            claim,
            StepWrite(2, StepKind.MODEL_TURN, "{}", finish=("succeeded", "ok")),
            then_claim=next_claim,
        )
    assert next_claim.claim is not None
    assert next_claim.claim.run_id == second.id
    appends = [sql for sql in seen if "INSERT INTO agent_step" in sql]
    assert len(appends) == 2
    assert [q["sql"] for q in logged.captured_queries if "INSERT INTO agent_step" in q["sql"]]
    assert AgentRun.objects.get(pk=first.id).status == "succeeded"


@pytest.mark.postgres
@pytest.mark.parametrize("logged", [False, True])
def test_the_claim_and_the_commit_go_out_positional_unless_queries_are_logged(
    logged: bool,
) -> None:
    """psycopg numbers named placeholders at every execution and keeps the result for short
    statements only; the claim and the finish-and-claim are longer. They go out numbered once
    ($1, $2, ...) with their parameters in a list, and as written while Django logs queries
    (with server_side_binding on, its record of a query composes the named form)."""
    import contextlib

    from django.test.utils import CaptureQueriesContext

    first, second = _runs(2)
    seen: list[tuple[str, Any]] = []

    def spy(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        seen.append((sql, params))
        return execute(sql, params, many, context)

    next_claim = NextClaim("w", 30, take=lambda: True, give_back=lambda: None)
    capture = CaptureQueriesContext(connection) if logged else contextlib.nullcontext()
    with connection.execute_wrapper(spy), capture:
        [claim] = current().claim_runs("w", 30)
        assert not current().has_waiting_messages(claim.run_id)  # the probe before a call
        assert current().append_step(claim, StepWrite(1, StepKind.MODEL_TURN, "{}"))
        assert current().append_step(
            claim,
            StepWrite(2, StepKind.MODEL_TURN, "{}", finish=("succeeded", "ok")),
            then_claim=next_claim,
        )
    assert claim.run_id == first.id
    assert next_claim.claim is not None
    assert next_claim.claim.run_id == second.id
    run = AgentRun.objects.get(pk=first.id)
    assert (run.status, run.result, run.last_seq) == ("succeeded", "ok", 2)
    sent = [
        (sql, params)
        for sql, params in seen
        if "SKIP LOCKED" in sql or "agent_step" in sql or "FROM agent_message" in sql
    ]
    # The claim, the inbox's probe, the step, and the last step with the next claim.
    assert len(sent) == 4
    for sql, params in sent:
        if logged:
            assert "%(run_id)s" in sql or "%(owner)s" in sql
            assert isinstance(params, dict)
        else:
            assert "%(" not in sql
            assert "$1" in sql
            assert isinstance(params, list)


def test_the_last_step_ends_the_run_in_the_same_statement() -> None:
    run = _runs(1)[0]
    [stale] = current().claim_runs("slow-worker", 30)
    _expire(run.id)
    [claim] = current().claim_runs("w", 30)
    assert not current().append_step(
        stale, StepWrite(1, StepKind.MODEL_TURN, "{}", finish=("succeeded", "x"))
    )
    assert AgentRun.objects.get(pk=run.id).status == RunStatus.RUNNING
    assert current().append_step(
        claim, StepWrite(1, StepKind.MODEL_TURN, "{}", finish=("succeeded", "done"))
    )
    run.refresh_from_db()
    assert (run.status, run.result, run.last_seq, run.lease_owner, run.lease_until) == (
        RunStatus.SUCCEEDED,
        "done",
        1,
        None,
        None,
    )
    assert run.finished_at is not None
    assert not current().append_step(
        claim, StepWrite(2, StepKind.TOOL_RESULT, "[]")
    )  # over: nothing more


class Tickets:
    """What a worker slot offers ``append_step``: the right to claim one more run."""

    def __init__(self, available: bool = True) -> None:
        self.available = available
        self.taken = self.given_back = 0

    def offer(self, owner: str = "w1") -> NextClaim:
        return NextClaim(owner, 30, take=self.take, give_back=self.give_back)

    def take(self) -> bool:
        self.taken += self.available
        return self.available

    def give_back(self) -> None:
        self.given_back += 1


@pytest.mark.postgres
def test_the_last_step_of_a_run_can_claim_the_next_one() -> None:
    first, second = _runs(2)
    [claim] = current().claim_runs("w1", 30)
    tickets = Tickets()
    then = tickets.offer()
    assert current().append_step(
        claim, StepWrite(1, StepKind.MODEL_TURN, "{}", finish=("succeeded", "ok")), then_claim=then
    )
    done = AgentRun.objects.get(pk=first.pk)
    assert (done.status, done.result, done.lease_owner, done.last_seq) == (
        "succeeded",
        "ok",
        None,
        1,
    )
    # The same statement took the next run, as claim_runs would have.
    assert then.claim is not None
    assert then.claim.run_id == second.pk
    taken = AgentRun.objects.get(pk=second.pk)
    assert (taken.status, taken.lease_owner, taken.attempt) == ("running", "w1", 1)
    assert taken.lease_until is not None
    assert taken.started_at is not None
    assert then.claim.attempt == 1
    assert then.claim.run.status == "running"
    assert then.claim.run.created_at == taken.created_at
    assert then.claim.task_payload == AgentStep.objects.get(run_id=second.pk, seq=0).payload
    assert (tickets.taken, tickets.given_back) == (1, 0)
    # The claim it returned holds: its steps commit.
    assert current().append_step(then.claim, StepWrite(1, StepKind.MODEL_TURN, "{}"))


@pytest.mark.postgres
def test_no_next_claim_when_the_fence_fails_or_nothing_waits_or_the_slot_declines() -> None:
    _first, second = _runs(2)
    [claim] = current().claim_runs("w1", 30)
    tickets = Tickets()
    stale = Claim(claim.run, "w1", claim.attempt + 1, 30)
    then = tickets.offer()
    assert not current().append_step(
        stale, StepWrite(1, StepKind.MODEL_TURN, "{}", finish=("succeeded", "")), then_claim=then
    )
    assert then.claim is None
    assert (tickets.taken, tickets.given_back) == (1, 1)
    assert AgentRun.objects.get(pk=second.pk).status == "pending"

    declined = Tickets(available=False).offer()
    assert current().append_step(
        claim,
        StepWrite(1, StepKind.MODEL_TURN, "{}", finish=("succeeded", "")),
        then_claim=declined,
    )
    assert declined.claim is None
    assert AgentRun.objects.get(pk=second.pk).status == "pending"

    [claim2] = current().claim_runs("w1", 30)
    assert claim2.run_id == second.pk
    then = tickets.offer()
    assert current().append_step(
        claim2, StepWrite(1, StepKind.MODEL_TURN, "{}", finish=("succeeded", "")), then_claim=then
    )
    assert then.claim is None
    assert tickets.given_back == 2  # nothing left to claim
