"""The durable_agents admin: runs and their transcripts, intents to decide, the dead letter and
an operations page.

Runs, steps and intents are never edited by hand: every page is read-only, and every change of
state is an action or a POST view that calls ``durable_agents.api``. AgentStep has a composite
primary key and cannot be registered; steps are shown on their run's page.

Hostile input is expected everywhere: model and tool text is escaped, marked where it cannot be
encoded (``durable_agents.text.storable_text``) and cut to a bound with a link to the whole;
malformed ids give 404; a confirmation page acts on exactly the objects it listed.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.views.main import ChangeList
from django.core.exceptions import PermissionDenied, ValidationError
from django.db.models import (
    Case,
    Exists,
    F,
    IntegerField,
    OuterRef,
    Q,
    QuerySet,
    TextField,
    Value,
    When,
)
from django.db.models.functions import Substr
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils.crypto import constant_time_compare
from django.utils.html import format_html
from django.utils.http import urlencode
from django.utils.safestring import SafeString
from django.utils.text import Truncator
from django.views.decorators.http import require_http_methods, require_POST

from durable_agents import admin_views as views
from durable_agents import api
from durable_agents.agents import AgentNotFound, registry
from durable_agents.models import (
    CANCELLABLE_STATUSES,
    AgentRun,
    AgentStep,
    IntentStatus,
    RunStatus,
    ToolEffect,
    ToolIntent,
)
from durable_agents.text import has_unstorable, storable_text

AWAITING_PERSON = (IntentStatus.PENDING, IntentStatus.UNKNOWN)
# A confirmation page lists, and posts back, at most this many objects: every one it lists,
# and nothing else. Kept under Django's DATA_UPLOAD_MAX_NUMBER_FIELDS (1000) with room for
# the fingerprints of intents.
RUN_ACTION_LIMIT = 500
INTENT_ACTION_LIMIT = 100
# An intent input longer than this (pretty-printed) is not approved from a list: a person
# reviews it on its own page.
BULK_INPUT_CHARS = 20_000
# What the model is told when a person rejects its call.
REASON_MAX_CHARS = 5_000
FINGERPRINT_FIELD = "fingerprint"


def _clean_pk(model: Any, value: Any) -> Any:
    """``value`` as ``model``'s primary key, or ValueError: for any string from a URL or a
    form (non-numbers, NUL, out-of-range integers that PostgreSQL would refuse)."""
    field = model._meta.pk
    try:
        pk = field.to_python(value)
    except (ValidationError, TypeError) as exc:
        raise ValueError(str(value)) from exc
    if pk is None:
        raise ValueError("no id")
    if isinstance(pk, int) and not -(2**63) <= pk < 2**63:
        raise ValueError(str(value))
    return pk


def _get_or_404(model: Any, object_id: Any, queryset: QuerySet | None = None) -> Any:
    """The object, or 404 for an unknown *or malformed* id (never a 500)."""
    try:
        pk = _clean_pk(model, object_id)
    except ValueError:
        raise Http404(f"No {model._meta.verbose_name} matches the given id.") from None
    try:
        return (queryset if queryset is not None else model._default_manager).get(pk=pk)
    except model.DoesNotExist:
        raise Http404(f"No {model._meta.verbose_name} matches the given id.") from None


def _no_unstorable(value: str) -> None:
    # Django's CharField already refuses NUL; a lone surrogate cannot be encoded either.
    if has_unstorable(value):
        raise ValidationError("Remove the NUL character or unpaired surrogate from this text.")


def plain_text_response(text: str) -> HttpResponse:
    """The whole of a text that a page showed cut: plain text that a browser never sniffs
    into HTML, nor runs anything from."""
    response = HttpResponse(storable_text(text), content_type="text/plain; charset=utf-8")
    response["X-Content-Type-Options"] = "nosniff"
    response["Content-Security-Policy"] = "default-src 'none'; sandbox"
    response["Content-Disposition"] = "inline"
    return response


@dataclass
class ConfirmRow:
    """One object of a confirmation page: what it shows, and whether "Yes" acts on it."""

    pk: str
    url: str
    label: str
    input: views.Text | None = None
    fingerprint: str = ""
    included: bool = True
    note: str = ""


class _OperationsMixin:
    """Shared helpers of the two ModelAdmins: object views and confirmation pages."""

    admin_site: admin.AdminSite
    opts: Any
    model: Any

    def _object_url(self, name: str) -> str:
        return f"{self.opts.app_label}_{self.opts.model_name}_{name}"

    def _url(self, name: str, *args: Any) -> str:
        return reverse(f"{self.admin_site.name}:{self._object_url(name)}", args=args)

    def _post_view(self, view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
        # admin_view: staff login and CSRF protection; require_POST: no GET changes state.
        return self.admin_site.admin_view(require_POST(view))

    def _confirm_view(self, view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
        # GET shows a confirmation, POST (CSRF-checked by admin_view) decides; nothing else.
        return self.admin_site.admin_view(require_http_methods(["GET", "HEAD", "POST"])(view))

    def _redirect_to_object(self, obj: Any) -> HttpResponseRedirect:
        return HttpResponseRedirect(self._url("change", obj.pk))

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        # A NUL in a filter or search term reaches PostgreSQL as a query parameter, which it
        # refuses (a 500): the list is shown without them, and says why.
        if any("\x00" in value for _, values in request.GET.lists() for value in values):
            self.message_user(  # type: ignore[attr-defined]
                request,
                "The search or a filter held a NUL character; showing the list without them.",
                messages.ERROR,
            )
            return HttpResponseRedirect(request.path)
        return super().changelist_view(request, extra_context)  # type: ignore[misc]

    def response_action(
        self, request: HttpRequest, queryset: QuerySet, **kwargs: Any
    ) -> HttpResponse | None:
        # Django filters pk__in=<posted ids>: a malformed id would be a 500 there. (Django 6
        # passes action_location too: keywords are handed on as they come.)
        try:
            for value in request.POST.getlist(helpers.ACTION_CHECKBOX_NAME):
                _clean_pk(self.model, value)
        except ValueError:
            self.message_user(  # type: ignore[attr-defined]
                request, "Malformed ids were posted; nothing was changed.", messages.ERROR
            )
            return HttpResponseRedirect(request.get_full_path())
        return super().response_action(request, queryset, **kwargs)  # type: ignore[misc]

    @staticmethod
    def _confirmed(request: HttpRequest) -> bool:
        """Whether this POST is the "Yes" of a confirmation page.

        Confirmation pages post the exact ids they listed, never select_across: a "Yes" that
        carries select_across would act on whatever matches the filters *now*, including
        objects created after the page was shown. Such a POST gets the confirmation page.
        """
        return request.POST.get("post") == "yes" and request.POST.get("select_across") != "1"

    @staticmethod
    def _posted_ids(request: HttpRequest) -> set[str]:
        return set(request.POST.getlist(helpers.ACTION_CHECKBOX_NAME))

    def _render_confirmation(
        self,
        request: HttpRequest,
        *,
        title: str,
        question: str,
        rows: list[ConfirmRow],
        matched: int,
        skipped: int,
        button: str,
        action: str,
        form_url: str,
        reason_form: forms.Form | None = None,
        status: int = 200,
    ) -> TemplateResponse:
        """The intermediate page of an action: every object it will act on is listed, and
        "Yes" posts exactly those ids (and, for intents, what was shown of each)."""
        included = [row for row in rows if row.included]
        context = {
            **self.admin_site.each_context(request),  # type: ignore[attr-defined]
            "title": title,
            "question": question,
            "opts": self.opts,
            "rows": rows,
            "included": included,
            "affected_count": len(included),
            "excluded_count": len(rows) - len(included),
            # Matching objects beyond the page's limit: not listed, so not acted on.
            "more_count": max(matched - len(rows), 0),
            "skipped_count": skipped,
            "button": button,
            "action": action,
            "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
            "fingerprint_field": FINGERPRINT_FIELD,
            "select_across": request.POST.get("select_across") == "1",
            "form_url": form_url,
            "reason_form": reason_form,
        }
        return TemplateResponse(
            request, "admin/durable_agents/action_confirmation.html", context, status=status
        )


# ---------------------------------------------------------------------------------------------
# Runs

TASK_HEAD_CHARS = 80
LAST_ERROR_CHARS = 60
LAST_ERROR_TITLE_CHARS = 500
# Run fields that can be long, each with a page of its own for the whole text.
RUN_TEXT_FIELDS = ("task", "result", "error")


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
    task = forms.CharField(
        widget=forms.Textarea(attrs={"rows": 10, "cols": 80}), validators=[_no_unstorable]
    )
    # A choice, not free text: a run may only pin a model that a registered version of its
    # agent declares (one that its prompts and tools were written for).
    model = forms.ChoiceField(
        required=False,
        help_text="Leave empty for the model of the chosen version; otherwise one of the models "
        "that the agent's registered versions use.",
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        agents = sorted(registry.all(), key=lambda a: (a.name, a.version))
        # The value is JSON so that any character in a name or version survives the round trip.
        self.fields["agent"].choices = [
            (json.dumps([a.name, a.version]), f"{a.name} @ {a.version} ({a.model})") for a in agents
        ]
        self.models_by_agent: dict[str, set[str]] = {}
        for agent in agents:
            self.models_by_agent.setdefault(agent.name, set()).add(agent.model)
        users: dict[str, list[str]] = {}
        for name, models in self.models_by_agent.items():
            for model in models:
                users.setdefault(model, []).append(name)
        self.fields["model"].choices = [
            ("", "The chosen version's own model"),
            *((model, f"{model} (for {', '.join(users[model])})") for model in sorted(users)),
        ]

    def clean(self) -> dict[str, Any]:
        data = super().clean()
        agent, model = data.get("agent"), data.get("model")
        if agent and model:
            name = json.loads(agent)[0]
            allowed = self.models_by_agent.get(name, set())
            if model not in allowed:
                self.add_error(
                    "model",
                    f"{model} is not a model of agent {name}; its versions use "
                    f"{', '.join(sorted(allowed)) or 'none'}.",
                )
        return data


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


def _text_html(text: views.Text) -> SafeString:
    """A possibly cut text as a read-only field: the same markup as the transcript's."""
    if not text.cut:
        return format_html('<div class="da-pre">{}</div>', text.text)
    if text.url:
        more = format_html('<a href="{}">the whole text ({} characters)</a>', text.url, text.length)
    else:
        more = format_html("{} characters in all", text.length)
    return format_html(
        '<div class="da-pre">{}<span class="da-cut">… [cut: {}]</span></div>', text.text, more
    )


