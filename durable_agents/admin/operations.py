"""The operations page: the figures of the runs, shaped for its charts."""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from django.contrib.humanize.templatetags.humanize import intcomma
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import URLPattern, path
from django.utils.translation import gettext, ngettext

from durable_agents._internal import counting
from durable_agents._internal.counting import bounded_count
from durable_agents.admin.base import AdminPage, AgentsAdmin
from durable_agents.admin.format import (
    HOUR_CHART_HEIGHT,
    RUN_COLORS,
    RUN_STATUS_NAMES,
    compact_age,
    format_time,
)
from durable_agents.admin.schedules import schedule_panel
from durable_agents.admin.waits import cut_summary
from durable_agents.conf import app_settings
from durable_agents.flow.pricing import add_cost, format_usd
from durable_agents.models import (
    FINISHED_STATUSES,
    AgentRun,
    MetricsSnapshot,
    RunStatus,
    WaitKind,
)
from durable_agents.observe.figures import (
    ATTEMPTS_CAP,
    COST_DAYS,
    FINISHED_WINDOW,
    OPERATIONS_PAGE,
    PERCENTILE_SAMPLE,
    Figures,
    Queue,
    WaitFigure,
    attempts_label,
    percentile,
    read_figures,
)
from durable_agents.observe.fleet import Fleet, VersionNeed, read_fleet


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
    shown: str = ""  # what the page prints for ``value``, when that is not the number (a cost)


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


def wait_rows(figures: Figures) -> list[WaitKindRow]:
    """Every kind of wait, with how many runs wait on it and the oldest wait; runs parked
    before waits had kinds last, when there are any."""
    found = {wait.kind: wait for wait in figures.waits}
    kinds = [(k.value, str(k.label)) for k in WaitKind]
    if "" in found:
        kinds.append(("", gettext("unrecorded")))
    rows = []
    for kind, label in kinds:
        wait = found.get(kind, WaitFigure(kind, 0))
        rows.append(
            WaitKindRow(
                kind=kind,
                label=label,
                count=wait.runs,
                oldest_since=wait.oldest_since,
                oldest_run=wait.oldest_run,
                oldest_age=figures.age(wait.oldest_since),
            )
        )
    return rows


def status_bars(figures: Figures) -> tuple[list[Bar], list[Bar], int]:
    """The live statuses now and the runs finished in the window, as bars; and how many
    finished in the window."""
    live = figures.runs_by_status
    live_items = [
        (RunStatus.PENDING.value, live.get(RunStatus.PENDING, 0)),
        (RunStatus.RUNNING.value, live.get(RunStatus.RUNNING, 0)),
        (RunStatus.WAITING.value, figures.waiting_total),
        (RunStatus.DEAD.value, live.get(RunStatus.DEAD, 0)),
    ]
    finished: dict[str, int] = dict.fromkeys(FINISHED_STATUSES, 0)
    for (status, _attempt), n in figures.finished.items():
        finished[status] = finished.get(status, 0) + n
    finished_items = [(str(status), finished.get(status, 0)) for status in FINISHED_STATUSES]
    live_bars = horizontal_bars(live_items, RUN_COLORS)
    finished_bars = horizontal_bars(finished_items, RUN_COLORS)
    for bar in (*live_bars, *finished_bars):
        bar.text = str(RUN_STATUS_NAMES.get(bar.label, bar.label))
    return live_bars, finished_bars, sum(finished.values())


def attempt_bars(figures: Figures) -> list[Bar]:
    """Claims per run finished in the window, the long tail in one "N+" bar."""
    claims: dict[int, int] = {}
    for (_status, attempt), n in figures.finished.items():
        bucket = min(attempt, ATTEMPTS_CAP)
        claims[bucket] = claims.get(bucket, 0) + n
    bars = horizontal_bars([(attempts_label(k), claims[k]) for k in sorted(claims)])
    for bar in bars:
        # "3", or "10+" for the long tail.
        count = int(bar.label.rstrip("+") or 0)
        bar.text = ngettext("%(count)s claim", "%(count)s claims", count) % {"count": bar.label}
    return bars


