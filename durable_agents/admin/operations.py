"""The operations page: the figures of the runs, shaped for its charts."""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from django.contrib.humanize.templatetags.humanize import intcomma
from django.core.exceptions import PermissionDenied
from django.db.models import (
    Count,
    Min,
    Q,
    TextField,
)
from django.db.models.functions import Substr
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import URLPattern, path
from django.utils import timezone
from django.utils.translation import gettext, ngettext

from durable_agents import metrics
from durable_agents.admin import listing
from durable_agents.admin.base import AgentsAdmin
from durable_agents.admin.format import HOUR_CHART_HEIGHT, RUN_COLORS, RUN_STATUS_NAMES
from durable_agents.admin.listing import bounded_count
from durable_agents.admin.waits import QUESTION_HEAD_CHARS, cut_summary
from durable_agents.models import (
    FINISHED_STATUSES,
    AgentQuestion,
    AgentRun,
    MetricsSnapshot,
    QuestionStatus,
    RunStatus,
    WaitKind,
)

if TYPE_CHECKING:
    pass


# ---------------------------------------------------------------------------------------------
# Operations


@dataclass
class Bar:
    label: str
    value: int
    # Geometry in SVG user units, computed here so that templates only print numbers.
    x: int = 0
    y: int = 0
    width: int = 0
    height: int = 0
    color: str = "#417690"
    link: str = ""
    axis_label: str = ""  # printed under the bar (vertical charts), empty for most bars
    text: str = ""  # what the page prints for ``label``, when that is not ``label`` itself


def horizontal_bars(
    items: Sequence[tuple[str, int]], colors: dict[str, str] | None = None, width: int = 300
) -> list[Bar]:
    top = max((v for _label, v in items), default=0) or 1
    bars = []
    for i, (label, value) in enumerate(items):
        w = round(width * value / top) if value else 0
        color = (colors or {}).get(label, "#417690")
        bars.append(
            Bar(
                label, value, x=0, y=i * 22, width=max(w, 1 if value else 0), height=16, color=color
            )
        )
    return bars


def vertical_bars(items: Sequence[tuple[str, int]], height: int = 100, step: int = 20) -> list[Bar]:
    top = max((v for _label, v in items), default=0) or 1
    bars = []
    for i, (label, value) in enumerate(items):
        h = round(height * value / top) if value else 0
        bars.append(Bar(label, value, x=i * step, y=height - h, width=step - 4, height=h))
    return bars


@dataclass
class WaitKindRow:
    """One line of the operations page's waits table: a kind, how many wait on it, and the
    run that has waited longest (by ``waiting_since``)."""

    kind: str
    label: str
    count: int
    oldest_since: datetime.datetime | None = None
    oldest_run: AgentRun | None = None
    oldest_age: datetime.timedelta | None = None


def waits_by_kind(now: datetime.datetime) -> list[WaitKindRow]:
    """Waiting runs per kind of wait, each with its oldest wait: two queries (one aggregate,
    one for the oldest runs), whatever the number of waiting runs."""
    aggregated = list(
        AgentRun.objects.filter(status=RunStatus.WAITING)
        .order_by()
        .values_list("waiting_for")
        # COUNT(*): the partial index agent_run_waiting (waiting_for, waiting_since) answers.
        .annotate(n=Count("*"), oldest=Min("waiting_since"))
    )
    found = {kind: (n, oldest) for kind, n, oldest in aggregated}
    oldest_filter = Q()
    for kind, (_count, oldest) in found.items():
        if oldest is not None:
            oldest_filter |= Q(waiting_for=kind, waiting_since=oldest)
    oldest_runs: dict[str, AgentRun] = {}
    if oldest_filter:
        for run in (
            AgentRun.objects.filter(status=RunStatus.WAITING)
            .filter(oldest_filter)
            .order_by("waiting_since", "pk")
            .only("pk", "agent", "status", "waiting_for", "waiting_since")
        ):
            oldest_runs.setdefault(run.waiting_for, run)
    kinds = [(k.value, str(k.label)) for k in WaitKind]
    if "" in found:  # runs parked before waits had kinds
        kinds.append(("", gettext("unrecorded")))
    rows = []
    for kind, label in kinds:
        count, oldest = found.get(kind, (0, None))
        rows.append(
            WaitKindRow(
                kind=kind,
                label=label,
                count=count,
                oldest_since=oldest,
                oldest_run=oldest_runs.get(kind),
                oldest_age=(now - oldest) if oldest is not None else None,
            )
        )
    return rows


