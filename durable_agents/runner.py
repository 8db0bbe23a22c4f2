"""The state machine of one run, top to bottom.

A worker that holds a claim calls ``advance_run``. It rebuilds the conversation from the step
log, then repeats until the run is parked or over:

    last step is the task or a tool_result -> call the model, commit the turn   (a step)
    last step is a model turn asking for tools -> run each call by its effect class,
                                                  commit the results             (a step)
    last step is a final model turn            -> the run succeeded

Each step is committed by ``Store.append_step``, only while this worker's fence holds, and in
seq order: a model turn before any of its calls runs; tool results before the next model call
goes out, except that results of pure and idempotent calls are committed while that call is in
flight (OVERLAP_SAFE_COMMITS; always before the turn it returns). Nothing is kept in memory that
the log does not also hold, so a new worker that claims the run after a crash continues at the
first uncommitted step.
"""

from __future__ import annotations

import enum
import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from django.db import DatabaseError, DataError
from django.utils import timezone

from durable_agents import calls, effects, llm, prometheus, signals, telemetry, waits
from durable_agents.agents import Agent, AgentNotFound, registry
from durable_agents.conf import app_settings
from durable_agents.deepjson import loads_deep
from durable_agents.history import (
    assistant_message,
    load_log,
    load_steps,
    task_log,
    user_message,
)
from durable_agents.interrupt import Interrupt
from durable_agents.logging import bind_run
from durable_agents.models import (
    AgentQuestion,
    AgentRun,
    IntentStatus,
    RunStatus,
    StepKind,
    ToolEffect,
    ToolIntent,
    WaitKind,
)
from durable_agents.store import MAX_REASON_CHARS, Claim, NextClaim, Parked, Store, current
from durable_agents.store.base import StepWrite, WaitRefused, WaitSpec
from durable_agents.text import Unstorable, check_depth, json_text, storable_text
from durable_agents.tools import EffectClass, Tool, ToolInputError

logger = logging.getLogger("durable_agents.runner")


class Disposition(enum.StrEnum):
    """What became of a run when ``advance_run`` returned."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    DEAD = "dead"
    WAITING = "waiting"  # parked (a person, a timer, an event, child runs); no worker holds it
    RELEASED = "released"  # handed back, claimable again (shutdown, transient model errors)
    CANCELLED = "cancelled"
    LOST = "lost"  # another worker holds it now
    ERROR = "error"  # an unexpected error in this app (the worker handed the run back)


SUCCEEDED = Disposition.SUCCEEDED
FAILED = Disposition.FAILED
DEAD = Disposition.DEAD
WAITING = Disposition.WAITING
RELEASED = Disposition.RELEASED
CANCELLED = Disposition.CANCELLED
LOST = Disposition.LOST


@dataclass
class _Step:
    seq: int
    kind: str
    message: Any  # the parsed payload
    # Committed by this claim just now: no call of this turn can have run yet, so the
    # effect ledger need not be read for it.
    fresh: bool = False


@dataclass(frozen=True)
class _ToolOutcome:
    text: str
    is_error: bool
    timed_out: bool = False


class _WaitRaised(Exception):
    """The tool raised ``Wait``: carried out of the call to the park."""

    def __init__(self, wait: waits.Wait) -> None:
        super().__init__(wait.describe())
        self.wait = wait


class _Stop(Exception):
    """Unwinds the step loop with the run's disposition."""

    def __init__(self, disposition: Disposition):
        self.disposition = disposition


def advance_run(
    claim: Claim,
    interrupt: Interrupt | None = None,
    drain: threading.Event | None = None,
    then_claim: NextClaim | None = None,
    store: Store | None = None,
) -> Disposition:
    """Advance one claimed run until it is parked or over; returns its disposition.

    ``interrupt`` aborts what is in flight (cancelled, lease lost, shutdown now); ``drain``
    only stops before the next step (a worker shutting down gracefully). With ``then_claim``,
    the statement that commits the run's last turn also claims the worker's next run.
    ``store``: where the run lives (default: ``store.current()``, chosen now for the whole
    claim); unit tests pass an ``InMemoryStore``."""
    advancer = RunAdvancer(claim, interrupt or Interrupt(), drain, then_claim, store)
    with bind_run(claim.run_id), telemetry.agent_span(claim) as span:
        disposition = advancer.advance()
        span.finish(disposition)
        return disposition


# The interrupt reason of a worker that stops for good (second signal, or its grace is over).
SHUTDOWN = "shutdown"

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