def hour_bars(figures: Figures) -> list[Bar]:
    """Runs finished per clock hour; every third hour counted back from the current one
    (which reads "now") is labelled under its bar."""
    bars = vertical_bars(
        [(h.strftime("%H:00"), n) for h, n in figures.per_hour], height=HOUR_CHART_HEIGHT
    )
    for back, bar in enumerate(reversed(bars)):
        if back % 3 == 0:
            bar.axis_label = gettext("now") if back == 0 else bar.label
    return bars


@dataclass
class CostRow:
    """One agent and model on the operations page: its model turns, tokens and cost over the
    last COST_DAYS days, and today's cost. A cost of None: none of its turns had a price."""

    agent: str
    model: str
    turns: int = 0
    tokens: int = 0
    cost: Decimal | None = None
    today: Decimal | None = None

    @property
    def cost_text(self) -> str:
        return format_usd(self.cost) or gettext("no price")

    @property
    def today_text(self) -> str:
        return format_usd(self.today) or ("—" if self.cost is not None else gettext("no price"))


def cost_rows(figures: Figures) -> list[CostRow]:
    """Each agent and model of the rollup's last days, the most expensive first (those
    without a price last)."""
    today = figures.taken_at.astimezone(datetime.UTC).date()
    rows: dict[tuple[str, str], CostRow] = {}
    for used in figures.usage:
        row = rows.setdefault((used.agent, used.model), CostRow(used.agent, used.model))
        row.turns += used.turns
        row.tokens += used.tokens
        row.cost = add_cost(row.cost, used.cost)
        if used.day == today:
            row.today = add_cost(row.today, used.cost)
    return sorted(rows.values(), key=lambda r: (r.cost is None, -(r.cost or 0), r.agent, r.model))


# The concurrency keys the operations page lists by cost (the most expensive first).
COST_KEYS = 10


def key_cost_rows(figures: Figures) -> list[CostRow]:
    """The COST_KEYS concurrency keys that cost the most over the rollup's last days (as
    CostRows whose agent is the key), with today's cost: what a tenant's budget is held to."""
    today = figures.taken_at.astimezone(datetime.UTC).date()
    rows: dict[str, CostRow] = {}
    for used in figures.usage:
        if not used.key:
            continue
        row = rows.setdefault(used.key, CostRow(used.key, ""))
        row.turns += used.turns
        row.tokens += used.tokens
        row.cost = add_cost(row.cost, used.cost)
        if used.day == today:
            row.today = add_cost(row.today, used.cost)
    ranked = sorted(rows.values(), key=lambda r: (r.cost is None, -(r.cost or 0), r.agent))
    return ranked[:COST_KEYS]


def turns_today(figures: Figures) -> tuple[int, int]:
    """Model turns of the current UTC day sent directly and answered through a Message Batch
    (from the rollup rows the costs already read)."""
    today = figures.taken_at.astimezone(datetime.UTC).date()
    used = [u for u in figures.usage if u.day == today]
    batched = sum(u.batch_turns for u in used)
    return sum(u.turns for u in used) - batched, batched


def cost_day_bars(figures: Figures) -> list[Bar]:
    """The cost of every agent together on each of the last COST_DAYS UTC days, oldest
    first (a day without a priced turn at 0)."""
    today = figures.taken_at.astimezone(datetime.UTC).date()
    days = [today - datetime.timedelta(days=back) for back in range(COST_DAYS - 1, -1, -1)]
    totals: dict[datetime.date, Decimal] = dict.fromkeys(days, Decimal(0))
    for used in figures.usage:
        if used.day in totals and used.cost is not None:
            totals[used.day] += used.cost
    # Bar lengths in micro-dollars (the geometry is whole units); the page prints the cost.
    bars = horizontal_bars([(day.isoformat(), int(totals[day] * 1_000_000)) for day in days])
    for bar, day in zip(bars, days, strict=True):
        bar.shown = format_usd(totals[day])
        bar.text = gettext("today") if day == today else day.strftime("%m-%d")
    return bars


