"""Helpers for testing your own agents deterministically, offline.

``run_agent`` starts a run and drives it to its end in the calling thread (so it works inside
pytest-django's transactional ``db`` fixture), with the offline scripted model playing a plan
you write with ``plan(...)``; ``drive`` does the same for a run that exists. They play every
part that a worker and the people around it would, as the test says: they decide intents,
deliver events, answer questions, move a fake clock past timers and timeouts, and drive child
runs. They return a ``RunResult`` to assert on: the tool calls with their idempotency keys and
results, the transcript, the final status, what the run still waits for, its children.

Time. A timer is due when the run's ``wake_at`` is past on the *database* clock, which a test
cannot move. ``FakeClock`` moves the deadlines instead: ``advance(seconds)`` takes ``seconds``
off the ``wake_at`` of every waiting run, which is what the clock going forward would do to
them. When nothing else can move, ``drive`` advances its clock to the earliest timer or timeout
of the runs it drives; it never sleeps. Tool code that reads the wall clock itself (say
``Wait(until=timezone.now() + ...)``) is not moved.

``drive`` never loops forever: a run that waits for something the test did not provide (an
event not in ``events``, a question not in ``answers``, ``intents="wait"``,
``timers="wait"``, ``children="wait"``) is left waiting, and ``RunResult.waits_for`` says
what for.

Tool code runs on the test's own thread (``calls.inline_calls``), so it sees the test's
transaction: tools that use the database (``spawn_run`` does) work under pytest-django's
plain ``db`` fixture. Tool timeouts are not enforced there: a call runs to its end.

``replay(run_id)`` plays a recorded run's tool calls to today's tool code (no model call) and
reports what changed; it lives in ``durable_agents.forks.replay``.

The pytest fixtures around it live in ``durable_agents.pytest_plugin``.
"""

from __future__ import annotations

import collections
import datetime
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from django.contrib.auth import get_user_model
from django.db.models import F
from django.db.models.functions import Now
from django.test import override_settings
from django.utils import timezone

from durable_agents import api, llm, store
from durable_agents._internal import calls
from durable_agents._internal.interrupt import Interrupt
from durable_agents.batches import Submitter, poll_due
from durable_agents.conf import app_settings
from durable_agents.engine.history import Conversation
from durable_agents.engine.runner import advance_run
from durable_agents.forks.replay import ReplayError, ReplayReport, replay
from durable_agents.models import (
    CLAIMABLE_STATUSES,
    AgentQuestion,
    AgentRun,
    AgentStep,
    IntentStatus,
    QuestionStatus,
    RunStatus,
    StepKind,
    ToolEffect,
    ToolIntent,
    WaitKind,
    steps_of,
)

__all__ = [
    "KEEP_WAITING",
    "AgentRunner",
    "FakeClock",
    "ReplayError",
    "ReplayReport",
    "RunResult",
    "ToolCall",
    "describe_wait",
    "drive",
    "offline_model",
    "plan",
    "replay",
    "run_agent",
]

Call = tuple[str, Any]


def plan(*turns: Call | Sequence[Call], task: str = "Follow the plan.") -> str:
    """A task text for the offline model: one turn per argument, each a ``(tool, input)``
    call or a list of calls made in the same turn. After the plan the model ends its run."""
    lines = [task]
    for turn in turns:
        calls = [turn] if isinstance(turn, tuple) else list(turn)
        lines.append(
            "@" + " && ".join(f"{name} {json.dumps(arguments)}" for name, arguments in calls)
        )
    return "\n".join(lines)


@dataclass(frozen=True)
class ToolCall:
    turn_seq: int
    index: int
    name: str
    input: Any
    key: str | None
    result: str | None
    is_error: bool


