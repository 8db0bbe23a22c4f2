"""What a waiting run waits for, its children and its questions (runs list and run page)."""

from __future__ import annotations

import datetime
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from django.db.models import (
    TextField,
)
from django.db.models.functions import Length, Substr
from django.utils import timezone
from django.utils.safestring import SafeString
from django.utils.text import Truncator
from django.utils.translation import gettext, ngettext

from durable_agents._internal import encryption
from durable_agents._internal.text import storable_text
from durable_agents.admin.format import (
    RUN_COLORS,
    TEXT_SHOWN_CHARS,
    Text,
    badge,
    format_time,
    question_badge,
    shown_text,
)
from durable_agents.models import (
    ENDED_STATUSES,
    AgentQuestion,
    AgentRun,
    IntentStatus,
    QuestionStatus,
    RunStatus,
    ToolIntent,
    WaitKind,
)

# Characters of an event name or a question in one line of the runs list.
WAIT_SUMMARY_CHARS = 60
# Characters of a question read for the runs list (never the whole text).
QUESTION_HEAD_CHARS = 200
# Children and questions listed on a run page; the rest are counted and linked.
CHILDREN_SHOWN = 100
QUESTIONS_SHOWN = 20
# Runs listed on an event's page as waiting on it.
EVENT_RUNS_SHOWN = 50
# Characters of a run's task read for a list of children.
TASK_HEAD_CHARS = 80


@dataclass
class WaitInfo:
    """What a waiting run waits for, in words and figures (the runs list and the run page)."""

    kind: str  # a WaitKind value; "" for a run parked before waits had kinds (an intent)
    label: str  # "a timer", "an event", "child runs", "an answer", "an approval"
    summary: str  # one line: the list under the task, the title of the run page's box
    since: datetime.datetime | None = None
    until: datetime.datetime | None = None  # a timer's due time, or a wait's timeout
    due: bool = False  # the timer or timeout is past: the next claim takes the run
    event: str = ""
    runs_total: int = 0
    runs_ended: int = 0
    question_id: int | None = None
    intent: ToolIntent | None = None

    @property
    def is_timeout(self) -> bool:
        return self.until is not None and self.kind in (WaitKind.EVENT, WaitKind.RUNS)


def _awaited_ids(run: AgentRun) -> list[str]:
    ids = run.wait_runs if isinstance(run.wait_runs, list) else []
    return [str(i) for i in ids if isinstance(i, str)]


def cut_summary(text: str, limit: int = WAIT_SUMMARY_CHARS) -> str:
    return Truncator(storable_text(text)).chars(limit)


def _describe_children_wait(
    info: WaitInfo, run: AgentRun, statuses: dict[str, str], timeout: str
) -> None:
    """The figures and the summary of a wait on child runs (``statuses``: of the awaited)."""
    ids = _awaited_ids(run)
    info.runs_total = len(ids)
    info.runs_ended = sum(1 for i in ids if statuses.get(i) in ENDED_STATUSES)
    counts = {"ended": info.runs_ended, "total": info.runs_total, "time": timeout}
    if timeout:
        info.summary = (
            ngettext(
                "a child run (%(ended)s of %(total)s ended) (timeout %(time)s)",
                "child runs (%(ended)s of %(total)s ended) (timeout %(time)s)",
                info.runs_total,
            )
            % counts
        )
    else:
        info.summary = (
            ngettext(
                "a child run (%(ended)s of %(total)s ended)",
                "child runs (%(ended)s of %(total)s ended)",
                info.runs_total,
            )
            % counts
        )


def _timed_summary(kind: str, wake_at: datetime.datetime | None, due: bool) -> str:
    """The summary of a wait that only time ends: a timer, or a debounced start's quiet
    window (each call with the run's start key starts that window again)."""
    values = {"time": format_time(wake_at) if wake_at is not None else ""}
    if kind == WaitKind.DEBOUNCE:
        if wake_at is None:
            return gettext("a quiet window")
        if due:
            return gettext("a quiet window, over since %(time)s: starting") % values
        return gettext("a quiet window: starts at %(time)s unless started again") % values
    if wake_at is None:
        return gettext("a timer")
    if due:
        return gettext("a timer, due since %(time)s") % values
    return gettext("a timer until %(time)s") % values


