"""Trees of runs and runs that cannot be read, through the ORM (SQLite and PostgreSQL alike):
a cancel's cascade in bounded batches, the lock a spawn takes on its tree's root, and the
dead letter of a run whose row does not decode. Plain functions; ``PortableStore`` and
``PostgresStore`` call them.

    readable_runs        the runs a claim took, read back; poison ones dead-lettered
    dead_letter_poison   a claimed run whose row does not decode -> dead (fenced)
    cancel_descendants   a cancel's cascade, generation by generation, in batches
    cancel               one batch: runs, their open questions, their pending intents
    lock_tree_root       the root's row lock every spawn in a tree takes first
"""

from __future__ import annotations

import logging
from typing import Any

from django.db import transaction
from django.db.models.functions import Now

from durable_agents.exceptions import StoredValueError
from durable_agents.models import (
    CANCELLABLE_STATUSES,
    AgentQuestion,
    AgentRun,
    IntentStatus,
    QuestionStatus,
    RunStatus,
    ToolIntent,
)
from durable_agents.store.base import RUN_CANCELLED, RunId, ended

logger = logging.getLogger("durable_agents.store")

# Runs a cancel's cascade changes per transaction (``cancel_descendants``): 110,000 runs in
# one transaction held every row lock for 8 s; a batch takes milliseconds.
CANCEL_BATCH = 1000


def readable_runs(ids: list[Any], owner: str) -> tuple[list[AgentRun], list[RunId | None]]:
    """The runs just claimed, in the claim's order, read back; a run whose row cannot be
    decoded (``StoredValueError``) is dead-lettered as poison instead of being returned
    (with its parent, to be told). One such row must not fail the whole claim: it would
    fail every claim of every worker, forever."""
    order = ("-priority", "fair_at", "created_at")
    try:
        return list(AgentRun.objects.filter(pk__in=ids).order_by(*order)), []
    except StoredValueError:
        pass
    runs: list[AgentRun] = []
    poisoned: list[RunId | None] = []
    for run_id in ids:
        try:
            runs.extend(AgentRun.objects.filter(pk=run_id))
        except StoredValueError as exc:
            dead, parent_id = dead_letter_poison(run_id, owner, None, exc)
            if dead:
                poisoned.append(parent_id)
    runs.sort(key=lambda run: (-run.priority, run.fair_at, run.created_at))
    return runs, poisoned


def dead_letter_poison(
    run_id: RunId, owner: str, attempt: int | None, exc: StoredValueError
) -> tuple[bool, RunId | None]:
    """Dead-letter a run that ``owner`` just claimed but whose row cannot be decoded,
    fenced on that claim (and ``attempt``, when known). Returns whether it was, and its
    parent's id: the caller tells the parent (``child_ended``) once its transaction is
    over."""
    reason = f"poison run: {exc}; dead-lettered on claim, since no worker can read it"
    runs = AgentRun.objects.filter(pk=run_id, lease_owner=owner, status=RunStatus.RUNNING)
    if attempt is not None:
        runs = runs.filter(attempt=attempt)
    parent_id = runs.values_list("parent_id", flat=True).first()
    if not runs.update(updated_at=Now(), **ended(RunStatus.DEAD, None, reason), finished_at=Now()):
        return False, None
    logger.error("run %s dead-lettered: %s", run_id, reason)
    return True, parent_id


def cancel_descendants(run_id: RunId) -> int:
    """Cancel the unfinished descendants of ``run_id`` (cancelled already), generation by
    generation, CANCEL_BATCH runs per transaction: a tree of 100,000 runs never holds
    100,000 row locks at once, nor blocks the runs' workers for the whole cascade.

    No child escapes: the children of a run are read only after its cancel committed,
    and a spawn locks its parent and refuses a child of a cancelled one, so a child
    spawned concurrently is either committed before that read (and found) or refused.
    A worker holding a descendant stops at its fence once its batch commits."""
    cancelled = 0
    parents = [run_id]
    while parents:
        batch, parents = parents[:CANCEL_BATCH], parents[CANCEL_BATCH:]
        children = list(
            AgentRun.objects.filter(parent_id__in=batch).order_by().values_list("pk", flat=True)
        )
        for start in range(0, len(children), CANCEL_BATCH):
            with transaction.atomic():
                cancelled += cancel(children[start : start + CANCEL_BATCH])
        parents += children
    return cancelled


def cancel(run_ids: list[Any]) -> int:
    """Cancel the cancellable runs of ``run_ids``, with their open questions and the
    intents that wait for a person's approval (rejected: "run cancelled"), in the
    caller's transaction: nothing is left in a person's queue for a run that is over."""
    if not run_ids:
        return 0
    cancelled = AgentRun.objects.filter(pk__in=run_ids, status__in=CANCELLABLE_STATUSES).update(
        status=RunStatus.CANCELLED,
        dead_cause="",
        lease_owner=None,
        lease_until=None,
        finished_at=Now(),
        updated_at=Now(),
    )
    AgentQuestion.objects.filter(run_id__in=run_ids, status=QuestionStatus.OPEN).update(
        status=QuestionStatus.CANCELLED
    )
    ToolIntent.objects.filter(run_id__in=run_ids, status=IntentStatus.PENDING).update(
        status=IntentStatus.REJECTED,
        reason=RUN_CANCELLED,
        decided_at=Now(),
        updated_at=Now(),
    )
    return cancelled


def lock_tree_root(parent_id: RunId | None) -> RunId | None:
    """The root of the tree a child of ``parent_id`` joins, its row locked (if it is still
    there) before the parent's: every spawn in the tree takes this lock first, so they
    count the tree's runs one at a time and never deadlock with each other or with a
    cancel (which never holds a descendant's lock while it waits for an ancestor's)."""
    if parent_id is None:
        return None
    row = AgentRun.objects.filter(pk=parent_id).values_list("root_id", flat=True).first()
    root_id: RunId = row or parent_id  # root_id never changes: read without a lock
    AgentRun.objects.select_for_update(no_key=True).filter(pk=root_id).values_list(
        "pk", flat=True
    ).first()
    return root_id
