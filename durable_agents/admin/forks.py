"""Forks from the admin: "Fork from here" on any step of a transcript, "Edit and rerun" on the
task and on a batch of tool results, a fork's origin and a run's forks on the run page, and
two runs compared from the step where they part.

Every page needs the permissions to fork and to view runs (a fork page shows the step as the
run page does), the task's edit page the permission to add runs too. Every fork goes through
``api.fork_run(..., user=request.user)`` (which checks the same permissions again) and writes a
LogEntry on the new run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from django import forms
from django.contrib import messages
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseBadRequest
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils.translation import gettext
from django.utils.translation import gettext_lazy as _

from durable_agents import api
from durable_agents._internal.deepjson import loads_deep
from durable_agents._internal.text import (
    Unstorable,
    check_depth,
    invisible_characters,
    invisible_name,
    plain_markers,
    storable_text,
)
from durable_agents.admin.base import AdminPage, AgentsAdmin, get_or_404
from durable_agents.admin.format import RUN_COLORS, badge, load_json
from durable_agents.admin.transcript import TranscriptStep, describe_step
from durable_agents.forks import planning as forks
from durable_agents.models import AgentRun, AgentStep, StepKind, ToolIntent, short_id, steps_of

if TYPE_CHECKING:
    from django.utils.safestring import SafeString

FORK_PERMISSION = "durable_agents.fork_agentrun"
# The forks a run page lists, newest first (the runs list filters the rest).
FORKS_LISTED = 10
# Steps of each column the compare page shows past the step where the two runs part.
COMPARE_STEPS = 200
# The longest edit a form takes (a batch of tool results can be long, but not unbounded).
EDIT_MAX_CHARS = 2_000_000
EDITABLE_KINDS = (StepKind.TASK, StepKind.TOOL_RESULT)


class ExactTextarea(forms.Textarea):
    """A textarea whose HTML holds no invisible or direction-changing character as it is: each
    is written as a character reference, so the browser still posts the text exactly. (A
    textarea cannot hold the admin's markers: the fork page lists them, with their lines and
    columns, above it instead.)"""

    template_name = "durable_agents/widgets/exact_textarea.html"


@dataclass(frozen=True)
class HiddenCharacter:
    """An invisible or direction-changing character of the text in the edit box, and where."""

    line: int  # 1-based
    column: int  # 1-based, in characters
    name: str  # "U+202E RIGHT-TO-LEFT OVERRIDE"
    marker: str  # "⟨U+202E⟩"


# The characters the warning above the edit box lists one by one; past that, only the count.
HIDDEN_LISTED = 50


def hidden_characters(text: str) -> list[HiddenCharacter]:
    """Each invisible or direction-changing character of ``text`` (what the admin draws as a
    ⟨U+....⟩ marker elsewhere), with its line and column."""
    found: list[HiddenCharacter] = []
    if text.isascii() and text.isprintable():
        return found
    for match in invisible_characters(text):
        char = match.group()
        line_start = text.rfind("\n", 0, match.start()) + 1
        found.append(
            HiddenCharacter(
                text.count("\n", 0, match.start()) + 1,
                match.start() - line_start + 1,
                invisible_name(char),
                plain_markers(char),
            )
        )
    return found


class ForkEditForm(forms.Form):
    """The new text of the task, or the new tool_result blocks as JSON."""

    edit = forms.CharField(
        label=_("New content"),
        strip=False,
        max_length=EDIT_MAX_CHARS,
        widget=ExactTextarea(attrs={"rows": 20, "cols": 100, "spellcheck": "false"}),
    )

    def __init__(self, *args: Any, kind: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.kind = kind
        if kind == StepKind.TOOL_RESULT:
            self.fields["edit"].help_text = _(
                "The list of tool_result blocks, as JSON: as many as the step holds, answering "
                "the same tool_use ids."
            )
        else:
            self.fields["edit"].help_text = _("The task the fork starts from, as plain text.")

    def clean_edit(self) -> Any:
        value: str = self.cleaned_data["edit"]
        if self.kind != StepKind.TOOL_RESULT:
            return value
        try:
            # Any depth without recursion (json.loads raises RecursionError near a thousand
            # levels: a 500), then bounded as every admin form bounds JSON.
            parsed = loads_deep(value)
        except ValueError as exc:
            raise forms.ValidationError(
                gettext("This is not valid JSON: %(error)s") % {"error": storable_text(exc, 200)}
            ) from None
        try:
            check_depth(parsed)
        except Unstorable as exc:
            # exc reads "is nested deeper than ...": the sentence's predicate.
            raise forms.ValidationError(
                gettext("The JSON %(problem)s.") % {"problem": exc}
            ) from None
        return parsed


@dataclass
class ForkRow:
    run: AgentRun
    badge: SafeString


@dataclass
class Parting:
    """Two logs compared: the steps both hold alike, then each one's own (capped)."""

    same: int  # steps 0 .. same-1 are alike
    left: list[TranscriptStep]
    right: list[TranscriptStep]
    left_more: bool
    right_more: bool


