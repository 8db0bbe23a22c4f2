"""Concurrency keys' budgets in the admin: each key with its budget in force (``BUDGETS``, or
the one staff set here), what it spent today, and how many of its runs wait for it. The one
field that can be changed is the key's budget, by staff with ``change_concurrencykey``: saving
goes through ``durable_agents.set_key_budget`` (its runs waiting for the budget go back to the
queue at once) and the admin writes its LogEntry, as for any change form."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from django import forms
from django.contrib import admin
from django.core.exceptions import ValidationError
from django.db.models import Count, DecimalField, OuterRef, Q, QuerySet, Subquery, Sum
from django.db.models.functions import Coalesce
from django.http import Http404, HttpRequest
from django.utils.translation import gettext
from django.utils.translation import gettext_lazy as _

from durable_agents import api
from durable_agents._internal.text import has_unstorable
from durable_agents.admin.base import AgentsAdmin
from durable_agents.admin.format import revealed_field
from durable_agents.admin.keys import limit_in_force_text
from durable_agents.flow import budgets
from durable_agents.models import (
    MAX_CONCURRENCY_KEY,
    AgentRun,
    AgentUsageDay,
    ConcurrencyKey,
    RunStatus,
    WaitKind,
)
from durable_agents.store.rows import utc_day

MONEY = DecimalField(max_digits=20, decimal_places=9)
USD_PER_DAY = _("USD per day")


class ConcurrencyKeyForm(forms.ModelForm):  # type: ignore[type-arg]
    """The key's limit and budget, checked as the API checks them, so that a refused value is
    an error beside its field rather than a failure of the save."""

    class Meta:
        model = ConcurrencyKey
        fields = ("concurrency_limit", "usd_per_day")

    def clean_concurrency_limit(self) -> int | None:
        limit = self.cleaned_data.get("concurrency_limit")
        if limit is not None and limit < 0:
            raise ValidationError(_("A limit is a whole number of 0 or more, or empty."))
        return limit

    def clean_usd_per_day(self) -> Decimal | None:
        amount = self.cleaned_data.get("usd_per_day")
        if amount is None:
            return None
        try:
            return budgets.check_amount(amount)
        except ValueError as exc:
            raise ValidationError(str(exc)) from None


class ConcurrencyKeyAdmin(AgentsAdmin[ConcurrencyKey]):
    form = ConcurrencyKeyForm
    list_display = (
        "key_shown",
        "limit_in_force",
        "budget_in_force",
        "budget_set_here",
        "spent",
        "waiting",
    )
    fields = (
        "key_shown",
        "concurrency_limit",
        "limit_in_force",
        "usd_per_day",
        "budget_setting",
    )
    readonly_fields = ("key_shown", "limit_in_force", "budget_setting")
    key_shown = revealed_field("key", _("key"))
    search_fields = ("=key",)
    ordering = ("key",)
    list_per_page = 50
    show_full_result_count = False

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # a key exists once a run has it

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # the claim locks the key's row

    def get_object(
        self, request: HttpRequest, object_id: str, from_field: Any = None
    ) -> ConcurrencyKey | None:
        # The key is the primary key, text from the URL: a NUL or a lone surrogate in it is
        # a database error on PostgreSQL (a 500 on the change, history and delete pages), and
        # names no key anyway.
        if has_unstorable(object_id) or len(object_id) > MAX_CONCURRENCY_KEY:
            raise Http404(gettext("No concurrency key matches the given id."))
        return super().get_object(request, object_id, from_field)

    def get_queryset(self, request: HttpRequest) -> QuerySet[ConcurrencyKey]:
        # Two subqueries per page row (the day's rollup rows of the key, its runs waiting for
        # the budget): each through an index, whatever the number of keys.
        spent = (
            AgentUsageDay.objects.filter(day=utc_day(), concurrency_key=OuterRef("key"))
            .order_by()
            .values("concurrency_key")
            .annotate(total=Sum("cost_usd"))
            .values("total")
        )
        waiting = (
            AgentRun.objects.filter(
                status=RunStatus.PENDING,
                waiting_for=WaitKind.BUDGET,
                concurrency_key=OuterRef("key"),
            )
            .order_by()
            .values("concurrency_key")
            .annotate(n=Count("pk", filter=Q(pk__isnull=False)))
            .values("n")
        )
        return (
            super()
            .get_queryset(request)
            .annotate(
                spent_today=Coalesce(Subquery(spent, output_field=MONEY), Decimal(0)),
                waiting_runs=Coalesce(Subquery(waiting), 0),
            )
        )

    def formfield_for_dbfield(self, db_field: Any, request: HttpRequest, **kwargs: Any) -> Any:
        # The model field's own name would read "Usd per day" (its label is set here rather
        # than on the model, which would take a migration for a label).
        if db_field.name == "usd_per_day":
            kwargs["label"] = USD_PER_DAY
        return super().formfield_for_dbfield(db_field, request, **kwargs)

    @admin.display(description=_("limit in force"))
    def limit_in_force(self, obj: ConcurrencyKey) -> str:
        """The key's limit and where it comes from (this page, CONCURRENCY_LIMITS, or none):
        the row's own field is empty whenever the setting or the agents decide."""
        return limit_in_force_text(obj.key, obj.concurrency_limit)

    @admin.display(description=USD_PER_DAY, ordering="usd_per_day")
    def budget_set_here(self, obj: ConcurrencyKey) -> str:
        return "—" if obj.usd_per_day is None else f"${obj.usd_per_day}"

    @admin.display(description=_("budget (BUDGETS)"))
    def budget_setting(self, obj: ConcurrencyKey) -> str:
        budget = budgets.configured_budget(obj.key)
        return "—" if budget is None else f"${budget}"

    @admin.display(description=_("budget in force, USD per day"))
    def budget_in_force(self, obj: ConcurrencyKey) -> str:
        budget = budgets.in_force(obj.key, obj.usd_per_day)
        return "—" if budget is None else f"${budget}"

    @admin.display(description=_("spent today (UTC)"))
    def spent(self, obj: ConcurrencyKey) -> str:
        return f"${getattr(obj, 'spent_today', 0):.4f}"

    @admin.display(description=_("runs waiting for the budget"))
    def waiting(self, obj: ConcurrencyKey) -> int:
        return int(getattr(obj, "waiting_runs", 0))

    def save_model(
        self, request: HttpRequest, obj: ConcurrencyKey, form: Any, change: bool
    ) -> None:
        # Through the API: its permission checks, the key's waiting runs handed back, and
        # this process's claims told of a new limit at once.
        if "concurrency_limit" in form.changed_data:
            api.set_key_limit(obj.key, obj.concurrency_limit, user=request.user)
        if "usd_per_day" in form.changed_data:
            api.set_key_budget(obj.key, obj.usd_per_day, user=request.user)
