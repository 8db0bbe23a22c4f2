"""The tool calls of one model turn, each by its tool's effect class.

``RunAdvancer`` (runner.py) inherits this: after a model turn that asks for tools, its tool
step calls ``_dispatch``, which runs the calls in order and returns their results:

    recorded already (the effect ledger)    -> its recorded result; it never runs again
    unknown tool, input too deep or invalid -> an error result for the model
    pure / idempotent                       -> run on the slot's caller thread (idempotent:
                                               after a fenced lease renewal), bounded by its
                                               timeout; a ``Wait`` it raises parks the run
    irreversible                            -> an intent a person approves first; the call
                                               runs once, behind a fenced ``executing`` mark

A tool with a ``Retry`` policy (any class but irreversible) is called again, with the same
idempotency key, after a failure the policy names and its pause (``_invoke``); the model
reads what the last attempt came to.

Each call travels as one ``ToolCall`` value. A completed call with a side effect (idempotent,
non-idempotent, irreversible) is recorded at once, so that it never runs again. A completed
pure call (or the error result of a call to no tool) waits to be recorded with the tool_result
step (``RunAdvancer._commit``), as the last call of the turn always is, so that a turn of
several quick pure calls commits once; it is recorded earlier if anything else is about to take
time: before a call that is not a plain (sync) pure one starts, when a plain pure call outlasts
the turn's window (``_while_a_pure_call_runs``), and before the run parks.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

from durable_agents import observers, signals
from durable_agents._internal import calls
from durable_agents._internal.interrupt import Interrupt
from durable_agents._internal.text import Unstorable, check_depth, storable_text
from durable_agents.conf import app_settings
from durable_agents.declare import waits
from durable_agents.declare.agents import Agent
from durable_agents.declare.tools import EffectClass, Tool, ToolInputError
from durable_agents.engine import effects
from durable_agents.engine.dispositions import SHUTDOWN, WAITING, Stop
from durable_agents.models import (
    AgentQuestion,
    AgentRun,
    IntentStatus,
    ToolEffect,
    ToolIntent,
    WaitKind,
)
from durable_agents.store import Claim, Parked, Store
from durable_agents.store.base import WaitRefused, WaitSpec

T = TypeVar("T")

# The run's whole story is told by one logger, whichever module tells it.
logger = logging.getLogger("durable_agents.runner")
# A tool's exception message in its WARNING line is cut to this many characters (the model
# gets the whole text as the tool's result; the traceback at DEBUG has it too).
MAX_LOGGED_ERROR_CHARS = 500
# A failed attempt that is tried again: its exception's message in the log is cut to this.
MAX_LOGGED_FAILURE_CHARS = 200


@dataclass(frozen=True)
class ToolCall:
    """One tool call of a model turn, as the model sent it, with where it stands in the log."""

    seq: int  # the seq of the model turn that asked for it
    index: int  # its place among that turn's calls
    name: Any  # the tool's name as the model sent it (any JSON value)
    input: Any  # the input as the model sent it
    key: str  # its idempotency key: the effect ledger, intents and waits know it by this
    # The idempotency key the tool receives: ``key``, but for the calls of a fork's fork-point
    # turn, the original run's key (``effects.key_run``): the original may have made the call.
    sent_key: str = ""

    @property
    def receiver_key(self) -> str:
        return self.sent_key or self.key


@dataclass(frozen=True)
class CallOutcome:
    """What one invocation of a tool came to: the text the model reads, and how it ended."""

    text: str
    is_error: bool
    timed_out: bool = False
    # The tool's Retry policy asks for another attempt (see ``ToolDispatch._invoke``).
    retry: bool = False
    # What the attempt raised, in words, for the log of a retried attempt ("" if nothing).
    failure: str = ""


# Not a DurableAgentsError: control flow inside the runtime (a tool's Wait on its way to the
# park), caught by the runner; never raised to user code.
class WaitRaised(Exception):
    """The tool raised ``Wait``: carried out of the call to the park."""

    def __init__(self, wait: waits.Wait) -> None:
        super().__init__(wait.describe())
        self.wait = wait


class _SlotWorkFailed(Exception):
    """What the slot's own work raised while a call ran or waited for its permit (the commit
    of the turn that asked for it): carried past the handling of the tool's failures, which
    it is not, and raised as it was."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


