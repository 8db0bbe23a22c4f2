"""Message Batches in the admin: each batch of model turns (``agent_batch``) with its counts,
its age, the runs in it and what it saved, and on its page its requests
(``agent_batch_request``). Written by the fleet's submitter and pollers, never by a person: view
only. A run's page says which batch its waiting turn is in (``batch_wait``).

A request's reason is the API's words (an error message, why it was sent again): it is escaped,
its invisible characters drawn as markers, and cut to a bound."""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

from django.contrib import admin
from django.contrib.admin.views.main import ChangeList
from django.db.models import Count, IntegerField, OuterRef, QuerySet, Subquery, Value
from django.db.models.functions import Coalesce
from django.http import HttpRequest
from django.urls import reverse
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString
from django.utils.translation import gettext, ngettext
from django.utils.translation import gettext_lazy as _

from durable_agents._internal.text import revealed, storable_text
from durable_agents.admin.base import ReadOnlyAdmin, StrictChangeList
from durable_agents.admin.format import (
    badge,
    compact_age,
    created_title,
    format_time,
    revealed_excerpt,
)
from durable_agents.flow.pricing import format_usd
from durable_agents.models import (
    AgentBatch,
    AgentBatchRequest,
    AgentRun,
    BatchStatus,
    RequestStatus,
    RunStatus,
    WaitKind,
    short_id,
)

STATUS_COLORS: dict[str, str] = {
    BatchStatus.SUBMITTING: "#9a6700",
    BatchStatus.IN_PROGRESS: "#0969da",
    BatchStatus.CANCELING: "#9a6700",
    BatchStatus.ENDED: "#1a7f37",
    BatchStatus.ABANDONED: "#cf222e",
}
REQUEST_COLORS: dict[str, str] = {
    RequestStatus.WAITING: "#9a6700",
    RequestStatus.SUBMITTED: "#0969da",
    RequestStatus.ANSWERED: "#1a7f37",
    RequestStatus.DIRECT: "#57606a",
    RequestStatus.DROPPED: "#57606a",
    RequestStatus.FAILED: "#cf222e",
}
# Requests listed on a batch's page (a batch holds up to BATCH_MAX_REQUESTS); the rest counted.
REQUESTS_SHOWN = 200
# Characters of a request's reason in the table (it is the API's text, any length).
REASON_CHARS = 300
ERROR_COLUMN_CHARS = 80


def runs_in_batch() -> Subquery:
    """The number of distinct runs among a batch's requests, as a scalar subquery per row of
    the page (through the index of the requests' batch), never an aggregate over the table."""
    return Subquery(
        AgentBatchRequest.objects.filter(batch=OuterRef("pk"))
        .order_by()
        .values("batch")
        .annotate(n=Count("run", distinct=True))
        .values("n"),
        output_field=IntegerField(),
    )


class BatchChangeList(StrictChangeList):
    """The batches list never reads a batch's last problem (only its page shows it)."""

    def get_queryset(self, request: HttpRequest, exclude_parameters: Any = None) -> QuerySet[Any]:
        return super().get_queryset(request, exclude_parameters).defer("error")


