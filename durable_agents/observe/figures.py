"""The operational figures of the runs, read in one place into one typed value.

Three readers use them: the admin's operations page (charts), ``housekeeping`` (a metrics
snapshot stored in ``agent_metrics``) and the Prometheus collector (gauges at scrape time).
Each asks ``read_figures`` for the parts it shows (``Part``); a part not asked for is not
read and stays empty. Every query aggregates in the database, reads a bounded sample or window
through an index, or is a bounded count: none reads a row per run.
"""

from __future__ import annotations

import datetime
import enum
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from django.db import DEFAULT_DB_ALIAS
from django.db.models import (
    Count,
    DateTimeField,
    F,
    Func,
    IntegerField,
    Min,
    Q,
    QuerySet,
    Subquery,
    Sum,
    TextField,
)
from django.db.models.functions import Now, Substr, TruncHour
from django.utils import timezone

from durable_agents._internal.counting import bounded_count
from durable_agents.models import (
    FINISHED_STATUSES,
    AgentQuestion,
    AgentRun,
    AgentUsageDay,
    QuestionStatus,
    RunStatus,
    ToolIntent,
)

# How many finished runs the steps percentiles look at: bounded so that the figure stays cheap
# on a table of millions, and portable (no percentile_cont on SQLite).
PERCENTILE_SAMPLE = 10_000
# Claims of a run from which on the attempts distribution has a single "N+" bucket.
ATTEMPTS_CAP = 10
# The window of the figures about recently finished runs: through the index agent_run_finished.
FINISHED_WINDOW = datetime.timedelta(hours=24)
# The statuses a run is in until it ends, counted exactly (each through the index
# agent_run_status); waiting runs are counted by kind of wait.
LIVE_STATUSES = (RunStatus.PENDING, RunStatus.RUNNING, RunStatus.DEAD)
UNFINISHED_STATUSES = (RunStatus.PENDING, RunStatus.RUNNING, RunStatus.WAITING)
# The UTC days (today included) of the cost figures.
COST_DAYS = 7
# Characters of the oldest open question read (never the whole text).
QUESTION_HEAD_CHARS = 200


class Part(enum.Flag):
    """What a reader asks ``read_figures`` for."""

    # Runs by status: pending, running and waiting exactly, the ended statuses as bounded
    # counts; running runs whose lease expired; waiting runs by kind; the counts and oldest
    # times of waiting intents and open questions. One grouped query over the unfinished
    # runs, then one bounded count per ended status: what a frequent scrape may cost.
    GAUGES = enum.auto()
    ALL_STATUSES = enum.auto()  # every status counted exactly (one index-only aggregate)
    LIVE_STATUSES = enum.auto()  # pending, running and dead counted exactly
    WAITS = enum.auto()  # waiting runs by kind with their oldest wait (one aggregate)
    OLDEST_WAITING_RUNS = enum.auto()  # the run of each kind's oldest wait (one query more)
    OLDEST_PENDING = enum.auto()
    INTENTS = enum.auto()  # waiting intents: how many, and the oldest (with its run)
    QUESTIONS = enum.auto()  # open questions: how many (with OLDEST_QUESTION, the oldest)
    OLDEST_QUESTION = enum.auto()
    STEPS = enum.auto()  # steps of the newest PERCENTILE_SAMPLE finished runs
    ATTEMPTS = enum.auto()  # claims per finished run, every finished run
    FINISHED_WINDOW = enum.auto()  # runs finished in FINISHED_WINDOW, by status and claims
    PER_HOUR = enum.auto()  # runs finished in each of the last 24 clock hours
    # Model turns, tokens and cost by UTC day, agent and model over the last COST_DAYS days,
    # from the rollup agent_usage_day (one aggregate over its few rows per day).
    COSTS = enum.auto()


