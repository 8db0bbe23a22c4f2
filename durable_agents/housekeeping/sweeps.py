"""Periodic housekeeping: the retired-model / undeployed-prompt sweep, retention, metrics.

Each task is a plain function: django-q2 schedules them (``manage.py durable_agents_schedules``),
and ``manage.py durable_agents_housekeeping`` runs them from cron or a Kubernetes CronJob
instead. The worker never depends on them to be correct: it claims only runs of the agent
versions it defines, and hands back one whose definition differs. The sweep dead-letters a run
whose version no live worker has defined for UNDEPLOYED_GRACE (what agent_worker and
agent_version say, never what this process defines). Parents
left waiting by a worker that died between a child's end and the parent's wake are woken by
the sweep, and by every worker when it starts.
"""

from __future__ import annotations

import datetime
import logging
import threading
from typing import Any

from django.core.exceptions import ValidationError
from django.db import DatabaseError, DataError, transaction
from django.db.models.functions import Now
from django.utils import timezone
from django.utils.module_loading import import_string

from durable_agents import signals, webhooks
from durable_agents._internal.text import storable_text
from durable_agents.conf import app_settings
from durable_agents.engine import services as worker_services
from durable_agents.exceptions import StoredValueError
from durable_agents.flow import budgets
from durable_agents.forks import planning as forks
from durable_agents.housekeeping import metrics
from durable_agents.housekeeping.step_log import step_log
from durable_agents.models import (
    FINISHED_STATUSES,
    WORKER_ROWS_KEPT,
    AgentEvent,
    AgentRun,
    AgentVersion,
    AgentWorker,
    CapacityEvent,
    MetricsSnapshot,
    RunStatus,
    WaitKind,
)
from durable_agents.models.workers import versions_seen
from durable_agents.store import Store, current
from durable_agents.store.base import RunId

logger = logging.getLogger("durable_agents.housekeeping")
# What a worker logs as it starts (``StrandedParents``) is the worker's.
worker_logger = logging.getLogger("durable_agents.worker")


def _dead_letter(queryset: Any, reason: str) -> int:
    """Dead-letter the runs of ``queryset`` that no worker holds (``Store.dead_letter``): a
    held run is left to its worker, which checks the same things before its next model call."""
    store = current()
    moved = 0
    for run_id in list(queryset.values_list("pk", flat=True)):
        if store.dead_letter(run_id, reason):
            moved += 1
            logger.warning("run %s dead-lettered by the sweep: %s", run_id, reason)
            signals.run_dead_lettered.send(sender=AgentRun, run_id=run_id, reason=reason)
    return moved


def sweep() -> dict[str, int]:
    """Dead-letter active runs pinned to a retired model, or to an agent version no live
    worker has defined for UNDEPLOYED_GRACE, with a reason a person can act on; and the rest
    of the periodic chores (stranded parents, cascades, budgets, capacity events, step
    partitions ahead, rows of workers long gone)."""
    active = AgentRun.objects.not_leased()
    moved = {
        "retired_model": 0,
        "undeployed_prompt": 0,
        "parents_woken": wake_stranded_parents(),
        "cascades_finished": finish_cancel_cascades(),
        "budget_woken": wake_budget_waiters(),
        "capacity_events_pruned": prune_capacity_events(),
        # The step log's days ahead (PostgreSQL): a day without its partition would have its
        # steps kept in the default partition.
        "step_partitions_made": len(step_log().make_days_ahead()),
    }
    for model in app_settings.RETIRED_MODELS:
        moved["retired_model"] += _dead_letter(
            active.filter(model=model),
            f"model {model!r} is retired (DURABLE_AGENTS['RETIRED_MODELS']); its thinking "
            "blocks cannot be continued by another model. Cancel the run, or start it again.",
        )
    moved["undeployed_prompt"] = dead_letter_undeployed(active)
    moved["workers_aged_out"] = age_out_workers()
    return moved


