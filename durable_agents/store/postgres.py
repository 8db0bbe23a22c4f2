"""``PostgresStore``: the hot paths of the store as single statements, on the database clock.

The life of a run, and what moves it along on PostgreSQL:

    claim        CLAIM_SQL              lock the claimable runs, admit them within their
                                        concurrency keys' limits, lease them, attempt + 1
    renew        RENEW_ALL_SQL          the heartbeat: every lease of a worker, one statement
    append_step  APPEND_STEP_SQL        fence, renewed lease and the step, one statement
                                        (its tool effects too: APPEND_STEP_WITH_EFFECTS_SQL;
                                        a model turn counted in the rollup: APPEND_TURN_SQL)
    finish       APPEND_LAST_STEP_SQL   the last step ends the run (and _WITH_EFFECTS_SQL,
                                        APPEND_LAST_TURN_SQL);
                 FINISH_AND_CLAIM_SQL   the same, and the claim of the worker's next run
                                        (FINISH_TURN_AND_CLAIM_SQL for a model turn)
    unstored     UNSTORED_TURN_SQL      a paid turn whose commit failed still counts
    debounce     DEBOUNCE_SQL           a later start of a debounced run: its quiet window
                                        starts again, with the call's task (the first
                                        start, or a late one: PortableStore)
    release      PortableStore          the claim given back, the run pending again
    park         PortableStore          the run waits: on an approval, a timer, an event, an
                                        answer or its children; START_INTENT_SQL starts an
                                        approved tool call under the fence
    wake         CLAIM_SQL (due)        a due timer or timeout, or the end of a debounced
                                        start's quiet window: the claim takes the run
                                        (NEXT_WAKE_SQL: when an idle worker claims again);
                 PortableStore          an event, an answer, a child's end: pending again

The statements live by job, each beside the named fragments it is composed from and the plain
functions that send it, which this class calls: the claim's (CLAIM_SQL, RENEW_ALL_SQL and
the claimable runs) in store/postgres_claims.py; a step's (the fence, the APPEND_* family,
FINISH_AND_CLAIM_SQL and FINISH_TURN_AND_CLAIM_SQL, UNSTORED_TURN_SQL, START_INTENT_SQL) in
store/postgres_steps.py; DEBOUNCE_SQL in store/postgres_debounce.py; firing schedules'
(TAKE_DUE_SQL, FIRE_SQL, MOVE_ON_SQL) in store/postgres_schedules.py. Every statement, and
every fragment the tests check, is importable from this module too. The full text of every
statement, exactly as it is sent, is in tests/sql/<NAME>.sql, one file per statement;
tests/unit/test_postgres_statements.py fails when what runs differs from those files by a
byte (``UPDATE_SQL_SNAPSHOTS=1`` rewrites them after a deliberate change).

The other operations (release, park, wake, decisions, a finish without a step) are the ORM
updates of ``PortableStore``, to which this class delegates them: one UPDATE each on
PostgreSQL too.
"""

from __future__ import annotations

import datetime
import functools
from collections.abc import Callable, Collection, Mapping, Sequence
from decimal import Decimal
from typing import Any

from django.db import DataError, connection
from django.db.backends.base.base import BaseDatabaseWrapper

from durable_agents._internal import db
from durable_agents.models import (
    AgentCallback,
    AgentEvent,
    AgentQuestion,
    AgentRun,
    AgentSchedule,
    AgentWorker,
    ToolEffect,
    ToolIntent,
    WaitKind,
    step_partitions,
)
from durable_agents.store import (
    key_rows,
    portable_batch,
    portable_callbacks,
    portable_logs,
    portable_runs,
    postgres_batches,
    postgres_claims,
    postgres_debounce,
    postgres_fleet,
    postgres_schedules,
    postgres_steps,
    read_ahead,
    workers,
)
from durable_agents.store.base import (
    AuthUser,
    CallbackReceipt,
    Claim,
    ForkWrite,
    LeaseLoss,
    LogRow,
    NextClaim,
    Parked,
    Presence,
    RunId,
    StepTuple,
    StepWrite,
    Store,
    WaitSpec,
)
from durable_agents.store.batches import BatchTurn, Candidate
from durable_agents.store.portable import PortableStore

