"""Upgrades: runs moved, in place, onto another version of their agent.

How runs are upgraded (``api.upgrade_runs`` and ``api.carry_over_runs`` -> ``upgrade``)::

    the candidates     -> the ids given, or every run of agent@from_version that can move (in
                          flight: pending, waiting, or running with an expired lease; dead of an
                          undeployed version or drift for a carry over), BATCH ids at a time
    a batch            -> one transaction: the candidates that can move locked (FOR NO KEY
                          UPDATE SKIP LOCKED); the others told apart (no such run, another agent
                          or version, ended, held by a live lease, busy: a worker is claiming it)
    a locked run       -> judged on what it committed (``Judge``): an intent waiting for a
                          person or in doubt; a last model turn asking for a tool the target
                          lacks or declares otherwise; signed thinking bound to a system prompt
                          or tools the target sends differently
    the movable ones   -> one UPDATE for the batch, fenced again on agent, version, status and
                          lease: version and fingerprint pinned anew (for the run's own model), a
                          run waiting for a worker pending again, a running run whose lease
                          expired handed back (its old holder's fence fails from then on), a
                          dead run back to pending as a requeue makes it
    after the commit   -> each upgraded run audited: the ``run_upgraded`` signal, a log line

What the history allows: a run's log is sent back byte for byte, and a thinking block in it is
signed over the model, system prompt and tools that produced it (``planning.bound_blocks``).
The model never changes here (the run keeps its own); the system prompt and tools are compared
with what the run's version sent: the request of ``from_version`` when this process defines it
with the run's fingerprint, else the ``agent_version`` record of the run's definition (the
``binding`` digest a worker recorded), else nothing is known and they count as changed. With
them changed, a run whose log holds bound thinking stays where it is; without thinking, any
version goes. A run's pending calls (its last turn's tool_use blocks) run on the target's tools:
each must be there with the same effect class and input schema (per-tool digests).

A batch holds its locks for its own transaction only; called inside a transaction of the
caller's, the locks last until that one ends.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import re
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

from django.db import transaction
from django.db.models import BooleanField, Case, ExpressionWrapper, F, Q, Value, When
from django.db.models.functions import Now

from durable_agents import signals
from durable_agents._internal.deepjson import loads_deep
from durable_agents._internal.text import storable_text
from durable_agents.causes import error_reason
from durable_agents.declare.agents import Agent, AgentNotFound, registry
from durable_agents.forks.planning import BoundBlock, StepRow, bound_in
from durable_agents.logging import bind_run
from durable_agents.models import (
    AgentRun,
    AgentStep,
    AgentVersion,
    IntentStatus,
    RunStatus,
    SharedSteps,
    StepKind,
    ToolIntent,
    WaitKind,
    step_part,
)

logger = logging.getLogger("durable_agents.upgrades")

# Runs locked, judged and moved per transaction (the candidates of a whole agent version are
# read in id order, a batch at a time).
BATCH = 500

# The dead-letter reasons of a run whose version no worker defines, or defines differently:
# the housekeeping sweep's (after UNDEPLOYED_GRACE without a live worker defining it), and
# those of earlier releases, which may still be in the dead letter: their sweep's, their
# worker's after MAX_ATTEMPTS claims (as the "last error"), and their worker's prompt drift.
# Such a run is carried over rather than requeued.
CARRIED_OVER_REASON = re.compile(
    r"agent version .* has not been defined by any live worker"
    r"|prompt version .* of agent .* is (?:no longer deployed|not deployed on worker)"
    r"|prompt drift: agent ",
    re.DOTALL,
)
# Words of those reasons a query can look for (CARRIED_OVER_REASON checks each run's again).
CARRIED_OVER_WORDS = ("defined by any live worker", "deployed", "prompt drift: ")
# Intents that hold a run: a person decides them (pending) or settles them (unknown), or the
# call is running (executing: in doubt if its worker died).
HOLDING_INTENTS = (IntentStatus.PENDING, IntentStatus.UNKNOWN, IntentStatus.EXECUTING)
# A pending run handed back until these let it go keeps its hold (their wait is not about its
# version); any other hold of a pending run is the undeployed version's, lifted by the upgrade.
KEPT_HOLDS = (WaitKind.CAPACITY, WaitKind.BUDGET)
PARAM_NAMES = {"system": "system prompt", "tools": "tools"}
# What each holding intent asks of a person before its run can move.
INTENT_REASONS: dict[str, str] = {
    IntentStatus.PENDING: "waits for a person's decision: decide it first",
    IntentStatus.UNKNOWN: (
        "has an unknown outcome (its call may have happened): a person resolves it first"
    ),
    IntentStatus.EXECUTING: (
        "is executing: its irreversible call has started and its outcome is not recorded yet"
    ),
}


@dataclasses.dataclass(frozen=True)
class UpgradeReport:
    """What an upgrade did: the runs now on the target version, in the order they moved, and
    each run it left where it was with the reason."""

    upgraded: list[uuid.UUID]
    refused: dict[uuid.UUID, str]


def carries_over(error: str) -> bool:
    """Whether a dead run's error says its version is not deployed or drifted: a requeue would
    only die again, a carry over to a deployed version may go on."""
    return bool(CARRIED_OVER_REASON.search(error or ""))


class _Row(NamedTuple):
    """A locked candidate, as a batch reads it."""

    pk: uuid.UUID
    status: str
    waiting_for: str
    fingerprint: str
    model: str
    last_seq: int
    fork_seq: int | None
    error: str


_ROW_FIELDS = _Row._fields


@dataclasses.dataclass(frozen=True)
class Sent:
    """What a run's version sent, against the target, as far as this process can tell."""

    # The parameters signed thinking binds that the target sends differently (in words).
    changed: tuple[str, ...]
    # The tools whose declaration (effect class, input schema) differs between the two, or
    # that only one of them has; None: the run's version's tools are not known here.
    differing: frozenset[str] | None


