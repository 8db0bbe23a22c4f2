"""The state machine of one run, top to bottom.

A worker that holds a claim calls ``advance_run``. It rebuilds the conversation from the step
log, then repeats until the run is parked or over:

    last step is the task or a tool_result -> call the model, commit the turn   (_model_step)
    last step is a model turn asking for tools -> run each call by its effect class,
                                                  commit the results             (_tool_step)
    last step is a final model turn            -> the run succeeded

The tool calls themselves, by effect class, are in ``dispatch.py``. Each step is committed in
``RunAdvancer._commit`` through ``Store.append_step`` (a ``StepWrite``), only while this
worker's fence holds, and in seq order: a model turn before any call with a side effect runs;
tool results before the next model call goes out, except that results of pure and idempotent
calls are committed while that call is in flight (OVERLAP_SAFE_COMMITS; always before the turn
it returns). A turn whose calls are all plain pure ones (but a claim's first) waits for them,
FUSE_WITHIN_SECONDS at most, and is committed with their results in one statement
(``Store.append_turn_and_results``); anything else the run writes meanwhile, or a slower call,
has it committed first. Nothing is
kept in memory that the log does not also hold, so a new worker that claims the run after a
crash continues at the first uncommitted step.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

from django.db import DatabaseError, DataError
from django.utils import timezone

from durable_agents import llm, observers, signals
from durable_agents._internal import db
from durable_agents._internal.deepjson import loads_deep
from durable_agents._internal.encryption import UndecryptableValue
from durable_agents._internal.interrupt import MESSAGE, Interrupt
from durable_agents._internal.text import json_text, storable_text
from durable_agents.conf import app_settings
from durable_agents.declare.agents import Agent, AgentNotFound, registry
from durable_agents.declare.output import InvalidOutput, correction_text
from durable_agents.declare.tools import EffectClass
from durable_agents.engine import credentials
from durable_agents.engine.dispatch import ToolCall, ToolDispatch, result_block
from durable_agents.engine.dispositions import (
    CANCELLED,
    DEAD,
    FAILED,
    LOST,
    REFUSED,
    RELEASED,
    SHUTDOWN,
    SUCCEEDED,
    THROTTLED,
    WAITING,
    Disposition,
    Stop,
)
from durable_agents.engine.history import (
    Conversation,
    assistant_message,
    load_log,
    load_steps,
    log_of_rows,
    task_log,
    user_message,
)
from durable_agents.engine.inbox_hint import InboxHint
from durable_agents.engine.outage import LeaseClock, retry_while_leased
from durable_agents.exceptions import StoredValueError
from durable_agents.flow import budgets, pricing
from durable_agents.flow.capacity import Estimate, Grant, observed
from durable_agents.logging import bind_run
from durable_agents.models import AgentRun, RunStatus, StepKind, ToolEffect, WaitKind
from durable_agents.store import MAX_REASON_CHARS, Claim, NextClaim, Parked, Store, current
from durable_agents.store.base import StepWrite
from durable_agents.store.batches import BatchTurn

# Names other modules import from here: the dispositions, and the tool-call value.
__all__ = [
    "CANCELLED",
    "DEAD",
    "FAILED",
    "FINAL_STOP_REASONS",
    "LOST",
    "RELEASED",
    "SHUTDOWN",
    "SUCCEEDED",
    "THROTTLED",
    "WAITING",
    "Disposition",
    "RunAdvancer",
    "ToolCall",
    "advance_run",
    "result_block",
    "text_of",
    "tokens_of",
]

logger = logging.getLogger("durable_agents.runner")

# What a person can do about a run started with another definition of its version.
DRIFT_ADVICE = (
    "Restore the definition the run started with, or give the changed agent a new version "
    "(version='<new>', upgrades_from=['{version}']) so that its runs carry over where their "
    "history allows (durable_agents.upgrade_runs('{agent}', '{version}', '<new>'))."
)

T = TypeVar("T")

# How long a model turn whose calls are all plain pure ones (sync, no Retry policy) may wait,
# answered but not committed, for those calls to end: then it is committed with their results
# in one statement, as one commit where there would be two. A call still running at this point
# has the turn committed while it runs, as any turn is. A crash within the window loses the
# paid turn, as a crash before any turn's commit lands does (its calls, being pure, just run
# again). Short enough that the window adds little to that of the commit itself.
FUSE_WITHIN_SECONDS = 0.005


class _MessageArrived(Exception):
    """A user's message interrupted the model call in flight (``policy="interrupt"``)."""


@dataclass
class _Step:
    seq: int
    kind: str
    message: Any  # the parsed payload
    # Committed by this claim just now: no call of this turn can have run yet, so the
    # effect ledger need not be read for it.
    fresh: bool = False


@dataclass(frozen=True)
class _UnstoredTurn:
    """A model turn answered and not committed yet: it may go with its calls' results."""

    step: StepWrite
    ms: float  # how long its call took
    deadline: float  # time.monotonic() by which it is committed, whatever its calls do


@dataclass
class _Position:
    """Where this claim stands: the conversation so far (appended to, read once per claim),
    the model turns in it, and the last committed step."""

    conversation: Conversation
    turns: int
    last: _Step
    # The commit of tool results that goes out with the next model call (see _tool_step).
    pending: Callable[[], None] | None = None


def advance_run(
    claim: Claim,
    interrupt: Interrupt | None = None,
    drain: threading.Event | None = None,
    then_claim: NextClaim | None = None,
    store: Store | None = None,
    lease: LeaseClock | None = None,
    inbox: InboxHint | None = None,
) -> Disposition:
    """Advance one claimed run until it is parked or over; returns its disposition.

    ``interrupt`` aborts what is in flight (cancelled, lease lost, shutdown now); ``drain``
    only stops before the next step (a worker shutting down gracefully). With ``then_claim``,
    the statement that commits the run's last turn also claims the worker's next run.
    ``store``: where the run lives (default: ``store.current()``, chosen now for the whole
    claim); unit tests pass an ``InMemoryStore``. ``lease``: how long the claim's lease holds,
    as the worker's heartbeat renews it (a commit cut by a lost connection is retried so long).
    ``inbox``: the worker's knowledge of messages queued since a look (each model call looks
    without it).
    """
    advancer = RunAdvancer(claim, interrupt or Interrupt(), drain, then_claim, store, lease, inbox)
    with bind_run(claim.run_id), observers.agent_span(claim) as span:
        disposition = advancer.advance()
        span.finish(disposition)
        return disposition