@dataclass
class RunResult:
    run: AgentRun
    steps: list[AgentStep]
    effects: list[ToolEffect]
    intents: list[ToolIntent]
    questions: list[AgentQuestion] = field(default_factory=list)
    # The runs this run spawned (``spawn_run``), each a RunResult, in the order they started.
    children: list[RunResult] = field(default_factory=list)
    # What a waiting run waits for, in words, and why the driver left it so ("" otherwise).
    waits_for: str = ""

    @property
    def status(self) -> str:
        return self.run.status

    @property
    def waiting_for(self) -> str:
        """The kind of wait of a waiting run (``WaitKind``: "timer", "event", "runs",
        "question", "intent"); "" when it does not wait."""
        return self.run.waiting_for if self.run.status == RunStatus.WAITING else ""

    @property
    def woken_by(self) -> dict[str, Any] | None:
        """What ended the run's last wait (the ``woken_by`` its waiting tool received)."""
        woken_by: dict[str, Any] | None = self.run.woken_by
        if isinstance(woken_by, dict) and "event" in woken_by and "payload" not in woken_by:
            # The run refers to the event; its payload is stored once, on the event's row.
            event = store.current().sent_event(str(woken_by["event"]))
            woken_by = {**woken_by, "payload": None if event is None else event.payload}
        return woken_by

    @property
    def result(self) -> str | None:
        return self.run.result

    @property
    def output(self) -> Any:
        """The validated final answer of an agent with an ``output_schema`` (a JSON value),
        else None."""
        return self.run.output

    @property
    def error(self) -> str:
        return self.run.error

    def messages(self) -> list[dict[str, Any]]:
        conversation = Conversation()
        for step in self.steps:
            conversation.append_step(step.kind, step.payload, step.content_span)
        return conversation.messages()

    def tool_calls(self) -> list[ToolCall]:
        """Every call the model made, in order, with the recorded outcome."""
        from durable_agents.engine.effects import idempotency_key

        by_key = {e.key: e for e in self.effects}
        calls = []
        for step in self.steps:
            if step.kind != StepKind.MODEL_TURN:
                continue
            uses = [b for b in step.data()["content"] if b.get("type") == "tool_use"]
            for index, block in enumerate(uses):
                key = idempotency_key(self.run.pk, step.seq, index, block["name"], block["input"])
                effect = by_key.get(key)
                calls.append(
                    ToolCall(
                        turn_seq=step.seq,
                        index=index,
                        name=block["name"],
                        input=block["input"],
                        key=key,
                        result=effect.result if effect else None,
                        is_error=effect.is_error if effect else False,
                    )
                )
        return calls

    def tool_names(self) -> list[str]:
        return [c.name for c in self.tool_calls()]

    def transcript(self) -> str:
        """A readable, stable rendering for snapshot-style assertions."""
        lines = []
        for step in self.steps:
            data = step.data()
            if step.kind == StepKind.TASK:
                lines.append(f"{step.seq} task: {data}")
            elif step.kind == StepKind.MODEL_TURN:
                for block in data["content"]:
                    if block.get("type") == "text":
                        lines.append(f"{step.seq} assistant: {block['text']}")
                    elif block.get("type") == "tool_use":
                        lines.append(
                            f"{step.seq} call {block['name']} {json.dumps(block['input'])}"
                        )
            else:
                for block in data:
                    flag = " (error)" if block.get("is_error") else ""
                    lines.append(f"{step.seq} result{flag}: {block['content']}")
        return "\n".join(lines)


Decision = str | Callable[[ToolIntent], str]
Events = Mapping[str, Any] | Callable[[str], Any]
Answers = Mapping[str, str] | Callable[[str], Any]


class _KeepWaiting:
    def __repr__(self) -> str:
        return "KEEP_WAITING"


# What an ``events`` or ``answers`` function returns to leave the wait as it is.
KEEP_WAITING: Any = _KeepWaiting()

# The lease owner of the driver's claims (the ``worker`` on the steps it commits).
OWNER = "durable-agents-test"


def _operator() -> Any:
    """The person the driver plays: a superuser, so it holds the permissions to decide
    intents (``approve_toolintent``) and answer questions (``answer_question``)."""
    user_model = get_user_model()
    user, _ = user_model.objects.get_or_create(
        username="durable-agents-test-operator", defaults={"is_staff": True, "is_superuser": True}
    )
    if not user.is_superuser:
        user.is_superuser = True
        user.save(update_fields=["is_superuser"])
    return user


