"""The waits of ``InMemoryStore`` (timers, events, questions, child runs): park, wake and the
reads they need, in the store's dicts under its lock, with the semantics of the SQL stores'.
Plain functions taking the store, which calls them (``InMemoryStore.park_on_wait`` is
``park_on_wait(self, ...)``): no mixin. What they use of the store is ``WaitHost``, so this
module does not import the store that imports it.

    park_on_wait         running -> waiting on a timer, an event, child runs, a question or
                         a callback
                         (fenced: ``InMemoryStore._fenced``); or ready at once
    send_event           the event sent once; its waiters -> pending
    answer_question      the question answered once; its run -> pending
    receive_callback     a call's callback body kept once; its waiting run -> pending
    spawn_run            a child run, once per (parent, key), within the limits
    wake_parent          the parent -> pending once all it waits on ended
"""

from __future__ import annotations

import copy
import datetime
import itertools
import threading
from collections.abc import Sequence
from typing import Any, Protocol, TypeVar

from django.db.models import Model

from durable_agents._internal.text import storable_text
from durable_agents.models import (
    ENDED_STATUSES,
    FINISHED_STATUSES,
    AgentCallback,
    AgentEvent,
    AgentQuestion,
    AgentRun,
    QuestionStatus,
    RunStatus,
    WaitKind,
)
from durable_agents.store.base import (
    AuthUser,
    CallbackReceipt,
    Claim,
    Parked,
    RunId,
    WaitSpec,
    refuse_spawn,
    refuse_strangers,
    run_outcome,
    tree_root,
)
from durable_agents.store.transitions import mark_transitioned

M = TypeVar("M", bound=Model)


class WaitHost(Protocol):
    """What the waits use of ``InMemoryStore``: its dicts, its lock and its helpers."""

    lock: threading.RLock
    runs: dict[RunId, AgentRun]
    events: dict[str, AgentEvent]
    questions: dict[str, AgentQuestion]
    callbacks: dict[str, AgentCallback]
    effects: dict[str, Any]
    _row_ids: itertools.count[int]

    def now(self) -> datetime.datetime: ...
    def create_run(self, run: AgentRun, task_payload: str) -> AgentRun: ...
    def _stored(self, run_id: RunId | str) -> AgentRun | None: ...
    def _fenced(self, claim: Claim) -> AgentRun | None: ...
    def _expiry(self, seconds: float) -> datetime.datetime: ...
    def _park(self, run: AgentRun, kind: str, key: str, **wait: Any) -> None: ...


def _copy(instance: M) -> M:
    """A copy of a stored instance (its cached relations too, e.g. ``decided_by``)."""
    return copy.copy(instance)


# -- waits ---------------------------------------------------------------------------


def park_on_wait(
    store: WaitHost, claim: Claim, spec: WaitSpec
) -> tuple[Parked, dict[str, Any] | None]:
    with store.lock:
        run = store._fenced(claim)
        if run is None:
            return Parked.FENCE_FAILED, None
        wait: dict[str, Any] = {}
        if spec.seconds is not None:
            wait["wake_at"] = store._expiry(spec.seconds)
        if spec.kind == WaitKind.TIMER and spec.until is not None:
            wait["wake_at"] = spec.until
        elif spec.kind == WaitKind.EVENT:
            assert spec.event is not None
            event = _event(store, spec.event)
            if event.is_sent:
                return Parked.READY, event.woken_by()
            wait["wait_event"] = spec.event
        elif spec.kind == WaitKind.RUNS:
            strangers = [
                r
                for r in spec.runs
                if (found := _by_text(store, r)) is None or found.parent_id != claim.run_id
            ]
            refuse_strangers(strangers)
            outcomes = run_outcomes(store, spec.runs)
            if all(o["status"] in ENDED_STATUSES for o in outcomes.values()):
                return Parked.READY, {"runs": outcomes}
            wait["wait_runs"] = list(spec.runs)
        elif spec.kind == WaitKind.QUESTION:
            question = store.questions.get(spec.key)
            if question is None:
                question = AgentQuestion(
                    pk=next(store._row_ids),
                    run_id=claim.run_id,
                    key=spec.key,
                    question=spec.question or "",
                    created_at=store.now(),
                )
                store.questions[spec.key] = question
            if question.status == QuestionStatus.ANSWERED:
                return Parked.READY, question.woken_by()
        elif spec.kind == WaitKind.CALLBACK:
            received = store.callbacks.get(spec.key)
            if received is not None:
                return Parked.READY, received.woken_by()
        store._park(run, spec.kind, spec.key, **wait)
        return Parked.PARKED, None


def _event(store: WaitHost, name: str) -> AgentEvent:
    event = store.events.get(name)
    if event is None:
        event = store.events[name] = AgentEvent(
            pk=next(store._row_ids), name=name, created_at=store.now()
        )
    return event


def _by_text(store: WaitHost, run_id: str) -> AgentRun | None:
    for run in store.runs.values():
        if str(run.pk) == run_id:
            return run
    return None