# A turn with one of these stop reasons ends the run successfully.
FINAL_STOP_REASONS = ("end_turn", "stop_sequence")


def text_of(message: dict[str, Any]) -> str:
    return "\n".join(
        block["text"]
        for block in message.get("content") or []
        if isinstance(block, dict)
        and block.get("type") == "text"
        and isinstance(block.get("text"), str)
    )


TOKEN_FIELDS = (
    "input_tokens",
    "cache_creation_input_tokens",
    "cache_read_input_tokens",
    "output_tokens",
)

# Turns with these stop reasons are not the end of anything: the model paused (a long server
# tool loop, or after a compaction pass with ``pause_after_compaction``) and is called again
# with the turn appended, exactly as the API documents.
CONTINUE_STOP_REASONS = ("pause_turn", "compaction")


# Bytes of a request per input token, for the estimate a call takes from the input bucket
# before it goes out (its usage settles the difference).
BYTES_PER_TOKEN = 4
# A call that finds the buckets short by at most this many seconds reserves its room and waits
# in its slot (no connection held); a longer wait hands the run back to the queue.
RESERVE_SECONDS = 1.0
# How long a model pauses after a 429 without retry-after.
RATE_LIMITED_SECONDS = 10.0


def charged_tokens(message: dict[str, Any]) -> tuple[int, int]:
    """What a turn charged to the API's rate limits: input tokens (cache writes included,
    cache reads not: they do not count toward input tokens per minute) and output tokens;
    summed over the passes of ``usage.iterations`` when the server ran several."""
    usage = message.get("usage") or {}
    passes = usage.get("iterations")
    if not isinstance(passes, list) or not passes:
        passes = [usage]

    def total(key: str) -> int:
        return sum(int(item.get(key) or 0) for item in passes if isinstance(item, dict))

    return total("input_tokens") + total("cache_creation_input_tokens"), total("output_tokens")


def tokens_of(message: dict[str, Any]) -> int:
    """Tokens billed for one turn: input (cached or not) plus output. When the server ran more
    than one pass (a compaction, then the message), ``usage.iterations`` lists each and the
    top-level figures cover only the last: the passes are summed instead."""
    usage = message.get("usage") or {}
    iterations = usage.get("iterations")
    if isinstance(iterations, list) and iterations:
        return sum(
            int(item.get(key) or 0)
            for item in iterations
            if isinstance(item, dict)
            for key in TOKEN_FIELDS
        )
    return sum(int(usage.get(key) or 0) for key in TOKEN_FIELDS)


