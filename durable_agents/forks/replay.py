"""Replay a recorded run's model turns to today's tool code, and say what changed.

``replay(run_id)`` reads the run's log (every model turn as the provider sent it, every
tool_result as the model received it) and, for each tool call of each turn, calls the agent's
*current* tool function with the recorded input, the way the runtime calls it: the same
validation against the schema, the same idempotency key, the result written as the runtime
writes it (JSON, storable, cut at ``MAX_RESULT_CHARS``). It never calls the model. A call
whose result now differs from the recorded one is a difference; a call that now raises (and
did not raise that way then) is an error. Together they are a regression test of tool code
against real transcripts.

What is not called:

- calls with a side effect that may not be repeated (``non_idempotent`` and ``irreversible``
  tools) unless ``allow_effects`` names them (or is True): reported as skipped;
- the built-in ``ask_person``, calls whose tool waited (``raise Wait``: what ended the wait is
  not recorded), and irreversible calls a person rejected (the tool never ran): reported as
  not replayed, with the reason.

Everything runs inside one transaction that is rolled back: what the tools write to the
database (a ``spawn_run``, say) is undone. What they do elsewhere is not, hence
``allow_effects``.
"""

from __future__ import annotations

import asyncio
import difflib
import json
import re
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from django.db import transaction

from durable_agents._internal.text import Unstorable, check_depth, storable_text
from durable_agents.declare import waits
from durable_agents.declare.agents import Agent, registry
from durable_agents.declare.tools import Tool
from durable_agents.engine import effects
from durable_agents.engine.dispatch import result_block
from durable_agents.exceptions import AgentNotFound, ReplayError, ToolInputError
from durable_agents.models import (
    AgentRun,
    IntentStatus,
    StepKind,
    ToolEffect,
    ToolIntent,
    steps_of,
)

__all__ = ["ReplayCall", "ReplayError", "ReplayReport", "replay"]

# Tools of the runtime's own whose outcome came from a person or the clock, not from code.
BUILTIN_TOOLS = frozenset({"ask_person"})

# How much of one result a report shows (each side of a diff), and of one input.
_SHOWN_CHARS = 2000
_SHOWN_INPUT = 300
_CONTROL_RE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u200b-\u200f\u202a-\u202e\u2066-\u2069]")


@dataclass(frozen=True)
class ReplayCall:
    """One tool call of the recording and what replaying it came to."""

    seq: int  # the model turn that asked for it
    index: int  # its place among that turn's calls
    tool: str
    input: Any
    old: str  # the recorded result, as the model received it
    old_is_error: bool
    new: str | None = None  # today's result (None when not called)
    new_is_error: bool = False
    reason: str = ""  # why it was skipped or not replayed

    def where(self) -> str:
        shown = _escape(json.dumps(self.input, ensure_ascii=False))
        if len(shown) > _SHOWN_INPUT:
            shown = shown[:_SHOWN_INPUT] + "..."
        return f"turn {self.seq} call {self.index}: {_escape(self.tool)} {shown}"


@dataclass
class ReplayReport:
    run_id: uuid.UUID
    agent: str
    version: str
    calls: int = 0  # the calls made to today's tool code
    matches: int = 0
    differences: list[ReplayCall] = field(default_factory=list)
    errors: list[ReplayCall] = field(default_factory=list)  # calls that now raise
    skipped: list[ReplayCall] = field(default_factory=list)  # effects not allowed
    not_replayed: list[ReplayCall] = field(default_factory=list)  # waits, people, built-ins

    @property
    def ok(self) -> bool:
        return not self.differences and not self.errors

    def __str__(self) -> str:
        lines = [
            f"replay of run {self.run_id} ({_escape(self.agent)} {_escape(self.version)}): "
            f"{self.calls} call(s), {self.matches} same, {len(self.differences)} different, "
            f"{len(self.errors)} error(s), {len(self.skipped)} skipped, "
            f"{len(self.not_replayed)} not replayed"
        ]
        for call in self.differences:
            lines.append(f"DIFFERENT {call.where()}")
            lines.extend(_diff(call))
        for call in self.errors:
            lines.append(f"ERROR {call.where()}")
            lines.extend(_diff(call))
        for call in self.skipped:
            lines.append(f"skipped {call.where()}: {call.reason}")
        for call in self.not_replayed:
            lines.append(f"not replayed {call.where()}: {call.reason}")
        return "\n".join(lines)


def _escape(text: str) -> str:
    """Control and direction characters as escapes: model and tool text must not drive the
    terminal, nor reorder what is read."""
    return _CONTROL_RE.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


def _shown(text: str, is_error: bool, start: int) -> list[str]:
    """Up to ``_SHOWN_CHARS`` of ``text`` from ``start``, a line each, escaped."""
    cut = text[start : start + _SHOWN_CHARS]
    lines = [_escape(line) for line in cut.splitlines()] or [""]
    if len(text) > start + _SHOWN_CHARS:
        lines.append(f"[... {len(text) - start - _SHOWN_CHARS} more characters]")
    if is_error:
        lines.insert(0, "[error]")
    return lines