def open_questions() -> tuple[int, AgentQuestion | None]:
    """How many questions wait for an answer, and the oldest of them (two queries)."""
    waiting = AgentQuestion.objects.filter(status=QuestionStatus.OPEN)
    oldest = (
        waiting.order_by("created_at", "pk")
        .annotate(
            question_head=Substr("question", 1, QUESTION_HEAD_CHARS, output_field=TextField())
        )
        .defer("question", "answer")
        .first()
    )
    return (waiting.count() if oldest is not None else 0), oldest


# The statuses a run is in until it ends, counted exactly on the operations page (each through
# the index agent_run_status); waiting runs are counted by kind of wait (waits_by_kind).
LIVE_STATUSES = (RunStatus.PENDING, RunStatus.RUNNING, RunStatus.DEAD)
# The window of the figures about finished runs: through the index agent_run_finished.
FINISHED_WINDOW = datetime.timedelta(hours=24)


@dataclass
class TableCount:
    """How many runs the table holds, and where the figure comes from: the latest metrics
    snapshot (exact when housekeeping took it) or, without one, a bounded count (exact up to
    EXACT_COUNT_LIMIT, past it the planner's estimate)."""

    total: int | None
    by_status: dict[str, int]
    taken_at: datetime.datetime | None  # of the snapshot; None for a bounded count
    counted: listing.Count | None = None

    @property
    def shown(self) -> str:
        if self.counted is not None:
            return str(self.counted)
        return "?" if self.total is None else str(intcomma(self.total))


def table_count() -> TableCount:
    snapshot = MetricsSnapshot.objects.order_by("-taken_at").first()
    by_status = snapshot.data.get("runs_by_status") if snapshot is not None else None
    if snapshot is not None and isinstance(by_status, dict):
        counts = {str(k): int(v) for k, v in by_status.items() if isinstance(v, int)}
        return TableCount(sum(counts.values()), counts, snapshot.taken_at)
    counted = bounded_count(AgentRun.objects.all())
    return TableCount(counted.value, {}, None, counted)