def _edit_initial(step: AgentStep) -> str:
    """What the edit form starts from: the task's text, or the blocks as JSON with every
    character past ASCII escaped (an invisible or direction-changing one reads as \\u202e in
    the box, and means the same once parsed)."""
    data = load_json(step.payload)
    if step.kind == StepKind.TASK and isinstance(data, str):
        return data
    return json.dumps(data, indent=2, ensure_ascii=True)


def part(a: AgentRun, b: AgentRun, limit: int = COMPARE_STEPS) -> Parting:
    """Where the logs of ``a`` and ``b`` part, and each one's next ``limit`` steps.

    Shared steps are the same rows, so they compare equal; steps are compared by kind and
    stored payload (under ENCRYPTION_KEYS two encryptions of one text differ, and the runs
    then read as parting at the first step that is not shared)."""
    left_rows = steps_of(a.pk).order_by("seq").only("seq", "kind", "payload").iterator(100)
    right_rows = steps_of(b.pk).order_by("seq").only("seq", "kind", "payload").iterator(100)
    same = 0
    for left, right in zip(left_rows, right_rows, strict=False):
        if (left.seq, left.kind, left.payload) != (right.seq, right.kind, right.payload):
            break
        same += 1
    parting = Parting(same, [], [], False, False)
    for run, column, more in ((a, parting.left, "left_more"), (b, parting.right, "right_more")):
        rows = list(steps_of(run.pk).filter(seq__gte=same).order_by("seq")[: limit + 1])
        setattr(parting, more, len(rows) > limit)
        names: dict[str, str] = {}
        if same:
            before = steps_of(run.pk).filter(seq=same - 1, kind=StepKind.MODEL_TURN).first()
            if before is not None:
                describe_step(before, run.pk, names)
        column.extend(describe_step(step, run.pk, names) for step in rows[:limit])
    return parting


