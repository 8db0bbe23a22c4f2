"""What the admin pages show, kept apart from the ModelAdmin classes in ``admin.py``.

Everything here reads; the only writes are in the POST views, and they go through
``durable_agents.api``. Payloads come from the model and from tools: they are passed to
templates as plain strings (autoescaped there), never marked safe.

Every word a page shows is translatable (``gettext``; module-level labels ``gettext_lazy``),
with named placeholders; what the model, a tool or a person wrote is never translated.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

from django.contrib.humanize.templatetags.humanize import intcomma
from django.db import connection
from django.db.models import Count, Max, Min, Q, TextField
from django.db.models.functions import Length, Substr
from django.utils import dateformat, timezone
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString, mark_safe
from django.utils.text import Truncator
from django.utils.translation import gettext, gettext_noop, ngettext, pgettext
from django.utils.translation import gettext_lazy as _

from durable_agents import listing, metrics
from durable_agents.causes import error_reason
from durable_agents.deepjson import dumps_deep, loads_deep
from durable_agents.models import (
    ENDED_STATUSES,
    FINISHED_STATUSES,
    AgentQuestion,
    AgentRun,
    AgentStep,
    IntentStatus,
    MetricsSnapshot,
    QuestionStatus,
    RunStatus,
    StepKind,
    ToolEffect,
    ToolIntent,
    WaitKind,
)
from durable_agents.text import storable_text

if TYPE_CHECKING:
    from django_stubs_ext import StrOrPromise

# Fixed colours per status: the only values interpolated into a style attribute.
RUN_COLORS: dict[str, str] = {
    RunStatus.PENDING: "#6c757d",
    RunStatus.RUNNING: "#0b6bcb",
    RunStatus.WAITING: "#b35c00",
    RunStatus.SUCCEEDED: "#1a7f37",
    RunStatus.FAILED: "#c62828",
    RunStatus.CANCELLED: "#57606a",
    RunStatus.DEAD: "#6f2da8",
}
QUESTION_COLORS: dict[str, str] = {
    QuestionStatus.OPEN: "#b35c00",
    QuestionStatus.ANSWERED: "#1a7f37",
    QuestionStatus.CANCELLED: "#57606a",
}
INTENT_COLORS: dict[str, str] = {
    IntentStatus.PENDING: "#b35c00",
    IntentStatus.APPROVED: "#0b6bcb",
    IntentStatus.REJECTED: "#c62828",
    IntentStatus.EXECUTING: "#0b6bcb",
    IntentStatus.DONE: "#1a7f37",
    IntentStatus.UNKNOWN: "#6f2da8",
}

HOUR_CHART_HEIGHT = 100


# Short labels for the runs list, where "Waiting for a person" would widen the column.
RUN_SHORT_LABELS: dict[str, StrOrPromise] = {
    RunStatus.PENDING: _("Pending"),
    RunStatus.RUNNING: _("Running"),
    RunStatus.WAITING: _("Waiting"),
    RunStatus.SUCCEEDED: _("Succeeded"),
    RunStatus.FAILED: _("Failed"),
    RunStatus.CANCELLED: _("Cancelled"),
    RunStatus.DEAD: _("Dead"),
}
# The statuses as the operations page names them (lowercase, as the status values read).
RUN_STATUS_NAMES: dict[str, StrOrPromise] = {
    RunStatus.PENDING: _("pending"),
    RunStatus.RUNNING: _("running"),
    RunStatus.WAITING: _("waiting"),
    RunStatus.SUCCEEDED: _("succeeded"),
    RunStatus.FAILED: _("failed"),
    RunStatus.CANCELLED: _("cancelled"),
    RunStatus.DEAD: _("dead"),
}

# One format for every time the admin prints: fields, columns and the transcript.
TIME_FORMAT = "Y-m-d H:i:s"


def badge(
    status: str, label: StrOrPromise, colors: dict[str, str], title: StrOrPromise = ""
) -> SafeString:
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
    if seconds >= 86_400:
        return pgettext("compact age", "%(count)sd") % {"count": seconds // 86_400}
    if seconds >= 3_600:
        return pgettext("compact age", "%(count)sh") % {"count": seconds // 3_600}
    if seconds >= 60:
        return pgettext("compact age", "%(count)sm") % {"count": seconds // 60}
    return pgettext("compact age", "%(count)ss") % {"count": seconds}


def lease_summary(
    owner: str | None, until: datetime.datetime | None, now: datetime.datetime | None = None
) -> SafeString | None:
    """The list's lease column: the owner, then "until HH:MM:SS" or "expired"; None if free."""
    if not owner and until is None:
        return None
    if until is None:
        state = ""
    elif until > (now or timezone.now()):
        state = gettext("until %(time)s") % {"time": format_time(until, "H:i:s")}
    else:
        state = gettext("expired")
    # Worker ids read host:pid:suffix; a narrow column may break them after a colon only.
    shown = Truncator(owner or "—").chars(24).split(":")
    return format_html(
        '<span class="da-lease" title="{}">{}</span>{}',
        owner or "",
        format_html_join(mark_safe(":<wbr>"), "{}", ((part,) for part in shown)),
        format_html('<br><span class="da-meta">{}</span>', state) if state else "",
    )


