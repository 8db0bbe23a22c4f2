"""``InMemoryStore``: the store in dicts under one lock, for unit tests of the state machine.

No database access at all: runs, steps, effects and intents are unsaved model instances
(``AgentRun(...)``, ``ToolEffect(...)``) kept in dicts; callers get copies, as they would get
rows. The semantics are the SQL's: the fence (owner, attempt, status running, last_seq =
seq - 1), claims by ``priority`` then ``created_at``, leases that expire by the store's own
clock (inject ``now`` to move it), ``stalled_claims`` counted by claims and reset by progress or
parking, the effect ledger's ``ON CONFLICT DO NOTHING``, and the intents' transitions. Each
operation holds the lock throughout, as a transaction would.

A complete test double of ``Store``, modelled on procrastinate's ``InMemoryConnector``: it
keeps the same contract as the database stores (tests/integration/test_store_contract.py runs
every test on it too). It keeps no schedules, so it is no ``ScheduleStore``: firing schedules
needs a database store (``schedule_store`` says so). One class, ``InMemoryStore(Store)``; its
waits are the functions of memory_waits.py, which it calls.
"""

from __future__ import annotations

import datetime
import functools
import itertools
import threading
import uuid
from collections.abc import Callable, Collection, Sequence
from decimal import Decimal
from typing import Any

from django.db import IntegrityError
from django.db.backends.base.base import BaseDatabaseWrapper
from django.utils import timezone

from durable_agents._internal.text import storable_text
from durable_agents.declare.agents import registry
from durable_agents.exceptions import RunNotFound
from durable_agents.flow.capacity.gate import CapacityGate
from durable_agents.flow.capacity.memory import InMemoryCapacity
from durable_agents.flow.pricing import add_cost
from durable_agents.models import (
    CANCELLABLE_STATUSES,
    CLAIMABLE_STATUSES,
    AgentCallback,
    AgentEvent,
    AgentMessage,
    AgentQuestion,
    AgentRun,
    AgentStep,
    AgentWorker,
    IntentStatus,
    QuestionStatus,
    RunStatus,
    StepKind,
    ToolEffect,
    ToolIntent,
    WaitKind,
)
from durable_agents.store import concurrency, inbox, memory_waits
from durable_agents.store.base import (
    MAX_REASON_CHARS,
    RUN_CANCELLED,
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
    refuse_fork_in_tree,
    timer_woken_by,
    tree_root,
)
from durable_agents.store.memory_waits import _copy
from durable_agents.store.portable_debounce import DEBOUNCED_FIELDS
from durable_agents.store.rollup import UsageRows, count_in_rows
from durable_agents.store.transitions import mark_transitioned

_AWAITING_PERSON = (IntentStatus.PENDING, IntentStatus.UNKNOWN)


class ManualClock:
    """A clock for tests: ``InMemoryStore(now=clock)``; ``clock.advance(seconds)``."""

    def __init__(self, start: datetime.datetime | None = None) -> None:
        self.time = start or datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)

    def __call__(self) -> datetime.datetime:
        return self.time

    def advance(self, seconds: float) -> None:
        self.time += datetime.timedelta(seconds=seconds)