class ForkPages(AdminPage[AgentsAdmin[AgentRun]]):
    """The fork pages of the runs admin (their URLs and names are the runs'), and the fork
    box of the run page (``fork_context``)."""

    def urls(self) -> list[URLPattern]:
        name = self.admin._object_url
        view = self.admin.admin_site.admin_view
        return [
            path("compare/", view(self.compare_view), name=name("compare")),
            path(
                "<path:object_id>/fork/<int:seq>/",
                self.admin._confirm_view(self.fork_view),
                name=name("fork"),
            ),
            path(
                "<path:object_id>/fork/<int:seq>/edit/",
                self.admin._confirm_view(self.fork_edit_view),
                name=name("fork_edit"),
            ),
        ]

    def has_fork_permission(self, request: HttpRequest) -> bool:
        """To fork, and to see the run forked (a fork page shows its steps, as the run page
        does): what ``fork_run(..., user=)`` checks too."""
        return request.user.has_perm(FORK_PERMISSION) and self.admin.has_view_permission(request)

    def has_fork_task_permission(self, request: HttpRequest) -> bool:
        """To fork with an edited task, which starts a run with a task of one's own: the
        permission to add runs too."""
        return self.has_fork_permission(request) and self.admin.has_add_permission(request)

    # -- the run page ----------------------------------------------------------------------

    def fork_context(self, request: HttpRequest, run: AgentRun) -> dict[str, Any]:
        """Whether the page offers forks, where the run was forked from, and its forks."""
        forks = [
            ForkRow(fork, badge(fork.status, fork.get_status_display(), RUN_COLORS))
            for fork in AgentRun.objects.filter(forked_from_id=run.pk)
            .order_by("-created_at")
            .only("id", "status", "created_at", "fork_seq", "forked_from_id")[: FORKS_LISTED + 1]
        ]
        is_fork = run.fork_seq is not None
        return {
            "can_fork": self.has_fork_permission(request),
            "can_fork_task": self.has_fork_task_permission(request),
            "is_fork": is_fork,
            "forks": forks[:FORKS_LISTED],
            "forks_more": len(forks) > FORKS_LISTED,
            "compare_url": (
                f"{self.admin._url('compare')}?a={run.forked_from_id}&b={run.pk}"
                if is_fork and run.forked_from_id
                else ""
            ),
        }

    # -- making a fork ---------------------------------------------------------------------

    def _fork_target(
        self, request: HttpRequest, object_id: str, seq: int, *, edit: bool = False
    ) -> tuple[AgentRun, AgentStep]:
        """The step to fork at, after the permissions (first: a forged request learns
        nothing): to fork and to view runs; to add runs too for the task's edit page."""
        if not self.has_fork_permission(request):
            raise PermissionDenied
        if edit and seq == 0 and not self.has_fork_task_permission(request):
            raise PermissionDenied  # step 0 is always the task
        run = get_or_404(
            AgentRun, object_id, AgentRun.objects.only("pk", "fork_seq", "fork_key_run_id")
        )
        step = steps_of(run.pk).filter(seq=seq).first()
        if step is None:
            raise Http404(gettext("No such step."))
        return run, step

    def _make_fork(
        self, request: HttpRequest, run: AgentRun, seq: int, edit: Any
    ) -> AgentRun | str:
        """The fork, logged; or why ``fork_run`` refused it (nothing was created)."""
        try:
            fork = api.fork_run(run.pk, seq, edit=edit, user=request.user)
        except ValueError as exc:
            return storable_text(exc, 2000)
        how = "edited" if edit is not None else "unedited"
        self.admin.log_addition(
            request, fork, f"Forked from the admin: run {run.pk} at step {seq} ({how})."
        )
        self.admin.message_user(
            request,
            gettext("Forked run %(run)s at step %(seq)s: the new run %(fork)s waits for a worker.")
            % {"run": run.pk, "seq": seq, "fork": fork.pk},
            messages.SUCCESS,
        )
        return fork

    def _fork_page(
        self,
        request: HttpRequest,
        run: AgentRun,
        step: AgentStep,
        *,
        form: ForkEditForm | None,
        error: str = "",
    ) -> TemplateResponse:
        entry = describe_step(step, run.pk, {})
        if form is None:
            title = gettext("Fork run %(run)s from step %(seq)s") % {"run": run.pk, "seq": step.seq}
        else:
            title = gettext("Edit step %(seq)s of run %(run)s and rerun") % {
                "run": run.pk,
                "seq": step.seq,
            }
        point = (
            forks.fork_point(run, step)
            if form is None and step.kind == StepKind.MODEL_TURN
            else forks.ForkPoint([], [], [])
        )
        text = ""
        if form is not None:
            shown = form["edit"].value()
            text = shown if isinstance(shown, str) else ""
        hidden = hidden_characters(text)
        context = {
            **self.admin.admin_site.each_context(request),
            "title": title,
            "opts": self.admin.opts,
            "original": run,
            "entry": entry,
            "form": form,
            "error": error,
            "run_url": self.admin._url("change", run.pk),
            # The calls of the fork point's turn the run did not record: the fork makes them
            # with the run's keys. Intents in doubt refuse the fork; open ones are warned of.
            "unrecorded": point.unrecorded,
            "in_doubt": [(i, self._intent_url(i)) for i in point.in_doubt],
            "open_intents": [(i, self._intent_url(i)) for i in point.open_intents],
            "hidden": hidden[:HIDDEN_LISTED],
            "hidden_count": len(hidden),
        }
        return TemplateResponse(
            request,
            "admin/durable_agents/agentrun/fork.html",
            context,
            status=400 if error or (form is not None and form.errors) else 200,
        )

    def _intent_url(self, intent: ToolIntent) -> str:
        site = self.admin.admin_site.name
        return reverse(f"{site}:durable_agents_toolintent_change", args=[intent.pk])

    def fork_view(self, request: HttpRequest, object_id: str, seq: int) -> HttpResponse:
        """GET: what the fork will be; POST ("Yes"): fork the run at the step, unedited."""
        run, step = self._fork_target(request, object_id, seq)
        if request.method == "POST" and request.POST.get("post") == "yes":
            made = self._make_fork(request, run, seq, None)
            if isinstance(made, AgentRun):
                return self.admin._redirect_to_object(made)
            return self._fork_page(request, run, step, form=None, error=made)
        return self._fork_page(request, run, step, form=None)

    def fork_edit_view(self, request: HttpRequest, object_id: str, seq: int) -> HttpResponse:
        """GET: the step's content in a form; POST: fork at the step with the edited content."""
        run, step = self._fork_target(request, object_id, seq, edit=True)
        if step.kind not in EDITABLE_KINDS:
            raise Http404(gettext("Only the task and a step of tool results can be edited."))
        if request.method != "POST":
            try:
                initial = _edit_initial(step)
            except ValueError:
                initial = ""
            form = ForkEditForm(initial={"edit": initial}, kind=step.kind)
            return self._fork_page(request, run, step, form=form)
        form = ForkEditForm(request.POST, kind=step.kind)
        if form.is_valid():
            made = self._make_fork(request, run, seq, form.cleaned_data["edit"])
            if isinstance(made, AgentRun):
                return self.admin._redirect_to_object(made)
            form.add_error("edit", made)
        return self._fork_page(request, run, step, form=form)

    # -- comparing two runs ----------------------------------------------------------------

    def compare_view(self, request: HttpRequest) -> HttpResponse:
        """Two runs side by side from the step where they part (``?a=<id>&b=<id>``)."""
        if not self.admin.has_view_permission(request):
            raise PermissionDenied
        a_id, b_id = request.GET.get("a"), request.GET.get("b")
        if not a_id or not b_id:
            return HttpResponseBadRequest(gettext("Compare needs two runs: ?a=<id>&b=<id>."))
        columns = ("id", "agent", "prompt_version", "status", "created_at", "last_seq")
        a = get_or_404(AgentRun, a_id, AgentRun.objects.only(*columns))
        b = get_or_404(AgentRun, b_id, AgentRun.objects.only(*columns))
        parting = part(a, b)
        context = {
            **self.admin.admin_site.each_context(request),
            "title": gettext("Compare runs %(a)s and %(b)s")
            % {"a": short_id(a.pk), "b": short_id(b.pk)},
            "opts": self.admin.opts,
            "a": a,
            "b": b,
            "a_url": self.admin._url("change", a.pk),
            "b_url": self.admin._url("change", b.pk),
            "a_badge": badge(a.status, a.get_status_display(), RUN_COLORS),
            "b_badge": badge(b.status, b.get_status_display(), RUN_COLORS),
            "parting": parting,
            "limit": COMPARE_STEPS,
        }
        return TemplateResponse(request, "admin/durable_agents/agentrun/compare.html", context)
