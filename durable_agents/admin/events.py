"""Events that runs wait on: the list, the page, and sending one."""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.contrib.admin.views.main import ChangeList
from django.core.exceptions import PermissionDenied
from django.db.models import (
    Count,
    F,
    IntegerField,
    OuterRef,
    QuerySet,
    Subquery,
    TextField,
    Value,
)
from django.db.models.functions import Coalesce, Substr
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils.html import format_html
from django.utils.http import urlencode
from django.utils.safestring import SafeString
from django.utils.text import Truncator
from django.utils.translation import gettext, ngettext
from django.utils.translation import gettext_lazy as _

from durable_agents import api
from durable_agents._internal import encryption
from durable_agents._internal.text import has_unstorable, plain_markers, revealed, storable_text
from durable_agents.admin.base import (
    SEND_EVENT_PERMISSION,
    CountedChangeList,
    ReadOnlyAdmin,
    get_or_404,
)
from durable_agents.admin.filters import SentFilter
from durable_agents.admin.format import (
    ago,
    audits_values,
    badge,
    format_time,
    plain_text_response,
    pretty_json,
    revealed_excerpt,
    revealed_field,
    shown_text,
    text_html,
    time_field,
)
from durable_agents.admin.forms import EventPayloadForm, SendEventForm
from durable_agents.admin.waits import runs_waiting_on_event
from durable_agents.models import (
    AgentEvent,
    AgentRun,
    RunStatus,
    WaitKind,
)


def send_event_as(
    model_admin: admin.ModelAdmin[Any], request: HttpRequest, name: str, payload: Any
) -> tuple[AgentEvent, bool]:
    """Send the event through ``api.send_event`` as the request's user (whose permission the
    caller checked) and audit it. Returns the event and whether this request sent it (an
    event is sent once: sending it again returns the first and changes nothing)."""
    # The audit's text before the send, storable: a payload may hold a lone surrogate (a JSON
    # escape), which is sent as such but would make the LogEntry's INSERT fail after the send,
    # leaving an event sent with no audit and a 500.
    message = (
        storable_text(
            f"Sent from the admin with payload {Truncator(pretty_json(payload)).chars(200)}"
        )
        if audits_values()
        # Encrypted at rest: the audit says who sent it, never what it carried.
        else "Sent from the admin (the payload is encrypted at rest)."
    )
    before = AgentEvent.objects.filter(name=name).only("pk", "sent_at").first()
    if before is not None and before.is_sent:
        return api.send_event(name, payload, user=request.user), False
    event = api.send_event(name, payload, user=request.user)
    if not api.made_transition(event):  # sent meanwhile, even by this person from another tab
        return event, False
    if before is None:
        model_admin.log_addition(request, event, message)
    else:
        model_admin.log_change(request, event, message)
    return event, True


def already_sent_message(event: AgentEvent) -> str:
    who = storable_text(event.sent_by.get_username()) if event.sent_by else gettext("the api")
    return gettext(
        "Event “%(name)s” was sent already, at %(time)s by %(user)s: an event is sent once. "
        "Nothing changed."
    ) % {
        "name": plain_markers(storable_text(event.name, 200)),
        "time": format_time(event.sent_at),
        "user": who,
    }


PAYLOAD_HEAD_CHARS = 200


class EventChangeList(CountedChangeList):
    """The events list reads the head of each payload, not the whole JSON."""

    def get_queryset(self, request: HttpRequest, exclude_parameters: Any = None) -> QuerySet[Any]:
        queryset: QuerySet[Any] = super().get_queryset(request, exclude_parameters)
        if encryption.enabled():
            # Encrypted at rest: a head cut in SQL would be ciphertext; whole values are read.
            return queryset
        headed: QuerySet[Any] = queryset.annotate(
            payload_head=Substr("payload", 1, PAYLOAD_HEAD_CHARS, output_field=TextField())
        ).defer("payload")
        return headed


def _waiting_on_event() -> Coalesce:
    """How many runs wait on each event (a correlated count the partial index
    agent_run_wait_event serves): one expression of the list's query, no query per row."""
    waiting = (
        AgentRun.objects.filter(
            status=RunStatus.WAITING, waiting_for=WaitKind.EVENT, wait_event=OuterRef("name")
        )
        .order_by()
        .values("wait_event")
        .annotate(n=Count("pk"))
        .values("n")[:1]
    )
    return Coalesce(Subquery(waiting, output_field=IntegerField()), Value(0))