PROMETHEUS = Part.GAUGES
SNAPSHOT = (
    Part.ALL_STATUSES
    | Part.WAITS
    | Part.OLDEST_PENDING
    | Part.INTENTS
    | Part.QUESTIONS
    | Part.STEPS
    | Part.ATTEMPTS
    | Part.PER_HOUR
)
OPERATIONS_PAGE = (
    Part.LIVE_STATUSES
    | Part.WAITS
    | Part.OLDEST_WAITING_RUNS
    | Part.OLDEST_PENDING
    | Part.INTENTS
    | Part.QUESTIONS
    | Part.OLDEST_QUESTION
    | Part.STEPS
    | Part.FINISHED_WINDOW
    | Part.PER_HOUR
    | Part.COSTS
)


@dataclass(frozen=True)
class WaitFigure:
    """Waiting runs of one kind of wait ("" for runs parked before waits had kinds)."""

    kind: str
    runs: int
    oldest_since: datetime.datetime | None = None  # the oldest ``waiting_since``
    oldest_run: AgentRun | None = None  # that run (Part.OLDEST_WAITING_RUNS)


@dataclass(frozen=True)
class Queue:
    """Things waiting for a person (intents, questions) or a worker (pending runs): how many,
    and since when the oldest has waited (with the oldest itself when it was read)."""

    count: int | None  # None: not counted (the oldest pending run alone is read)
    oldest_at: datetime.datetime | None
    oldest: Any = None


@dataclass(frozen=True)
class UsageFigure:
    """Model turns of one agent and model on one UTC day, from the rollup."""

    day: datetime.date
    agent: str
    model: str
    turns: int
    tokens: int  # input, cache and output
    cost: Decimal | None  # None: none of these turns had a price
    key: str = ""  # the runs' concurrency key ('': none)
    batch_turns: int = 0  # of ``turns``, those answered through a Message Batch


@dataclass(frozen=True)
class Figures:
    """The figures as of ``taken_at``; the parts not read are empty (or None)."""

    taken_at: datetime.datetime
    runs_by_status: Mapping[str, int] = field(default_factory=dict)
    lease_expired: int | None = None
    waits: tuple[WaitFigure, ...] = ()
    pending: Queue | None = None
    intents: Queue | None = None
    questions: Queue | None = None
    steps: tuple[int, ...] = ()  # sorted
    attempts: Mapping[int, int] = field(default_factory=dict)  # capped claims -> runs
    finished: Mapping[tuple[str, int], int] = field(default_factory=dict)  # in the window
    per_hour: tuple[tuple[datetime.datetime, int], ...] = ()
    usage: tuple[UsageFigure, ...] = ()  # the last COST_DAYS days, oldest first

    def age(self, since: datetime.datetime | None) -> datetime.timedelta | None:
        return None if since is None else self.taken_at - since

    def age_seconds(self, since: datetime.datetime | None) -> float | None:
        age = self.age(since)
        return None if age is None else age.total_seconds()

    @property
    def waiting_total(self) -> int:
        return sum(wait.runs for wait in self.waits)


def percentile(sorted_values: tuple[int, ...] | list[int], fraction: float) -> float | None:
    """Linear interpolation between closest ranks, as PostgreSQL's percentile_cont does."""
    if not sorted_values:
        return None
    position = (len(sorted_values) - 1) * fraction
    low = int(position)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)


def attempts_label(bucket: int) -> str:
    """``3``, or ``10+`` for the long tail."""
    return f"{bucket}+" if bucket == ATTEMPTS_CAP else str(bucket)


