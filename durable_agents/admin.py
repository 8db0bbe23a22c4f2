"""The durable_agents admin: runs and their transcripts (with what a waiting run waits for, its
parent and children), intents to decide, questions to answer, events to send, the dead letter
and an operations page.

Runs, steps, intents, questions and events are never edited by hand: every page is read-only,
and every change of state is an action or a POST view that checks its permission, calls
``durable_agents.api`` and writes a LogEntry. AgentStep has a composite primary key and
cannot be registered; steps are shown on their run's page.

Hostile input is expected everywhere: model and tool text is escaped, marked where it cannot be
encoded (``durable_agents.text.storable_text``) and cut to a bound with a link to the whole;
malformed ids give 404; a confirmation page acts on exactly the objects it listed.

Every word the admin shows is translatable: labels, titles, filters and actions with
``gettext_lazy``, messages with ``gettext``/``ngettext`` and named placeholders (the catalogue
is ``durable_agents/locale``). What a model, a tool or a person wrote is never translated. The
admin's LogEntry messages stay in English: they are an audit record, written once and read by
whoever comes later, whatever their language.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar, cast

from django import forms
from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.views.main import ORDER_VAR, ChangeList
from django.core.exceptions import PermissionDenied, ValidationError
from django.db.models import (
    Case,
    Count,
    Exists,
    F,
    IntegerField,
    Model,
    OuterRef,
    QuerySet,
    Subquery,
    TextField,
    Value,
    When,
)
from django.db.models.functions import Coalesce, Substr
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.loader import render_to_string
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils.crypto import constant_time_compare
from django.utils.html import format_html
from django.utils.http import urlencode
from django.utils.safestring import SafeString, mark_safe
from django.utils.text import Truncator
from django.utils.translation import gettext, gettext_noop, ngettext, ngettext_lazy
from django.utils.translation import gettext_lazy as _
from django.views.decorators.http import require_http_methods, require_POST

from durable_agents import admin_views as views
from durable_agents import api, listing
from durable_agents.agents import AgentNotFound, registry
from durable_agents.deepjson import loads_deep
from durable_agents.models import (
    CANCELLABLE_STATUSES,
    AgentEvent,
    AgentQuestion,
    AgentRun,
    AgentStep,
    IntentStatus,
    QuestionStatus,
    RunStatus,
    ToolEffect,
    ToolIntent,
    WaitKind,
)
from durable_agents.text import Unstorable, check_depth, has_unstorable, storable_text

if TYPE_CHECKING:
    from django.contrib.admin import ModelAdmin as _ModelAdmin
    from django_stubs_ext import StrOrPromise
else:

    class _ModelAdmin(admin.ModelAdmin):
        """ModelAdmin, subscriptable at run time as the type stubs declare it generic."""

        def __class_getitem__(cls, model: Any) -> Any:
            return cls


_M = TypeVar("_M", bound=Model)

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
# An answer to a question (the model reads it as the ask_person result).
ANSWER_MAX_CHARS = 20_000
# The JSON text of an event's payload typed into a form.
PAYLOAD_MAX_CHARS = 100_000
SEND_EVENT_PERMISSION = "durable_agents.send_event"


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


def _get_or_404(model: type[_M], object_id: Any, queryset: QuerySet[_M] | None = None) -> _M:
    """The object, or 404 for an unknown *or malformed* id (never a 500)."""
    try:
        pk = _clean_pk(model, object_id)
    except ValueError:
        raise Http404(_no_match(model)) from None
    try:
        return (queryset if queryset is not None else model._default_manager.all()).get(pk=pk)
    except model.DoesNotExist:  # type: ignore[attr-defined]  # every concrete model has it
        raise Http404(_no_match(model)) from None


def _no_match(model: Any) -> str:
    return gettext("No %(name)s matches the given id.") % {"name": model._meta.verbose_name}


def _no_unstorable(value: str) -> None:
    # Django's CharField already refuses NUL; a lone surrogate cannot be encoded either.
    if has_unstorable(value):
        raise ValidationError(
            gettext("Remove the NUL character or unpaired surrogate from this text.")
        )


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


class _OperationsAdmin(_ModelAdmin[_M]):
    """What the ModelAdmins share: object views and confirmation pages."""

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
            self.message_user(
                request,
                gettext(
                    "The search or a filter held a NUL character; showing the list without them."
                ),
                messages.ERROR,
            )
            return HttpResponseRedirect(request.path)
        return super().changelist_view(request, extra_context)

    def response_action(
        self, request: HttpRequest, queryset: QuerySet[Any], *args: Any, **kwargs: Any
    ) -> HttpResponse | None:
        # Django filters pk__in=<posted ids>: a malformed id would be a 500 there. (Django 6
        # passes action_location too: arguments are handed on as they come.)
        try:
            for value in request.POST.getlist(helpers.ACTION_CHECKBOX_NAME):
                _clean_pk(self.model, value)
        except ValueError:
            self.message_user(
                request, gettext("Malformed ids were posted; nothing was changed."), messages.ERROR
            )
            return HttpResponseRedirect(request.get_full_path())
        return super().response_action(request, queryset, *args, **kwargs)

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
        title: StrOrPromise,
        question: StrOrPromise,
        rows: list[ConfirmRow],
        matched: int,
        skipped: int,
        button: StrOrPromise,
        action: str,
        form_url: str,
        reason_form: forms.Form | None = None,
        extra_form: forms.Form | None = None,
        extra_hidden: dict[str, str] | None = None,
        note: StrOrPromise = "",
        status: int = 200,
    ) -> TemplateResponse:
        """The intermediate page of an action: every object it will act on is listed, and
        "Yes" posts exactly those ids (and, for intents, what was shown of each; for an
        event, its name in ``extra_hidden``, and ``extra_form``'s fields)."""
        included = [row for row in rows if row.included]
        context = {
            **self.admin_site.each_context(request),
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
            "extra_form": extra_form,
            "extra_hidden": sorted((extra_hidden or {}).items()),
            "note": note,
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


class CountedChangeList(ChangeList):
    """A change list whose count a page prints as ``result_count_text``: "4 agent runs", or
    past listing.EXACT_COUNT_LIMIT "about 1.2 million agent runs" (listing.EstimatingPaginator;
    the app's pagination.html and search_form.html print it)."""

    @property
    def result_count_text(self) -> str:
        paginator = getattr(self, "paginator", None)
        if isinstance(paginator, listing.EstimatingPaginator):
            count = paginator.bounded
        else:
            count = listing.Count(self.result_count, exact=True)
        return count.describe(str(self.opts.verbose_name), str(self.opts.verbose_name_plural))


class RunChangeList(CountedChangeList):
    """The runs list reads the head of each task, not the whole text (tasks can be long), and
    what the page's waiting runs wait for in at most three queries (``attach_waits``)."""

    def get_queryset(self, request: HttpRequest, exclude_parameters: Any = None) -> QuerySet[Any]:
        queryset: QuerySet[Any] = (
            super()
            .get_queryset(request, exclude_parameters)
            .annotate(task_head=Substr("task", 1, TASK_HEAD_CHARS))
            # woken_by can hold an event's whole payload: the list never shows it.
            .defer("task", "result", "fingerprint", "woken_by")
        )
        return queryset

    def get_results(self, request: HttpRequest) -> None:
        super().get_results(request)
        # Evaluates the page's queryset once; the template iterates the same (cached) rows.
        views.attach_waits(list(self.result_list))


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
    led by the field (``listing.distinct_values``) instead of SELECT DISTINCT over the table."""

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
        values = listing.distinct_values(model._default_manager.all(), field_path)
        self.lookup_choices = values  # type: ignore[assignment]


class StartRunForm(forms.Form):
    agent = forms.ChoiceField(
        label=_("Agent"), help_text=_("Registered agents, as name @ version.")
    )
    task = forms.CharField(
        label=_("Task"),
        widget=forms.Textarea(attrs={"rows": 10, "cols": 80}),
        validators=[_no_unstorable],
    )
    # A choice, not free text: a run may only pin a model that a registered version of its
    # agent declares (one that its prompts and tools were written for).
    model = forms.ChoiceField(
        label=_("Model"),
        required=False,
        help_text=_(
            "Leave empty for the model of the chosen version; otherwise one of the models "
            "that the agent's registered versions use."
        ),
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        agents = sorted(registry.all(), key=lambda a: (a.name, a.version))
        # The value is JSON so that any character in a name or version survives the round trip.
        cast(forms.ChoiceField, self.fields["agent"]).choices = [
            (json.dumps([a.name, a.version]), f"{a.name} @ {a.version} ({a.model})") for a in agents
        ]
        self.models_by_agent: dict[str, set[str]] = {}
        for agent in agents:
            self.models_by_agent.setdefault(agent.name, set()).add(agent.model)
        users: dict[str, list[str]] = {}
        for name, models in self.models_by_agent.items():
            for model in models:
                users.setdefault(model, []).append(name)
        cast(forms.ChoiceField, self.fields["model"]).choices = [
            ("", gettext("The chosen version's own model")),
            *(
                (
                    model,
                    gettext("%(model)s (for %(agents)s)")
                    % {"model": model, "agents": ", ".join(users[model])},
                )
                for model in sorted(users)
            ),
        ]

    def clean(self) -> dict[str, Any]:
        super().clean()
        data = self.cleaned_data
        agent, model = data.get("agent"), data.get("model")
        if agent and model:
            name = json.loads(agent)[0]
            allowed = self.models_by_agent.get(name, set())
            if model not in allowed:
                self.add_error(
                    "model",
                    gettext(
                        "%(model)s is not a model of agent %(agent)s; its versions use %(models)s."
                    )
                    % {
                        "model": model,
                        "agent": name,
                        "models": ", ".join(sorted(allowed)) or gettext("none"),
                    },
                )
        return data


class AnswerForm(forms.Form):
    """The answer to a run's question: the ask_person tool's result, with who and when."""

    # The question the page showed: the answer goes to that one or nowhere.
    question = forms.IntegerField(widget=forms.HiddenInput, min_value=1, max_value=2**63 - 1)
    answer = forms.CharField(
        label=_("Your answer (the model reads it, with your name)"),
        max_length=ANSWER_MAX_CHARS,
        widget=forms.Textarea(attrs={"rows": 4, "cols": 60}),
        validators=[_no_unstorable],
        error_messages={"required": _("Write an answer: the model reads it, and you are named.")},
    )


def parse_payload(text: str) -> Any:
    """An event payload typed into a form: JSON (any value), empty for null. Raises
    ValidationError with a reason a person can act on; never a RecursionError."""
    text = text.strip()
    if not text:
        return None
    try:
        value = loads_deep(text)  # any depth without recursion; then bounded
    except ValueError as exc:
        raise ValidationError(
            gettext("The payload is not JSON: %(error)s") % {"error": storable_text(exc, 200)}
        ) from None
    try:
        check_depth(value)
    except Unstorable as exc:
        # exc reads "is nested deeper than ...": the sentence's predicate.
        raise ValidationError(gettext("The payload %(problem)s.") % {"problem": exc}) from None
    try:
        json.dumps(value, allow_nan=False)
    except ValueError:
        raise ValidationError(
            gettext("The payload is not JSON: NaN and Infinity are not.")
        ) from None
    return value


class EventPayloadForm(forms.Form):
    payload = forms.CharField(
        label=_("Payload (JSON; empty for null)"),
        required=False,
        strip=False,
        max_length=PAYLOAD_MAX_CHARS,
        widget=forms.Textarea(attrs={"rows": 4, "cols": 60, "spellcheck": "false"}),
        help_text=_('What each woken run receives as woken_by["payload"], e.g. {"status": "ok"}.'),
    )

    def clean_payload(self) -> Any:
        return parse_payload(self.cleaned_data.get("payload") or "")


class SendEventForm(EventPayloadForm):
    name = forms.CharField(
        label=_("Name"),
        max_length=200,
        validators=[_no_unstorable],
        help_text=_(
            "The name the runs wait on (Wait(event=name)). An event is sent once: "
            "sending a name again changes nothing."
        ),
    )
    field_order = ["name", "payload"]


def _time_field(field_name: str, description: StrOrPromise) -> Callable[[Any, Any], str]:
    """A read-only field or column printing ``field_name`` as ``views.TIME_FORMAT``.

    Django prints datetimes in the locale's format ("Dec. 2, 2026, 4:51 p.m."); the transcript
    prints them as ISO-like times, and so does every page of the admin through these.
    """

    @admin.display(description=description, ordering=field_name)
    def show(self: admin.ModelAdmin[Any], obj: Any) -> str:
        return views.format_time(getattr(obj, field_name)) or self.get_empty_value_display()

    show.__name__ = f"{field_name}_display"
    return show


def _text_html(text: views.Text) -> SafeString:
    """A possibly cut text as a read-only field: the transcript's markup (its template, with
    autoescape on, and its translated words)."""
    html = render_to_string("admin/durable_agents/includes/text.html", {"t": text})
    return mark_safe(html.strip())  # the template escaped every value in it


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
        return _text_html(views.shown_text(value, url))

    show.__name__ = f"{field_name}_text"
    return show


def _question_text_url(model_admin: admin.ModelAdmin[Any]) -> Callable[[Any, str], str]:
    """The address of the whole text of a question's ``question`` or ``answer``."""
    name = f"{model_admin.admin_site.name}:durable_agents_agentquestion_text"

    def url(pk: Any, field: str) -> str:
        return reverse(name, args=[pk, field])

    return url


def answer_as(
    model_admin: admin.ModelAdmin[Any], request: HttpRequest, question: AgentQuestion
) -> bool:
    """Answer ``question`` with the posted AnswerForm, through ``api.answer_question``, as the
    request's user (whose permission the caller checked); audit it and say what happened.

    The api answers the run's newest question: the answer is given only when that is the
    question the form was for and it is still open, so an answer is never given to a
    question that the person did not see. True when this request answered it."""
    form = AnswerForm(request.POST)
    if not form.is_valid():
        errors = " ".join(str(e) for errors in form.errors.values() for e in errors)
        model_admin.message_user(
            request,
            gettext("Nothing was answered: %(reason)s") % {"reason": errors},
            messages.ERROR,
        )
        return False
    text = form.cleaned_data["answer"]
    if form.cleaned_data["question"] != question.pk:
        model_admin.message_user(
            request,
            gettext("Nothing was answered: the form was for another question."),
            messages.ERROR,
        )
        return False
    if question.status != QuestionStatus.OPEN:
        _not_open(model_admin, request, question)
        return False
    newest = (
        AgentQuestion.objects.filter(run_id=question.run_id)
        .order_by("-created_at", "-pk")
        .values_list("pk", flat=True)
        .first()
    )
    if newest != question.pk:
        model_admin.message_user(
            request,
            gettext("Nothing was answered: run %(run)s asked a newer question since.")
            % {"run": question.run_id},
            messages.ERROR,
        )
        return False
    try:
        after = api.answer_question(question.run_id, request.user, text, question_id=question.pk)
    except (ValueError, AgentQuestion.DoesNotExist) as exc:
        model_admin.message_user(
            request,
            gettext("Nothing was answered: %(reason)s") % {"reason": storable_text(exc, 300)},
            messages.ERROR,
        )
        return False
    answered = (
        after.pk == question.pk
        and after.status == QuestionStatus.ANSWERED
        and after.answered_by_id == request.user.pk
        and after.answer == storable_text(text)
    )
    if not answered:
        _not_open(model_admin, request, after)
        return False
    excerpt = Truncator(text).chars(200)
    model_admin.log_change(request, after, f"Answered: “{excerpt}”.")
    run = AgentRun.objects.only("pk", "agent", "prompt_version", "status").get(pk=after.run_id)
    model_admin.log_change(request, run, f"Answered question {after.pk}: “{excerpt}”.")
    model_admin.message_user(
        request,
        gettext("Answered question %(question)s: run %(run)s goes on (%(status)s).")
        % {"question": after.pk, "run": after.run_id, "status": run.status},
        messages.SUCCESS,
    )
    return True


def _not_open(model_admin: admin.ModelAdmin[Any], request: HttpRequest, question: Any) -> None:
    question.refresh_from_db(fields=["status", "answered_by", "answered_at"])
    if question.status == QuestionStatus.ANSWERED:
        who = storable_text(question.answered_by.get_username()) if question.answered_by else "—"
        message = gettext("Question %(id)s is already answered by %(user)s. Nothing changed.") % {
            "id": question.pk,
            "user": who,
        }
    else:
        message = gettext("Question %(id)s is %(status)s. Nothing changed.") % {
            "id": question.pk,
            "status": question.get_status_display().lower(),
        }
    model_admin.message_user(request, message, messages.WARNING)


def send_event_as(
    model_admin: admin.ModelAdmin[Any], request: HttpRequest, name: str, payload: Any
) -> tuple[AgentEvent, bool]:
    """Send the event through ``api.send_event`` as the request's user (whose permission the
    caller checked) and audit it. Returns the event and whether this request sent it (an
    event is sent once: sending it again returns the first and changes nothing)."""
    before = AgentEvent.objects.filter(name=name).only("pk", "sent_at").first()
    if before is not None and before.is_sent:
        return api.send_event(name, payload, user=request.user), False
    event = api.send_event(name, payload, user=request.user)
    if event.sent_by_id != request.user.pk or event.payload != payload:
        return event, False
    message = f"Sent from the admin with payload {Truncator(views.pretty_json(payload)).chars(200)}"
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
        "name": storable_text(event.name, 200),
        "time": views.format_time(event.sent_at),
        "user": who,
    }