def pretty_json(value: Any) -> str:
    """``value`` as indented JSON; a value nested too deep for the indenting encoder (it
    recurses per level) is printed compact at any depth, and one that cannot be printed
    says so."""
    try:
        return json.dumps(value, indent=2, ensure_ascii=False, default=str)
    except (RecursionError, ValueError):
        pass
    try:
        return dumps_deep(value)
    except (TypeError, ValueError) as exc:
        return gettext("[a JSON value that cannot be shown: %(error)s]") % {
            "error": type(exc).__name__
        }


def load_json(text: str) -> Any:
    """``json.loads`` at any depth (``deepjson``); text that is not JSON raises ValueError
    (a page then shows the text as it is)."""
    return loads_deep(text)


def shown_json(value: Any) -> str:
    """``pretty_json`` that a page can always encode (lone surrogates and NUL marked)."""
    return storable_text(pretty_json(value))


def intent_fingerprint(intent: ToolIntent) -> str:
    """What a person saw when asked to approve ``intent``: its id, run, tool and input.

    The approving POST carries this back; the view approves only when it still matches, so
    what is approved is exactly what was shown. ASCII JSON, so that any value (lone
    surrogates included) has one text and one hash.
    """
    canonical = json.dumps(
        [intent.pk, str(intent.run_id), intent.tool, intent.input],
        ensure_ascii=True,
        separators=(",", ":"),
        default=str,
    )
    return hashlib.sha256(canonical.encode("ascii")).hexdigest()


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
# Text shown on a page: never crashes the encoder, never unbounded

# A text longer than this is cut on the run page, with a link to the whole (a model turn or
# a tool result can be megabytes; the page must stay small whatever the run did).
TEXT_SHOWN_CHARS = 4_000


@dataclass
class Text:
    """A string for a template: storable (encodable), cut to a bound, with where the whole is."""

    text: str
    length: int  # of the whole text
    url: str = ""  # the whole text, when there is a view for it
    cut: bool = False


def shown_text(value: Any, url: str = "", limit: int = TEXT_SHOWN_CHARS) -> Text:
    """``value`` as a ``Text``: NUL and lone surrogates marked (``storable_text``), cut to
    ``limit`` characters. The cut happens before the markers, so a huge text is never copied
    whole."""
    text = value if isinstance(value, str) else storable_text(value)
    if len(text) > limit:
        return Text(storable_text(text[:limit]), len(text), url, cut=True)
    return Text(storable_text(text), len(text), url)