class FakeClock:
    """The time a test's runs see, moved by the test instead of waited for.

    The database clock decides when a timer is due (``wake_at <= now()``) and a test cannot
    move it, so the clock moves the deadlines: ``advance(seconds)`` takes ``seconds`` off the
    ``wake_at`` of every waiting run. ``offset`` is how far it went in all.

    Schedules keep their slots (a slot's time is in its run's start key): ``advance`` fires
    the slots that fall due up to the moved time instead, as the workers would have (only the
    newest missed slot of a schedule without ``catch_up``), and ``fired`` lists the runs they
    started, oldest first, for the test to drive."""

    def __init__(self) -> None:
        self.offset = 0.0
        self.fired: list[AgentRun] = []

    def now(self) -> datetime.datetime:
        """The time as this clock tells it: the real time plus ``offset``."""
        return timezone.now() + datetime.timedelta(seconds=self.offset)

    def advance(
        self,
        seconds: float = 0.0,
        *,
        minutes: float = 0.0,
        hours: float = 0.0,
        days: float = 0.0,
    ) -> int:
        """Move the clock forward by the sum of the arguments (``advance(30)``,
        ``advance(hours=1)``); returns the number of waiting runs with a timer or a timeout
        (each now that much closer). A run whose ``wake_at`` is past is claimed by the next
        ``drive`` (or worker). The schedule slots that fall due on the way are fired (their
        runs appended to ``fired``) without sleeping."""
        for name, value in (
            ("seconds", seconds),
            ("minutes", minutes),
            ("hours", hours),
            ("days", days),
        ):
            if not isinstance(value, int | float) or isinstance(value, bool) or not value >= 0:
                raise ValueError(f"a clock only goes forward, not by {name}={value!r}")
        seconds = seconds + 60 * minutes + 3600 * hours + 86400 * days
        moved = AgentRun.objects.filter(status=RunStatus.WAITING, wake_at__isnull=False).update(
            wake_at=F("wake_at") - datetime.timedelta(seconds=seconds)
        )
        self.offset += seconds
        self.fire_schedules()
        return moved

    def fire_schedules(self) -> list[AgentRun]:
        """Fire every schedule slot due by this clock's time (``advance`` does); returns the
        runs started, also appended to ``fired``."""
        from durable_agents.schedules.firing import fire_due

        now = self.now()
        started: list[AgentRun] = []
        while True:
            fired = fire_due(now)
            started.extend(fired.runs)
            # Nothing taken (a slot whose run could not start stays due): do not spin on it.
            if fired.next_in != 0.0 or not fired.schedules:
                break
        self.fired.extend(started)
        return started

    def advance_to_next(self, runs: Iterable[Any] | None = None) -> float | None:
        """Advance to the earliest ``wake_at`` of the waiting runs (of ``runs``, ids or runs,
        if given), a millisecond past it; returns the seconds advanced, None if none has a
        timer or a timeout."""
        waiting = AgentRun.objects.filter(status=RunStatus.WAITING, wake_at__isnull=False)
        if runs is not None:
            waiting = waiting.filter(pk__in=[getattr(r, "pk", r) for r in runs])
        row = (
            waiting.annotate(db_now=Now()).order_by("wake_at").values_list("wake_at", "db_now")
        ).first()
        if row is None:
            return None
        wake_at, db_now = row
        if wake_at is None:  # never: the filter leaves it out
            return None
        seconds = max(0.0, (wake_at - db_now).total_seconds()) + 0.001
        self.advance(seconds)
        return seconds


