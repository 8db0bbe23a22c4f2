"""The waits of ``InMemoryStore`` (timers, events, questions, child runs): park, wake and the
reads they need, in dicts under the store's lock, with the semantics of the SQL stores'.
``InMemoryStore`` inherits them; this class only declares what it uses of the store."""

from __future__ import annotations

import abc
import copy
import datetime
import threading
import uuid
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

from django.db.models import Model

from durable_agents.models import (
    ENDED_STATUSES,
    AgentEvent,
    AgentQuestion,
    AgentRun,
    QuestionStatus,
    RunStatus,
    WaitKind,
)
from durable_agents.store.base import (
    AuthUser,
    Claim,
    Parked,
    RunId,
    Store,
    WaitSpec,
    refuse_spawn,
    refuse_strangers,
    run_outcome,
    tree_root,
)
from durable_agents.store.transitions import mark_transitioned
from durable_agents.text import storable_text

M = TypeVar("M", bound=Model)


def _copy(instance: M) -> M:
    """A copy of a stored instance (its cached relations too, e.g. ``decided_by``)."""
    return copy.copy(instance)


class InMemoryWaits(Store):
    """Parking and waking runs in memory; mixed into ``InMemoryStore``."""

    lock: threading.RLock
    runs: dict[RunId, AgentRun]
    events: dict[str, AgentEvent]
    questions: dict[str, AgentQuestion]
    _row_ids: Iterator[int]

    @abc.abstractmethod
    def _fenced(self, claim: Claim) -> AgentRun | None: ...

    @abc.abstractmethod
    def _expiry(self, seconds: float) -> datetime.datetime: ...

    @abc.abstractmethod
    def _park(self, run: AgentRun, kind: str, key: str, **wait: Any) -> None: ...

    # -- waits ---------------------------------------------------------------------------

    def park_on_wait(self, claim: Claim, spec: WaitSpec) -> tuple[Parked, dict[str, Any] | None]:
        with self.lock:
            run = self._fenced(claim)
            if run is None:
                return Parked.FENCE_FAILED, None
            wait: dict[str, Any] = {}
            if spec.seconds is not None:
                wait["wake_at"] = self._expiry(spec.seconds)
            if spec.kind == WaitKind.TIMER and spec.until is not None:
                wait["wake_at"] = spec.until
            elif spec.kind == WaitKind.EVENT:
                assert spec.event is not None
                event = self._event(spec.event)
                if event.is_sent:
                    return Parked.READY, event.woken_by()
                wait["wait_event"] = spec.event
            elif spec.kind == WaitKind.RUNS:
                strangers = [
                    r
                    for r in spec.runs
                    if (found := self._by_text(r)) is None or found.parent_id != claim.run_id
                ]
                refuse_strangers(strangers)
                outcomes = self.run_outcomes(spec.runs)
                if all(o["status"] in ENDED_STATUSES for o in outcomes.values()):
                    return Parked.READY, {"runs": outcomes}
                wait["wait_runs"] = list(spec.runs)
            elif spec.kind == WaitKind.QUESTION:
                question = self.questions.get(spec.key)
                if question is None:
                    question = AgentQuestion(
                        pk=next(self._row_ids),
                        run_id=claim.run_id,
                        key=spec.key,
                        question=spec.question or "",
                        created_at=self.now(),
                    )
                    self.questions[spec.key] = question
                if question.status == QuestionStatus.ANSWERED:
                    return Parked.READY, question.woken_by()
            self._park(run, spec.kind, spec.key, **wait)
            return Parked.PARKED, None

    def _event(self, name: str) -> AgentEvent:
        event = self.events.get(name)
        if event is None:
            event = self.events[name] = AgentEvent(
                pk=next(self._row_ids), name=name, created_at=self.now()
            )
        return event

    def _stored(self, run_id: RunId | str) -> AgentRun | None:
        """The run by its id. Runs are kept by UUID: the text of an id finds none here (the
        database stores read it as the id)."""
        return self.runs.get(run_id) if isinstance(run_id, uuid.UUID) else None

    def _by_text(self, run_id: str) -> AgentRun | None:
        for run in self.runs.values():
            if str(run.pk) == run_id:
                return run
        return None

    def send_event(self, name: str, payload: Any, user: AuthUser = None) -> tuple[AgentEvent, int]:
        with self.lock:
            event = self._event(name)
            if event.is_sent:
                return _copy(event), 0
            event.payload = copy.deepcopy(payload)
            event.sent_at = self.now()
            event.sent_by = user
            woken = 0
            for run in self.runs.values():
                if (
                    run.status == RunStatus.WAITING
                    and run.waiting_for == WaitKind.EVENT
                    and run.wait_event == name
                ):
                    run.status = RunStatus.PENDING
                    run.woken_by = event.wake_reference()
                    run.wake_at = None
                    run.updated_at = self.now()
                    woken += 1
            return mark_transitioned(_copy(event)), woken

    def answer_question(
        self, run_id: RunId | str, user: AuthUser, text: str, question_id: int | None = None
    ) -> AgentQuestion | None:
        with self.lock:
            asked = [
                q
                for q in self.questions.values()
                if q.run_id == run_id and (question_id is None or q.pk == question_id)
            ]
            if not asked:
                return None
            question = max(asked, key=lambda q: (q.created_at, q.pk))
            if question.status == QuestionStatus.OPEN:
                question.status = QuestionStatus.ANSWERED
                question.answer = storable_text(text)
                question.answered_by = user
                question.answered_at = self.now()
                run = self._stored(run_id)
                if (
                    run is not None
                    and run.status == RunStatus.WAITING
                    and run.waiting_for == WaitKind.QUESTION
                    and run.wait_key == question.key
                ):
                    run.status = RunStatus.PENDING
                    run.woken_by = question.woken_by()
                    run.updated_at = self.now()
                return mark_transitioned(_copy(question))
            return _copy(question)

    def spawn_run(
        self,
        child: AgentRun,
        task_payload: str,
        max_children: int,
        max_tree_runs: int | None = None,
    ) -> tuple[AgentRun, bool]:
        with self.lock:
            siblings = [r for r in self.runs.values() if r.parent_id == child.parent_id]
            for sibling in siblings:
                if sibling.spawn_key == child.spawn_key:
                    return _copy(sibling), False
            parent = None if child.parent_id is None else self.runs.get(child.parent_id)
            status = None if parent is None else parent.status
            root_id = None if parent is None else tree_root(parent)
            tree = 1 + sum(1 for r in self.runs.values() if r.root_id == root_id)
            refuse_spawn(status, len(siblings), max_children, tree, max_tree_runs)
            assert parent is not None  # refuse_spawn raised otherwise
            child.root_id = root_id
            child.priority = parent.priority  # a child of an urgent run is urgent
            child.concurrency_key = parent.concurrency_key  # and counts toward its key
            return self.create_run(child, task_payload), True

    def wake_parent(self, parent_id: RunId) -> bool:
        with self.lock:
            parent = self.runs.get(parent_id)
            if (
                parent is None
                or parent.status != RunStatus.WAITING
                or parent.waiting_for != WaitKind.RUNS
            ):
                return False
            outcomes = self.run_outcomes(parent.wait_runs or [])
            if any(o["status"] not in ENDED_STATUSES for o in outcomes.values()):
                return False
            parent.status = RunStatus.PENDING
            parent.woken_by = {"runs": outcomes}
            parent.wake_at = None
            parent.updated_at = self.now()
            return True

    def stranded_parents(self, limit: int) -> list[RunId]:
        with self.lock:
            waiting = [
                r
                for r in self.runs.values()
                if r.status == RunStatus.WAITING and r.waiting_for == WaitKind.RUNS
            ]
            return [r.pk for r in sorted(waiting, key=lambda r: r.created_at)[:limit]]

    def sent_event(self, name: str) -> AgentEvent | None:
        with self.lock:
            event = self.events.get(name)
            return None if event is None or not event.is_sent else _copy(event)

    def question_for_key(self, key: str) -> AgentQuestion | None:
        with self.lock:
            question = self.questions.get(key)
            return None if question is None else _copy(question)

    def run_outcomes(self, run_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
        with self.lock:
            outcomes = {}
            for run_id in run_ids:
                run = self._by_text(str(run_id))
                if run is not None:
                    outcomes[str(run_id)] = run_outcome(run)
            return outcomes
