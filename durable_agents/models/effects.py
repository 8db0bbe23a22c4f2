"""``tool_effect``: the effect ledger, the recorded outcome of each tool call by its key."""

from __future__ import annotations

from typing import ClassVar

from django.db import models
from django.db.models.functions import Now
from django.utils.translation import gettext_lazy as _

from durable_agents.models.fields import JSONTextField
from durable_agents.models.runs import AgentRun


class ToolEffect(models.Model):
    """The recorded outcome of one tool call, keyed by its position-derived key."""

    key = models.CharField(max_length=64, primary_key=True)
    # Indexed by tool_effect_run_seq below.
    run = models.ForeignKey(
        AgentRun, on_delete=models.CASCADE, related_name="effects", db_index=False
    )
    seq = models.IntegerField(help_text=_("seq of the model turn that asked for the call"))
    call_index = models.PositiveIntegerField()
    tool = models.CharField(max_length=200)
    # The whole tool_result content (before any cut for the model), and whether it was an error.
    result = JSONTextField(encrypted=True)
    is_error = models.BooleanField(default=False)
    created_at = models.DateTimeField(db_default=Now(), editable=False)

    class Meta:
        db_table = "tool_effect"
        indexes: ClassVar[list[models.Index]] = [
            models.Index(fields=["run", "seq"], name="tool_effect_run_seq")
        ]

    def __str__(self) -> str:
        return f"{self.tool} {self.key[:12]}"