@dataclass
class TableCount:
    """How many runs the table holds, and where the figure comes from: the latest metrics
    snapshot (exact when housekeeping took it) or, without one, a bounded count (exact up to
    EXACT_COUNT_LIMIT, past it the planner's estimate)."""

    total: int | None
    by_status: dict[str, int]
    taken_at: datetime.datetime | None  # of the snapshot; None for a bounded count
    counted: counting.Count | None = None

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


@dataclass
class FleetLine:
    """A line at the top of the operations page about the workers: none is live while runs
    are in flight, or none defines a version that runs in flight need."""

    kind: str  # "no-worker", "version", or "more" (versions past FLEET_LINES)
    need: VersionNeed | None = None
    dead_letter_from: datetime.datetime | None = None  # last defined + UNDEPLOYED_GRACE
    more: int = 0

    @property
    def text(self) -> str:
        """The line, in words."""
        need = self.need
        if self.kind == "more":
            return ngettext(
                "%(count)s more agent version that runs in flight need has no live worker.",
                "%(count)s more agent versions that runs in flight need have no live worker.",
                self.more,
            ) % {"count": self.more}
        if need is None:
            return gettext(
                "No live worker: nothing will advance until a worker runs "
                "(python manage.py runagents)."
            )
        parts = [
            (need.pending, gettext("pending")),
            (need.running, gettext("running")),
            (need.waiting, gettext("waiting")),
        ]
        words = [f"{n} {word}" for n, word in parts if n]
        if len(words) == 1:
            runs = words[0]
        else:
            runs = gettext("%(first)s and %(last)s") % {
                "first": ", ".join(words[:-1]),
                "last": words[-1],
            }
        values = {"runs": runs, "version": need.label}
        head = (
            ngettext(
                "%(runs)s run needs %(version)s, which no live worker defines",
                "%(runs)s runs need %(version)s, which no live worker defines",
                need.runs,
            )
            % values
        )
        if need.last_defined_at is None:
            when = gettext("no worker on record has defined it")
        else:
            when = gettext("last defined %(time)s, %(age)s ago") % {
                "time": format_time(need.last_defined_at),
                "age": compact_age(need.last_defined_at),
            }
        if self.dead_letter_from is not None:
            grace = gettext(
                "housekeeping dead-letters them after UNDEPLOYED_GRACE, from %(time)s"
            ) % {"time": format_time(self.dead_letter_from)}
        else:
            grace = gettext("housekeeping dead-letters them after UNDEPLOYED_GRACE")
        return f"{head} ({when}; {grace})."


def undeployed_grace() -> datetime.timedelta | None:
    """UNDEPLOYED_GRACE as a duration; None when the setting holds no number (the system
    checks say so)."""
    try:
        return datetime.timedelta(seconds=float(app_settings.UNDEPLOYED_GRACE))
    except (TypeError, ValueError, OverflowError):
        return None


# The most agent versions without a worker the page names (those most runs need first).
FLEET_LINES = 10


def fleet_lines(fleet: Fleet) -> list[FleetLine]:
    """What the page says first about the workers: that none is live while runs are in flight
    (and nothing else: every version then lacks a worker), or each agent version that runs in
    flight need and no live worker defines (the FLEET_LINES that most runs need, then how many
    more there are)."""
    if fleet.no_live_worker:
        return [FleetLine("no-worker")]
    grace = undeployed_grace()
    lines = [
        FleetLine(
            "version",
            need,
            need.last_defined_at + grace
            if grace is not None and need.last_defined_at is not None
            else None,
        )
        for need in fleet.needs[:FLEET_LINES]
    ]
    if len(fleet.needs) > FLEET_LINES:
        lines.append(FleetLine("more", more=len(fleet.needs) - FLEET_LINES))
    return lines