def read_figures(
    parts: Part,
    now: datetime.datetime | None = None,
    *,
    using: str = DEFAULT_DB_ALIAS,
) -> Figures:
    """The figures of ``parts``, as of ``now``."""
    now = now or timezone.now()
    runs = AgentRun.objects.using(using)
    values: dict[str, Any] = {}
    if Part.GAUGES in parts:
        values.update(_gauges(using))
    if Part.ALL_STATUSES in parts:
        counts = dict(runs.order_by().values_list("status").annotate(n=Count("*")))
        values["runs_by_status"] = {s: counts.get(s, 0) for s in RunStatus.values}
    if Part.LIVE_STATUSES in parts:
        values["runs_by_status"] = dict(
            runs.filter(status__in=LIVE_STATUSES)
            .order_by()
            .values_list("status")
            .annotate(n=Count("*"))  # COUNT(*): the index agent_run_status answers alone
        )
    # With the oldest waiting runs, the oldest pending run is read in the same query.
    pending_with_waits = Part.OLDEST_PENDING in parts and Part.OLDEST_WAITING_RUNS in parts
    if Part.WAITS in parts:
        values["waits"], oldest_pending = _waits(
            runs,
            with_runs=Part.OLDEST_WAITING_RUNS in parts,
            with_pending=pending_with_waits,
        )
        if pending_with_waits:
            values["pending"] = Queue(
                None, oldest_pending.created_at if oldest_pending else None, oldest_pending
            )
    if Part.OLDEST_PENDING in parts and "pending" not in values:
        pending = runs.filter(status=RunStatus.PENDING).order_by("created_at").first()
        values["pending"] = Queue(None, pending.created_at if pending else None, pending)
    if Part.INTENTS in parts:
        # The oldest with the count of all as a scalar subquery: one statement (none waiting:
        # no row, and none to count).
        waiting = ToolIntent.objects.using(using).awaiting_person()
        oldest = (
            waiting.annotate(waiting_total=scalar(waiting, "COUNT", "pk", IntegerField()))
            .order_by("created_at")
            .select_related("run")
            .first()
        )
        if oldest is None:
            values["intents"] = Queue(0, None)
        else:
            # The custom queryset's type does not carry the annotation.
            total = oldest.waiting_total  # type: ignore[attr-defined]
            values["intents"] = Queue(total, oldest.created_at, oldest)
    if Part.QUESTIONS in parts:
        values["questions"] = _questions(using, oldest=Part.OLDEST_QUESTION in parts)
    values.update(_finished(runs, parts, now))
    if Part.COSTS in parts:
        values["usage"] = usage_by_day(now, days=COST_DAYS, using=using)
    return Figures(taken_at=now, **values)


def usage_by_day(
    now: datetime.datetime, *, days: int = 7, using: str = DEFAULT_DB_ALIAS
) -> tuple[UsageFigure, ...]:
    """The rollup's rows of the last ``days`` UTC days (today included) by day, agent, model
    and concurrency key, their shards summed: one aggregate over the day range of its unique
    index, whose rows grow with agents, models and keys, never with runs or steps."""
    today = now.astimezone(datetime.UTC).date()
    rows = (
        AgentUsageDay.objects.using(using)
        .filter(day__gt=today - datetime.timedelta(days=days))
        .order_by()
        .values_list("day", "agent", "model", "concurrency_key")
        .annotate(
            n=Sum("turns"),
            read=Sum("input_tokens"),
            out=Sum("output_tokens"),
            cached=Sum("cache_read_tokens"),
            written=Sum("cache_write_tokens"),
            cost=Sum("cost_usd"),
            batched=Sum("batch_turns"),
        )
        .order_by("day", "agent", "model", "concurrency_key")
    )
    return tuple(
        UsageFigure(day, agent, model, n, read + out + cached + written, cost, key, batched or 0)
        for day, agent, model, key, n, read, out, cached, written, cost, batched in rows
    )


