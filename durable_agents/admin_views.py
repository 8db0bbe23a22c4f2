"""What the admin pages show, kept apart from the ModelAdmin classes in ``admin.py``.

Everything here reads; the only writes are in the POST views, and they go through
``durable_agents.api``. Payloads come from the model and from tools: they are passed to
templates as plain strings (autoescaped there), never marked safe.
"""

from __future__ import annotations

import datetime
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from django.db import connection
from django.db.models import Count, Max
from django.utils import dateformat, timezone
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString, mark_safe
from django.utils.text import Truncator

from durable_agents import metrics
from durable_agents.models import (
    AgentRun,
    AgentStep,
    IntentStatus,
    RunStatus,
    StepKind,
    ToolEffect,
    ToolIntent,
)

# Fixed colours per status: the only values interpolated into a style attribute.
RUN_COLORS = {
    RunStatus.PENDING: "#6c757d",
    RunStatus.RUNNING: "#0b6bcb",
    RunStatus.WAITING: "#b35c00",
    RunStatus.SUCCEEDED: "#1a7f37",
    RunStatus.FAILED: "#c62828",
    RunStatus.CANCELLED: "#57606a",
    RunStatus.DEAD: "#6f2da8",
}
INTENT_COLORS = {
    IntentStatus.PENDING: "#b35c00",
    IntentStatus.APPROVED: "#0b6bcb",
    IntentStatus.REJECTED: "#c62828",
    IntentStatus.EXECUTING: "#0b6bcb",
    IntentStatus.DONE: "#1a7f37",
    IntentStatus.UNKNOWN: "#6f2da8",
}

# How many dead runs the dead-letter page groups (errors are folded in Python).
DEAD_LETTER_SAMPLE = 10_000
REASON_CHARS = 120
HOUR_CHART_HEIGHT = 100


# Short labels for the runs list, where "Waiting for a person" would widen the column.
RUN_SHORT_LABELS = {
    RunStatus.PENDING: "Pending",
    RunStatus.RUNNING: "Running",
    RunStatus.WAITING: "Waiting",
    RunStatus.SUCCEEDED: "Succeeded",
    RunStatus.FAILED: "Failed",
    RunStatus.CANCELLED: "Cancelled",
    RunStatus.DEAD: "Dead",
}

# One format for every time the admin prints: fields, columns and the transcript.
TIME_FORMAT = "Y-m-d H:i:s"


def badge(status: str, label: str, colors: dict[str, str], title: str = "") -> SafeString:
    if title:
        return format_html(
            '<span class="da-badge" style="background-color:{}" title="{}">{}</span>',
            colors.get(status, "#57606a"),
            title,
            label,
        )
    return format_html(
        '<span class="da-badge" style="background-color:{}">{}</span>',
        colors.get(status, "#57606a"),
        label,
    )


def format_time(value: datetime.datetime | None, fmt: str = TIME_FORMAT) -> str:
    """A datetime in the current time zone as ``fmt`` (a ``date`` filter format)."""
    if value is None:
        return ""
    if timezone.is_aware(value):
        value = timezone.localtime(value)
    return dateformat.format(value, fmt)