def cut_at_word(text: str, limit: int) -> tuple[str, bool]:
    """``text`` cut to at most ``limit`` characters at a word boundary, with an ellipsis;
    and whether it was cut. A single word longer than the limit is cut where it must be."""
    if len(text) <= limit:
        return text, False
    head = text[: limit + 1]
    space = max(head.rfind(" "), head.rfind("\t"))
    # A space in the second half: cut there; otherwise one long word, cut where we must.
    head = head[:space] if space > limit // 2 else head[:limit]
    return head.rstrip() + "…", True


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
    outcome: str = ""  # "done", "done: the tool raised", "running", "not run yet", ...
    action: str = ""  # what a person should do on the intent page, if anything
    state: str = ""  # the intent status, for the CSS class
    raised: bool = False  # done, but the tool raised: the outcome is an error


INTENT_OUTCOMES: dict[str, StrOrPromise] = {
    IntentStatus.APPROVED: _("not run yet"),
    IntentStatus.EXECUTING: _("running"),
    IntentStatus.DONE: _("done"),
    IntentStatus.UNKNOWN: _("outcome unknown"),
    IntentStatus.REJECTED: _("not run"),
}
# A done intent whose tool raised: not a success, whatever the status says. The English
# text (marked for the catalogue); pages show gettext(RAISED_LABEL).
RAISED_LABEL = gettext_noop("done: the tool raised")
RAISED_TITLE = _("the call ran and the tool raised: the model received an error result")
RAISED_COLOR = "#c2410c"


# Short labels for the intents list, where "Pending approval" would widen the column.
INTENT_SHORT_LABELS: dict[str, StrOrPromise] = {
    IntentStatus.PENDING: _("Pending"),
    IntentStatus.UNKNOWN: _("Unknown"),
}


def intent_badge(intent: ToolIntent, raised: bool | None = None, short: bool = False) -> SafeString:
    """The status badge of an intent; a done intent whose effect is an error reads so.

    ``raised`` defaults to the ``_raised`` annotation of the admin's queryset.
    """
    if raised is None:
        raised = bool(getattr(intent, "_raised", False))
    if intent.status == IntentStatus.DONE and raised:
        return format_html(
            '<span class="da-badge da-raised" style="background-color:{}" title="{}">{}</span>',
            RAISED_COLOR,
            RAISED_TITLE,
            gettext(RAISED_LABEL),
        )
    label = intent.get_status_display()
    if short:
        return badge(
            intent.status, INTENT_SHORT_LABELS.get(intent.status, label), INTENT_COLORS, label
        )
    return badge(intent.status, label, INTENT_COLORS)


def describe_intent(intent: ToolIntent, effect: ToolEffect | None = None) -> IntentLine:
    """The transcript's intent line (uses ``decided_by``: select it with the intent)."""
    if intent.status == IntentStatus.PENDING:
        return IntentLine(
            gettext("awaiting a decision"), action=gettext("decide it"), state=intent.status
        )
    decided_by = intent.decided_by
    raised = intent.status == IntentStatus.DONE and effect is not None and effect.is_error
    return IntentLine(
        decision=gettext("rejected")
        if intent.status == IntentStatus.REJECTED
        else gettext("approved"),
        by=storable_text(decided_by.get_username()) if decided_by is not None else "",
        at=format_time(intent.decided_at),
        reason=storable_text(intent.reason),
        outcome=gettext(RAISED_LABEL)
        if raised
        else str(INTENT_OUTCOMES.get(intent.status, intent.get_status_display().lower())),
        action=gettext("resolve it") if intent.status == IntentStatus.UNKNOWN else "",
        state=intent.status,
        raised=raised,
    )


@dataclass
class ToolCall:
    id: str
    name: str
    input: Text
    effect: ToolEffect | None = None
    effect_url: str = ""
    intent: ToolIntent | None = None
    intent_line: IntentLine | None = None