def drive(
    run: AgentRun | RunResult,
    *,
    intents: Decision = "approve",
    events: Events | None = None,
    answers: Answers | None = None,
    timers: str = "advance",
    children: str = "drive",
    clock: FakeClock | None = None,
    max_claims: int = 100,
) -> RunResult:
    """Advance ``run`` (and the runs it spawns) in this thread until it ends, or waits for
    something this call was not told how to provide; it never sleeps.

    - ``intents``: "approve", "reject", "wait" or a function of the intent returning one of
      them; for an intent whose outcome is unknown, "approve" resolves it as not having
      happened.
    - ``events``: what to send (``api.send_event``) when a run waits on an event: a dict of
      name to payload, or a function of the name returning the payload (or ``KEEP_WAITING``
      to send nothing for that name); ``events=KEEP_WAITING`` sends nothing at all. A name
      it does not know leaves the run waiting.
    - ``answers``: how to answer a question (``ask_person``), through ``api.answer_question``
      as a user with the permission: a dict of question text to answer, or a function of the
      question text returning the answer (None or ``KEEP_WAITING``: no answer).
    - ``timers``: "advance" moves ``clock`` to the earliest timer or timeout when nothing else
      can move; "wait" leaves runs waiting on them.
    - ``children``: "drive" claims and advances the runs it spawns (and theirs) with the same
      options, so ``Wait(runs=...)`` ends; "wait" leaves them pending.
    - ``clock``: the ``FakeClock`` to move (a new one if not given).
    - ``max_claims``: claims of one run after which it raises ``RuntimeError`` (a run that
      never ends).
    """
    if isinstance(run, RunResult):
        run = run.run
    if timers not in ("advance", "wait"):
        raise ValueError(f'timers= is "advance" or "wait", not {timers!r}')
    if children not in ("drive", "wait"):
        raise ValueError(f'children= is "drive" or "wait", not {children!r}')
    driver = _Driver(
        run,
        intents=intents,
        events=events,
        answers=answers,
        timers=timers,
        children=children,
        clock=clock or FakeClock(),
    )
    # Tool code runs on this thread, in the test's transaction (a worker runs it on a thread
    # of its own): a test under pytest-django's ``db`` fixture sees what its tools wrote.
    with calls.inline_calls():
        return driver.drive(max_claims)


# Waits that only time ends: a timer, and a debounced start's quiet window.
_TIMED = (WaitKind.TIMER, WaitKind.DEBOUNCE)


