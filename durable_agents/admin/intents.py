"""Irreversible calls waiting for a person: the intents list, page and decisions."""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.views.main import ORDER_VAR, ChangeList
from django.core.exceptions import PermissionDenied
from django.db.models import (
    Case,
    Exists,
    F,
    IntegerField,
    OuterRef,
    QuerySet,
    TextField,
    Value,
    When,
)
from django.db.models.functions import Substr
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils.crypto import constant_time_compare
from django.utils.html import format_html
from django.utils.http import urlencode
from django.utils.safestring import SafeString
from django.utils.text import Truncator
from django.utils.translation import gettext, gettext_noop, ngettext
from django.utils.translation import gettext_lazy as _

from durable_agents import api, audit
from durable_agents._internal import encryption, intent_links
from durable_agents._internal.counting import count_at_most
from durable_agents._internal.text import plain_markers, revealed, storable_text
from durable_agents.admin.base import (
    FINGERPRINT_FIELD,
    ConfirmRow,
    CountedChangeList,
    ReadOnlyAdmin,
    clean_pk,
    get_or_404,
)
from durable_agents.admin.filters import IndexedValuesFilter
from durable_agents.admin.format import (
    Text,
    ago,
    audits_values,
    created_title,
    format_time,
    intent_badge,
    intent_fingerprint,
    number_and_age,
    pretty_json,
    revealed_excerpt,
    revealed_field,
    shown_json,
    shown_text,
    time_field,
)
from durable_agents.admin.forms import RejectForm, ResolveForm
from durable_agents.admin.listing import EstimatingPaginator
from durable_agents.admin.transcript import StepUrl, model_turn_for_intent
from durable_agents.models import (
    IntentStatus,
    ToolEffect,
    ToolIntent,
    short_id,
)

AWAITING_PERSON = (IntentStatus.PENDING, IntentStatus.UNKNOWN)
# A confirmation page lists, and posts back, at most this many intents (each with the
# fingerprint of what it showed): under Django's DATA_UPLOAD_MAX_NUMBER_FIELDS (1000).
INTENT_ACTION_LIMIT = 100
# An intent input longer than this (pretty-printed) is not approved from a list: a person
# reviews it on its own page.
BULK_INPUT_CHARS = 20_000
INPUT_HEAD_CHARS = 200
INPUT_COLUMN_CHARS = 60


class IntentChangeList(CountedChangeList):
    """The intents list reads the head of each input, not the whole JSON (it can be large).

    Its order is a queue, then a history: intents waiting for a person oldest first, then the
    decided ones newest first (``ToolIntentAdmin.get_ordering``). One ORDER BY of that would
    sort every intent for each page; the page is read from two index scans instead
    (``tool_intent_status`` for the queue, ``tool_intent_created`` for the history), unless a
    column header asks for another order."""

    def get_results(self, request: HttpRequest) -> None:
        super().get_results(request)  # the count and the page's bounds; its rows stay unread
        if ORDER_VAR in self.params or (self.show_all and self.can_show_all):
            return
        base = self.queryset.order_by()
        queue = base.filter(status__in=AWAITING_PERSON).order_by("created_at", "pk")
        history = base.exclude(status__in=AWAITING_PERSON).order_by("-created_at", "-pk")
        start = (self.page_num - 1) * self.list_per_page
        rows = list(queue[start : start + self.list_per_page])
        if len(rows) < self.list_per_page:
            # The queue ends on this page (it holds start + len(rows) intents) or before it.
            queued = start + len(rows) if rows else count_at_most(queue, start)
            skip = max(0, start - queued)
            rows += list(history[skip : skip + self.list_per_page - len(rows)])
        self.result_list = rows

    def get_queryset(self, request: HttpRequest, exclude_parameters: Any = None) -> QuerySet[Any]:
        queryset: QuerySet[Any] = super().get_queryset(request, exclude_parameters)
        if encryption.enabled():
            # Encrypted at rest: a head cut in SQL would be ciphertext; whole values are read.
            return queryset
        headed: QuerySet[Any] = queryset.annotate(
            # TextField: the head of the JSON text is not JSON, so it must not be decoded.
            input_head=Substr("input", 1, INPUT_HEAD_CHARS, output_field=TextField())
        ).defer("input")
        return headed