def compact_age(since: datetime.datetime, now: datetime.datetime | None = None) -> str:
    """``45s``, ``12m``, ``3h``, ``2d``: the list's age column in a few characters."""
    seconds = max(int(((now or timezone.now()) - since).total_seconds()), 0)
    for unit, size in (("d", 86_400), ("h", 3_600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def lease_summary(
    owner: str | None, until: datetime.datetime | None, now: datetime.datetime | None = None
) -> SafeString | None:
    """The list's lease column: the owner, then "until HH:MM:SS" or "expired"; None if free."""
    if not owner and until is None:
        return None
    if until is None:
        state = ""
    elif until > (now or timezone.now()):
        state = f"until {format_time(until, 'H:i:s')}"
    else:
        state = "expired"
    # Worker ids read host:pid:suffix; a narrow column may break them after a colon only.
    shown = Truncator(owner or "—").chars(24).split(":")
    return format_html(
        '<span class="da-lease" title="{}">{}</span>{}',
        owner or "",
        format_html_join(mark_safe(":<wbr>"), "{}", ((part,) for part in shown)),
        format_html('<br><span class="da-meta">{}</span>', state) if state else "",
    )


def pretty_json(value: Any) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False, default=str)


def error_reason(error: str) -> str:
    """The first line of a run's error, cut to REASON_CHARS: the dead-letter grouping key."""
    first = (error or "").strip().splitlines()[0] if (error or "").strip() else ""
    return first[:REASON_CHARS]


def sql_literal_id(run_id: Any) -> str:
    """The run id as the database stores it: a uuid on PostgreSQL, 32 hex digits on SQLite."""
    return run_id.hex if connection.vendor == "sqlite" else str(run_id)


def sql_hint(run: AgentRun) -> str:
    rid = sql_literal_id(run.pk)
    return (
        f"SELECT status, attempt, lease_owner, lease_until, last_seq, error\n"
        f"  FROM agent_run WHERE id = '{rid}';\n"
        f"SELECT seq, kind, request_id, attempt, worker, created_at, payload\n"
        f"  FROM agent_step WHERE run_id = '{rid}' ORDER BY seq;\n"
        f"SELECT seq, call_index, tool, is_error, key, result\n"
        f"  FROM tool_effect WHERE run_id = '{rid}' ORDER BY seq, call_index;\n"
        f"SELECT id, seq, call_index, tool, status, decided_by_id, decided_at, reason\n"
        f"  FROM tool_intent WHERE run_id = '{rid}' ORDER BY seq, call_index;"
    )


# ---------------------------------------------------------------------------------------------
# The transcript of a run


@dataclass
class IntentLine:
    """What a person decided about an irreversible call, and then what became of the call.

    Kept apart so that "approved by operator" never reads as "operator ran it".
    """

    decision: str  # "approved", "rejected" or "awaiting a decision"
    by: str = ""
    at: str = ""
    reason: str = ""
    outcome: str = ""  # "done", "running", "not run yet", "outcome unknown", "not run"
    action: str = ""  # what a person should do on the intent page, if anything
    state: str = ""  # the intent status, for the CSS class


INTENT_OUTCOMES = {
    IntentStatus.APPROVED: "not run yet",
    IntentStatus.EXECUTING: "running",
    IntentStatus.DONE: "done",
    IntentStatus.UNKNOWN: "outcome unknown",
    IntentStatus.REJECTED: "not run",
}


def describe_intent(intent: ToolIntent) -> IntentLine:
    """The transcript's intent line (uses ``decided_by``: select it with the intent)."""
    if intent.status == IntentStatus.PENDING:
        return IntentLine("awaiting a decision", action="decide it", state=intent.status)
    decided_by = intent.decided_by
    return IntentLine(
        decision="rejected" if intent.status == IntentStatus.REJECTED else "approved",
        by=decided_by.get_username() if decided_by is not None else "",
        at=format_time(intent.decided_at),
        reason=intent.reason,
        outcome=INTENT_OUTCOMES.get(intent.status, intent.get_status_display().lower()),
        action="resolve it" if intent.status == IntentStatus.UNKNOWN else "",
        state=intent.status,
    )


@dataclass
class ToolCall:
    id: str
    name: str
    input_json: str
    effect: ToolEffect | None = None
    intent: ToolIntent | None = None
    intent_line: IntentLine | None = None


@dataclass
class ToolResult:
    tool_use_id: str
    tool_name: str
    content: str
    is_error: bool


@dataclass
class TranscriptStep:
    step: AgentStep
    kind: str
    task: str = ""
    texts: list[str] = field(default_factory=list)
    thinking: list[str] = field(default_factory=list)
    calls: list[ToolCall] = field(default_factory=list)
    other_blocks: list[str] = field(default_factory=list)
    results: list[ToolResult] = field(default_factory=list)
    stop_reason: str = ""
    usage_json: str = ""
    model: str = ""
    unparsed: str = ""


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(b, dict) and b.get("type") == "text" for b in content
    ):
        return "\n".join(str(b.get("text", "")) for b in content)
    return pretty_json(content)


def describe_model_turn(entry: TranscriptStep, data: dict[str, Any]) -> None:
    """Split a provider response body into the parts a person reads."""
    for block in data.get("content") or []:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            entry.texts.append(str(block.get("text", "")))
        elif kind == "thinking":
            entry.thinking.append(str(block.get("thinking", "")))
        elif kind == "redacted_thinking":
            entry.thinking.append("[redacted thinking]")
        elif kind == "tool_use":
            entry.calls.append(
                ToolCall(
                    id=str(block.get("id", "")),
                    name=str(block.get("name", "")),
                    input_json=pretty_json(block.get("input")),
                )
            )
        else:
            entry.other_blocks.append(pretty_json(block))
    entry.stop_reason = str(data.get("stop_reason") or "")
    entry.model = str(data.get("model") or "")
    if data.get("usage") is not None:
        entry.usage_json = pretty_json(data["usage"])


def build_transcript(run: AgentRun) -> list[TranscriptStep]:
    """The run's steps in seq order, with the effects and intents of each tool call.

    Three queries whatever the length of the run: steps, effects, intents.
    """
    steps = list(AgentStep.objects.filter(run_id=run.pk).order_by("seq"))
    effects = {(e.seq, e.call_index): e for e in ToolEffect.objects.filter(run_id=run.pk)}
    intents = {
        (i.seq, i.call_index): i
        for i in ToolIntent.objects.filter(run_id=run.pk).select_related("decided_by")
    }
    names_by_call_id: dict[str, str] = {}
    transcript: list[TranscriptStep] = []
    for step in steps:
        entry = TranscriptStep(step=step, kind=step.kind)
        try:
            data = json.loads(step.payload)
        except ValueError:
            entry.unparsed = step.payload
            transcript.append(entry)
            continue
        if step.kind == StepKind.TASK:
            entry.task = _content_text(data)
        elif step.kind == StepKind.MODEL_TURN and isinstance(data, dict):
            describe_model_turn(entry, data)
            for index, call in enumerate(entry.calls):
                call.effect = effects.get((step.seq, index))
                call.intent = intents.get((step.seq, index))
                if call.intent is not None:
                    call.intent_line = describe_intent(call.intent)
                names_by_call_id[call.id] = call.name
        elif step.kind == StepKind.TOOL_RESULT and isinstance(data, list):
            for block in data:
                if not isinstance(block, dict):
                    entry.other_blocks.append(pretty_json(block))
                    continue
                tool_use_id = str(block.get("tool_use_id", ""))
                entry.results.append(
                    ToolResult(
                        tool_use_id=tool_use_id,
                        tool_name=names_by_call_id.get(tool_use_id, ""),
                        content=_content_text(block.get("content", "")),
                        is_error=bool(block.get("is_error")),
                    )
                )
        else:
            entry.unparsed = pretty_json(data)
        transcript.append(entry)
    return transcript