# The statements and fragments of the claim and of a step, importable from here as they were
# before they had modules of their own: tests/sql/ pins every ``*_SQL`` of this module, the
# tests check the fragments (``_FREED`` too) and the benchmarks run the claim and the commit.
from durable_agents.store.postgres_batches import WAKE_ANSWERED_SQL as WAKE_ANSWERED_SQL
from durable_agents.store.postgres_claims import _FREED as _FREED
from durable_agents.store.postgres_claims import ADMITTED as ADMITTED
from durable_agents.store.postgres_claims import BEAT_SQL as BEAT_SQL
from durable_agents.store.postgres_claims import CLAIM_SQL as CLAIM_SQL
from durable_agents.store.postgres_claims import CLAIMABLE_RUNS as CLAIMABLE_RUNS
from durable_agents.store.postgres_claims import (
    CLAIMABLE_RUNS_IF_FENCED as CLAIMABLE_RUNS_IF_FENCED,
)
from durable_agents.store.postgres_claims import CLAIMABLE_SQL as CLAIMABLE_SQL
from durable_agents.store.postgres_claims import KEY_LIMIT as KEY_LIMIT
from durable_agents.store.postgres_claims import NEXT_WAKE_SQL as NEXT_WAKE_SQL
from durable_agents.store.postgres_claims import (
    RENEW_ALL_AND_BEAT_SQL as RENEW_ALL_AND_BEAT_SQL,
)
from durable_agents.store.postgres_claims import RENEW_ALL_SQL as RENEW_ALL_SQL
from durable_agents.store.postgres_claims import ROUTED as ROUTED
from durable_agents.store.postgres_claims import TAKE_CLAIMABLE_RUNS as TAKE_CLAIMABLE_RUNS
from durable_agents.store.postgres_claims import key_limits as key_limits
from durable_agents.store.postgres_cursor import binding_cursor as binding_cursor
from durable_agents.store.postgres_debounce import (
    DEBOUNCE_SQL as DEBOUNCE_SQL,  # one of this store's statements, pinned in tests/sql/ too
)
from durable_agents.store.postgres_fleet import IN_FLIGHT_VERSIONS_SQL as IN_FLIGHT_VERSIONS_SQL
from durable_agents.store.postgres_schedules import (  # pinned in tests/sql/ too
    FIRE_SQL as FIRE_SQL,
)
from durable_agents.store.postgres_schedules import (
    MOVE_ON_SQL as MOVE_ON_SQL,
)
from durable_agents.store.postgres_schedules import (
    TAKE_DUE_SQL as TAKE_DUE_SQL,
)
from durable_agents.store.postgres_steps import ADD_COST as ADD_COST
from durable_agents.store.postgres_steps import APPEND_LAST_STEP_SQL as APPEND_LAST_STEP_SQL
from durable_agents.store.postgres_steps import (
    APPEND_LAST_STEP_WITH_EFFECTS_SQL as APPEND_LAST_STEP_WITH_EFFECTS_SQL,
)
from durable_agents.store.postgres_steps import APPEND_LAST_TURN_SQL as APPEND_LAST_TURN_SQL
from durable_agents.store.postgres_steps import APPEND_STEP_SQL as APPEND_STEP_SQL
from durable_agents.store.postgres_steps import (
    APPEND_STEP_WITH_EFFECTS_SQL as APPEND_STEP_WITH_EFFECTS_SQL,
)
from durable_agents.store.postgres_steps import (
    APPEND_TURN_AND_RESULTS_SQL as APPEND_TURN_AND_RESULTS_SQL,
)
from durable_agents.store.postgres_steps import (
    APPEND_TURN_AND_RESULTS_WITH_EFFECTS_SQL as APPEND_TURN_AND_RESULTS_WITH_EFFECTS_SQL,
)
from durable_agents.store.postgres_steps import APPEND_TURN_SQL as APPEND_TURN_SQL
from durable_agents.store.postgres_steps import FENCE as FENCE
from durable_agents.store.postgres_steps import FENCED_LAST_STEP as FENCED_LAST_STEP
from durable_agents.store.postgres_steps import FENCED_STEP as FENCED_STEP
from durable_agents.store.postgres_steps import FINISH_AND_CLAIM_SQL as FINISH_AND_CLAIM_SQL
from durable_agents.store.postgres_steps import (
    FINISH_TURN_AND_CLAIM_SQL as FINISH_TURN_AND_CLAIM_SQL,
)
from durable_agents.store.postgres_steps import (
    HAS_WAITING_MESSAGE_SQL as HAS_WAITING_MESSAGE_SQL,
)
from durable_agents.store.postgres_steps import LOCK_RUN_SQL as LOCK_RUN_SQL
from durable_agents.store.postgres_steps import NO_MESSAGE_WAITING as NO_MESSAGE_WAITING
from durable_agents.store.postgres_steps import RECORD_EFFECT_SQL as RECORD_EFFECT_SQL
from durable_agents.store.postgres_steps import RECORD_EFFECTS as RECORD_EFFECTS
from durable_agents.store.postgres_steps import RECORD_USAGE as RECORD_USAGE
from durable_agents.store.postgres_steps import START_INTENT_SQL as START_INTENT_SQL
from durable_agents.store.postgres_steps import STEP_FENCE as STEP_FENCE
from durable_agents.store.postgres_steps import STEP_INSERT as STEP_INSERT
from durable_agents.store.postgres_steps import UNLESS_MESSAGES as UNLESS_MESSAGES
from durable_agents.store.postgres_steps import UNSTORED_TURN_SQL as UNSTORED_TURN_SQL
from durable_agents.store.rows import DueSchedules, SlotStart


