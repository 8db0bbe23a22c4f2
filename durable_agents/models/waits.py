"""What ends a run's wait besides a timer or its child runs: events by name (``agent_event``),
questions to people with their answers (``agent_question``) and the bodies services POST to a
call's callback URL (``agent_callback``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from django.conf import settings
from django.db import models
from django.db.models.functions import Now
from django.utils.translation import gettext_lazy as _

from durable_agents.models.fields import EncryptedTextField, JSONTextField
from durable_agents.models.runs import AgentRun

if TYPE_CHECKING:
    from django_stubs_ext import StrOrPromise


class AgentEvent(models.Model):
    """An event by name (``send_event``): stored once; a second send of the name is a no-op.

    A run that waits on a name not sent yet creates the row with ``sent_at`` NULL: the send
    and the wait then lock the same row, so neither can miss the other."""

    id = models.BigAutoField(primary_key=True)
    name = models.CharField(max_length=200, unique=True)
    payload = JSONTextField(null=True, blank=True, encrypted=True)
    sent_at = models.DateTimeField(null=True, blank=True)
    sent_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
    )
    created_at = models.DateTimeField(db_default=Now(), editable=False)

    class Meta:
        db_table = "agent_event"
        ordering: ClassVar[list[str]] = ["-created_at"]
        permissions: ClassVar[list[tuple[str, StrOrPromise]]] = [
            ("send_event", _("Can send events to waiting runs"))
        ]

    def __str__(self) -> str:
        return self.name

    @property
    def is_sent(self) -> bool:
        return self.sent_at is not None

    def woken_by(self) -> dict[str, Any]:
        """What a run that waited on this event receives."""
        return {**self.wake_reference(), "payload": self.payload}

    def wake_reference(self) -> dict[str, Any]:
        """What each run this event wakes stores as its ``woken_by``: the event's name and
        time, not its payload, which is stored once, here (twenty waiters of a large payload
        would otherwise hold twenty copies). The woken call gets ``woken_by()`` whole."""
        return {"event": self.name, "at": self.sent_at.isoformat() if self.sent_at else None}


class QuestionStatus(models.TextChoices):
    OPEN = "open", _("Open")
    ANSWERED = "answered", _("Answered")
    CANCELLED = "cancelled", _("Cancelled")


class AgentQuestion(models.Model):
    """A question a run asked a person (the built-in ``ask_person`` tool), and its answer."""

    id = models.BigAutoField(primary_key=True)
    run = models.ForeignKey(AgentRun, on_delete=models.CASCADE, related_name="questions")
    # The idempotency key of the ask_person call: one question per call.
    key = models.CharField(max_length=64, unique=True)
    question = models.TextField()
    status = models.CharField(
        max_length=16, choices=QuestionStatus.choices, default=QuestionStatus.OPEN
    )
    answer = EncryptedTextField(blank=True, default="")
    answered_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
    )
    answered_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(db_default=Now(), editable=False)

    class Meta:
        db_table = "agent_question"
        ordering: ClassVar[list[str]] = ["created_at"]
        permissions: ClassVar[list[tuple[str, StrOrPromise]]] = [
            ("answer_question", _("Can answer questions that runs ask"))
        ]
        indexes: ClassVar[list[models.Index]] = [
            models.Index(fields=["status", "created_at"], name="agent_question_status")
        ]

    def __str__(self) -> str:
        return f"question {self.pk} of run {self.run_id} ({self.status})"

    def woken_by(self) -> dict[str, Any]:
        """What the asking call receives once answered."""
        who = self.answered_by.get_username() if self.answered_by is not None else None
        return {
            "answer": self.answer,
            "answered_by": who,
            "at": self.answered_at.isoformat() if self.answered_at else None,
        }


class AgentCallback(models.Model):
    """The body a service POSTed to a call's callback URL (``Wait(callback=True)``): one per
    call, by the call's idempotency key. Its existence is what makes the URL single-use (the
    key is unique, and the POST inserts it under the run's lock); a call that parks after the
    POST arrived (the service answered before the park committed) finds it here and goes on."""

    id = models.BigAutoField(primary_key=True)
    run = models.ForeignKey(AgentRun, on_delete=models.CASCADE, related_name="callbacks")
    # The idempotency key of the call the URL belongs to.
    key = models.CharField(max_length=64, unique=True)
    body = JSONTextField(null=True, blank=True, encrypted=True)
    received_at = models.DateTimeField(db_default=Now(), editable=False)

    class Meta:
        db_table = "agent_callback"
        ordering: ClassVar[list[str]] = ["-received_at"]

    def __str__(self) -> str:
        return f"callback of run {self.run_id} call {self.key[:12]}"

    def woken_by(self) -> dict[str, Any]:
        """What the waiting call receives."""
        return {**self.wake_reference(), "callback": self.body}

    def wake_reference(self) -> dict[str, Any]:
        """What the woken run stores as its ``woken_by``: the time only; the body (up to
        CALLBACK_MAX_BYTES) is stored once, here, and the woken call reads it from here."""
        return {"at": self.received_at.isoformat() if self.received_at else None}