def _waits(
    runs: QuerySet[AgentRun], *, with_runs: bool, with_pending: bool = False
) -> tuple[tuple[WaitFigure, ...], AgentRun | None]:
    """Waiting runs per kind of wait, each with its oldest wait: one aggregate (and, with
    ``with_runs``, one query for the oldest runs), whatever the number of waiting runs. With
    ``with_pending`` (and ``with_runs``), that query also reads the oldest pending run (its
    id, agent and creation time), returned second."""
    waiting = runs.filter(status=RunStatus.WAITING)
    aggregated = list(
        waiting.order_by()
        .values_list("waiting_for")
        # COUNT(*): the partial index agent_run_waiting (waiting_for, waiting_since) answers.
        .annotate(n=Count("*"), oldest=Min("waiting_since"))
    )
    oldest_runs: dict[str, AgentRun] = {}
    oldest_filter = Q()
    for kind, _count, oldest in aggregated:
        if oldest is not None:
            # At most the oldest, not equal to it: SQLite stores a time written by the
            # database (Now()) in milliseconds and compares it as text with the microseconds
            # of the value read back, so equality never holds there. No wait is older than
            # the oldest, so this still matches only it (and its ties).
            oldest_filter |= Q(waiting_for=kind, waiting_since__lte=oldest)
    wanted = Q(status=RunStatus.WAITING) & oldest_filter if oldest_filter else None
    if with_runs and with_pending:
        oldest_pending = runs.filter(status=RunStatus.PENDING).order_by("created_at")
        pending_pk = Q(pk=Subquery(oldest_pending.values("pk")[:1]))
        wanted = pending_pk if wanted is None else wanted | pending_pk
    pending: AgentRun | None = None
    if with_runs and wanted is not None:
        for run in (
            runs.filter(wanted)
            .order_by("waiting_since", "pk")
            .only("pk", "agent", "status", "waiting_for", "waiting_since", "created_at")
        ):
            if run.status == RunStatus.PENDING:
                pending = run
            else:
                oldest_runs.setdefault(run.waiting_for, run)
    waits = tuple(
        WaitFigure(kind or "", n, oldest, oldest_runs.get(kind)) for kind, n, oldest in aggregated
    )
    return waits, pending


def scalar(queryset: QuerySet[Any], function: str, column: str, output: Any) -> Subquery:
    """``function`` (an aggregate: COUNT, MIN) of ``column`` over ``queryset``, as a scalar
    subquery another statement carries (evaluated once: it refers to nothing outside)."""
    value = Func(F(column), function=function, output_field=output)
    return Subquery(queryset.order_by().annotate(v=value).values("v")[:1])


def _questions(using: str, *, oldest: bool) -> Queue:
    """Open questions: how many; with ``oldest``, the oldest one (its head, not its text)."""
    open_questions = AgentQuestion.objects.using(using).filter(status=QuestionStatus.OPEN)
    if not oldest:
        return Queue(open_questions.count(), None)
    # The oldest with the count of all as a scalar subquery: one statement.
    first = (
        open_questions.order_by("created_at", "pk")
        .annotate(
            question_head=Substr("question", 1, QUESTION_HEAD_CHARS, output_field=TextField()),
            open_total=scalar(open_questions, "COUNT", "pk", IntegerField()),
        )
        .defer("question", "answer")
        .first()
    )
    if first is None:
        return Queue(0, None)
    return Queue(first.open_total, first.created_at, first)


def _finished(runs: QuerySet[AgentRun], parts: Part, now: datetime.datetime) -> dict[str, Any]:
    """The parts about finished runs: a sample, the claims, a window, the hours."""
    values: dict[str, Any] = {}
    finished = runs.filter(status__in=FINISHED_STATUSES)
    if Part.STEPS in parts:
        # finished_at IS NOT NULL lets the partial index agent_run_finished serve the order.
        newest = finished.filter(finished_at__isnull=False).order_by("-finished_at")
        sample = newest.values_list("last_seq", flat=True)[:PERCENTILE_SAMPLE]
        values["steps"] = tuple(sorted(last_seq + 1 for last_seq in sample))  # seq 0: the task
    if Part.ATTEMPTS in parts:
        attempts: Counter[int] = Counter()
        for attempt, n in finished.order_by().values_list("attempt").annotate(n=Count("pk")):
            attempts[min(attempt, ATTEMPTS_CAP)] += n
        values["attempts"] = dict(attempts)
    if Part.FINISHED_WINDOW in parts:
        # Runs finished in the window, by status and claims: one aggregate for both.
        window: Counter[tuple[str, int]] = Counter()
        for status, attempt, n in (
            finished.filter(finished_at__gte=now - FINISHED_WINDOW)
            .order_by()
            .values_list("status", "attempt")
            .annotate(n=Count("pk"))
        ):
            window[(status, attempt)] += n
        values["finished"] = dict(window)
    if Part.PER_HOUR in parts:
        values["per_hour"] = tuple(_finished_per_hour(runs, now))
    return values


