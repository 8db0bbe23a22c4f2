"""``agent_batch`` and ``agent_batch_request``: model turns sent through the Message Batches
API at half the price, for runs that can wait (``Agent(batch=True)``, ``start_run(batch=True)``).

A run in batches that needs a model turn does not call the model: it records the request (an
``AgentBatchRequest``, the exact body it would have sent) and waits (``WaitKind.BATCH``), holding
no worker slot and no connection. The fleet's submitter puts waiting requests into a batch (an
``AgentBatch``); a poller retrieves each batch until it has ended and commits each answer as the
run's next step, byte for byte, fenced on the run still waiting on that request. The flow and its
guarantees are in ``durable_agents/batches/__init__.py``."""

from __future__ import annotations

from decimal import Decimal
from typing import ClassVar

from django.db import models
from django.db.models.functions import Now
from django.utils.translation import gettext_lazy as _

from durable_agents.models.fields import EncryptedTextField
from durable_agents.models.runs import AgentRun


class BatchStatus(models.TextChoices):
    # Rows for the batch are taken and its create call is in flight (or its worker died in
    # that window: the requests go back to waiting once ``owner_until`` has passed).
    SUBMITTING = "submitting", _("Submitting")
    IN_PROGRESS = "in_progress", _("In progress")
    # Cancelled by us (every run in it was cancelled) or by someone else; it ends soon.
    CANCELING = "canceling", _("Canceling")
    # Ended at the API and its results committed.
    ENDED = "ended", _("Ended")
    # Never recorded at the API (its create failed or its worker died before recording it), or
    # lost there (404, no results, past its expiry): its requests were sent again.
    ABANDONED = "abandoned", _("Abandoned")


# A poller may take a batch in these statuses.
POLLED_STATUSES = (BatchStatus.IN_PROGRESS, BatchStatus.CANCELING)


class AgentBatch(models.Model):
    """One Message Batch: the requests of many runs, sent together with one ``anthropic-beta``
    header (requests are grouped by it)."""

    id = models.BigAutoField(primary_key=True)
    # The API's id ("msgbatch_..."), once the create answered.
    provider_id = models.CharField(max_length=100, null=True, blank=True, unique=True)
    status = models.CharField(
        max_length=16, choices=BatchStatus.choices, default=BatchStatus.SUBMITTING
    )
    betas = models.CharField(max_length=500, blank=True, default="")
    requests = models.PositiveIntegerField(default=0)
    # What the API counted when it ended (processing while in progress).
    processing = models.PositiveIntegerField(default=0)
    succeeded = models.PositiveIntegerField(default=0)
    errored = models.PositiveIntegerField(default=0)
    expired = models.PositiveIntegerField(default=0)
    canceled = models.PositiveIntegerField(default=0)
    # The worker that submits it or polls it now, until ``owner_until``: one at a time across
    # the fleet, with no transaction open across the call to the API.
    owner = models.CharField(max_length=200, null=True, blank=True)
    owner_until = models.DateTimeField(null=True, blank=True)
    # When the next retrieve is due; and how many there were (the backoff grows with them).
    poll_at = models.DateTimeField(null=True, blank=True)
    polls = models.PositiveIntegerField(default=0)
    # Downloads of its results that failed (a 404, a 500, a cut connection); past a few, the
    # batch is given up and its unanswered requests are sent again.
    result_failures = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(db_default=Now(), editable=False)
    submitted_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    ended_at = models.DateTimeField(null=True, blank=True)
    # What its committed answers cost at batch prices, and what they would have cost sent
    # directly (NULL: no price).
    cost_usd = models.DecimalField(max_digits=20, decimal_places=9, null=True, blank=True)
    direct_cost_usd = models.DecimalField(max_digits=20, decimal_places=9, null=True, blank=True)
    # The last problem with it (a failed retrieve, a results download that failed, ...).
    error = models.TextField(blank=True, default="")

    class Meta:
        db_table = "agent_batch"
        ordering: ClassVar[list[str]] = ["-created_at"]
        verbose_name = _("batch")
        verbose_name_plural = _("batches")
        indexes: ClassVar[list[models.Index]] = [
            # The pollers' look: the batches still at the API, by when each is due.
            models.Index(
                fields=["poll_at"],
                name="agent_batch_due",
                condition=models.Q(status__in=["in_progress", "canceling", "submitting"]),
            )
        ]

    def __str__(self) -> str:
        return f"batch {self.provider_id or self.pk} ({self.status})"

    @property
    def saved_usd(self) -> Decimal | None:
        """What sending its answers directly would have cost more (None: no price)."""
        if self.cost_usd is None or self.direct_cost_usd is None:
            return None
        return self.direct_cost_usd - self.cost_usd