def _slot_work(work: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        try:
            work()
        except Exception as exc:
            raise _SlotWorkFailed(exc) from exc

    return run


def result_block(tool_use_id: str, effect: ToolEffect) -> dict[str, Any]:
    text = effect.result
    limit = app_settings.MAX_RESULT_CHARS
    if len(text) > limit:
        text = (
            text[:limit] + f"\n[truncated: the result has {len(effect.result)} characters; "
            f"the first {limit} are shown]"
        )
    block: dict[str, Any] = {"type": "tool_result", "tool_use_id": tool_use_id, "content": text}
    if effect.is_error:
        block["is_error"] = True
    return block


def wait_spec(wait: waits.Wait, key: str) -> WaitSpec:
    """How the store parks ``wait`` of the call with this key."""
    if isinstance(wait, waits.AskPerson):
        return WaitSpec(WaitKind.QUESTION, key, question=wait.question)
    if wait.kind == "timer":
        return WaitSpec(WaitKind.TIMER, key, seconds=wait.seconds, until=wait.until)
    if wait.kind == "event":
        # Checked again here: tool code may have changed the name after ``Wait`` checked it,
        # and a name the database refuses must be the tool's error, never a failed park.
        problem = waits.event_name_problem(wait.event)
        if problem is not None:
            raise WaitRefused(f"invalid event name: {problem}")
        return WaitSpec(WaitKind.EVENT, key, seconds=wait.timeout, event=wait.event)
    if wait.kind == "callback":
        return WaitSpec(WaitKind.CALLBACK, key, seconds=wait.timeout)
    return WaitSpec(WaitKind.RUNS, key, seconds=wait.timeout, runs=wait.runs)


def _free_to_run_again(tool: Tool | None) -> bool:
    """Whether a completed call costs nothing to run again: a call to a pure tool, or to no
    tool at all (its error result is computed again)."""
    return tool is None or tool.effect is EffectClass.PURE


def _quick_to_fuse(tool: Tool | None) -> bool:
    """Whether a call may start while the turn's completed pure calls are not recorded yet: a
    plain (sync) pure call, whose wait records them once it outlasts the turn's window, or a
    call to no tool at all (an error result at once)."""
    return _free_to_run_again(tool) and not (tool is not None and tool.is_async)


class ToolDispatch:
    """The tool half of ``RunAdvancer``: what it needs of the advancer is declared here (the
    claim, its store and interrupt, and three ways to stop), defined there."""

    store: Store
    claim: Claim
    run: AgentRun
    interrupt: Interrupt

    # The calls recorded at the run's last step, read with the claim's batch: (seq, by key).
    ahead_effects: tuple[int, dict[str, ToolEffect]] | None = None
    # Completed calls of the turn being dispatched that are free to run again, not recorded
    # yet: they go with the tool_result step, or earlier (see the module's docstring).
    unrecorded: tuple[ToolEffect, ...] = ()

    def _check_interrupt(self) -> None:
        raise NotImplementedError

    def _recorded_effects(self, seq: int) -> dict[str, ToolEffect]:
        """The calls of turn ``seq`` that completed: read with the claim's batch the first
        time (when it is the step they were read at), from the store otherwise."""
        ahead, self.ahead_effects = self.ahead_effects, None
        if ahead is not None and ahead[0] == seq:
            return ahead[1]
        return self.store.recorded_effects(self.run.pk, seq)

    def durably(self, operation: Callable[[], T], what: str) -> T:
        raise NotImplementedError

    def _store_unstored_turn(self) -> None:
        """Commit the model turn whose calls are running, if it is not committed yet (it may
        wait to go with their results): before anything else of the run is written."""

    def _while_a_pure_call_runs(self) -> tuple[Callable[[], None] | None, float | None]:
        """What the slot does while a plain pure call runs, and after how many seconds of it
        (``run_abortable``'s ``meanwhile`` and ``meanwhile_after``): nothing by default."""
        return None, None

    def _fence_failed(self) -> NoReturn:
        raise NotImplementedError

    def _dead(self, reason: str) -> NoReturn:
        raise NotImplementedError

    # -- the calls of a turn ---------------------------------------------------------------

    def _dispatch(
        self, agent: Agent, seq: int, turn: dict[str, Any], fresh: bool
    ) -> tuple[list[dict[str, Any]], list[ToolEffect]]:
        """Run the calls of the model turn ``turn`` (step ``seq``) in order; their results,
        and the calls to record with the tool_result step: the last one, and the pure ones
        not recorded on the way (a completed call with a side effect is recorded at once).
        ``fresh``: the turn was committed by this claim just now, so none of its calls can
        have run yet (the ledger need not be read)."""
        calls = [b for b in turn.get("content") or [] if b.get("type") == "tool_use"]
        recorded = {} if fresh else self._recorded_effects(seq)
        results: list[dict[str, Any]] = []
        final_effect: ToolEffect | None = None
        self.unrecorded = ()
        for index, call in enumerate(calls):
            name = call.get("name", "")
            tool = agent.tools_by_name.get(name) if isinstance(name, str) else None
            tool_input = call.get("input")
            key = effects.idempotency_key(self.run.pk, seq, index, name, tool_input)
            effect = recorded.get(key)
            if effect is None:
                # The ledger knows the call by this run's key (found by (run_id, seq), never
                # another run's row); the tool may get the original's (a fork's first turn).
                keys_of = effects.key_run(self.run, seq)
                sent = (
                    key
                    if keys_of == self.run.pk
                    else effects.idempotency_key(keys_of, seq, index, name, tool_input)
                )
                if not _quick_to_fuse(tool):
                    # What may take long, or has a side effect, starts with the turn's
                    # completed calls recorded: a crash meanwhile does not run them again.
                    self._record_unrecorded()
                with observers.tool_span(agent, call, key) as span:
                    effect = self._call_tool(
                        agent, ToolCall(seq, index, name, tool_input, key, sent)
                    )
                    span.result(effect.result, effect.is_error)
                if index == len(calls) - 1:
                    final_effect = effect
                elif _free_to_run_again(tool):
                    self.unrecorded = (*self.unrecorded, effect)
                else:
                    # Recorded at once (again after a lost connection): a completed call
                    # with a side effect must not run again in the next claim.
                    self._record_unrecorded()
                    self._record(effect)
            results.append(result_block(call.get("id", ""), effect))
        to_record, self.unrecorded = list(self.unrecorded), ()
        if final_effect is not None:
            to_record.append(final_effect)
        return results, to_record

    def _record(self, effect: ToolEffect) -> None:
        self.durably(
            functools.partial(self.store.record_effect, effect),
            f"recording call {effect.call_index} of step {effect.seq}",
        )

    def _record_unrecorded(self) -> None:
        """Record the completed pure calls of the turn not recorded yet: their results are
        kept, not computed again, whatever happens next."""
        pending, self.unrecorded = self.unrecorded, ()
        for effect in pending:
            self._record(effect)

    def _effect(self, call: ToolCall, text: str, is_error: bool) -> ToolEffect:
        # Names and texts come from the model and from tool code: made storable here, the one
        # place every recorded call passes through.
        return ToolEffect(
            key=call.key,
            run_id=self.run.pk,
            seq=call.seq,
            call_index=call.index,
            tool=storable_text(call.name)[:200],
            result=storable_text(text),
            is_error=is_error,
        )

    def _call_tool(self, agent: Agent, call: ToolCall) -> ToolEffect:
        """One call, by its tool's effect class (see the module docstring)."""
        name = call.name
        tool = agent.tools_by_name.get(name) if isinstance(name, str) else None
        if tool is None:
            known = ", ".join(sorted(agent.tools_by_name)) or "none"
            shown = storable_text(repr(name), 300)
            return self._effect(call, f"unknown tool {shown}; the tools are: {known}", True)
        try:
            check_depth(call.input)
        except Unstorable as exc:
            return self._effect(call, f"Invalid input for tool {name!r}: the input {exc}", True)
        try:
            tool.validate(call.input)
        except ToolInputError as exc:
            return self._effect(call, str(exc), True)

        if tool.effect is EffectClass.IRREVERSIBLE:
            return self._irreversible(agent, tool, call)
        if tool.effect is not EffectClass.PURE and not self.durably(
            functools.partial(self.store.renew_lease, self.claim), "renewal before a side effect"
        ):
            # Before any side effect: make sure the run is still ours and not cancelled.
            self._fence_failed()
        return self._invoke(agent, tool, call)

    def _invoke(self, agent: Agent, tool: Tool, call: ToolCall) -> ToolEffect:
        """Call the tool; a ``Wait`` it raises parks the run here (``Stop``), or, when what
        it waits for is over already, the call is made again at once with ``woken_by``. A
        failure its ``Retry`` policy names is tried again (with the same idempotency key)
        after the policy's pause, up to its attempts: the model reads what the last attempt
        came to, never the failures before it."""
        woken_by = self._woken_by(call.key)
        attempt = 1
        failures: list[str] = []
        while True:
            try:
                outcome = self._run_tool(agent, tool, call, woken_by, attempt)
            except WaitRaised as raised:
                try:
                    if raised.wait.kind == "callback" and woken_by and "callback" in woken_by:
                        # Its URL is used: a second wait on it would never end (or, once
                        # parked, go on at once with the same body, again and again).
                        raise WaitRefused(
                            "this call received its callback already (a callback URL is "
                            "single-use); a new callback needs a new tool call"
                        )
                    woken_by = self._park_on_wait(raised.wait, tool, call)
                    continue
                except WaitRefused as exc:
                    outcome = CallOutcome(f"{tool.name}: {exc}", True)
            if outcome.retry and self._pause_before_retry(tool, attempt, outcome):
                failures.append(outcome.failure)
                attempt += 1
                continue
            if attempt > 1:
                logger.info(
                    "run %s: tool %s call %d of turn %d: %s after %d attempts (failed before: %s)",
                    self.run.pk,
                    tool.name,
                    call.index,
                    call.seq,
                    "error" if outcome.is_error else "ok",
                    attempt,
                    "; ".join(failures),
                )
            return self._effect(call, outcome.text, outcome.is_error)

    def _pause_before_retry(self, tool: Tool, attempt: int, outcome: CallOutcome) -> bool:
        """The pause of ``tool``'s Retry policy after failed attempt ``attempt``: True when
        the next attempt may start. Nothing is in flight meanwhile (the heartbeat renews the
        lease on its own thread): a cancellation, a lost lease or a draining worker ends the
        pause at once, and no other attempt starts. A call whose rerun is free (pure,
        idempotent) is then left to the next claim, which calls it again (``Stop``); a
        non-idempotent one is over, its last failure the model's news, recorded as any
        completed call is."""
        retry = tool.retry
        assert retry is not None
        try:
            delay = retry.delay(attempt)
        except Exception as exc:  # noqa: BLE001 - the user's backoff function: its failure is logged
            logger.error(
                "run %s: tool %s: no retry: its backoff failed: %s",
                self.run.pk,
                tool.name,
                storable_text(exc, MAX_LOGGED_ERROR_CHARS),
            )
            return False
        logger.warning(
            "run %s: tool %s attempt %d of %d failed (%s); retrying in %.2fs",
            self.run.pk,
            tool.name,
            attempt,
            retry.attempts,
            outcome.failure,
            delay,
        )
        if not self.interrupt.wait_unless_draining(delay):
            if tool.effect is EffectClass.PURE or self.durably(
                functools.partial(self.store.renew_lease, self.claim), "renewal before a retry"
            ):
                return True
            # As before the first attempt: a side effect starts only while the run is ours
            # and not cancelled (a cancel the pause did not hear of in time).
            self._not_retried(tool, attempt, "its fenced lease renewal failed")
            if tool.effect.rerun_is_free:
                self._fence_failed()  # not recorded: whoever holds the run calls it again
            return False
        self._not_retried(
            tool,
            attempt,
            (self.interrupt.reason or "interrupted")
            if self.interrupt.is_set()
            else "the worker drains",
        )
        if tool.effect.rerun_is_free:
            # Hands the run back or stops it: the call is not recorded, the next claim (if
            # any) makes it again.
            self._check_interrupt()
        return False

    def _not_retried(self, tool: Tool, attempt: int, why: str) -> None:
        logger.info(
            "run %s: tool %s not tried again (%s) after %d attempt(s)",
            self.run.pk,
            tool.name,
            why,
            attempt,
        )

    def _woken_by(self, key: str) -> dict[str, Any] | None:
        """What ended the wait of the call with this key, if this claim follows that wake."""
        run = self.run
        if run.wait_key != key or not isinstance(run.woken_by, dict):
            return None
        woken_by = dict(run.woken_by)
        if run.waiting_for == WaitKind.RUNS and "runs" not in woken_by:
            # A timeout: the runs as they are now.
            woken_by["runs"] = self.store.run_outcomes(run.wait_runs or [])
        if run.waiting_for == WaitKind.EVENT and "event" in woken_by and "payload" not in woken_by:
            # The run stores a reference to the event: its payload is stored once, there.
            at = woken_by.get("at")
            woken_by["payload"] = self.store.sent_event_payload(
                str(woken_by["event"]), at if isinstance(at, str) else None
            )
        if run.waiting_for == WaitKind.CALLBACK and "at" in woken_by and "callback" not in woken_by:
            # The run stores when the callback came; its body is stored once, with it.
            received = self.store.received_callback(key)
            woken_by["callback"] = None if received is None else received.body
        return woken_by

    def _park_on_wait(self, wait: waits.Wait, tool: Tool, call: ToolCall) -> dict[str, Any]:
        """Park the run on ``wait`` and stop (raises ``Stop``), or return ``woken_by`` when
        what it waits for is over already (an event sent, children ended, an answer)."""
        spec = wait_spec(wait, call.key)
        self._store_unstored_turn()  # the wait belongs to a call of a committed turn
        self._record_unrecorded()  # the turn's pure calls before it are not run again
        outcome, woken_by = self.store.park_on_wait(self.claim, spec)
        if outcome is Parked.FENCE_FAILED:
            self._fence_failed()
        if outcome is Parked.READY:
            assert woken_by is not None
            logger.info("run %s: %s is over already; %s goes on", self.run.pk, wait, tool.name)
            return woken_by
        logger.info("run %s waits (%s: %s)", self.run.pk, tool.name, wait.describe())
        signals.run_waiting.send(
            sender=AgentRun, run_id=self.run.pk, waiting_for=spec.kind, what=wait.describe()
        )
        if spec.kind == WaitKind.QUESTION:
            question = self.store.question_for_key(call.key)
            if question is not None:
                signals.question_asked.send(sender=AgentQuestion, question=question)
        raise Stop(WAITING)

    def _run_tool(
        self,
        agent: Agent,
        tool: Tool,
        call: ToolCall,
        woken_by: dict[str, Any] | None = None,
        attempt: int = 1,
    ) -> CallOutcome:
        """Call the tool on the slot's caller thread (``async def`` tools: on the event loop),
        bounded by its timeout; whatever it raises (``SystemExit`` included) or returns becomes
        the call's result, but ``Wait`` (``WaitRaised``, for tools that may wait). An
        interrupt walks away from the call and stops the run."""
        timeout = agent.timeout_for(tool, float(app_settings.TOOL_TIMEOUT))
        # A pure call is walked away from on any interrupt. A call with a side effect started
        # behind the fence: a cancellation or a lost lease lets it finish (within its timeout)
        # so that what it did is recorded; only a worker that stops for good abandons it.
        interrupt = (
            self.interrupt if tool.effect is EffectClass.PURE else self.interrupt.narrowed(SHUTDOWN)
        )
        try:
            return self._await_tool(tool, call, interrupt, timeout, woken_by, attempt)
        finally:
            if interrupt is not self.interrupt:
                self.interrupt.drop(interrupt)

    def _await_tool(
        self,
        tool: Tool,
        call: ToolCall,
        interrupt: Interrupt,
        timeout: float,
        woken_by: dict[str, Any] | None = None,
        attempt: int = 1,
    ) -> CallOutcome:
        started = time.monotonic()
        timed_out = False
        error_type: str | None = None  # the span's error.type
        # The tool's Retry policy asks for another attempt after this one's failure.
        retry = False
        failure = ""
        retries_left = tool.retry is not None and attempt < tool.retry.attempts
        try:
            value = self._invoke_once(tool, call, interrupt, timeout, woken_by)
        except waits.Wait as wait:
            if tool.effect is not EffectClass.IRREVERSIBLE:
                raise WaitRaised(wait) from None
            text, is_error = (
                f"{tool.name} raised Wait, but an irreversible tool may not wait: its approval "
                "is its wait",
                True,
            )
        except calls.CallInterrupted:
            logger.warning(
                "run %s: tool %s abandoned (%s)", self.run.pk, tool.name, self.interrupt.reason
            )
            if tool.effect is EffectClass.IRREVERSIBLE:
                raise  # its intent records what became of it (``_irreversible``)
            self._check_interrupt()
            raise
        except calls.CallTimedOut:
            error_type = "timeout"
            timed_out, is_error = True, True
            text = (
                f"{tool.name} timed out after {timeout:g}s and was abandoned; it may still "
                "finish in the background"
            )
            if retries_left and tool.retry is not None and tool.retry.retries_timeouts:
                retry, failure = True, f"timed out after {timeout:g}s"
        except _SlotWorkFailed as failed:
            raise failed.error from None  # the slot's own commit failed, not the tool
        # The tool's failure is the model's news: catch everything (logged just below).
        except BaseException as exc:  # noqa: BLE001
            error_type = type(exc).__qualname__
            if retries_left and tool.retry is not None and tool.retry.retries(exc):
                # Logged with the attempt by ``_pause_before_retry``; its traceback here.
                retry = True
                failure = f"{type(exc).__name__}: {storable_text(exc, MAX_LOGGED_FAILURE_CHARS)}"
                self._log_traceback(tool, exc)
            else:
                self._log_tool_error(tool, exc)
            text, is_error = effects.tool_error_text(tool.name, exc), True
        else:
            text, is_error = effects.format_result(value)
        outcome = "retried" if retry else "timeout" if timed_out else "error" if is_error else "ok"
        observers.tool_call(
            tool.name, tool.effect, outcome, time.monotonic() - started, error_type, attempt
        )
        logger.info(
            "run %s tool %s (%s) call %d of turn %d%s: %s in %.1f ms",
            self.run.pk,
            tool.name,
            tool.effect,
            call.index,
            call.seq,
            f", attempt {attempt}" if tool.retry is not None else "",
            "timed out" if timed_out else "error" if is_error else "ok",
            (time.monotonic() - started) * 1000,
        )
        return CallOutcome(text, is_error, timed_out, retry, failure)

    def _invoke_once(
        self,
        tool: Tool,
        call: ToolCall,
        interrupt: Interrupt,
        timeout: float,
        woken_by: dict[str, Any] | None,
    ) -> Any:
        """One attempt of the call: the tool invoked on a caller thread (or the tools' event
        loop) that the worker can walk away from, with what tool code may ask of its call."""
        # What spawn_run inside the tool needs: set on the thread (or task) that runs it.
        context = waits.CallContext(
            self.run.pk, self.run.depth, call.key, call.seq, metadata=self.run.metadata
        )
        # The run, for a tool with a parameter annotated RunContext (built only for those).
        run_context = (
            None
            if tool.run_context_parameter is None
            else self.run.run_context(attempt=self.claim.attempt, tool=tool.name)
        )
        sent = call.receiver_key

        def run_call(abort: threading.Event) -> Any:
            with waits.calling(context):
                return tool.invoke(
                    call.input,
                    idempotency_key=sent,
                    woken_by=woken_by,
                    run_context=run_context,
                    validated=True,
                )

        async def call_async() -> Any:
            with waits.calling(context):
                return await tool.invoke(
                    call.input,
                    idempotency_key=sent,
                    woken_by=woken_by,
                    run_context=run_context,
                    validated=True,
                )

        if tool.is_async:
            return calls.await_abortable(call_async, interrupt, timeout=timeout)
        meanwhile, meanwhile_after = (
            self._while_a_pure_call_runs() if tool.effect is EffectClass.PURE else (None, None)
        )
        return calls.run_abortable(
            run_call,
            interrupt,
            timeout=timeout,
            permits=calls.tool_permits(),
            meanwhile=None if meanwhile is None else _slot_work(meanwhile),
            meanwhile_after=meanwhile_after,
        )

    def _log_tool_error(self, tool: Tool, exc: BaseException) -> None:
        """A tool's exception is the model's news, not the worker's failure: one line at
        WARNING (which run, which tool, what it raised), its traceback at DEBUG for whoever
        debugs the tool. A tool that fails on every call would otherwise fill the log with
        tracebacks of the same line."""
        logger.warning(
            "run %s: tool %s raised %s: %s",
            self.run.pk,
            tool.name,
            type(exc).__name__,
            storable_text(exc, MAX_LOGGED_ERROR_CHARS),
        )
        self._log_traceback(tool, exc)

    def _log_traceback(self, tool: Tool, exc: BaseException) -> None:
        logger.debug(
            "run %s: tool %s raised %s; its traceback:",
            self.run.pk,
            tool.name,
            type(exc).__name__,
            exc_info=exc,
        )

    def _irreversible(self, agent: Agent, tool: Tool, call: ToolCall) -> ToolEffect:
        """The call runs only once a person approved its intent, and at most once: behind a
        fenced ``executing`` mark, so that a crash leaves its outcome for a person to say."""
        intent = self.store.intent_for_key(call.key)
        if intent is None:
            intent = ToolIntent(
                run_id=self.run.pk,
                seq=call.seq,
                call_index=call.index,
                tool=tool.name,
                input=call.input,
                key=call.key,
            )
            self._park(intent, f"{tool.name} waits for approval", new=True)
        while True:
            status = intent.status
            if status in (IntentStatus.PENDING, IntentStatus.UNKNOWN):
                self._park(intent, f"intent {intent.pk} for {tool.name} is {status}")
            elif status == IntentStatus.EXECUTING:
                # A worker died while this ran, before its outcome was recorded. Only a person
                # can say whether it happened; never run it again blindly.
                self._park(
                    intent,
                    f"intent {intent.pk} for {tool.name}: outcome unknown after a crash",
                    unknown=True,
                )
            elif status == IntentStatus.REJECTED:
                who = intent.decided_by.get_username() if intent.decided_by else "a person"
                reason = intent.reason or "no reason given"
                return self._effect(
                    call, f"{tool.name} was not run: rejected by {who}: {reason}", True
                )
            elif status == IntentStatus.DONE:
                # Its call completed (or a person said it happened) after this claim read the
                # ledger: the effect is recorded by now, in the intent's transaction.
                recorded = self.store.recorded_effects(self.run.pk, call.seq).get(call.key)
                if recorded is None:
                    self._dead(f"intent {intent.pk} is done but no effect is recorded for it")
                return recorded
            elif status == IntentStatus.APPROVED:
                if not self.store.start_intent_execution(self.claim, intent):
                    self.store.reload_intent(intent)
                    if intent.status == IntentStatus.APPROVED:
                        self._fence_failed()  # cancelled or taken over: the call never starts
                    continue
                try:
                    outcome = self._run_tool(agent, tool, call)
                except calls.CallInterrupted:
                    # Only a worker that stops for good abandons this call (its interrupt is
                    # narrowed to a shutdown): it may still be running, and its outcome is for a
                    # person to say. Said now, with what really happened, rather than by the
                    # next claim as if this worker had crashed.
                    detail = self.interrupt.detail or "the worker shut down while it ran"
                    self._park(
                        intent,
                        f"intent {intent.pk} for {tool.name}: outcome unknown: {detail}",
                        unknown=True,
                    )
                    continue
                if outcome.timed_out:
                    # Abandoned while it may still be running: whether it happened is now for
                    # a person to say, exactly as after a crash.
                    timeout = agent.timeout_for(tool, float(app_settings.TOOL_TIMEOUT))
                    self._park(
                        intent,
                        f"intent {intent.pk} for {tool.name}: timed out after {timeout:g}s and "
                        "was abandoned, outcome unknown",
                        unknown=True,
                    )
                    continue
                effect = self._effect(call, outcome.text, outcome.is_error)
                self.store.complete_intent(intent, effect)
                return effect
            self.store.reload_intent(intent)

    def _park(
        self, intent: ToolIntent, why: str, *, new: bool = False, unknown: bool = False
    ) -> None:
        """Park the run on ``intent`` and stop (raises ``Stop``), or return when the intent
        was decided meanwhile (``intent`` is re-read: the caller goes on with it). ``unknown``:
        the intent was left executing; it becomes unknown, with ``why`` as its reason."""
        self._record_unrecorded()  # the turn's pure calls before it are not run again
        outcome = self.store.park_on_intent(
            self.claim, intent, new=new, unknown_because=why if unknown else None
        )
        if outcome is Parked.FENCE_FAILED:
            self._fence_failed()
        if outcome is Parked.DECIDED:
            self.store.reload_intent(intent)
            return
        logger.info("run %s waits for a person: %s", self.run.pk, why)
        signals.intent_waiting.send(sender=ToolIntent, intent=intent)
        raise Stop(WAITING)
