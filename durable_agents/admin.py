"""The durable_agents admin: runs and their transcripts, intents to decide, the dead letter and
an operations page.

Runs, steps and intents are never edited by hand: every page is read-only, and every change of
state is an action or a POST-only view that calls ``durable_agents.api``. AgentStep has a
composite primary key and cannot be registered; steps are shown on their run's page.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.views.main import ChangeList
from django.core.exceptions import PermissionDenied
from django.db.models import Case, Exists, F, IntegerField, OuterRef, Q, QuerySet, Value, When
from django.db.models.functions import Substr
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import get_object_or_404
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils.html import format_html
from django.utils.safestring import SafeString
from django.utils.text import Truncator
from django.views.decorators.http import require_POST

from durable_agents import admin_views as views
from durable_agents import api
from durable_agents.agents import AgentNotFound, registry
from durable_agents.models import (
    CANCELLABLE_STATUSES,
    AgentRun,
    AgentStep,
    IntentStatus,
    RunStatus,
    ToolIntent,
)

AWAITING_PERSON = (IntentStatus.PENDING, IntentStatus.UNKNOWN)
# The confirmation pages list this many objects and summarise the rest.
CONFIRMATION_LIST_LIMIT = 100


def _confirmation_hidden_fields(request: HttpRequest, queryset: QuerySet) -> dict[str, Any]:
    """What a confirmation page posts back so that Django replays the same action.

    Django runs an action posted without ``index`` only when ``_selected_action`` is present,
    so a select-across confirmation carries a few pks too; ``select_across`` makes Django
    rebuild the queryset from the filters in the URL, which the form keeps by posting back
    to the same address.
    """
    select_across = request.POST.get("select_across") == "1"
    selected = request.POST.getlist(helpers.ACTION_CHECKBOX_NAME)
    if select_across and not selected:
        selected = [str(pk) for pk in queryset.values_list("pk", flat=True)[:1]]
    return {
        "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
        "selected": selected,
        "select_across": "1" if select_across else "0",
        "action": request.POST.get("action", ""),
        "form_url": request.get_full_path(),
    }


class _OperationsMixin:
    """Shared helpers of the two ModelAdmins: POST-only object views and confirmation pages."""

    admin_site: admin.AdminSite
    opts: Any
    model: Any

    def _object_url(self, name: str) -> str:
        return f"{self.opts.app_label}_{self.opts.model_name}_{name}"

    def _post_view(self, view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
        # admin_view: staff login and CSRF protection; require_POST: no GET changes state.
        return self.admin_site.admin_view(require_POST(view))

    def _redirect_to_object(self, obj: Any) -> HttpResponseRedirect:
        return HttpResponseRedirect(
            reverse(
                f"{self.admin_site.name}:{self._object_url('change')}",
                args=[obj.pk],
            )
        )

    def _render_confirmation(
        self,
        request: HttpRequest,
        queryset: QuerySet,
        *,
        title: str,
        question: str,
        affected: QuerySet,
        skipped: int,
        button: str,
        reason_field: bool = False,
    ) -> TemplateResponse:
        total = affected.count()
        context = {
            **self.admin_site.each_context(request),  # type: ignore[attr-defined]
            "title": title,
            "question": question,
            "opts": self.opts,
            "objects": list(affected[:CONFIRMATION_LIST_LIMIT]),
            "affected_count": total,
            "more_count": max(total - CONFIRMATION_LIST_LIMIT, 0),
            "skipped_count": skipped,
            "button": button,
            "reason_field": reason_field,
            **_confirmation_hidden_fields(request, queryset),
        }
        return TemplateResponse(request, "admin/durable_agents/action_confirmation.html", context)


# ---------------------------------------------------------------------------------------------
# Runs

TASK_HEAD_CHARS = 80
LAST_ERROR_CHARS = 60
LAST_ERROR_TITLE_CHARS = 500


class RunChangeList(ChangeList):
    """The runs list reads the head of each task, not the whole text (tasks can be long)."""

    def get_queryset(self, request: HttpRequest, exclude_parameters: Any = None) -> QuerySet:
        return (
            super()
            .get_queryset(request, exclude_parameters)
            .annotate(task_head=Substr("task", 1, TASK_HEAD_CHARS))
            .defer("task", "result", "fingerprint")
        )


class StartRunForm(forms.Form):
    agent = forms.ChoiceField(help_text="Registered agents, as name @ version.")
    task = forms.CharField(widget=forms.Textarea(attrs={"rows": 10, "cols": 80}))
    model = forms.CharField(
        required=False, max_length=200, help_text="Leave empty for the agent's model."
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The value is JSON so that any character in a name or version survives the round trip.
        self.fields["agent"].choices = [
            (json.dumps([a.name, a.version]), f"{a.name} @ {a.version} ({a.model})")
            for a in sorted(registry.all(), key=lambda a: (a.name, a.version))
        ]


def _time_field(field_name: str, description: str) -> Callable[[Any, Any], str]:
    """A read-only field or column printing ``field_name`` as ``views.TIME_FORMAT``.

    Django prints datetimes in the locale's format ("Dec. 2, 2026, 4:51 p.m."); the transcript
    prints them as ISO-like times, and so does every page of the admin through these.
    """

    @admin.display(description=description, ordering=field_name)
    def show(self: admin.ModelAdmin, obj: Any) -> str:
        return views.format_time(getattr(obj, field_name)) or self.get_empty_value_display()

    show.__name__ = f"{field_name}_display"
    return show


CLAIMS_HELP = (
    "how many times a worker took this run (after a crash, a deploy or a person's decision)"
)


@admin.register(AgentRun)
class AgentRunAdmin(_OperationsMixin, admin.ModelAdmin):
    # Sized for 1280 px with the nav sidebar and the filters (a 631 px table): the age under
    # the run id, the model under the agent, the error (truncated) under the task, one lease
    # column and short headers; admin.css sets the widths.
    list_display = (
        "short_id",
        "status_short",
        "agent_version",
        "task_excerpt",
        "steps",
        "claims",
        "lease",
    )
    list_filter = ("status", "agent", "model", "created_at")
    search_fields = ("task",)  # plus ids and request ids: see get_search_results
    search_help_text = "A run id, a request id (req_...), or words of the task."
    date_hierarchy = "created_at"
    ordering = ("-created_at",)
    show_full_result_count = False
    list_select_related = False  # every column lives on agent_run itself
    list_per_page = 50
    actions = ("cancel_runs", "requeue_runs")
    fieldsets = (
        (None, {"fields": ("id", "status_badge", "agent", "prompt_version", "model", "task")}),
        (
            "Progress",
            {
                "fields": (
                    "steps",
                    "tokens_used",
                    "attempt",
                    "stalled_claims",
                    "lease_owner",
                    "lease_until_display",
                    "created_at_display",
                    "started_at_display",
                    "updated_at_display",
                    "finished_at_display",
                )
            },
        ),
        ("Outcome", {"fields": ("result", "error")}),
        ("Pinning", {"classes": ("collapse",), "fields": ("fingerprint",)}),
    )
    readonly_fields = (
        "id",
        "status_badge",
        "agent",
        "prompt_version",
        "model",
        "task",
        "steps",
        "tokens_used",
        "attempt",
        "stalled_claims",
        "lease_owner",
        "lease_until_display",
        "created_at_display",
        "started_at_display",
        "updated_at_display",
        "finished_at_display",
        "result",
        "error",
        "fingerprint",
    )
    # Labels and help of read-only fields come from the form's Meta (see get_form).
    field_labels = {"attempt": "claims", "tokens_used": "tokens used"}
    field_help_texts = {"attempt": CLAIMS_HELP, "started_at_display": "first claim"}

    lease_until_display = _time_field("lease_until", "lease until")
    created_at_display = _time_field("created_at", "created at")
    started_at_display = _time_field("started_at", "started at")
    updated_at_display = _time_field("updated_at", "updated at")
    finished_at_display = _time_field("finished_at", "finished at")

    def get_form(
        self, request: HttpRequest, obj: Any = None, change: bool = False, **kwargs: Any
    ) -> type[forms.ModelForm]:
        kwargs.setdefault("labels", self.field_labels)
        kwargs.setdefault("help_texts", self.field_help_texts)
        return super().get_form(request, obj, change, **kwargs)

    # -- columns ---------------------------------------------------------------------------

    @admin.display(description="run", ordering="created_at")
    def short_id(self, obj: AgentRun) -> SafeString:
        """The id's first 8 characters, and the run's age under it (sorts by creation)."""
        if not obj.created_at:
            return format_html("{}", str(obj.pk)[:8])
        return format_html(
            '{}<br><span class="da-meta" title="created {}">{} ago</span>',
            str(obj.pk)[:8],
            views.format_time(obj.created_at),
            views.compact_age(obj.created_at),
        )

    @admin.display(description="status", ordering="status")
    def status_badge(self, obj: AgentRun) -> SafeString:
        return views.badge(obj.status, obj.get_status_display(), views.RUN_COLORS)

    @admin.display(description="status", ordering="status")
    def status_short(self, obj: AgentRun) -> SafeString:
        label = views.RUN_SHORT_LABELS.get(obj.status, obj.get_status_display())
        return views.badge(obj.status, label, views.RUN_COLORS, title=obj.get_status_display())

    @admin.display(description="agent", ordering="agent")
    def agent_version(self, obj: AgentRun) -> SafeString:
        return format_html(
            '{} @ {}<br><span class="da-meta">{}</span>', obj.agent, obj.prompt_version, obj.model
        )

    @admin.display(description="task")
    def task_excerpt(self, obj: AgentRun) -> SafeString:
        """The task's first line, and under it the start of the error if there is one."""
        head = getattr(obj, "task_head", None) or obj.task
        first_line = next((line for line in head.splitlines() if line.strip()), "")
        task = Truncator(first_line).chars(60)
        if not obj.error:
            return format_html("{}", task)
        return format_html(
            '{}<br><span class="da-list-error" title="{}">{}</span>',
            task,
            Truncator(obj.error).chars(LAST_ERROR_TITLE_CHARS),
            Truncator(obj.error).chars(LAST_ERROR_CHARS),
        )

    @admin.display(description="steps", ordering="last_seq")
    def steps(self, obj: AgentRun) -> int:
        return obj.last_seq + 1  # seq 0 is the task; no per-row query

    @admin.display(description="claims", ordering="attempt")
    def claims(self, obj: AgentRun) -> int:
        return obj.attempt

    @admin.display(description="lease", ordering="lease_until")
    def lease(self, obj: AgentRun) -> SafeString | None:
        return views.lease_summary(obj.lease_owner, obj.lease_until)

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return RunChangeList

    # -- permissions: read-only pages, operations through actions --------------------------

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # A saved change form would write a stale copy of a row that workers update.
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_operate_permission(self, request: HttpRequest) -> bool:
        """Cancel and requeue: Django's change permission on runs."""
        return request.user.has_perm(f"{self.opts.app_label}.change_{self.opts.model_name}")

    # -- search ----------------------------------------------------------------------------

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet, search_term: str
    ) -> tuple[QuerySet, bool]:
        term = search_term.strip()
        if not term:
            return queryset, False
        try:
            run_id = uuid.UUID(term)
        except ValueError:
            pass
        else:
            return queryset.filter(pk=run_id), False
        # EXISTS instead of a join over steps__request_id: one row per run, no DISTINCT.
        by_request = Exists(AgentStep.objects.filter(run_id=OuterRef("pk"), request_id=term))
        return queryset.filter(Q(task__icontains=term) | by_request), False

    def lookup_allowed(self, lookup: str, value: str, request: HttpRequest | None = None) -> bool:
        # The dead-letter page links to runs whose error starts with a reason.
        if lookup == "error__startswith":
            return True
        return super().lookup_allowed(lookup, value, request)

    # -- actions ---------------------------------------------------------------------------

    @admin.action(description="Cancel selected runs", permissions=["operate"])
    def cancel_runs(self, request: HttpRequest, queryset: QuerySet) -> HttpResponse | None:
        eligible = queryset.filter(status__in=CANCELLABLE_STATUSES)
        return self._run_operation(
            request,
            queryset,
            eligible,
            operation=api.cancel_run,
            verb="cancel",
            done="Cancelled",
            question=(
                "These runs will be cancelled. A worker holding one stops at its next step; "
                "nothing it committed is undone."
            ),
        )

    @admin.action(description="Requeue selected dead runs", permissions=["operate"])
    def requeue_runs(self, request: HttpRequest, queryset: QuerySet) -> HttpResponse | None:
        eligible = queryset.filter(status=RunStatus.DEAD)
        return self._run_operation(
            request,
            queryset,
            eligible,
            operation=api.requeue_run,
            verb="requeue",
            done="Requeued",
            question=(
                "These dead runs go back to pending and resume at their first uncommitted step."
            ),
        )

    def _run_operation(
        self,
        request: HttpRequest,
        queryset: QuerySet,
        eligible: QuerySet,
        *,
        operation: Callable[[Any], bool],
        verb: str,
        done: str,
        question: str,
    ) -> HttpResponse | None:
        if request.POST.get("post") != "yes":
            return self._render_confirmation(
                request,
                queryset,
                title=f"{verb.capitalize()} runs",
                question=question,
                affected=eligible.order_by("-created_at"),
                skipped=queryset.count() - eligible.count(),
                button=f"Yes, {verb} them",
            )
        total = queryset.count()
        changed = 0
        for run in eligible.only("pk", "status"):
            # Per run through the api: the status it checks may have moved since the page.
            if operation(run.pk):
                changed += 1
                self.log_change(request, run, f"{done} from the admin (was {run.status}).")
        skipped = total - changed
        level = messages.SUCCESS if changed else messages.WARNING
        self.message_user(
            request,
            f"{done} {changed} run(s); {skipped} skipped (not in a status that allows it).",
            level,
        )
        return None

    # -- pages -----------------------------------------------------------------------------

    def get_urls(self) -> list[URLPattern]:
        name = self._object_url
        return [
            path(
                "operations/",
                self.admin_site.admin_view(self.operations_view),
                name=name("operations"),
            ),
            path(
                "dead-letter/",
                self.admin_site.admin_view(self.dead_letter_view),
                name=name("dead_letter"),
            ),
            path(
                "<path:object_id>/cancel/",
                self._post_view(self.cancel_view),
                name=name("cancel"),
            ),
            path(
                "<path:object_id>/requeue/",
                self._post_view(self.requeue_view),
                name=name("requeue"),
            ),
            *super().get_urls(),
        ]

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        extra_context = {**(extra_context or {}), "dead_count": AgentRun.objects.dead().count()}
        return super().changelist_view(request, extra_context)

    def render_change_form(
        self,
        request: HttpRequest,
        context: dict[str, Any],
        add: bool = False,
        change: bool = False,
        form_url: str = "",
        obj: AgentRun | None = None,
    ) -> HttpResponse:
        if obj is not None:
            can_operate = self.has_operate_permission(request)
            context.update(
                transcript=views.build_transcript(obj),
                sql_hint=views.sql_hint(obj),
                can_cancel=can_operate and obj.status in CANCELLABLE_STATUSES,
                can_requeue=can_operate and obj.status == RunStatus.DEAD,
            )
        return super().render_change_form(request, context, add, change, form_url, obj)

    def add_view(
        self, request: HttpRequest, form_url: str = "", extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        """ "Add" is "start a run": api.start_run with an agent of the registry and a task."""
        if not self.has_add_permission(request):
            raise PermissionDenied
        form = StartRunForm(request.POST or None)
        if request.method == "POST" and form.is_valid():
            name, version = json.loads(form.cleaned_data["agent"])
            try:
                run = api.start_run(
                    name,
                    form.cleaned_data["task"],
                    version=version,
                    model=form.cleaned_data["model"] or None,
                )
            except (AgentNotFound, ValueError) as exc:
                form.add_error(None, str(exc))
            else:
                self.log_addition(request, run, "Started from the admin.")
                self.message_user(request, f"Started run {run.pk}.", messages.SUCCESS)
                return self._redirect_to_object(run)
        context = {
            **self.admin_site.each_context(request),
            "title": "Start a run",
            "opts": self.opts,
            "form": form,
        }
        return TemplateResponse(request, "admin/durable_agents/agentrun/start_run.html", context)

    def _single_run_operation(
        self,
        request: HttpRequest,
        object_id: str,
        operation: Callable[[Any], bool],
        done: str,
    ) -> HttpResponse:
        if not self.has_operate_permission(request):
            raise PermissionDenied
        run = get_object_or_404(AgentRun, pk=object_id)
        before = run.status
        if operation(run.pk):
            self.log_change(request, run, f"{done} from the admin (was {before}).")
            self.message_user(request, f"{done} run {run.pk}.", messages.SUCCESS)
        else:
            run.refresh_from_db(fields=["status"])
            self.message_user(
                request,
                f"Nothing changed: run {run.pk} is {run.get_status_display().lower()}.",
                messages.WARNING,
            )
        return self._redirect_to_object(run)

    def cancel_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        return self._single_run_operation(request, object_id, api.cancel_run, "Cancelled")

    def requeue_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        return self._single_run_operation(request, object_id, api.requeue_run, "Requeued")

    def dead_letter_view(self, request: HttpRequest) -> HttpResponse:
        if not self.has_view_permission(request):
            raise PermissionDenied
        reasons, total = views.dead_letter_reasons()
        context = {
            **self.admin_site.each_context(request),
            "title": "Dead letter",
            "opts": self.opts,
            "reasons": reasons,
            "total": total,
        }
        return TemplateResponse(request, "admin/durable_agents/agentrun/dead_letter.html", context)

    def operations_view(self, request: HttpRequest) -> HttpResponse:
        if not self.has_view_permission(request):
            raise PermissionDenied
        context = {
            **self.admin_site.each_context(request),
            "title": "Operations",
            "opts": self.opts,
            **views.operations_stats(),
        }
        return TemplateResponse(request, "admin/durable_agents/agentrun/operations.html", context)


# ---------------------------------------------------------------------------------------------
# Intents


@admin.register(ToolIntent)
class ToolIntentAdmin(_OperationsMixin, admin.ModelAdmin):
    list_display = (
        "id",
        "tool",
        "run_link",
        "status_badge",
        "created_at_display",
        "decided_by",
        "decided_at_display",
    )
    list_display_links = ("id", "tool")
    list_filter = ("status", "tool")
    list_select_related = ("decided_by",)
    search_fields = ("tool",)
    show_full_result_count = False
    list_per_page = 50
    actions = ("approve_intents", "reject_intents")
    fieldsets = (
        (None, {"fields": ("id", "status_badge", "tool", "run", "seq", "call_index", "key")}),
        ("Decision", {"fields": ("decided_by", "decided_at_display", "reason")}),
        ("Timestamps", {"fields": ("created_at_display", "updated_at_display")}),
    )
    readonly_fields = (
        "id",
        "status_badge",
        "tool",
        "run",
        "seq",
        "call_index",
        "key",
        "decided_by",
        "decided_at_display",
        "reason",
        "created_at_display",
        "updated_at_display",
    )

    created_at_display = _time_field("created_at", "created at")
    decided_at_display = _time_field("decided_at", "decided at")
    updated_at_display = _time_field("updated_at", "updated at")

    # -- columns ---------------------------------------------------------------------------

    @admin.display(description="run", ordering="run_id")
    def run_link(self, obj: ToolIntent) -> SafeString:
        url = reverse(f"{self.admin_site.name}:durable_agents_agentrun_change", args=[obj.run_id])
        return format_html('<a href="{}">{}</a>', url, str(obj.run_id)[:8])

    @admin.display(description="status", ordering="status")
    def status_badge(self, obj: ToolIntent) -> SafeString:
        return views.badge(obj.status, obj.get_status_display(), views.INTENT_COLORS)

    # -- ordering: what waits for a person first, oldest first -----------------------------

    def get_queryset(self, request: HttpRequest) -> QuerySet:
        return (
            super()
            .get_queryset(request)
            .annotate(
                _awaiting=Case(
                    When(status__in=AWAITING_PERSON, then=Value(0)),
                    default=Value(1),
                    output_field=IntegerField(),
                )
            )
        )

    def get_ordering(self, request: HttpRequest) -> list[Any]:
        # Waiting intents oldest first (a queue), decided ones newest first (a history).
        waiting_since = Case(When(status__in=AWAITING_PERSON, then=F("created_at")))
        return [
            F("_awaiting").asc(),
            waiting_since.asc(nulls_last=True),
            F("created_at").desc(),
        ]

    # -- permissions -----------------------------------------------------------------------

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # intents are written by runs, not people

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # decisions go through the decision views below

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_approve_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm(api.APPROVE_PERMISSION)

    # -- actions ---------------------------------------------------------------------------

    @admin.action(description="Approve selected pending intents", permissions=["approve"])
    def approve_intents(self, request: HttpRequest, queryset: QuerySet) -> HttpResponse | None:
        return self._decide_many(request, queryset, approve=True)

    @admin.action(description="Reject selected pending intents", permissions=["approve"])
    def reject_intents(self, request: HttpRequest, queryset: QuerySet) -> HttpResponse | None:
        return self._decide_many(request, queryset, approve=False)

    def _decide_many(
        self, request: HttpRequest, queryset: QuerySet, *, approve: bool
    ) -> HttpResponse | None:
        pending = queryset.filter(status=IntentStatus.PENDING).select_related("run")
        verb = "approve" if approve else "reject"
        if request.POST.get("post") != "yes":
            return self._render_confirmation(
                request,
                queryset,
                title=f"{verb.capitalize()} intents",
                question=(
                    "These irreversible calls will run once a worker resumes their runs."
                    if approve
                    else "These calls will not run; each model receives an error result "
                    "naming you and the reason."
                ),
                affected=pending.order_by("created_at"),
                skipped=queryset.count() - pending.count(),
                button=f"Yes, {verb} them",
                reason_field=not approve,
            )
        reason = request.POST.get("reason", "").strip()
        total = queryset.count()
        changed = 0
        for intent in pending.order_by("created_at"):
            if self._decide(request, intent, approve=approve, reason=reason):
                changed += 1
        self.message_user(
            request,
            f"{'Approved' if approve else 'Rejected'} {changed} intent(s); "
            f"{total - changed} skipped (not pending).",
            messages.SUCCESS if changed else messages.WARNING,
        )
        return None

    def _decide(
        self, request: HttpRequest, intent: ToolIntent, *, approve: bool, reason: str = ""
    ) -> bool:
        """Approve or reject through the api; True when this request made the decision."""
        before = intent.status
        if approve:
            after = api.approve_intent(intent.pk, request.user)
        else:
            after = api.reject_intent(intent.pk, request.user, reason=reason)
        decided = (
            before == IntentStatus.PENDING
            and after.status != IntentStatus.PENDING
            and after.decided_by_id == request.user.pk
        )
        if decided:
            message = "Approved." if approve else f"Rejected: {reason or 'no reason given'}."
            self.log_change(request, after, message)
        return decided

    # -- the intent page and its decision views --------------------------------------------

    def render_change_form(
        self,
        request: HttpRequest,
        context: dict[str, Any],
        add: bool = False,
        change: bool = False,
        form_url: str = "",
        obj: ToolIntent | None = None,
    ) -> HttpResponse:
        if obj is not None:
            can_decide = self.has_approve_permission(request)
            context.update(
                input_json=views.pretty_json(obj.input),
                turn=views.model_turn_for_intent(obj),
                can_decide=can_decide and obj.status == IntentStatus.PENDING,
                can_resolve=can_decide and obj.status == IntentStatus.UNKNOWN,
            )
        return super().render_change_form(request, context, add, change, form_url, obj)

    def get_urls(self) -> list[URLPattern]:
        name = self._object_url
        return [
            path(
                "<path:object_id>/approve/",
                self._post_view(self.approve_view),
                name=name("approve"),
            ),
            path(
                "<path:object_id>/reject/",
                self._post_view(self.reject_view),
                name=name("reject"),
            ),
            path(
                "<path:object_id>/resolve/",
                self._post_view(self.resolve_view),
                name=name("resolve"),
            ),
            *super().get_urls(),
        ]

    def _intent_for_decision(self, request: HttpRequest, object_id: str) -> ToolIntent:
        # Permission first: a forged POST learns nothing and changes nothing.
        if not self.has_approve_permission(request):
            raise PermissionDenied
        return get_object_or_404(ToolIntent, pk=object_id)

    def _already_decided(self, request: HttpRequest, intent: ToolIntent) -> None:
        intent.refresh_from_db()
        who = intent.decided_by.get_username() if intent.decided_by else "nobody"
        self.message_user(
            request,
            f"Intent {intent.pk} was already decided: it is {intent.get_status_display().lower()}"
            f" (decided by {who}). Nothing changed.",
            messages.WARNING,
        )

    def approve_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        intent = self._intent_for_decision(request, object_id)
        if self._decide(request, intent, approve=True):
            self.message_user(request, f"Approved intent {intent.pk}.", messages.SUCCESS)
        else:
            self._already_decided(request, intent)
        return self._redirect_to_object(intent)

    def reject_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        intent = self._intent_for_decision(request, object_id)
        reason = request.POST.get("reason", "").strip()
        if self._decide(request, intent, approve=False, reason=reason):
            self.message_user(request, f"Rejected intent {intent.pk}.", messages.SUCCESS)
        else:
            self._already_decided(request, intent)
        return self._redirect_to_object(intent)

    def resolve_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        intent = self._intent_for_decision(request, object_id)
        happened = request.POST.get("happened")
        if happened not in ("yes", "no"):
            self.message_user(request, "Say whether the call happened.", messages.ERROR)
            return self._redirect_to_object(intent)
        reason = request.POST.get("reason", "").strip()
        result = request.POST.get("result", "")
        before = intent.status
        after = api.resolve_intent(
            intent.pk, request.user, happened=happened == "yes", result=result, reason=reason
        )
        if before == IntentStatus.UNKNOWN and after.status != IntentStatus.UNKNOWN:
            message = (
                f"Resolved: it happened; recorded result {Truncator(result).chars(200)!r}."
                if happened == "yes"
                else "Resolved: it did not happen; the call runs again."
            )
            self.log_change(request, after, message + (f" {reason}" if reason else ""))
            self.message_user(request, f"Intent {intent.pk}: {message}", messages.SUCCESS)
        else:
            self._already_decided(request, intent)
        return self._redirect_to_object(intent)