@dataclass
class ToolResult:
    tool_use_id: str
    tool_name: str
    content: Text
    is_error: bool


@dataclass
class Compaction:
    """A ``compaction`` block of a model turn (API.md section 9): the summary that replaced
    the history before it, or a failed compaction (``content`` null, a no-op)."""

    summary: Text | None  # None: the compaction failed

    @property
    def failed(self) -> bool:
        return self.summary is None


@dataclass
class Usage:
    """The tokens of one model turn, summed over its passes (``usage.iterations``) when the
    server ran more than one (a compaction, then the message), as budgets count them."""

    input: int | None = None
    output: int | None = None
    cache_read: int | None = None
    cache_write: int | None = None
    passes: list[str] = field(default_factory=list)  # the kinds of the passes, if listed

    @property
    def shows_cache(self) -> bool:
        """Cache figures are shown when the turn read from or wrote to the prompt cache."""
        return bool(self.cache_read) or bool(self.cache_write)


@dataclass
class TranscriptStep:
    step: AgentStep
    kind: str
    task: Text | None = None
    compactions: list[Compaction] = field(default_factory=list)
    texts: list[Text] = field(default_factory=list)
    thinking: list[Text] = field(default_factory=list)
    calls: list[ToolCall] = field(default_factory=list)
    other_blocks: list[Text] = field(default_factory=list)
    results: list[ToolResult] = field(default_factory=list)
    stop_reason: str = ""
    usage: Usage | None = None
    usage_json: str = ""
    model: str = ""
    unparsed: Text | None = None
    request_id: str = ""
    worker: str = ""


# Builds the address of the whole text of one step (block None: the whole step) or effect.
StepUrl = Callable[[int, int | None], str]


def _no_url(seq: int, block: int | None = None) -> str:
    return ""


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(b, dict) and b.get("type") == "text" for b in content
    ):
        return "\n".join(str(b.get("text", "")) for b in content)
    return pretty_json(content)


def block_text(kind: str, data: Any, block: int | None) -> str | None:
    """The whole text of one part of a step, as the run page shows it cut; None if absent.

    ``block`` is an index into a model turn's ``content`` or into a tool result step's
    list; None means the whole step (a task's text, or any other step's payload).
    """
    if block is None:
        if kind == StepKind.TASK:
            return _content_text(data)
        return pretty_json(data)
    if kind == StepKind.MODEL_TURN and isinstance(data, dict):
        blocks = data.get("content")
    elif kind == StepKind.TOOL_RESULT:
        blocks = data
    else:
        return None
    if not isinstance(blocks, list) or not 0 <= block < len(blocks):
        return None
    item = blocks[block]
    if not isinstance(item, dict):
        return pretty_json(item)
    if kind == StepKind.TOOL_RESULT:
        return _content_text(item.get("content", ""))
    item_kind = item.get("type")
    if item_kind == "text":
        return str(item.get("text", ""))
    if item_kind == "thinking":
        return str(item.get("thinking", ""))
    if item_kind == "tool_use":
        return pretty_json(item.get("input"))
    if item_kind == "compaction":
        summary = item.get("content")
        if summary is None:
            return gettext("[compaction failed: no summary]")
        return summary if isinstance(summary, str) else pretty_json(summary)
    return pretty_json(item)


USAGE_FIELDS = {
    "input": "input_tokens",
    "output": "output_tokens",
    "cache_read": "cache_read_input_tokens",
    "cache_write": "cache_creation_input_tokens",
}