class _Raced(Exception):
    """A batch's UPDATE found fewer rows than it locked: rolled back, its runs refused."""


@dataclasses.dataclass
class Upgrade:
    """One call of ``upgrade``: the agent, the two versions, what is known of each."""

    agent: str
    from_version: str
    to_version: str
    carry_over: bool = False
    user: Any = None
    target: Agent = dataclasses.field(init=False)
    pinned: Agent | None = dataclasses.field(init=False)
    records: list[AgentVersion] = dataclasses.field(init=False)
    _sent: dict[tuple[str, str], Sent] = dataclasses.field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.target = registry.get(self.agent, self.to_version)
        try:
            self.pinned = registry.get(self.agent, self.from_version)
        except AgentNotFound:
            self.pinned = None
        self.records = list(
            AgentVersion.objects.filter(agent=self.agent, version=self.from_version).order_by(
                "-last_defined_at", "-pk"
            )
        )

    # -- what moves ----------------------------------------------------------------------

    def movable(self) -> Q:
        """The runs of the agent's version that this call may move: those in flight, or, for
        a carry over, the dead ones."""
        of_version = Q(agent=self.agent, prompt_version=self.from_version)
        if self.carry_over:
            return of_version & Q(status=RunStatus.DEAD)
        return of_version & (
            Q(status__in=(RunStatus.PENDING, RunStatus.WAITING))
            | Q(status=RunStatus.RUNNING, lease_until__isnull=True)
            | Q(status=RunStatus.RUNNING, lease_until__lt=Now())
        )

    def pages(self, run_ids: Sequence[uuid.UUID] | None) -> Iterator[list[uuid.UUID]]:
        """The candidates, BATCH at a time: the ids given, or the movable runs by id."""
        if run_ids is not None:
            for start in range(0, len(run_ids), BATCH):
                yield list(run_ids[start : start + BATCH])
            return
        after: uuid.UUID | None = None
        candidates = AgentRun.objects.filter(self.movable())
        if self.carry_over:
            words = Q()
            for word in CARRIED_OVER_WORDS:
                words |= Q(error__contains=word)
            candidates = candidates.filter(words)
        while True:
            found = candidates
            if after is not None:
                found = found.filter(pk__gt=after)
            ids = list(found.order_by("pk").values_list("pk", flat=True)[:BATCH])
            if not ids:
                return
            yield ids
            after = ids[-1]

    # -- what the run's version sent -------------------------------------------------------

    def sent(self, fingerprint: str, model: str) -> Sent:
        """``Sent`` for runs of ``from_version`` started with ``fingerprint`` on ``model``."""
        key = (fingerprint, model)
        found = self._sent.get(key)
        if found is None:
            found = self._sent[key] = self._compare(fingerprint, model)
        return found

    def _compare(self, fingerprint: str, model: str) -> Sent:
        target_tools: dict[str, str] = self.target.digests()["tools"]
        pinned = self.pinned
        if pinned is not None and pinned.fingerprint(model) == fingerprint:
            before, after = pinned.request_for(model), self.target.request_for(model)
            changed = tuple(
                name for param, name in PARAM_NAMES.items() if before.get(param) != after.get(param)
            )
            return Sent(changed, _differing(pinned.digests()["tools"], target_tools))
        record = self._record(fingerprint, model)
        if record is None:
            defined = "defines it otherwise" if pinned is not None else "does not define it"
            return Sent(
                (
                    f"system prompt and tools (what version {self.from_version!r} sent is not "
                    f"known here: this process {defined}, and no worker recorded the "
                    "definition the run started with)",
                ),
                None,
            )
        same = record.binding == self.target.digests()["binding"]
        changed = () if same else ("system prompt or tools",)
        tools = record.tools if isinstance(record.tools, dict) else None
        return Sent(changed, None if tools is None else _differing(tools, target_tools))

    def _record(self, fingerprint: str, model: str) -> AgentVersion | None:
        """The agent_version row of the run's definition: its fingerprint's; for a run started
        on another model than the version's own (whose fingerprint no row holds), the newest
        row of the version (system prompt and tools do not depend on the model)."""
        for record in self.records:
            if record.fingerprint == fingerprint:
                return record
        if self.records and self.records[0].model != model:
            return self.records[0]
        return None

    # -- a batch -----------------------------------------------------------------------------

    def run_batch(self, ids: list[uuid.UUID], report: UpgradeReport) -> list[uuid.UUID]:
        """Lock, judge and move one batch in one transaction; returns the runs it moved."""
        refused: dict[uuid.UUID, str] = {}
        try:
            with transaction.atomic():
                locked = list(
                    AgentRun.objects.select_for_update(skip_locked=True, no_key=True)
                    .filter(self.movable(), pk__in=ids)
                    .order_by()
                    .values_list(*_ROW_FIELDS)
                )
                rows = [_Row(*row) for row in locked]
                seen = {row.pk for row in rows}
                refused.update(self._not_movable([pk for pk in ids if pk not in seen]))
                refused.update(Judge(self, rows).refusals())
                moving = [row for row in rows if row.pk not in refused]
                if moving:
                    self._move(moving)
        except _Raced:
            moving = []
            for pk in ids:
                if pk not in refused:
                    refused[pk] = "busy: its row changed while it was upgraded, try again"
        moved = [row.pk for row in moving]
        report.upgraded.extend(moved)
        for pk in ids:
            if pk in refused:
                report.refused[pk] = refused[pk]
        return moved

    def _not_movable(self, ids: list[uuid.UUID]) -> dict[uuid.UUID, str]:
        """Why each of ``ids`` was not locked: what it is, read now (without a lock)."""
        if not ids:
            return {}
        live = ExpressionWrapper(Q(lease_until__gte=Now()), output_field=BooleanField())
        rows = {
            pk: (agent, version, status, owner, until, held)
            for pk, agent, version, status, owner, until, held in AgentRun.objects.filter(
                pk__in=ids
            )
            .annotate(held=live)
            .order_by()
            .values_list(
                "pk", "agent", "prompt_version", "status", "lease_owner", "lease_until", "held"
            )
        }
        reasons = {}
        for pk in ids:
            found = rows.get(pk)
            reasons[pk] = "there is no run with this id" if found is None else self._why_not(*found)
        return reasons

    def _why_not(
        self,
        agent: str,
        version: str,
        status: str,
        owner: str | None,
        until: datetime.datetime | None,
        held: bool | None,
    ) -> str:
        if agent != self.agent:
            return f"it is a run of agent {storable_text(agent, 200)!r}, not {self.agent!r}"
        if version != self.from_version:
            return (
                f"it is on version {storable_text(version, 200)!r}, not {self.from_version!r} "
                "(upgraded already, or never on it)"
            )
        if self.carry_over:
            if status == RunStatus.DEAD:
                return "busy: a worker or a person is changing it, try again"
            return (
                f"it is {status}, not dead: a carry over moves dead runs (upgrade_runs moves "
                "runs in flight)"
            )
        if status == RunStatus.DEAD:
            return (
                "it is dead: carry it over instead (the dead letter offers it when its version "
                "is not deployed or drifted), or requeue it"
            )
        if status not in (RunStatus.PENDING, RunStatus.WAITING, RunStatus.RUNNING):
            return f"it is {status}: only runs in flight (pending, waiting, running) are upgraded"
        if status == RunStatus.RUNNING and held:
            at = until.isoformat(timespec="seconds") if until is not None else "?"
            return (
                f"held by worker {storable_text(owner or '?', 200)!r} (its lease runs until "
                f"{at}): let that worker finish or stop it first, then upgrade again"
            )
        return "busy: a worker is claiming it, try again"

    def _move(self, rows: list[_Row]) -> None:
        """The batch's one UPDATE (its rows are locked), fenced again on agent, version,
        status and lease; ``_Raced`` when it finds fewer rows than it should."""
        prints = {row.model: self.target.fingerprint(row.model) for row in rows}
        running = Q(status=RunStatus.RUNNING)
        pending = Q(status=RunStatus.PENDING)
        changes: dict[str, Any] = {
            "prompt_version": self.to_version,
            "fingerprint": Case(
                *(When(model=model, then=Value(fp)) for model, fp in prints.items()),
                default=F("fingerprint"),
            ),
            "waiting_for": Case(
                When(waiting_for__in=(WaitKind.WORKER, WaitKind.BATCH), then=Value("")),
                default=F("waiting_for"),
            ),
            "updated_at": Now(),
        }
        if self.carry_over:
            changes.update(
                status=RunStatus.PENDING,
                dead_cause="",
                stalled_claims=0,
                lease_owner=None,
                lease_until=None,
                finished_at=None,
            )
        else:
            # A running run whose lease expired is handed back: the fence of the worker that
            # held it (owner, attempt, running) fails from now on, and a claim takes it anew.
            for_worker = Q(
                status=RunStatus.WAITING, waiting_for__in=(WaitKind.WORKER, WaitKind.BATCH)
            )
            changes.update(
                # A run waiting for a worker that defines its old version is claimable at
                # once (the trigger on agent_run tells the workers that it became pending).
                # So is a run whose turn waits in a batch: that request was the old version's;
                # the run asks again as the new one, and the old answer is paid, not used.
                status=Case(
                    When(running | for_worker, then=Value(RunStatus.PENDING)),
                    default=F("status"),
                ),
                lease_owner=Case(When(running, then=Value(None)), default=F("lease_owner")),
                lease_until=Case(
                    When(running | (pending & ~Q(waiting_for__in=KEPT_HOLDS)), then=Value(None)),
                    default=F("lease_until"),
                ),
            )
        moved = (
            AgentRun.objects.filter(self.movable(), pk__in=[row.pk for row in rows])
            .order_by()
            .update(**changes)
        )
        if moved != len(rows):
            raise _Raced

    # -- after each batch ----------------------------------------------------------------

    def audit(self, moved: list[uuid.UUID]) -> None:
        """The record of each run moved: the ``run_upgraded`` signal and a log line."""
        who = _who(self.user)
        what = "carried over from the dead letter" if self.carry_over else "upgraded"
        for run_id in moved:
            with bind_run(run_id):
                logger.info(
                    "run %s %s: agent %s version %s -> %s, by %s",
                    run_id,
                    what,
                    self.agent,
                    self.from_version,
                    self.to_version,
                    who,
                )
            signals.run_upgraded.send(
                sender=AgentRun,
                run_id=run_id,
                agent=self.agent,
                from_version=self.from_version,
                to_version=self.to_version,
                carried_over=self.carry_over,
                user=self.user,
            )