def _created(obj: Any) -> str:
    """The title of a list's age line: when the object was created."""
    return gettext("created %(time)s") % {"time": views.format_time(obj.created_at)}


def _ago(when: Any) -> str:
    """``3h ago``: the age under an id or a name in a list."""
    return gettext("%(age)s ago") % {"age": views.compact_age(when)}


CLAIMS_HELP = _(
    "how many times a worker took this run (after a crash, a deploy or a person's decision)"
)
# The error of these runs is what a person came for: the run page shows it first.
ERROR_FIRST_STATUSES = (RunStatus.DEAD, RunStatus.FAILED)


@dataclass(frozen=True)
class RunOperation:
    """A bulk operation on runs: what it applies to, and the words of its pages."""

    statuses: tuple[str, ...]
    function: str  # of durable_agents.api
    logged: str  # the LogEntry's verb (English: the audit record)
    title: StrOrPromise
    question: StrOrPromise
    button: StrOrPromise
    done: StrOrPromise  # the message: %(count)s changed, %(skipped)s skipped


@admin.register(AgentRun)
class AgentRunAdmin(_OperationsAdmin[AgentRun]):
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
    # At production size (docs/operating.md): every filter is an index condition, agent and
    # model list their values by a skip scan, "created" is a range (no date hierarchy, which
    # reads the dates of every row), and the list sorts by creation only.
    list_filter = (
        "status",
        WaitingForFilter,
        FamilyFilter,
        ("agent", IndexedValuesFilter),
        ("model", IndexedValuesFilter),
        "created_at",
    )
    search_fields = ("task",)  # the whole search is listing.search_runs: get_search_results
    search_help_text = _(
        "A run id or its first characters, a request id (req_...) or its first characters, "
        "an agent or a model, or words of the task or of a dead or failed run's reason."
    )
    ordering = ("-created_at",)
    paginator = listing.EstimatingPaginator
    show_full_result_count = False
    show_facets = admin.ShowFacets.NEVER  # facet counts would count the whole table
    list_select_related = False  # every column lives on agent_run itself
    list_per_page = 50
    actions = ("cancel_runs", "requeue_runs", "send_events")
    fieldsets = (
        (
            None,
            {"fields": ("id", "status_badge", "agent", "prompt_version", "model", "task_text")},
        ),
        (
            _("Progress"),
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
        (_("Outcome"), {"fields": ("result_text", "error_text")}),
        (_("Pinning"), {"classes": ("collapse",), "fields": ("fingerprint",)}),
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
        "parent_link",
        "spawn_key",
        "depth",
        "waiting_for",
        "waiting_since_display",
        "wake_at_display",
        "wait_event",
        "woken_by_text",
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
    field_labels = {
        "attempt": _("claims"),
        "tokens_used": _("tokens used"),
        "waiting_for": _("waited for"),
        "wait_event": _("event"),
        "spawn_key": _("spawn key"),
    }
    field_help_texts = {
        "attempt": CLAIMS_HELP,
        "started_at_display": _("first claim"),
        "wake_at_display": _("a timer's due time, or the timeout of an event or child runs wait"),
        "woken_by_text": _("what ended the wait: the waiting call receives it"),
    }

    lease_until_display = _time_field("lease_until", _("lease until"))
    created_at_display = _time_field("created_at", _("created at"))
    started_at_display = _time_field("started_at", _("started at"))
    updated_at_display = _time_field("updated_at", _("updated at"))
    finished_at_display = _time_field("finished_at", _("finished at"))
    task_text = _run_text_field("task", _("task"))
    result_text = _run_text_field("result", _("result"))
    error_text = _run_text_field("error", _("error"))
    waiting_since_display = _time_field("waiting_since", _("waiting since"))
    wake_at_display = _time_field("wake_at", _("wake at"))

    def get_fieldsets(self, request: HttpRequest, obj: Any = None) -> Any:
        fieldsets: list[Any] = list(super().get_fieldsets(request, obj))
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

    @admin.display(description=_("woken by"))
    def woken_by_text(self, obj: AgentRun) -> SafeString | str:
        if obj.woken_by is None:
            return self.get_empty_value_display()
        return _text_html(views.shown_text(views.pretty_json(obj.woken_by)))

    def get_form(
        self, request: HttpRequest, obj: Any = None, change: bool = False, **kwargs: Any
    ) -> type[forms.ModelForm[Any]]:
        kwargs.setdefault("labels", self.field_labels)
        kwargs.setdefault("help_texts", self.field_help_texts)
        return super().get_form(request, obj, change, **kwargs)

    # -- columns ---------------------------------------------------------------------------

    @admin.display(description=_("run"), ordering="created_at")
    def short_id(self, obj: AgentRun) -> SafeString:
        """The id's first 8 characters, and the run's age under it (sorts by creation)."""
        if not obj.created_at:
            return format_html("{}", str(obj.pk)[:8])
        return format_html(
            '{}<br><span class="da-meta" title="{}">{}</span>',
            str(obj.pk)[:8],
            _created(obj),
            _ago(obj.created_at),
        )

    @admin.display(description=_("status"), ordering="status")
    def status_badge(self, obj: AgentRun) -> SafeString:
        return views.badge(obj.status, obj.get_status_display(), views.RUN_COLORS)

    @admin.display(description=_("status"))
    def status_short(self, obj: AgentRun) -> SafeString:
        label = views.RUN_SHORT_LABELS.get(obj.status, obj.get_status_display())
        return views.badge(obj.status, label, views.RUN_COLORS, title=obj.get_status_display())

    @admin.display(description=_("agent"))
    def agent_version(self, obj: AgentRun) -> SafeString:
        return format_html(
            '{} @ {}<br><span class="da-meta">{}</span>',
            storable_text(obj.agent),
            storable_text(obj.prompt_version),
            storable_text(obj.model),
        )

    @admin.display(description=_("task"))
    def task_excerpt(self, obj: AgentRun) -> SafeString:
        """The task's first line (after a marker linking the parent, for a child run), under
        it what a waiting run waits for, and the start of the error if there is one."""
        head = getattr(obj, "task_head", None) or obj.task
        first_line = next((line for line in head.splitlines() if line.strip()), "")
        html = format_html("{}", Truncator(storable_text(first_line)).chars(60))
        if obj.parent_id:
            html = format_html(
                '<a class="da-child" href="{}" title="{}">↳ {}</a> {}',
                self._url("change", obj.parent_id),
                gettext("a child run of %(run)s") % {"run": obj.parent_id},
                str(obj.parent_id)[:8],
                html,
            )
        wait = getattr(obj, "wait", None)
        if wait is not None:
            html = format_html(
                '{}<br><span class="da-wait da-wait-{}">{}</span>',
                html,
                wait.kind or "person",
                gettext("waits for %(what)s") % {"what": wait.summary},
            )
        if not obj.error:
            return html
        error = storable_text(obj.error[: LAST_ERROR_TITLE_CHARS + 1])
        return format_html(
            '{}<br><span class="da-list-error" title="{}">{}</span>',
            html,
            Truncator(error).chars(LAST_ERROR_TITLE_CHARS),
            Truncator(error).chars(LAST_ERROR_CHARS),
        )

    @admin.display(description=_("steps"))
    def steps(self, obj: AgentRun) -> int:
        return obj.last_seq + 1  # seq 0 is the task; no per-row query

    @admin.display(description=_("claims"))
    def claims(self, obj: AgentRun) -> int:
        return obj.attempt

    @admin.display(description=_("lease"))
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

    def has_send_event_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm(SEND_EVENT_PERMISSION)

    def has_answer_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm(api.ANSWER_PERMISSION)

    # -- search ----------------------------------------------------------------------------

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[Any], search_term: str
    ) -> tuple[QuerySet[Any], bool]:
        """What an operator has in hand (an id as the list shows it, a whole id, a request id
        from a support ticket or an error, words), each through its own index:
        ``listing.search_runs``."""
        term = storable_text(search_term).strip()
        if not term:
            return queryset, False
        found = listing.search_runs(queryset, term)
        note = listing.search_note(found)
        if note:
            self.message_user(request, note, messages.WARNING)
        return found.queryset, False

    def lookup_allowed(self, lookup: str, value: str, request: HttpRequest) -> bool:
        # Older dead-letter links filter runs whose error starts with a reason.
        if lookup in ("error__startswith", "dead_cause"):
            return True
        return super().lookup_allowed(lookup, value, request)

    # -- actions ---------------------------------------------------------------------------

    @admin.action(description=_("Cancel selected runs"), permissions=["operate"])
    def cancel_runs(self, request: HttpRequest, queryset: QuerySet[Any]) -> HttpResponse | None:
        return self._run_operation(request, queryset, "cancel_runs")

    @admin.action(description=_("Requeue selected dead runs"), permissions=["operate"])
    def requeue_runs(self, request: HttpRequest, queryset: QuerySet[Any]) -> HttpResponse | None:
        return self._run_operation(request, queryset, "requeue_runs")

    RUN_OPERATIONS: dict[str, RunOperation] = {
        "cancel_runs": RunOperation(
            statuses=tuple(CANCELLABLE_STATUSES),
            function="cancel_run",
            logged="Cancelled",
            title=_("Cancel runs"),
            question=_(
                "These runs will be cancelled. A worker holding one stops at its next step; "
                "nothing it committed is undone."
            ),
            button=_("Yes, cancel them"),
            # The English keeps "run(s)"; a catalogue gives each plural form its own words.
            done=ngettext_lazy(
                "Cancelled %(count)s run(s); %(skipped)s skipped (not in a status that allows it).",
                "Cancelled %(count)s run(s); %(skipped)s skipped (not in a status that allows it).",
                "count",
            ),
        ),
        "requeue_runs": RunOperation(
            statuses=(RunStatus.DEAD,),
            function="requeue_run",
            logged="Requeued",
            title=_("Requeue runs"),
            question=_(
                "These dead runs go back to pending and resume at their first uncommitted step."
            ),
            button=_("Yes, requeue them"),
            done=ngettext_lazy(
                "Requeued %(count)s run(s); %(skipped)s skipped (not in a status that allows it).",
                "Requeued %(count)s run(s); %(skipped)s skipped (not in a status that allows it).",
                "count",
            ),
        ),
    }

    def _run_operation(
        self,
        request: HttpRequest,
        queryset: QuerySet[Any],
        action: str,
        *,
        form_url: str | None = None,
        example: str | None = None,
    ) -> HttpResponse | None:
        operation = self.RUN_OPERATIONS[action]
        eligible = queryset.filter(status__in=operation.statuses)
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
            title: StrOrPromise = operation.title
            if example is not None:  # a group of the dead letter: its example reason
                title = gettext("%(title)s: “%(example)s”") % {
                    "title": operation.title,
                    "example": example,
                }
            return self._render_confirmation(
                request,
                title=title,
                question=operation.question,
                rows=rows,
                matched=matched,
                skipped=queryset.count() - matched,
                button=operation.button,
                action=action,
                form_url=form_url or request.get_full_path(),
            )
        # The "Yes" of a confirmation page: Django filtered the queryset to the posted ids.
        function: Callable[[Any], bool] = getattr(api, operation.function)
        total = len(self._posted_ids(request))
        changed = 0
        for run in eligible.only("pk", "status"):
            # Per run through the api: the status it checks may have moved since the page.
            if function(run.pk):
                changed += 1
                self.log_change(
                    request, run, f"{operation.logged} from the admin (was {run.status})."
                )
        skipped = total - changed
        level = messages.SUCCESS if changed else messages.WARNING
        self.message_user(request, operation.done % {"count": changed, "skipped": skipped}, level)
        return None

    @admin.action(description=_("Send the event these runs wait for"), permissions=["send_event"])
    def send_events(self, request: HttpRequest, queryset: QuerySet[Any]) -> HttpResponse | None:
        """An intermediate page lists the selected runs that wait on an event (all on one
        event) and takes the payload; its "Yes" posts exactly those run ids and the event's
        name, and sends that event only if the runs still wait on it."""
        eligible = queryset.filter(
            status=RunStatus.WAITING, waiting_for=WaitKind.EVENT, wait_event__isnull=False
        )
        names = sorted(
            eligible.order_by().values_list("wait_event", flat=True).distinct()[:11],
            key=str,
        )
        confirmed = self._confirmed(request)
        if confirmed:
            posted = request.POST.get("event", "")
            if names != [posted]:
                self.message_user(
                    request,
                    gettext(
                        "Nothing was sent: the runs listed no longer all wait on event “%(name)s”."
                    )
                    % {"name": storable_text(posted, 200)},
                    messages.ERROR,
                )
                return None
        elif not names:
            self.message_user(
                request, gettext("None of the selected runs waits on an event."), messages.WARNING
            )
            return None
        elif len(names) > 1:
            shown = ", ".join(f"“{storable_text(n, 60)}”" for n in names[:10])
            if len(names) > 10:
                message = gettext(
                    "The selected runs wait on more than ten different events (%(events)s): "
                    "select runs that wait on one of them."
                )
            else:
                message = gettext(
                    "The selected runs wait on %(count)s different events (%(events)s): "
                    "select runs that wait on one of them."
                )
            self.message_user(
                request, message % {"count": len(names), "events": shown}, messages.ERROR
            )
            return None
        name = names[0]
        form = EventPayloadForm(request.POST if confirmed else None)
        if not confirmed or not form.is_valid():
            matched = eligible.count()
            runs = eligible.order_by("waiting_since", "pk").only(
                "id", "agent", "prompt_version", "status", "created_at", "waiting_since"
            )[:RUN_ACTION_LIMIT]
            rows = [
                ConfirmRow(
                    pk=str(run.pk),
                    url=self._url("change", run.pk),
                    label=storable_text(str(run)),
                )
                for run in runs
            ]
            everyone = AgentRun.objects.filter(
                status=RunStatus.WAITING, waiting_for=WaitKind.EVENT, wait_event=name
            ).count()
            return self._render_confirmation(
                request,
                title=gettext("Send event “%(name)s”")
                % {"name": views.cut_at_word(storable_text(name), 60)[0]},
                question=gettext(
                    "Event “%(name)s” will be sent with the payload below, once: every run "
                    "waiting on it wakes and receives it."
                )
                % {"name": storable_text(name)},
                note=(
                    ngettext(
                        "%(count)s run(s) wait on this event in all; the ones not listed here "
                        "wake too (an event is sent by name, not per run).",
                        "%(count)s run(s) wait on this event in all; the ones not listed here "
                        "wake too (an event is sent by name, not per run).",
                        everyone,
                    )
                    % {"count": everyone}
                    if everyone > len(rows)
                    else ""
                ),
                rows=rows,
                matched=matched,
                skipped=queryset.count() - matched,
                button=gettext("Yes, send it"),
                action="send_events",
                form_url=request.get_full_path(),
                extra_form=form if confirmed else EventPayloadForm(),
                extra_hidden={"event": name},
            )
        listed = list(eligible.values_list("pk", flat=True))
        event, sent = send_event_as(self, request, name, form.cleaned_data["payload"])
        if not sent:
            self.message_user(request, already_sent_message(event), messages.WARNING)
            return None
        still = set(
            AgentRun.objects.filter(
                pk__in=listed, status=RunStatus.WAITING, waiting_for=WaitKind.EVENT
            ).values_list("pk", flat=True)
        )
        woken = [pk for pk in listed if pk not in still]
        for run in AgentRun.objects.filter(pk__in=woken).only(
            "pk", "agent", "prompt_version", "status"
        ):
            self.log_change(request, run, f"Woken by event “{name}”, sent from the admin.")
        self.message_user(
            request,
            ngettext(
                "Sent event “%(name)s”: %(woken)s of the %(count)s listed run(s) woke.",
                "Sent event “%(name)s”: %(woken)s of the %(count)s listed run(s) woke.",
                len(listed),
            )
            % {"name": storable_text(name, 200), "woken": len(woken), "count": len(listed)},
            messages.SUCCESS,
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
                "dead-letter/<str:action>/",
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
            *super().get_urls(),
        ]

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        dead = listing.bounded_count(AgentRun.objects.dead())
        extra_context = {**(extra_context or {}), "dead_count": dead}
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
                **self._wait_context(request, obj),
            )
        return super().render_change_form(request, context, add, change, form_url, obj)

    def _wait_context(self, request: HttpRequest, run: AgentRun) -> dict[str, Any]:
        """What the run waits for, its questions and its children: a few queries, bounded
        whatever the run spawned or asked."""
        views.attach_waits([run])
        wait = run.wait  # type: ignore[attr-defined]
        questions, questions_total = views.run_questions(run, _question_text_url(self))
        open_question = next((row for row in questions if row.is_open), None)
        can_answer = self.has_answer_permission(request)
        event_pk = None
        if wait is not None and wait.kind == WaitKind.EVENT:
            event_pk = (
                AgentEvent.objects.filter(name=run.wait_event).values_list("pk", flat=True).first()
            )
        return {
            "wait": wait,
            "children": views.run_children(run),
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
        run = _get_or_404(AgentRun, object_id, AgentRun.objects.only("pk"))
        try:
            question_id = _clean_pk(AgentQuestion, request.POST.get("question"))
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

    def _single_run_operation(
        self,
        request: HttpRequest,
        object_id: str,
        operation: Callable[[Any], bool],
        logged: str,
        done: StrOrPromise,
    ) -> HttpResponse:
        """``logged``: the LogEntry's verb (English); ``done``: the message, with %(run)s."""
        if not self.has_operate_permission(request):
            raise PermissionDenied
        run = _get_or_404(AgentRun, object_id, AgentRun.objects.only("pk", "status"))
        before = run.status
        if operation(run.pk):
            self.log_change(request, run, f"{logged} from the admin (was {before}).")
            self.message_user(request, done % {"run": run.pk}, messages.SUCCESS)
        else:
            run.refresh_from_db(fields=["status"])
            self.message_user(
                request,
                gettext("Nothing changed: run %(run)s is %(status)s.")
                % {"run": run.pk, "status": run.get_status_display().lower()},
                messages.WARNING,
            )
        return self._redirect_to_object(run)

    def cancel_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        return self._single_run_operation(
            request, object_id, api.cancel_run, "Cancelled", _("Cancelled run %(run)s.")
        )

    def requeue_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        return self._single_run_operation(
            request, object_id, api.requeue_run, "Requeued", _("Requeued run %(run)s.")
        )

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
            raise Http404(gettext("No such step."))
        block_param = request.GET.get("block")
        block: int | None = None
        if block_param is not None:
            try:
                block = int(block_param)
            except ValueError:
                raise Http404(gettext("No such block.")) from None
        try:
            data = views.load_json(step.payload)
        except ValueError:
            if block is not None:
                raise Http404(gettext("No such block.")) from None
            return plain_text_response(step.payload)
        text = views.block_text(step.kind, data, block)
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
        return plain_text_response(result if isinstance(result, str) else views.pretty_json(result))

    def run_text_view(self, request: HttpRequest, object_id: str, field: str) -> HttpResponse:
        """The task, result or error of a run, as plain text."""
        if field not in RUN_TEXT_FIELDS:
            raise Http404(gettext("No such text."))
        run = self._run_for_text(request, object_id, field)
        return plain_text_response(getattr(run, field) or "")

    # -- dead letter and operations --------------------------------------------------------

    def dead_letter_view(self, request: HttpRequest) -> HttpResponse:
        if not self.has_view_permission(request):
            raise PermissionDenied
        try:
            number = int(request.GET.get("page", "1"))
        except ValueError:
            number = 1
        page = views.dead_letter_page(min(max(number, 1), views.DEAD_LETTER_MAX_PAGE))
        context = {
            **self.admin_site.each_context(request),
            "title": gettext("Dead letter"),
            "opts": self.opts,
            "page": page,
            "groups": page.groups,
            "total": page.total,
            "can_operate": self.has_operate_permission(request),
            "action_limit": RUN_ACTION_LIMIT,
        }
        return TemplateResponse(request, "admin/durable_agents/agentrun/dead_letter.html", context)

    def dead_letter_confirm_view(self, request: HttpRequest, action: str) -> HttpResponse:
        """The confirmation page of a group's requeue or cancel (the group's cause in the query
        string): it lists the group's newest runs (at most RUN_ACTION_LIMIT) and its "Yes"
        posts exactly their ids to the runs list."""
        if action not in self.RUN_OPERATIONS:
            raise Http404(gettext("No such operation."))
        if not self.has_operate_permission(request):
            raise PermissionDenied
        cause = request.GET.get("cause", "")
        run_ids = (
            views.dead_group_run_ids(cause, RUN_ACTION_LIMIT) if "cause" in request.GET else []
        )
        if not run_ids:
            self.message_user(
                request,
                gettext("That group is gone: its runs are no longer dead."),
                messages.WARNING,
            )
            return HttpResponseRedirect(self._url("dead_letter"))
        queryset = AgentRun.objects.filter(pk__in=run_ids)
        form_url = f"{self._url('changelist')}?{urlencode({'status__exact': RunStatus.DEAD})}"
        example = views.cut_at_word(cause, 60)[0]
        return self._run_operation(request, queryset, action, form_url=form_url, example=example)  # type: ignore[return-value]

    def operations_view(self, request: HttpRequest) -> HttpResponse:
        if not self.has_view_permission(request):
            raise PermissionDenied
        context = {
            **self.admin_site.each_context(request),
            "title": gettext("Operations"),
            "opts": self.opts,
            **views.operations_stats(),
        }
        return TemplateResponse(request, "admin/durable_agents/agentrun/operations.html", context)


# ---------------------------------------------------------------------------------------------
# Intents

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
            queued = start + len(rows) if rows else listing.count_at_most(queue, start)
            skip = max(0, start - queued)
            rows += list(history[skip : skip + self.list_per_page - len(rows)])
        self.result_list = rows

    def get_queryset(self, request: HttpRequest, exclude_parameters: Any = None) -> QuerySet[Any]:
        queryset: QuerySet[Any] = (
            super()
            .get_queryset(request, exclude_parameters)
            # TextField: the head of the JSON text is not JSON, so it must not be decoded.
            .annotate(input_head=Substr("input", 1, INPUT_HEAD_CHARS, output_field=TextField()))
            .defer("input")
        )
        return queryset


class RejectForm(forms.Form):
    reason = forms.CharField(
        label=_("Reason (the model sees it)"),
        max_length=REASON_MAX_CHARS,
        widget=forms.Textarea(attrs={"rows": 3, "cols": 60}),
        validators=[_no_unstorable],
        error_messages={"required": _("Say why: the model reads the reason and you are named.")},
    )


class ResolveForm(forms.Form):
    happened = forms.ChoiceField(
        choices=[("yes", "yes"), ("no", "no")],
        error_messages={"required": _("Say whether the call happened.")},
    )
    result = forms.CharField(required=False, strip=False, validators=[_no_unstorable])
    reason = forms.CharField(
        required=False, max_length=REASON_MAX_CHARS, validators=[_no_unstorable]
    )


@admin.register(ToolIntent)
class ToolIntentAdmin(_OperationsAdmin[ToolIntent]):
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
    paginator = listing.EstimatingPaginator
    show_full_result_count = False
    show_facets = admin.ShowFacets.NEVER
    list_per_page = 50
    actions = ("approve_intents", "reject_intents")
    fieldsets = (
        (None, {"fields": ("id", "status_badge", "tool", "run", "seq", "call_index", "key")}),
        (_("Decision"), {"fields": ("decided_by", "decided_at_display", "reason")}),
        (_("Timestamps"), {"fields": ("created_at_display", "updated_at_display")}),
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

    created_at_display = _time_field("created_at", _("created at"))
    decided_at_display = _time_field("decided_at", _("decided at"))
    updated_at_display = _time_field("updated_at", _("updated at"))

    # -- columns ---------------------------------------------------------------------------

    @admin.display(description=_("intent"), ordering="created_at")
    def intent_id(self, obj: ToolIntent) -> SafeString:
        """The id, and the intent's age under it (sorts by creation)."""
        if not obj.created_at:
            return format_html("#{}", obj.pk)
        return format_html(
            '#{}<br><span class="da-meta" title="{}">{}</span>',
            obj.pk,
            _created(obj),
            _ago(obj.created_at),
        )

    @admin.display(description=_("tool"), ordering="tool")
    def tool_name(self, obj: ToolIntent) -> str:
        return storable_text(obj.tool)

    @admin.display(description=_("input"))
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

    @admin.display(description=_("run"), ordering="run_id")
    def run_link(self, obj: ToolIntent) -> SafeString:
        url = reverse(f"{self.admin_site.name}:durable_agents_agentrun_change", args=[obj.run_id])
        return format_html('<a href="{}">{}</a>', url, str(obj.run_id)[:8])

    @admin.display(description=_("status"), ordering="status")
    def status_badge(self, obj: ToolIntent) -> SafeString:
        return views.intent_badge(obj)

    @admin.display(description=_("status"), ordering="status")
    def status_short(self, obj: ToolIntent) -> SafeString:
        return views.intent_badge(obj, short=True)

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
            views.format_time(obj.decided_at),
            _ago(obj.decided_at),
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

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # intents are written by runs, not people

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # decisions go through the decision views below

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

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
                "run": str(intent.run_id)[:8],
            }
            text = views.shown_json(intent.input)
            row = ConfirmRow(pk=str(intent.pk), url=url, label=label)
            if approve and len(text) > BULK_INPUT_CHARS:
                row.input = views.shown_text(text, url)
                row.included = False
                row.note = gettext("too long to review in a list: approve it from its own page")
            elif approve:
                row.input = views.Text(text, len(text))
                row.fingerprint = views.intent_fingerprint(intent)
            else:
                row.input = views.shown_text(text, url)
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
                if not constant_time_compare(shown, views.intent_fingerprint(intent)):
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
            % names,
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
        intent = self._intent_for_decision(request, object_id)
        if request.method != "POST":
            return self._render_decision(request, intent, approve=False, form=RejectForm())
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
            # Marked once: the LogEntry keeps the English, the person reads their language.
            message = (
                gettext_noop("Resolved: it happened; recorded result %(result)s.")
                if happened == "yes"
                else gettext_noop("Resolved: it did not happen; the call runs again.")
            )
            values = {"result": repr(Truncator(result).chars(200))}
            logged = message % values
            self.log_change(request, after, logged + (f" {reason}" if reason else ""))
            self.message_user(
                request,
                gettext("Intent %(id)s: %(outcome)s")
                % {"id": intent.pk, "outcome": gettext(message) % values},
                messages.SUCCESS,
            )
        else:
            self._already_decided(request, intent)
        return self._redirect_to_object(intent)


# ---------------------------------------------------------------------------------------------
# Questions (ask_person)

QUESTION_COLUMN_CHARS = 80
ANSWER_TITLE_CHARS = 300


class QuestionChangeList(CountedChangeList):
    """The questions list reads the head of each question and answer, never the whole."""

    def get_queryset(self, request: HttpRequest, exclude_parameters: Any = None) -> QuerySet[Any]:
        queryset: QuerySet[Any] = (
            super()
            .get_queryset(request, exclude_parameters)
            .annotate(
                question_head=Substr(
                    "question", 1, views.QUESTION_HEAD_CHARS, output_field=TextField()
                ),
                answer_head=Substr("answer", 1, ANSWER_TITLE_CHARS, output_field=TextField()),
            )
            .defer("question", "answer")
        )
        return queryset


@admin.register(AgentQuestion)
class AgentQuestionAdmin(_OperationsAdmin[AgentQuestion]):
    """Questions that runs asked a person (the built-in ask_person tool): the open ones
    first, oldest first; each page has the answer form for those who may answer."""

    list_display = ("question_id", "question_excerpt", "run_link", "status_short", "answered")
    list_display_links = ("question_id", "question_excerpt")
    list_filter = ("status",)
    list_select_related = ("answered_by",)
    search_fields = ("question",)
    show_full_result_count = False
    list_per_page = 50
    actions = None
    fieldsets = (
        (None, {"fields": ("id", "status_badge", "run_link", "key")}),
        (_("Answer"), {"fields": ("answered_by", "answered_at_display")}),
        (_("Timestamps"), {"fields": ("created_at_display",)}),
    )
    readonly_fields = (
        "id",
        "status_badge",
        "run_link",
        "key",
        "answered_by",
        "answered_at_display",
        "created_at_display",
    )

    created_at_display = _time_field("created_at", _("asked at"))
    answered_at_display = _time_field("answered_at", _("answered at"))

    # -- columns ---------------------------------------------------------------------------

    @admin.display(description=_("question"), ordering="created_at")
    def question_id(self, obj: AgentQuestion) -> SafeString:
        if not obj.created_at:
            return format_html("#{}", obj.pk)
        return format_html(
            '#{}<br><span class="da-meta" title="{}">{}</span>',
            obj.pk,
            gettext("asked %(time)s") % {"time": views.format_time(obj.created_at)},
            _ago(obj.created_at),
        )

    @admin.display(description=_("asks"))
    def question_excerpt(self, obj: AgentQuestion) -> SafeString:
        head = getattr(obj, "question_head", None)
        text = storable_text(head if head is not None else obj.question)
        return format_html(
            '<span class="da-question" title="{}">{}</span>',
            text,
            Truncator(" ".join(text.split())).chars(QUESTION_COLUMN_CHARS),
        )

    @admin.display(description=_("run"), ordering="run_id")
    def run_link(self, obj: AgentQuestion) -> SafeString:
        url = reverse(f"{self.admin_site.name}:durable_agents_agentrun_change", args=[obj.run_id])
        return format_html('<a href="{}">{}</a>', url, str(obj.run_id)[:8])

    @admin.display(description=_("status"), ordering="status")
    def status_badge(self, obj: AgentQuestion) -> SafeString:
        return views.question_badge(obj)

    @admin.display(description=_("status"), ordering="status")
    def status_short(self, obj: AgentQuestion) -> SafeString:
        return views.question_badge(obj)

    @admin.display(description=_("answered"), ordering="answered_at")
    def answered(self, obj: AgentQuestion) -> SafeString | str:
        if obj.status != QuestionStatus.ANSWERED:
            return self.get_empty_value_display()
        who = storable_text(obj.answered_by.get_username()) if obj.answered_by else "—"
        head = getattr(obj, "answer_head", None)
        answer = storable_text(head if head is not None else obj.answer)
        return format_html(
            '<span title="{}">{}</span><br><span class="da-meta" title="{}">{}</span>',
            Truncator(answer).chars(ANSWER_TITLE_CHARS),
            who,
            views.format_time(obj.answered_at),
            _ago(obj.answered_at) if obj.answered_at else gettext("%(age)s ago") % {"age": "—"},
        )

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return QuestionChangeList

    # -- ordering: open questions first, oldest first --------------------------------------

    def get_queryset(self, request: HttpRequest) -> QuerySet[Any]:
        return (
            super()
            .get_queryset(request)
            .annotate(
                _open=Case(
                    When(status=QuestionStatus.OPEN, then=Value(0)),
                    default=Value(1),
                    output_field=IntegerField(),
                )
            )
        )

    def get_ordering(self, request: HttpRequest) -> list[Any]:
        waiting_since = Case(When(status=QuestionStatus.OPEN, then=F("created_at")))
        return [F("_open").asc(), waiting_since.asc(nulls_last=True), F("created_at").desc()]

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[Any], search_term: str
    ) -> tuple[QuerySet[Any], bool]:
        return super().get_search_results(request, queryset, storable_text(search_term))

    # -- permissions -----------------------------------------------------------------------

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # runs ask; people answer

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False  # answers go through the answer view

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_answer_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm(api.ANSWER_PERMISSION)

    # -- the question page and its answer view ---------------------------------------------

    def get_object(self, request: HttpRequest, object_id: str, from_field: Any = None) -> Any:
        # The page reads the head and length of the question and answer, not the whole.
        try:
            pk = _clean_pk(AgentQuestion, object_id)
        except ValueError:
            return None
        return views.question_texts(self.get_queryset(request)).filter(pk=pk).first()

    def render_change_form(
        self,
        request: HttpRequest,
        context: dict[str, Any],
        add: bool = False,
        change: bool = False,
        form_url: str = "",
        obj: AgentQuestion | None = None,
    ) -> HttpResponse:
        if obj is not None:
            row = views.question_row(obj, _question_text_url(self))
            can_answer = self.has_answer_permission(request)
            context.update(
                row=row,
                can_answer=can_answer,
                answer_form=AnswerForm(initial={"question": obj.pk})
                if can_answer and row.is_open
                else None,
            )
        return super().render_change_form(request, context, add, change, form_url, obj)

    def get_urls(self) -> list[URLPattern]:
        name = self._object_url
        return [
            path(
                "<path:object_id>/answer/", self._post_view(self.answer_view), name=name("answer")
            ),
            path(
                "<path:object_id>/text/<str:field>/",
                self.admin_site.admin_view(self.text_view),
                name=name("text"),
            ),
            *super().get_urls(),
        ]

    def answer_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        if not self.has_answer_permission(request):
            raise PermissionDenied  # first: a forged POST learns nothing and changes nothing
        question = _get_or_404(
            AgentQuestion, object_id, AgentQuestion.objects.select_related("answered_by")
        )
        answer_as(self, request, question)
        return self._redirect_to_object(question)

    def text_view(self, request: HttpRequest, object_id: str, field: str) -> HttpResponse:
        """The whole question or answer, as plain text."""
        if field not in ("question", "answer"):
            raise Http404(gettext("No such text."))
        if not self.has_view_permission(request):
            raise PermissionDenied
        question = _get_or_404(AgentQuestion, object_id, AgentQuestion.objects.only("pk", field))
        return plain_text_response(getattr(question, field) or "")