class ToolIntentAdmin(ReadOnlyAdmin[ToolIntent]):
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
    list_filter = ("status", ("tool", IndexedValuesFilter))
    list_select_related = ("decided_by",)
    search_fields = ("tool",)
    paginator = EstimatingPaginator
    show_full_result_count = False
    show_facets = admin.ShowFacets.NEVER
    list_per_page = 50
    actions = ("approve_intents", "reject_intents")
    fieldsets = (
        (None, {"fields": ("id", "status_badge", "tool_shown", "run", "seq", "call_index", "key")}),
        (_("Decision"), {"fields": ("decided_by", "decided_at_display", "reason_shown")}),
        (_("Timestamps"), {"fields": ("created_at_display", "updated_at_display")}),
    )
    readonly_fields = (
        "id",
        "status_badge",
        "tool_shown",
        "run",
        "seq",
        "call_index",
        "key",
        "decided_by",
        "decided_at_display",
        "reason_shown",
        "created_at_display",
        "updated_at_display",
    )

    tool_shown = revealed_field("tool", _("tool"))
    reason_shown = revealed_field("reason", _("reason"))
    created_at_display = time_field("created_at", _("created at"))
    decided_at_display = time_field("decided_at", _("decided at"))
    updated_at_display = time_field("updated_at", _("updated at"))

    # -- columns ---------------------------------------------------------------------------

    @admin.display(description=_("intent"), ordering="created_at")
    def intent_id(self, obj: ToolIntent) -> SafeString:
        """The id, and the intent's age under it (sorts by creation)."""
        title = created_title(obj) if obj.created_at else ""
        return number_and_age(obj.pk, obj.created_at, title)

    @admin.display(description=_("tool"), ordering="tool")
    def tool_name(self, obj: ToolIntent) -> SafeString:
        return revealed(obj.tool)

    @admin.display(description=_("input"))
    def input_excerpt(self, obj: ToolIntent) -> SafeString:
        """The head of the input's JSON: three drop_table rows no longer look the same."""
        head = getattr(obj, "input_head", None)
        if head is None:
            head = pretty_json(obj.input)
        head = storable_text(head)
        return format_html(
            '<code class="da-input" title="{}">{}</code>',
            plain_markers(head),
            revealed_excerpt(head, INPUT_COLUMN_CHARS),
        )

    @admin.display(description=_("run"), ordering="run_id")
    def run_link(self, obj: ToolIntent) -> SafeString:
        url = reverse(f"{self.admin_site.name}:durable_agents_agentrun_change", args=[obj.run_id])
        return format_html('<a href="{}">{}</a>', url, short_id(obj.run_id))

    @admin.display(description=_("status"), ordering="status")
    def status_badge(self, obj: ToolIntent) -> SafeString:
        return intent_badge(obj)

    @admin.display(description=_("status"), ordering="status")
    def status_short(self, obj: ToolIntent) -> SafeString:
        return intent_badge(obj, short=True)

    @admin.display(description=_("decided"), ordering="decided_at")
    def decided(self, obj: ToolIntent) -> SafeString | str:
        """Who decided, and how long ago under it (the time itself in the title)."""
        if obj.decided_by is None and obj.decided_at is None:
            return self.get_empty_value_display()
        who = storable_text(obj.decided_by.get_username()) if obj.decided_by else "—"
        if obj.decided_at is None:
            return format_html("{}", who)
        return format_html(
            '{}<br><span class="da-meta" title="{}">{}</span>',
            who,
            format_time(obj.decided_at),
            ago(obj.decided_at),
        )

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return IntentChangeList

    # -- ordering: what waits for a person first, oldest first -----------------------------

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
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
        self, request: HttpRequest, queryset: QuerySet[Any], search_term: str
    ) -> tuple[QuerySet[Any], bool]:
        return super().get_search_results(request, queryset, storable_text(search_term))

    # -- permissions -----------------------------------------------------------------------

    def has_approve_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm(api.APPROVE_PERMISSION)

    # -- actions ---------------------------------------------------------------------------

    @admin.action(description=_("Approve selected pending intents"), permissions=["approve"])
    def approve_intents(self, request: HttpRequest, queryset: QuerySet[Any]) -> HttpResponse | None:
        return self._decide_many(request, queryset, approve=True)

    @admin.action(description=_("Reject selected pending intents"), permissions=["approve"])
    def reject_intents(self, request: HttpRequest, queryset: QuerySet[Any]) -> HttpResponse | None:
        return self._decide_many(request, queryset, approve=False)

    def _intent_rows(self, intents: list[ToolIntent], *, approve: bool) -> list[ConfirmRow]:
        """Each intent with its exact input; an approval row also carries the fingerprint of
        what it shows. An input too long to review in a list is shown cut and left out."""
        rows = []
        for intent in intents:
            url = self._url("change", intent.pk)
            label = gettext("#%(id)s %(tool)s for run %(run)s") % {
                "id": intent.pk,
                "tool": storable_text(intent.tool),
                "run": short_id(intent.run_id),
            }
            text = shown_json(intent.input)
            row = ConfirmRow(pk=str(intent.pk), url=url, label=label)
            if approve and len(text) > BULK_INPUT_CHARS:
                row.input = shown_text(text, url)
                row.included = False
                row.note = gettext("too long to review in a list: approve it from its own page")
            elif approve:
                row.input = Text(text, len(text))
                row.fingerprint = intent_fingerprint(intent)
            else:
                row.input = shown_text(text, url)
            rows.append(row)
        return rows

    def _decide_many(
        self, request: HttpRequest, queryset: QuerySet[Any], *, approve: bool
    ) -> HttpResponse | None:
        # defer(None): the list's queryset leaves the input out, and every row shows it.
        pending = queryset.filter(status=IntentStatus.PENDING).order_by("created_at").defer(None)
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
                title=gettext("Approve intents") if approve else gettext("Reject intents"),
                question=gettext(
                    "These irreversible calls will run, each with exactly the input shown, "
                    "once a worker resumes their runs."
                )
                if approve
                else gettext(
                    "These calls will not run; each model receives an error result "
                    "naming you and the reason."
                ),
                rows=rows,
                matched=matched,
                skipped=queryset.count() - matched,
                button=gettext("Yes, approve them") if approve else gettext("Yes, reject them"),
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
                if not constant_time_compare(shown, intent_fingerprint(intent)):
                    differs += 1
                    continue
            if self._decide(request, intent, approve=approve, reason=reason):
                changed += 1
        # The English keeps "intent(s)"; a catalogue gives each plural form its own words.
        counts = {"count": changed, "skipped": total - changed - differs, "differs": differs}
        if approve:
            message = ngettext(
                "Approved %(count)s intent(s); %(skipped)s skipped (not pending).",
                "Approved %(count)s intent(s); %(skipped)s skipped (not pending).",
                changed,
            )
        else:
            message = ngettext(
                "Rejected %(count)s intent(s); %(skipped)s skipped (not pending).",
                "Rejected %(count)s intent(s); %(skipped)s skipped (not pending).",
                changed,
            )
        message %= counts
        if differs:
            message += (
                " "
                + ngettext(
                    "%(differs)s not approved: what was shown is not what they hold.",
                    "%(differs)s not approved: what was shown is not what they hold.",
                    differs,
                )
                % counts
            )
        self.message_user(
            request, message, messages.SUCCESS if changed and not differs else messages.WARNING
        )
        return None

    def _decide(
        self, request: HttpRequest, intent: ToolIntent, *, approve: bool, reason: str = ""
    ) -> bool:
        """Approve or reject through the api; True when this request made the decision (a
        second request deciding at the same moment, even the same person's, finds it made and
        writes no LogEntry)."""
        _, decided = audit.decide_intent(intent.pk, request.user, approve=approve, reason=reason)
        return decided

    # -- the intent page and its decision views --------------------------------------------

    def _step_url(self, run_id: Any) -> StepUrl:
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
                input_json=shown_json(obj.input),
                turn=model_turn_for_intent(obj, self._step_url(obj.run_id)),
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
        return get_or_404(ToolIntent, object_id, ToolIntent.objects.select_related("decided_by"))

    def _undecidable(
        self, request: HttpRequest, object_id: str, exc: encryption.UndecryptableValue
    ) -> HttpResponse:
        """A decision on an intent whose input does not decrypt (the key that encrypted it is
        no longer in ENCRYPTION_KEYS): nothing is decided, the intent stays as it is, and the
        person is told why on its page (which shows the input as "[cannot decrypt: ...]")."""
        self.message_user(
            request,
            gettext(
                "Nothing was decided: the intent's input cannot be read (%(reason)s). Put the "
                "key that encrypted it back in ENCRYPTION_KEYS, then decide."
            )
            % {"reason": str(exc)},
            messages.ERROR,
        )
        return HttpResponseRedirect(self._url("change", clean_pk(ToolIntent, object_id)))

    def _already_decided(self, request: HttpRequest, intent: ToolIntent) -> None:
        intent.refresh_from_db()
        who = (
            storable_text(intent.decided_by.get_username())
            if intent.decided_by
            else gettext("nobody")
        )
        self.message_user(
            request,
            gettext(
                "Intent %(id)s was already decided: it is %(status)s (decided by %(user)s). "
                "Nothing changed."
            )
            % {"id": intent.pk, "status": intent.get_status_display().lower(), "user": who},
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
        names = {"tool": storable_text(intent.tool), "id": intent.pk}
        context = {
            **self.admin_site.each_context(request),
            "title": (
                gettext("Approve %(tool)s (intent %(id)s)?")
                if approve
                else gettext("Reject %(tool)s (intent %(id)s)?")
            )
            % {**names, "tool": plain_markers(intent.tool)},
            "opts": self.opts,
            "original": intent,
            "tool": storable_text(intent.tool),
            "input_json": shown_json(intent.input),
            "approve": approve,
            "pending": intent.status == IntentStatus.PENDING,
            "status_badge": intent_badge(intent, raised=False),
            "fingerprint_field": FINGERPRINT_FIELD,
            "fingerprint": intent_fingerprint(intent),
            "form": form,
        }
        return TemplateResponse(
            request, "admin/durable_agents/toolintent/decide.html", context, status=status
        )

    def _refused_link(
        self, request: HttpRequest, intent: ToolIntent, action: str
    ) -> HttpResponse | None:
        """A confirmation page reached by a signed link from a notification: None when the
        link is good (or there is none: the page is reached from the admin too), else a 403
        page that says why and leads to the intent's page. The link grants nothing; the
        person is logged in and may decide already (``admin_view``, ``_intent_for_decision``)."""
        token = request.GET.get(intent_links.LINK_PARAMETER)
        if token is None:
            return None
        found = intent_links.problem(token, intent, action)
        if found is None:
            return None
        context = {
            **self.admin_site.each_context(request),
            "title": gettext("This link cannot be used"),
            "opts": self.opts,
            "original": intent,
            "reason": gettext(found.value),
            "changed": found is intent_links.LinkProblem.CHANGED,
        }
        return TemplateResponse(
            request, "admin/durable_agents/toolintent/bad_link.html", context, status=403
        )

    def approve_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """GET: the exact input, and a form carrying its fingerprint; POST: approve it, only
        if the fingerprint posted is that of the intent now (what was shown is approved)."""
        try:
            intent = self._intent_for_decision(request, object_id)
        except encryption.UndecryptableValue as exc:  # a POST reads strictly: it may write
            return self._undecidable(request, object_id, exc)
        if request.method != "POST":
            refused = self._refused_link(request, intent, "approve")
            return refused or self._render_decision(request, intent, approve=True)
        shown = request.POST.get(FINGERPRINT_FIELD, "")
        if not constant_time_compare(shown, intent_fingerprint(intent)):
            self.message_user(
                request,
                gettext(
                    "Nothing was approved: this confirmation did not show the intent's current "
                    "input. Check the input below, then approve again."
                ),
                messages.ERROR,
            )
            return HttpResponseRedirect(self._url("approve", intent.pk))
        if self._decide(request, intent, approve=True):
            self.message_user(
                request, gettext("Approved intent %(id)s.") % {"id": intent.pk}, messages.SUCCESS
            )
        else:
            self._already_decided(request, intent)
        return self._redirect_to_object(intent)

    def reject_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """GET: the input and a reason to give; POST: reject with a valid reason, or show the
        form again with its errors."""
        try:
            intent = self._intent_for_decision(request, object_id)
        except encryption.UndecryptableValue as exc:  # a POST reads strictly: it may write
            return self._undecidable(request, object_id, exc)
        if request.method != "POST":
            refused = self._refused_link(request, intent, "reject")
            return refused or self._render_decision(
                request, intent, approve=False, form=RejectForm()
            )
        form = RejectForm(request.POST)
        if not form.is_valid():
            return self._render_decision(request, intent, approve=False, form=form)
        reason = form.cleaned_data["reason"]
        if self._decide(request, intent, approve=False, reason=reason):
            self.message_user(
                request, gettext("Rejected intent %(id)s.") % {"id": intent.pk}, messages.SUCCESS
            )
        else:
            self._already_decided(request, intent)
        return self._redirect_to_object(intent)

    def resolve_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        try:
            intent = self._intent_for_decision(request, object_id)
        except encryption.UndecryptableValue as exc:  # a POST reads strictly: it may write
            return self._undecidable(request, object_id, exc)
        form = ResolveForm(request.POST)
        if not form.is_valid():
            errors = " ".join(str(e) for errors in form.errors.values() for e in errors)
            self.message_user(request, errors, messages.ERROR)
            return self._redirect_to_object(intent)
        happened = form.cleaned_data["happened"]
        reason = form.cleaned_data["reason"]
        result = form.cleaned_data["result"]
        after = api.resolve_intent(
            intent.pk, user=request.user, happened=happened == "yes", result=result, reason=reason
        )
        if api.made_transition(after):
            # Marked once: the LogEntry keeps the English, the person reads their language.
            if happened != "yes":
                message = gettext_noop("Resolved: it did not happen; the call runs again.")
            elif audits_values():
                message = gettext_noop("Resolved: it happened; recorded result %(result)s.")
            else:
                # The result is encrypted at rest: neither the audit nor the message (kept in
                # the session or a cookie until shown) holds it.
                message = gettext_noop(
                    "Resolved: it happened; recorded its result (encrypted at rest)."
                )
            values = {"result": repr(Truncator(result).chars(200))}
            logged = message % values
            self.log_change(
                request, after, storable_text(logged + (f" {reason}" if reason else ""))
            )
            self.message_user(
                request,
                gettext("Intent %(id)s: %(outcome)s")
                % {"id": intent.pk, "outcome": gettext(message) % values},
                messages.SUCCESS,
            )
        else:
            self._already_decided(request, intent)
        return self._redirect_to_object(intent)
