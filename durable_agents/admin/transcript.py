"""The transcript of a run: its steps, one page at a time, with their calls' effects and intents."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from django.db.models import Q
from django.utils.translation import gettext

from durable_agents._internal.text import storable_text
from durable_agents.admin.format import (
    TEXT_SHOWN_CHARS,
    IntentLine,
    Text,
    describe_intent,
    load_json,
    pretty_json,
    shown_json,
    shown_text,
)
from durable_agents.models import (
    AgentRun,
    AgentStep,
    StepKind,
    ToolEffect,
    ToolIntent,
    steps_of,
)
from durable_agents.models.forks import log_of


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
    """A ``compaction`` block of a model turn: the summary that replaced
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
    # The run whose row this step is, when it is not the run shown (a fork's shared steps).
    shared_from: Any = None


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
    elif kind in (StepKind.TOOL_RESULT, StepKind.MESSAGE):
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
            newer = log_of(run).filter(seq__gt=wanted).count()
            number = newer // size + 1
    elif page not in (None, ""):
        try:
            number = int(page)
        except (TypeError, ValueError):
            number = 1
    return min(max(number, 1), num_pages)


def _attach_calls(
    entry: TranscriptStep,
    effects: dict[tuple[int, int], ToolEffect],
    intents: dict[tuple[int, int], ToolIntent],
    effect_url: Callable[[str], str],
) -> None:
    """Each call of a model turn with its recorded effect and its intent, if any."""
    seq = entry.step.seq
    for index, call in enumerate(entry.calls):
        call.effect = effects.get((seq, index))
        if call.effect is not None:
            call.effect_url = effect_url(call.effect.key)
        call.intent = intents.get((seq, index))
        if call.intent is not None:
            call.intent_line = describe_intent(call.intent, call.effect)


def _describe_results(
    entry: TranscriptStep, blocks: list[Any], names_by_call_id: dict[str, str], step_url: StepUrl
) -> None:
    """The blocks of a tool-result step, each named by the call it answers."""
    for index, block in enumerate(blocks):
        url = step_url(entry.step.seq, index)
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


def build_transcript(
    run: AgentRun,
    page: Any = None,
    seq: Any = None,
    *,
    step_url: StepUrl = _no_url,
    effect_url: Callable[[str], str] = lambda key: "",
) -> Transcript:
    """One page of the run's steps in seq order, with the effects and intents of their calls.

    The first page holds the newest steps. A few queries whatever the length of the run: the
    stretches a fork shares, the step count, the page's steps (plus the one before, which
    names the tools whose results open the page), and the effects (without their results) and
    intents of the page. A fork's shared steps are read through ``steps_of``: they are rows of
    the runs it was forked from, and so are the effects and intents of their calls.
    """
    steps = log_of(run)
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

    # Each step's calls were recorded by the run whose row the step is (a shared step's by
    # the run it was forked from); the run's own records win where both hold one (a fork
    # inherits the calls of its fork point under its own keys).
    where = Q()
    for owner in {step.run_id for step in shown}:
        seqs = [step.seq for step in shown if step.run_id == owner]
        where |= Q(run_id=owner, seq__range=(min(seqs), max(seqs)))
    effects: dict[tuple[int, int], ToolEffect] = {}
    for e in ToolEffect.objects.filter(where).only(*EFFECT_COLUMNS):
        if e.run_id == run.pk or (e.seq, e.call_index) not in effects:
            effects[(e.seq, e.call_index)] = e
    intents: dict[tuple[int, int], ToolIntent] = {}
    for i in ToolIntent.objects.filter(where).defer("input").select_related("decided_by"):
        if i.run_id == run.pk or (i.seq, i.call_index) not in intents:
            intents[(i.seq, i.call_index)] = i
    names_by_call_id: dict[str, str] = {}
    if before is not None and before.kind == StepKind.MODEL_TURN:
        names_by_call_id = _call_names(before)
    for step in shown:
        entry = describe_step(step, run.pk, names_by_call_id, step_url)
        if entry.calls:
            _attach_calls(entry, effects, intents, effect_url)
        transcript.entries.append(entry)
    return transcript


def describe_step(
    step: AgentStep, run_id: Any, names_by_call_id: dict[str, str], step_url: StepUrl = _no_url
) -> TranscriptStep:
    """One step of ``run_id``'s log as a person reads it (``names_by_call_id`` names the
    results of a tool-result step, and learns the calls of a model turn)."""
    entry = TranscriptStep(
        step=step,
        kind=step.kind,
        request_id=storable_text(step.request_id or "", 200),
        worker=storable_text(step.worker, 200),
        shared_from=step.run_id if step.run_id != run_id else None,
    )
    try:
        data = load_json(step.payload)
    except ValueError:
        entry.unparsed = shown_text(step.payload, step_url(step.seq, None))
        return entry
    if step.kind == StepKind.TASK:
        entry.task = shown_text(_content_text(data), step_url(step.seq, None))
    elif step.kind == StepKind.MODEL_TURN and isinstance(data, dict):
        describe_model_turn(entry, data, step_url)
        names_by_call_id.update((call.id, call.name) for call in entry.calls)
    elif step.kind == StepKind.TOOL_RESULT and isinstance(data, list):
        _describe_results(entry, data, names_by_call_id, step_url)
    elif step.kind == StepKind.MESSAGE and isinstance(data, list):
        # What a user sent while the run worked (send_message): one text block each.
        entry.texts = [
            shown_text(str(block.get("text", "")), step_url(step.seq, index))
            for index, block in enumerate(data)
            if isinstance(block, dict)
        ]
    else:
        entry.unparsed = shown_text(pretty_json(data), step_url(step.seq, None))
    return entry


def model_turn_for_intent(intent: ToolIntent, step_url: StepUrl = _no_url) -> TranscriptStep | None:
    """The model turn that asked for the intent's call (one query)."""
    step = steps_of(intent.run_id).filter(seq=intent.seq, kind=StepKind.MODEL_TURN).first()
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