def _run_text_field(field_name: str) -> Callable[[Any, Any], SafeString | str]:
    """A read-only field printing a long text of the run, cut with a link to the whole."""

    @admin.display(description=field_name)
    def show(self: AgentRunAdmin, obj: AgentRun) -> SafeString | str:
        value = getattr(obj, field_name)
        if not value:
            return self.get_empty_value_display()
        url = self._url("text", obj.pk, field_name)
        return _text_html(views.shown_text(value, url))

    show.__name__ = f"{field_name}_text"
    return show


CLAIMS_HELP = (
    "how many times a worker took this run (after a crash, a deploy or a person's decision)"
)
# The error of these runs is what a person came for: the run page shows it first.
ERROR_FIRST_STATUSES = (RunStatus.DEAD, RunStatus.FAILED)


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
    search_fields = ("task",)  # plus ids, errors, models and request ids: get_search_results
    search_help_text = (
        "A run id or its first characters, a request id (req_...), a model, or words of the "
        "task or the error."
    )
    date_hierarchy = "created_at"
    ordering = ("-created_at",)
    show_full_result_count = False
    list_select_related = False  # every column lives on agent_run itself
    list_per_page = 50
    actions = ("cancel_runs", "requeue_runs")
    fieldsets = (
        (
            None,
            {"fields": ("id", "status_badge", "agent", "prompt_version", "model", "task_text")},
        ),
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
        ("Outcome", {"fields": ("result_text", "error_text")}),
        ("Pinning", {"classes": ("collapse",), "fields": ("fingerprint",)}),
    )
    readonly_fields = (
        "id",
        "status_badge",
        "agent",
        "prompt_version",
        "model",
        "task_text",
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
        "result_text",
        "error_text",
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
    task_text = _run_text_field("task")
    result_text = _run_text_field("result")
    error_text = _run_text_field("error")

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
            '{} @ {}<br><span class="da-meta">{}</span>',
            storable_text(obj.agent),
            storable_text(obj.prompt_version),
            storable_text(obj.model),
        )

    @admin.display(description="task")
    def task_excerpt(self, obj: AgentRun) -> SafeString:
        """The task's first line, and under it the start of the error if there is one."""
        head = getattr(obj, "task_head", None) or obj.task
        first_line = next((line for line in head.splitlines() if line.strip()), "")
        task = Truncator(storable_text(first_line)).chars(60)
        if not obj.error:
            return format_html("{}", task)
        error = storable_text(obj.error[: LAST_ERROR_TITLE_CHARS + 1])
        return format_html(
            '{}<br><span class="da-list-error" title="{}">{}</span>',
            task,
            Truncator(error).chars(LAST_ERROR_TITLE_CHARS),
            Truncator(error).chars(LAST_ERROR_CHARS),
        )

    @admin.display(description="steps", ordering="last_seq")
    def steps(self, obj: AgentRun) -> int:
        return obj.last_seq + 1  # seq 0 is the task; no per-row query

    @admin.display(description="claims", ordering="attempt")
    def claims(self, obj: AgentRun) -> int:
        return obj.attempt

    @admin.display(description="lease", ordering="lease_until")
    def lease(self, obj: AgentRun) -> SafeString | None:
        return views.lease_summary(
            storable_text(obj.lease_owner) if obj.lease_owner else obj.lease_owner,
            obj.lease_until,
        )

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
        """What an operator has in hand: an id as the list shows it (its first characters),
        a whole id, a request id from a support ticket or an error, a model, words."""
        term = storable_text(search_term).strip()
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
        found = (
            Q(task__icontains=term)
            | Q(error__icontains=term)
            | Q(model__icontains=term)
            | Q(agent__icontains=term)
            | by_request
        )
        digits = term.replace("-", "").lower()
        if 4 <= len(digits) <= 32 and all(c in "0123456789abcdef" for c in digits):
            # An id prefix as a range of ids: the same on PostgreSQL (uuid, ordered bytewise)
            # and SQLite (32 lowercase hex digits), and served by the primary key's index,
            # unlike a cast to text. Dashes are ignored, as in a pasted "3f2a1c9e-12".
            low = uuid.UUID(digits.ljust(32, "0"))
            high = uuid.UUID(digits.ljust(32, "f"))
            found |= Q(pk__gte=low, pk__lte=high)
        return queryset.filter(found), False

    def lookup_allowed(self, lookup: str, value: str, request: HttpRequest | None = None) -> bool:
        # Older dead-letter links filter runs whose error starts with a reason.
        if lookup == "error__startswith":
            return True
        return super().lookup_allowed(lookup, value, request)

    # -- actions ---------------------------------------------------------------------------

    @admin.action(description="Cancel selected runs", permissions=["operate"])
    def cancel_runs(self, request: HttpRequest, queryset: QuerySet) -> HttpResponse | None:
        return self._run_operation(request, queryset, "cancel_runs")

    @admin.action(description="Requeue selected dead runs", permissions=["operate"])
    def requeue_runs(self, request: HttpRequest, queryset: QuerySet) -> HttpResponse | None:
        return self._run_operation(request, queryset, "requeue_runs")

    # action -> (statuses it applies to, api function name, verb, past tense, question)
    RUN_OPERATIONS: dict[str, tuple[tuple[str, ...], str, str, str, str]] = {
        "cancel_runs": (
            tuple(CANCELLABLE_STATUSES),
            "cancel_run",
            "cancel",
            "Cancelled",
            "These runs will be cancelled. A worker holding one stops at its next step; "
            "nothing it committed is undone.",
        ),
        "requeue_runs": (
            (RunStatus.DEAD,),
            "requeue_run",
            "requeue",
            "Requeued",
            "These dead runs go back to pending and resume at their first uncommitted step.",
        ),
    }

    def _run_operation(
        self,
        request: HttpRequest,
        queryset: QuerySet,
        action: str,
        *,
        form_url: str | None = None,
        title_suffix: str = "",
    ) -> HttpResponse | None:
        statuses, function, verb, done, question = self.RUN_OPERATIONS[action]
        eligible = queryset.filter(status__in=statuses)
        if not self._confirmed(request):
            matched = eligible.count()
            runs = eligible.order_by("-created_at").only(
                "id", "agent", "prompt_version", "status", "created_at"
            )[:RUN_ACTION_LIMIT]
            rows = [
                ConfirmRow(
                    pk=str(run.pk),
                    url=self._url("change", run.pk),
                    label=storable_text(str(run)),
                )
                for run in runs
            ]
            return self._render_confirmation(
                request,
                title=f"{verb.capitalize()} runs{title_suffix}",
                question=question,
                rows=rows,
                matched=matched,
                skipped=queryset.count() - matched,
                button=f"Yes, {verb} them",
                action=action,
                form_url=form_url or request.get_full_path(),
            )
        # The "Yes" of a confirmation page: Django filtered the queryset to the posted ids.
        operation: Callable[[Any], bool] = getattr(api, function)
        total = len(self._posted_ids(request))
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
        view = self.admin_site.admin_view
        return [
            path("operations/", view(self.operations_view), name=name("operations")),
            path("dead-letter/", view(self.dead_letter_view), name=name("dead_letter")),
            path(
                "dead-letter/<str:key>/<str:action>/",
                view(self.dead_letter_confirm_view),
                name=name("dead_letter_confirm"),
            ),
            path(
                "<path:object_id>/cancel/", self._post_view(self.cancel_view), name=name("cancel")
            ),
            path(
                "<path:object_id>/requeue/",
                self._post_view(self.requeue_view),
                name=name("requeue"),
            ),
            path(
                "<path:object_id>/steps/<int:seq>/",
                view(self.step_text_view),
                name=name("step_text"),
            ),
            path(
                "<path:object_id>/effects/<str:key>/",
                view(self.effect_text_view),
                name=name("effect_text"),
            ),
            path(
                "<path:object_id>/text/<str:field>/",
                view(self.run_text_view),
                name=name("text"),
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
            run_pk = obj.pk

            def step_url(seq: int, block: int | None = None) -> str:
                url = self._url("step_text", run_pk, seq)
                return url if block is None else f"{url}?{urlencode({'block': block})}"

            transcript = views.build_transcript(
                obj,
                request.GET.get("page"),
                request.GET.get("seq"),
                step_url=step_url,
                effect_url=lambda key: self._url("effect_text", run_pk, key),
            )
            run_error = None
            if obj.status in ERROR_FIRST_STATUSES and obj.error:
                run_error = views.shown_text(obj.error, self._url("text", run_pk, "error"))
            context.update(
                transcript=transcript,
                run_error=run_error,
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
                form.add_error(None, storable_text(exc))
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
        run = _get_or_404(AgentRun, object_id, AgentRun.objects.only("pk", "status"))
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

    # -- the whole of a text the run page cut ----------------------------------------------

    def _run_for_text(self, request: HttpRequest, object_id: str, *fields: str) -> AgentRun:
        if not self.has_view_permission(request):
            raise PermissionDenied
        return _get_or_404(AgentRun, object_id, AgentRun.objects.only("pk", *fields))

    def step_text_view(self, request: HttpRequest, object_id: str, seq: int) -> HttpResponse:
        """One step, or one block of it (``?block=N``), as plain text."""
        run = self._run_for_text(request, object_id)
        step = AgentStep.objects.filter(run_id=run.pk, seq=seq).first()
        if step is None:
            raise Http404("No such step.")
        block_param = request.GET.get("block")
        block: int | None = None
        if block_param is not None:
            try:
                block = int(block_param)
            except ValueError:
                raise Http404("No such block.") from None
        try:
            data = views.load_json(step.payload)
        except ValueError:
            if block is not None:
                raise Http404("No such block.") from None
            return plain_text_response(step.payload)
        text = views.block_text(step.kind, data, block)
        if text is None:
            raise Http404("No such block.")
        return plain_text_response(text)

    def effect_text_view(self, request: HttpRequest, object_id: str, key: str) -> HttpResponse:
        """The recorded result of one tool call, as plain text."""
        run = self._run_for_text(request, object_id)
        effect = ToolEffect.objects.filter(run_id=run.pk, key=key).only("result").first()
        if effect is None:
            raise Http404("No such effect.")
        result = effect.result
        return plain_text_response(result if isinstance(result, str) else views.pretty_json(result))

    def run_text_view(self, request: HttpRequest, object_id: str, field: str) -> HttpResponse:
        """The task, result or error of a run, as plain text."""
        if field not in RUN_TEXT_FIELDS:
            raise Http404("No such text.")
        run = self._run_for_text(request, object_id, field)
        return plain_text_response(getattr(run, field) or "")

    # -- dead letter and operations --------------------------------------------------------

    def dead_letter_view(self, request: HttpRequest) -> HttpResponse:
        if not self.has_view_permission(request):
            raise PermissionDenied
        groups, grouped, total = views.dead_letter_groups()
        context = {
            **self.admin_site.each_context(request),
            "title": "Dead letter",
            "opts": self.opts,
            "groups": groups,
            "grouped": grouped,
            "total": total,
            "can_operate": self.has_operate_permission(request),
            "action_limit": RUN_ACTION_LIMIT,
        }
        return TemplateResponse(request, "admin/durable_agents/agentrun/dead_letter.html", context)

    def dead_letter_confirm_view(self, request: HttpRequest, key: str, action: str) -> HttpResponse:
        """The confirmation page of a group's requeue or cancel: it lists the group's runs (at
        most RUN_ACTION_LIMIT) and its "Yes" posts exactly their ids to the runs list."""
        if action not in self.RUN_OPERATIONS:
            raise Http404("No such operation.")
        if not self.has_operate_permission(request):
            raise PermissionDenied
        group = next((g for g in views.dead_letter_groups()[0] if g.key == key), None)
        if group is None:
            self.message_user(
                request, "That group is gone: its runs are no longer dead.", messages.WARNING
            )
            return HttpResponseRedirect(self._url("dead_letter"))
        queryset = AgentRun.objects.filter(pk__in=group.run_ids[:RUN_ACTION_LIMIT])
        form_url = f"{self._url('changelist')}?{urlencode({'status__exact': RunStatus.DEAD})}"
        example = views.cut_at_word(group.example, 60)[0]
        return self._run_operation(
            request, queryset, action, form_url=form_url, title_suffix=f": “{example}”"
        )  # type: ignore[return-value]

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

INPUT_HEAD_CHARS = 200
INPUT_COLUMN_CHARS = 60


class IntentChangeList(ChangeList):
    """The intents list reads the head of each input, not the whole JSON (it can be large)."""

    def get_queryset(self, request: HttpRequest, exclude_parameters: Any = None) -> QuerySet:
        return (
            super()
            .get_queryset(request, exclude_parameters)
            # TextField: the head of the JSON text is not JSON, so it must not be decoded.
            .annotate(input_head=Substr("input", 1, INPUT_HEAD_CHARS, output_field=TextField()))
            .defer("input")
        )


class RejectForm(forms.Form):
    reason = forms.CharField(
        label="Reason (the model sees it)",
        max_length=REASON_MAX_CHARS,
        widget=forms.Textarea(attrs={"rows": 3, "cols": 60}),
        validators=[_no_unstorable],
        error_messages={"required": "Say why: the model reads the reason and you are named."},
    )


class ResolveForm(forms.Form):
    happened = forms.ChoiceField(
        choices=[("yes", "yes"), ("no", "no")],
        error_messages={"required": "Say whether the call happened."},
    )
    result = forms.CharField(required=False, strip=False, validators=[_no_unstorable])
    reason = forms.CharField(
        required=False, max_length=REASON_MAX_CHARS, validators=[_no_unstorable]
    )


@admin.register(ToolIntent)
class ToolIntentAdmin(_OperationsMixin, admin.ModelAdmin):
    # Sized for 1280 px with the nav sidebar and the filters: the input (head, monospace)
    # is the widest column; who decided and when share one column. See the list template.
    list_display = (
        "intent_id",
        "tool_name",
        "input_excerpt",
        "run_link",
        "status_short",
        "decided",
    )
    list_display_links = ("intent_id", "tool_name")
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

    @admin.display(description="intent", ordering="created_at")
    def intent_id(self, obj: ToolIntent) -> SafeString:
        """The id, and the intent's age under it (sorts by creation)."""
        if not obj.created_at:
            return format_html("#{}", obj.pk)
        return format_html(
            '#{}<br><span class="da-meta" title="created {}">{} ago</span>',
            obj.pk,
            views.format_time(obj.created_at),
            views.compact_age(obj.created_at),
        )

    @admin.display(description="tool", ordering="tool")
    def tool_name(self, obj: ToolIntent) -> str:
        return storable_text(obj.tool)

    @admin.display(description="input")
    def input_excerpt(self, obj: ToolIntent) -> SafeString:
        """The head of the input's JSON: three drop_table rows no longer look the same."""
        head = getattr(obj, "input_head", None)
        if head is None:
            head = views.pretty_json(obj.input)
        head = storable_text(head)
        return format_html(
            '<code class="da-input" title="{}">{}</code>',
            head,
            Truncator(head).chars(INPUT_COLUMN_CHARS),
        )

    @admin.display(description="run", ordering="run_id")
    def run_link(self, obj: ToolIntent) -> SafeString:
        url = reverse(f"{self.admin_site.name}:durable_agents_agentrun_change", args=[obj.run_id])
        return format_html('<a href="{}">{}</a>', url, str(obj.run_id)[:8])

    @admin.display(description="status", ordering="status")
    def status_badge(self, obj: ToolIntent) -> SafeString:
        return views.intent_badge(obj)

    @admin.display(description="status", ordering="status")
    def status_short(self, obj: ToolIntent) -> SafeString:
        return views.intent_badge(obj, short=True)

    @admin.display(description="decided", ordering="decided_at")
    def decided(self, obj: ToolIntent) -> SafeString | str:
        """Who decided, and how long ago under it (the time itself in the title)."""
        if obj.decided_by is None and obj.decided_at is None:
            return self.get_empty_value_display()
        who = storable_text(obj.decided_by.get_username()) if obj.decided_by else "—"
        if obj.decided_at is None:
            return format_html("{}", who)
        return format_html(
            '{}<br><span class="da-meta" title="{}">{} ago</span>',
            who,
            views.format_time(obj.decided_at),
            views.compact_age(obj.decided_at),
        )

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return IntentChangeList

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
                ),
                # A done intent whose tool raised is not a success: its badge says so.
                _raised=Exists(ToolEffect.objects.filter(key=OuterRef("key"), is_error=True)),
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

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet, search_term: str
    ) -> tuple[QuerySet, bool]:
        return super().get_search_results(request, queryset, storable_text(search_term))

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

    def _intent_rows(self, intents: list[ToolIntent], *, approve: bool) -> list[ConfirmRow]:
        """Each intent with its exact input; an approval row also carries the fingerprint of
        what it shows. An input too long to review in a list is shown cut and left out."""
        rows = []
        for intent in intents:
            url = self._url("change", intent.pk)
            label = f"#{intent.pk} {storable_text(intent.tool)} for run {str(intent.run_id)[:8]}"
            text = views.shown_json(intent.input)
            row = ConfirmRow(pk=str(intent.pk), url=url, label=label)
            if approve and len(text) > BULK_INPUT_CHARS:
                row.input = views.shown_text(text, url)
                row.included = False
                row.note = "too long to review in a list: approve it from its own page"
            elif approve:
                row.input = views.Text(text, len(text))
                row.fingerprint = views.intent_fingerprint(intent)
            else:
                row.input = views.shown_text(text, url)
            rows.append(row)
        return rows

    def _decide_many(
        self, request: HttpRequest, queryset: QuerySet, *, approve: bool
    ) -> HttpResponse | None:
        # defer(None): the list's queryset leaves the input out, and every row shows it.
        pending = queryset.filter(status=IntentStatus.PENDING).order_by("created_at").defer(None)
        verb = "approve" if approve else "reject"
        action = "approve_intents" if approve else "reject_intents"
        reason_form = None if approve else RejectForm(request.POST or None)
        confirmed = self._confirmed(request)
        if not confirmed or (reason_form is not None and not reason_form.is_valid()):
            if not confirmed and reason_form is not None:
                reason_form = RejectForm()  # the first showing: no errors yet
            matched = pending.count()
            rows = self._intent_rows(list(pending[:INTENT_ACTION_LIMIT]), approve=approve)
            return self._render_confirmation(
                request,
                title=f"{verb.capitalize()} intents",
                question=(
                    "These irreversible calls will run, each with exactly the input shown, "
                    "once a worker resumes their runs."
                    if approve
                    else "These calls will not run; each model receives an error result "
                    "naming you and the reason."
                ),
                rows=rows,
                matched=matched,
                skipped=queryset.count() - matched,
                button=f"Yes, {verb} them",
                action=action,
                form_url=request.get_full_path(),
                reason_form=reason_form,
            )
        reason = reason_form.cleaned_data["reason"] if reason_form is not None else ""
        total = len(self._posted_ids(request))
        changed = differs = 0
        for intent in pending.select_related(None):
            if approve:
                shown = request.POST.get(f"{FINGERPRINT_FIELD}-{intent.pk}", "")
                if not constant_time_compare(shown, views.intent_fingerprint(intent)):
                    differs += 1
                    continue
            if self._decide(request, intent, approve=approve, reason=reason):
                changed += 1
        message = (
            f"{'Approved' if approve else 'Rejected'} {changed} intent(s); "
            f"{total - changed - differs} skipped (not pending)."
        )
        if differs:
            message += f" {differs} not approved: what was shown is not what they hold."
        self.message_user(
            request, message, messages.SUCCESS if changed and not differs else messages.WARNING
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

    def _step_url(self, run_id: Any) -> views.StepUrl:
        def step_url(seq: int, block: int | None = None) -> str:
            url = reverse(
                f"{self.admin_site.name}:durable_agents_agentrun_step_text", args=[run_id, seq]
            )
            return url if block is None else f"{url}?{urlencode({'block': block})}"

        return step_url

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
                tool=storable_text(obj.tool),
                input_json=views.shown_json(obj.input),
                turn=views.model_turn_for_intent(obj, self._step_url(obj.run_id)),
                can_decide=can_decide and obj.status == IntentStatus.PENDING,
                can_resolve=can_decide and obj.status == IntentStatus.UNKNOWN,
                reject_form=RejectForm(auto_id="id_reject_%s"),
            )
        return super().render_change_form(request, context, add, change, form_url, obj)

    def get_urls(self) -> list[URLPattern]:
        name = self._object_url
        return [
            # GET: the confirmation page (the exact input); POST: the decision.
            path(
                "<path:object_id>/approve/",
                self._confirm_view(self.approve_view),
                name=name("approve"),
            ),
            path(
                "<path:object_id>/reject/",
                self._confirm_view(self.reject_view),
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
        return _get_or_404(ToolIntent, object_id, ToolIntent.objects.select_related("decided_by"))

    def _already_decided(self, request: HttpRequest, intent: ToolIntent) -> None:
        intent.refresh_from_db()
        who = storable_text(intent.decided_by.get_username()) if intent.decided_by else "nobody"
        self.message_user(
            request,
            f"Intent {intent.pk} was already decided: it is {intent.get_status_display().lower()}"
            f" (decided by {who}). Nothing changed.",
            messages.WARNING,
        )

    def _render_decision(
        self,
        request: HttpRequest,
        intent: ToolIntent,
        *,
        approve: bool,
        form: forms.Form | None = None,
        status: int = 200,
    ) -> TemplateResponse:
        verb = "Approve" if approve else "Reject"
        context = {
            **self.admin_site.each_context(request),
            "title": f"{verb} {storable_text(intent.tool)} (intent {intent.pk})?",
            "opts": self.opts,
            "original": intent,
            "tool": storable_text(intent.tool),
            "input_json": views.shown_json(intent.input),
            "approve": approve,
            "pending": intent.status == IntentStatus.PENDING,
            "status_badge": views.intent_badge(intent, raised=False),
            "fingerprint_field": FINGERPRINT_FIELD,
            "fingerprint": views.intent_fingerprint(intent),
            "form": form,
        }
        return TemplateResponse(
            request, "admin/durable_agents/toolintent/decide.html", context, status=status
        )

    def approve_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """GET: the exact input, and a form carrying its fingerprint; POST: approve it, only
        if the fingerprint posted is that of the intent now (what was shown is approved)."""
        intent = self._intent_for_decision(request, object_id)
        if request.method != "POST":
            return self._render_decision(request, intent, approve=True)
        shown = request.POST.get(FINGERPRINT_FIELD, "")
        if not constant_time_compare(shown, views.intent_fingerprint(intent)):
            self.message_user(
                request,
                "Nothing was approved: this confirmation did not show the intent's current "
                "input. Check the input below, then approve again.",
                messages.ERROR,
            )
            return HttpResponseRedirect(self._url("approve", intent.pk))
        if self._decide(request, intent, approve=True):
            self.message_user(request, f"Approved intent {intent.pk}.", messages.SUCCESS)
        else:
            self._already_decided(request, intent)
        return self._redirect_to_object(intent)

    def reject_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """GET: the input and a reason to give; POST: reject with a valid reason, or show the
        form again with its errors."""
        intent = self._intent_for_decision(request, object_id)
        if request.method != "POST":
            return self._render_decision(request, intent, approve=False, form=RejectForm())
        form = RejectForm(request.POST)
        if not form.is_valid():
            return self._render_decision(request, intent, approve=False, form=form)
        reason = form.cleaned_data["reason"]
        if self._decide(request, intent, approve=False, reason=reason):
            self.message_user(request, f"Rejected intent {intent.pk}.", messages.SUCCESS)
        else:
            self._already_decided(request, intent)
        return self._redirect_to_object(intent)

    def resolve_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        intent = self._intent_for_decision(request, object_id)
        form = ResolveForm(request.POST)
        if not form.is_valid():
            errors = " ".join(str(e) for errors in form.errors.values() for e in errors)
            self.message_user(request, errors, messages.ERROR)
            return self._redirect_to_object(intent)
        happened = form.cleaned_data["happened"]
        reason = form.cleaned_data["reason"]
        result = form.cleaned_data["result"]
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