def _token_count(value: Any) -> int | None:
    """A token figure of a usage object: a non-negative int, or None for anything else (the
    body is the provider's, or a hostile server's)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return value


def describe_usage(usage: Any) -> Usage | None:
    """The figures of a turn's ``usage``: each summed over ``usage.iterations`` when the
    server lists its passes (the top-level figures then cover only the last pass)."""
    if not isinstance(usage, dict):
        return None
    iterations = usage.get("iterations")
    passes = [i for i in iterations if isinstance(i, dict)] if isinstance(iterations, list) else []
    sources = passes or [usage]
    shown = Usage(
        passes=[storable_text(str(p.get("type") or "?"), 40) for p in passes][:20],
    )
    for attribute, key in USAGE_FIELDS.items():
        values = [_token_count(source.get(key)) for source in sources]
        present = [v for v in values if v is not None]
        setattr(shown, attribute, sum(present) if present else None)
    return shown


def describe_model_turn(
    entry: TranscriptStep, data: dict[str, Any], step_url: StepUrl = _no_url
) -> None:
    """Split a provider response body into the parts a person reads."""
    seq = entry.step.seq
    content = data.get("content")
    for index, block in enumerate(content if isinstance(content, list) else []):
        kind = block.get("type") if isinstance(block, dict) else None
        url = step_url(seq, index)
        if kind == "text":
            entry.texts.append(shown_text(str(block.get("text", "")), url))
        elif kind == "thinking":
            entry.thinking.append(shown_text(str(block.get("thinking", "")), url))
        elif kind == "redacted_thinking":
            entry.thinking.append(shown_text(gettext("[redacted thinking]")))
        elif kind == "compaction":
            summary = block.get("content")
            if summary is None:
                entry.compactions.append(Compaction(None))
            else:
                text = summary if isinstance(summary, str) else pretty_json(summary)
                entry.compactions.append(Compaction(shown_text(text, url)))
        elif kind == "tool_use":
            entry.calls.append(
                ToolCall(
                    id=storable_text(block.get("id", ""), 200),
                    name=storable_text(block.get("name", ""), 200),
                    input=shown_text(pretty_json(block.get("input")), url),
                )
            )
        else:
            entry.other_blocks.append(shown_text(pretty_json(block), url))
    entry.stop_reason = storable_text(data.get("stop_reason") or "", 200)
    entry.model = storable_text(data.get("model") or "", 200)
    if data.get("usage") is not None:
        entry.usage = describe_usage(data["usage"])
        entry.usage_json = shown_json(data["usage"])[:TEXT_SHOWN_CHARS]


def _call_names(step: AgentStep) -> dict[str, str]:
    """tool_use id -> tool name of one model turn (to name the results of the next step)."""
    try:
        data = load_json(step.payload)
    except ValueError:
        return {}
    content = data.get("content") if isinstance(data, dict) else None
    return {
        str(b.get("id", "")): storable_text(b.get("name", ""), 200)
        for b in (content if isinstance(content, list) else [])
        if isinstance(b, dict) and b.get("type") == "tool_use"
    }


# Steps per page of the transcript: a run of thousands of steps renders one page at a time.
TRANSCRIPT_PAGE_STEPS = 50
# The columns of tool_effect that the run page reads: never ``result`` (it can be megabytes
# per call and is only shown on its own page, through the effect's link).
EFFECT_COLUMNS = ("key", "run_id", "seq", "call_index", "tool", "is_error", "created_at")


@dataclass
class Transcript:
    entries: list[TranscriptStep]
    total: int  # steps in the run
    number: int  # this page, 1 = the newest steps
    num_pages: int

    @property
    def newer(self) -> int | None:
        return self.number - 1 if self.number > 1 else None

    @property
    def older(self) -> int | None:
        return self.number + 1 if self.number < self.num_pages else None

    @property
    def first_seq(self) -> int | None:
        return self.entries[0].step.seq if self.entries else None

    @property
    def last_seq(self) -> int | None:
        return self.entries[-1].step.seq if self.entries else None


def transcript_page_number(page: Any, seq: Any, total: int, run: AgentRun) -> int:
    """The page to show: the one holding step ``seq`` when asked, else ``page`` (1 = newest);
    anything malformed reads as the first page."""
    size = TRANSCRIPT_PAGE_STEPS
    num_pages = max(1, -(-total // size))
    number = 1
    if seq not in (None, ""):
        try:
            wanted = int(seq)
        except (TypeError, ValueError):
            wanted = None
        if wanted is not None:
            newer = AgentStep.objects.filter(run_id=run.pk, seq__gt=wanted).count()
            number = newer // size + 1
    elif page not in (None, ""):
        try:
            number = int(page)
        except (TypeError, ValueError):
            number = 1
    return min(max(number, 1), num_pages)


def build_transcript(
    run: AgentRun,
    page: Any = None,
    seq: Any = None,
    *,
    step_url: StepUrl = _no_url,
    effect_url: Callable[[str], str] = lambda key: "",
) -> Transcript:
    """One page of the run's steps in seq order, with the effects and intents of their calls.

    The first page holds the newest steps. Five queries whatever the length of the run: the
    step count, the page's steps (plus the one before, which names the tools whose results
    open the page), and the effects (without their results) and intents of the page.
    """
    steps = AgentStep.objects.filter(run_id=run.pk)
    total = steps.count()
    size = TRANSCRIPT_PAGE_STEPS
    number = transcript_page_number(page, seq, total, run)
    offset = (number - 1) * size
    rows = list(steps.order_by("-seq")[offset : offset + size + 1])
    before = rows[size] if len(rows) > size else None
    shown = rows[:size]
    shown.reverse()
    transcript = Transcript([], total, number, max(1, -(-total // size)))
    if not shown:
        return transcript

    low, high = shown[0].seq, shown[-1].seq
    effects = {
        (e.seq, e.call_index): e
        for e in ToolEffect.objects.filter(run_id=run.pk, seq__range=(low, high)).only(
            *EFFECT_COLUMNS
        )
    }
    intents = {
        (i.seq, i.call_index): i
        for i in ToolIntent.objects.filter(run_id=run.pk, seq__range=(low, high))
        .defer("input")
        .select_related("decided_by")
    }
    names_by_call_id: dict[str, str] = {}
    if before is not None and before.kind == StepKind.MODEL_TURN:
        names_by_call_id = _call_names(before)
    for step in shown:
        entry = TranscriptStep(
            step=step,
            kind=step.kind,
            request_id=storable_text(step.request_id or "", 200),
            worker=storable_text(step.worker, 200),
        )
        transcript.entries.append(entry)
        try:
            data = load_json(step.payload)
        except ValueError:
            entry.unparsed = shown_text(step.payload, step_url(step.seq, None))
            continue
        if step.kind == StepKind.TASK:
            entry.task = shown_text(_content_text(data), step_url(step.seq, None))
        elif step.kind == StepKind.MODEL_TURN and isinstance(data, dict):
            describe_model_turn(entry, data, step_url)
            for index, call in enumerate(entry.calls):
                call.effect = effects.get((step.seq, index))
                if call.effect is not None:
                    call.effect_url = effect_url(call.effect.key)
                call.intent = intents.get((step.seq, index))
                if call.intent is not None:
                    call.intent_line = describe_intent(call.intent, call.effect)
                names_by_call_id[call.id] = call.name
        elif step.kind == StepKind.TOOL_RESULT and isinstance(data, list):
            for index, block in enumerate(data):
                url = step_url(step.seq, index)
                if not isinstance(block, dict):
                    entry.other_blocks.append(shown_text(pretty_json(block), url))
                    continue
                tool_use_id = storable_text(block.get("tool_use_id", ""), 200)
                entry.results.append(
                    ToolResult(
                        tool_use_id=tool_use_id,
                        tool_name=names_by_call_id.get(tool_use_id, ""),
                        content=shown_text(_content_text(block.get("content", "")), url),
                        is_error=bool(block.get("is_error")),
                    )
                )
        else:
            entry.unparsed = shown_text(pretty_json(data), step_url(step.seq, None))
    return transcript


def model_turn_for_intent(intent: ToolIntent, step_url: StepUrl = _no_url) -> TranscriptStep | None:
    """The model turn that asked for the intent's call (one query)."""
    step = AgentStep.objects.filter(
        run_id=intent.run_id, seq=intent.seq, kind=StepKind.MODEL_TURN
    ).first()
    if step is None:
        return None
    entry = TranscriptStep(step=step, kind=step.kind)
    try:
        data = load_json(step.payload)
    except ValueError:
        entry.unparsed = shown_text(step.payload, step_url(step.seq, None))
        return entry
    if isinstance(data, dict):
        describe_model_turn(entry, data, step_url)
    return entry


