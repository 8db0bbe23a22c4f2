"""A run's inbox (``agent_message``) on the database stores: the messages ``send_message``
queues, and their fold into the log by the worker that holds the run.

Who writes what, and why nothing is lost or delivered twice:

- ``queue_message`` locks the run's row, checks it is in flight and inserts the message, in
  one transaction. The worker's last commit of a run (``append_last_step``) locks the same
  row and looks at the inbox first: a message is either seen by it (the run goes on) or
  refused because the run ended, never accepted by a run that ends without it.
- ``fold_messages`` commits the step that carries them (``Store.append_step``, fenced) and
  marks them folded with that step's seq in the same transaction: only the lease holder folds,
  and a crash before the commit leaves them waiting for the next worker, after it folded once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from django.db import DatabaseError, DataError, IntegrityError, connection, transaction
from django.utils import timezone

from durable_agents._internal import inbox_bell
from durable_agents.exceptions import RunBusy, RunFinished, RunNotFound
from durable_agents.models import AgentMessage, AgentRun, RunStatus

if TYPE_CHECKING:
    from durable_agents.store.base import AuthUser, Claim, NextClaim, RunId, StepWrite, Store

# The statuses of a run that takes messages: it is in flight.
TAKES_MESSAGES = (RunStatus.PENDING, RunStatus.RUNNING, RunStatus.WAITING)
# What ``policy="reject"`` refuses: a run that is working (not parked on a wait).
BUSY = (RunStatus.PENDING, RunStatus.RUNNING)


def refuse(run_id: Any, status: str, *, busy_refused: bool) -> None:
    """The refusal of a run in ``status``, if any: over (``RunFinished``) or, for
    ``policy="reject"``, working (``RunBusy``)."""
    if status not in TAKES_MESSAGES:
        raise RunFinished(
            f"run {run_id} has ended ({status}); start a new run or fork it"
            if status != RunStatus.DEAD
            else f"run {run_id} is dead; requeue it first, or start a new run or fork it"
        )
    if busy_refused and status in BUSY:
        raise RunBusy(f"run {run_id} is working ({status}); policy='reject' refuses the message")


def queue_message(
    run_id: RunId, text: str, key: str | None, user: AuthUser, *, busy_refused: bool
) -> tuple[AgentMessage, bool]:
    """The message queued (True), or the one queued before with ``key`` (False)."""
    with transaction.atomic():
        status = (
            AgentRun.objects.select_for_update(no_key=True)
            .filter(pk=run_id)
            .values_list("status", flat=True)
            .first()
        )
        if status is None:
            raise RunNotFound(f"there is no run {run_id}")
        if key is not None:
            earlier = AgentMessage.objects.filter(run_id=run_id, key=key).first()
            if earlier is not None:
                return earlier, False
        refuse(run_id, status, busy_refused=busy_refused)
        try:
            with transaction.atomic():
                message = AgentMessage.objects.create(
                    run_id=run_id, text=text, key=key, sent_by=user
                )
        except IntegrityError:
            # The same key sent at the same moment (a store whose transactions do not lock
            # the run's row): the first one's message.
            if key is None:
                raise
            return AgentMessage.objects.get(run_id=run_id, key=key), False
        # A worker of this process holding the run folds it at its next model call for
        # certain; the others hear of it by the database's notification (PostgreSQL).
        transaction.on_commit(lambda: inbox_bell.ring(run_id))
    return message, True


def waiting_messages(run_id: RunId) -> list[AgentMessage]:
    return list(AgentMessage.objects.filter(run_id=run_id, folded_seq__isnull=True).order_by("id"))


# The probe before every model call of a run (does a message wait?): one lookup in the partial
# index of waiting messages, written out rather than compiled by the ORM on each call (which
# cost more CPU than the round trip; the SQL is the same on every database). PostgreSQL sends
# its own copy, with a named parameter, as its step commits go out (store/postgres_steps.py).
HAS_WAITING_SQL = "SELECT 1 FROM agent_message WHERE run_id = %s AND folded_seq IS NULL LIMIT 1"


def has_waiting(run_id: RunId) -> bool:
    with connection.cursor() as cursor:
        cursor.execute(HAS_WAITING_SQL, [AgentRun._meta.pk.get_db_prep_value(run_id, connection)])
        return cursor.fetchone() is not None


def fold_messages(store: Store, claim: Claim, step: StepWrite, ids: Sequence[int]) -> bool:
    with transaction.atomic():
        if not store.append_step(claim, step):
            return False
        AgentMessage.objects.filter(
            run_id=claim.run_id, id__in=ids, folded_seq__isnull=True
        ).update(folded_seq=step.seq, folded_at=timezone.now())
        # All folded by this step (or by its first try, when this is a retry after a lost
        # connection whose first try landed); anything else would deliver a message twice.
        here = AgentMessage.objects.filter(run_id=claim.run_id, id__in=ids, folded_seq=step.seq)
        if here.count() != len(ids):
            transaction.set_rollback(True)
            return False
    return True


def append_last_step(
    store: Store, claim: Claim, step: StepWrite, then_claim: NextClaim | None
) -> bool | None:
    try:
        with transaction.atomic():
            store.lock_run_row(claim.run_id)
            if has_waiting(claim.run_id):
                return None
            return store.append_step(claim, step, then_claim)
    except DatabaseError as exc:
        # The database refused the turn: inside this transaction the store's own count of
        # the unstored turn failed too (the transaction was aborted), so it is counted here,
        # after the rollback, and the refusal raised as the store would have raised it.
        refused = exc.__context__
        if isinstance(exc, DataError) or not isinstance(refused, DataError):
            raise
        if step.usage is not None:
            store.count_unstored_turn(claim, step)
        raise refused from None


def finish_unless_messages(
    store: Store, claim: Claim, result: str | None, output: Any
) -> bool | None:
    """``Store.finish_run`` (succeeded) under the run's lock, unless messages wait (None)."""
    with transaction.atomic():
        store.lock_run_row(claim.run_id)
        if has_waiting(claim.run_id):
            return None
        return store.finish_run(claim, RunStatus.SUCCEEDED, result=result, output=output)