def model_turn_for_intent(intent: ToolIntent) -> TranscriptStep | None:
    """The model turn that asked for the intent's call (one query)."""
    step = AgentStep.objects.filter(
        run_id=intent.run_id, seq=intent.seq, kind=StepKind.MODEL_TURN
    ).first()
    if step is None:
        return None
    entry = TranscriptStep(step=step, kind=step.kind)
    try:
        data = json.loads(step.payload)
    except ValueError:
        entry.unparsed = step.payload
        return entry
    if isinstance(data, dict):
        describe_model_turn(entry, data)
    return entry


# ---------------------------------------------------------------------------------------------
# Dead letter


@dataclass
class DeadReason:
    reason: str
    count: int
    newest: datetime.datetime | None


def dead_letter_reasons() -> tuple[list[DeadReason], int]:
    """Dead runs grouped by the first line of their error, most frequent first.

    Grouping by the whole error in SQL first keeps the rows fetched down to the distinct
    errors; folding to the first line happens in Python because that is not portable SQL.
    """
    rows = (
        AgentRun.objects.dead()
        .values("error")
        .annotate(n=Count("pk"), newest=Max("created_at"))
        .order_by()[:DEAD_LETTER_SAMPLE]
    )
    counts: Counter[str] = Counter()
    newest: dict[str, datetime.datetime] = {}
    for row in rows:
        reason = error_reason(row["error"])
        counts[reason] += row["n"]
        if row["newest"] is not None and (reason not in newest or row["newest"] > newest[reason]):
            newest[reason] = row["newest"]
    reasons = [DeadReason(r, n, newest.get(r)) for r, n in counts.most_common()]
    return reasons, sum(counts.values())


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


def horizontal_bars(
    items: Sequence[tuple[str, int]], colors: dict[str, str] | None = None, width: int = 300
) -> list[Bar]:
    top = max((v for _, v in items), default=0) or 1
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
    top = max((v for _, v in items), default=0) or 1
    bars = []
    for i, (label, value) in enumerate(items):
        h = round(height * value / top) if value else 0
        bars.append(Bar(label, value, x=i * step, y=height - h, width=step - 4, height=h))
    return bars


def operations_stats(now: datetime.datetime | None = None) -> dict[str, Any]:
    """Every number of the operations page (from ``metrics``), shaped for its charts."""
    now = now or timezone.now()
    by_status = metrics.runs_by_status()
    status_items = list(by_status.items())
    oldest_pending = metrics.oldest_pending()
    finished_steps = metrics.steps_of_recent_finished_runs()
    attempts = metrics.attempts_distribution(AgentRun.objects.all())
    waiting_count, oldest_intent = metrics.waiting_intents()
    hour_items = [(h.strftime("%H:00"), n) for h, n in metrics.finished_per_hour(now)]
    hour_bars = vertical_bars(hour_items, height=HOUR_CHART_HEIGHT)
    # Every third hour counted back from the current one, which reads "now".
    for back, bar in enumerate(reversed(hour_bars)):
        if back % 3 == 0:
            bar.axis_label = "now" if back == 0 else bar.label

    return {
        "total_runs": sum(by_status.values()),
        "status_bars": horizontal_bars(status_items, RUN_COLORS),
        "status_chart_height": len(status_items) * 22,
        "oldest_pending": oldest_pending,
        "oldest_pending_age": (now - oldest_pending.created_at) if oldest_pending else None,
        "steps_sample": len(finished_steps),
        "steps_p50": metrics.percentile(finished_steps, 0.5),
        "steps_p95": metrics.percentile(finished_steps, 0.95),
        "steps_max": finished_steps[-1] if finished_steps else None,
        "percentile_sample_limit": metrics.PERCENTILE_SAMPLE,
        "attempt_bars": horizontal_bars(attempts),
        "attempt_chart_height": max(len(attempts), 1) * 22,
        "intents_waiting": waiting_count,
        "oldest_intent": oldest_intent,
        "oldest_intent_age": (now - oldest_intent.created_at) if oldest_intent else None,
        "hour_bars": hour_bars,
        "hour_total": sum(v for _, v in hour_items),
        "hour_chart_width": 24 * 20,
        # The bars stand on this line (they are drawn 12 units down, under their value).
        "hour_baseline_y": HOUR_CHART_HEIGHT + 12,
    }