# ---------------------------------------------------------------------------------------------
# Waits (API.md section 8): what a waiting run waits for, its children, its questions

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


def _cut(text: str, limit: int = WAIT_SUMMARY_CHARS) -> str:
    return Truncator(storable_text(text)).chars(limit)


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
    if kind == WaitKind.TIMER:
        if run.wake_at is None:
            info.summary = gettext("a timer")
        elif info.due:
            info.summary = gettext("a timer, due since %(time)s") % {
                "time": format_time(run.wake_at)
            }
        else:
            info.summary = gettext("a timer until %(time)s") % {"time": format_time(run.wake_at)}
    elif kind == WaitKind.EVENT:
        info.event = storable_text(run.wait_event or "")
        values = {"event": _cut(info.event), "time": timeout}
        if timeout:
            info.summary = gettext("event “%(event)s” (timeout %(time)s)") % values
        else:
            info.summary = gettext("event “%(event)s”") % values
    elif kind == WaitKind.RUNS:
        ids = _awaited_ids(run)
        known = statuses or {}
        info.runs_total = len(ids)
        info.runs_ended = sum(1 for i in ids if known.get(i) in ENDED_STATUSES)
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
    elif kind == WaitKind.QUESTION:
        if question is not None:
            info.question_id = question.pk
            head = getattr(question, "question_head", None)
            text = head if head is not None else question.question
            first_line = next((line for line in text.splitlines() if line.strip()), text)
            info.summary = gettext("an answer to “%(question)s”") % {"question": _cut(first_line)}
        else:
            info.summary = gettext("an answer to a question")
    elif kind == WaitKind.INTENT or kind == "":
        info.intent = intent
        if intent is not None and intent.status == IntentStatus.UNKNOWN:
            info.summary = gettext("a person to resolve %(tool)s (outcome unknown)") % {
                "tool": _cut(intent.tool)
            }
        elif intent is not None:
            info.summary = gettext("an approval of %(tool)s") % {"tool": _cut(intent.tool)}
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
                task=_cut(getattr(child, "task_head", None) or "", TASK_HEAD_CHARS),
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
    return (
        queryset.annotate(**_head_and_length("question"), **_head_and_length("answer"))
        .defer("question", "answer")
        .select_related("answered_by")
    )


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


