"""``agent_message``: a run's inbox, the messages a user sent while the agent was working
(``durable_agents.send_message``)."""

from __future__ import annotations

from typing import ClassVar

from django.conf import settings
from django.db import models
from django.db.models.functions import Now

from durable_agents.models.fields import EncryptedTextField
from durable_agents.models.runs import AgentRun


class AgentMessage(models.Model):
    """One message sent to a run in flight. It waits (``folded_seq`` NULL) until the worker
    holding the run commits it as a step of the log (``StepKind.MESSAGE``, seq
    ``folded_seq``), in the same transaction that marks it folded: a message is folded once,
    by the lease holder only, never beside it."""

    id = models.BigAutoField(primary_key=True)
    run = models.ForeignKey(AgentRun, on_delete=models.CASCADE, related_name="messages")
    # Encrypted at rest under ENCRYPTION_KEYS, as the step it becomes is.
    text = EncryptedTextField()
    # A client's idempotency key: a retry with it returns the first message and adds none.
    key = models.CharField(max_length=200, null=True, blank=True)
    sent_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
    )
    created_at = models.DateTimeField(db_default=Now(), editable=False)
    folded_at = models.DateTimeField(null=True, blank=True)
    folded_seq = models.IntegerField(null=True, blank=True)

    class Meta:
        db_table = "agent_message"
        ordering: ClassVar[list[str]] = ["run_id", "id"]
        constraints: ClassVar[list[models.BaseConstraint]] = [
            models.UniqueConstraint(
                fields=["run", "key"],
                name="agent_message_run_key",
                condition=models.Q(key__isnull=False),
            )
        ]
        indexes: ClassVar[list[models.Index]] = [
            # The worker's question before each model call: does anything wait?
            models.Index(
                fields=["run"],
                name="agent_message_waiting",
                condition=models.Q(folded_seq__isnull=True),
            )
        ]

    def __str__(self) -> str:
        state = "waiting" if self.folded_seq is None else f"folded at #{self.folded_seq}"
        return f"message {self.pk} to run {self.run_id} ({state})"
