"""``agent_webhook_delivery``: each POST of an event to a configured webhook, its attempts and
its outcome (``WebhookStatus``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from django.db import models
from django.db.models.functions import Now
from django.utils.translation import gettext_lazy as _

if TYPE_CHECKING:
    from django_stubs_ext import StrOrPromise


class WebhookStatus(models.TextChoices):
    PENDING = "pending", _("Pending")
    DELIVERED = "delivered", _("Delivered")
    FAILED = "failed", _("Failed")


class WebhookDelivery(models.Model):
    """One event for one webhook URL: written when the event happens (after its commit), sent
    by a task or a thread, tried again by housekeeping with a doubling wait until it is
    delivered or WEBHOOK_MAX_ATTEMPTS failed. The payload holds no encrypted value; the
    secret that signs it stays in the settings."""

    id = models.BigAutoField(primary_key=True)
    url = models.TextField()
    event = models.CharField(max_length=32)
    # The run the event is about (no foreign key: a delivery outlives its run's retention).
    run_id = models.UUIDField(null=True, blank=True)
    payload = models.JSONField()
    status = models.CharField(
        max_length=16, choices=WebhookStatus.choices, default=WebhookStatus.PENDING
    )
    attempts = models.PositiveIntegerField(default=0)
    # When the next attempt is due (pending only); an attempt under way holds it ahead, so
    # that housekeeping does not send the same delivery at the same time.
    next_attempt_at = models.DateTimeField(null=True, blank=True)
    last_error = models.TextField(blank=True, default="")
    response_status = models.PositiveSmallIntegerField(null=True, blank=True)
    created_at = models.DateTimeField(db_default=Now(), editable=False)
    delivered_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "agent_webhook_delivery"
        ordering: ClassVar[list[str]] = ["-created_at", "-id"]
        verbose_name = _("webhook delivery")
        verbose_name_plural = _("webhook deliveries")
        permissions: ClassVar[list[tuple[str, StrOrPromise]]] = [
            ("retry_webhookdelivery", _("Can send webhook deliveries again"))
        ]
        indexes: ClassVar[list[models.Index]] = [
            # Housekeeping's look for due deliveries reads only the pending ones.
            models.Index(
                fields=["next_attempt_at"],
                condition=models.Q(status="pending"),
                name="agent_webhook_due",
            ),
            models.Index(fields=["created_at"], name="agent_webhook_created"),
        ]

    def __str__(self) -> str:
        return f"{self.event} to {self.url} ({self.status})"