def question_badge(question: AgentQuestion) -> SafeString:
    return badge(question.status, question.get_status_display(), QUESTION_COLORS)


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


# ---------------------------------------------------------------------------------------------
# Dead letter

# Causes (groups) per page of the dead letter.
DEAD_GROUPS_PER_PAGE = 20
# Beyond this page the dead letter answers with its last one (an OFFSET stays an integer).
DEAD_LETTER_MAX_PAGE = 10_000
# Characters of an example error read: reasons are one line; the rest is detail.
DEAD_ERROR_HEAD_CHARS = 2_000
# The example reason of a group is cut here, at a word boundary.
EXAMPLE_REASON_CHARS = 300
EXAMPLE_MARGIN = datetime.timedelta(milliseconds=1)


@dataclass
class DeadGroup:
    cause: str  # agent_run.dead_cause: the normalised reason, the grouping key
    count: int
    newest: datetime.datetime | None
    example: str = ""  # the newest run's reason, cut at a word boundary
    example_cut: bool = False
    example_run_id: Any = None

    @property
    def cause_shown(self) -> str:
        return cut_at_word(self.cause, EXAMPLE_REASON_CHARS)[0]

    @property
    def query(self) -> str:
        """The group's cause as a query string: what its confirmation asks."""
        return urlencode({"cause": self.cause})

    @property
    def runs_query(self) -> str:
        """The runs list's filter on the group's cause (through agent_run_dead_cause)."""
        return urlencode({"dead_cause": self.cause})


