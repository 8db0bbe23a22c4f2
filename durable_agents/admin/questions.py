"""Questions that runs ask a person (ask_person): the list, the page, the answer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.contrib import admin, messages
from django.contrib.admin.views.main import ChangeList
from django.core.exceptions import PermissionDenied
from django.db.models import (
    Case,
    F,
    IntegerField,
    QuerySet,
    TextField,
    Value,
    When,
)
from django.db.models.functions import Substr
from django.http import Http404, HttpRequest, HttpResponse
from django.urls import URLPattern, path, reverse
from django.utils.html import format_html
from django.utils.safestring import SafeString
from django.utils.text import Truncator
from django.utils.translation import gettext
from django.utils.translation import gettext_lazy as _

from durable_agents import api
from durable_agents._internal import encryption
from durable_agents._internal.text import (
    count_invisible,
    invisible_warning,
    plain_markers,
    revealed,
    storable_text,
)
from durable_agents.admin.base import CountedChangeList, ReadOnlyAdmin, clean_pk, get_or_404
from durable_agents.admin.format import (
    ago,
    audits_values,
    format_time,
    number_and_age,
    plain_text_response,
    question_badge,
    revealed_excerpt,
    time_field,
)
from durable_agents.admin.forms import AnswerForm
from durable_agents.admin.waits import QUESTION_HEAD_CHARS, question_row, question_texts
from durable_agents.models import (
    AgentQuestion,
    AgentRun,
    QuestionStatus,
    short_id,
)


def question_text_url(model_admin: admin.ModelAdmin[Any]) -> Callable[[Any, str], str]:
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
        after = api.answer_question(
            question.run_id, text, user=request.user, question_id=question.pk
        )
    except (ValueError, AgentQuestion.DoesNotExist) as exc:
        model_admin.message_user(
            request,
            gettext("Nothing was answered: %(reason)s") % {"reason": storable_text(exc, 300)},
            messages.ERROR,
        )
        return False
    # Only the request that answered it: the same person answering from two tabs at once gets
    # one answer and one LogEntry.
    if not (api.made_transition(after) and after.pk == question.pk):
        _not_open(model_admin, request, after)
        return False
    run = AgentRun.objects.only("pk", "agent", "prompt_version", "status").get(pk=after.run_id)
    if audits_values():
        excerpt = storable_text(Truncator(text).chars(200))  # an audit record any column holds
        model_admin.log_change(request, after, f"Answered: “{excerpt}”.")
        model_admin.log_change(request, run, f"Answered question {after.pk}: “{excerpt}”.")
    else:  # the answer is encrypted at rest: the audit says who answered, not what
        model_admin.log_change(request, after, "Answered (the answer is encrypted at rest).")
        model_admin.log_change(
            request, run, f"Answered question {after.pk} (the answer is encrypted at rest)."
        )
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


QUESTION_COLUMN_CHARS = 80
ANSWER_TITLE_CHARS = 300


class QuestionChangeList(CountedChangeList):
    """The questions list reads the head of each question and answer, never the whole."""

    def get_queryset(self, request: HttpRequest, exclude_parameters: Any = None) -> QuerySet[Any]:
        queryset: QuerySet[Any] = (
            super()
            .get_queryset(request, exclude_parameters)
            .annotate(
                question_head=Substr("question", 1, QUESTION_HEAD_CHARS, output_field=TextField())
            )
            .defer("question")
        )
        if encryption.enabled():
            # Encrypted at rest: a head cut in SQL would be ciphertext; whole answers are read.
            return queryset
        headed: QuerySet[Any] = queryset.annotate(
            answer_head=Substr("answer", 1, ANSWER_TITLE_CHARS, output_field=TextField())
        ).defer("answer")
        return headed


class AgentQuestionAdmin(ReadOnlyAdmin[AgentQuestion]):
    """Questions that runs asked a person (the built-in ask_person tool): the open ones
    first, oldest first; each page has the answer form for those who may answer."""

    list_display = ("question_id", "question_excerpt", "run_link", "status_short", "answered")
    list_display_links = ("question_id", "question_excerpt")
    list_filter = ("status",)
    list_select_related = ("answered_by",)
    search_fields = ("question",)
    list_lookups = ("run__id__exact",)  # a run page's link to its questions
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

    created_at_display = time_field("created_at", _("asked at"))
    answered_at_display = time_field("answered_at", _("answered at"))

    # -- columns ---------------------------------------------------------------------------

    @admin.display(description=_("question"), ordering="created_at")
    def question_id(self, obj: AgentQuestion) -> SafeString:
        when = obj.created_at
        title = gettext("asked %(time)s") % {"time": format_time(when)} if when else ""
        return number_and_age(obj.pk, when, title)

    @admin.display(description=_("asks"))
    def question_excerpt(self, obj: AgentQuestion) -> SafeString:
        head = getattr(obj, "question_head", None)
        text = storable_text(head if head is not None else obj.question)
        return format_html(
            '<span class="da-question" title="{}">{}</span>',
            plain_markers(text),
            revealed_excerpt(" ".join(text.split()), QUESTION_COLUMN_CHARS),
        )

    @admin.display(description=_("run"), ordering="run_id")
    def run_link(self, obj: AgentQuestion) -> SafeString:
        url = reverse(f"{self.admin_site.name}:durable_agents_agentrun_change", args=[obj.run_id])
        return format_html('<a href="{}">{}</a>', url, short_id(obj.run_id))

    @admin.display(description=_("status"), ordering="status")
    def status_badge(self, obj: AgentQuestion) -> SafeString:
        return question_badge(obj)

    @admin.display(description=_("status"), ordering="status")
    def status_short(self, obj: AgentQuestion) -> SafeString:
        return question_badge(obj)

    @admin.display(description=_("answered"), ordering="answered_at")
    def answered(self, obj: AgentQuestion) -> SafeString | str:
        if obj.status != QuestionStatus.ANSWERED:
            return self.get_empty_value_display()
        who = storable_text(obj.answered_by.get_username()) if obj.answered_by else "—"
        head = getattr(obj, "answer_head", None)
        answer = storable_text(head if head is not None else obj.answer)
        return format_html(
            '{}<span title="{}">{}</span><br><span class="da-meta" title="{}">{}</span>',
            invisible_warning(count_invisible(answer)),
            plain_markers(Truncator(answer).chars(ANSWER_TITLE_CHARS)),
            revealed(who),
            format_time(obj.answered_at),
            ago(obj.answered_at) if obj.answered_at else gettext("%(age)s ago") % {"age": "—"},
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

    def has_answer_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm(api.ANSWER_PERMISSION)

    # -- the question page and its answer view ---------------------------------------------

    def get_object(self, request: HttpRequest, object_id: str, from_field: Any = None) -> Any:
        # The page reads the head and length of the question and answer, not the whole.
        try:
            pk = clean_pk(AgentQuestion, object_id)
        except ValueError:
            return None
        return question_texts(self.get_queryset(request)).filter(pk=pk).first()

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
            row = question_row(obj, question_text_url(self))
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
        question = get_or_404(
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
        question = get_or_404(AgentQuestion, object_id, AgentQuestion.objects.only("pk", field))
        return plain_text_response(getattr(question, field) or "")
