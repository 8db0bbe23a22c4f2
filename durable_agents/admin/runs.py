"""The runs list and the run page."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.utils import unquote
from django.contrib.admin.views.main import ChangeList
from django.core.exceptions import PermissionDenied
from django.db.models import (
    QuerySet,
)
from django.db.models.functions import Substr
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils.html import format_html
from django.utils.http import urlencode
from django.utils.safestring import SafeString
from django.utils.text import Truncator
from django.utils.translation import gettext
from django.utils.translation import gettext_lazy as _

from durable_agents import api
from durable_agents._internal.counting import bounded_count
from durable_agents._internal.text import plain_markers, revealed, storable_text
from durable_agents.admin.base import (
    AdminPage,
    CountedChangeList,
    ReadOnlyAdmin,
    clean_pk,
    get_or_404,
)
from durable_agents.admin.batches import batch_wait
from durable_agents.admin.capacity import CapacityPage
from durable_agents.admin.costs import list_cost, run_page_cost
from durable_agents.admin.dead_letter import DeadLetterPages
from durable_agents.admin.filters import FamilyFilter, IndexedValuesFilter, WaitingForFilter
from durable_agents.admin.forks import ForkPages
from durable_agents.admin.format import (
    RUN_COLORS,
    RUN_SHORT_LABELS,
    ago,
    badge,
    created_title,
    lease_summary,
    load_json,
    plain_text_response,
    pretty_json,
    revealed_excerpt,
    revealed_field,
    shown_text,
    sql_hint,
    text_html,
    time_field,
)
from durable_agents.admin.forms import AnswerForm, SendEventForm, StartRunForm
from durable_agents.admin.keys import KeyFilter, attach_key_states
from durable_agents.admin.keys import detail as key_detail
from durable_agents.admin.keys import list_summary as key_list_summary
from durable_agents.admin.listing import EstimatingPaginator, search_note, search_runs
from durable_agents.admin.live import live_context
from durable_agents.admin.operations import OperationsPage
from durable_agents.admin.questions import answer_as, question_text_url
from durable_agents.admin.run_actions import RunActions
from durable_agents.admin.transcript import block_text, build_transcript
from durable_agents.admin.undecodable import (
    Undecodable,
    decode_raw,
    reading_raw,
    run_reading_what_decodes,
)
from durable_agents.admin.upgrades import UpgradePages
from durable_agents.admin.waits import attach_waits, run_children, run_questions
from durable_agents.admin.workers import worker_wait
from durable_agents.declare.agents import AgentNotFound
from durable_agents.forks.upgrades import carries_over
from durable_agents.models import (
    CANCELLABLE_STATUSES,
    AgentEvent,
    AgentMessage,
    AgentQuestion,
    AgentRun,
    RunStatus,
    ToolEffect,
    WaitKind,
    short_id,
)
from durable_agents.models.forks import log_of
from durable_agents.models.runs import (
    id_range,
    run_id_prefix,
    run_id_tail,
    time_ordered_id_ending,
)

if TYPE_CHECKING:
    from django_stubs_ext import StrOrPromise


TASK_HEAD_CHARS = 80
# The messages waiting in a run's inbox that its page lists (send_message); once folded they
# are steps of the transcript.
INBOX_SHOWN = 20
LAST_ERROR_CHARS = 60
LAST_ERROR_TITLE_CHARS = 500
# Run fields that can be long, each with a page of its own for the whole text.
RUN_TEXT_FIELDS = ("task", "result", "output", "error")
_P = TypeVar("_P", bound=AdminPage[Any])


class RunChangeList(CountedChangeList):
    """The runs list reads the head of each task, not the whole text (tasks can be long), and
    what the page's waiting runs wait for in at most three queries (``attach_waits``)."""

    def get_queryset(self, request: HttpRequest, exclude_parameters: Any = None) -> QuerySet[Any]:
        queryset: QuerySet[Any] = (
            super()
            .get_queryset(request, exclude_parameters)
            .annotate(task_head=Substr("task", 1, TASK_HEAD_CHARS))
            # woken_by can hold an event's whole payload: the list never shows it.
            .defer("task", "result", "output", "fingerprint", "woken_by", "metadata")
        )
        # wait_runs as text, decoded per row: one run's undecodable wait cannot fail the list.
        return reading_raw(queryset, "wait_runs")

    def get_results(self, request: HttpRequest) -> None:
        super().get_results(request)
        for run in self.result_list:
            decode_raw(run, "wait_runs")
        # Evaluates the page's queryset once; the template iterates the same (cached) rows.
        attach_waits(list(self.result_list))
        attach_key_states(list(self.result_list))


