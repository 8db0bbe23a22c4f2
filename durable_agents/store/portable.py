"""``PortableStore``: the store through the Django ORM, one transaction per operation.

Used on SQLite, where the IMMEDIATE transaction mode makes each transaction exclusive (so a
check-then-write is atomic), and on PostgreSQL inside a caller's open transaction
(``connection.in_atomic_block``): there a one-statement path would neither commit by itself
nor be undone alone, and an error in it would abort the caller's whole transaction, whereas
``transaction.atomic()`` here nests as a savepoint. ``PostgresStore`` writes the hot paths as
single statements and delegates the other operations to an instance of this class (``orm``):
the same ORM updates on both.

One class, no mixins: the runs' claims, steps, intents, waits and operations are its methods;
what is a concern of its own is a module of plain functions it calls (and ``PostgresStore``
calls too): ``portable_runs`` (create a run), ``portable_batch`` (many keyed runs),
``portable_logs`` (the log and forks), ``portable_trees`` (cascades, tree roots, poison
runs), ``portable_debounce`` and ``portable_schedules`` (``ScheduleStore``).

Lease times come from the database clock (``Now()``), never from a worker's clock.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Collection, Mapping, Sequence
from decimal import Decimal
from typing import Any

from django.db import DataError, connection, transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.models import (
    Case,
    DateTimeField,
    ExpressionWrapper,
    F,
    QuerySet,
    TextField,
    Value,
    When,
)
from django.db.models.expressions import CombinedExpression
from django.db.models.functions import Coalesce, Greatest, Now
from django.utils import timezone

from durable_agents._internal.text import json_text, storable_text
from durable_agents.declare.agents import registry
from durable_agents.models import (
    CANCELLABLE_STATUSES,
    ENDED_STATUSES,
    AgentCallback,
    AgentEvent,
    AgentQuestion,
    AgentRun,
    AgentSchedule,
    AgentStep,
    AgentWorker,
    IntentStatus,
    QuestionStatus,
    RunStatus,
    ToolEffect,
    ToolIntent,
    WaitKind,
)
from durable_agents.store import (
    batches,
    concurrency,
    key_rows,
    portable_batch,
    portable_callbacks,
    portable_debounce,
    portable_logs,
    portable_runs,
    portable_schedules,
    portable_trees,
    workers,
)
from durable_agents.store.base import (
    MAX_REASON_CHARS,
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
    ended,
    lease_losses,
    refuse_spawn,
    refuse_strangers,
    run_outcome,
    timer_woken_by,
)
from durable_agents.store.batches import BatchTurn, Candidate
from durable_agents.store.effect_rows import EFFECT_COLUMNS, effects_from
from durable_agents.store.rollup import added_cost, record_usage
from durable_agents.store.rows import DueSchedules, SlotStart
from durable_agents.store.transitions import mark_transitioned

_AWAITING_PERSON = (IntentStatus.PENDING, IntentStatus.UNKNOWN)

# The tool effects recorded for the calls of one model turn (``recorded_effects``).
RECORDED_EFFECTS_SQL = f"SELECT {EFFECT_COLUMNS} FROM tool_effect WHERE run_id = %s AND seq = %s"

# ``woken_by`` of a run the claim takes: set for a due wait, kept for any other run (a run
# claimed again after a crash keeps what woke it). Plain JSON text, as PostgreSQL's claim writes
# it too: a timer's end says nothing of the customer, and an encrypted constant would be fixed
# at import under whatever keys were configured then.
CLAIM_WOKEN_BY = Case(
    # A debounced start is no wake of a call: nothing woke, the run starts.
    When(status=RunStatus.WAITING, waiting_for=WaitKind.DEBOUNCE, then=Value(None)),
    When(
        status=RunStatus.WAITING,
        waiting_for=WaitKind.TIMER,
        then=Value(json_text(timer_woken_by(WaitKind.TIMER))),
    ),
    When(
        status=RunStatus.WAITING,
        then=Value(json_text(timer_woken_by(WaitKind.EVENT))),
    ),
    default=F("woken_by"),
    output_field=TextField(),
)


def lease_expiry(seconds: float) -> ExpressionWrapper[CombinedExpression]:
    """Now plus ``seconds`` on the database clock."""
    return ExpressionWrapper(
        Now() + datetime.timedelta(seconds=seconds), output_field=DateTimeField()
    )


def fenced(claim: Claim) -> QuerySet[AgentRun]:
    """The run, only while it is still this claim's: (id, owner, attempt, running)."""
    return AgentRun.objects.filter(
        pk=claim.run_id,
        lease_owner=claim.owner,
        attempt=claim.attempt,
        status=RunStatus.RUNNING,
    )