def _diff(call: ReplayCall) -> list[str]:
    """A unified diff of the two results, around where they first differ: a long result that
    changed near its end still shows the change."""
    old, new = call.old, call.new or ""
    common = next((i for i, (a, b) in enumerate(zip(old, new, strict=False)) if a != b), None)
    if common is None:
        common = min(len(old), len(new))
    start = old.rfind("\n", 0, max(0, common - _SHOWN_CHARS // 2)) + 1
    diff = difflib.unified_diff(
        _shown(old, call.old_is_error, start),
        _shown(new, call.new_is_error, start),
        f"recorded (from character {start})" if start else "recorded",
        f"today (from character {start})" if start else "today",
        lineterm="",
        n=2,
    )
    return ["    " + line for line in diff]


def replay(run_id: Any, *, allow_effects: bool | Iterable[str] = False) -> ReplayReport:
    """Replay the run ``run_id`` (a run, or its id) to today's tool code; see the module's
    docstring. ``allow_effects``: True, or the names of the ``non_idempotent`` and
    ``irreversible`` tools that may be called. Raises ``ReplayError`` for a run that does not
    exist or whose agent version is no longer registered."""
    run = _load_run(run_id)
    try:
        agent = registry.get(run.agent, run.prompt_version)
    except AgentNotFound as exc:
        raise ReplayError(
            f"run {run.pk} cannot be replayed: agent {run.agent!r} version "
            f"{run.prompt_version!r} is not registered ({exc})"
        ) from None
    allowed: bool | frozenset[str]
    if isinstance(allow_effects, bool):
        allowed = allow_effects
    elif isinstance(allow_effects, str):  # one name, not its letters
        allowed = frozenset({allow_effects})
    else:
        allowed = frozenset(allow_effects)
    report = ReplayReport(run.pk, run.agent, run.prompt_version)
    with transaction.atomic():
        try:
            _Replayer(run, agent, allowed, report).replay()
        finally:
            # A scratch transaction: what tool code wrote to the database is undone. (Marked
            # at the end: a transaction marked for rollback refuses every further query.)
            transaction.set_rollback(True)
    return report


def _load_run(run_id: Any) -> AgentRun:
    if isinstance(run_id, AgentRun):
        return run_id
    try:
        pk = run_id if isinstance(run_id, uuid.UUID) else uuid.UUID(str(run_id))
    except ValueError:
        raise ReplayError(f"{storable_text(repr(run_id), 100)} is not a run id") from None
    run = AgentRun.objects.filter(pk=pk).first()
    if run is None:
        raise ReplayError(f"no run {pk}")
    return run


class _Replayer:
    def __init__(
        self, run: AgentRun, agent: Agent, allowed: bool | frozenset[str], report: ReplayReport
    ) -> None:
        self.run = run
        self.agent = agent
        self.allowed = allowed
        self.report = report
        self.intents = dict(ToolIntent.objects.filter(run=run).values_list("key", "status"))
        self.maker: uuid.UUID = run.pk  # the run that made the calls being replayed
        # Of each run that made calls: its fork point and the run its keys there came from.
        self.key_runs: dict[uuid.UUID, tuple[int | None, uuid.UUID | None]] = {}

    def replay(self) -> None:
        # A fork's log holds steps of the runs it was forked from: a call's key is that of
        # the run whose tool_result step answered it (the run that made the call).
        rows = list(
            steps_of(self.run.pk).order_by("seq").values_list("seq", "kind", "payload", "run_id")
        )
        steps = [(seq, kind, payload) for seq, kind, payload, _ in rows]
        makers = {seq: run_id for seq, _, _, run_id in rows}
        # A fork's calls of its fork-point turn carried the keys of the run it was forked from
        # (``effects.key_run``): the tool gets the key it got then.
        self.key_runs = {
            pk: (fork_seq, key_run)
            for pk, fork_seq, key_run in AgentRun.objects.filter(
                pk__in={*makers.values(), self.run.pk}
            ).values_list("pk", "fork_seq", "fork_key_run_id")
        }
        if len(set(makers.values())) > 1:
            self.intents = dict(
                ToolIntent.objects.filter(run_id__in=set(makers.values())).values_list(
                    "key", "status"
                )
            )
        for position, (seq, kind, payload) in enumerate(steps):
            if kind != StepKind.MODEL_TURN:
                continue
            self.maker = makers.get(seq + 1, self.run.pk)
            uses = [
                b
                for b in json.loads(payload).get("content") or []
                if isinstance(b, dict) and b.get("type") == "tool_use"
            ]
            if not uses:
                continue
            recorded = _results_after(steps, position)
            for index, block in enumerate(uses):
                old = recorded.get(block.get("id", ""))
                if old is None:
                    continue  # the run stopped before this call completed: nothing to compare
                self._one(seq, index, block, old)

    def _one(self, seq: int, index: int, block: dict[str, Any], old: dict[str, Any]) -> None:
        name, tool_input = block.get("name", ""), block.get("input")
        content = old.get("content")
        old_text = content if isinstance(content, str) else json.dumps(content)
        call = ReplayCall(
            seq, index, storable_text(name), tool_input, old_text, bool(old.get("is_error"))
        )
        key = effects.idempotency_key(self.maker, seq, index, name, tool_input)
        sent = effects.idempotency_key(self._key_run(seq), seq, index, name, tool_input)
        tool = self.agent.tools_by_name.get(name) if isinstance(name, str) else None
        reason = self._not_replayed(name, key)
        if reason:
            self.report.not_replayed.append(_with(call, reason=reason))
            return
        if tool is not None and not self._may_call(tool):
            self.report.skipped.append(
                _with(call, reason=f"a {tool.effect} tool; allow_effects does not name it")
            )
            return
        outcome = self._call(tool, call, key, sent)
        if isinstance(outcome, str):
            self.report.not_replayed.append(_with(call, reason=outcome))
            return
        self.report.calls += 1
        text, is_error, raised = outcome
        block_now = result_block(
            "", ToolEffect(key=key, tool=call.tool, result=text, is_error=is_error)
        )
        now = _with(call, new=block_now["content"], new_is_error=is_error)
        if _same(now.old, now.new or "") and call.old_is_error == is_error:
            self.report.matches += 1
        elif raised:
            self.report.errors.append(now)
        else:
            self.report.differences.append(now)

    def _key_run(self, seq: int) -> uuid.UUID:
        """The run whose id the keys the maker's tools received at ``seq`` came from."""
        fork_seq, key_run = self.key_runs.get(self.maker, (None, None))
        return key_run if key_run is not None and seq == fork_seq else self.maker

    def _not_replayed(self, name: Any, key: str) -> str:
        if name in BUILTIN_TOOLS:
            return f"the built-in {name}: its result came from a person"
        if self.intents.get(key) == IntentStatus.REJECTED:
            return "a person rejected the call: the tool never ran"
        return ""

    def _may_call(self, tool: Tool) -> bool:
        if tool.effect.rerun_is_free:
            return True
        return self.allowed is True or (
            isinstance(self.allowed, frozenset) and tool.name in self.allowed
        )

    def _call(
        self, tool: Tool | None, call: ReplayCall, key: str, sent: str
    ) -> tuple[str, bool, bool] | str:
        """Today's (text, is_error, raised) of the call, the way the runtime makes it (the
        tool receives ``sent``, the idempotency key it received then); a string when the call
        waits instead (the reason it is not replayed)."""
        if tool is None:
            known = ", ".join(sorted(self.agent.tools_by_name)) or "none"
            return (
                f"unknown tool {storable_text(repr(call.tool), 300)}; the tools are: {known}",
                True,
                False,
            )
        try:
            check_depth(call.input)
            tool.validate(call.input)
        except Unstorable as exc:
            return f"Invalid input for tool {tool.name!r}: the input {exc}", True, False
        except ToolInputError as exc:
            return str(exc), True, False
        context = waits.CallContext(self.run.pk, self.run.depth, key, metadata=self.run.metadata)
        try:
            # A savepoint per call: a query that fails in one tool (which aborts a PostgreSQL
            # transaction) must not fail the calls after it.
            with transaction.atomic(), waits.calling(context):
                value = tool.invoke(
                    call.input,
                    idempotency_key=sent,
                    run_context=(
                        None
                        if tool.run_context_parameter is None
                        else self.run.run_context(attempt=self.run.attempt, tool=tool.name)
                    ),
                )
                if tool.is_async:
                    value = asyncio.run(value)
        except waits.Wait as wait:
            return f"the call waits ({wait.describe()}): what ended its wait is not recorded"
        except Exception as exc:  # noqa: BLE001 -- the tool's failure is what the report is for
            return effects.tool_error_text(tool.name, exc), True, True
        text, is_error = effects.format_result(value)
        return text, is_error, False


def _results_after(steps: list[tuple[int, str, str]], position: int) -> dict[str, dict[str, Any]]:
    """The tool_result blocks of the tool_result step that follows the model turn at
    ``position``, by tool_use_id ({} if the run stopped before it)."""
    for _seq, kind, payload in steps[position + 1 :]:
        if kind == StepKind.MODEL_TURN:
            return {}
        if kind == StepKind.TOOL_RESULT:
            blocks = json.loads(payload)
            return {
                b["tool_use_id"]: b
                for b in blocks
                if isinstance(b, dict) and b.get("type") == "tool_result" and "tool_use_id" in b
            }
    return {}


def _same(old: str, new: str) -> bool:
    """Equal texts, or the same JSON value written another way (key order aside, the runtime
    writes JSON one way, but a recording may predate a change of how)."""
    if old == new:
        return True
    try:
        return bool(json.loads(old) == json.loads(new))
    except ValueError:
        return False


def _with(call: ReplayCall, **changes: Any) -> ReplayCall:
    return replace(call, **changes)