class PostgresStore(Store):
    """PostgreSQL outside a caller's transaction: one statement (one round trip) per claim,
    per step commit, per finish-and-claim, per heartbeat and per debounced start's push.

    Its statements are in modules of plain functions it calls, one per concern
    (``postgres_claims``, ``postgres_steps``, ``postgres_debounce``, ``postgres_schedules``).
    What it has no statement for it delegates, never inherits: to the concern modules
    (``portable_runs``, ``portable_logs``, ``portable_batch``, ``key_rows``) and, for
    release, park, wake, decisions, waits and the operations on any run, to ``orm`` (a
    ``PortableStore``: the same ORM updates, one UPDATE each on PostgreSQL too)."""

    sends_live_text = True
    partitions_steps = True

    @functools.cached_property
    def orm(self) -> PortableStore:
        """The ORM's store, which does the operations this one has no statement of its own
        for (each is one transaction, as on SQLite)."""
        return PortableStore()

    def claim_runs(self, owner: str, lease_seconds: float, limit: int = 1) -> list[Claim]:
        """CLAIM_SQL (``postgres_claims.claim_runs``); then the parents of the runs it
        dead-lettered as poison are told."""
        claims, poisoned = postgres_claims.claim_runs(owner, lease_seconds, limit)
        for parent_id in poisoned:
            self.child_ended(parent_id)
        return claims

    def renew_leases(
        self,
        owner: str,
        claims: Sequence[Claim],
        lease_seconds: float,
        using: BaseDatabaseWrapper | None = None,
        presence: Presence | None = None,
    ) -> dict[RunId, LeaseLoss]:
        """One statement with the worker's row, on ``using`` (the heartbeat's own
        connection) if given."""
        return postgres_claims.renew_leases(owner, claims, lease_seconds, using, presence)

    def register_worker(
        self, presence: Presence, definitions: Sequence[dict[str, Any]]
    ) -> AgentWorker | None:
        return self.orm.register_worker(presence, definitions)

    def beat_worker(self, presence: Presence) -> None:
        postgres_claims.renew_leases(presence.worker_id, (), presence.alive_seconds, None, presence)

    def unregister_worker(self, presence: Presence, definitions: Sequence[dict[str, Any]]) -> None:
        self.orm.unregister_worker(presence, definitions)

    def wait_for_worker(self, claim: Claim, reason: str) -> bool:
        return self.orm.wait_for_worker(claim, reason)

    def park_unserved_runs(self, served: Collection[tuple[str, str]]) -> int:
        """The versions in flight by a loose index scan (``postgres_fleet``), then the ORM's
        update per version to park."""
        return workers.park_unserved(served, postgres_fleet.in_flight_versions())

    def wake_served_runs(self, can_serve: Callable[[str, str, str, str], bool]) -> int:
        return self.orm.wake_served_runs(can_serve)

    def make_step_partitions(self) -> list[str]:
        return step_partitions.ensure_ahead(connection)

    def append_step(
        self, claim: Claim, step: StepWrite, then_claim: NextClaim | None = None
    ) -> bool:
        """This is where a step gets committed on PostgreSQL: one statement that checks the
        fence, renews the lease (or ends the run), inserts the step and records its effects
        (store/postgres_steps.py)."""
        appended = self._commit_step(claim, step, then_claim, unless_messages=False)
        assert appended is not None  # None only unless_messages
        return appended

    def has_waiting_messages(self, run_id: RunId) -> bool:
        """The probe as the step commits go out (store/postgres_steps.py): numbered once, and
        prepared where the connection prepares its frequent statements."""
        return postgres_steps.has_waiting_message(run_id)

    def read_ahead(self, claims: Sequence[Claim]) -> list[Claim]:
        """As every store reads ahead, the three statements in one round trip (a pipeline)."""
        return read_ahead.read_ahead(claims, together=postgres_steps.sent_together)

    def append_last_step(
        self, claim: Claim, step: StepWrite, then_claim: NextClaim | None = None
    ) -> bool | None:
        """One round trip on PostgreSQL: the run's lock and the step's statement, which ends
        the run only while no message waits in its inbox, sent together (``locked_first`` in
        store/postgres_steps.py), where the portable way takes five (BEGIN, the lock, the
        inbox's probe, the step, COMMIT). Only when nothing was appended does the inbox's probe
        tell a waiting message (None) from a failed fence (False). A libpq older than 14 has no
        pipeline: then the portable way."""
        if not postgres_steps.pipelines():
            return super().append_last_step(claim, step, then_claim)
        return self._commit_step(claim, step, then_claim, unless_messages=True)

    def _commit_step(
        self, claim: Claim, step: StepWrite, then_claim: NextClaim | None, unless_messages: bool
    ) -> bool | None:
        params = postgres_steps.step_params(claim, step)
        finish = step.finish
        try:
            appended = self._append(params, step.effects, finish, then_claim, unless_messages)
        except DataError:
            if step.usage is not None:
                self.count_unstored_turn(claim, step)
            raise
        if not appended and self.committed_by(claim, step.seq):
            # A retry whose first try landed (outage.py): this claim's own step, committed.
            appended = True
        elif not appended and unless_messages and self.has_waiting_messages(claim.run_id):
            return None  # the turn is committed as a plain step next: not counted here
        elif not appended and step.usage is not None:
            self.count_unstored_turn(claim, step)
        if appended and finish is not None:
            self.child_ended(claim.run.parent_id)
        return appended

    def count_unstored_turn(self, claim: Claim, step: StepWrite) -> None:
        postgres_steps.count_unstored_turn(claim, step)

    def append_turn_and_results(self, claim: Claim, turn: StepWrite, results: StepWrite) -> bool:
        """One statement on PostgreSQL (APPEND_TURN_AND_RESULTS_SQL): the fence on the turn's
        seq, the renewed lease, the turn counted, the last call recorded, both steps; nothing
        but the paid turn's count (``count_unstored_turn``) when the fence fails."""
        sql, params = postgres_steps.turn_and_results_params(claim, turn, results)
        try:
            appended = postgres_steps.execute_turn_and_results(sql, params)
        except DataError:
            self.count_unstored_turn(claim, turn)
            raise
        if not appended and self.committed_by(claim, results.seq):
            return True  # a retry whose first try landed (outage.py)
        if not appended:
            self.count_unstored_turn(claim, turn)
        return appended

    def _append(
        self,
        params: dict[str, Any],
        effects: Sequence[ToolEffect],
        finish: tuple[str, str | None] | None,
        then_claim: NextClaim | None,
        unless_messages: bool = False,
    ) -> bool:
        """The step's statement sent: a finish-and-claim, or one of the APPEND_* family (a
        last step with ``unless_messages`` guarded by the inbox, right behind the run's lock)."""
        if finish is not None and then_claim is not None and not effects:
            return self._finish_and_claim(params, then_claim, unless_messages)
        return self._execute_append(
            postgres_steps.append_statement(params, effects, finish, unless_messages), params
        )

    @staticmethod
    def _execute_append(sql: str, params: dict[str, Any]) -> bool:
        # A method of its own: the statement tests keep what it would send instead.
        return postgres_steps.execute_append(sql, params)

    def _finish_and_claim(
        self, params: dict[str, Any], then_claim: NextClaim, unless_messages: bool
    ) -> bool:
        """``append_step`` of a run's last step that also claims the next run, if the slot
        may (``then_claim.take()``); a model turn (its rollup parameters) is counted too."""
        # The connection first: a slot that waited for one in a busy pool decides whether to
        # claim with what the claims sent meanwhile found.
        connection.ensure_connection()
        if not then_claim.take():
            statement = postgres_steps.last_step_statement(params, unless_messages)
            return self._execute_append(statement, params)
        appended, poisoned_parent = postgres_steps.finish_and_claim(
            params, then_claim, unless_messages
        )
        self.child_ended(poisoned_parent)  # the next run's, if it was dead-lettered as poison
        return appended

    def interrupt_model_call(self, run_id: RunId) -> None:
        """A notification ``message:<run id>`` on the workers' channel (sent when the caller's
        transaction commits, after the message it is about): the worker holding the run
        abandons its model call in flight (engine/worker.py)."""
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_notify(%s, %s)", [db.CHANNEL, f"message:{run_id}"])

    def lock_run_row(self, run_id: RunId) -> None:
        """``LOCK_RUN_SQL``, written out: a run's last commit takes this lock, and the ORM
        would build its query anew each time."""
        with connection.cursor() as cursor:
            cursor.execute(LOCK_RUN_SQL, {"run_id": run_id})

    def start_intent_execution(self, claim: Claim, intent: ToolIntent) -> bool:
        """One statement; the run row stays locked until the intent row is updated."""
        return postgres_steps.start_intent_execution(claim, intent)

    # -- what this store has no statement of its own for: the concern modules and the ORM's

    def create_runs(self, runs: Sequence[tuple[AgentRun, str]]) -> list[AgentRun]:
        return portable_batch.create_runs(runs)

    def take_due_schedules(self, now: datetime.datetime | None, limit: int) -> DueSchedules:
        return postgres_schedules.take_due_schedules(now, limit)

    def fire_slots(
        self,
        starts: Sequence[SlotStart],
        rows: Sequence[AgentSchedule],
        last_keys: Mapping[int, str],
    ) -> dict[str, RunId]:
        return postgres_schedules.fire_slots(starts, rows, last_keys)

    def move_schedules(self, rows: Sequence[AgentSchedule]) -> None:
        postgres_schedules.move_schedules(rows)

    def create_run(self, run: AgentRun, task_payload: str) -> AgentRun:
        return portable_runs.create_run(run, task_payload)

    def create_fork(self, run: AgentRun, write: ForkWrite) -> AgentRun:
        return portable_logs.create_fork(run, write)

    def debounce_run(self, run: AgentRun, task_payload: str, seconds: float) -> AgentRun:
        return postgres_debounce.debounce_run(run, task_payload, seconds)

    def claim_run(self, run_id: RunId, owner: str, lease_seconds: float) -> Claim | None:
        return self.orm.claim_run(run_id, owner, lease_seconds)

    def renew_lease(self, claim: Claim) -> bool:
        return self.orm.renew_lease(claim)

    def finish_run(
        self,
        claim: Claim,
        status: str,
        *,
        result: str | None = None,
        error: str = "",
        output: Any = None,
    ) -> bool:
        return self.orm.finish_run(claim, status, result=result, error=error, output=output)

    def release_lease(
        self,
        claim: Claim,
        *,
        error: str | None = None,
        count_claim: bool = True,
        hold_seconds: float | None = None,
        waiting_for: WaitKind | None = None,
    ) -> bool:
        return self.orm.release_lease(
            claim,
            error=error,
            count_claim=count_claim,
            hold_seconds=hold_seconds,
            waiting_for=waiting_for,
        )

    def park_on_intent(
        self,
        claim: Claim,
        intent: ToolIntent,
        *,
        new: bool = False,
        unknown_because: str | None = None,
    ) -> Parked:
        return self.orm.park_on_intent(claim, intent, new=new, unknown_because=unknown_because)

    def complete_intent(self, intent: ToolIntent, effect: ToolEffect) -> None:
        self.orm.complete_intent(intent, effect)

    def wake_run(self, run_id: RunId) -> bool:
        return self.orm.wake_run(run_id)

    def decide_intent(
        self, intent_id: int, user: AuthUser, from_status: str, to_status: str, reason: str
    ) -> ToolIntent:
        return self.orm.decide_intent(intent_id, user, from_status, to_status, reason)

    def resolve_intent(
        self, intent_id: int, user: AuthUser, *, outcome: tuple[str, bool] | None, reason: str
    ) -> ToolIntent:
        return self.orm.resolve_intent(intent_id, user, outcome=outcome, reason=reason)

    def park_on_batch(self, claim: Claim, turn: BatchTurn) -> Parked:
        return self.orm.park_on_batch(claim, turn)

    def wake_batch_answers(self, candidates: Sequence[Candidate], woken_by: str) -> set[int]:
        return postgres_batches.wake_answers(candidates, woken_by)

    def park_on_wait(self, claim: Claim, spec: WaitSpec) -> tuple[Parked, dict[str, Any] | None]:
        return self.orm.park_on_wait(claim, spec)

    def send_event(self, name: str, payload: Any, user: AuthUser = None) -> tuple[AgentEvent, int]:
        return self.orm.send_event(name, payload, user)

    def answer_question(
        self, run_id: RunId | str, user: AuthUser, text: str, question_id: int | None = None
    ) -> AgentQuestion | None:
        return self.orm.answer_question(run_id, user, text, question_id)

    def spawn_run(
        self,
        child: AgentRun,
        task_payload: str,
        max_children: int,
        max_tree_runs: int | None = None,
    ) -> tuple[AgentRun, bool]:
        return self.orm.spawn_run(child, task_payload, max_children, max_tree_runs)

    def wake_parent(self, parent_id: RunId) -> bool:
        return self.orm.wake_parent(parent_id)

    def stranded_parents(self, limit: int) -> list[RunId]:
        return self.orm.stranded_parents(limit)

    def receive_callback(self, run_id: RunId, key: str, body: Any) -> CallbackReceipt:
        return portable_callbacks.receive_callback(run_id, key, body)

    def received_callback(self, key: str) -> AgentCallback | None:
        return portable_callbacks.received_callback(key)

    def sent_event(self, name: str) -> AgentEvent | None:
        return self.orm.sent_event(name)

    def question_for_key(self, key: str) -> AgentQuestion | None:
        return self.orm.question_for_key(key)

    def run_outcomes(self, run_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
        return self.orm.run_outcomes(run_ids)

    def cancel_run(self, run_id: RunId | str) -> bool:
        return self.orm.cancel_run(run_id)

    def requeue_run(self, run_id: RunId | str) -> bool:
        return self.orm.requeue_run(run_id)

    def dead_letter(self, run_id: RunId, reason: str) -> bool:
        return self.orm.dead_letter(run_id, reason)

    def current_status(self, run_id: RunId) -> str | None:
        return self.orm.current_status(run_id)

    def spent_today(self, key: str) -> tuple[Decimal, Decimal | None]:
        return key_rows.spent_today(key)

    def set_key_limit(self, key: str, limit: int | None) -> None:
        key_rows.set_limit(key, limit)

    def set_key_budget(self, key: str, usd_per_day: Decimal | None) -> int:
        return key_rows.set_budget(key, usd_per_day)

    def next_wake_in(self) -> float | None:
        """NEXT_WAKE_SQL: by the database's clock, which the claim compares wake_at with."""
        with connection.cursor() as cursor:
            cursor.execute(NEXT_WAKE_SQL)
            row = cursor.fetchone()
        return None if row is None or row[0] is None else float(row[0])

    def first_claimable(self) -> tuple[str, int] | None:
        return self.orm.first_claimable()

    def load_log_rows(self, run_id: RunId | str, *, shares: bool = True) -> list[LogRow]:
        return portable_logs.load_log_rows(run_id, shares=shares)

    def load_steps(self, run_id: RunId, after_seq: int = -1) -> list[StepTuple]:
        return portable_logs.load_steps(run_id, after_seq)

    def recorded_effects(self, run_id: RunId, seq: int) -> dict[str, ToolEffect]:
        return self.orm.recorded_effects(run_id, seq)

    def record_effect(self, effect: ToolEffect) -> None:
        """One statement (RECORD_EFFECT_SQL), sent and prepared as the step commits are."""
        postgres_steps.record_effect(effect)

    def intent_for_key(self, key: str) -> ToolIntent | None:
        return self.orm.intent_for_key(key)

    def reload_intent(self, intent: ToolIntent) -> None:
        self.orm.reload_intent(intent)