def _differing(before: dict[str, Any], after: dict[str, Any]) -> frozenset[str]:
    return frozenset(name for name in {*before, *after} if before.get(name) != after.get(name))


def _who(user: Any) -> str:
    if user is None:
        return "code (no user)"
    name = getattr(user, "get_username", None)
    return storable_text(name() if callable(name) else str(user), 200)


class Judge:
    """The refusals of a batch's locked runs, from what they committed: their intents (one
    query), their last steps (one query, only for runs whose tools differ or are unknown) and
    their logs' model turns (one query, only for runs whose binding changed)."""

    def __init__(self, upgrade: Upgrade, rows: list[_Row]) -> None:
        self.upgrade = upgrade
        self.rows = rows
        self.refused: dict[uuid.UUID, str] = {}

    def refusals(self) -> dict[uuid.UUID, str]:
        if not self.rows:
            return {}
        if self.upgrade.carry_over:
            for row in self.rows:
                if not carries_over(row.error):
                    self.refused[row.pk] = (
                        "it did not die of an undeployed version or drift (its reason: "
                        f"{storable_text(error_reason(row.error), 200)!r}): requeue it instead"
                    )
        self._intents()
        # Hook: a run whose turn waits in a Message Batch (sent with its version's request) is
        # to be refused here once runs can wait for batched turns.
        self._last_turns()
        self._thinking()
        return self.refused

    def _open(self, want: Callable[[Sent], bool]) -> list[_Row]:
        return [
            row
            for row in self.rows
            if row.pk not in self.refused and want(self.upgrade.sent(row.fingerprint, row.model))
        ]

    def _intents(self) -> None:
        intents = (
            ToolIntent.objects.filter(
                run_id__in=[row.pk for row in self.rows if row.pk not in self.refused],
                status__in=HOLDING_INTENTS,
            )
            .order_by("run_id", "seq", "call_index")
            .values_list("run_id", "pk", "tool", "seq", "call_index", "status")
        )
        for run_id, pk, tool, seq, index, status in intents:
            if run_id in self.refused:
                continue
            what = INTENT_REASONS[str(status)]
            self.refused[run_id] = (
                f"intent {pk} ({storable_text(tool, 200)}, call {index} of step {seq}) {what}"
            )

    def _last_turns(self) -> None:
        """A run's calls still to make (its last step is a model turn asking for tools) run
        on the target's tools: each must be declared there as the run's version declared it."""
        rows = self._open(lambda sent: sent.differing is None or bool(sent.differing))
        if not rows:
            return
        last = {row.pk: row.last_seq for row in rows}
        logs = _model_turns(rows, seqs=set(last.values()))
        target = self.upgrade.to_version
        for row in rows:
            turn = next((step for step in logs.get(row.pk, ()) if step[0] == row.last_seq), None)
            if turn is None:
                continue  # its last step is the task or tool results: no call pending
            names = _tool_names(turn)
            if not names:
                continue
            differing = self.upgrade.sent(row.fingerprint, row.model).differing
            where = f"step {row.last_seq} (a model turn) asks for"
            if differing is None:
                self.refused[row.pk] = (
                    f"{where} {', '.join(repr(n) for n in names)}, and the tools version "
                    f"{self.upgrade.from_version!r} declared are not known here (no worker "
                    "recorded the definition the run started with): version "
                    f"{target!r} might run them differently"
                )
                continue
            for name in names:
                if name not in differing:
                    continue
                if name not in self.upgrade.target.tools_by_name:
                    why = f"which version {target!r} does not have"
                else:
                    why = (
                        f"which version {target!r} declares with another effect class or "
                        "input schema"
                    )
                self.refused[row.pk] = f"{where} tool {name!r}, {why}"
                break

    def _thinking(self) -> None:
        """Runs whose version sent another system prompt or other tools than the target: their
        logs' signed thinking would be refused by the API."""
        rows = self._open(lambda sent: bool(sent.changed))
        if not rows:
            return
        logs = _model_turns(rows)
        for row in rows:
            bound = bound_in(logs.get(row.pk, ()))
            if bound:
                changed = self.upgrade.sent(row.fingerprint, row.model).changed
                self.refused[row.pk] = _rebinding(changed, bound)