def send_event(
    store: WaitHost, name: str, payload: Any, user: AuthUser = None
) -> tuple[AgentEvent, int]:
    with store.lock:
        event = _event(store, name)
        if event.is_sent:
            return _copy(event), 0
        event.payload = copy.deepcopy(payload)
        event.sent_at = store.now()
        event.sent_by = user
        woken = 0
        for run in store.runs.values():
            if (
                run.status == RunStatus.WAITING
                and run.waiting_for == WaitKind.EVENT
                and run.wait_event == name
            ):
                run.status = RunStatus.PENDING
                run.woken_by = event.wake_reference()
                run.wake_at = None
                run.updated_at = store.now()
                woken += 1
        return mark_transitioned(_copy(event)), woken


def answer_question(
    store: WaitHost,
    run_id: RunId | str,
    user: AuthUser,
    text: str,
    question_id: int | None = None,
) -> AgentQuestion | None:
    with store.lock:
        asked = [
            q
            for q in store.questions.values()
            if q.run_id == run_id and (question_id is None or q.pk == question_id)
        ]
        if not asked:
            return None
        question = max(asked, key=lambda q: (q.created_at, q.pk))
        if question.status == QuestionStatus.OPEN:
            question.status = QuestionStatus.ANSWERED
            question.answer = storable_text(text)
            question.answered_by = user
            question.answered_at = store.now()
            run = store._stored(run_id)
            if (
                run is not None
                and run.status == RunStatus.WAITING
                and run.waiting_for == WaitKind.QUESTION
                and run.wait_key == question.key
            ):
                run.status = RunStatus.PENDING
                run.woken_by = question.woken_by()
                run.updated_at = store.now()
            return mark_transitioned(_copy(question))
        return _copy(question)


def receive_callback(store: WaitHost, run_id: RunId, key: str, body: Any) -> CallbackReceipt:
    with store.lock:
        run = store.runs.get(run_id)
        if run is None or run.status in FINISHED_STATUSES:
            return CallbackReceipt.OVER
        if key in store.callbacks:
            return CallbackReceipt.USED
        if key in store.effects:
            return CallbackReceipt.OVER
        received = store.callbacks[key] = AgentCallback(
            pk=next(store._row_ids),
            run_id=run_id,
            key=key,
            body=copy.deepcopy(body),
            received_at=store.now(),
        )
        if not (
            run.status == RunStatus.WAITING
            and run.waiting_for == WaitKind.CALLBACK
            and run.wait_key == key
        ):
            return CallbackReceipt.KEPT
        run.status = RunStatus.PENDING
        run.woken_by = received.wake_reference()
        run.wake_at = None
        run.updated_at = store.now()
        return CallbackReceipt.WOKEN


def received_callback(store: WaitHost, key: str) -> AgentCallback | None:
    with store.lock:
        received = store.callbacks.get(key)
        return None if received is None else _copy(received)


def spawn_run(
    store: WaitHost,
    child: AgentRun,
    task_payload: str,
    max_children: int,
    max_tree_runs: int | None = None,
) -> tuple[AgentRun, bool]:
    with store.lock:
        siblings = [r for r in store.runs.values() if r.parent_id == child.parent_id]
        for sibling in siblings:
            if sibling.spawn_key == child.spawn_key:
                return _copy(sibling), False
        parent = None if child.parent_id is None else store.runs.get(child.parent_id)
        status = None if parent is None else parent.status
        root_id = None if parent is None else tree_root(parent)
        tree = 1 + sum(1 for r in store.runs.values() if r.root_id == root_id)
        refuse_spawn(status, len(siblings), max_children, tree, max_tree_runs)
        assert parent is not None  # refuse_spawn raised otherwise
        child.root_id = root_id
        child.priority = parent.priority  # a child of an urgent run is urgent
        child.concurrency_key = parent.concurrency_key  # and counts toward its key
        return store.create_run(child, task_payload), True


def wake_parent(store: WaitHost, parent_id: RunId) -> bool:
    with store.lock:
        parent = store.runs.get(parent_id)
        if (
            parent is None
            or parent.status != RunStatus.WAITING
            or parent.waiting_for != WaitKind.RUNS
        ):
            return False
        outcomes = run_outcomes(store, parent.wait_runs or [])
        if any(o["status"] not in ENDED_STATUSES for o in outcomes.values()):
            return False
        parent.status = RunStatus.PENDING
        parent.woken_by = {"runs": outcomes}
        parent.wake_at = None
        parent.updated_at = store.now()
        return True


def stranded_parents(store: WaitHost, limit: int) -> list[RunId]:
    with store.lock:
        waiting = [
            r
            for r in store.runs.values()
            if r.status == RunStatus.WAITING and r.waiting_for == WaitKind.RUNS
        ]
        return [r.pk for r in sorted(waiting, key=lambda r: r.created_at)[:limit]]


def sent_event(store: WaitHost, name: str) -> AgentEvent | None:
    with store.lock:
        event = store.events.get(name)
        return None if event is None or not event.is_sent else _copy(event)


def question_for_key(store: WaitHost, key: str) -> AgentQuestion | None:
    with store.lock:
        question = store.questions.get(key)
        return None if question is None else _copy(question)


def run_outcomes(store: WaitHost, run_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
    with store.lock:
        outcomes = {}
        for run_id in run_ids:
            run = _by_text(store, str(run_id))
            if run is not None:
                outcomes[str(run_id)] = run_outcome(run)
        return outcomes