def wait_info(
    run: AgentRun,
    *,
    statuses: dict[str, str] | None = None,
    question: AgentQuestion | None = None,
    intent: ToolIntent | None = None,
    now: datetime.datetime | None = None,
) -> WaitInfo | None:
    """What ``run`` waits for, or None when it is not waiting.

    ``statuses`` maps the ids of the runs it waits on to their statuses; ``question`` is its
    open question (its ``question_head`` annotation or its text is read); ``intent`` the
    intent it waits on. ``attach_waits`` reads all three for a page of runs."""
    if run.status != RunStatus.WAITING:
        return None
    now = now or timezone.now()
    kind = run.waiting_for or ""
    label = str(WaitKind(kind).label) if kind in WaitKind.values else gettext("a person")
    info = WaitInfo(kind=kind, label=label, summary=label, since=run.waiting_since)
    info.until = run.wake_at
    info.due = run.wake_at is not None and run.wake_at <= now
    # A wait on an event or on child runs may also end at its timeout.
    timeout = format_time(info.until) if kind in (WaitKind.EVENT, WaitKind.RUNS) else ""
    if kind in (WaitKind.TIMER, WaitKind.DEBOUNCE):
        info.summary = _timed_summary(kind, run.wake_at, info.due)
    elif kind == WaitKind.EVENT:
        info.event = storable_text(run.wait_event or "")
        values = {"event": cut_summary(info.event), "time": timeout}
        if timeout:
            info.summary = gettext("event “%(event)s” (timeout %(time)s)") % values
        else:
            info.summary = gettext("event “%(event)s”") % values
    elif kind == WaitKind.RUNS:
        _describe_children_wait(info, run, statuses or {}, timeout)
    elif kind == WaitKind.QUESTION:
        if question is not None:
            info.question_id = question.pk
            head = getattr(question, "question_head", None)
            text = head if head is not None else question.question
            first_line = next((line for line in text.splitlines() if line.strip()), text)
            info.summary = gettext("an answer to “%(question)s”") % {
                "question": cut_summary(first_line)
            }
        else:
            info.summary = gettext("an answer to a question")
    elif kind == WaitKind.INTENT or kind == "":
        info.intent = intent
        if intent is not None and intent.status == IntentStatus.UNKNOWN:
            info.summary = gettext("a person to resolve %(tool)s (outcome unknown)") % {
                "tool": cut_summary(intent.tool)
            }
        elif intent is not None:
            info.summary = gettext("an approval of %(tool)s") % {"tool": cut_summary(intent.tool)}
    return info


def attach_waits(runs: Sequence[AgentRun], now: datetime.datetime | None = None) -> None:
    """Set ``wait`` (``wait_info``) on each of a page's runs, and ``children_waited`` on each
    parent. At most three queries whatever the page holds (none for a page without waiting
    runs): the statuses of the runs awaited, the open questions, the intents waited on."""
    waiting = [r for r in runs if r.status == RunStatus.WAITING]
    awaited: set[uuid.UUID] = set()
    question_keys: list[str] = []
    intent_keys: list[str] = []
    for run in waiting:
        if run.waiting_for == WaitKind.RUNS:
            for value in _awaited_ids(run):
                try:
                    awaited.add(uuid.UUID(value))
                except ValueError:
                    continue
        elif run.waiting_for == WaitKind.QUESTION and run.wait_key:
            question_keys.append(run.wait_key)
        elif run.waiting_for in (WaitKind.INTENT, "") and run.wait_key:
            intent_keys.append(run.wait_key)
    statuses: dict[str, str] = {}
    if awaited:
        statuses = {
            str(pk): status
            for pk, status in AgentRun.objects.filter(pk__in=awaited).values_list("pk", "status")
        }
    questions: dict[str, AgentQuestion] = {}
    if question_keys:
        questions = {
            q.key: q
            for q in AgentQuestion.objects.filter(key__in=question_keys)
            .annotate(
                question_head=Substr("question", 1, QUESTION_HEAD_CHARS, output_field=TextField())
            )
            .only("pk", "key", "run_id", "status", "created_at")
        }
    intents: dict[str, ToolIntent] = {}
    if intent_keys:
        intents = {
            i.key: i
            for i in ToolIntent.objects.filter(key__in=intent_keys).only(
                "pk", "key", "run_id", "tool", "status"
            )
        }
    for run in runs:
        key = run.wait_key or ""
        run.wait = wait_info(  # type: ignore[attr-defined]
            run,
            statuses=statuses,
            question=questions.get(key),
            intent=intents.get(key),
            now=now,
        )


@dataclass
class ChildRow:
    run: AgentRun
    task: str
    awaited: bool  # the parent's current wait is on this run

    @property
    def ended(self) -> bool:
        return self.run.status in ENDED_STATUSES

    @property
    def badge(self) -> SafeString:
        return badge(self.run.status, self.run.get_status_display(), RUN_COLORS)