def _rebinding(changed: tuple[str, ...], bound: list[BoundBlock]) -> str:
    more = f" ({len(bound)} such blocks in all)" if len(bound) > 1 else ""
    return (
        f"cannot upgrade onto a different {' and '.join(changed)}: {bound[0]} holds signed "
        "thinking, which is bound to the model, system prompt and tools that produced it (the "
        "API refuses it with 400 Invalid signature). Keep a worker that defines its version, "
        f"or fork it at a step before {bound[0].seq}{more}"
    )


def _tool_names(turn: StepRow) -> list[str]:
    content = loads_deep(turn[2]).get("content") or []
    return list(
        dict.fromkeys(
            str(block.get("name", ""))
            for block in content
            if isinstance(block, dict) and block.get("type") == "tool_use"
        )
    )


def _model_turns(rows: list[_Row], seqs: set[int] | None = None) -> dict[uuid.UUID, list[StepRow]]:
    """The model turns of each run's log up to its last step, in seq order (only those at
    ``seqs`` when given): their own rows and, for forks, the stretches of other runs' logs
    they read. One query for the steps (and one for the stretches, when forks are among
    them)."""
    last = {row.pk: row.last_seq for row in rows}
    forks = [row.pk for row in rows if row.fork_seq is not None]
    shares: dict[uuid.UUID, list[tuple[uuid.UUID, int, int]]] = {}
    if forks:
        for fork, source, lo, hi in SharedSteps.objects.filter(fork_id__in=forks).values_list(
            "fork_id", "source_id", "lo", "hi"
        ):
            shares.setdefault(source, []).append((fork, lo, hi))
    wanted = Q(run_id__in=list(last), part__in=sorted({step_part(pk) for pk in last}))
    for source, stretches in shares.items():
        for _fork, lo, hi in stretches:
            wanted |= Q(run_id=source, part=step_part(source), seq__gte=lo, seq__lt=hi)
    steps = AgentStep.objects.filter(wanted, kind=StepKind.MODEL_TURN)
    if seqs is not None:
        steps = steps.filter(seq__in=sorted(seqs))
    found: dict[uuid.UUID, list[StepRow]] = {}
    for run_id, seq, kind, payload, start, end in steps.order_by().values_list(
        "run_id", "seq", "kind", "payload", "content_start", "content_end"
    ):
        step: StepRow = (seq, kind, payload, start, end)
        owners = [run_id] if run_id in last else []
        owners += [fork for fork, lo, hi in shares.get(run_id, ()) if lo <= seq < hi]
        for owner in owners:
            if seq <= last[owner] and (seqs is None or seq == last[owner]):
                found.setdefault(owner, []).append(step)
    for log in found.values():
        log.sort(key=lambda step: step[0])
    return found


def upgrade(
    agent: str,
    from_version: str,
    to_version: str,
    run_ids: Sequence[uuid.UUID] | None,
    *,
    carry_over: bool = False,
    user: Any = None,
) -> UpgradeReport:
    """Move the runs (``run_ids``, or every movable run of agent@from_version) to
    ``to_version`` where their history allows it, batch by batch; the arguments are checked
    already (``api.upgrade_runs``). Each batch is audited once it committed."""
    job = Upgrade(agent, from_version, to_version, carry_over=carry_over, user=user)
    report = UpgradeReport([], {})
    for ids in job.pages(run_ids):
        job.audit(job.run_batch(ids, report))
    return report


def compared(agent: str, from_version: str, to_version: str) -> Sent | None:
    """What ``to_version`` sends differently from what ``from_version`` sent (as this process
    defines it, else as a worker recorded it), for the admin's choice of a target; None when
    nothing is known of ``from_version``. Runs started with another definition of
    ``from_version`` are judged on their own when they move."""
    job = Upgrade(agent, from_version, to_version)
    if job.pinned is not None:
        return job.sent(job.pinned.fingerprint(), job.pinned.model)
    if job.records:
        return job.sent(job.records[0].fingerprint, job.records[0].model)
    return None
