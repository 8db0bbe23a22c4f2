"""The list filters of the admin: each one an index condition."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.db.models import (
    QuerySet,
)
from django.http import HttpRequest
from django.utils.translation import gettext
from django.utils.translation import gettext_lazy as _

from durable_agents._internal.text import plain_markers
from durable_agents.admin.listing import distinct_values
from durable_agents.models import (
    RunStatus,
    WaitKind,
)


class WaitingForFilter(admin.SimpleListFilter):
    """Waiting runs by what they wait for (``waiting_for`` is kept after a wake, as the record
    of the last wait: the filter also asks for the status)."""

    title = _("waiting for")
    parameter_name = "waits_for"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [(kind.value, str(kind.label)) for kind in WaitKind]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        if value in WaitKind.values:
            return queryset.filter(status=RunStatus.WAITING, waiting_for=value)
        return queryset


class FamilyFilter(admin.SimpleListFilter):
    """Runs started by start_run, or child runs (spawn_run)."""

    title = _("parent")
    parameter_name = "family"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("top", gettext("started directly")), ("child", gettext("child runs"))]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        if self.value() == "top":
            return queryset.filter(parent__isnull=True)
        if self.value() == "child":
            return queryset.filter(parent__isnull=False)
        return queryset


class IndexedValuesFilter(admin.AllValuesFieldListFilter):
    """Django's filter by a field's values, its choices found by a skip scan over the index
    led by the field (``distinct_values``) instead of SELECT DISTINCT over the table."""

    def __init__(
        self,
        field: Any,
        request: HttpRequest,
        params: Any,
        model: Any,
        model_admin: Any,
        field_path: str,
    ) -> None:
        super().__init__(field, request, params, model, model_admin, field_path)
        values = distinct_values(model._default_manager.all(), field_path)
        self.lookup_choices = values  # type: ignore[assignment]

    def choices(self, changelist: Any) -> Any:
        # The values are text from outside (agents, models, tools): their invisible and
        # direction-changing characters read as markers in the sidebar too.
        for choice in super().choices(changelist):
            yield {**choice, "display": plain_markers(choice["display"])}


class SentFilter(admin.SimpleListFilter):
    title = _("sent")
    parameter_name = "sent"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("no", gettext("awaited (not sent yet)")), ("yes", gettext("sent"))]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        if self.value() == "no":
            return queryset.filter(sent_at__isnull=True)
        if self.value() == "yes":
            return queryset.filter(sent_at__isnull=False)
        return queryset