def operations_stats(now: datetime.datetime | None = None) -> dict[str, Any]:
    """Every figure of the operations page, shaped for its charts. Each reads a bounded window
    through an index, or the latest metrics snapshot, never the whole table, and the page says
    which: live statuses now, finished runs in the last 24 hours, the newest finished runs, the
    table's totals as of the snapshot."""
    now = now or timezone.now()
    live = dict(
        AgentRun.objects.filter(status__in=LIVE_STATUSES)
        .order_by()
        .values_list("status")
        .annotate(n=Count("*"))  # COUNT(*): the index agent_run_status answers alone
    )
    wait_rows = waits_by_kind(now)
    waiting_total = sum(row.count for row in wait_rows)
    live_items = [
        (RunStatus.PENDING.value, live.get(RunStatus.PENDING, 0)),
        (RunStatus.RUNNING.value, live.get(RunStatus.RUNNING, 0)),
        (RunStatus.WAITING.value, waiting_total),
        (RunStatus.DEAD.value, live.get(RunStatus.DEAD, 0)),
    ]
    # Runs finished in the window, by status and claims: both charts from one aggregate.
    since = now - FINISHED_WINDOW
    finished_counts: dict[str, int] = dict.fromkeys(FINISHED_STATUSES, 0)
    claims: dict[int, int] = {}
    for status, attempt, n in (
        AgentRun.objects.filter(finished_at__gte=since, status__in=FINISHED_STATUSES)
        .order_by()
        .values_list("status", "attempt")
        .annotate(n=Count("pk"))
    ):
        finished_counts[status] = finished_counts.get(status, 0) + n
        bucket = min(attempt, metrics.ATTEMPTS_CAP)
        claims[bucket] = claims.get(bucket, 0) + n
    finished_items = [(str(status), finished_counts.get(status, 0)) for status in FINISHED_STATUSES]
    live_bars = horizontal_bars(live_items, RUN_COLORS)
    finished_bars = horizontal_bars(finished_items, RUN_COLORS)
    for bar in (*live_bars, *finished_bars):
        bar.text = str(RUN_STATUS_NAMES.get(bar.label, bar.label))
    attempts = [
        (f"{k}+" if k == metrics.ATTEMPTS_CAP else str(k), claims[k]) for k in sorted(claims)
    ]
    attempt_bars = horizontal_bars(attempts)
    for bar in attempt_bars:
        # "3", or "10+" for the long tail.
        count = int(bar.label.rstrip("+") or 0)
        bar.text = ngettext("%(count)s claim", "%(count)s claims", count) % {"count": bar.label}
    oldest_pending = metrics.oldest_pending()
    finished_steps = metrics.steps_of_recent_finished_runs()
    waiting_count, oldest_intent = metrics.waiting_intents()
    questions_open, oldest_question = open_questions()
    hour_items = [(h.strftime("%H:00"), n) for h, n in metrics.finished_per_hour(now)]
    hour_bars = vertical_bars(hour_items, height=HOUR_CHART_HEIGHT)
    # Every third hour counted back from the current one, which reads "now".
    for back, bar in enumerate(reversed(hour_bars)):
        if back % 3 == 0:
            bar.axis_label = gettext("now") if back == 0 else bar.label
    table = table_count()

    return {
        "table": table,
        "total_runs": table.total,
        "live_bars": live_bars,
        "live_chart_height": len(live_items) * 22,
        "finished_bars": finished_bars,
        "finished_chart_height": len(finished_items) * 22,
        "finished_total": sum(finished_counts.values()),
        "finished_window_hours": int(FINISHED_WINDOW.total_seconds() // 3600),
        "oldest_pending": oldest_pending,
        "oldest_pending_age": (now - oldest_pending.created_at) if oldest_pending else None,
        "steps_sample": len(finished_steps),
        "steps_p50": metrics.percentile(finished_steps, 0.5),
        "steps_p95": metrics.percentile(finished_steps, 0.95),
        "steps_max": finished_steps[-1] if finished_steps else None,
        "percentile_sample_limit": metrics.PERCENTILE_SAMPLE,
        "attempt_bars": attempt_bars,
        "attempt_chart_height": max(len(attempts), 1) * 22,
        "intents_waiting": waiting_count,
        "oldest_intent": oldest_intent,
        "oldest_intent_age": (now - oldest_intent.created_at) if oldest_intent else None,
        "wait_rows": wait_rows,
        "waiting_total": waiting_total,
        "questions_open": questions_open,
        "oldest_question": oldest_question,
        "oldest_question_text": cut_summary(getattr(oldest_question, "question_head", ""))
        if oldest_question is not None
        else "",
        "oldest_question_age": (now - oldest_question.created_at) if oldest_question else None,
        "hour_bars": hour_bars,
        "hour_total": sum(v for _hour, v in hour_items),
        "hour_chart_width": 24 * 20,
        # The bars stand on this line (they are drawn 12 units down, under their value).
        "hour_baseline_y": HOUR_CHART_HEIGHT + 12,
    }


class OperationsPage(AgentsAdmin[AgentRun]):
    """The operations page, under the runs' admin (its URL and name are the runs')."""

    def get_urls(self) -> list[URLPattern]:
        view = self.admin_site.admin_view(self.operations_view)
        return [
            path("operations/", view, name=self._object_url("operations")),
            *super().get_urls(),
        ]

    def operations_view(self, request: HttpRequest) -> HttpResponse:
        if not self.has_view_permission(request):
            raise PermissionDenied
        context = {
            **self.admin_site.each_context(request),
            "title": gettext("Operations"),
            "opts": self.opts,
            **operations_stats(),
        }
        return TemplateResponse(request, "admin/durable_agents/agentrun/operations.html", context)