def ending(status: str, result: str | None, error: str, output: Any = None) -> dict[str, Any]:
    """The columns a run's end sets, as ORM values (``base.ended`` plus ``finished_at``)."""
    return {**ended(status, result, error, output), "finished_at": Now()}


def _run_pk(run_id: RunId | str) -> RunId:
    """A run's id given as itself or as its text, converted by the id field as a lookup
    converts it (``ValidationError`` for text that is not a UUID)."""
    pk: RunId = AgentRun._meta.pk.to_python(run_id)
    return pk


class PortableStore(Store):
    """The store through the Django ORM (SQLite; a caller's transaction on PostgreSQL)."""

    # -- create --------------------------------------------------------------------------

    def create_run(self, run: AgentRun, task_payload: str) -> AgentRun:
        return portable_runs.create_run(run, task_payload)

    def create_runs(self, runs: Sequence[tuple[AgentRun, str]]) -> list[AgentRun]:
        return portable_batch.create_runs(runs)

    def create_fork(self, run: AgentRun, write: ForkWrite) -> AgentRun:
        return portable_logs.create_fork(run, write)

    def debounce_run(self, run: AgentRun, task_payload: str, seconds: float) -> AgentRun:
        return portable_debounce.debounce_run(run, task_payload, seconds)

    # -- schedules (ScheduleStore: schedules/firing.py holds the flow) -------------------

    def take_due_schedules(self, now: datetime.datetime | None, limit: int) -> DueSchedules:
        return portable_schedules.take_due_schedules(now, limit)

    def fire_slots(
        self,
        starts: Sequence[SlotStart],
        rows: Sequence[AgentSchedule],
        last_keys: Mapping[int, str],
    ) -> dict[str, RunId]:
        return portable_schedules.fire_slots(starts, rows, last_keys)

    def move_schedules(self, rows: Sequence[AgentSchedule]) -> None:
        portable_schedules.move_schedules(rows)

    # -- claim and renew -----------------------------------------------------------------

    def claim_runs(self, owner: str, lease_seconds: float, limit: int = 1) -> list[Claim]:
        """The claimable runs locked with select_for_update(skip_locked=True, no_key=True):
        FOR NO KEY UPDATE rather than FOR UPDATE, which would conflict with the FOR KEY SHARE
        lock that inserting a step takes on its run through the foreign key. On SQLite the
        IMMEDIATE transaction mode makes the whole claim exclusive instead. Only runs of the
        agent versions this process defines (``routed``)."""
        routing = registry.routing()
        return self._lock_and_take(
            [
                workers.routed(AgentRun.objects.due(), routing).order_by("wake_at"),
                workers.routed(AgentRun.objects.claimable(), routing).order_by(
                    "-priority", "fair_at", "created_at"
                ),
            ],
            owner,
            lease_seconds,
            limit,
        )

    def claim_run(self, run_id: RunId, owner: str, lease_seconds: float) -> Claim | None:
        claims = self._lock_and_take(
            [
                AgentRun.objects.due().filter(pk=run_id),
                AgentRun.objects.claimable().filter(pk=run_id),
            ],
            owner,
            lease_seconds,
            1,
        )
        return claims[0] if claims else None

    def _lock_and_take(
        self, candidates: list[QuerySet[AgentRun]], owner: str, lease_seconds: float, limit: int
    ) -> list[Claim]:
        """Due waits first, then the other claimable runs, ``limit`` in all, within the limits
        of their concurrency keys (``key_rows.admit_locked``)."""
        with transaction.atomic():
            limits = {**concurrency.overrides(), **key_rows.limit_overrides()}
            ids: list[Any] = []
            for queryset in candidates:
                if len(ids) >= limit:
                    break
                ids += (
                    key_rows.within_limits(queryset, limits)
                    .select_for_update(skip_locked=True, no_key=True, of=("self",))
                    .values_list("pk", flat=True)[: limit - len(ids)]
                )
            ids = key_rows.admit_locked(ids, limits)
            if not ids:
                return []
            AgentRun.objects.filter(pk__in=ids).update(
                woken_by=CLAIM_WOKEN_BY,
                wake_at=None,
                status=RunStatus.RUNNING,
                lease_owner=owner,
                lease_until=lease_expiry(lease_seconds),
                attempt=F("attempt") + 1,
                stalled_claims=F("stalled_claims") + 1,
                started_at=Coalesce(F("started_at"), Now()),
                updated_at=Now(),
            )
            runs, poisoned = portable_trees.readable_runs(ids, owner)
        for parent_id in poisoned:
            self.child_ended(parent_id)
        return [Claim(run, owner, run.attempt, lease_seconds) for run in runs]

    def register_worker(
        self, presence: Presence, definitions: Sequence[dict[str, Any]]
    ) -> AgentWorker | None:
        return workers.register(presence, definitions)

    def beat_worker(self, presence: Presence) -> None:
        workers.beat(presence)

    def unregister_worker(self, presence: Presence, definitions: Sequence[dict[str, Any]]) -> None:
        workers.unregister(presence, definitions)

    def renew_leases(
        self,
        owner: str,
        claims: Sequence[Claim],
        lease_seconds: float,
        using: BaseDatabaseWrapper | None = None,
        presence: Presence | None = None,
    ) -> dict[RunId, LeaseLoss]:
        """Read, then renew what is still ours, in one IMMEDIATE transaction (SQLite: a single
        writer, so nothing changes in between), with the worker's row. ``using`` is not
        needed here."""
        if not claims:
            if presence is not None:
                workers.beat(presence)
            return {}
        with transaction.atomic():
            if presence is not None:
                workers.beat(presence)
            by_id = {c.run_id: c for c in claims}
            rows = list(
                AgentRun.objects.filter(pk__in=list(by_id)).values_list(
                    "pk", "status", "lease_owner", "attempt"
                )
            )
            ours: list[RunId] = []
            missed: list[tuple[RunId, str | None]] = []
            for run_id, status, lease_owner, attempt in rows:
                mine = lease_owner == owner and attempt == by_id[run_id].attempt
                if mine and status == RunStatus.RUNNING:
                    ours.append(run_id)
                else:
                    missed.append((run_id, status))
            AgentRun.objects.filter(pk__in=ours).update(
                lease_until=lease_expiry(lease_seconds), updated_at=Now()
            )
        return lease_losses(missed)

    def renew_lease(self, claim: Claim) -> bool:
        return bool(
            fenced(claim).update(lease_until=lease_expiry(claim.lease_seconds), updated_at=Now())
        )

    # -- commit --------------------------------------------------------------------------

    def append_step(
        self, claim: Claim, step: StepWrite, then_claim: NextClaim | None = None
    ) -> bool:
        """This is where a step gets committed on SQLite (or in a caller's transaction): the
        fence and the insert in one transaction. ``then_claim`` is never used here (it is
        left unclaimed; the worker claims its next run by itself)."""
        try:
            appended = self._append_fenced(claim, step)
        except DataError:
            self.count_unstored_turn(claim, step)
            raise
        if not appended and self.committed_by(claim, step.seq):
            # A retry whose first try landed (outage.py): this claim's own step, committed.
            appended = True
        elif not appended:
            self.count_unstored_turn(claim, step)
        if appended and step.finish is not None:
            self.child_ended(claim.run.parent_id)
        return appended

    def count_unstored_turn(self, claim: Claim, step: StepWrite) -> None:
        if step.usage is None:
            return
        with transaction.atomic():
            changes: dict[str, Any] = {"tokens_used": F("tokens_used") + step.tokens}
            if step.cost is not None:
                changes["cost_usd"] = added_cost(step.cost)
            AgentRun.objects.filter(pk=claim.run_id).update(**changes)
            record_usage(claim.run, step.usage, step.cost)

    def _append_fenced(self, claim: Claim, step: StepWrite) -> bool:
        with transaction.atomic():
            if step.effects:
                ToolEffect.objects.bulk_create(step.effects, ignore_conflicts=True)
            changes: dict[str, Any] = {"lease_until": lease_expiry(claim.lease_seconds)}
            if step.finish is not None:
                changes = ending(step.finish[0], step.finish[1], "", step.output)
            if step.cost is not None:
                changes["cost_usd"] = added_cost(step.cost)
            if not (
                fenced(claim)
                .filter(last_seq=step.seq - 1)
                .update(
                    last_seq=step.seq,
                    stalled_claims=0,
                    tokens_used=F("tokens_used") + step.tokens,
                    updated_at=Now(),
                    **changes,
                )
            ):
                return False
            if step.usage is not None:
                record_usage(claim.run, step.usage, step.cost)
            AgentStep.objects.create(
                run_id=claim.run_id,
                seq=step.seq,
                kind=step.kind,
                payload=step.payload,
                content_start=step.content_span[0] if step.content_span else None,
                content_end=step.content_span[1] if step.content_span else None,
                request_id=step.request_id,
                attempt=claim.attempt,
                worker=claim.owner,
            )
        return True

    # -- end, hand back, park ------------------------------------------------------------

    def finish_run(
        self,
        claim: Claim,
        status: str,
        *,
        result: str | None = None,
        error: str = "",
        output: Any = None,
    ) -> bool:
        if not fenced(claim).update(updated_at=Now(), **ending(status, result, error, output)):
            return False
        self.child_ended(claim.run.parent_id)
        return True

    def release_lease(
        self,
        claim: Claim,
        *,
        error: str | None = None,
        count_claim: bool = True,
        hold_seconds: float | None = None,
        waiting_for: WaitKind | None = None,
    ) -> bool:
        changes: dict[str, Any] = {
            "status": RunStatus.PENDING,
            "lease_owner": None,
            "lease_until": None if hold_seconds is None else lease_expiry(hold_seconds),
            "updated_at": Now(),
        }
        if error is not None:
            changes["error"] = storable_text(error, MAX_REASON_CHARS)
        if not count_claim:
            changes["stalled_claims"] = Greatest(F("stalled_claims") - 1, 0)
        if waiting_for is not None:
            changes["waiting_for"] = waiting_for
            changes["waiting_since"] = Now()
        return bool(fenced(claim).update(**changes))

    def wait_for_worker(self, claim: Claim, reason: str) -> bool:
        return bool(
            fenced(claim).update(
                status=RunStatus.WAITING,
                waiting_for=WaitKind.WORKER,
                waiting_since=Now(),
                lease_owner=None,
                lease_until=None,
                error=storable_text(reason, MAX_REASON_CHARS),
                stalled_claims=Greatest(F("stalled_claims") - 1, 0),
                updated_at=Now(),
            )
        )

    def park_unserved_runs(self, served: Collection[tuple[str, str]]) -> int:
        return workers.park_unserved(served)

    def wake_served_runs(self, can_serve: Callable[[str, str, str, str], bool]) -> int:
        return workers.wake_served(can_serve)

    def park_on_intent(
        self,
        claim: Claim,
        intent: ToolIntent,
        *,
        new: bool = False,
        unknown_because: str | None = None,
    ) -> Parked:
        why: str | None = None  # set when this park marks the intent unknown
        run_changes: dict[str, Any] = {}
        with transaction.atomic():
            if new:
                intent.save(force_insert=True)
            else:
                status = (
                    ToolIntent.objects.select_for_update()
                    .filter(pk=intent.pk)
                    .values_list("status", flat=True)
                    .first()
                )
                if unknown_because is not None and status == IntentStatus.EXECUTING:
                    why = storable_text(unknown_because, MAX_REASON_CHARS)
                    ToolIntent.objects.filter(pk=intent.pk).update(
                        status=IntentStatus.UNKNOWN, reason=why, updated_at=Now()
                    )
                    status = IntentStatus.UNKNOWN
                    # Read on the runs list and the run's page, beside the wait.
                    run_changes["error"] = why
                if status not in _AWAITING_PERSON:
                    return Parked.DECIDED
            # Parking is this claim's outcome, not a stall: the no-progress count starts again.
            if not fenced(claim).update(
                **run_changes,
                status=RunStatus.WAITING,
                lease_owner=None,
                lease_until=None,
                stalled_claims=0,
                waiting_for=WaitKind.INTENT,
                waiting_since=Now(),
                wake_at=None,
                wait_event=None,
                wait_runs=None,
                wait_key=intent.key,
                woken_by=None,
                updated_at=Now(),
            ):
                transaction.set_rollback(True)
                return Parked.FENCE_FAILED
        if why is not None:
            # What the signal's receivers (the notification mail) read.
            intent.status, intent.reason = IntentStatus.UNKNOWN, why
        return Parked.PARKED

    def start_intent_execution(self, claim: Claim, intent: ToolIntent) -> bool:
        with transaction.atomic():
            started = bool(
                fenced(claim).update(
                    lease_until=lease_expiry(claim.lease_seconds), updated_at=Now()
                )
            ) and bool(
                ToolIntent.objects.filter(pk=intent.pk, status=IntentStatus.APPROVED).update(
                    status=IntentStatus.EXECUTING, updated_at=Now()
                )
            )
            if not started:
                transaction.set_rollback(True)
        if started:
            intent.status = IntentStatus.EXECUTING
        return started

    def complete_intent(self, intent: ToolIntent, effect: ToolEffect) -> None:
        """If another worker meanwhile found the intent ``executing`` and parked the run on it
        as ``unknown``, this settles it and wakes the run, which goes on with the recorded
        effect."""
        with transaction.atomic():
            if ToolIntent.objects.filter(
                pk=intent.pk, status__in=(IntentStatus.EXECUTING, IntentStatus.UNKNOWN)
            ).update(status=IntentStatus.DONE, updated_at=Now()):
                self.wake_run(intent.run_id)
            self.record_effect(effect)
        intent.status = IntentStatus.DONE

    # -- wake and decide -----------------------------------------------------------------

    def wake_run(self, run_id: RunId) -> bool:
        return bool(
            AgentRun.objects.filter(pk=run_id, status=RunStatus.WAITING).update(
                status=RunStatus.PENDING, updated_at=Now()
            )
        )

    def decide_intent(
        self, intent_id: int, user: AuthUser, from_status: str, to_status: str, reason: str
    ) -> ToolIntent:
        with transaction.atomic():
            intent = ToolIntent.objects.select_for_update().get(pk=intent_id)
            decided = intent.status == from_status
            if decided:
                intent.status = to_status
                intent.decided_by = user
                intent.decided_at = Now()
                intent.reason = storable_text(reason, MAX_REASON_CHARS)
                intent.updated_at = Now()
                intent.save(
                    update_fields=["status", "decided_by", "decided_at", "reason", "updated_at"]
                )
                # In the transaction that holds the intent's lock: see park_on_intent.
                self.wake_run(intent.run_id)
        intent.refresh_from_db()
        return mark_transitioned(intent) if decided else intent

    def resolve_intent(
        self, intent_id: int, user: AuthUser, *, outcome: tuple[str, bool] | None, reason: str
    ) -> ToolIntent:
        with transaction.atomic():
            intent = ToolIntent.objects.select_for_update().get(pk=intent_id)
            if intent.status != IntentStatus.UNKNOWN:
                return intent
            intent.decided_by = user
            intent.decided_at = Now()
            intent.reason = storable_text(reason, MAX_REASON_CHARS)
            if outcome is not None:
                self.record_effect(
                    ToolEffect(
                        key=intent.key,
                        run_id=intent.run_id,
                        seq=intent.seq,
                        call_index=intent.call_index,
                        tool=intent.tool,
                        result=outcome[0],
                        is_error=outcome[1],
                    )
                )
                intent.status = IntentStatus.DONE
            else:
                intent.status = IntentStatus.APPROVED
            intent.updated_at = Now()
            intent.save(
                update_fields=["status", "decided_by", "decided_at", "reason", "updated_at"]
            )
            self.wake_run(intent.run_id)
        intent.refresh_from_db()
        return mark_transitioned(intent)

    # -- operations on any run -----------------------------------------------------------

    def cancel_run(self, run_id: RunId | str) -> bool:
        run_id = _run_pk(run_id)
        with transaction.atomic():
            parent_id = (
                AgentRun.objects.filter(pk=run_id, status__in=CANCELLABLE_STATUSES)
                .values_list("parent_id", flat=True)
                .first()
            )
            if not portable_trees.cancel([run_id]):
                return False
        portable_trees.cancel_descendants(run_id)
        self.child_ended(parent_id)
        return True

    def requeue_run(self, run_id: RunId | str) -> bool:
        return bool(
            AgentRun.objects.filter(pk=run_id, status=RunStatus.DEAD).update(
                status=RunStatus.PENDING,
                dead_cause="",
                stalled_claims=0,
                lease_owner=None,
                lease_until=None,
                finished_at=None,
                updated_at=Now(),
            )
        )

    def dead_letter(self, run_id: RunId, reason: str) -> bool:
        candidates = AgentRun.objects.not_leased().filter(pk=run_id)
        parent_id = candidates.values_list("parent_id", flat=True).first()
        if not candidates.update(updated_at=Now(), **ending(RunStatus.DEAD, None, reason)):
            return False
        self.child_ended(parent_id)
        return True

    # -- waits ---------------------------------------------------------------------------

    def park_on_batch(self, claim: Claim, turn: BatchTurn) -> Parked:
        return batches.park_on_batch(claim, turn)

    def wake_batch_answers(self, candidates: Sequence[Candidate], woken_by: str) -> set[int]:
        return batches.wake_answers(candidates, woken_by)

    def park_on_wait(self, claim: Claim, spec: WaitSpec) -> tuple[Parked, dict[str, Any] | None]:
        with transaction.atomic():
            # The run's row first: a wake of this run (an answer, a child's end) locks it
            # too, so it either sees the run parked or is seen here as done.
            if not fenced(claim).select_for_update(no_key=True).exists():
                return Parked.FENCE_FAILED, None
            changes: dict[str, Any] = {
                "wake_at": None if spec.seconds is None else lease_expiry(spec.seconds),
                "wait_event": None,
                "wait_runs": None,
            }
            if spec.kind == WaitKind.TIMER and spec.until is not None:
                changes["wake_at"] = spec.until
            elif spec.kind == WaitKind.EVENT:
                assert spec.event is not None
                event = self._locked_event(spec.event)
                if event.is_sent:
                    return Parked.READY, event.woken_by()
                changes["wait_event"] = spec.event
            elif spec.kind == WaitKind.RUNS:
                outcomes = self._children_outcomes(claim.run_id, spec.runs)
                if all(o["status"] in ENDED_STATUSES for o in outcomes.values()):
                    return Parked.READY, {"runs": outcomes}
                changes["wait_runs"] = list(spec.runs)
            elif spec.kind == WaitKind.QUESTION:
                assert spec.question is not None
                question, _ = AgentQuestion.objects.get_or_create(
                    key=spec.key, defaults={"run_id": claim.run_id, "question": spec.question}
                )
                if question.status == QuestionStatus.ANSWERED:
                    return Parked.READY, question.woken_by()
            elif spec.kind == WaitKind.CALLBACK:
                # The service may have answered before this park: its POST locked this row
                # too, and kept the body for the call.
                received = AgentCallback.objects.filter(key=spec.key).first()
                if received is not None:
                    return Parked.READY, received.woken_by()
            # Parking is this claim's outcome, not a stall: the no-progress count starts again.
            fenced(claim).update(
                status=RunStatus.WAITING,
                lease_owner=None,
                lease_until=None,
                stalled_claims=0,
                waiting_for=spec.kind,
                waiting_since=Now(),
                wait_key=spec.key,
                woken_by=None,
                updated_at=Now(),
                **changes,
            )
        return Parked.PARKED, None

    @staticmethod
    def _locked_event(name: str) -> AgentEvent:
        """The event's row, created unsent if need be, locked for this transaction: a send
        and a wait of the same name serialise on it."""
        AgentEvent.objects.get_or_create(name=name)
        return AgentEvent.objects.select_for_update().get(name=name)

    def _children_outcomes(self, parent_id: RunId, run_ids: Sequence[str]) -> dict[str, Any]:
        children = AgentRun.objects.filter(pk__in=list(run_ids), parent_id=parent_id)
        outcomes = {str(run.pk): run_outcome(run) for run in children}
        strangers = [r for r in run_ids if r not in outcomes]
        refuse_strangers(strangers)
        return {r: outcomes[r] for r in run_ids}

    def send_event(self, name: str, payload: Any, user: AuthUser = None) -> tuple[AgentEvent, int]:
        with transaction.atomic():
            event = self._locked_event(name)
            if event.is_sent:
                return event, 0
            event.payload = payload
            event.sent_at = Now()
            event.sent_by = user
            event.save(update_fields=["payload", "sent_at", "sent_by"])
            event.refresh_from_db()
            mark_transitioned(event)
            woken = AgentRun.objects.filter(
                status=RunStatus.WAITING, waiting_for=WaitKind.EVENT, wait_event=name
            ).update(
                status=RunStatus.PENDING,
                woken_by=event.wake_reference(),
                wake_at=None,
                updated_at=Now(),
            )
        return event, woken

    def answer_question(
        self, run_id: RunId | str, user: AuthUser, text: str, question_id: int | None = None
    ) -> AgentQuestion | None:
        with transaction.atomic():
            asked = AgentQuestion.objects.select_for_update().filter(run_id=_run_pk(run_id))
            if question_id is not None:
                asked = asked.filter(pk=question_id)
            question = asked.order_by("-created_at", "-pk").first()
            if question is None or question.status != QuestionStatus.OPEN:
                return question
            question.status = QuestionStatus.ANSWERED
            question.answer = storable_text(text)
            question.answered_by = user
            question.answered_at = Now()
            question.save(update_fields=["status", "answer", "answered_by", "answered_at"])
            question.refresh_from_db()
            mark_transitioned(question)
            AgentRun.objects.filter(
                pk=run_id,
                status=RunStatus.WAITING,
                waiting_for=WaitKind.QUESTION,
                wait_key=question.key,
            ).update(status=RunStatus.PENDING, woken_by=question.woken_by(), updated_at=Now())
        return question

    def spawn_run(
        self,
        child: AgentRun,
        task_payload: str,
        max_children: int,
        max_tree_runs: int | None = None,
    ) -> tuple[AgentRun, bool]:
        with transaction.atomic():
            existing = AgentRun.objects.filter(
                parent_id=child.parent_id, spawn_key=child.spawn_key
            ).first()
            if existing is not None:
                return existing, False
            root_id = portable_trees.lock_tree_root(child.parent_id)
            # The parent's row, locked: a cancel of the parent (which cancels its children)
            # and other spawns of it wait, so no child outlives a cancelled parent and the
            # count below holds.
            parent = (
                None  # no parent at all: refused below, as a parent that is gone
                if child.parent_id is None
                else AgentRun.objects.select_for_update(no_key=True)
                .filter(pk=child.parent_id)
                .values_list("status", "priority", "concurrency_key")
                .first()
            )
            refuse_spawn(
                None if parent is None else parent[0],
                AgentRun.objects.filter(parent_id=child.parent_id).count(),
                max_children,
                # The root and its descendants, counted under the root's lock.
                1 + AgentRun.objects.filter(root_id=root_id).count() if root_id else 0,
                max_tree_runs,
            )
            assert parent is not None  # refuse_spawn raised otherwise
            child.priority = parent[1]  # a child of an urgent run is urgent
            child.concurrency_key = parent[2]  # and counts toward its key
            child.root_id = root_id
            return self.create_run(child, task_payload), True

    def wake_parent(self, parent_id: RunId) -> bool:
        with transaction.atomic():
            parent = (
                AgentRun.objects.select_for_update(no_key=True)
                .filter(pk=parent_id, status=RunStatus.WAITING, waiting_for=WaitKind.RUNS)
                .only("pk", "wait_runs")
                .first()
            )
            if parent is None:
                return False
            # Read after the lock: every child that ended before it is seen here.
            outcomes = self.run_outcomes(parent.wait_runs or [])
            if any(o["status"] not in ENDED_STATUSES for o in outcomes.values()):
                return False
            return bool(
                AgentRun.objects.filter(pk=parent_id, status=RunStatus.WAITING).update(
                    status=RunStatus.PENDING,
                    woken_by={"runs": outcomes},
                    wake_at=None,
                    updated_at=Now(),
                )
            )

    def stranded_parents(self, limit: int) -> list[RunId]:
        return list(
            AgentRun.objects.filter(status=RunStatus.WAITING, waiting_for=WaitKind.RUNS)
            .order_by("created_at")
            .values_list("pk", flat=True)[:limit]
        )

    def receive_callback(self, run_id: RunId, key: str, body: Any) -> CallbackReceipt:
        return portable_callbacks.receive_callback(run_id, key, body)

    def received_callback(self, key: str) -> AgentCallback | None:
        return portable_callbacks.received_callback(key)

    def sent_event(self, name: str) -> AgentEvent | None:
        return AgentEvent.objects.filter(name=name, sent_at__isnull=False).first()

    def question_for_key(self, key: str) -> AgentQuestion | None:
        return AgentQuestion.objects.filter(key=key).first()

    def run_outcomes(self, run_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
        runs = AgentRun.objects.filter(pk__in=list(run_ids)).only(
            "pk", "status", "result", "error", "task", "output"
        )
        found = {str(run.pk): run_outcome(run) for run in runs}
        return {str(r): found[str(r)] for r in run_ids if str(r) in found}

    # -- reads ---------------------------------------------------------------------------

    def current_status(self, run_id: RunId) -> str | None:
        return AgentRun.objects.filter(pk=run_id).values_list("status", flat=True).first()

    def spent_today(self, key: str) -> tuple[Decimal, Decimal | None]:
        return key_rows.spent_today(key)

    def set_key_limit(self, key: str, limit: int | None) -> None:
        key_rows.set_limit(key, limit)

    def set_key_budget(self, key: str, usd_per_day: Decimal | None) -> int:
        return key_rows.set_budget(key, usd_per_day)

    def next_wake_in(self) -> float | None:
        # The first row of agent_run_wake. This database compares wake_at with this process's
        # clock (the claim's ``Now()`` on SQLite is the same machine's).
        first = (
            AgentRun.objects.filter(status=RunStatus.WAITING, wake_at__isnull=False)
            .order_by("wake_at")
            .values_list("wake_at", flat=True)
            .first()
        )
        return None if first is None else (first - timezone.now()).total_seconds()

    def first_claimable(self) -> tuple[str, int] | None:
        # The claim's own order, read from its index (agent_run_claim_priority).
        return (
            AgentRun.objects.claimable()
            .order_by("-priority", "fair_at", "created_at")
            .values_list("model", "priority")
            .first()
        )

    def load_log_rows(self, run_id: RunId | str, *, shares: bool = True) -> list[LogRow]:
        return portable_logs.load_log_rows(run_id, shares=shares)

    def load_steps(self, run_id: RunId, after_seq: int = -1) -> list[StepTuple]:
        return portable_logs.load_steps(run_id, after_seq)

    def recorded_effects(self, run_id: RunId, seq: int) -> dict[str, ToolEffect]:
        # Read by the first tool step of every claim that resumes a run: written out, since
        # the ORM sets a query up anew each time (the fields' converters still apply).
        run = AgentRun._meta.pk.get_db_prep_value(run_id, connection)
        with connection.cursor() as cursor:
            cursor.execute(RECORDED_EFFECTS_SQL, [run, seq])
            rows = cursor.fetchall()
        return {e.key: e for e in effects_from(rows, connection)}

    def record_effect(self, effect: ToolEffect) -> None:
        ToolEffect.objects.bulk_create([effect], ignore_conflicts=True)

    def intent_for_key(self, key: str) -> ToolIntent | None:
        return ToolIntent.objects.filter(key=key).first()

    def reload_intent(self, intent: ToolIntent) -> None:
        intent.refresh_from_db()