# ---------------------------------------------------------------------------------------------
# Events (send_event)

PAYLOAD_HEAD_CHARS = 200


class EventChangeList(CountedChangeList):
    """The events list reads the head of each payload, not the whole JSON."""

    def get_queryset(self, request: HttpRequest, exclude_parameters: Any = None) -> QuerySet[Any]:
        queryset: QuerySet[Any] = (
            super()
            .get_queryset(request, exclude_parameters)
            .annotate(
                payload_head=Substr("payload", 1, PAYLOAD_HEAD_CHARS, output_field=TextField())
            )
            .defer("payload")
        )
        return queryset


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


@admin.register(AgentEvent)
class AgentEventAdmin(_OperationsAdmin[AgentEvent]):
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
        (None, {"fields": ("name", "sent_badge", "payload_text")}),
        (_("Sent"), {"fields": ("sent_by", "sent_at_display", "created_at_display")}),
    )
    readonly_fields = (
        "name",
        "sent_badge",
        "payload_text",
        "sent_by",
        "sent_at_display",
        "created_at_display",
    )

    created_at_display = _time_field("created_at", _("first awaited or sent"))
    sent_at_display = _time_field("sent_at", _("sent at"))

    # -- columns ---------------------------------------------------------------------------

    @admin.display(description=_("event"), ordering="name")
    def event_name(self, obj: AgentEvent) -> str:
        return storable_text(obj.name)

    @admin.display(description=_("status"), ordering="sent_at")
    def sent_badge(self, obj: AgentEvent) -> SafeString:
        if obj.is_sent:
            return views.badge("sent", gettext("Sent"), {"sent": "#1a7f37"})
        return views.badge(
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
            head = views.pretty_json(obj.payload)
        head = storable_text(head)
        return format_html(
            '<code class="da-input" title="{}">{}</code>', head, Truncator(head).chars(60)
        )

    @admin.display(description=_("sent"), ordering="sent_at")
    def sent(self, obj: AgentEvent) -> SafeString | str:
        if obj.sent_at is None:
            return self.get_empty_value_display()
        who = storable_text(obj.sent_by.get_username()) if obj.sent_by else gettext("the api")
        return format_html(
            '{}<br><span class="da-meta" title="{}">{}</span>',
            who,
            views.format_time(obj.sent_at),
            _ago(obj.sent_at),
        )

    @admin.display(description=_("payload"))
    def payload_text(self, obj: AgentEvent) -> SafeString | str:
        if not obj.is_sent:
            return gettext("not sent yet")
        url = self._url("payload", obj.pk)
        return _text_html(views.shown_text(views.pretty_json(obj.payload), url))

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

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

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
            runs, total = views.runs_waiting_on_event(obj.name)
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
        event = _get_or_404(AgentEvent, object_id, AgentEvent.objects.only("pk", "name"))
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
                % {"name": storable_text(name, 200), "count": waiting},
                messages.SUCCESS,
            )
        else:
            self.message_user(request, already_sent_message(event), messages.WARNING)
        return self._redirect_to_object(event)

    def payload_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """The whole payload of an event, as plain text."""
        if not self.has_view_permission(request):
            raise PermissionDenied
        event = _get_or_404(AgentEvent, object_id, AgentEvent.objects.only("pk", "payload"))
        return plain_text_response(views.pretty_json(event.payload))