@dataclass
class Children:
    rows: list[ChildRow]
    total: int

    @property
    def more(self) -> int:
        return self.total - len(self.rows)

    @property
    def ended(self) -> int:
        return sum(1 for row in self.rows if row.ended)


def run_children(run: AgentRun) -> Children:
    """The run's child runs, oldest first: at most CHILDREN_SHOWN, with how many there are
    (one query, two when there are more), never their whole tasks."""
    awaited = set(_awaited_ids(run)) if run.status == RunStatus.WAITING else set()
    children = AgentRun.objects.filter(parent_id=run.pk)
    rows = list(
        children.order_by("created_at", "pk")
        .annotate(task_head=Substr("task", 1, TASK_HEAD_CHARS, output_field=TextField()))
        .only("pk", "agent", "prompt_version", "status", "created_at", "finished_at", "parent_id")[
            : CHILDREN_SHOWN + 1
        ]
    )
    total = len(rows) if len(rows) <= CHILDREN_SHOWN else children.count()
    return Children(
        rows=[
            ChildRow(
                run=child,
                task=cut_summary(getattr(child, "task_head", None) or "", TASK_HEAD_CHARS),
                awaited=str(child.pk) in awaited,
            )
            for child in rows[:CHILDREN_SHOWN]
        ],
        total=total,
    )


@dataclass
class QuestionRow:
    question: AgentQuestion
    text: Text
    answer: Text | None
    by: str = ""
    at: str = ""

    @property
    def is_open(self) -> bool:
        return self.question.status == QuestionStatus.OPEN

    @property
    def badge(self) -> SafeString:
        return question_badge(self.question)


def _head_and_length(field_name: str) -> dict[str, Any]:
    return {
        f"{field_name}_head": Substr(field_name, 1, TEXT_SHOWN_CHARS, output_field=TextField()),
        f"{field_name}_length": Length(field_name),
    }


def _annotated_text(obj: Any, field_name: str, url: str) -> Text:
    """A text field read as its head and length (``_head_and_length``), as a ``Text``."""
    head = getattr(obj, f"{field_name}_head", None)
    if head is None:
        return shown_text(getattr(obj, field_name) or "", url)
    length = getattr(obj, f"{field_name}_length", None) or len(head)
    text = shown_text(head, url)
    if length > len(head):
        text.length, text.cut = length, True
    return text


def question_texts(queryset: Any) -> Any:
    """``queryset`` of questions reading only the head and length of the question and the
    answer (either may be long: a question is model output)."""
    queryset = queryset.annotate(**_head_and_length("question")).defer("question")
    if not encryption.enabled():
        # Encrypted at rest, a head cut in SQL would be ciphertext: whole answers are read.
        queryset = queryset.annotate(**_head_and_length("answer")).defer("answer")
    return queryset.select_related("answered_by")


def question_row(question: AgentQuestion, text_url: Callable[[Any, str], str]) -> QuestionRow:
    answered = question.status == QuestionStatus.ANSWERED
    by = question.answered_by
    return QuestionRow(
        question=question,
        text=_annotated_text(question, "question", text_url(question.pk, "question")),
        answer=_annotated_text(question, "answer", text_url(question.pk, "answer"))
        if answered
        else None,
        by=storable_text(by.get_username()) if by is not None else "",
        at=format_time(question.answered_at),
    )


def run_questions(
    run: AgentRun, text_url: Callable[[Any, str], str]
) -> tuple[list[QuestionRow], int]:
    """The run's questions, newest first (at most QUESTIONS_SHOWN), and how many it asked."""
    questions = AgentQuestion.objects.filter(run_id=run.pk)
    rows = list(question_texts(questions).order_by("-created_at", "-pk")[: QUESTIONS_SHOWN + 1])
    total = len(rows) if len(rows) <= QUESTIONS_SHOWN else questions.count()
    return [question_row(q, text_url) for q in rows[:QUESTIONS_SHOWN]], total


def runs_waiting_on_event(name: str) -> tuple[list[AgentRun], int]:
    """Runs waiting on the event ``name``, oldest wait first (at most EVENT_RUNS_SHOWN), and
    how many there are (the partial index agent_run_wait_event serves both)."""
    waiting = AgentRun.objects.filter(
        status=RunStatus.WAITING, waiting_for=WaitKind.EVENT, wait_event=name
    )
    rows = list(
        waiting.order_by("waiting_since", "pk").only(
            "pk", "agent", "prompt_version", "status", "waiting_since", "wake_at", "created_at"
        )[: EVENT_RUNS_SHOWN + 1]
    )
    total = len(rows) if len(rows) <= EVENT_RUNS_SHOWN else waiting.count()
    return rows[:EVENT_RUNS_SHOWN], total
