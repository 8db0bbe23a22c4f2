"""Webhook deliveries: each event posted to a webhook of ``WEBHOOKS``, its attempts and its
outcome (``agent_webhook_delivery``). Written by the events and housekeeping, never by a
person: view only, and one action, "Send again now", for those who hold
``retry_webhookdelivery`` (a POST from the list, CSRF-checked by the admin)."""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest
from django.urls import reverse
from django.utils.html import format_html
from django.utils.safestring import SafeString
from django.utils.translation import gettext_lazy as _
from django.utils.translation import ngettext

from durable_agents import webhooks
from durable_agents._internal.text import revealed, storable_text
from durable_agents.admin.base import ReadOnlyAdmin
from durable_agents.admin.format import badge, format_time, revealed_excerpt, shown_json
from durable_agents.models import WebhookDelivery, WebhookStatus, short_id

STATUS_COLORS: dict[str, str] = {
    WebhookStatus.PENDING: "#9a6700",
    WebhookStatus.DELIVERED: "#1a7f37",
    WebhookStatus.FAILED: "#cf222e",
}
URL_COLUMN_CHARS = 60
ERROR_COLUMN_CHARS = 80
RETRY_PERMISSION = "durable_agents.retry_webhookdelivery"


class WebhookDeliveryAdmin(ReadOnlyAdmin[WebhookDelivery]):
    list_display = (
        "id",
        "event",
        "url_shown",
        "run_link",
        "status_badge",
        "attempts",
        "response_status",
        "created",
        "next_attempt",
        "error_excerpt",
    )
    list_filter = ("status", "event")
    search_fields = ("url",)
    list_per_page = 50
    show_full_result_count = False
    actions = ("send_again",)
    fields = (
        "id",
        "event",
        "url_shown",
        "run_link",
        "status_badge",
        "attempts",
        "response_status",
        "created",
        "next_attempt",
        "delivered",
        "error_shown",
        "payload_shown",
    )
    readonly_fields = fields

    @admin.display(description=_("URL"), ordering="url")
    def url_shown(self, obj: WebhookDelivery) -> SafeString:
        return format_html(
            '<code title="{}">{}</code>',
            storable_text(obj.url),
            revealed_excerpt(storable_text(obj.url), URL_COLUMN_CHARS),
        )

    @admin.display(description=_("run"))
    def run_link(self, obj: WebhookDelivery) -> SafeString | str:
        if obj.run_id is None:
            return "—"
        url = reverse(f"{self.admin_site.name}:durable_agents_agentrun_change", args=[obj.run_id])
        return format_html('<a href="{}">{}</a>', url, short_id(obj.run_id))

    @admin.display(description=_("status"), ordering="status")
    def status_badge(self, obj: WebhookDelivery) -> SafeString:
        return badge(obj.status, obj.get_status_display(), STATUS_COLORS)

    @admin.display(description=_("created"), ordering="created_at")
    def created(self, obj: WebhookDelivery) -> str:
        return format_time(obj.created_at) if obj.created_at else "—"

    @admin.display(description=_("next attempt"), ordering="next_attempt_at")
    def next_attempt(self, obj: WebhookDelivery) -> str:
        return format_time(obj.next_attempt_at) if obj.next_attempt_at else "—"

    @admin.display(description=_("delivered"), ordering="delivered_at")
    def delivered(self, obj: WebhookDelivery) -> str:
        return format_time(obj.delivered_at) if obj.delivered_at else "—"

    @admin.display(description=_("last error"))
    def error_excerpt(self, obj: WebhookDelivery) -> SafeString:
        return revealed_excerpt(storable_text(obj.last_error), ERROR_COLUMN_CHARS)

    @admin.display(description=_("last error"))
    def error_shown(self, obj: WebhookDelivery) -> SafeString:
        return format_html('<div class="da-pre">{}</div>', revealed(storable_text(obj.last_error)))

    @admin.display(description=_("payload"))
    def payload_shown(self, obj: WebhookDelivery) -> SafeString:
        return format_html('<div class="da-pre">{}</div>', revealed(shown_json(obj.payload)))

    # -- the one action ----------------------------------------------------------------------

    def has_retry_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm(RETRY_PERMISSION)

    @admin.action(description=_("Send again now"), permissions=["retry"])
    def send_again(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        """One more attempt now for each selected delivery that is not delivered (a failed
        one too: it is failed again if that attempt fails as well)."""
        chosen = list(queryset.exclude(status=WebhookStatus.DELIVERED))
        made_due = webhooks.send_again([delivery.pk for delivery in chosen])
        for delivery in chosen:
            self.log_change(request, delivery, "Sent again.")
        self.message_user(
            request,
            ngettext(
                "%(count)s delivery sent again; %(skipped)s skipped (delivered already).",
                "%(count)s deliveries sent again; %(skipped)s skipped (delivered already).",
                made_due,
            )
            % {"count": made_due, "skipped": queryset.count() - made_due},
            messages.SUCCESS,
        )
