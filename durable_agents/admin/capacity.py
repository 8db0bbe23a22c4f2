"""The capacity page: each model's share of the provider's rate limits as the fleet sees it
(limits in force, what its buckets hold now, a pause after a 429), the 429s, 529s and pauses
of the last hour, and the runs waiting for capacity or for their key's budget, by priority and
by concurrency key. A fixed number of queries whatever the number of runs: each count is
bounded (``counting.bounded_count``) and the lists are cut."""

from __future__ import annotations

import copy
import dataclasses
import datetime
from typing import Any

from django.core.exceptions import PermissionDenied
from django.db.models import Count
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import URLPattern, path
from django.utils import timezone
from django.utils.translation import gettext

from durable_agents.admin.base import AdminPage, AgentsAdmin
from durable_agents.flow.capacity import buckets
from durable_agents.models import (
    AgentRun,
    CapacityEvent,
    ModelCapacity,
    RunStatus,
    WaitKind,
)

# The most keys and priorities the page lists (the busiest first).
TOP = 20
EVENT_WINDOW = datetime.timedelta(hours=1)


@dataclasses.dataclass(frozen=True)
class BucketView:
    name: str
    limit: float
    capacity: float
    level: float

    @property
    def percent(self) -> int:
        return max(0, min(100, round(100 * self.level / self.capacity))) if self.capacity else 0


@dataclasses.dataclass(frozen=True)
class ModelView:
    model: str
    source: str
    buckets: list[BucketView]
    paused_for: float | None
    calls: int
    rate_limited: int
    pauses: int
    capacity_waits: int
    input_per_call: float
    output_per_call: float


def model_view(row: ModelCapacity, now: datetime.datetime) -> ModelView:
    current = copy.copy(row)
    buckets.refill(current, now)  # as it is now, not as last written
    views = [
        BucketView(gettext(name), limit, limit * current.burst_seconds / 60, level)
        for name, limit, level in (
            ("requests", current.requests_per_minute, current.requests_level),
            ("input tokens", current.input_tokens_per_minute, current.input_level),
            ("output tokens", current.output_tokens_per_minute, current.output_level),
        )
        if limit is not None
    ]
    if current.configured:
        source = gettext("RATE_LIMITS")
    elif current.probing:
        source = gettext("learning (first calls)")
    elif views:
        source = gettext("learned from the API's headers")
    else:
        source = gettext("no limits")
    paused = current.paused_until
    return ModelView(
        model=row.model,
        source=source,
        buckets=views,
        paused_for=(paused - now).total_seconds() if paused and paused > now else None,
        calls=row.calls,
        rate_limited=row.rate_limited,
        pauses=row.pauses,
        capacity_waits=row.capacity_waits,
        input_per_call=row.input_per_call,
        output_per_call=row.output_per_call,
    )


def capacity_stats() -> dict[str, Any]:
    now = timezone.now()
    models = [model_view(row, now) for row in ModelCapacity.objects.order_by("model")[:TOP]]
    events = (
        CapacityEvent.objects.filter(at__gte=now - EVENT_WINDOW)
        .values("model", "kind")
        .annotate(n=Count("id"))
        .order_by("model", "kind")
    )
    waiting = AgentRun.objects.filter(
        status=RunStatus.PENDING, waiting_for__in=(WaitKind.CAPACITY, WaitKind.BUDGET)
    )
    by_priority = list(
        waiting.values("waiting_for", "priority")
        .annotate(n=Count("pk"))
        .order_by("waiting_for", "-priority")[:TOP]
    )
    by_key = list(
        waiting.exclude(concurrency_key=None)
        .values("waiting_for", "concurrency_key")
        .annotate(n=Count("pk"))
        .order_by("-n")[:TOP]
    )
    return {
        "models": models,
        "events": list(events),
        "by_priority": by_priority,
        "by_key": by_key,
        "top": TOP,
    }


class CapacityPage(AdminPage[AgentsAdmin[AgentRun]]):
    """The capacity page, under the runs' admin (beside the operations page)."""

    def urls(self) -> list[URLPattern]:
        view = self.admin.admin_site.admin_view(self.capacity_view)
        return [path("capacity/", view, name=self.admin._object_url("capacity"))]

    def capacity_view(self, request: HttpRequest) -> HttpResponse:
        if not self.admin.has_view_permission(request):
            raise PermissionDenied
        context = {
            **self.admin.admin_site.each_context(request),
            "title": gettext("Model capacity"),
            "opts": self.admin.opts,
            **capacity_stats(),
        }
        return TemplateResponse(request, "admin/durable_agents/agentrun/capacity.html", context)