@dataclass
class DeadLetterPage:
    groups: list[DeadGroup]
    number: int  # 1-based
    has_next: bool
    total: listing.Count  # dead runs in all


def dead_letter_page(number: int = 1) -> DeadLetterPage:
    """A page of the dead letter: the causes with the most dead runs first, each with its
    count, its newest run and that run's reason as the example. Three queries whatever the
    number of dead runs: the groups come from the index agent_run_dead_cause (dead_cause,
    created_at) alone, the examples by (cause, newest) through the same index, and the total
    is a bounded count."""
    number = max(1, number)
    dead = AgentRun.objects.dead()
    offset = (number - 1) * DEAD_GROUPS_PER_PAGE
    rows = list(
        dead.order_by()
        .values_list("dead_cause")
        # COUNT(*), not COUNT(id): the index (dead_cause, created_at) answers alone.
        .annotate(n=Count("*"), newest=Max("created_at"))
        .order_by("-n", "dead_cause")[offset : offset + DEAD_GROUPS_PER_PAGE + 1]
    )
    groups = [
        DeadGroup(cause=cause, count=n, newest=newest)
        for cause, n, newest in rows[:DEAD_GROUPS_PER_PAGE]
    ]
    newest_of = Q()
    for group in groups:
        # A millisecond's margin: SQLite keeps times as text, whose MAX() need not compare
        # equal to the same time written back; the newest row of each cause is taken below.
        if group.newest is not None:
            newest_of |= Q(dead_cause=group.cause, created_at__gt=group.newest - EXAMPLE_MARGIN)
    if groups:
        examples = (
            dead.filter(newest_of)
            .order_by("-created_at", "pk")
            .annotate(
                error_head=Substr("error", 1, DEAD_ERROR_HEAD_CHARS, output_field=TextField())
            )
            .values_list("pk", "dead_cause", "error_head")
        )
        by_cause = {group.cause: group for group in groups}
        for pk, cause, error in examples:
            found = by_cause.get(cause)
            if found is not None and found.example_run_id is None:
                found.example, found.example_cut = cut_at_word(
                    storable_text(error_reason(error)), EXAMPLE_REASON_CHARS
                )
                found.example_run_id = pk
    return DeadLetterPage(
        groups=groups,
        number=number,
        has_next=len(rows) > DEAD_GROUPS_PER_PAGE,
        total=listing.bounded_count(dead),
    )


def dead_group_run_ids(cause: str, limit: int) -> list[Any]:
    """The newest ``limit`` dead runs of a cause (agent_run_dead_cause), newest first."""
    return list(
        AgentRun.objects.dead()
        .filter(dead_cause=cause)
        .order_by("-created_at")
        .values_list("pk", flat=True)[:limit]
    )


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
    listing.EXACT_COUNT_LIMIT, past it the planner's estimate)."""

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
    counted = listing.bounded_count(AgentRun.objects.all())
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
        "oldest_question_text": _cut(getattr(oldest_question, "question_head", ""))
        if oldest_question is not None
        else "",
        "oldest_question_age": (now - oldest_question.created_at) if oldest_question else None,
        "hour_bars": hour_bars,
        "hour_total": sum(v for _hour, v in hour_items),
        "hour_chart_width": 24 * 20,
        # The bars stand on this line (they are drawn 12 units down, under their value).
        "hour_baseline_y": HOUR_CHART_HEIGHT + 12,
    }
