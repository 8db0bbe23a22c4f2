"""Callbacks through the ORM: a service's POST to a call's signed URL (``Wait(callback=True)``).
``PortableStore`` and ``PostgresStore`` are these (one short transaction each, on any database).

    receive_callback    the body stored once per call; the run waiting on it -> pending
    received_callback   the body a call received, for the woken call

Single use is the unique key of ``agent_callback`` inserted under the run's lock: two POSTs of
one URL serialise on the run's row (FOR NO KEY UPDATE on PostgreSQL; SQLite's IMMEDIATE
transaction is exclusive), and the second finds the first's row. The wake is one conditional
UPDATE (the run still waiting, on a callback, of this call), so a timeout that claimed the run
meanwhile, or a cancel, leaves nothing to move.
"""

from __future__ import annotations

from typing import Any

from django.db import IntegrityError, transaction
from django.db.models.functions import Now

from durable_agents.models import (
    FINISHED_STATUSES,
    AgentCallback,
    AgentRun,
    RunStatus,
    ToolEffect,
    WaitKind,
)
from durable_agents.store.base import CallbackReceipt, RunId


def receive_callback(run_id: RunId, key: str, body: Any) -> CallbackReceipt:
    """``Store.receive_callback``."""
    with transaction.atomic():
        # The run's row first, as park_on_wait locks it: whichever of the park and this POST
        # commits second sees the other's work.
        status = (
            AgentRun.objects.select_for_update(no_key=True)
            .filter(pk=run_id)
            .values_list("status", flat=True)
            .first()
        )
        if status is None or status in FINISHED_STATUSES:
            return CallbackReceipt.OVER
        if AgentCallback.objects.filter(key=key).exists():
            return CallbackReceipt.USED
        if ToolEffect.objects.filter(key=key).exists():
            return CallbackReceipt.OVER  # the call returned (after a timeout, say)
        try:
            with transaction.atomic():  # a savepoint: the unique key is the last word
                received = AgentCallback.objects.create(run_id=run_id, key=key, body=body)
        except IntegrityError:
            return CallbackReceipt.USED
        received.refresh_from_db(fields=["received_at"])
        woken = AgentRun.objects.filter(
            pk=run_id, status=RunStatus.WAITING, waiting_for=WaitKind.CALLBACK, wait_key=key
        ).update(
            status=RunStatus.PENDING,
            woken_by=received.wake_reference(),
            wake_at=None,
            updated_at=Now(),
        )
    return CallbackReceipt.WOKEN if woken else CallbackReceipt.KEPT


def received_callback(key: str) -> AgentCallback | None:
    """``Store.received_callback``."""
    return AgentCallback.objects.filter(key=key).first()