class RunAdvancer:
    def __init__(
        self,
        claim: Claim,
        interrupt: Interrupt,
        drain: threading.Event | None = None,
        then_claim: NextClaim | None = None,
        store: Store | None = None,
    ) -> None:
        # Every read and write of the run goes through this store.
        self.store: Store = store or current()
        self.claim = claim
        self.run: AgentRun = claim.run
        self.interrupt = interrupt
        self.drain = drain
        self.then_claim = then_claim

    # -- entry -----------------------------------------------------------------------------

    def advance(self) -> Disposition:
        try:
            return self._loop()
        except _Stop as stop:
            return stop.disposition

    def _loop(self) -> NoReturn:
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
        agent = self._pinned_agent()
        params = agent.request_for(run.model)

        if self.claim.task_payload is not None:
            log = task_log(self.claim.task_payload)
        else:
            log = load_log(run.pk, store=self.store)
        if log.last is None or log.first_kind != StepKind.TASK:
            self._dead("the step log has no task step at seq 0")
        # The conversation, rebuilt from the log verbatim; kept in memory (and appended to)
        # while this claim lasts, so the log is read once per claim, not once per step.
        conversation = log.conversation
        turns = log.turns
        self.tokens = run.tokens_used
        last = _Step(log.last.seq, log.last.kind, loads_deep(log.last.payload))
        del log

        # Tool results whose commit goes out with the next model call (see the tool branch).
        pending: Callable[[], None] | None = None
        while True:
            if pending is None:
                self._check_interrupt()
            if (
                last.kind != StepKind.MODEL_TURN
                or last.message.get("stop_reason") in CONTINUE_STOP_REASONS
            ):
                if pending is None:
                    self._check_budgets(agent, turns)
                turn = self._call_model(agent, params, conversation.json(), pending)
                pending = None
                turn_tokens = tokens_of(turn.message)
                self.tokens += turn_tokens
                seq = last.seq + 1
                if turn.message.get("stop_reason") in FINAL_STOP_REASONS:
                    # The last turn: commit it and end the run in one statement (which may
                    # also claim the worker's next run).
                    result = text_of(turn.message)
                    self._commit(
                        StepWrite(
                            seq,
                            StepKind.MODEL_TURN,
                            turn.body,
                            turn.request_id,
                            finish=(SUCCEEDED, result),
                            content_span=turn.content_span,
                            tokens=turn_tokens,
                        ),
                        ms=turn.elapsed_ms,
                        then_claim=self.then_claim,
                    )
                    self._finished(SUCCEEDED)
                self._commit(
                    StepWrite(
                        seq,
                        StepKind.MODEL_TURN,
                        turn.body,
                        turn.request_id,
                        content_span=turn.content_span,
                        tokens=turn_tokens,
                    ),
                    ms=turn.elapsed_ms,
                )
                conversation.append(assistant_message(turn.body, turn.content_span))
                last = _Step(seq, StepKind.MODEL_TURN, turn.message, fresh=True)
                turns += 1
                continue

            stop_reason = last.message.get("stop_reason")
            if stop_reason == "tool_use":
                last_turn = last
                started = time.monotonic()
                results, final_effect = self._dispatch(agent, last)
                seq = last.seq + 1
                # Escapes instead of raw lone surrogates (a hostile tool_use id): the text is
                # storable and decodes to exactly what the model sent.
                payload = json_text(results)
                commit = functools.partial(
                    self._commit,
                    StepWrite(
                        seq,
                        StepKind.TOOL_RESULT,
                        payload,
                        effects=[final_effect] if final_effect else [],
                    ),
                    ms=(time.monotonic() - started) * 1000,
                    tool=storable_text(
                        ",".join(
                            str(b.get("name"))
                            for b in last.message["content"]
                            if b.get("type") == "tool_use"
                        ),
                        200,
                    ),
                )
                conversation.append(user_message(payload))
                last = _Step(seq, StepKind.TOOL_RESULT, results)
                if (
                    app_settings.OVERLAP_SAFE_COMMITS
                    and self._rerun_is_free(agent, last_turn)
                    and self._between_steps_reason(agent, turns) is None
                ):
                    # Only pure and idempotent calls, and nothing stops the run before its
                    # next model call: that call goes out while this step commits. Its turn
                    # is committed only after this step (the fence checks the seq), and a
                    # failed commit abandons it. A crash leaves the log as it would without
                    # the overlap; at worst these calls run again, which costs nothing.
                    # Results of non-idempotent and irreversible calls are always committed
                    # before the next call goes out.
                    pending = commit
                else:
                    commit()
            elif stop_reason in FINAL_STOP_REASONS:  # committed by an earlier claim
                self._finish(SUCCEEDED, result=text_of(last.message))
            else:
                self._finish(FAILED, error=f"the model stopped with stop_reason={stop_reason!r}")

    # -- pinning ---------------------------------------------------------------------------

    def _pinned_agent(self) -> Agent:
        run = self.run
        try:
            agent = registry.get(run.agent, run.prompt_version)
        except AgentNotFound as exc:
            # Most likely a rolling deploy: the run was started by newer code than this
            # worker's. Another worker may have the version; after MAX_ATTEMPTS such claims
            # the run goes to the dead letter with this reason.
            reason = (
                f"prompt version {run.prompt_version!r} of agent {run.agent!r} is not deployed "
                f"on worker {self.claim.owner} ({exc}); deploy it again or cancel the run"
            )
            logger.warning("run %s handed back: %s", run.pk, reason)
            self.store.release_lease(
                self.claim, error=reason, hold_seconds=app_settings.UNDEPLOYED_RETRY_SECONDS
            )
            raise _Stop(RELEASED) from exc
        current = agent.fingerprint(run.model)
        if current != run.fingerprint:
            self._dead(
                f"prompt drift: agent {run.agent}@{run.prompt_version} on this worker has "
                f"fingerprint {current[:12]}, the run was started with {run.fingerprint[:12]}; "
                "its system prompt, tools or parameters changed without a new version, and "
                "resuming would change the history the model signed"
            )
        return agent

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
        pending: Callable[[], None] | None = None,
    ) -> llm.ModelTurn:
        on_text = None
        if agent.on_text is not None:
            callback, run_id = agent.on_text, self.run.pk

            def on_text(text: str) -> None:
                callback(run_id, text)

        try:
            return llm.create_turn(
                params,
                messages,
                interrupt=self.interrupt,
                stream=agent.stream,
                on_text=on_text,
                meanwhile=pending,
            )
        except llm.PermanentModelError as exc:
            prometheus.observe_model_call("permanent_error")
            self._dead(exc.message + (f" (request id {exc.request_id})" if exc.request_id else ""))
        except llm.ModelCallInterrupted:
            self._check_interrupt()
            raise
        except llm.TransientModelError as exc:
            prometheus.observe_model_call("transient_error")
            logger.warning(
                "run %s: model unavailable, handing the run back: %s", self.run.pk, exc.message
            )
            self.store.release_lease(self.claim, error=f"model call failed: {exc.message}")
            raise _Stop(RELEASED) from exc

    # -- tools -----------------------------------------------------------------------------

    def _dispatch(
        self, agent: Agent, turn: _Step
    ) -> tuple[list[dict[str, Any]], ToolEffect | None]:
        """Run the calls of one turn in order. Every completed call is recorded at once, but
        the last, which is committed together with the tool_result step."""
        calls = [b for b in turn.message.get("content") or [] if b.get("type") == "tool_use"]
        recorded = {} if turn.fresh else self.store.recorded_effects(self.run.pk, turn.seq)
        results: list[dict[str, Any]] = []
        final_effect: ToolEffect | None = None
        for index, call in enumerate(calls):
            name = call.get("name", "")
            tool_input = call.get("input")
            key = effects.idempotency_key(self.run.pk, turn.seq, index, name, tool_input)
            effect = recorded.get(key)
            if effect is None:
                with telemetry.tool_span(agent, call, key) as span:
                    effect = self._call_tool(agent, turn.seq, index, name, tool_input, key)
                    span.result(effect.result, effect.is_error)
                if index < len(calls) - 1:
                    self.store.record_effect(effect)
                else:
                    final_effect = effect
            results.append(result_block(call.get("id", ""), effect))
        return results, final_effect

    def _effect(
        self, seq: int, index: int, name: Any, key: str, text: str, is_error: bool
    ) -> ToolEffect:
        # Names and texts come from the model and from tool code: made storable here, the one
        # place every recorded call passes through.
        return ToolEffect(
            key=key,
            run_id=self.run.pk,
            seq=seq,
            call_index=index,
            tool=storable_text(name)[:200],
            result=storable_text(text),
            is_error=is_error,
        )

    def _call_tool(
        self, agent: Agent, seq: int, index: int, name: Any, tool_input: Any, key: str
    ) -> ToolEffect:
        tool = agent.tools_by_name.get(name) if isinstance(name, str) else None
        if tool is None:
            known = ", ".join(sorted(agent.tools_by_name)) or "none"
            shown = storable_text(repr(name), 300)
            return self._effect(
                seq, index, name, key, f"unknown tool {shown}; the tools are: {known}", True
            )
        try:
            check_depth(tool_input)
        except Unstorable as exc:
            message = f"Invalid input for tool {name!r}: the input {exc}"
            return self._effect(seq, index, name, key, message, True)
        try:
            tool.validate(tool_input)
        except ToolInputError as exc:
            return self._effect(seq, index, name, key, str(exc), True)

        if tool.effect is EffectClass.IRREVERSIBLE:
            return self._irreversible(agent, tool, seq, index, tool_input, key)
        if tool.effect is not EffectClass.PURE and not self.store.renew_lease(self.claim):
            # Before any side effect: make sure the run is still ours and not cancelled.
            self._fence_failed()
        return self._invoke(agent, tool, seq, index, tool_input, key)

    def _invoke(
        self, agent: Agent, tool: Tool, seq: int, index: int, tool_input: Any, key: str
    ) -> ToolEffect:
        """Call the tool; a ``Wait`` it raises parks the run here (``_Stop``), or, when what
        it waits for is over already, the call is made again at once with ``woken_by``."""
        woken_by = self._woken_by(key)
        while True:
            try:
                outcome = self._run_tool(agent, tool, seq, index, tool_input, key, woken_by)
            except _WaitRaised as raised:
                try:
                    woken_by = self._park_on_wait(raised.wait, tool, key)
                    continue
                except WaitRefused as exc:
                    outcome = _ToolOutcome(f"{tool.name}: {exc}", True)
            return self._effect(seq, index, tool.name, key, outcome.text, outcome.is_error)

    def _woken_by(self, key: str) -> dict[str, Any] | None:
        """What ended the wait of the call with this key, if this claim follows that wake."""
        run = self.run
        if run.wait_key != key or not isinstance(run.woken_by, dict):
            return None
        woken_by = dict(run.woken_by)
        if run.waiting_for == WaitKind.RUNS and "runs" not in woken_by:
            # A timeout: the runs as they are now.
            woken_by["runs"] = self.store.run_outcomes(run.wait_runs or [])
        return woken_by

    def _park_on_wait(self, wait: waits.Wait, tool: Tool, key: str) -> dict[str, Any]:
        """Park the run on ``wait`` and stop (raises ``_Stop``), or return ``woken_by`` when
        what it waits for is over already (an event sent, children ended, an answer)."""
        if isinstance(wait, waits.AskPerson):
            spec = WaitSpec(WaitKind.QUESTION, key, question=wait.question)
        elif wait.kind == "timer":
            spec = WaitSpec(WaitKind.TIMER, key, seconds=wait.seconds, until=wait.until)
        elif wait.kind == "event":
            spec = WaitSpec(WaitKind.EVENT, key, seconds=wait.timeout, event=wait.event)
        else:
            spec = WaitSpec(WaitKind.RUNS, key, seconds=wait.timeout, runs=wait.runs)
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
            question = self.store.question_for_key(key)
            if question is not None:
                signals.question_asked.send(sender=AgentQuestion, question=question)
        raise _Stop(WAITING)

    def _run_tool(
        self,
        agent: Agent,
        tool: Tool,
        seq: int,
        index: int,
        tool_input: Any,
        key: str,
        woken_by: dict[str, Any] | None = None,
    ) -> _ToolOutcome:
        """Call the tool on the slot's caller thread (``async def`` tools: on the event loop),
        bounded by its timeout; whatever it raises (``SystemExit`` included) or returns becomes
        the call's result, but ``Wait`` (``_WaitRaised``, for tools that may wait). An
        interrupt walks away from the call and stops the run."""
        timeout = agent.timeout_for(tool, float(app_settings.TOOL_TIMEOUT))
        # A pure call is walked away from on any interrupt. A call with a side effect started
        # behind the fence: a cancellation or a lost lease lets it finish (within its timeout)
        # so that what it did is recorded; only a worker that stops for good abandons it.
        interrupt = (
            self.interrupt if tool.effect is EffectClass.PURE else self.interrupt.narrowed(SHUTDOWN)
        )
        try:
            return self._await_tool(tool, tool_input, key, interrupt, timeout, index, seq, woken_by)
        finally:
            if interrupt is not self.interrupt:
                self.interrupt.drop(interrupt)

    def _await_tool(
        self,
        tool: Tool,
        tool_input: Any,
        key: str,
        interrupt: Interrupt,
        timeout: float,
        index: int,
        seq: int,
        woken_by: dict[str, Any] | None = None,
    ) -> _ToolOutcome:
        started = time.monotonic()
        timed_out = False
        # What spawn_run inside the tool needs: set on the thread (or task) that runs it.
        context = waits.CallContext(self.run.pk, self.run.depth, key)

        def call(abort: threading.Event) -> Any:
            with waits.calling(context):
                return tool.invoke(tool_input, idempotency_key=key, woken_by=woken_by)

        async def call_async() -> Any:
            with waits.calling(context):
                return await tool.invoke(tool_input, idempotency_key=key, woken_by=woken_by)

        try:
            if tool.is_async:
                value = calls.await_abortable(call_async, interrupt, timeout=timeout)
            else:
                value = calls.run_abortable(
                    call, interrupt, timeout=timeout, permits=calls.tool_permits()
                )
        except waits.Wait as wait:
            if tool.effect is not EffectClass.IRREVERSIBLE:
                raise _WaitRaised(wait) from None
            text, is_error = (
                f"{tool.name} raised Wait, but an irreversible tool may not wait: its approval "
                "is its wait",
                True,
            )
        except calls.CallInterrupted:
            logger.warning(
                "run %s: tool %s abandoned (%s)", self.run.pk, tool.name, self.interrupt.reason
            )
            self._check_interrupt()
            raise
        except calls.CallTimedOut:
            telemetry.tool_failed("timeout")
            timed_out, is_error = True, True
            text = (
                f"{tool.name} timed out after {timeout:g}s and was abandoned; it may still "
                "finish in the background"
            )
        except BaseException as exc:  # noqa: BLE001 - the tool's failure is the model's news
            telemetry.tool_failed(type(exc).__qualname__)
            logger.warning(
                "tool %s raised %s: %s",
                tool.name,
                type(exc).__name__,
                storable_text(exc, 2000),
                exc_info=True,
            )
            text, is_error = effects.tool_error_text(tool.name, exc), True
        else:
            text, is_error = effects.format_result(value)
        outcome = "timeout" if timed_out else "error" if is_error else "ok"
        prometheus.observe_tool(tool.effect, outcome, time.monotonic() - started)
        logger.info(
            "run %s tool %s (%s) call %d of turn %d: %s in %.1f ms",
            self.run.pk,
            tool.name,
            tool.effect,
            index,
            seq,
            "timed out" if timed_out else "error" if is_error else "ok",
            (time.monotonic() - started) * 1000,
        )
        return _ToolOutcome(text, is_error, timed_out)

    def _irreversible(
        self, agent: Agent, tool: Tool, seq: int, index: int, tool_input: Any, key: str
    ) -> ToolEffect:
        intent = self.store.intent_for_key(key)
        if intent is None:
            intent = ToolIntent(
                run_id=self.run.pk,
                seq=seq,
                call_index=index,
                tool=tool.name,
                input=tool_input,
                key=key,
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
                    crashed=True,
                )
            elif status == IntentStatus.REJECTED:
                who = intent.decided_by.get_username() if intent.decided_by else "a person"
                reason = intent.reason or "no reason given"
                return self._effect(
                    seq,
                    index,
                    tool.name,
                    key,
                    f"{tool.name} was not run: rejected by {who}: {reason}",
                    True,
                )
            elif status == IntentStatus.DONE:
                # Its call completed (or a person said it happened) after this claim read the
                # ledger: the effect is recorded by now, in the intent's transaction.
                recorded = self.store.recorded_effects(self.run.pk, seq).get(key)
                if recorded is None:
                    self._dead(f"intent {intent.pk} is done but no effect is recorded for it")
                return recorded
            elif status == IntentStatus.APPROVED:
                if not self.store.start_intent_execution(self.claim, intent):
                    self.store.reload_intent(intent)
                    if intent.status == IntentStatus.APPROVED:
                        self._fence_failed()  # cancelled or taken over: the call never starts
                    continue
                outcome = self._run_tool(agent, tool, seq, index, tool_input, key)
                if outcome.timed_out:
                    # Abandoned while it may still be running: whether it happened is now for
                    # a person to say, exactly as after a crash.
                    self._park(
                        intent,
                        f"intent {intent.pk} for {tool.name}: timed out, outcome unknown",
                        crashed=True,
                    )
                    continue
                effect = self._effect(seq, index, tool.name, key, outcome.text, outcome.is_error)
                self.store.complete_intent(intent, effect)
                return effect
            self.store.reload_intent(intent)

    def _park(
        self, intent: ToolIntent, why: str, *, new: bool = False, crashed: bool = False
    ) -> None:
        """Park the run on ``intent`` and stop (raises ``_Stop``), or return when the intent
        was decided meanwhile (``intent`` is re-read: the caller goes on with it)."""
        outcome = self.store.park_on_intent(self.claim, intent, new=new, crashed=crashed)
        if outcome is Parked.FENCE_FAILED:
            self._fence_failed()
        if outcome is Parked.DECIDED:
            self.store.reload_intent(intent)
            return
        logger.info("run %s waits for a person: %s", self.run.pk, why)
        signals.intent_waiting.send(sender=ToolIntent, intent=intent)
        raise _Stop(WAITING)

    # -- commits and endings ---------------------------------------------------------------

    def _commit(
        self,
        step: StepWrite,
        *,
        ms: float = 0.0,
        tool: str | None = None,
        then_claim: NextClaim | None = None,
    ) -> None:
        """Commit ``step`` through ``Store.append_step`` (every step of the run is committed
        here), or stop: the fence failed, or the database refused what was to be stored."""
        seq, kind = step.seq, step.kind
        started = time.monotonic()
        try:
            committed = self.store.append_step(self.claim, step, then_claim)
        except DataError as exc:
            # The database refuses what was to be stored (the statement wrote nothing). Trying
            # again would pay for the same answer and fail the same way: end the run now.
            self._dead(
                f"step {seq} ({kind}) could not be stored: {storable_text(exc, 500)}; "
                "requeue the run to try the step again"
            )
        if not committed:
            self._fence_failed()
        prometheus.observe_commit(time.monotonic() - started, kind)
        logger.info(
            "run %s seq %d %s%s committed (%.1f ms)",
            self.run.pk,
            seq,
            kind,
            f" tool={tool}" if tool else "",
            ms,
        )

    def _check_interrupt(self) -> None:
        if self.drain is not None and self.drain.is_set() and not self.interrupt.is_set():
            # The worker is draining: the last step is committed; hand the run back now.
            self.store.release_lease(self.claim, count_claim=False)
            logger.info("run %s handed back: the worker is shutting down", self.run.pk)
            raise _Stop(RELEASED)
        if not self.interrupt.is_set():
            return
        if self.interrupt.reason == SHUTDOWN:
            self.store.release_lease(self.claim, count_claim=False)
            raise _Stop(RELEASED)
        self._fence_failed()

    def _fence_failed(self) -> NoReturn:
        status = self.store.current_status(self.run.pk)
        if status == RunStatus.CANCELLED:
            logger.info("run %s was cancelled; stopping without committing", self.run.pk)
            raise _Stop(CANCELLED)
        logger.warning("run %s: lease lost (status now %s); stopping", self.run.pk, status)
        raise _Stop(LOST)

    def _finish(
        self, disposition: Disposition, *, result: str | None = None, error: str = ""
    ) -> NoReturn:
        if not self.store.finish_run(self.claim, disposition, result=result, error=error):
            self._fence_failed()
        self._finished(disposition, error)

    def _finished(self, disposition: Disposition, error: str = "") -> NoReturn:
        log = logger.info if disposition == SUCCEEDED else logger.warning
        log("run %s %s%s", self.run.pk, disposition, f": {error}" if error else "")
        signals.run_finished.send(sender=AgentRun, run_id=self.run.pk, status=disposition)
        raise _Stop(disposition)

    def _dead(self, reason: str) -> NoReturn:
        reason = storable_text(reason, MAX_REASON_CHARS)
        try:
            ended = self.store.finish_run(self.claim, RunStatus.DEAD, error=reason)
        except DatabaseError as exc:
            # Whatever the reason holds, the run must end: a poison run that cannot even be
            # dead-lettered would be claimed again forever.
            logger.error("run %s: storing the dead-letter reason failed: %s", self.run.pk, exc)
            reason = (
                f"dead-lettered; the reason could not be stored ({type(exc).__name__}); "
                "see the worker's log for this run id"
            )
            ended = self.store.finish_run(self.claim, RunStatus.DEAD, error=reason)
        if not ended:
            self._fence_failed()
        logger.error("run %s dead-lettered: %s", self.run.pk, reason)
        signals.run_dead_lettered.send(sender=AgentRun, run_id=self.run.pk, reason=reason)
        raise _Stop(DEAD)

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