def _run_text_field(
    field_name: str, description: StrOrPromise
) -> Callable[[Any, Any], SafeString | str]:
    """A read-only field printing a long text of the run, cut with a link to the whole."""

    @admin.display(description=description)
    def show(self: AgentRunAdmin, obj: AgentRun) -> SafeString | str:
        value = getattr(obj, field_name)
        if not value:
            return self.get_empty_value_display()
        url = self._url("text", obj.pk, field_name)
        return text_html(shown_text(value, url))

    show.__name__ = f"{field_name}_text"
    return show


CLAIMS_HELP = _(
    "how many times a worker took this run (after a crash, a deploy or a person's decision)"
)
# The error of these runs is what a person came for: the run page shows it first.
ERROR_FIRST_STATUSES = (RunStatus.DEAD, RunStatus.FAILED)


class AgentRunAdmin(RunActions, ReadOnlyAdmin[AgentRun]):
    """The runs list and the run page, with the run actions (cancel, requeue, send an event),
    and the pages that live under the runs' URLs (``pages``)."""

    # Built with this admin in __init__; their URLs are the runs' (get_urls).
    pages: ClassVar[tuple[type[AdminPage[Any]], ...]] = (
        # First: its "dead-letter/carry-over/" comes before the dead letter's paths.
        UpgradePages,
        ForkPages,
        CapacityPage,
        OperationsPage,
        DeadLetterPages,
    )
    # Sized for 1280 px with the nav sidebar and the filters (a 631 px table): the age under
    # the run id, the model under the agent, the error (truncated) under the task, one lease
    # column and short headers; admin.css sets the widths.
    list_display = (
        "short_id",
        "status_short",
        "agent_version",
        "task_excerpt",
        "steps_and_cost",
        "claims",
        "lease",
    )
    # At production size (docs/howto/admin-at-scale.md): every filter is an index condition,
    # agent and model and priority list their values by a skip scan, "created" is a range (no date
    # hierarchy, which reads the dates of every row), and the list sorts by creation only.
    list_filter = (
        "status",
        WaitingForFilter,
        FamilyFilter,
        ("priority", IndexedValuesFilter),
        KeyFilter,
        ("agent", IndexedValuesFilter),
        ("model", IndexedValuesFilter),
        "created_at",
    )
    search_fields = ("task",)  # the whole search is search_runs: get_search_results
    # The filters the app's own pages link to (operations, dead letter, events, a parent's
    # children) beyond list_filter; any other lookup is refused (StrictChangeList).
    list_lookups = (
        "agent",
        "model",
        "dead_cause",
        "error__startswith",
        "wait_event",
        "parent__id__exact",
    )
    search_help_text = _(
        "A run id or its first characters, a request id (req_...) or its first characters, "
        "a start key, a concurrency key, an agent or a model, or words of the task or of a "
        "dead or failed run's reason; meta:key=value for the runs whose metadata has that "
        "value (meta:tenant=acme)."
    )
    ordering = ("-created_at",)
    paginator = EstimatingPaginator
    show_full_result_count = False
    show_facets = admin.ShowFacets.NEVER  # facet counts would count the whole table
    list_select_related = False  # every column lives on agent_run itself
    list_per_page = 50
    actions = ("cancel_runs", "requeue_runs", "send_events", "upgrade_runs")
    fieldsets = (
        (
            None,
            {
                "fields": (
                    "id",
                    "status_badge",
                    "agent_shown",
                    "prompt_version_shown",
                    "model_shown",
                    "priority",
                    "task_text",
                )
            },
        ),
        (
            _("Progress"),
            {
                "fields": (
                    "steps",
                    "tokens_used",
                    "cost",
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
        (_("Outcome"), {"fields": ("result_text", "error_text")}),
        (_("Pinning"), {"classes": ("collapse",), "fields": ("fingerprint",)}),
    )
    readonly_fields = (
        "id",
        "status_badge",
        "agent_shown",
        "prompt_version_shown",
        "model_shown",
        "priority",
        "task_text",
        "steps",
        "tokens_used",
        "cost",
        "attempt",
        "stalled_claims",
        "lease_owner",
        "lease_until_display",
        "created_at_display",
        "started_at_display",
        "updated_at_display",
        "finished_at_display",
        "result_text",
        "output_text",
        "error_text",
        "fingerprint",
        "start_key_shown",
        "parent_link",
        "spawn_key",
        "depth",
        "waiting_for",
        "waiting_since_display",
        "wake_at_display",
        "wait_event",
        "woken_by_text",
        "concurrency",
        "metadata_text",
        "batch_mode",
    )
    # Shown on the page of a child run, and of a run that has waited.
    child_fieldset = (_("Child run"), {"fields": ("parent_link", "spawn_key", "depth")})
    wait_fieldset = (
        _("Last wait"),
        {
            "fields": (
                "waiting_for",
                "waiting_since_display",
                "wake_at_display",
                "wait_event",
                "woken_by_text",
            )
        },
    )
    # Labels and help of read-only fields come from the form's Meta (see get_form).
    field_labels: ClassVar[dict[str, StrOrPromise]] = {
        "attempt": _("claims"),
        "tokens_used": _("tokens used"),
        "waiting_for": _("waited for"),
        "wait_event": _("event"),
        "spawn_key": _("spawn key"),
        "start_key_shown": _("start key"),
        "priority": _("priority"),
    }
    field_help_texts: ClassVar[dict[str, StrOrPromise]] = {
        "attempt": CLAIMS_HELP,
        "start_key_shown": _(
            "the key it was started with: starting it again with it returns this run"
        ),
        "priority": _("0 to 100: workers claim the highest first, then the oldest"),
        "started_at_display": _("first claim"),
        "wake_at_display": _("a timer's due time, or the timeout of an event or child runs wait"),
        "woken_by_text": _("what ended the wait: the waiting call receives it"),
        "output_text": _("the final answer as JSON, validated against the agent's output schema"),
        "metadata_text": _(
            "what the product attached to the run when it started it; stored unencrypted, "
            "searchable with meta:key=value"
        ),
    }

    agent_shown = revealed_field("agent", _("agent"))
    prompt_version_shown = revealed_field("prompt_version", _("prompt version"))
    model_shown = revealed_field("model", _("model"))
    start_key_shown = revealed_field("start_key", _("start key"))
    lease_until_display = time_field("lease_until", _("lease until"))
    created_at_display = time_field("created_at", _("created at"))
    started_at_display = time_field("started_at", _("started at"))
    updated_at_display = time_field("updated_at", _("updated at"))
    finished_at_display = time_field("finished_at", _("finished at"))
    task_text = _run_text_field("task", _("task"))
    result_text = _run_text_field("result", _("result"))
    error_text = _run_text_field("error", _("error"))
    waiting_since_display = time_field("waiting_since", _("waiting since"))
    wake_at_display = time_field("wake_at", _("wake at"))

    def get_fieldsets(self, request: HttpRequest, obj: Any = None) -> Any:
        fieldsets: list[Any] = list(super().get_fieldsets(request, obj))
        if obj is not None and obj.start_key is not None:
            # After the task, on the page of a run started with a key only.
            name, options = fieldsets[0]
            fieldsets[0] = (name, {**options, "fields": (*options["fields"], "start_key_shown")})
        if obj is not None and obj.batch:
            # Its model turns go through Message Batches: after the model.
            name, options = fieldsets[0]
            fields = list(options["fields"])
            fields.insert(fields.index("model_shown") + 1, "batch_mode")
            fieldsets[0] = (name, {**options, "fields": tuple(fields)})
        if obj is not None and obj.concurrency_key is not None:
            name, options = fieldsets[0]
            fieldsets[0] = (name, {**options, "fields": (*options["fields"], "concurrency")})
        if obj is not None and obj.metadata:
            # What the product attached to it (a tenant, a user, an order), after the task.
            name, options = fieldsets[0]
            fieldsets[0] = (name, {**options, "fields": (*options["fields"], "metadata_text")})
        if obj is not None and obj.output is not None:
            # The validated answer of an agent with an output schema, after the result text.
            index = next(
                i
                for i, (_name, options) in enumerate(fieldsets)
                if "result_text" in options["fields"]
            )
            name, options = fieldsets[index]
            fields = list(options["fields"])
            fields.insert(fields.index("result_text") + 1, "output_text")
            fieldsets[index] = (name, {**options, "fields": tuple(fields)})
        if obj is not None and obj.parent_id:
            fieldsets.insert(1, self.child_fieldset)
        if obj is not None and obj.waiting_for and obj.status != RunStatus.WAITING:
            # The record of a wait that is over (a waiting run's page has its box instead).
            fieldsets.insert(-2, self.wait_fieldset)
        return fieldsets

    @admin.display(description=_("parent run"))
    def parent_link(self, obj: AgentRun) -> SafeString | str:
        if not obj.parent_id:
            return self.get_empty_value_display()
        return format_html(
            '<a href="{}" id="parent-link">{}</a>',
            self._url("change", obj.parent_id),
            obj.parent_id,
        )

    @admin.display(description=_("model turns"))
    def batch_mode(self, obj: AgentRun) -> str:
        return gettext("in batches (Message Batches API, at batch prices)") if obj.batch else ""

    @admin.display(description=_("concurrency key"))
    def concurrency(self, obj: AgentRun) -> SafeString | str:
        return key_detail(obj)

    @admin.display(description=_("metadata"))
    def metadata_text(self, obj: AgentRun) -> SafeString | str:
        """The run's metadata as indented JSON, escaped (it is the product's, not ours)."""
        if not obj.metadata:
            return self.get_empty_value_display()
        return text_html(shown_text(pretty_json(obj.metadata)))

    @admin.display(description=_("output"))
    def output_text(self, obj: AgentRun) -> SafeString | str:
        """The validated final answer as indented JSON, escaped (it is the model's)."""
        if obj.output is None:
            return self.get_empty_value_display()
        return text_html(shown_text(pretty_json(obj.output), self._url("text", obj.pk, "output")))

    @admin.display(description=_("woken by"))
    def woken_by_text(self, obj: AgentRun) -> SafeString | str:
        if obj.woken_by is None:
            return self.get_empty_value_display()
        if isinstance(obj.woken_by, Undecodable):
            return text_html(shown_text(str(obj.woken_by)))
        return text_html(shown_text(pretty_json(obj.woken_by)))

    def get_form(
        self, request: HttpRequest, obj: Any = None, change: bool = False, **kwargs: Any
    ) -> type[forms.ModelForm[Any]]:
        kwargs.setdefault("labels", self.field_labels)
        kwargs.setdefault("help_texts", self.field_help_texts)
        return super().get_form(request, obj, change, **kwargs)

    # -- columns ---------------------------------------------------------------------------

    @admin.display(description=_("run"), ordering="created_at")
    def short_id(self, obj: AgentRun) -> SafeString:
        """The run's short id (``ids.short_id``), and its age under it (sorts by creation)."""
        if not obj.created_at:
            return format_html("{}", short_id(obj.pk))
        return format_html(
            '{}<br><span class="da-meta" title="{}">{}</span>',
            short_id(obj.pk),
            created_title(obj),
            ago(obj.created_at),
        )

    @admin.display(description=_("status"), ordering="status")
    def status_badge(self, obj: AgentRun) -> SafeString:
        return badge(obj.status, obj.get_status_display(), RUN_COLORS)

    @admin.display(description=_("status"))
    def status_short(self, obj: AgentRun) -> SafeString:
        label = RUN_SHORT_LABELS.get(obj.status, obj.get_status_display())
        html = badge(obj.status, label, RUN_COLORS, title=obj.get_status_display())
        if obj.priority:
            # Under the status, not a column of its own: the list fits a 1280 px screen.
            html = format_html(
                '{}<br><span class="da-meta da-priority">{}</span>',
                html,
                gettext("priority %(priority)s") % {"priority": obj.priority},
            )
        key = key_list_summary(obj)
        if key is not None:  # the concurrency key too, for the same reason
            html = format_html("{}<br>{}", html, key)
        return html

    @admin.display(description=_("agent"))
    def agent_version(self, obj: AgentRun) -> SafeString:
        return format_html(
            '{} @ {}<br><span class="da-meta">{}</span>',
            revealed(obj.agent),
            revealed(obj.prompt_version),
            revealed(obj.model),
        )

    @admin.display(description=_("task"))
    def task_excerpt(self, obj: AgentRun) -> SafeString:
        """The task's first line (after a marker linking the parent, for a child run), under
        it what a waiting run waits for, and the start of the error if there is one."""
        head = getattr(obj, "task_head", None) or obj.task
        first_line = next((line for line in head.splitlines() if line.strip()), "")
        html = revealed_excerpt(storable_text(first_line), 60)
        if obj.parent_id:
            html = format_html(
                '<a class="da-child" href="{}" title="{}">↳ {}</a> {}',
                self._url("change", obj.parent_id),
                gettext("a child run of %(run)s") % {"run": obj.parent_id},
                short_id(obj.parent_id),
                html,
            )
        wait = getattr(obj, "wait", None)
        if wait is not None:
            html = format_html(
                '{}<br><span class="da-wait da-wait-{}">{}</span>',
                html,
                wait.kind or "person",
                revealed(gettext("waits for %(what)s") % {"what": wait.summary}),
            )
        if not obj.error:
            return html
        error = storable_text(obj.error[: LAST_ERROR_TITLE_CHARS + 1])
        return format_html(
            '{}<br><span class="da-list-error" title="{}">{}</span>',
            html,
            plain_markers(Truncator(error).chars(LAST_ERROR_TITLE_CHARS)),
            revealed_excerpt(error, LAST_ERROR_CHARS),
        )

    @admin.display(description=_("steps"))
    def steps(self, obj: AgentRun) -> int:
        return obj.last_seq + 1  # seq 0 is the task; no per-row query

    @admin.display(description=_("steps"))
    def steps_and_cost(self, obj: AgentRun) -> SafeString:
        """The steps, and under them what the run cost (its tokens in the title)."""
        return format_html("{}{}", obj.last_seq + 1, list_cost(obj))

    @admin.display(description=_("cost"))
    def cost(self, obj: AgentRun) -> SafeString | str:
        """What its model turns cost at PRICES, and with its child runs' when it has any."""
        return run_page_cost(obj)

    @admin.display(description=_("claims"))
    def claims(self, obj: AgentRun) -> int:
        return obj.attempt

    @admin.display(description=_("lease"))
    def lease(self, obj: AgentRun) -> SafeString | None:
        return lease_summary(
            storable_text(obj.lease_owner) if obj.lease_owner else obj.lease_owner,
            obj.lease_until,
        )

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return RunChangeList

    # -- permissions: read-only pages, operations through actions --------------------------

    def has_add_permission(self, request: HttpRequest) -> bool:
        # "Add" is "start a run" (add_view): Django's add permission on runs.
        return request.user.has_perm(f"{self.opts.app_label}.add_{self.opts.model_name}")

    def has_answer_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm(api.ANSWER_PERMISSION)

    # -- search ----------------------------------------------------------------------------

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[Any], search_term: str
    ) -> tuple[QuerySet[Any], bool]:
        """What an operator has in hand (an id as the list shows it, a whole id, a request id
        from a support ticket or an error, words), each through its own index:
        ``search_runs``."""
        term = storable_text(search_term).strip()
        if not term:
            return queryset, False
        found = search_runs(queryset, term)
        note = search_note(found)
        if note:
            self.message_user(request, note, messages.WARNING)
        return found.queryset, False

    def lookup_allowed(self, lookup: str, value: str, request: HttpRequest) -> bool:
        # Older dead-letter links filter runs whose error starts with a reason.
        if lookup in ("error__startswith", "dead_cause"):
            return True
        return super().lookup_allowed(lookup, value, request)

    @admin.action(description=_("Upgrade to version…"), permissions=["operate"])
    def upgrade_runs(self, request: HttpRequest, queryset: QuerySet[Any]) -> HttpResponse | None:
        """Move the selected runs (of one agent and one version) to another registered
        version: an intermediate page chooses it (``UpgradePages``)."""
        return self.page(UpgradePages).upgrade_action(request, queryset)

    # -- pages and views -------------------------------------------------------------------

    def __init__(self, model: type[AgentRun], admin_site: admin.AdminSite) -> None:
        super().__init__(model, admin_site)
        self.built_pages: list[AdminPage[Any]] = [page(self) for page in self.pages]

    def page(self, kind: type[_P]) -> _P:
        """The page of class ``kind`` (or a subclass) this admin holds."""
        for built in self.built_pages:
            if isinstance(built, kind):
                return built
        raise LookupError(f"{type(self).__name__}.pages holds no {kind.__name__}")

    def get_urls(self) -> list[URLPattern]:
        name = self._object_url
        view = self.admin_site.admin_view
        # The pages' paths come before those of the run actions and of Django, whose
        # "<path:object_id>/..." would take "compare/" or "dead-letter/cancel/".
        return [
            path(
                "<path:object_id>/answer/", self._post_view(self.answer_view), name=name("answer")
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
            *(pattern for page in self.built_pages for pattern in page.urls()),
            *super().get_urls(),
        ]

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        dead = bounded_count(AgentRun.objects.dead())
        extra_context = {**(extra_context or {}), "dead_count": dead}
        return super().changelist_view(request, extra_context)

    def change_view(
        self,
        request: HttpRequest,
        object_id: str,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        term = unquote(object_id)
        if run_id_prefix(term) is not None:
            return self._short_id_view(request, term)
        return super().change_view(request, object_id, form_url, extra_context)

    def _short_id_view(self, request: HttpRequest, term: str) -> HttpResponse:
        """A run's page by its id as the admin shows ids: the first characters of an id (the
        short id of a random one), or the last 8 digits of a time-ordered one (its short id).
        The run's own page when the term names one run either way; else a 404 that says
        whether it names none or several. Permission first: a user who may not see runs learns
        nothing of which ids exist."""
        if not self.has_view_or_change_permission(request):
            raise PermissionDenied
        # change_view took the term for the start of an id: both accept it.
        digits = run_id_prefix(term)
        by_head = id_range(term)
        assert digits is not None
        assert by_head is not None
        tail = run_id_tail(term)
        runs = self.get_queryset(request)
        # Two index reads (a range of the primary key; agent_run_id_tail), two runs at most
        # each: enough to tell one run from several.
        found = list(runs.filter(by_head).order_by("pk").values_list("pk", flat=True)[:2])
        if tail is not None:
            by_tail = runs.filter(time_ordered_id_ending(tail)).order_by()
            found = list(dict.fromkeys([*found, *by_tail.values_list("pk", flat=True)[:2]]))
        if len(found) == 1:
            url = self._url("change", found[0])
            query = request.META.get("QUERY_STRING", "")
            return HttpResponseRedirect(f"{url}?{query}" if query else url)
        if tail is None:  # not the 8 plain digits of a short id: the start of an id only
            names = {"prefix": digits}
            title = gettext("Run %(prefix)s…") % names
            message = (
                gettext("No run's id starts with %(prefix)s.") % names
                if not found
                else gettext(
                    "Several runs' ids start with %(prefix)s: give more of the id, or pick the "
                    "run from the list of them."
                )
                % names
            )
        else:
            names = {"id": tail}
            title = gettext("Run %(id)s") % names
            message = (
                gettext("No run has the short id %(id)s, nor an id that starts with it.") % names
                if not found
                else gettext(
                    "Several runs have the short id %(id)s or an id that starts with it: give "
                    "the whole id, or pick the run from the list of them."
                )
                % names
            )
        context = {
            **self.admin_site.each_context(request),
            "title": title,
            "opts": self.opts,
            "message": message,
            "several": bool(found),
            "search_url": f"{self._url('changelist')}?{urlencode({'q': digits})}",
        }
        return TemplateResponse(
            request, "admin/durable_agents/agentrun/short_id.html", context, status=404
        )

    def get_object(self, request: HttpRequest, object_id: str, from_field: Any = None) -> Any:
        run = super().get_object(request, object_id, from_field)
        if run is not None or from_field is not None:
            return run
        # Django reads a ValueError of the row's decoding (``StoredValueError``) as "no such
        # run". A poison run's page shows what cannot be decoded instead.
        try:
            return run_reading_what_decodes(
                self.get_queryset(request), clean_pk(AgentRun, object_id)
            )
        except ValueError:
            return None

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

            transcript = build_transcript(
                obj,
                request.GET.get("page"),
                request.GET.get("seq"),
                step_url=step_url,
                effect_url=lambda key: self._url("effect_text", run_pk, key),
            )
            carried = obj.status == RunStatus.DEAD and carries_over(obj.error)
            run_error = None
            if obj.status in ERROR_FIRST_STATUSES and obj.error:
                run_error = shown_text(obj.error, self._url("text", run_pk, "error"))
            context.update(
                transcript=transcript,
                run_error=run_error,
                sql_hint=sql_hint(obj),
                can_cancel=can_operate and obj.status in CANCELLABLE_STATUSES,
                # A run dead of an undeployed version or drift would only die again: it is
                # carried over to another version instead.
                can_requeue=can_operate and obj.status == RunStatus.DEAD and not carried,
                carry_over_url=self._url("carry_over", run_pk) if can_operate and carried else None,
                **self._wait_context(request, obj),
                **self.page(ForkPages).fork_context(request, obj),
                **live_context(obj),
                worker_wait=worker_wait(obj),
            )
        return super().render_change_form(request, context, add, change, form_url, obj)

    def _wait_context(self, request: HttpRequest, run: AgentRun) -> dict[str, Any]:
        """What the run waits for, its questions and its children: a few queries, bounded
        whatever the run spawned or asked."""
        attach_waits([run])
        wait = run.wait  # type: ignore[attr-defined]
        questions, questions_total = run_questions(run, question_text_url(self))
        open_question = next((row for row in questions if row.is_open), None)
        can_answer = self.has_answer_permission(request)
        event_pk = None
        if wait is not None and wait.kind == WaitKind.EVENT:
            event_pk = (
                AgentEvent.objects.filter(name=run.wait_event).values_list("pk", flat=True).first()
            )
        inbox = list(
            AgentMessage.objects.filter(run_id=run.pk, folded_seq__isnull=True)
            .select_related("sent_by")
            .order_by("id")[: INBOX_SHOWN + 1]
        )
        return {
            "inbox": [(message, shown_text(message.text)) for message in inbox[:INBOX_SHOWN]],
            "inbox_more": len(inbox) > INBOX_SHOWN,
            "wait": wait,
            # The request and batch of a turn it waits for in a batch (a query for those only).
            "batch_wait": batch_wait(run, self.admin_site.name)
            if wait is not None and wait.kind == WaitKind.BATCH
            else None,
            "children": run_children(run),
            "questions": questions,
            "questions_total": questions_total,
            "open_question": open_question,
            "can_answer": can_answer,
            "answer_form": AnswerForm(
                initial={"question": open_question.question.pk} if open_question else None
            )
            if can_answer and open_question
            else None,
            "can_send_event": self.has_send_event_permission(request),
            "event_pk": event_pk,
            "send_form": SendEventForm(initial={"name": run.wait_event})
            if wait is not None and wait.kind == WaitKind.EVENT
            else None,
            "children_url": f"{self._url('changelist')}?"
            + urlencode({"parent__id__exact": str(run.pk)}),
            "questions_url": reverse(
                f"{self.admin_site.name}:durable_agents_agentquestion_changelist"
            )
            + "?"
            + urlencode({"run__id__exact": str(run.pk)}),
        }

    def answer_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """POST: answer the run's open question shown on its page (the form names it)."""
        if not self.has_answer_permission(request):
            raise PermissionDenied  # first: a forged POST learns nothing and changes nothing
        run = get_or_404(AgentRun, object_id, AgentRun.objects.only("pk"))
        try:
            question_id = clean_pk(AgentQuestion, request.POST.get("question"))
        except ValueError:
            question_id = None
        question = (
            AgentQuestion.objects.filter(pk=question_id, run_id=run.pk)
            .select_related("answered_by")
            .first()
            if question_id is not None
            else None
        )
        if question is None:
            self.message_user(
                request,
                gettext("Nothing was answered: the form named no question of this run."),
                messages.ERROR,
            )
        else:
            answer_as(self, request, question)
        return self._redirect_to_object(run)

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
                self.message_user(
                    request, gettext("Started run %(run)s.") % {"run": run.pk}, messages.SUCCESS
                )
                return self._redirect_to_object(run)
        context = {
            **self.admin_site.each_context(request),
            "title": gettext("Start a run"),
            "opts": self.opts,
            "form": form,
        }
        return TemplateResponse(request, "admin/durable_agents/agentrun/start_run.html", context)

    # -- the whole of a text the run page cut ----------------------------------------------

    def _run_for_text(self, request: HttpRequest, object_id: str, *fields: str) -> AgentRun:
        if not self.has_view_permission(request):
            raise PermissionDenied
        return get_or_404(AgentRun, object_id, AgentRun.objects.only("pk", "fork_seq", *fields))

    def step_text_view(self, request: HttpRequest, object_id: str, seq: int) -> HttpResponse:
        """One step, or one block of it (``?block=N``), as plain text."""
        run = self._run_for_text(request, object_id)
        step = log_of(run).filter(seq=seq).first()
        if step is None:
            raise Http404(gettext("No such step."))
        block_param = request.GET.get("block")
        block: int | None = None
        if block_param is not None:
            try:
                block = int(block_param)
            except ValueError:
                raise Http404(gettext("No such block.")) from None
        try:
            data = load_json(step.payload)
        except ValueError:
            if block is not None:
                raise Http404(gettext("No such block.")) from None
            return plain_text_response(step.payload)
        text = block_text(step.kind, data, block)
        if text is None:
            raise Http404(gettext("No such block."))
        return plain_text_response(text)

    def effect_text_view(self, request: HttpRequest, object_id: str, key: str) -> HttpResponse:
        """The recorded result of one tool call, as plain text."""
        run = self._run_for_text(request, object_id)
        effect = ToolEffect.objects.filter(run_id=run.pk, key=key).only("result").first()
        if effect is None:
            raise Http404(gettext("No such effect."))
        result = effect.result
        return plain_text_response(result if isinstance(result, str) else pretty_json(result))

    def run_text_view(self, request: HttpRequest, object_id: str, field: str) -> HttpResponse:
        """The task, result, output (indented JSON) or error of a run, as plain text."""
        if field not in RUN_TEXT_FIELDS:
            raise Http404(gettext("No such text."))
        run = self._run_for_text(request, object_id, field)
        value = getattr(run, field)
        if field == "output":
            return plain_text_response("" if value is None else pretty_json(value))
        return plain_text_response(value or "")
