"""``agent_progress``: what tool code says while it works (``durable_agents.progress``), kept
with the run and streamed to whoever watches it."""

from __future__ import annotations

from typing import ClassVar

from django.db import models
from django.db.models.functions import Now

from durable_agents.models.fields import EncryptedTextField


class AgentProgress(models.Model):
    """One ``progress(...)`` message of a run's tool call. Never updated; deleted with its run."""

    id = models.BigAutoField(primary_key=True)
    # Indexed with id by agent_progress_run below.
    run = models.ForeignKey(
        "durable_agents.AgentRun",
        on_delete=models.CASCADE,
        related_name="progress_messages",
        db_index=False,
    )
    # The model turn whose tool call said it: it sits after that step in the transcript.
    seq = models.IntegerField()
    # Encrypted at rest under ENCRYPTION_KEYS, as tool results are.
    message = EncryptedTextField()
    created_at = models.DateTimeField(db_default=Now(), editable=False)

    class Meta:
        db_table = "agent_progress"
        ordering: ClassVar[list[str]] = ["run_id", "id"]
        indexes: ClassVar[list[models.Index]] = [
            models.Index(fields=["run", "id"], name="agent_progress_run")
        ]

    def __str__(self) -> str:
        # Never the message: it is encrypted at rest, and a str() ends up in logs and audit rows.
        return f"progress of run {self.run_id} after #{self.seq}"