def dead_letter_undeployed(active: Any, now: datetime.datetime | None = None) -> int:
    """Dead-letter the unleased runs of an agent version that no live worker has defined for
    UNDEPLOYED_GRACE (from the last time one did, or from the run's creation when none ever
    did): never because this process lacks the version, since another deploy may define it."""
    now = now or timezone.now()
    grace = datetime.timedelta(seconds=float(app_settings.UNDEPLOYED_GRACE))
    seen = versions_seen(now)
    moved = 0
    pinned = active.order_by().values_list("agent", "prompt_version").distinct()
    for agent, version in pinned:
        known = seen.get((agent, version))
        if known is not None and known.live_workers:
            continue
        cutoff = now - grace
        if known is not None and known.last_defined_at is not None:
            if known.last_defined_at > cutoff:
                continue
            since = f"since {known.last_defined_at:%Y-%m-%d %H:%M %Z}"
        else:
            since = "ever"
        moved += _dead_letter(
            active.filter(agent=agent, prompt_version=version, created_at__lt=cutoff),
            f"agent version {agent}@{version} has not been defined by any live worker {since} "
            f"(UNDEPLOYED_GRACE is {_duration(grace)}): deploy it again, or upgrade the run to "
            "another version, or cancel it",
        )
    return moved


def age_out_workers(now: datetime.datetime | None = None) -> int:
    """Remove the rows of workers gone for WORKER_ROWS_KEPT (killed: a clean stop removes its
    own), recording in agent_version that their versions were defined until their last beat."""
    cutoff = (now or timezone.now()) - WORKER_ROWS_KEPT
    removed = 0
    for worker in AgentWorker.objects.filter(alive_until__lt=cutoff):
        with transaction.atomic():
            for defined in worker.defined():
                AgentVersion.objects.filter(
                    agent=defined.get("agent"),
                    version=defined.get("version"),
                    fingerprint=defined.get("fingerprint"),
                    last_defined_at__lt=worker.beat_at,
                ).update(last_defined_at=worker.beat_at)
            removed += AgentWorker.objects.filter(
                pk=worker.pk, alive_until=worker.alive_until
            ).delete()[0]
    return removed


def _duration(delta: datetime.timedelta) -> str:
    seconds = delta.total_seconds()
    if seconds >= 86400 and seconds % 86400 == 0:
        return f"{seconds / 86400:g} days"
    if seconds >= 3600:
        return f"{seconds / 3600:g} hours"
    return f"{seconds:g} s"


# How long the record of 429s, 529s and pauses is kept (the capacity page shows the last hour).
CAPACITY_EVENTS_KEPT = datetime.timedelta(days=7)


def prune_capacity_events(now: datetime.datetime | None = None) -> int:
    """Delete the 429s, 529s and pauses recorded more than a week ago."""
    cutoff = (now or timezone.now()) - CAPACITY_EVENTS_KEPT
    deleted, _ = CapacityEvent.objects.filter(at__lt=cutoff).delete()
    return deleted


def wake_budget_waiters(limit: int = 1000) -> int:
    """Hand back the runs that wait for their key's budget when the key has room again: a
    budget raised in BUDGETS by a deploy (one raised with ``set_key_budget`` wakes them at
    once, and the next UTC day ends every such wait by itself)."""
    store = current()
    waiting = AgentRun.objects.filter(status=RunStatus.PENDING, waiting_for=WaitKind.BUDGET)
    keys = (
        waiting.filter(lease_until__gt=Now())
        .exclude(concurrency_key=None)
        .order_by()
        .values_list("concurrency_key", flat=True)
        .distinct()[:limit]
    )
    woken = 0
    for key in keys:
        if key is None:
            continue
        spent, override = store.spent_today(key)
        budget = budgets.in_force(key, override)
        if budget is None or spent < budget:
            woken += waiting.filter(concurrency_key=key).update(lease_until=None, updated_at=Now())
    if woken:
        logger.info("%d runs waiting for their key's budget handed back: it has room", woken)
    return woken