def operations_stats(now: datetime.datetime | None = None) -> dict[str, Any]:
    """Every figure of the operations page, shaped for its charts. Each reads a bounded window
    through an index, or the latest metrics snapshot, never the whole table, and the page says
    which: live statuses now, finished runs in the last 24 hours, the newest finished runs, the
    table's totals as of the snapshot; and the fleet (``read_fleet``: one statement over the
    runs in flight and the worker rows)."""
    figures = read_figures(OPERATIONS_PAGE, now)
    fleet = read_fleet(now)
    live_bars, finished_bars, finished_total = status_bars(figures)
    attempts = attempt_bars(figures)
    hours = hour_bars(figures)
    nothing = Queue(0, None)  # a part not read; OPERATIONS_PAGE reads all three
    pending = figures.pending or nothing
    intents = figures.intents or nothing
    questions = figures.questions or nothing
    steps = figures.steps
    table = table_count()
    direct_turns, batch_turns = turns_today(figures)
    return {
        "fleet": fleet,
        "fleet_lines": fleet_lines(fleet),
        "table": table,
        "total_runs": table.total,
        "live_bars": live_bars,
        "live_chart_height": len(live_bars) * 22,
        "finished_bars": finished_bars,
        "finished_chart_height": len(finished_bars) * 22,
        "finished_total": finished_total,
        "finished_window_hours": int(FINISHED_WINDOW.total_seconds() // 3600),
        "oldest_pending": pending.oldest,
        "oldest_pending_age": figures.age(pending.oldest_at),
        "steps_sample": len(steps),
        "steps_p50": percentile(steps, 0.5),
        "steps_p95": percentile(steps, 0.95),
        "steps_max": steps[-1] if steps else None,
        "percentile_sample_limit": PERCENTILE_SAMPLE,
        "attempt_bars": attempts,
        "attempt_chart_height": max(len(attempts), 1) * 22,
        "intents_waiting": intents.count,
        "oldest_intent": intents.oldest,
        "oldest_intent_age": figures.age(intents.oldest_at),
        "wait_rows": wait_rows(figures),
        "waiting_total": figures.waiting_total,
        "questions_open": questions.count,
        "oldest_question": questions.oldest,
        "oldest_question_text": cut_summary(getattr(questions.oldest, "question_head", ""))
        if questions.oldest is not None
        else "",
        "oldest_question_age": figures.age(questions.oldest_at),
        "hour_bars": hours,
        "hour_total": sum(v for _hour, v in figures.per_hour),
        "hour_chart_width": 24 * 20,
        # The bars stand on this line (they are drawn 12 units down, under their value).
        "hour_baseline_y": HOUR_CHART_HEIGHT + 12,
        "cost_rows": cost_rows(figures),
        "key_cost_rows": key_cost_rows(figures),
        "cost_day_bars": cost_day_bars(figures),
        "cost_chart_height": COST_DAYS * 22,
        "cost_days": COST_DAYS,
        "turns_today_direct": direct_turns,
        "turns_today_batched": batch_turns,
        "cost_total": format_usd(sum((u.cost for u in figures.usage if u.cost), Decimal(0))),
    }


class OperationsPage(AdminPage[AgentsAdmin[AgentRun]]):
    """The operations page, under the runs' admin (its URL and name are the runs')."""

    def urls(self) -> list[URLPattern]:
        view = self.admin.admin_site.admin_view(self.operations_view)
        return [path("operations/", view, name=self.admin._object_url("operations"))]

    def operations_view(self, request: HttpRequest) -> HttpResponse:
        if not self.admin.has_view_permission(request):
            raise PermissionDenied
        context = {
            **self.admin.admin_site.each_context(request),
            "title": gettext("Operations"),
            "opts": self.admin.opts,
            **operations_stats(),
            # The schedules' next slots and those in trouble, for whoever may see schedules.
            "schedules": schedule_panel()
            if request.user.has_perm("durable_agents.view_agentschedule")
            else None,
        }
        return TemplateResponse(request, "admin/durable_agents/agentrun/operations.html", context)