class AgentBatchAdmin(ReadOnlyAdmin[AgentBatch]):
    """Every batch, newest first: how many requests it holds and how they ended at the API,
    the runs in it, its cost at batch prices and what sending them directly would have cost
    more."""

    list_display = (
        "provider_shown",
        "status_badge",
        "requests",
        "succeeded",
        "errored",
        "expired",
        "canceled",
        "age",
        "run_count",
        "cost",
        "saved",
    )
    list_filter = ("status",)
    search_fields = ("=provider_id",)
    # Newest first through the primary key's index (ids grow with created_at, which has none).
    ordering = ("-id",)
    list_per_page = 50
    show_full_result_count = False
    show_facets = admin.ShowFacets.NEVER
    fields = (
        "provider_shown",
        "status_badge",
        "betas_shown",
        "requests",
        "processing",
        "succeeded",
        "errored",
        "expired",
        "canceled",
        "run_count",
        "cost",
        "saved",
        "created",
        "submitted",
        "expires",
        "ended",
        "polls",
        "result_failures",
        "error_shown",
        "requests_table",
    )
    readonly_fields = fields

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return BatchChangeList

    def get_queryset(self, request: HttpRequest) -> QuerySet[AgentBatch]:
        return (
            super().get_queryset(request).annotate(runs_count=Coalesce(runs_in_batch(), Value(0)))
        )

    @admin.display(description=_("batch id"), ordering="provider_id")
    def provider_shown(self, obj: AgentBatch) -> SafeString:
        if not obj.provider_id:
            return format_html('<span class="da-meta">#{} {}</span>', obj.pk, gettext("no API id"))
        return format_html("<code>{}</code>", revealed(storable_text(obj.provider_id)))

    @admin.display(description=_("status"), ordering="status")
    def status_badge(self, obj: AgentBatch) -> SafeString:
        return badge(obj.status, obj.get_status_display(), STATUS_COLORS)

    @admin.display(description=_("age"), ordering="created_at")
    def age(self, obj: AgentBatch) -> SafeString:
        return format_html(
            '<span title="{}">{}</span>', created_title(obj), compact_age(obj.created_at)
        )

    @admin.display(description=_("runs"), ordering="runs_count")
    def run_count(self, obj: AgentBatch) -> int:
        return int(getattr(obj, "runs_count", 0) or 0)

    @admin.display(description=_("cost"), ordering="cost_usd")
    def cost(self, obj: AgentBatch) -> str:
        return format_usd(obj.cost_usd) or self.get_empty_value_display()

    @admin.display(description=_("saved"))
    def saved(self, obj: AgentBatch) -> str:
        return format_usd(obj.saved_usd) or self.get_empty_value_display()

    @admin.display(description=_("anthropic-beta"))
    def betas_shown(self, obj: AgentBatch) -> SafeString | str:
        if not obj.betas:
            return self.get_empty_value_display()
        return format_html("<code>{}</code>", revealed(storable_text(obj.betas)))

    @admin.display(description=_("created"), ordering="created_at")
    def created(self, obj: AgentBatch) -> str:
        return format_time(obj.created_at) or self.get_empty_value_display()

    @admin.display(description=_("submitted"), ordering="submitted_at")
    def submitted(self, obj: AgentBatch) -> str:
        return format_time(obj.submitted_at) or self.get_empty_value_display()

    @admin.display(description=_("expires"), ordering="expires_at")
    def expires(self, obj: AgentBatch) -> str:
        return format_time(obj.expires_at) or self.get_empty_value_display()

    @admin.display(description=_("ended"), ordering="ended_at")
    def ended(self, obj: AgentBatch) -> str:
        return format_time(obj.ended_at) or self.get_empty_value_display()

    @admin.display(description=_("last problem"))
    def error_shown(self, obj: AgentBatch) -> SafeString | str:
        if not obj.error:
            return self.get_empty_value_display()
        return format_html('<div class="da-pre">{}</div>', revealed(storable_text(obj.error)))

    @admin.display(description=_("requests"))
    def requests_table(self, obj: AgentBatch) -> SafeString | str:
        """The requests the batch holds, in order (at most REQUESTS_SHOWN, their bodies never
        read). A request sent again after this batch (it expired, the API was overloaded) is
        listed in its later batch."""
        held = AgentBatchRequest.objects.filter(batch=obj)
        rows = list(
            held.order_by("id").only("pk", "run_id", "seq", "status", "tries", "reason")[
                : REQUESTS_SHOWN + 1
            ]
        )
        if not rows:
            return self.get_empty_value_display()
        head = format_html(
            "<thead><tr>{}</tr></thead>",
            format_html_join(
                "",
                '<th scope="col">{}</th>',
                (
                    (gettext("request id"),),
                    (gettext("run"),),
                    (gettext("step"),),
                    (gettext("status"),),
                    (gettext("tries"),),
                    (gettext("reason"),),
                ),
            ),
        )
        body = format_html_join(
            "",
            '<tr class="da-batch-request"><td><code>{}</code></td><td><a href="{}">{}</a></td>'
            "<td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            (
                (
                    row.custom_id,
                    reverse(
                        f"{self.admin_site.name}:durable_agents_agentrun_change", args=[row.run_id]
                    ),
                    short_id(row.run_id),
                    row.seq,
                    badge(row.status, row.get_status_display(), REQUEST_COLORS),
                    row.tries,
                    revealed_excerpt(storable_text(row.reason), REASON_CHARS),
                )
                for row in rows[:REQUESTS_SHOWN]
            ),
        )
        more = ""
        if len(rows) > REQUESTS_SHOWN:
            count = held.count() - REQUESTS_SHOWN
            more = ngettext(
                "%(count)s more request not listed.",
                "%(count)s more requests not listed.",
                count,
            ) % {"count": count}
        return format_html(
            '<table class="da-stats" id="batch-requests">{}<tbody>{}</tbody></table>{}',
            head,
            body,
            format_html('<p class="da-meta">{}</p>', more) if more else "",
        )


@dataclass(frozen=True)
class BatchWait:
    """What a run page says about the batched model turn its run waits for: the request, and
    the batch it is in (None while it waits for the submitter)."""

    request: AgentBatchRequest
    batch: AgentBatch | None
    batch_url: str = ""

    @property
    def submitted_at(self) -> datetime.datetime | None:
        return self.request.submitted_at

    @property
    def reason_shown(self) -> SafeString:
        """Why it was sent again (or why it failed): the API's words, escaped and cut."""
        return revealed_excerpt(storable_text(self.request.reason), REASON_CHARS)


def batch_wait(run: AgentRun, admin_site_name: str = "admin") -> BatchWait | None:
    """The request of the turn ``run`` waits for in a batch, with its batch: one query, for a
    run waiting on a batch only (None for every other run, without a query)."""
    if run.status != RunStatus.WAITING or run.waiting_for != WaitKind.BATCH:
        return None
    request = (
        AgentBatchRequest.objects.filter(run_id=run.pk, seq=run.last_seq + 1)
        .select_related("batch")
        .defer("body", "batch__error")
        .first()
    )
    if request is None:
        return None
    batch = request.batch
    url = (
        reverse(f"{admin_site_name}:durable_agents_agentbatch_change", args=[batch.pk])
        if batch is not None
        else ""
    )
    return BatchWait(request, batch, url)
