"""``tool_intent``: irreversible tool calls, written before they may run and decided by a
person (``IntentStatus``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from django.conf import settings
from django.db import models
from django.db.models.functions import Now
from django.utils.translation import gettext_lazy as _

from durable_agents.models.fields import JSONTextField
from durable_agents.models.runs import AgentRun

if TYPE_CHECKING:
    from django_stubs_ext import StrOrPromise


class IntentStatus(models.TextChoices):
    PENDING = "pending", _("Pending approval")
    APPROVED = "approved", _("Approved")
    REJECTED = "rejected", _("Rejected")
    EXECUTING = "executing", _("Executing")
    DONE = "done", _("Done")
    UNKNOWN = "unknown", _("Outcome unknown")


class ToolIntentQuerySet(models.QuerySet["ToolIntent"]):
    def awaiting_person(self) -> ToolIntentQuerySet:
        return self.filter(status__in=(IntentStatus.PENDING, IntentStatus.UNKNOWN))


class ToolIntent(models.Model):
    """An irreversible tool call: written before it may run, decided by a person."""

    id = models.BigAutoField(primary_key=True)
    run = models.ForeignKey(AgentRun, on_delete=models.CASCADE, related_name="intents")
    seq = models.IntegerField(help_text=_("seq of the model turn that asked for the call"))
    call_index = models.PositiveIntegerField()
    tool = models.CharField(max_length=200)
    input = JSONTextField(encrypted=True)
    key = models.CharField(max_length=64, unique=True)
    status = models.CharField(
        max_length=16, choices=IntentStatus.choices, default=IntentStatus.PENDING
    )
    decided_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
    )
    decided_at = models.DateTimeField(null=True, blank=True)
    reason = models.TextField(blank=True, default="")
    created_at = models.DateTimeField(db_default=Now(), editable=False)
    updated_at = models.DateTimeField(db_default=Now(), editable=False)

    objects = ToolIntentQuerySet.as_manager()

    class Meta:
        db_table = "tool_intent"
        ordering: ClassVar[list[str]] = ["created_at"]
        permissions: ClassVar[list[tuple[str, StrOrPromise]]] = [
            ("approve_toolintent", _("Can approve, reject or resolve tool intents"))
        ]
        indexes: ClassVar[list[models.Index]] = [
            models.Index(fields=["status", "created_at"], name="tool_intent_status"),
            # The intents list at production size: decided intents newest first, by tool.
            models.Index(fields=["created_at"], name="tool_intent_created"),
            models.Index(fields=["tool", "created_at"], name="tool_intent_tool"),
        ]

    def __str__(self) -> str:
        return f"{self.tool} for run {self.run_id} ({self.status})"