class InMemoryStore(Store):
    """Runs, steps, effects and intents in dicts under one lock; ``now`` is its clock."""

    def __init__(self, now: Callable[[], datetime.datetime] | None = None) -> None:
        self.now: Callable[[], datetime.datetime] = now or timezone.now
        self.lock = threading.RLock()
        self.runs: dict[RunId, AgentRun] = {}
        self.steps: dict[RunId, dict[int, AgentStep]] = {}
        # A fork's stretches of other runs' logs: (source, lo, hi), as agent_step_share.
        self.shares: dict[RunId, list[tuple[RunId, int, int]]] = {}
        self.effects: dict[str, ToolEffect] = {}
        self.intents: dict[int, ToolIntent] = {}
        self._intent_ids = itertools.count(1)
        self.events: dict[str, AgentEvent] = {}
        self.questions: dict[str, AgentQuestion] = {}  # by the asking call's key
        self.callbacks: dict[str, AgentCallback] = {}  # by the call's key
        self.inboxes: dict[RunId, list[AgentMessage]] = {}  # agent_message, by run
        self._row_ids = itertools.count(1)
        # The daily rollup, by (day, concurrency_key, agent, model, shard) as in the table.
        self.usage_days: UsageRows = {}
        # Limits staff set per concurrency key (``ConcurrencyKey.concurrency_limit``).
        self.key_limits: dict[str, int] = {}
        # Budgets staff set per concurrency key (``ConcurrencyKey.usd_per_day``).
        self.key_budgets: dict[str, Decimal] = {}
        # Each concurrency key's next turn (``ConcurrencyKey.next_fair_at``).
        self.next_turns: dict[str, datetime.datetime] = {}
        # agent_worker, by worker id; agent_version's last definitions, by (agent, version,
        # fingerprint).
        self.workers: dict[str, AgentWorker] = {}
        self.versions_defined: dict[tuple[str, str, str], datetime.datetime] = {}

    # No database: a worker on this store has no connection to look after.
    holds_connections = False

    @functools.cached_property
    def capacity(self) -> CapacityGate:
        """Model capacity in memory, on this store's clock."""
        return InMemoryCapacity(self.now)

    # -- inspection (tests) --------------------------------------------------------------

    def run(self, run_id: RunId) -> AgentRun:
        """A copy of the run as stored now."""
        with self.lock:
            return _copy(self.runs[run_id])

    def steps_of(self, run_id: RunId) -> list[AgentStep]:
        with self.lock:
            return [_copy(step) for step in self._log(run_id)]

    def intents_of(self, run_id: RunId) -> list[ToolIntent]:
        with self.lock:
            return [_copy(i) for i in self.intents.values() if i.run_id == run_id]

    # -- helpers -------------------------------------------------------------------------

    def _log(self, run_id: RunId) -> list[AgentStep]:
        """The run's own steps and the stretches it shares, in seq order (as LOG_SQL)."""
        rows = list(self.steps.get(run_id, {}).values())
        for source, lo, hi in self.shares.get(run_id, ()):
            rows += [s for seq, s in self.steps.get(source, {}).items() if lo <= seq < hi]
        return sorted(rows, key=lambda step: step.seq)

    def _stored(self, run_id: RunId | str) -> AgentRun | None:
        """The run by its id. Runs are kept by UUID: the text of an id finds none here (the
        database stores read it as the id)."""
        return self.runs.get(run_id) if isinstance(run_id, uuid.UUID) else None

    def _fenced(self, claim: Claim) -> AgentRun | None:
        """The stored run, only while it is still this claim's."""
        run = self.runs.get(claim.run_id)
        if (
            run is None
            or run.lease_owner != claim.owner
            or run.attempt != claim.attempt
            or run.status != RunStatus.RUNNING
        ):
            return None
        return run

    def _expiry(self, seconds: float) -> datetime.datetime:
        return self.now() + datetime.timedelta(seconds=seconds)

    def _claimable(self, run: AgentRun, now: datetime.datetime) -> bool:
        return run.status in CLAIMABLE_STATUSES and (
            run.lease_until is None or run.lease_until < now
        )

    @staticmethod
    def _due(run: AgentRun, now: datetime.datetime) -> bool:
        return run.status == RunStatus.WAITING and run.wake_at is not None and run.wake_at <= now

    def _take(self, runs: list[AgentRun], owner: str, lease_seconds: float) -> list[Claim]:
        now = self.now()
        claims = []
        for run in runs:
            if run.status == RunStatus.WAITING:
                # A debounced start is no wake of a call: nothing woke, the run starts.
                debounced = run.waiting_for == WaitKind.DEBOUNCE
                run.woken_by = None if debounced else timer_woken_by(run.waiting_for)
            run.wake_at = None
            run.status = RunStatus.RUNNING
            run.lease_owner = owner
            run.lease_until = now + datetime.timedelta(seconds=lease_seconds)
            run.attempt += 1
            run.stalled_claims += 1
            run.started_at = run.started_at or now
            run.updated_at = now
            task = self.steps.get(run.pk, {}).get(0)
            task_payload = (
                task.payload
                if run.last_seq == 0 and task is not None and task.kind == StepKind.TASK
                else None
            )
            claims.append(Claim(_copy(run), owner, run.attempt, lease_seconds, task_payload))
        return claims

    def _end(
        self, run: AgentRun, status: str, result: str | None, error: str, output: Any = None
    ) -> None:
        for name, value in ended(status, result, error, output).items():
            setattr(run, name, value)
        run.finished_at = run.updated_at = self.now()
        self.child_ended(run.parent_id)

    def _park(self, run: AgentRun, kind: str, key: str, **wait: Any) -> None:
        run.status = RunStatus.WAITING
        run.lease_owner = None
        run.lease_until = None
        run.stalled_claims = 0
        run.waiting_for = kind
        run.waiting_since = run.updated_at = self.now()
        run.wait_key = key
        run.woken_by = None
        run.wake_at = wait.get("wake_at")
        run.wait_event = wait.get("wait_event")
        run.wait_runs = wait.get("wait_runs")

    def _record(self, effect: ToolEffect) -> None:
        if effect.key not in self.effects:  # ON CONFLICT (key) DO NOTHING
            stored = _copy(effect)
            stored.created_at = self.now()
            self.effects[effect.key] = stored

    def _intent(self, intent_id: int) -> ToolIntent:
        try:
            return self.intents[intent_id]
        except KeyError:
            raise ToolIntent.DoesNotExist(f"no intent {intent_id}") from None

    # -- create --------------------------------------------------------------------------

    def create_run(self, run: AgentRun, task_payload: str) -> AgentRun:
        with self.lock:
            if run.pk in self.runs:
                raise IntegrityError(f"run {run.pk} exists")
            if run.start_key is not None:
                for started in self.runs.values():
                    if started.agent == run.agent and started.start_key == run.start_key:
                        return _copy(started)
            now = self.now()
            run.created_at = run.updated_at = run.fair_at = now
            if run.concurrency_key is not None:
                key = run.concurrency_key
                run.fair_at, self.next_turns[key] = concurrency.next_turn(
                    now, self.next_turns.get(key)
                )
            self.runs[run.pk] = _copy(run)
            self.steps[run.pk] = {
                0: AgentStep(
                    run_id=run.pk, seq=0, kind=StepKind.TASK, payload=task_payload, created_at=now
                )
            }
            return _copy(run)

    def debounce_run(self, run: AgentRun, task_payload: str, seconds: float) -> AgentRun:
        with self.lock:
            now = self.now()
            window_end = now + datetime.timedelta(seconds=seconds)
            started = next(
                (
                    r
                    for r in self.runs.values()
                    if (r.agent, r.start_key) == (run.agent, run.start_key)
                ),
                None,
            )
            if started is None:
                run.status = RunStatus.WAITING
                run.waiting_for = WaitKind.DEBOUNCE
                run.waiting_since, run.wake_at = now, window_end
                return self.create_run(run, task_payload)
            if started.status == RunStatus.WAITING and started.waiting_for == WaitKind.DEBOUNCE:
                for name in DEBOUNCED_FIELDS:
                    setattr(started, name, getattr(run, name))
                started.wake_at = window_end
                started.waiting_since = started.updated_at = now
                self.steps[started.pk][0] = AgentStep(
                    run_id=started.pk,
                    seq=0,
                    kind=StepKind.TASK,
                    payload=task_payload,
                    created_at=now,
                )
            return _copy(started)

    def create_fork(self, run: AgentRun, write: ForkWrite) -> AgentRun:
        with self.lock:
            if run.pk in self.runs:
                raise IntegrityError(f"run {run.pk} exists")
            missing = {source for source, _, _ in write.shares} - set(self.runs)
            if missing:  # the foreign key of agent_step_share.source_id
                raise IntegrityError(f"no run {', '.join(map(str, missing))}")
            if run.parent_id is not None:
                # Joins the child's tree, counted as a spawn is (under the store's one lock).
                parent = self.runs.get(run.parent_id)
                root_id = run.parent_id if parent is None else tree_root(parent)
                root = self.runs.get(root_id)
                refuse_fork_in_tree(
                    None if parent is None else parent.status,
                    None if root is None else root.status,
                    sum(1 for r in self.runs.values() if r.parent_id == run.parent_id),
                    1 + sum(1 for r in self.runs.values() if r.root_id == root_id),
                    write,
                )
                run.root_id = root_id
            now = self.now()
            run.created_at = run.updated_at = run.fair_at = now
            if run.concurrency_key is not None:
                key = run.concurrency_key
                run.fair_at, self.next_turns[key] = concurrency.next_turn(
                    now, self.next_turns.get(key)
                )
            self.runs[run.pk] = _copy(run)
            self.steps[run.pk] = {}
            self.shares[run.pk] = list(write.shares)
            if write.own_step is not None:
                seq, kind, payload = write.own_step
                self.steps[run.pk][seq] = AgentStep(
                    run_id=run.pk, seq=seq, kind=kind, payload=payload, created_at=now
                )
            for effect in write.effects:
                self._record(effect)
            return _copy(run)

    # -- claim and renew -----------------------------------------------------------------

    def claim_runs(self, owner: str, lease_seconds: float, limit: int = 1) -> list[Claim]:
        with self.lock:
            now = self.now()
            routing = registry.routing()
            routed = [
                run
                for run in self.runs.values()
                if routing.admits(run.agent, run.prompt_version, run.fingerprint)
            ]
            due = [run for run in routed if self._due(run, now)]
            due.sort(key=lambda run: run.wake_at or now)  # a due run always has its wake_at
            candidates = [run for run in routed if self._claimable(run, now)]
            # Highest priority first, then by turn, then oldest; stable: ties keep insertion
            # order.
            candidates.sort(key=lambda run: (-run.priority, run.fair_at, run.created_at))
            taken = concurrency.admit(due + candidates, self._held(now), self._limits(), limit)
            return self._take(taken, owner, lease_seconds)

    def claim_run(self, run_id: RunId, owner: str, lease_seconds: float) -> Claim | None:
        with self.lock:
            run = self.runs.get(run_id)
            now = self.now()
            if run is None or not (self._claimable(run, now) or self._due(run, now)):
                return None
            if not concurrency.admit([run], self._held(now), self._limits(), 1):
                return None
            return self._take([run], owner, lease_seconds)[0]

    def _held(self, now: datetime.datetime) -> dict[str, int]:
        """Each key's runs that hold a slot: running with a live lease."""
        held: dict[str, int] = {}
        for run in self.runs.values():
            key = run.concurrency_key
            if (
                key is not None
                and run.status == RunStatus.RUNNING
                and not self._claimable(run, now)
            ):
                held[key] = held.get(key, 0) + 1
        return held

    def register_worker(
        self, presence: Presence, definitions: Sequence[dict[str, Any]]
    ) -> AgentWorker | None:
        with self.lock:
            now = self.now()
            holder = self.workers.get(presence.worker_id)
            if (
                holder is not None
                and holder.instance != presence.instance
                and holder.alive_until > now
            ):
                return _copy(holder)
            self.workers[presence.worker_id] = AgentWorker(
                id=presence.worker_id,
                instance=presence.instance,
                host=presence.host,
                pid=presence.pid,
                concurrency=presence.concurrency,
                versions=list(presence.versions),
                started_at=now,
            )
            self._beat_worker(presence)
            self._record_versions(definitions, now)
            return None

    def beat_worker(self, presence: Presence) -> None:
        with self.lock:
            self._beat_worker(presence)

    def _beat_worker(self, presence: Presence) -> None:
        row = self.workers.get(presence.worker_id)
        if row is None or row.instance != presence.instance:
            return
        row.beat_at = self.now()
        row.alive_until = self._expiry(presence.alive_seconds)
        row.runs_held = presence.runs_held
        row.draining = presence.draining

    def unregister_worker(self, presence: Presence, definitions: Sequence[dict[str, Any]]) -> None:
        with self.lock:
            self._record_versions(definitions, self.now())
            row = self.workers.get(presence.worker_id)
            if row is not None and row.instance == presence.instance:
                del self.workers[presence.worker_id]

    def _record_versions(
        self, definitions: Sequence[dict[str, Any]], at: datetime.datetime
    ) -> None:
        for definition in definitions:
            key = (definition["agent"], definition["version"], definition["fingerprint"])
            self.versions_defined[key] = max(at, self.versions_defined.get(key, at))

    def wait_for_worker(self, claim: Claim, reason: str) -> bool:
        with self.lock:
            run = self._fenced(claim)
            if run is None:
                return False
            run.status = RunStatus.WAITING
            run.waiting_for = WaitKind.WORKER
            run.waiting_since = self.now()
            run.lease_owner = None
            run.lease_until = None
            run.error = storable_text(reason, MAX_REASON_CHARS)
            run.stalled_claims = max(run.stalled_claims - 1, 0)
            run.updated_at = self.now()
            return True

    def park_unserved_runs(self, served: Collection[tuple[str, str]]) -> int:
        with self.lock:
            now = self.now()
            parked = 0
            for run in self.runs.values():
                if (
                    run.status in (RunStatus.PENDING, RunStatus.RUNNING)
                    and (run.lease_until is None or run.lease_until < now)
                    and (run.status == RunStatus.PENDING or run.lease_until is not None)
                    and (run.agent, run.prompt_version) not in served
                ):
                    run.status = RunStatus.WAITING
                    run.waiting_for = WaitKind.WORKER
                    run.waiting_since = now
                    run.lease_owner = None
                    run.lease_until = None
                    run.error = (
                        f"waiting for a worker that defines {run.agent}@{run.prompt_version}:"
                        " no live worker does"
                    )
                    run.updated_at = now
                    parked += 1
            return parked

    def wake_served_runs(self, can_serve: Callable[[str, str, str, str], bool]) -> int:
        with self.lock:
            woken = 0
            for run in self.runs.values():
                if (
                    run.status == RunStatus.WAITING
                    and run.waiting_for == WaitKind.WORKER
                    and can_serve(run.agent, run.prompt_version, run.model, run.fingerprint)
                ):
                    run.status = RunStatus.PENDING
                    run.waiting_for = ""
                    run.wake_at = None
                    run.updated_at = self.now()
                    woken += 1
            return woken

    def renew_leases(
        self,
        owner: str,
        claims: Sequence[Claim],
        lease_seconds: float,
        using: BaseDatabaseWrapper | None = None,
        presence: Presence | None = None,
    ) -> dict[RunId, LeaseLoss]:
        with self.lock:
            if presence is not None:
                self._beat_worker(presence)
            missed: list[tuple[RunId, str | None]] = []
            for claim in claims:
                run = self.runs.get(claim.run_id)
                if run is None:
                    continue
                if (
                    run.lease_owner == owner
                    and run.attempt == claim.attempt
                    and run.status == RunStatus.RUNNING
                ):
                    run.lease_until = self._expiry(lease_seconds)
                    run.updated_at = self.now()
                else:
                    missed.append((claim.run_id, run.status))
            return lease_losses(missed)

    def renew_lease(self, claim: Claim) -> bool:
        with self.lock:
            run = self._fenced(claim)
            if run is None:
                return False
            run.lease_until = self._expiry(claim.lease_seconds)
            run.updated_at = self.now()
            return True

    # -- commit --------------------------------------------------------------------------

    def committed_by(self, claim: Claim, seq: int) -> bool:
        with self.lock:
            return self._committed_by(claim, seq)

    def _committed_by(self, claim: Claim, seq: int) -> bool:
        step = self.steps.get(claim.run_id, {}).get(seq)
        return step is not None and (step.attempt, step.worker) == (claim.attempt, claim.owner)

    def read_ahead(self, claims: Sequence[Claim]) -> list[Claim]:
        """Nothing to save in memory: each resume reads the store itself."""
        return list(claims)

    def append_step(
        self, claim: Claim, step: StepWrite, then_claim: NextClaim | None = None
    ) -> bool:
        """This is where a step gets committed in memory (the fence, then the step), with
        the next run claimed as ``PostgresStore`` does when ``then_claim`` is given."""
        with self.lock:
            for effect in step.effects:  # whatever the fence says
                self._record(effect)
            may_claim = (
                step.finish is not None
                and then_claim is not None
                and not step.effects
                and then_claim.take()
            )
            run = self._fenced(claim)
            if run is None or run.last_seq != step.seq - 1:
                if may_claim:
                    assert then_claim is not None
                    then_claim.give_back()
                if self._committed_by(claim, step.seq):
                    return True
                self.count_unstored_turn(claim, step)
                return False
            now = self.now()
            run.last_seq = step.seq
            run.stalled_claims = 0
            self._count_turn(run, step)
            run.updated_at = now
            if step.finish is None:
                run.lease_until = self._expiry(claim.lease_seconds)
            else:
                self._end(run, step.finish[0], step.finish[1], "", step.output)
            self.steps.setdefault(run.pk, {})[step.seq] = AgentStep(
                run_id=run.pk,
                seq=step.seq,
                kind=step.kind,
                payload=step.payload,
                content_start=step.content_span[0] if step.content_span else None,
                content_end=step.content_span[1] if step.content_span else None,
                request_id=step.request_id,
                attempt=claim.attempt,
                worker=claim.owner,
                created_at=now,
            )
            if may_claim:
                assert then_claim is not None
                taken = self.claim_runs(claim.owner, then_claim.lease_seconds, 1)
                if taken:
                    next_claim = taken[0]
                    then_claim.claim = Claim(
                        next_claim.run,
                        then_claim.owner,
                        next_claim.attempt,
                        then_claim.lease_seconds,
                        next_claim.task_payload,
                    )
                else:
                    then_claim.give_back()
            return True

    # -- the inbox (store/inbox.py's operations, with a list per run) -------------------

    def queue_message(
        self,
        run_id: RunId,
        text: str,
        key: str | None,
        user: Any = None,
        *,
        busy_refused: bool = False,
    ) -> tuple[AgentMessage, bool]:
        with self.lock:
            run = self.runs.get(run_id)
            if run is None:
                raise RunNotFound(f"there is no run {run_id}")
            box = self.inboxes.setdefault(run_id, [])
            if key is not None:
                for earlier in box:
                    if earlier.key == key:
                        return earlier, False
            inbox.refuse(run_id, run.status, busy_refused=busy_refused)
            message = AgentMessage(
                id=next(self._row_ids),
                run_id=run_id,
                text=text,
                key=key,
                sent_by=user,
                created_at=self.now(),
            )
            box.append(message)
            return message, True

    def waiting_messages(self, run_id: RunId) -> list[AgentMessage]:
        with self.lock:
            return [m for m in self.inboxes.get(run_id, []) if m.folded_seq is None]

    def has_waiting_messages(self, run_id: RunId) -> bool:
        return bool(self.waiting_messages(run_id))

    def fold_messages(self, claim: Claim, step: StepWrite, ids: Sequence[int]) -> bool:
        with self.lock:
            if not self.append_step(claim, step):
                return False
            chosen = [m for m in self.inboxes.get(claim.run_id, []) if m.id in ids]
            for message in chosen:
                if message.folded_seq is None:
                    message.folded_seq = step.seq
                    message.folded_at = self.now()
            return all(m.folded_seq == step.seq for m in chosen) and len(chosen) == len(ids)

    def finish_unless_messages(
        self, claim: Claim, result: str | None, output: Any = None
    ) -> bool | None:
        with self.lock:
            if self.has_waiting_messages(claim.run_id):
                return None
            return self.finish_run(claim, RunStatus.SUCCEEDED, result=result, output=output)

    def append_last_step(
        self, claim: Claim, step: StepWrite, then_claim: NextClaim | None = None
    ) -> bool | None:
        with self.lock:
            if self.has_waiting_messages(claim.run_id):
                return None
            return self.append_step(claim, step, then_claim)

    def count_unstored_turn(self, claim: Claim, step: StepWrite) -> None:
        if step.usage is None:
            return
        with self.lock:
            run = self.runs.get(claim.run_id)
            if run is not None:
                self._count_turn(run, step)

    def _count_turn(self, run: AgentRun, step: StepWrite) -> None:
        """A step's tokens and cost on its run; a model turn in the day's rollup too."""
        run.tokens_used += step.tokens
        run.cost_usd = add_cost(run.cost_usd, step.cost)
        if step.usage is not None:
            day = self.now().astimezone(datetime.UTC).date()
            count_in_rows(self.usage_days, day, run, step.usage, step.cost)

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
        with self.lock:
            run = self._fenced(claim)
            if run is None:
                return False
            self._end(run, status, result, error, output)
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
        with self.lock:
            run = self._fenced(claim)
            if run is None:
                return False
            run.status = RunStatus.PENDING
            run.lease_owner = None
            run.lease_until = None if hold_seconds is None else self._expiry(hold_seconds)
            run.updated_at = self.now()
            if error is not None:
                run.error = storable_text(error, MAX_REASON_CHARS)
            if not count_claim:
                run.stalled_claims = max(run.stalled_claims - 1, 0)
            if waiting_for is not None:
                run.waiting_for = waiting_for
                run.waiting_since = self.now()
            return True

    def park_on_intent(
        self,
        claim: Claim,
        intent: ToolIntent,
        *,
        new: bool = False,
        unknown_because: str | None = None,
    ) -> Parked:
        with self.lock:
            mark_unknown = False
            if new:
                if any(i.key == intent.key for i in self.intents.values()):
                    raise IntegrityError(f"an intent with key {intent.key} exists")
            else:
                status = self._intent(intent.pk).status if intent.pk in self.intents else None
                if unknown_because is not None and status == IntentStatus.EXECUTING:
                    mark_unknown = True
                    status = IntentStatus.UNKNOWN
                if status not in _AWAITING_PERSON:
                    return Parked.DECIDED
            run = self._fenced(claim)
            if run is None:
                return Parked.FENCE_FAILED  # nothing written: the transaction rolls back
            now = self.now()
            if new:
                intent.pk = next(self._intent_ids)
                intent.created_at = intent.updated_at = now
                self.intents[intent.pk] = _copy(intent)
            elif mark_unknown:
                why = storable_text(unknown_because, MAX_REASON_CHARS)
                stored = self.intents[intent.pk]
                stored.status = intent.status = IntentStatus.UNKNOWN
                stored.reason = intent.reason = why
                stored.updated_at = now
                run.error = why
            self._park(run, WaitKind.INTENT, intent.key)
            return Parked.PARKED

    def start_intent_execution(self, claim: Claim, intent: ToolIntent) -> bool:
        with self.lock:
            run = self._fenced(claim)
            stored = self.intents.get(intent.pk)
            if run is None or stored is None or stored.status != IntentStatus.APPROVED:
                return False
            now = self.now()
            run.lease_until = self._expiry(claim.lease_seconds)
            run.updated_at = now
            stored.status = IntentStatus.EXECUTING
            stored.updated_at = now
        intent.status = IntentStatus.EXECUTING
        return True

    def complete_intent(self, intent: ToolIntent, effect: ToolEffect) -> None:
        with self.lock:
            stored = self.intents.get(intent.pk)
            if stored is not None and stored.status in (
                IntentStatus.EXECUTING,
                IntentStatus.UNKNOWN,
            ):
                stored.status = IntentStatus.DONE
                stored.updated_at = self.now()
                self.wake_run(stored.run_id)
            self._record(effect)
        intent.status = IntentStatus.DONE

    # -- wake and decide -----------------------------------------------------------------

    def wake_run(self, run_id: RunId) -> bool:
        with self.lock:
            run = self.runs.get(run_id)
            if run is None or run.status != RunStatus.WAITING:
                return False
            run.status = RunStatus.PENDING
            run.updated_at = self.now()
            return True

    def _decided(self, intent: ToolIntent, user: AuthUser, reason: str) -> None:
        now = self.now()
        intent.decided_by = user
        intent.decided_at = now
        intent.reason = storable_text(reason, MAX_REASON_CHARS)
        intent.updated_at = now

    def decide_intent(
        self, intent_id: int, user: AuthUser, from_status: str, to_status: str, reason: str
    ) -> ToolIntent:
        with self.lock:
            intent = self._intent(intent_id)
            if intent.status == from_status:
                intent.status = to_status
                self._decided(intent, user, reason)
                self.wake_run(intent.run_id)
                return mark_transitioned(_copy(intent))
            return _copy(intent)

    def resolve_intent(
        self, intent_id: int, user: AuthUser, *, outcome: tuple[str, bool] | None, reason: str
    ) -> ToolIntent:
        with self.lock:
            intent = self._intent(intent_id)
            if intent.status != IntentStatus.UNKNOWN:
                return _copy(intent)
            if outcome is not None:
                self._record(
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
            self._decided(intent, user, reason)
            self.wake_run(intent.run_id)
            return mark_transitioned(_copy(intent))

    # -- waits: memory_waits.py ---------------------------------------------------------

    def park_on_wait(self, claim: Claim, spec: WaitSpec) -> tuple[Parked, dict[str, Any] | None]:
        return memory_waits.park_on_wait(self, claim, spec)

    def send_event(self, name: str, payload: Any, user: AuthUser = None) -> tuple[AgentEvent, int]:
        return memory_waits.send_event(self, name, payload, user)

    def answer_question(
        self, run_id: RunId | str, user: AuthUser, text: str, question_id: int | None = None
    ) -> AgentQuestion | None:
        return memory_waits.answer_question(self, run_id, user, text, question_id)

    def spawn_run(
        self,
        child: AgentRun,
        task_payload: str,
        max_children: int,
        max_tree_runs: int | None = None,
    ) -> tuple[AgentRun, bool]:
        return memory_waits.spawn_run(self, child, task_payload, max_children, max_tree_runs)

    def wake_parent(self, parent_id: RunId) -> bool:
        return memory_waits.wake_parent(self, parent_id)

    def stranded_parents(self, limit: int) -> list[RunId]:
        return memory_waits.stranded_parents(self, limit)

    def receive_callback(self, run_id: RunId, key: str, body: Any) -> CallbackReceipt:
        return memory_waits.receive_callback(self, run_id, key, body)

    def received_callback(self, key: str) -> AgentCallback | None:
        return memory_waits.received_callback(self, key)

    def sent_event(self, name: str) -> AgentEvent | None:
        return memory_waits.sent_event(self, name)

    def question_for_key(self, key: str) -> AgentQuestion | None:
        return memory_waits.question_for_key(self, key)

    def run_outcomes(self, run_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
        return memory_waits.run_outcomes(self, run_ids)

    # -- operations on any run -----------------------------------------------------------

    def cancel_run(self, run_id: RunId | str) -> bool:
        with self.lock:
            run = self._stored(run_id)
            if run is None or run.status not in CANCELLABLE_STATUSES:
                return False
            generation = [run]
            while generation:
                for each in generation:
                    if each.status in CANCELLABLE_STATUSES:
                        each.status = RunStatus.CANCELLED
                        each.dead_cause = ""
                        each.lease_owner = None
                        each.lease_until = None
                        each.finished_at = each.updated_at = self.now()
                    for question in self.questions.values():
                        if question.run_id == each.pk and question.status == QuestionStatus.OPEN:
                            question.status = QuestionStatus.CANCELLED
                    for intent in self.intents.values():
                        if intent.run_id == each.pk and intent.status == IntentStatus.PENDING:
                            intent.status = IntentStatus.REJECTED
                            intent.reason = RUN_CANCELLED
                            intent.decided_at = intent.updated_at = self.now()
                ids = {each.pk for each in generation}
                generation = [r for r in self.runs.values() if r.parent_id in ids]
            self.child_ended(run.parent_id)
            return True

    def requeue_run(self, run_id: RunId | str) -> bool:
        with self.lock:
            run = self._stored(run_id)
            if run is None or run.status != RunStatus.DEAD:
                return False
            run.status = RunStatus.PENDING
            run.dead_cause = ""
            run.stalled_claims = 0
            run.lease_owner = None
            run.lease_until = None
            run.finished_at = None
            run.updated_at = self.now()
            return True

    def dead_letter(self, run_id: RunId, reason: str) -> bool:
        with self.lock:
            run = self.runs.get(run_id)
            if run is None:
                return False
            now = self.now()
            not_leased = run.status in (RunStatus.PENDING, RunStatus.WAITING) or (
                run.status == RunStatus.RUNNING
                and (run.lease_until is None or run.lease_until < now)
            )
            if not not_leased:
                return False
            self._end(run, RunStatus.DEAD, None, reason)
            return True

    # -- reads ---------------------------------------------------------------------------

    def current_status(self, run_id: RunId) -> str | None:
        with self.lock:
            run = self.runs.get(run_id)
            return None if run is None else run.status

    def _limits(self) -> dict[str, int]:
        """CONCURRENCY_LIMITS, and the limits set with ``set_key_limit`` (which win)."""
        return {**concurrency.overrides(), **self.key_limits}

    def set_key_limit(self, key: str, limit: int | None) -> None:
        with self.lock:
            if limit is None:
                self.key_limits.pop(key, None)
            else:
                self.key_limits[key] = limit

    def spent_today(self, key: str) -> tuple[Decimal, Decimal | None]:
        with self.lock:
            day = self.now().astimezone(datetime.UTC).date()
            spent = sum(
                (row.cost_usd or Decimal(0))
                for (row_day, row_key, *_), row in self.usage_days.items()
                if row_day == day and row_key == key
            )
            return Decimal(spent), self.key_budgets.get(key)

    def set_key_budget(self, key: str, usd_per_day: Decimal | None) -> int:
        with self.lock:
            if usd_per_day is None:
                self.key_budgets.pop(key, None)
            else:
                self.key_budgets[key] = usd_per_day
            woken = 0
            for run in self.runs.values():
                if (
                    run.status == RunStatus.PENDING
                    and run.waiting_for == WaitKind.BUDGET
                    and run.concurrency_key == key
                ):
                    run.lease_until = None
                    woken += 1
            return woken

    def next_wake_in(self) -> float | None:
        with self.lock:
            due = [
                run.wake_at
                for run in self.runs.values()
                if run.status == RunStatus.WAITING and run.wake_at is not None
            ]
            return (min(due) - self.now()).total_seconds() if due else None

    def first_claimable(self) -> tuple[str, int] | None:
        with self.lock:
            now = self.now()
            candidates = [run for run in self.runs.values() if self._claimable(run, now)]
            if not candidates:
                return None
            first = min(candidates, key=lambda run: (-run.priority, run.fair_at, run.created_at))
            return first.model, first.priority

    def load_log_rows(self, run_id: RunId | str, *, shares: bool = True) -> list[LogRow]:
        if not isinstance(run_id, uuid.UUID):
            return []  # kept by UUID, like the runs: the text of an id finds no log here
        with self.lock:
            return [
                (s.seq, s.kind, s.payload, s.content_start, s.content_end)
                for s in self._log(run_id)
            ]

    def load_steps(self, run_id: RunId, after_seq: int = -1) -> list[StepTuple]:
        with self.lock:
            return [(s.seq, s.kind, s.payload) for s in self._log(run_id) if s.seq > after_seq]

    def recorded_effects(self, run_id: RunId, seq: int) -> dict[str, ToolEffect]:
        with self.lock:
            return {
                key: _copy(e)
                for key, e in self.effects.items()
                if e.run_id == run_id and e.seq == seq
            }

    def record_effect(self, effect: ToolEffect) -> None:
        with self.lock:
            self._record(effect)

    def intent_for_key(self, key: str) -> ToolIntent | None:
        with self.lock:
            found = next((i for i in self.intents.values() if i.key == key), None)
            return None if found is None else _copy(found)

    def reload_intent(self, intent: ToolIntent) -> None:
        with self.lock:
            stored = self._intent(intent.pk)
            for field in ToolIntent._meta.concrete_fields:
                setattr(intent, field.attname, getattr(stored, field.attname))
            intent._state.fields_cache = dict(stored._state.fields_cache)
