"""``agent_step``: a run's append-only log, one row per step (``StepKind``)."""

from __future__ import annotations

import json
from typing import Any, ClassVar

from django.db import models
from django.db.models.functions import Now
from django.utils.translation import gettext_lazy as _

from durable_agents.models.fields import EncryptedTextField, StepPartField
from durable_agents.models.runs import AgentRun


class StepKind(models.TextChoices):
    TASK = "task", _("Task")
    MODEL_TURN = "model_turn", _("Model turn")
    TOOL_RESULT = "tool_result", _("Tool result")
    # Messages a user sent while the run worked (agent_message), folded into the user turn
    # they follow: after its tool_result blocks, as text blocks (engine/history.py).
    MESSAGE = "message", _("Message")


class AgentStep(models.Model):
    """One entry of a run's append-only log. Never updated.

    ``payload`` holds JSON text, verbatim: for a model turn the provider's response body byte
    for byte (a text column, because jsonb reorders keys and thinking signatures bind them);
    for the task and tool results the exact content that was sent.
    """

    pk = models.CompositePrimaryKey("run_id", "seq")
    # The primary key (run_id, seq) already indexes run_id. No foreign key in the database:
    # on PostgreSQL a day's steps are dropped as one partition after their runs were deleted
    # (housekeeping/partitions.py), so a step may outlive its run for that while; every
    # statement that writes a step updates its run's row in the same transaction (the fence),
    # which is what the key would have checked.
    run = models.ForeignKey(
        AgentRun,
        on_delete=models.DO_NOTHING,
        related_name="steps",
        db_index=False,
        db_constraint=False,
    )
    seq = models.IntegerField()
    # The day (since 1970-01-01) the run's id was made, 0 for runs with random ids: the
    # partition key on PostgreSQL, where the primary key is (run_id, seq, part) and a CHECK
    # holds part to its run's id (so (run_id, seq) stays unique).
    part = StepPartField(default=0, editable=False)
    kind = models.CharField(max_length=16, choices=StepKind.choices)
    # Encrypted at rest under ENCRYPTION_KEYS (the raw statements of store/postgres_*.py seal it
    # themselves); decrypted, it is the stored text byte for byte.
    payload = EncryptedTextField()
    # Model turns: where the response's ``content`` array lies in ``payload`` (character
    # offsets), so that a resume sends that text back as received without parsing the turn.
    content_start = models.IntegerField(null=True, blank=True)
    content_end = models.IntegerField(null=True, blank=True)
    request_id = models.CharField(max_length=200, null=True, blank=True)
    attempt = models.PositiveIntegerField(default=0)
    worker = models.CharField(max_length=200, blank=True, default="")
    created_at = models.DateTimeField(db_default=Now(), editable=False)

    class Meta:
        db_table = "agent_step"
        ordering: ClassVar[list[str]] = ["run_id", "seq"]
        indexes: ClassVar[list[models.Index]] = [
            # Support tickets quote the provider's request id; only model turns have one.
            models.Index(
                fields=["request_id"],
                name="agent_step_request_id",
                condition=models.Q(request_id__isnull=False),
            )
        ]

    def __str__(self) -> str:
        return f"{self.run_id}#{self.seq} {self.kind}"

    def data(self) -> Any:
        return json.loads(self.payload)

    @property
    def content_span(self) -> tuple[int, int] | None:
        if self.content_start is None or self.content_end is None:
            return None
        return self.content_start, self.content_end


# The column a step's payload is bound to when encrypted, for the statements that read or
# write it without the ORM (store/postgres_*.py, store/portable.py).
STEP_PAYLOAD = "agent_step.payload"
