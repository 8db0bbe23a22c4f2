"""Forks: a new run whose log up to a step is another run's, byte for byte, going on from there.

How a fork is made (``api.fork_run`` -> ``plan_fork`` -> ``Store.create_fork``)::

    the step at the fork point       -> kept, or replaced by the edit (the task, or a batch of
                                        tool results; never a model turn: its bytes are signed)
    the steps before it              -> shared, not copied: agent_step_share rows saying which
                                        stretch of which run's log the fork reads
    the fork point's recorded calls  -> inherited under the fork's keys, so a fork at a model
                                        turn does not make its calls again
    its calls not recorded           -> made by the fork with the original's idempotency keys
                                        (``fork_key_run_id``): they may have happened; an
                                        irreversible one in doubt refuses the fork
    the rest                         -> the fork's own: a worker claims it as any pending run,
                                        rebuilds the shared log and goes on; its calls get keys
                                        of the fork (new intents, new approvals)

How a fork's log is read: its own rows plus the shared stretches, in one statement where a
worker reads it (``LOG_SQL``) and through ``steps_of`` elsewhere. How retention keeps it:
before a run is deleted, ``keep_shared_steps`` copies every stretch a surviving fork reads from
it into that fork, in the same transaction as the delete (and ``agent_step_share.source_id``
RESTRICTs any other delete).

What may change on the way: ``version=`` and ``model=`` fork onto another agent version or
model unless the shared log holds thinking the API would refuse (``bound_blocks``): a thinking
or redacted_thinking block is signed over the model, system prompt and tools that produced it,
so with any of those changed the API answers 400. Other request parameters (max_tokens,
tool_choice, metadata, ...) may change freely.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from django.db import connection

from durable_agents._internal.deepjson import loads_deep
from durable_agents._internal.text import (
    MAX_DEPTH,
    Unstorable,
    check_depth,
    has_unstorable,
    json_text,
    storable_text,
)
from durable_agents.declare.agents import Agent, AgentNotFound, registry
from durable_agents.engine import effects
from durable_agents.engine.history import message_text
from durable_agents.exceptions import ForkRefused as ForkRefused
from durable_agents.models import (
    AgentRun,
    AgentStep,
    IntentStatus,
    RunStatus,
    SharedSteps,
    StepKind,
    ToolEffect,
    ToolIntent,
    new_run_id,
    step_part,
    steps_of,
)
from durable_agents.store.base import ForkWrite, RunId

# The stretches of other runs' logs one fork may read: a fork of a fork of a fork... adds one
# each, and every read of its log joins them all.
MAX_SHARES = 100
# Keys a tool_result block may carry in an edit (what the Messages API accepts).
RESULT_BLOCK_KEYS = frozenset({"type", "tool_use_id", "content", "is_error", "cache_control"})
# The request parameters a signed thinking block is bound to, besides the earlier messages.
BINDING_PARAMS = ("model", "system", "tools")


@dataclasses.dataclass(frozen=True)
class BoundBlock:
    """A thinking block in the log a fork would send, which binds the model, system and tools."""

    seq: int
    index: int
    type: str

    def __str__(self) -> str:
        return f"step {self.seq} (a model turn), content block {self.index} ({self.type})"


@dataclasses.dataclass(frozen=True)
class ForkPlan:
    run: AgentRun  # unsaved, pending
    write: ForkWrite


def plan_fork(
    parent: AgentRun,
    at_seq: Any,
    edit: Any = None,
    version: str | None = None,
    model: str | None = None,
) -> ForkPlan:
    """What ``create_fork`` writes for a fork of ``parent`` at ``at_seq``; ``ForkRefused``
    (a ``ValueError``) with the reason when the fork cannot be made."""
    step = _fork_point(parent, at_seq)
    pinned = _registered(parent.agent, parent.prompt_version)
    target = pinned if version is None else _registered(parent.agent, version)
    if target is None:
        wanted = parent.prompt_version if version is None else version
        raise ForkRefused(
            f"agent {parent.agent!r} version {wanted!r} is not registered in this process: a "
            "fork runs on a registered agent (keep the version deployed to fork its runs, or "
            "pass version= to fork onto one that is)"
        )
    fork_model = parent.model if model is None else model
    cut = at_seq if edit is not None else at_seq + 1
    _refuse_rebinding(parent, cut, _changed_params(parent, pinned, target, fork_model))
    task = parent.task
    own_step: tuple[int, str, str] | None = None
    inherited: list[ToolEffect] = []
    run_id = new_run_id()
    key_run_id: RunId | None = None
    if edit is not None:
        payload, task = _edited(step, edit, task)
        own_step = (at_seq, step.kind, payload)
    elif step.kind == StepKind.MODEL_TURN:
        inherited, key_run_id = _at_a_model_turn(parent, step, run_id)
    shares = shares_for(parent.pk, cut)
    if len(shares) > MAX_SHARES:
        raise ForkRefused(
            f"a fork reads at most {MAX_SHARES} stretches of other runs' logs; this one would "
            f"read {len(shares)} (a fork of a fork of ...): fork an earlier run of the line"
        )
    run = AgentRun(
        id=run_id,
        agent=parent.agent,
        prompt_version=target.version,
        fingerprint=target.fingerprint(fork_model),
        model=fork_model,
        task=task,
        status=RunStatus.PENDING,
        last_seq=at_seq,
        priority=parent.priority,
        concurrency_key=parent.concurrency_key,
        concurrency_limit=parent.concurrency_limit,
        # A fork is the same piece of work, for the same tenant, user or order.
        metadata=parent.metadata,
        forked_from=parent,
        fork_seq=at_seq,
        fork_key_run_id=key_run_id,
        # A fork of a child run stays in its tree, beside the child: the tree's limits count
        # it, and cancelling the tree's root (or the child's parent) cancels it. No spawn_key:
        # that names the call that spawned the child, which did not spawn the fork.
        parent_id=parent.parent_id,
        root_id=parent.root_id,
        depth=parent.depth,
    )
    return ForkPlan(run, ForkWrite(shares, own_step, inherited))


def _fork_point(parent: AgentRun, at_seq: Any) -> AgentStep:
    """The step of ``parent``'s log a fork at ``at_seq`` starts from; ``ForkRefused`` when
    ``at_seq`` names none."""
    if not isinstance(at_seq, int) or isinstance(at_seq, bool):
        raise ForkRefused(f"at_seq is a step's seq, an int, not {type(at_seq).__name__}")
    if not 0 <= at_seq <= parent.last_seq:
        raise ForkRefused(
            f"run {parent.pk} has steps 0 to {parent.last_seq}; there is no step {at_seq}"
        )
    step = steps_of(parent.pk).filter(seq=at_seq).first()
    if step is None:
        raise ForkRefused(f"run {parent.pk} has no step {at_seq} in its log")
    return step


def _refuse_rebinding(parent: AgentRun, cut: int, changed: list[str]) -> None:
    """``ForkRefused`` when the fork changes what signed thinking before ``cut`` is bound to
    (the model, or the version's system prompt and tools): the API would refuse the history."""
    if not changed:
        return
    bound = bound_blocks(parent.pk, cut)
    if bound:
        raise ForkRefused(
            f"cannot fork onto a different {' and '.join(changed)}: {bound[0]} holds "
            "signed thinking, which is bound to the model, system prompt and tools that "
            "produced it (the API refuses it with 400 Invalid signature). Fork without "
            f"version=/model=, or at a step before {bound[0].seq}"
            + (f" ({len(bound)} such blocks in all)" if len(bound) > 1 else "")
        )


def _registered(name: str, version: str) -> Agent | None:
    try:
        return registry.get(name, version)
    except AgentNotFound:
        return None


def _changed_params(parent: AgentRun, pinned: Agent | None, target: Agent, model: str) -> list[str]:
    """Which of the parameters thinking is bound to the fork would send differently."""
    if pinned is None:
        # The run's own version is gone: only its fingerprint says what it sent.
        if target.fingerprint(model) == parent.fingerprint:
            return []
        return [f"agent version (version {parent.prompt_version!r} is not registered here)"]
    before = pinned.request_for(parent.model)
    after = target.request_for(model)
    names = {"model": "model", "system": "system prompt", "tools": "tools"}
    return [names[p] for p in BINDING_PARAMS if before.get(p) != after.get(p)]


def bound_blocks(run_id: RunId, cut: int) -> list[BoundBlock]:
    """The thinking and redacted_thinking blocks of the run's model turns before step ``cut``
    that the API checks: those from the last compaction block on (it checks nothing before)."""
    rows = (
        steps_of(run_id)
        .filter(seq__lt=cut, kind=StepKind.MODEL_TURN)
        .order_by("seq")
        .values_list("seq", "kind", "payload", "content_start", "content_end")
    )
    return bound_in(rows)


# A step as ``bound_in`` reads it: (seq, kind, payload, content_start, content_end).
StepRow = tuple[int, str, str, int | None, int | None]


def bound_in(rows: Iterable[StepRow]) -> list[BoundBlock]:
    """``bound_blocks`` of a log already read: its model turns, in seq order."""
    found: list[BoundBlock] = []
    for seq, kind, payload, start, end in rows:
        content = loads_deep(message_text(kind, payload, start, end)).get("content") or []
        for index, block in enumerate(content):
            kind_of = block.get("type") if isinstance(block, dict) else None
            if kind_of == "compaction":
                found = []  # the check starts at the newest compaction block
            elif kind_of in ("thinking", "redacted_thinking"):
                found.append(BoundBlock(seq, index, kind_of))
    return found


def shares_for(parent_id: RunId, cut: int) -> list[tuple[RunId, int, int]]:
    """The stretches a fork of ``parent_id`` reads to have the parent's steps 0 to cut - 1:
    the parent's own shares cut at ``cut``, and the parent itself where it holds its rows."""
    taken = sorted(
        SharedSteps.objects.filter(fork_id=parent_id, lo__lt=cut).values_list(
            "source_id", "lo", "hi"
        ),
        key=lambda share: share[1],
    )
    shares: list[tuple[RunId, int, int]] = []
    start = 0  # the parent's own rows run from here to the next shared stretch
    for source, lo, hi in taken:
        if start < lo:
            shares.append((parent_id, start, lo))
        shares.append((source, lo, min(hi, cut)))
        start = min(hi, cut)
    if start < cut:
        shares.append((parent_id, start, cut))
    return shares


def _edited(step: AgentStep, edit: Any, task: str) -> tuple[str, str]:
    """The payload of the edited step at the fork point, and the fork's task."""
    if step.kind == StepKind.MODEL_TURN:
        raise ForkRefused(
            f"step {step.seq} is a model turn, which cannot be edited: its bytes are what the "
            "model sent, and its thinking is signed. Fork at it without edit=, or edit the "
            f"tool results after it (step {step.seq + 1})"
        )
    if step.kind == StepKind.MESSAGE:
        raise ForkRefused(
            f"step {step.seq} holds messages a user sent while the run worked, which cannot be "
            "edited: fork at it without edit=, or fork before it"
        )
    if step.kind == StepKind.TASK:
        if not isinstance(edit, str):
            raise ForkRefused(f"the edit of a task is a string, not {type(edit).__name__}")
        if not edit.strip():
            raise ForkRefused("the edited task is empty")
        _check_storable(edit)
        return json.dumps(edit, ensure_ascii=False), edit
    original = json.loads(step.payload)
    _check_results(step.seq, edit, original)
    return json_text(edit), task


def _check_results(seq: int, edit: Any, original: list[Any]) -> None:
    """An edit of a tool_result step: the same calls answered in the same order, each block a
    tool_result the API accepts, as JSON (no NUL, no lone surrogate, at most MAX_DEPTH deep)."""
    if not isinstance(edit, list):
        raise ForkRefused(
            f"the edit of step {seq} is the list of its tool_result blocks, not "
            f"{type(edit).__name__}"
        )
    if len(edit) != len(original):
        raise ForkRefused(
            f"step {seq} answers {len(original)} tool call(s); the edit has {len(edit)} block(s)"
        )
    try:
        check_depth(edit, MAX_DEPTH)
    except Unstorable as exc:
        raise ForkRefused(f"the edit {exc}") from None
    for index, (block, was) in enumerate(zip(edit, original, strict=True)):
        where = f"block {index} of the edit"
        if not isinstance(block, dict):
            raise ForkRefused(f"{where} is a tool_result object, not {type(block).__name__}")
        if block.get("type") != "tool_result":
            raise ForkRefused(f'{where} must have "type": "tool_result"')
        unknown = sorted(set(map(str, block)) - RESULT_BLOCK_KEYS)
        if unknown:
            raise ForkRefused(f"{where} has keys a tool_result cannot have: {', '.join(unknown)}")
        if block.get("tool_use_id") != was.get("tool_use_id"):
            raise ForkRefused(
                f"{where} answers tool_use_id {block.get('tool_use_id')!r}; step {seq} "
                f"answers {was.get('tool_use_id')!r} there (a result must answer its call)"
            )
        if "is_error" in block and not isinstance(block["is_error"], bool):
            raise ForkRefused(f'{where}: "is_error" is true or false')
        content = block.get("content", "")
        if not isinstance(content, str) and not (
            isinstance(content, list)
            and all(
                isinstance(part, dict) and isinstance(part.get("type"), str) for part in content
            )
        ):
            raise ForkRefused(
                f'{where}: "content" is a string or a list of content blocks (objects with '
                'a "type")'
            )
    try:
        json.dumps(edit, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ForkRefused(f"the edit is not JSON: {exc}") from None
    for text in _strings(edit):
        _check_storable(text)


def _strings(value: Any) -> Iterator[str]:
    """Every string in a JSON value, keys included (iterative: the depth is checked already,
    but a walk needs no recursion)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def _check_storable(text: str) -> None:
    if has_unstorable(text):
        raise ForkRefused(
            "the edit holds a NUL character or a lone surrogate, which no model request can carry"
        )


@dataclasses.dataclass(frozen=True)
class ForkPoint:
    """The calls of a model turn a fork would be made at, as the original left them."""

    # (call index, tool name) of each call the original recorded no result for: in flight,
    # cut by a crash, or not reached. The fork makes them with the original's keys.
    unrecorded: list[tuple[int, str]]
    # Irreversible calls among them whose outcome is in doubt (their intent is unknown, or
    # executing): a fork is refused until a person resolved them.
    in_doubt: list[ToolIntent]
    # Irreversible calls among them waiting for a decision or to run (pending, approved): the
    # fork's call needs its own approval, and carries the same key.
    open_intents: list[ToolIntent]


IN_DOUBT = (IntentStatus.UNKNOWN, IntentStatus.EXECUTING)
OPEN = (IntentStatus.PENDING, IntentStatus.APPROVED)


def _at_a_model_turn(
    parent: AgentRun, turn: AgentStep, fork_id: RunId
) -> tuple[list[ToolEffect], RunId]:
    """A fork at a model turn: the effects of it the fork inherits (the recorded ones), and
    the run whose keys its other calls carry; ``ForkRefused`` while an irreversible call of
    the turn is in doubt (a person resolves it on the run that made it first)."""
    point = fork_point(parent, turn)
    if point.in_doubt:
        raise ForkRefused(_in_doubt_refusal(point.in_doubt[0], len(point.in_doubt)))
    caller = calls_made_by(parent, turn.seq)
    return _inherited_effects(caller.pk, turn, fork_id), effects.key_run(caller, turn.seq)


def calls_made_by(run: AgentRun, seq: int) -> AgentRun:
    """The run that made (or was to make) the calls of the model turn ``seq`` of ``run``'s log:
    ``run`` itself, unless the turn comes before ``run``'s own fork point, where the run it was
    forked from made them (and so on up the line). Its ledger holds what was recorded of them,
    and its keys are the ones a receiver may have seen. A fork made at an edited step after
    the turn never made them, so neither its ledger nor its keys know them."""
    caller = run
    while caller.fork_seq is not None and seq < caller.fork_seq:
        parent = (
            AgentRun.objects.filter(pk=caller.forked_from_id).first()
            if caller.forked_from_id is not None
            else None
        )
        if parent is None:  # deleted by retention: its keys live on in the fork's key run
            break
        caller = parent
    return caller


def fork_point(parent: AgentRun, turn: AgentStep) -> ForkPoint:
    """What a fork of ``parent`` at its model turn ``turn`` inherits and what it does not.
    The calls are those of the run that made them (``calls_made_by``: ``parent``, or the run
    it was forked from when the turn predates its fork point); the intents looked at are that
    run's and, when its calls of this turn carry another run's keys (a fork of a fork at the
    same turn), that run's too."""
    parent = calls_made_by(parent, turn.seq)
    calls = _calls_of(turn)
    recorded = set(
        ToolEffect.objects.filter(run_id=parent.pk, seq=turn.seq).values_list(
            "call_index", flat=True
        )
    )
    unrecorded = [
        (index, str(call.get("name", "")))
        for index, call in enumerate(calls)
        if index not in recorded
    ]
    if not unrecorded:
        return ForkPoint([], [], [])
    runs = {parent.pk, effects.key_run(parent, turn.seq)}
    intents = list(
        ToolIntent.objects.filter(
            run_id__in=runs,
            seq=turn.seq,
            call_index__in=[index for index, _ in unrecorded],
            status__in=(*IN_DOUBT, *OPEN),
        ).order_by("call_index", "id")
    )
    return ForkPoint(
        unrecorded,
        [i for i in intents if i.status in IN_DOUBT],
        [i for i in intents if i.status in OPEN],
    )


def _in_doubt_refusal(intent: ToolIntent, count: int) -> str:
    where = (
        f"intent {intent.pk} ({storable_text(intent.tool, 200)}, call {intent.call_index} of "
        f"step {intent.seq}) of run {intent.run_id}"
    )
    if intent.status == IntentStatus.EXECUTING:
        why = (
            "is executing: its irreversible call has started and its outcome is not recorded "
            "yet. Fork once it is (if its worker died, a person resolves the intent first)"
        )
    else:
        why = (
            "has an unknown outcome: its irreversible call may have happened. A person resolves "
            "it first (it happened, with its result, or it did not); then fork again: a call "
            "that happened is the fork's too, and is not made again"
        )
    more = f" ({count} such intents in all)" if count > 1 else ""
    return f"cannot fork at step {intent.seq}: {where} {why}{more}"


def _calls_of(turn: AgentStep) -> list[dict[str, Any]]:
    return [
        block
        for block in loads_deep(turn.payload).get("content") or []
        if isinstance(block, dict) and block.get("type") == "tool_use"
    ]


def _inherited_effects(parent_id: RunId, turn: AgentStep, fork_id: RunId) -> list[ToolEffect]:
    """The fork point is a model turn: the calls of it that the parent completed are the
    fork's too, under the fork's keys, so the fork reads their results rather than making
    them again. A call the parent did not complete (in flight, cut by a crash, an approval
    still pending) is the fork's to make, with the parent's idempotency key
    (``effects.key_run``)."""
    calls = _calls_of(turn)
    recorded = ToolEffect.objects.filter(run_id=parent_id, seq=turn.seq)
    inherited = []
    for effect in recorded:
        if effect.call_index >= len(calls):
            continue
        call = calls[effect.call_index]
        key = effects.idempotency_key(
            fork_id, turn.seq, effect.call_index, call.get("name", ""), call.get("input")
        )
        inherited.append(
            ToolEffect(
                key=key,
                run_id=fork_id,
                seq=turn.seq,
                call_index=effect.call_index,
                tool=effect.tool,
                result=effect.result,
                is_error=effect.is_error,
            )
        )
    return inherited


def keep_shared_steps(run_ids: Sequence[RunId]) -> int:
    """Before ``run_ids`` are deleted: copy each stretch of their logs that a fork outside them
    reads into that fork (as its own rows) and drop the stretch. Call it inside the
    transaction that deletes them. Returns the number of steps copied."""
    if not run_ids:
        return 0
    to_db = AgentRun._meta.pk.get_db_prep_value
    ids = [to_db(run_id, connection) for run_id in run_ids]
    marks = ", ".join(["%s"] * len(ids))
    copied = 0
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT DISTINCT fork_id FROM agent_step_share"
            f" WHERE source_id IN ({marks}) AND fork_id NOT IN ({marks})",
            [*ids, *ids],
        )
        forks = [row[0] for row in cursor.fetchall()]
        for fork in forks:
            # Each fork's copies go to its own partition (its id's day, models/ids.py).
            part = step_part(fork)
            cursor.execute(
                "INSERT INTO agent_step (run_id, seq, part, kind, payload, content_start,"
                " content_end, request_id, attempt, worker, created_at)"
                " SELECT h.fork_id, s.seq, %s, s.kind, s.payload, s.content_start,"
                " s.content_end, s.request_id, s.attempt, s.worker, s.created_at"
                " FROM agent_step_share h"
                " JOIN agent_step s ON s.run_id = h.source_id AND s.seq >= h.lo"
                " AND s.seq < h.hi"
                f" WHERE h.source_id IN ({marks}) AND h.fork_id = %s",
                [part, *ids, fork],
            )
            copied += max(cursor.rowcount, 0)
        cursor.execute(
            f"DELETE FROM agent_step_share WHERE source_id IN ({marks})"
            f" AND fork_id NOT IN ({marks})",
            [*ids, *ids],
        )
    return copied