class AgentEventAdmin(ReadOnlyAdmin[AgentEvent]):
    """Events by name: those runs await (not sent yet, with how many runs wait on each) first,
    then those sent. "Add" is "send an event" and needs durable_agents.send_event."""

    list_display = ("event_name", "sent_badge", "waiting_runs", "payload_excerpt", "sent")
    list_display_links = ("event_name",)
    list_filter = (SentFilter,)
    list_select_related = ("sent_by",)
    search_fields = ("name",)
    show_full_result_count = False
    list_per_page = 50
    actions = None
    fieldsets = (
        (None, {"fields": ("name_shown", "sent_badge", "payload_text")}),
        (_("Sent"), {"fields": ("sent_by", "sent_at_display", "created_at_display")}),
    )
    readonly_fields = (
        "name_shown",
        "sent_badge",
        "payload_text",
        "sent_by",
        "sent_at_display",
        "created_at_display",
    )

    created_at_display = time_field("created_at", _("first awaited or sent"))
    sent_at_display = time_field("sent_at", _("sent at"))
    name_shown = revealed_field("name", _("name"))

    # -- columns ---------------------------------------------------------------------------

    @admin.display(description=_("event"), ordering="name")
    def event_name(self, obj: AgentEvent) -> SafeString:
        return revealed(obj.name)

    @admin.display(description=_("status"), ordering="sent_at")
    def sent_badge(self, obj: AgentEvent) -> SafeString:
        if obj.is_sent:
            return badge("sent", gettext("Sent"), {"sent": "#1a7f37"})
        return badge(
            "awaited", gettext("Awaited"), {"awaited": "#b35c00"}, title=gettext("not sent yet")
        )

    @admin.display(description=_("runs waiting"), ordering="_waiting")
    def waiting_runs(self, obj: AgentEvent) -> SafeString | int:
        count = getattr(obj, "_waiting", 0)
        if not count:
            return 0
        url = reverse(f"{self.admin_site.name}:durable_agents_agentrun_changelist")
        query = urlencode({"waits_for": WaitKind.EVENT, "wait_event": obj.name})
        return format_html('<a href="{}?{}">{}</a>', url, query, count)

    @admin.display(description=_("payload"))
    def payload_excerpt(self, obj: AgentEvent) -> SafeString | str:
        if not obj.is_sent:
            return self.get_empty_value_display()
        head = getattr(obj, "payload_head", None)
        if head is None:
            head = pretty_json(obj.payload)
        head = storable_text(head)
        return format_html(
            '<code class="da-input" title="{}">{}</code>',
            plain_markers(head),
            revealed_excerpt(head, 60),
        )

    @admin.display(description=_("sent"), ordering="sent_at")
    def sent(self, obj: AgentEvent) -> SafeString | str:
        if obj.sent_at is None:
            return self.get_empty_value_display()
        who = storable_text(obj.sent_by.get_username()) if obj.sent_by else gettext("the api")
        return format_html(
            '{}<br><span class="da-meta" title="{}">{}</span>',
            who,
            format_time(obj.sent_at),
            ago(obj.sent_at),
        )

    @admin.display(description=_("payload"))
    def payload_text(self, obj: AgentEvent) -> SafeString | str:
        if not obj.is_sent:
            return gettext("not sent yet")
        url = self._url("payload", obj.pk)
        return text_html(shown_text(pretty_json(obj.payload), url))

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return EventChangeList

    # -- ordering: awaited events first ----------------------------------------------------

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        return super().get_queryset(request).annotate(_waiting=_waiting_on_event())

    def get_ordering(self, request: HttpRequest) -> list[Any]:
        return [F("sent_at").desc(nulls_first=True), F("created_at").desc()]

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[Any], search_term: str
    ) -> tuple[QuerySet[Any], bool]:
        return super().get_search_results(request, queryset, storable_text(search_term))

    # -- permissions -----------------------------------------------------------------------

    def has_add_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm(SEND_EVENT_PERMISSION)  # "add" is "send an event"

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # Whoever may send events may see them (and the runs that wait on them).
        return super().has_view_permission(request, obj) or self.has_add_permission(request)

    # -- pages -----------------------------------------------------------------------------

    def get_urls(self) -> list[URLPattern]:
        name = self._object_url
        return [
            path("<path:object_id>/send/", self._post_view(self.send_view), name=name("send")),
            path(
                "<path:object_id>/payload/",
                self.admin_site.admin_view(self.payload_view),
                name=name("payload"),
            ),
            *super().get_urls(),
        ]

    def render_change_form(
        self,
        request: HttpRequest,
        context: dict[str, Any],
        add: bool = False,
        change: bool = False,
        form_url: str = "",
        obj: AgentEvent | None = None,
    ) -> HttpResponse:
        if obj is not None:
            runs, total = runs_waiting_on_event(obj.name)
            context.update(
                waiting_runs=runs,
                waiting_total=total,
                waiting_url=reverse(f"{self.admin_site.name}:durable_agents_agentrun_changelist")
                + "?"
                + urlencode({"waits_for": WaitKind.EVENT, "wait_event": obj.name}),
                send_form=EventPayloadForm()
                if not obj.is_sent and self.has_add_permission(request)
                else None,
            )
        return super().render_change_form(request, context, add, change, form_url, obj)

    def add_view(
        self, request: HttpRequest, form_url: str = "", extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        """ "Add" is "send an event": a name and a JSON payload, through api.send_event."""
        if not self.has_add_permission(request):
            raise PermissionDenied
        if request.method == "POST":
            form = SendEventForm(request.POST)
        else:
            form = SendEventForm(initial={"name": request.GET.get("name", "")[:200]})
        if request.method == "POST" and form.is_valid():
            name = form.cleaned_data["name"]
            return self._send(request, name, form.cleaned_data["payload"])
        waiting = 0
        name = (form.data.get("name") if form.is_bound else form.initial.get("name")) or ""
        if name and not has_unstorable(name):
            waiting = AgentRun.objects.filter(
                status=RunStatus.WAITING, waiting_for=WaitKind.EVENT, wait_event=name
            ).count()
        context = {
            **self.admin_site.each_context(request),
            "title": gettext("Send an event"),
            "opts": self.opts,
            "form": form,
            "waiting": waiting,
            "event_name": storable_text(name),
        }
        return TemplateResponse(request, "admin/durable_agents/agentevent/send_event.html", context)

    def send_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """POST: send an awaited event from its page (the payload; the name is the event's)."""
        if not self.has_add_permission(request):
            raise PermissionDenied  # first: a forged POST learns nothing and changes nothing
        event = get_or_404(AgentEvent, object_id, AgentEvent.objects.only("pk", "name"))
        form = EventPayloadForm(request.POST)
        if not form.is_valid():
            errors = " ".join(str(e) for errors in form.errors.values() for e in errors)
            self.message_user(
                request,
                gettext("Nothing was sent: %(reason)s") % {"reason": errors},
                messages.ERROR,
            )
            return self._redirect_to_object(event)
        return self._send(request, event.name, form.cleaned_data["payload"])

    def _send(self, request: HttpRequest, name: str, payload: Any) -> HttpResponse:
        waiting = AgentRun.objects.filter(
            status=RunStatus.WAITING, waiting_for=WaitKind.EVENT, wait_event=name
        ).count()
        event, sent = send_event_as(self, request, name, payload)
        if sent:
            self.message_user(
                request,
                ngettext(
                    "Sent event “%(name)s”; %(count)s run(s) were waiting on it and woke.",
                    "Sent event “%(name)s”; %(count)s run(s) were waiting on it and woke.",
                    waiting,
                )
                % {"name": plain_markers(storable_text(name, 200)), "count": waiting},
                messages.SUCCESS,
            )
        else:
            self.message_user(request, already_sent_message(event), messages.WARNING)
        return self._redirect_to_object(event)

    def payload_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """The whole payload of an event, as plain text."""
        if not self.has_view_permission(request):
            raise PermissionDenied
        event = get_or_404(AgentEvent, object_id, AgentEvent.objects.only("pk", "payload"))
        return plain_text_response(pretty_json(event.payload))