class _Driver:
    """One ``drive``: the run, its descendants, and why each one it left waiting waits."""

    def __init__(
        self,
        root: AgentRun,
        *,
        intents: Decision,
        events: Events | None,
        answers: Answers | None,
        timers: str,
        children: str,
        clock: FakeClock,
    ) -> None:
        self.root = root
        self.intents = intents
        self.events = events
        self.answers = answers
        self.timers = timers
        self.children = children
        self.clock = clock
        self.notes: dict[Any, str] = {}

    def drive(self, max_claims: int) -> RunResult:
        claims: collections.Counter[Any] = collections.Counter()
        unclaimed = 0
        # Each turn of the loop claims a run, or gives a waiting run what it waits for (a
        # decision, an event, an answer, time), or returns. Something given is claimed at the
        # next turn, so the bound on turns without a claim is only a safety net.
        while unclaimed < 100:
            tree = self._tree()
            claimed = self._claim_one(tree)
            if claimed is not None:
                claims[claimed.pk] += 1
                if claims[claimed.pk] > max_claims:
                    raise RuntimeError(f"run {claimed.pk} did not end within {max_claims} claims")
                unclaimed = 0
                continue
            unclaimed += 1
            self.notes = {}
            if self._resolve(tree):
                continue
            if self.timers == "advance" and self.clock.advance_to_next(tree) is not None:
                continue
            return _result(self.root, self.notes)
        raise RuntimeError(
            f"run {self.root.pk}: nothing could be claimed after {unclaimed} wake-ups; it "
            f"waits for {describe_wait(self._reload(self.root)) or 'nothing'}"
        )

    def _tree(self) -> list[AgentRun]:
        """The run and, unless ``children="wait"``, every run it spawned, parents first."""
        runs = [self._reload(self.root)]
        if self.children == "wait":
            return runs
        level = [runs[0].pk]
        while level:
            found = list(AgentRun.objects.filter(parent_id__in=level).order_by("created_at"))
            runs += found
            level = [r.pk for r in found]
        return runs

    @staticmethod
    def _reload(run: AgentRun) -> AgentRun:
        run.refresh_from_db()
        return run

    def _claim_one(self, tree: list[AgentRun]) -> AgentRun | None:
        """Claim the first run that a worker could take now and advance it until it waits
        or ends. A waiting run with a timer or a timeout is tried too: the claim takes it
        only once its ``wake_at`` is past."""
        for run in tree:
            due = run.status == RunStatus.WAITING and run.wake_at is not None
            if run.status not in CLAIMABLE_STATUSES and not due:
                continue
            claim = store.current().claim_run(run.pk, OWNER, app_settings.LEASE_SECONDS)
            if claim is None:
                if due:
                    continue  # not due yet
                raise RuntimeError(f"run {run.pk} is leased by another worker")
            advance_run(claim, Interrupt())
            return run
        return None

    def _resolve(self, tree: list[AgentRun]) -> bool:
        """Give each waiting run what the test said it gets; True if anything changed."""
        changed = False
        for run in tree:
            if run.status != RunStatus.WAITING:
                continue
            if run.waiting_for == WaitKind.EVENT:
                changed |= self._send_event(run)
            elif run.waiting_for == WaitKind.QUESTION:
                changed |= self._answer(run)
            elif run.waiting_for in _TIMED and self.timers == "wait":
                self.notes[run.pk] = 'timers="wait"'
            elif run.waiting_for == WaitKind.BATCH:
                changed |= self._answer_batches()
            elif run.waiting_for == WaitKind.RUNS:
                if self.children == "wait":
                    self.notes[run.pk] = 'children="wait"'
            elif run.waiting_for not in _TIMED:  # an intent
                changed |= self._decide_intents(run)
        return changed

    @staticmethod
    def _answer_batches() -> bool:
        """Submit every request waiting for a batch, whatever the window, and poll every
        batch at once: the offline model ends a batch at its first retrieve."""
        submitted = Submitter(OWNER).submit_due(force=True)
        polled = poll_due(OWNER, force=True)
        return bool(
            submitted.batches or polled.committed or polled.resent or polled.failed or polled.direct
        )

    def _decide_intents(self, run: AgentRun) -> bool:
        operator = None
        changed = False
        waiting = ToolIntent.objects.filter(
            run=run, status__in=(IntentStatus.PENDING, IntentStatus.UNKNOWN)
        ).order_by("pk")
        for intent in waiting:
            decision = self.intents(intent) if callable(self.intents) else self.intents
            if decision == "wait":
                self.notes[run.pk] = 'intents="wait"'
                continue
            operator = operator or _operator()
            if intent.status == IntentStatus.UNKNOWN:
                api.resolve_intent(intent.pk, user=operator, happened=decision != "approve")
            elif decision == "approve":
                api.approve_intent(intent.pk, user=operator)
            elif decision == "reject":
                api.reject_intent(intent.pk, user=operator, reason="rejected by the test")
            else:
                raise ValueError(f"unknown decision {decision!r}")
            changed = True
        return changed

    def _send_event(self, run: AgentRun) -> bool:
        name = run.wait_event or ""
        if self.events is None or self.events is KEEP_WAITING:
            payload = KEEP_WAITING
        elif callable(self.events):
            payload = self.events(name)
        else:
            payload = self.events.get(name, KEEP_WAITING)
        if payload is KEEP_WAITING:
            self.notes[run.pk] = "no event of that name in events="
            return False
        api.send_event(name, payload)
        return True

    def _answer(self, run: AgentRun) -> bool:
        question = AgentQuestion.objects.filter(run=run, status=QuestionStatus.OPEN).first()
        if question is None:
            return False
        if self.answers is None or self.answers is KEEP_WAITING:
            answer = None
        elif callable(self.answers):
            answer = self.answers(question.question)
        else:
            answer = self.answers.get(question.question)
        if answer is None or answer is KEEP_WAITING:
            self.notes[run.pk] = "no answer to it in answers="
            return False
        api.answer_question(run.pk, answer, user=_operator())
        return True