def _finished_per_hour(
    runs: QuerySet[AgentRun], now: datetime.datetime
) -> list[tuple[datetime.datetime, int]]:
    """Runs finished in each of the last 24 clock hours (UTC), oldest first, the current last."""
    since = (now - datetime.timedelta(hours=23)).replace(minute=0, second=0, microsecond=0)
    rows = (
        runs.filter(finished_at__gte=since)
        .annotate(hour=TruncHour("finished_at", tzinfo=datetime.UTC))
        .order_by()
        .values_list("hour")
        .annotate(n=Count("pk"))
    )
    # Keyed by naive UTC hours so that the backends' aware/naive results compare equal.
    counts: Counter[datetime.datetime] = Counter()
    for hour, n in rows:
        if hour is not None:
            counts[hour.astimezone(datetime.UTC).replace(tzinfo=None)] += n
    start = since.astimezone(datetime.UTC)
    hours = [start + datetime.timedelta(hours=h) for h in range(24)]
    return [(hour, counts.get(hour.replace(tzinfo=None), 0)) for hour in hours]


def _gauges(using: str) -> dict[str, Any]:
    """``Part.GAUGES`` in a few statements whatever the size of ``agent_run``: its unfinished
    runs (few, through the status index) grouped by status and wait kind, with the waiting
    intents and open questions as scalar subqueries (evaluated once); then the ended runs per
    status, each a bounded count (exact up to 10,000 rows, past that the planner's estimate),
    so that a table of ten million runs is not read at every scrape."""

    intents = ToolIntent.objects.using(using).awaiting_person()
    questions = AgentQuestion.objects.using(using).filter(status=QuestionStatus.OPEN)
    runs = AgentRun.objects.using(using)
    rows = list(
        runs.filter(status__in=UNFINISHED_STATUSES)
        .order_by()
        .values("status", "waiting_for")
        .annotate(
            runs=Count("pk"),
            oldest=Min("created_at"),
            expired=Count("pk", filter=Q(status=RunStatus.RUNNING, lease_until__lt=Now())),
            open_intents=scalar(intents, "COUNT", "pk", IntegerField()),
            oldest_intent=scalar(intents, "MIN", "created_at", DateTimeField()),
            open_questions=scalar(questions, "COUNT", "pk", IntegerField()),
            oldest_question=scalar(questions, "MIN", "created_at", DateTimeField()),
        )
    )
    by_status = dict.fromkeys(RunStatus.values, 0)
    waiting: Counter[str] = Counter()
    for row in rows:
        by_status[row["status"]] += row["runs"]
        if row["status"] == RunStatus.WAITING:
            waiting[row["waiting_for"] or ""] += row["runs"]
    oldest_pending = min(
        (row["oldest"] for row in rows if row["status"] == RunStatus.PENDING and row["oldest"]),
        default=None,
    )
    if rows:  # every row carries the same scalar subqueries
        intent_queue = Queue(rows[0]["open_intents"] or 0, rows[0]["oldest_intent"])
        question_queue = Queue(rows[0]["open_questions"] or 0, rows[0]["oldest_question"])
    else:  # no unfinished run carried them
        found = intents.order_by().aggregate(n=Count("pk"), oldest=Min("created_at"))
        intent_queue = Queue(found["n"], found["oldest"])
        found = questions.order_by().aggregate(n=Count("pk"), oldest=Min("created_at"))
        question_queue = Queue(found["n"], found["oldest"])
    for status in RunStatus.values:
        if status not in UNFINISHED_STATUSES:
            by_status[status] = bounded_count(runs.filter(status=status)).value
    return {
        "runs_by_status": by_status,
        "lease_expired": sum(row["expired"] for row in rows),
        "waits": tuple(WaitFigure(kind, n) for kind, n in waiting.items()),
        "pending": Queue(by_status[RunStatus.PENDING], oldest_pending),
        "intents": intent_queue,
        "questions": question_queue,
    }