def wake_stranded_parents(limit: int = 1000, store: Store | None = None) -> int:
    """Wake the runs that wait on child runs which have all ended. A child's end wakes its
    parent right after its own commit; a worker that died in between leaves the parent
    waiting, and this finds it (``Store.wake_parent`` is a no-op for any other parent)."""
    store = store or current()
    woken = 0
    for run_id in store.stranded_parents(limit):
        try:
            if store.wake_parent(run_id):
                woken += 1
                logger.warning("run %s: its child runs had all ended; woken by the sweep", run_id)
        except POISON_ERRORS as exc:
            # One run whose wait cannot be read (ids that are not run ids, undecodable JSON)
            # must not stop the sweep, nor a worker starting with it: it is dead-lettered.
            _dead_letter_poison(store, run_id, exc)
    return woken


# What a run's own bad row raises when read: a stored value that does not decode, a run id
# that is not one (ValidationError), a value of the wrong shape, a value the database refuses.
POISON_ERRORS = (StoredValueError, ValidationError, ValueError, TypeError, DataError)


def _dead_letter_poison(store: Store, run_id: RunId, exc: Exception) -> None:
    problem = storable_text(" ".join(str(exc).split()), StoredValueError.MAX_PROBLEM)
    reason = f"poison run: its wait on child runs cannot be read ({type(exc).__name__}: {problem})"
    if store.dead_letter(run_id, reason):
        logger.error("run %s dead-lettered by the sweep: %s", run_id, reason)
        signals.run_dead_lettered.send(sender=AgentRun, run_id=run_id, reason=reason)
    else:
        logger.error("run %s: %s (left as it is: a worker holds it)", run_id, reason)


def finish_cancel_cascades(limit: int = 1000) -> int:
    """Cancel the active runs whose parent is cancelled: a cancel reaches a big tree's
    descendants in batches, one transaction each, after the run itself; a process that died
    in the middle of that leaves the rest active, and this finishes the cascade."""
    store = current()
    orphans = list(
        AgentRun.objects.active()
        .filter(parent__status=RunStatus.CANCELLED)
        .order_by()
        .values_list("pk", flat=True)[:limit]
    )
    cancelled = sum(1 for run_id in orphans if store.cancel_run(run_id))
    if cancelled:
        logger.warning("%d runs of cancelled parents cancelled by the sweep", cancelled)
    return cancelled


def apply_retention(now: datetime.datetime | None = None) -> int:
    """Delete (after archiving, if an archiver is set) finished runs older than
    RETENTION_DAYS, in batches. Their steps, effects and intents go with them: an effect's
    key belongs to its run, so no other run can ever need it. Steps a fork shares are copied
    into that fork first. Dead runs are kept: they wait for a person."""
    days = app_settings.RETENTION_DAYS
    if days is None:
        return 0
    cutoff = (now or timezone.now()) - datetime.timedelta(days=days)
    archiver = import_string(app_settings.ARCHIVER) if app_settings.ARCHIVER else None
    log = step_log()
    # Days whose steps go as one partition once their runs are deleted (PostgreSQL); the
    # steps of every other run are deleted with it, row by row.
    dropping = log.droppable_days(cutoff)
    deleted = 0
    while True:
        with transaction.atomic():
            batch = list(
                AgentRun.objects.filter(status__in=FINISHED_STATUSES, finished_at__lt=cutoff)
                .order_by("finished_at")
                .values_list("pk", flat=True)[: app_settings.RETENTION_BATCH]
            )
            if not batch:
                break
            # A fork outside the batch that reads steps of a run in it gets them copied in
            # first, so that deleting what it was forked from never breaks its log.
            forks.keep_shared_steps(batch)
            if archiver is not None:
                archiver(AgentRun.objects.filter(pk__in=batch))
            log.delete_steps(batch, dropping)
            AgentRun.objects.filter(pk__in=batch).delete()
        deleted += len(batch)
    log.drop_days(dropping)
    if deleted:
        logger.info("retention deleted %d finished runs older than %s", deleted, cutoff)
    events = _expire_events(cutoff)
    if events:
        logger.info("retention deleted %d events older than %s", events, cutoff)
    return deleted