class RunAdvancer(ToolDispatch):
    """One claim of one run: the step loop; the tool calls are ``ToolDispatch``'s."""

    def __init__(
        self,
        claim: Claim,
        interrupt: Interrupt,
        drain: threading.Event | None = None,
        then_claim: NextClaim | None = None,
        store: Store | None = None,
        lease: LeaseClock | None = None,
        inbox: InboxHint | None = None,
    ) -> None:
        # Every read and write of the run goes through this store.
        self.store: Store = store or current()
        # How long this claim's lease holds: a write cut by a lost connection is retried
        # within it (outage.py). Renewed by each committed step and by the heartbeat.
        self.lease = lease or LeaseClock(claim.lease_seconds, claim.leased_at)
        self.claim = claim
        self.run: AgentRun = claim.run
        self.interrupt = interrupt
        self.drain = drain
        self.then_claim = then_claim
        # Whether a message may have been queued since the last look (the worker's listener).
        self.inbox = inbox
        # Tokens billed to the run so far (the budgets read it); each turn adds its own.
        self.tokens: int = claim.run.tokens_used
        # The size of what every call sends besides the messages (system, tools, ...).
        self._request_bytes: int | None = None
        # Read with the claim's batch (``Claim.ahead``) or by the claim itself, each used
        # once: whether messages waited, and the calls recorded at the run's last step.
        ahead = claim.ahead
        self._ahead_messages: bool | None = (
            claim.messages_waiting if ahead is None else ahead.messages_waiting
        )
        self.ahead_effects: tuple[int, dict[str, ToolEffect]] | None = (
            None if ahead is None else (ahead.last_seq, ahead.effects)
        )
        # The model turn whose pure calls are running, while it waits to go with their results.
        self._unstored_turn: _UnstoredTurn | None = None
        # Whether this claim has committed a model turn (a later turn may go with its results).
        self._turn_committed_here = False

        # -- entry -----------------------------------------------------------------------------

    def advance(self) -> Disposition:
        try:
            try:
                return self._loop()
            except UndecryptableValue as exc:
                # A value of the run encrypted with a key no longer configured: every claim
                # would meet it again. A poison run, dead-lettered with the key id.
                self._dead(f"cannot decrypt: {exc}")
            except StoredValueError as exc:
                # A stored value of the run (a step, an effect, an intent, a wait) cannot be
                # read back: no later claim can either. A poison run, dead-lettered at once.
                self._dead(f"poison run: {exc}")
        except Stop as stop:
            return stop.disposition

    def _loop(self) -> NoReturn:
        """The step loop: each step returns the position after it, or stops the run."""
        agent, params, at = self._resume()
        while True:
            try:
                if at.pending is None:
                    self._check_interrupt()
                if self._model_goes_next(at.last):
                    if at.last.kind != StepKind.MODEL_TURN:
                        at = self._fold_messages(at)
                    at = self._model_step(agent, params, at)
                elif at.last.message.get("stop_reason") == "tool_use":
                    at = self._tool_step(agent, at)
                else:
                    at = self._end_as_committed(agent, at)
            except BaseException:
                # Whatever stops the run, what it has not committed yet is committed if the
                # fence still holds: a turn waiting for its calls' results, or the results (and
                # the turn that went with them) that were to commit with the next call. A paid
                # turn is not asked for again because something failed after it.
                self._store_turn_on_the_way_out()
                self._commit_on_the_way_out(at.pending)
                raise

    def _resume(self) -> tuple[Agent, dict[str, Any], _Position]:
        """Where this claim starts: a run that stalled too often is dead-lettered, the agent
        is pinned, and the conversation is rebuilt from the log verbatim."""
        run = self.run
        if run.stalled_claims > app_settings.MAX_ATTEMPTS:
            try:
                reason = self._stalled_reason()
            except Exception as exc:  # noqa: BLE001 - the run must end whatever the log holds
                reason = (
                    f"{run.stalled_claims - 1} claims in a row ended without committing a step "
                    f"(MAX_ATTEMPTS={app_settings.MAX_ATTEMPTS}); describing the step in "
                    f"flight failed: {type(exc).__name__}"
                )
            self._dead(reason)
        if self.claim.unreadable is not None:
            self._dead(f"cannot decrypt: {self.claim.unreadable}")
        agent = self._pinned_agent()
        params = agent.request_for(run.model)

        if self.claim.task_payload is not None:
            log = task_log(self.claim.task_payload)
        elif self.claim.ahead is not None:
            log = log_of_rows(self.claim.ahead.log)  # read with the claim's batch
        else:
            log = load_log(run.pk, store=self.store, shares=run.fork_seq is not None)
        if log.last is None or log.first_kind != StepKind.TASK:
            self._dead("the step log has no task step at seq 0")
        # Kept in memory (and appended to) while this claim lasts, so the log is read once per
        # claim, not once per step.
        try:
            message = loads_deep(log.last.payload)
        except ValueError as exc:
            problem = f"step {log.last.seq}: {type(exc).__name__}: {exc}"
            raise StoredValueError("agent_step.payload", problem) from exc
        last = _Step(log.last.seq, log.last.kind, message)
        return agent, params, _Position(log.conversation, log.turns, last)

    @staticmethod
    def _model_goes_next(last: _Step) -> bool:
        """After the task, tool results, or a turn the model paused in: call the model."""
        return (
            last.kind != StepKind.MODEL_TURN
            or last.message.get("stop_reason") in CONTINUE_STOP_REASONS
        )

    def _model_step(self, agent: Agent, params: dict[str, Any], at: _Position) -> _Position:
        """Call the model and commit its turn; a final turn ends the run instead."""
        if at.pending is None:
            self._check_budgets(agent, at.turns)
        messages = at.conversation.json()
        self._check_key_budget(str(params["model"]), at)
        if self.run.batch:
            self._park_on_batch(params, messages, at)  # returns only to send it directly
            at.pending = None
        grant = self._take_capacity(params, messages, at.pending)
        try:
            turn = self._call_model(agent, params, messages, at.pending, grant, at.last.seq + 1)
        except _MessageArrived:
            # The commit that went with the call ran before the call gave up (create_turn).
            logger.info("run %s: model call abandoned for a user's message", self.run.pk)
            return dataclasses.replace(at, pending=None)
        credentials.accepted()
        turn_tokens = tokens_of(turn.message)
        self.tokens += turn_tokens
        # Priced at the run's model (what it was started with and every call sends); the
        # turn is paid whatever becomes of its commit, so it is reported now.
        usage = pricing.usage_of(turn.message)
        cost = pricing.cost_of(self.run.model, usage)
        observers.turn_cost(self.run.agent, self.run.model, cost)
        step = StepWrite(
            at.last.seq + 1,
            StepKind.MODEL_TURN,
            turn.body,
            turn.request_id,
            content_span=turn.content_span,
            tokens=turn_tokens,
            usage=usage,
            cost=cost,
        )
        refused: InvalidOutput | None = None
        if turn.message.get("stop_reason") in FINAL_STOP_REASONS:
            text = text_of(turn.message)
            try:
                output = None if agent.output is None else agent.output.parse(text)
            except InvalidOutput as exc:
                refused = exc  # committed as a turn like any other, then answered below
            else:
                # The last turn: commit it and end the run in one statement (which may also
                # claim the worker's next run), with the validated answer if there is one.
                last_step = dataclasses.replace(step, finish=(SUCCEEDED, text), output=output)
                if self._commit(last_step, ms=turn.elapsed_ms, then_claim=self.then_claim):
                    self._settle(grant, turn)
                    raise self._finished(SUCCEEDED)
                # Messages wait in the run's inbox: the answer is a turn like any other, and
                # the model answers them next (_end_as_committed folds them).
        if refused is None and self._may_go_with_results(agent, turn.message):
            # Committed with its calls' results (_tool_step), or before anything else the run
            # writes, or within FUSE_WITHIN_SECONDS while a call runs, whichever comes first.
            deadline = time.monotonic() + FUSE_WITHIN_SECONDS
            self._unstored_turn = _UnstoredTurn(step, turn.elapsed_ms, deadline)
        else:
            self._commit(step, ms=turn.elapsed_ms)
        self._settle(grant, turn)
        at.conversation.append(assistant_message(turn.body, turn.content_span))
        last = _Step(step.seq, StepKind.MODEL_TURN, turn.message, fresh=True)
        after = _Position(at.conversation, at.turns + 1, last)
        if refused is not None:
            return self._refuse_answer(agent, after, refused)
        return after

    def _park_on_batch(self, params: dict[str, Any], messages: bytes, at: _Position) -> None:
        """A run in batches: its next turn goes into a Message Batch. The request (the body a
        direct call would send) is recorded and the run waits on it without a worker; the
        batch poller commits the answer as the next step and makes the run pending. Returns
        only when the request waited past BATCH_FALLBACK_SECONDS: the run sends it itself."""
        if at.pending is not None:
            at.pending()  # the tool results before the request that carries them
        body, betas = llm.batches.batch_request(params, messages)
        turn = BatchTurn(at.last.seq + 1, body, str(params["model"]), betas)
        parked = self.durably(
            lambda: self.store.park_on_batch(self.claim, turn), f"park on turn {turn.seq}"
        )
        if parked == Parked.READY:
            logger.info(
                "run %s: its batched turn %d waited past BATCH_FALLBACK_SECONDS: sent directly",
                self.run.pk,
                turn.seq,
            )
            return
        if parked != Parked.PARKED:
            self._fence_failed()
        logger.info("run %s waits for its turn %d in a Message Batch", self.run.pk, turn.seq)
        raise Stop(WAITING)

    def _refuse_answer(self, agent: Agent, at: _Position, refused: InvalidOutput) -> _Position:
        """The final answer (``at.last``, committed) does not match the agent's output schema.
        With a turn left, the model is told why in a user message (a step of its own, so a
        resumed run sends it too) and answers again; without one, the run fails with the
        validation error."""
        no_turn_left = self._budget_exceeded(agent, at.turns)
        if no_turn_left is not None:
            self._finish(
                FAILED,
                error=f"the final answer was refused: {refused} ({no_turn_left}; no turn left "
                "to correct it)",
            )
        # A user message whose content is a string: the API's message rules hold (an answer
        # that asked for no tool is followed by a user turn), and the signed turns before it
        # are sent again as they were.
        payload = json_text(correction_text(refused))
        step = StepWrite(at.last.seq + 1, StepKind.TOOL_RESULT, payload)
        self._commit(step)
        logger.info("run %s: final answer refused, the model is told why: %s", self.run.pk, refused)
        at.conversation.append(user_message(payload))
        last = _Step(step.seq, StepKind.TOOL_RESULT, loads_deep(payload))
        return _Position(at.conversation, at.turns, last)

    def _tool_step(self, agent: Agent, at: _Position) -> _Position:
        """Run the calls the last turn asked for and commit their results, now or with the
        next model call."""
        turn = at.last
        # What the claim (or its batch) saw in the inbox is older than anything sent while
        # these calls run: from here on the next model call looks for itself.
        self._ahead_messages = None
        started = time.monotonic()
        results, to_record = self._dispatch(agent, turn.seq, turn.message, turn.fresh)
        # Still unstored: its calls all ended within the window; it goes with their results.
        with_turn, self._unstored_turn = self._unstored_turn, None
        # Escapes instead of raw lone surrogates (a hostile tool_use id): the text is storable
        # and decodes to exactly what the model sent.
        payload = json_text(results)
        step = StepWrite(
            turn.seq + 1,
            StepKind.TOOL_RESULT,
            payload,
            effects=to_record,
        )
        commit_step = functools.partial(
            self._commit,
            step,
            with_turn=with_turn,
            ms=(time.monotonic() - started) * 1000,
            tool=storable_text(
                ",".join(
                    str(b.get("name"))
                    for b in turn.message["content"]
                    if b.get("type") == "tool_use"
                ),
                200,
            ),
        )

        committed: list[bool] = []

        def commit() -> None:
            # Once: a run that stops on the way tries it again (_loop).
            if not committed:
                committed.append(True)
                commit_step()

        at.conversation.append(user_message(payload))
        after = _Position(at.conversation, at.turns, _Step(step.seq, StepKind.TOOL_RESULT, results))
        if (
            app_settings.OVERLAP_SAFE_COMMITS
            and self._rerun_is_free(agent, turn)
            and self._between_steps_reason(agent, at.turns) is None
        ):
            # Only pure and idempotent calls, and nothing stops the run before its next model
            # call: that call goes out while this step commits. Its turn is committed only
            # after this step (the fence checks the seq), and a failed commit abandons it. A
            # crash leaves the log as it would without the overlap; at worst these calls run
            # again, which costs nothing. Results of non-idempotent and irreversible calls are
            # always committed before the next call goes out.
            after.pending = commit
        else:
            commit()
        return after

    def _end_as_committed(self, agent: Agent, at: _Position) -> _Position:
        """The last step is a turn that asked for no tool, committed by an earlier claim:
        the run ends as that turn says (or, a final answer the output schema refuses, the
        model is told why and the run goes on)."""
        stop_reason = at.last.message.get("stop_reason")
        if stop_reason in FINAL_STOP_REASONS:
            text = text_of(at.last.message)
            output = None
            if agent.output is not None:
                try:
                    output = agent.output.parse(text)
                except InvalidOutput as refused:
                    return self._refuse_answer(agent, at, refused)
            if not self._succeed_unless_messages(text, output):
                # A user wrote while the model answered: the run goes on with their messages
                # (found under the run's lock: whatever the inbox hint says, they are read).
                return self._fold_messages(at, found=True)
            raise self._finished(SUCCEEDED)
        self._finish(FAILED, error=f"the model stopped with stop_reason={stop_reason!r}")

    # -- the inbox (send_message) -----------------------------------------------------------

    def _fold_messages(self, at: _Position, found: bool = False) -> _Position:
        """Commit the messages waiting in the run's inbox as a ``message`` step, before the
        next model call: one index probe when none waits (none at all when the inbox hint
        knows that none came; with ``found`` a look found some already). The step marks them
        folded in its own transaction (``Store.fold_messages``); the tool results still to be
        committed go first, since the step's seq follows theirs. In the conversation the
        messages join the user turn they follow, after its tool_result blocks
        (``history.folded_message``)."""
        if found:
            self._ahead_messages = None  # the claim's look is older than this one
        elif not self._messages_may_wait():
            return at
        if at.pending is not None:
            at.pending()
            at.pending = None
        waiting = self.store.waiting_messages(self.run.pk)
        if not waiting:
            return at
        blocks = [{"type": "text", "text": message.text} for message in waiting]
        payload = json_text(blocks)
        step = StepWrite(at.last.seq + 1, StepKind.MESSAGE, payload)
        ids = [message.pk for message in waiting]
        started = time.monotonic()
        folded = self.durably(
            lambda: self.store.fold_messages(self.claim, step, ids), f"commit of step {step.seq}"
        )
        if not folded:
            self._fence_failed()
        self.lease.renewed(started)  # the step renewed the lease (counted from its first try)
        observers.step_committed(StepKind.MESSAGE, time.monotonic() - started)
        logger.info(
            "run %s seq %d message committed (%d message(s) folded)",
            self.run.pk,
            step.seq,
            len(ids),
        )
        at.conversation.fold(payload)
        return _Position(at.conversation, at.turns, _Step(step.seq, StepKind.MESSAGE, blocks))

    def _messages_may_wait(self) -> bool:
        """Whether the inbox may hold a message: what the worker has heard since the last look
        (``InboxHint``: no statement while nothing was queued), at the first model call of a
        claim when no tool ran before it what the claim or its batch saw, else the inbox's
        probe. A message queued after a look is folded at the next call that looks, or keeps
        the run going at its last commit, which looks again under the run's lock."""
        ahead, self._ahead_messages = self._ahead_messages, None
        if self.inbox is not None and not self.inbox.may_wait(self.run.pk):
            return False
        if ahead is not None:
            return ahead
        if self.inbox is None:
            return self.store.has_waiting_messages(self.run.pk)
        mark = self.inbox.mark()
        found = self.store.has_waiting_messages(self.run.pk)
        self.inbox.looked(self.run.pk, mark, found=found)
        return found

    # -- pinning ---------------------------------------------------------------------------

    def _pinned_agent(self) -> Agent:
        """The registered agent the run is pinned to (name, version and fingerprint for the
        run's model). A run this process cannot serve costs no attempt: it waits, visibly, for
        a worker that can (``WaitKind.WORKER``). Claims route by version already
        (``AgentRegistry.routing``): this is a claim by id ("run now"), or a run of a
        definition found to differ, which this process's claims skip from then on."""
        run = self.run
        try:
            agent = registry.get(run.agent, run.prompt_version)
        except AgentNotFound as exc:
            self._hand_back_unserved(
                f"waiting for a worker that defines {run.agent}@{run.prompt_version}: worker "
                f"{self.claim.owner} does not ({exc})"
            )
        current = agent.fingerprint(run.model)
        if current != run.fingerprint:
            registry.refuse(run.agent, run.prompt_version, run.fingerprint)
            self._hand_back_unserved(
                f"waiting for a worker whose {run.agent}@{run.prompt_version} has fingerprint "
                f"{run.fingerprint[:12]} (the run's): worker {self.claim.owner} has "
                f"{current[:12]}: its system prompt, tools or parameters changed without a new "
                "version, and resuming would change the history the model signed. "
                + DRIFT_ADVICE.format(agent=run.agent, version=run.prompt_version)
            )
        return agent

    def _hand_back_unserved(self, reason: str) -> NoReturn:
        """The run waits for a worker that can serve it (``WaitKind.WORKER``), out of every
        claim's way; a worker that can wakes it (``Store.wake_served_runs``)."""
        logger.warning("run %s handed back: %s", self.run.pk, reason)
        if not self.store.wait_for_worker(self.claim, reason):
            self._fence_failed()
        raise Stop(WAITING)

    # -- the model -------------------------------------------------------------------------

    def _check_budgets(self, agent: Agent, turns: int) -> None:
        """Between steps: a run over one of its agent's budgets fails with the figure."""
        exceeded = self._budget_exceeded(agent, turns)
        if exceeded is not None:
            self._finish(FAILED, error=f"budget exceeded: {exceeded}")

    def _budget_exceeded(self, agent: Agent, turns: int) -> str | None:
        if turns >= agent.max_turns:
            return f"max_turns ({agent.max_turns}) reached"
        if agent.max_total_tokens is not None and self.tokens >= agent.max_total_tokens:
            return f"{self.tokens} tokens used, max_total_tokens is {agent.max_total_tokens}"
        if agent.max_wall_seconds is not None and self.run.started_at is not None:
            elapsed = (timezone.now() - self.run.started_at).total_seconds()
            if elapsed >= agent.max_wall_seconds:
                return (
                    f"{elapsed:.1f}s since the run started, "
                    f"max_wall_seconds is {agent.max_wall_seconds}"
                )
        return None

    @staticmethod
    def _rerun_is_free(agent: Agent, turn: _Step) -> bool:
        """Whether running the turn's calls again could not repeat a side effect: every call
        is to a pure or idempotent tool (or to no tool at all: an error result)."""
        for block in turn.message.get("content") or []:
            if block.get("type") != "tool_use":
                continue
            tool = agent.tools_by_name.get(block.get("name", ""))
            if tool is not None and not tool.effect.rerun_is_free:
                return False
        return True

    def _may_go_with_results(self, agent: Agent, turn: dict[str, Any]) -> bool:
        """Whether the turn may wait for its calls to go with their results: it asks for
        tools, and each call is to a plain pure tool (sync, no Retry policy) or to no tool
        at all (an error result), so that its results may be committed while the next model
        call is in flight (OVERLAP_SAFE_COMMITS). Only once this claim has committed a model
        turn: a claim's first turn is committed before its calls, so that a call that kills
        its process (a poison run) costs no paid turn again at each claim, its dead letter
        names the call, and a worker that resumes a run after a crash runs its first turn's
        calls only once that turn is in the log."""
        if not app_settings.OVERLAP_SAFE_COMMITS or turn.get("stop_reason") != "tool_use":
            return False
        if not self._turn_committed_here:
            return False
        for block in turn.get("content") or []:
            if block.get("type") != "tool_use":
                continue
            name = block.get("name")
            tool = agent.tools_by_name.get(name) if isinstance(name, str) else None
            if tool is None:
                continue
            if tool.effect is not EffectClass.PURE or tool.is_async or tool.retry is not None:
                return False
        return True

    def _store_unstored_turn(self) -> None:
        """Commit the turn that waits for its calls' results, alone (dispatch.py calls this
        before the run parks; ``durably`` before every other write)."""
        unstored, self._unstored_turn = self._unstored_turn, None
        if unstored is not None:
            self._commit(unstored.step, ms=unstored.ms)

    def _while_a_pure_call_runs(self) -> tuple[Callable[[], None] | None, float | None]:
        """While a plain pure call runs: the unstored turn is committed, and the turn's
        completed calls not recorded yet are recorded, once the turn's window is over (at once
        if it is over already; FUSE_WITHIN_SECONDS from now when the turn is committed
        already), unless the call ended first."""
        unstored = self._unstored_turn
        if unstored is None and not self.unrecorded:
            return None, None
        now = time.monotonic()
        deadline = now + FUSE_WITHIN_SECONDS if unstored is None else unstored.deadline
        return self._keep_what_the_turn_did, max(0.0, deadline - now)

    def _keep_what_the_turn_did(self) -> None:
        self._store_unstored_turn()
        self._record_unrecorded()

    def _store_turn_on_the_way_out(self) -> None:
        """The calls of an unstored turn did not come to results (the run stops, or something
        failed): the paid turn is committed if the fence still holds, else counted as unstored
        by the store."""
        if self._unstored_turn is not None:
            self._commit_on_the_way_out(self._store_unstored_turn)

    def _commit_on_the_way_out(self, commit: Callable[[], None] | None) -> None:
        """``commit`` (a commit still to make) as the run stops. Whatever that meets, the
        exception already on its way out is what propagates; this one is only logged."""
        if commit is None:
            return
        try:
            commit()
        except Stop:
            pass  # the fence failed: nothing to keep (a paid turn is counted by the store)
        except Exception:
            logger.warning("run %s: committing on the way out failed", self.run.pk, exc_info=True)

    def _between_steps_reason(self, agent: Agent, turns: int) -> str | None:
        """Why the run would stop before its next step (what _check_interrupt and
        _check_budgets act on), or None."""
        if self.drain is not None and self.drain.is_set():
            return "draining"
        if self.interrupt.is_set():
            return self.interrupt.reason or "interrupted"
        return self._budget_exceeded(agent, turns)

    def _call_model(
        self,
        agent: Agent,
        params: dict[str, Any],
        messages: bytes,
        pending: Callable[[], None] | None,
        grant: Grant,
        seq: int,
    ) -> llm.ModelTurn:
        try:
            with self.interrupt.model_call() as call_interrupt:
                try:
                    return llm.create_turn(
                        params,
                        messages,
                        interrupt=call_interrupt,
                        # A run in batches never streams, even sent directly.
                        stream=agent.stream and not self.run.batch,
                        on_text=observers.text_receivers(
                            agent, self.run.pk, seq, self.claim.attempt, self.store.sends_live_text
                        ),
                        meanwhile=pending,
                        retry_rate_limits=False,
                    )
                except llm.ModelCallInterrupted as exc:
                    if call_interrupt.reason == MESSAGE and not self.interrupt.is_set():
                        # A user's message cut the call short: nothing of it is committed
                        # (an abandoned call returns no usage), and the run calls again.
                        self._give_back(grant)
                        raise _MessageArrived from exc
                    raise
        except llm.PermanentModelError as exc:
            self._give_back(grant)
            self._dead(exc.message + (f" (request id {exc.request_id})" if exc.request_id else ""))
        except llm.ModelCallInterrupted as exc:
            if exc.retry_after and self._only_draining():
                # The worker drains while the call waited out a retry-after: the run goes back
                # now, claimable when the server said the call may be made again.
                self._give_back(grant)
                self._wait_for_capacity(
                    grant.model,
                    exc.retry_after,
                    f"the worker is shutting down; {exc.message}",
                    observers.WaitReason.OVERLOADED
                    if exc.overloaded
                    else observers.WaitReason.RATE_LIMITED
                    if exc.rate_limited
                    else observers.WaitReason.CAPACITY,
                )
            self._check_interrupt()
            raise
        except llm.CredentialsRefused as exc:
            self._credentials_refused(grant, exc)
        except llm.TransientModelError as exc:
            self._not_the_runs_fault(grant, exc)
            self._give_back(grant)
            logger.warning(
                "run %s: model unavailable, handing the run back: %s", self.run.pk, exc.message
            )
            self.store.release_lease(self.claim, error=f"model call failed: {exc.message}")
            raise Stop(RELEASED) from exc

    def _credentials_refused(self, grant: Grant, exc: llm.CredentialsRefused) -> NoReturn:
        """The API refused the worker's key: hand the run back at once, uncounted (another
        worker's key may work), and pause this worker's claims (``credentials``)."""
        self._give_back(grant)
        if not self.store.release_lease(self.claim, count_claim=False):
            self._fence_failed()
        credentials.refused(exc.status, exc.message)
        raise Stop(REFUSED) from exc

    # -- model capacity (capacity/gate.py: the fleet's buckets) -----------------------------

    def _take_capacity(
        self, params: dict[str, Any], messages: bytes, pending: Callable[[], None] | None
    ) -> Grant:
        """Capacity for the next model call, from the fleet's buckets; or the run is handed
        back to wait for it (after committing ``pending``, the step that goes with the call)."""
        if self._request_bytes is None:
            self._request_bytes = len(json_text({k: v for k, v in params.items() if k != "model"}))
        estimate = Estimate(
            input_tokens=(self._request_bytes + len(messages)) // BYTES_PER_TOKEN + 1,
            output_tokens=int(params.get("max_tokens") or 0),
        )
        grant = self.store.capacity.acquire(
            str(params["model"]), estimate, self.run.priority, max_wait=RESERVE_SECONDS
        )
        if grant.granted and grant.wait_seconds > 0:
            # The reserved room is a moment away: the slot waits for it without a connection
            # (a worker's few pooled connections serve every slot's commits meanwhile).
            db.release()
            if self.interrupt.wait_unless_draining(grant.wait_seconds):
                # Interrupted (or the worker drains) meanwhile: the call never goes out.
                self._give_back(grant)
                if pending is not None:
                    pending()
                self._check_interrupt()
        if not grant.granted:
            if pending is not None:
                pending()
            self._wait_for_capacity(
                grant.model, grant.wait_seconds, grant.reason, observers.WaitReason.CAPACITY
            )
        return grant

    def _check_key_budget(self, model: str, at: _Position) -> None:
        """A run whose concurrency key spent its budget today waits for the next UTC day
        (or for its budget to be raised), pending, before it pays for another turn. The turn
        before is counted first: one that went with its results is committed now, not while
        the next call is in flight."""
        key = self.run.concurrency_key
        if key is None or budgets.configured_budget(key) is None:
            return
        if at.pending is not None:
            at.pending()
            at.pending = None
        spent, override = self.store.spent_today(key)
        budget = budgets.in_force(key, override)
        if budget is None or spent < budget:
            return
        self._wait_for_capacity(
            model,
            budgets.seconds_to_next_day(self.store.now()),
            f"key {key!r} spent ${spent:.4f} of its ${budget} today",
            observers.WaitReason.BUDGET,
            WaitKind.BUDGET,
        )

    def _not_the_runs_fault(self, grant: Grant, exc: llm.TransientModelError) -> None:
        """A 429 pauses the model for the whole fleet, and the run waits for the pause to
        end; a 529 whose retries ran out hands the run back too. Neither counts against the
        run: however long they last, no run is dead-lettered for them."""
        if exc.rate_limited:
            seconds = exc.retry_after if exc.retry_after is not None else RATE_LIMITED_SECONDS
            self.store.capacity.rate_limited(
                grant.model, seconds, observed(exc.rate_headers), self.run.priority
            )
            self._wait_for_capacity(
                grant.model,
                seconds,
                f"429 from the API: {exc.message}",
                observers.WaitReason.RATE_LIMITED,
            )
        if exc.overloaded:
            self._give_back(grant)
            self.store.capacity.overloaded(grant.model)
            # As long as the next retry would have waited: the retries of this claim are over.
            backoff = llm.retries.backoff_ceiling(int(app_settings.MODEL_RETRIES))
            seconds = backoff if exc.retry_after is None else exc.retry_after
            self._wait_for_capacity(
                grant.model,
                seconds,
                f"the API is overloaded: {exc.message}",
                observers.WaitReason.OVERLOADED,
            )

    def _wait_for_capacity(
        self,
        model: str,
        seconds: float,
        reason: str,
        why: observers.WaitReason,
        kind: WaitKind = WaitKind.CAPACITY,
    ) -> NoReturn:
        """Hand the run back, pending, claimable again in ``seconds``: it holds no slot, no
        connection and no attempt meanwhile (the claim is not counted as a stall)."""
        released = self.store.release_lease(
            self.claim, count_claim=False, hold_seconds=seconds, waiting_for=kind
        )
        if not released:
            self._fence_failed()
        observers.capacity_wait(model, why, seconds)
        logger.info(
            "run %s waits %.2fs for capacity of %s (%s)", self.run.pk, seconds, model, reason
        )
        raise Stop(THROTTLED)

    def _settle(self, grant: Grant, turn: llm.ModelTurn) -> None:
        """The call answered: its usage settles what the grant took, its headers correct the
        buckets. After the commit: a failure here costs accuracy, never the answer."""
        try:
            self.store.capacity.settle(
                grant, charged_tokens(turn.message), observed(turn.rate_headers)
            )
        except DatabaseError as exc:
            logger.warning("run %s: settling model capacity failed: %s", self.run.pk, exc)

    def _give_back(self, grant: Grant) -> None:
        """The call charged nothing (refused or failed): what its grant took comes back."""
        if grant.limited:
            self.store.capacity.settle(grant, None, None)

    # -- commits and endings ---------------------------------------------------------------

    def _commit(
        self,
        step: StepWrite,
        *,
        ms: float = 0.0,
        tool: str | None = None,
        then_claim: NextClaim | None = None,
        with_turn: _UnstoredTurn | None = None,
    ) -> bool:
        """Commit ``step`` through ``Store.append_step`` (every step of the run is committed
        here), or stop: the fence failed, or the database refused what was to be stored.
        A step that ends the run goes through ``Store.append_last_step``: False when messages
        wait in the run's inbox and nothing was committed (the run goes on). ``with_turn``:
        the tool results go with the model turn that asked for them, not committed yet
        (``Store.append_turn_and_results``)."""
        seq, kind = step.seq, step.kind
        started = time.monotonic()
        tries: list[float] = []
        deferred: list[bool] = []

        def append() -> bool:
            tries.append(time.monotonic())
            # A retry claims no next run: the first try may have claimed one already.
            next_claim = then_claim if len(tries) == 1 else None
            if with_turn is not None:
                return self.store.append_turn_and_results(self.claim, with_turn.step, step)
            if step.finish is None:
                return self.store.append_step(self.claim, step, next_claim)
            appended = self.store.append_last_step(self.claim, step, next_claim)
            if appended is None:
                deferred.append(True)
                return True
            return appended

        try:
            committed = self.durably(append, f"commit of step {seq}")
        except DataError as exc:
            # The database refuses what was to be stored (the statement wrote nothing). Trying
            # again would pay for the same answer and fail the same way: end the run now.
            self._dead(
                f"step {seq} ({kind}) could not be stored: {storable_text(exc, 500)}; "
                "requeue the run to try the step again"
            )
        if not committed:
            self._fence_failed()
        if deferred:
            return False
        if step.finish is None:
            self.lease.renewed(tries[-1])  # the step renewed the lease
        if kind == StepKind.MODEL_TURN or with_turn is not None:
            self._turn_committed_here = True
        if with_turn is not None:
            observers.step_committed(with_turn.step.kind, time.monotonic() - started)
            logger.info(
                "run %s seq %d %s committed (%.1f ms)",
                self.run.pk,
                with_turn.step.seq,
                with_turn.step.kind,
                with_turn.ms,
            )
        observers.step_committed(kind, time.monotonic() - started)
        logger.info(
            "run %s seq %d %s%s committed (%.1f ms)",
            self.run.pk,
            seq,
            kind,
            f" tool={tool}" if tool else "",
            ms,
        )
        return True

    def durably(self, operation: Callable[[], T], what: str) -> T:
        """``operation``, a fenced write of this claim, tried again on a fresh connection when
        the connection is lost, for as long as the lease holds (outage.py); a model turn still
        unstored is committed first."""
        self._store_unstored_turn()
        return retry_while_leased(
            operation, lease=self.lease, what=f"run {self.run.pk}: {what}", interrupt=self.interrupt
        )

    def _only_draining(self) -> bool:
        """The worker is shutting down gracefully and nothing interrupted this run itself."""
        return self.drain is not None and self.drain.is_set() and not self.interrupt.is_set()

    def _check_interrupt(self) -> None:
        if self._unstored_turn is not None and (self._only_draining() or self.interrupt.is_set()):
            # Stopping between a turn and its results: the paid turn is kept if the fence holds.
            self._store_turn_on_the_way_out()
        if self._only_draining():
            # The worker is draining: the last step is committed; hand the run back now.
            self.store.release_lease(self.claim, count_claim=False)
            logger.info("run %s handed back: the worker is shutting down", self.run.pk)
            raise Stop(RELEASED)
        if not self.interrupt.is_set():
            return
        if self.interrupt.reason == SHUTDOWN:
            self.store.release_lease(self.claim, count_claim=False)
            raise Stop(RELEASED)
        self._fence_failed()

    def _fence_failed(self) -> NoReturn:
        status = self.store.current_status(self.run.pk)
        if status == RunStatus.CANCELLED:
            logger.info("run %s was cancelled; stopping without committing", self.run.pk)
            raise Stop(CANCELLED)
        logger.warning("run %s: lease lost (status now %s); stopping", self.run.pk, status)
        raise Stop(LOST)

    def _finish(
        self,
        disposition: Disposition,
        *,
        result: str | None = None,
        error: str = "",
        output: Any = None,
    ) -> NoReturn:
        if not self._end(disposition, result=result, error=error, output=output):
            self._fence_failed()
        raise self._finished(disposition, error)

    def _end(
        self, status: str, *, result: str | None = None, error: str = "", output: Any = None
    ) -> bool:
        """``finish_run``, tried again after a lost connection; True too when a try whose
        answer was lost did end the run (it has that status now)."""
        tries = 0

        def finish() -> bool:
            nonlocal tries
            tries += 1
            return self.store.finish_run(
                self.claim, status, result=result, error=error, output=output
            )

        ended = self.durably(finish, f"end ({status})")
        return ended or (tries > 1 and self.store.current_status(self.run.pk) == status)

    def _succeed_unless_messages(self, result: str, output: Any) -> bool:
        """End the run as succeeded, unless messages wait in its inbox (False: nothing
        changed); under the run's lock, as ``send_message`` takes it, so that no message is
        accepted by a run that then ends without it."""
        tries = 0

        def finish() -> bool | None:
            nonlocal tries
            tries += 1
            return self.store.finish_unless_messages(self.claim, result, output)

        ended = self.durably(finish, f"end ({SUCCEEDED})")
        if ended is None:
            return False
        if not ended and not (
            tries > 1 and self.store.current_status(self.run.pk) == RunStatus.SUCCEEDED
        ):
            self._fence_failed()
        return True

    def _finished(self, disposition: Disposition, error: str = "") -> Stop:
        """The run ended (committed already): log it, signal it, and return the ``Stop`` for
        the caller to raise (``raise self._finished(...)``: the end is visible where it is)."""
        log = logger.info if disposition == SUCCEEDED else logger.warning
        log("run %s %s%s", self.run.pk, disposition, f": {error}" if error else "")
        signals.run_finished.send(sender=AgentRun, run_id=self.run.pk, status=disposition)
        return Stop(disposition)

    def _dead(self, reason: str) -> NoReturn:
        reason = storable_text(reason, MAX_REASON_CHARS)
        try:
            ended = self._end(RunStatus.DEAD, error=reason)
        except DatabaseError as exc:
            # Whatever the reason holds, the run must end: a poison run that cannot even be
            # dead-lettered would be claimed again forever.
            logger.error("run %s: storing the dead-letter reason failed: %s", self.run.pk, exc)
            reason = (
                f"dead-lettered; the reason could not be stored ({type(exc).__name__}); "
                "see the worker's log for this run id"
            )
            ended = self._end(RunStatus.DEAD, error=reason)
        if not ended:
            self._fence_failed()
        logger.error("run %s dead-lettered: %s", self.run.pk, reason)
        signals.run_dead_lettered.send(sender=AgentRun, run_id=self.run.pk, reason=reason)
        raise Stop(DEAD)

    def _stalled_reason(self) -> str:
        run = self.run
        reason = (
            f"{run.stalled_claims - 1} claims in a row ended without committing a step "
            f"(MAX_ATTEMPTS={app_settings.MAX_ATTEMPTS}); last committed step: seq {run.last_seq}"
        )
        last = load_steps(run.pk, after_seq=run.last_seq - 1, store=self.store)
        if last and last[-1].kind == StepKind.MODEL_TURN:
            calls = [
                b.get("name")
                for b in loads_deep(last[-1].payload).get("content") or []
                if b.get("type") == "tool_use"
            ]
            if calls:
                reason += f"; the step in flight ran tool call(s): {', '.join(map(str, calls))}"
            else:
                reason += "; the step in flight was finishing the run"
        else:
            reason += "; the step in flight was a model call"
        if run.error:
            reason += f"; last error: {run.error}"
        return reason
