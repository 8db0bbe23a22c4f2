"""Debounced starts through the ORM (``start_run(..., key=, debounce=)``): ``debounce_run``,
a plain function that ``PortableStore`` calls, and ``PostgresStore`` for a first start, a late
one, or a caller's transaction.

The run is created ``waiting`` for a quiet window (``waiting_for="debounce"``) with its
``wake_at`` on the database clock, so the claim's ``due`` part starts it like any due timer:
no polling of its own. A later call with the key pushes the window back with one conditional
UPDATE of the run's row, guarded by ``status='waiting' AND waiting_for='debounce'``; the row
lock it takes orders it against a claim of the run:

- the update first: a claim at that moment skips the locked row (SKIP LOCKED), and once the
  update commits the run is not due any more;
- the claim first: the update waits for it, finds the run running (PostgreSQL re-reads the
  row, READ COMMITTED) and changes nothing; the caller gets the started run as it is.

Step 0, the task no model has seen yet, is rewritten in the same transaction, only when the
guarded update changed the run, while its row lock is held: a claim never reads a task that
does not belong to the run's window. On SQLite the IMMEDIATE transaction makes all of it one
exclusive step anyway.
"""

from __future__ import annotations

import datetime
from typing import Any

from django.db import transaction
from django.db.models import DateTimeField, ExpressionWrapper
from django.db.models.expressions import CombinedExpression
from django.db.models.functions import Now

from durable_agents.models import AgentRun, AgentStep, ConcurrencyKey, RunStatus, StepKind, WaitKind
from durable_agents.store.portable_runs import insert_run

# What a later call within the window replaces, besides the task's step: everything that
# ``start_run`` derives from the call (the run has not started, so nothing was pinned yet).
DEBOUNCED_FIELDS = (
    "task",
    "prompt_version",
    "model",
    "fingerprint",
    "priority",
    "concurrency_key",
    "concurrency_limit",
    "trace_context",
    "metadata",
    "batch",
)


def window_end(seconds: float) -> ExpressionWrapper[CombinedExpression]:
    """Now plus ``seconds`` on the database clock: when a window that starts now ends."""
    return ExpressionWrapper(
        Now() + datetime.timedelta(seconds=seconds), output_field=DateTimeField()
    )


def debouncing(pk: Any) -> Any:
    """The run ``pk``, only while it still waits for its quiet window (the guard)."""
    return AgentRun.objects.filter(
        pk=pk, status=RunStatus.WAITING, waiting_for=WaitKind.DEBOUNCE
    ).order_by()


def debounce_run(run: AgentRun, task_payload: str, seconds: float) -> AgentRun:
    """``Store.debounce_run`` through the ORM: the run inserted waiting for its window, or
    the window of the run of its key pushed back (``push``), in one transaction."""
    assert run.start_key is not None, "a debounced start has a start key"
    with transaction.atomic():
        run.status = RunStatus.WAITING
        run.waiting_for = WaitKind.DEBOUNCE
        run.waiting_since = Now()
        run.wake_at = window_end(seconds)
        started = insert_run(run)
        if started is None:
            AgentStep.objects.create(run=run, seq=0, kind=StepKind.TASK, payload=task_payload)
            run.refresh_from_db()
            return run
        push(started.pk, run, task_payload, seconds)
    return AgentRun.objects.get(pk=started.pk)


def push(pk: Any, run: AgentRun, task_payload: str, seconds: float) -> bool:
    """The window of the debouncing run ``pk`` starts again now, with ``run``'s task and
    settings; False (nothing changed) once the run has started or ended."""
    if run.concurrency_key is not None:
        # A claim admits a keyed run only through its key's row: a key new to this run
        # may be new to the database too.
        ConcurrencyKey.objects.get_or_create(key=run.concurrency_key)
    pushed = debouncing(pk).update(
        wake_at=window_end(seconds),
        # The window's start, as the admin shows it: waiting for quiet since the last call.
        waiting_since=Now(),
        updated_at=Now(),
        **{name: getattr(run, name) for name in DEBOUNCED_FIELDS},
    )
    if not pushed:
        return False
    AgentStep.objects.filter(run_id=pk, seq=0, kind=StepKind.TASK).update(payload=task_payload)
    return True