def _expire_events(cutoff: datetime.datetime) -> int:
    """Events created before ``cutoff`` that no run waits on. A run that waits on such a name
    later waits for a new send: retention is the one place an event is forgotten."""
    waited = AgentRun.objects.filter(status=RunStatus.WAITING, waiting_for=WaitKind.EVENT).values(
        "wait_event"
    )
    deleted, _ = AgentEvent.objects.filter(created_at__lt=cutoff).exclude(name__in=waited).delete()
    return deleted


def snapshot_metrics() -> int:
    snapshot = MetricsSnapshot.objects.create(data=metrics.collect())
    MetricsSnapshot.objects.filter(
        taken_at__lt=timezone.now() - datetime.timedelta(days=app_settings.METRICS_KEEP_DAYS)
    ).delete()
    return snapshot.pk


def deliver_webhooks(now: datetime.datetime | None = None) -> dict[str, int]:
    """The webhook deliveries whose next attempt is due, attempted here (a batch each pass:
    this task's time, not a worker's), and those delivered or failed for WEBHOOK_KEEP_DAYS
    deleted."""
    return {"attempted": webhooks.retry_due(now), "pruned": webhooks.prune(now)}


# The django-q2 schedules: (name, function path, minutes between runs).
SCHEDULES = [
    ("durable_agents: sweep", "durable_agents.housekeeping.sweep", 5),
    ("durable_agents: retention", "durable_agents.housekeeping.apply_retention", 60),
    ("durable_agents: metrics", "durable_agents.housekeeping.snapshot_metrics", 5),
    ("durable_agents: webhooks", "durable_agents.housekeeping.deliver_webhooks", 1),
]


class StrandedParents(worker_services.WorkerService):
    """A worker that died between a child run's end and the wake of its parent left the
    parent waiting: every worker repairs that when it starts (housekeeping does too)."""

    def starting(self, worker: Any) -> None:
        try:
            woken = wake_stranded_parents(store=worker.store)
        except DatabaseError:
            worker_logger.warning("worker %s: waking stranded parent runs failed", worker.worker_id)
            return
        except Exception:
            worker_logger.exception(
                "worker %s: waking stranded parent runs failed", worker.worker_id
            )
            return
        finally:
            worker.connections.release()
        if woken:
            worker_logger.info("worker %s woke %d stranded parent run(s)", worker.worker_id, woken)


worker_services.register("durable_agents.housekeeping.sweeps", StrandedParents())


# How often a worker makes the step log's days ahead again while it runs (a worker that runs
# for weeks without housekeeping would otherwise write its steps to the default partition).
STEP_PARTITIONS_EVERY_SECONDS = 3600.0


class StepPartitionsAhead(worker_services.WorkerService):
    """Every worker makes the step log's days ahead when it starts and every hour while it
    runs (housekeeping's sweep does too): a fleet without django-q2 still has its partitions."""

    def starting(self, worker: Any) -> None:
        self._make(worker)

    def start(self, worker: Any) -> threading.Thread | None:
        if not (worker.store or current()).partitions_steps:
            return None  # nothing to make: the store keeps one table

        def serve() -> None:
            try:
                while not worker.stopping.wait(STEP_PARTITIONS_EVERY_SECONDS):
                    self._make(worker)
            finally:
                worker.connections.close()

        thread = threading.Thread(target=serve, name="da-step-partitions", daemon=True)
        thread.start()
        return thread

    @staticmethod
    def _make(worker: Any) -> None:
        try:
            made = (worker.store or current()).make_step_partitions()
        except DatabaseError:
            worker_logger.warning(
                "worker %s: making the step log's days ahead failed", worker.worker_id
            )
            return
        finally:
            worker.connections.release()
        if made:
            worker_logger.info("worker %s made step partitions %s", worker.worker_id, made)


worker_services.register("durable_agents.housekeeping.step_partitions", StepPartitionsAhead())