def describe_wait(run: AgentRun, notes: Mapping[Any, str] | None = None) -> str:
    """What a waiting run waits for, in words ("" when it does not wait); ``notes`` adds, per
    run id, why the driver left it waiting."""
    if run.status != RunStatus.WAITING:
        return ""
    kind = run.waiting_for
    timeout = f", or its timeout at {_when(run.wake_at)}" if run.wake_at else ""
    if kind == WaitKind.TIMER:
        text = f"a timer due at {_when(run.wake_at)}"
    elif kind == WaitKind.DEBOUNCE:
        text = f"a quiet window: a debounced start due at {_when(run.wake_at)}"
    elif kind == WaitKind.EVENT:
        text = f"event {run.wait_event!r}{timeout}"
    elif kind == WaitKind.QUESTION:
        question = AgentQuestion.objects.filter(run=run, status=QuestionStatus.OPEN).first()
        text = f"an answer to {question.question!r}" if question else "an answer"
    elif kind == WaitKind.WORKER:
        text = (
            f"a worker that defines {run.agent}@{run.prompt_version} with the run's definition"
            f" (fingerprint {run.fingerprint[:12]}): {run.error}"
        )
    elif kind == WaitKind.RUNS:
        ids = [str(r) for r in run.wait_runs or []]
        by_id = {str(r.pk): r for r in AgentRun.objects.filter(pk__in=ids)}
        parts = []
        for run_id in ids:
            child = by_id.get(run_id)
            if child is None:
                parts.append(f"{run_id} (gone)")
                continue
            inner = describe_wait(child, notes)
            parts.append(f"{run_id} ({child.status}{': waits for ' + inner if inner else ''})")
        text = f"{len(ids)} child run(s) to end{timeout}: {', '.join(parts)}"
    else:
        intents = ToolIntent.objects.filter(
            run=run, status__in=(IntentStatus.PENDING, IntentStatus.UNKNOWN)
        ).order_by("pk")
        text = (
            "; ".join(
                f"a person to resolve intent #{i.pk} ({i.tool}), whose outcome is unknown"
                if i.status == IntentStatus.UNKNOWN
                else f"a decision on intent #{i.pk} ({i.tool})"
                for i in intents
            )
            or "a person"
        )
    note = (notes or {}).get(run.pk)
    return f"{text} [{note}]" if note else text


def _when(moment: datetime.datetime | None) -> str:
    return moment.isoformat(timespec="seconds") if moment else "?"


def _result(run: AgentRun, notes: Mapping[Any, str] | None = None) -> RunResult:
    run.refresh_from_db()
    return RunResult(
        run=run,
        steps=list(steps_of(run.pk).order_by("seq")),
        effects=list(ToolEffect.objects.filter(run=run).order_by("seq", "call_index")),
        intents=list(ToolIntent.objects.filter(run=run).order_by("pk")),
        questions=list(AgentQuestion.objects.filter(run=run).order_by("pk")),
        children=[
            _result(child, notes)
            for child in AgentRun.objects.filter(parent=run).order_by("created_at", "spawn_key")
        ],
        waits_for=describe_wait(run, notes),
    )


def run_agent(
    agent: str,
    task: str,
    *,
    version: str | None = None,
    model: str | None = None,
    offline: bool = True,
    metadata: dict[str, Any] | None = None,
    **options: Any,
) -> RunResult:
    """Start a run of ``agent`` (with its ``metadata``, if given) and drive it to its end with
    the offline scripted model; ``options`` are those of ``drive`` (``intents``, ``events``,
    ``answers``, ``timers``, ``children``, ``clock``, ``max_claims``)."""
    run = api.start_run(agent, task, version=version, model=model, metadata=metadata)
    if not offline:
        return drive(run, **options)
    with offline_model():
        return drive(run, **options)


class AgentRunner:
    """``run_agent`` and ``drive`` sharing one clock: what the ``agent_runner`` fixture is.

    ``runner(agent, task, **options)`` starts and drives a run; ``runner.drive(run_or_result,
    **options)`` drives one further, e.g. after the test sent an event itself. ``offline``
    forces the offline model around each call (the fixture forces it for the whole test)."""

    def __init__(self, clock: FakeClock | None = None, *, offline: bool = True) -> None:
        self.clock = clock or FakeClock()
        self.offline = offline

    def __call__(self, agent: str, task: str, **options: Any) -> RunResult:
        options.setdefault("clock", self.clock)
        return run_agent(agent, task, offline=self.offline, **options)

    def drive(self, run: AgentRun | RunResult, **options: Any) -> RunResult:
        options.setdefault("clock", self.clock)
        if not self.offline:
            return drive(run, **options)
        with offline_model():
            return drive(run, **options)


class offline_model(override_settings):  # lower case: used like override_settings
    """Force the offline scripted model (and a fresh client) inside a block or a test."""

    def __init__(self) -> None:
        from django.conf import settings

        current = dict(getattr(settings, "DURABLE_AGENTS", None) or {})
        super().__init__(
            DURABLE_AGENTS={
                **current,
                "OFFLINE": True,
                "CLIENT_FACTORY": "durable_agents.llm.default_client",
            }
        )

    def enable(self) -> None:
        super().enable()
        llm.reset_clients()

    def disable(self) -> None:
        super().disable()
        llm.reset_clients()