class RequestStatus(models.TextChoices):
    # Recorded by its run, waiting for the submitter.
    WAITING = "waiting", _("Waiting")
    # In a batch at the API.
    SUBMITTED = "submitted", _("Submitted")
    # Its answer is committed as the run's step.
    ANSWERED = "answered", _("Answered")
    # Waited longer than BATCH_FALLBACK_SECONDS after a failed try: the run calls directly.
    DIRECT = "direct", _("Sent directly")
    # Its run moved on without it (cancelled, ended, deleted, requeued): an answer is ignored.
    DROPPED = "dropped", _("Dropped")
    # The API refused it (a request error), or its tries ran out: its run is dead-lettered.
    FAILED = "failed", _("Failed")


class AgentBatchRequest(models.Model):
    """One model turn of one run, asked through a batch. Its id is its ``custom_id``, so that
    any answer (a late one, a duplicate, one of a resubmission) matches exactly one request;
    its answer commits as step ``seq`` of its run only while the run still waits on it."""

    id = models.BigAutoField(primary_key=True)
    run = models.ForeignKey(AgentRun, on_delete=models.CASCADE, related_name="batch_requests")
    # The step the answer becomes (the run's last_seq + 1 when it parked).
    seq = models.IntegerField()
    status = models.CharField(
        max_length=16, choices=RequestStatus.choices, default=RequestStatus.WAITING
    )
    batch = models.ForeignKey(
        AgentBatch, null=True, blank=True, on_delete=models.SET_NULL, related_name="turns"
    )
    # The Messages request body exactly as a direct call would send it (without "stream"),
    # encrypted at rest as the steps are; emptied once the request is over.
    body = EncryptedTextField(blank=True, default="")
    model = models.CharField(max_length=200)
    betas = models.CharField(max_length=500, blank=True, default="")
    # Batches it was sent in so far; each failed try (expired, an overloaded answer) counts.
    tries = models.PositiveIntegerField(default=0)
    # Why it was sent again, or why it failed.
    reason = models.TextField(blank=True, default="")
    # When its run first asked for this turn (BATCH_FALLBACK_SECONDS counts from here).
    created_at = models.DateTimeField(db_default=Now(), editable=False)
    # When it last began to wait for a batch (BATCH_WINDOW_SECONDS counts from here).
    queued_at = models.DateTimeField(db_default=Now())
    submitted_at = models.DateTimeField(null=True, blank=True)
    answered_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "agent_batch_request"
        ordering: ClassVar[list[str]] = ["id"]
        constraints: ClassVar[list[models.BaseConstraint]] = [
            # One request per turn of a run: a run that parks again at the same seq (claimed
            # again after a crash, requeued) reuses it.
            models.UniqueConstraint(fields=["run", "seq"], name="agent_batch_request_turn")
        ]
        indexes: ClassVar[list[models.Index]] = [
            # The submitter's look: the requests waiting for a batch, oldest first.
            models.Index(
                fields=["betas", "queued_at"],
                name="agent_batch_request_waiting",
                condition=models.Q(status="waiting"),
            )
        ]

    def __str__(self) -> str:
        return f"batch request {self.pk} of run {self.run_id} seq {self.seq} ({self.status})"

    @property
    def custom_id(self) -> str:
        return str(self.pk)
