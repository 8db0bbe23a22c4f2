"""Waiting without a worker: ``raise Wait(...)`` from tool code, and the built-in ``ask_person``.

A tool that raises ``Wait`` parks its run: no effect is recorded for the call, the run becomes
``waiting`` with what it waits for in its row, and the worker's slot, thread, lease and
connection are free at once. When the wait is over (a timer is due, an event was sent, the
children ended, a person answered, or the timeout passed) a worker claims the run again and
the same call, with the same idempotency key, is invoked again with ``woken_by`` filled in::

    {"timer": True}
    {"timeout": True}
    {"event": name, "payload": ..., "at": iso}
    {"runs": {id: {"status", "result", "error", "task"}}}  (and "output", when a child has one)
    {"answer": text, "answered_by": username, "at": iso}         (ask_person)
    {"callback": body, "at": iso}                                (Wait(callback=True))

A callback is a service's answer by HTTP: ``durable_agents.callback_url()`` in tool code gives
the current call's signed URL (the same URL every time the call is invoked, in any process),
which the tool hands to the service before it raises ``Wait(callback=True)``; the service's
POST of a JSON body to it completes the wait once (``body`` is that JSON value; ``at`` when
it was received). A call receives one callback: a POST that arrives before the call parked is
kept, and the park goes on at once with it.

The transitions themselves are the store's (``Store.park_on_wait``, ``send_event``,
``answer_question``, ``wake_parent``, ``receive_callback``); this module holds only what tool
code touches, and imports no Django model: an ``agents.py`` imports it at app loading.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import datetime
import math
import re
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

from durable_agents.declare.tools import tool

__all__ = ["CallContext", "Wait", "ask_person", "current_call"]

# Longest name of an event (the column's width).
MAX_EVENT_NAME = 200


# Control characters (C0, DEL, C1: NUL among them, and CR/LF, which forge log lines) and lone
# surrogates (which no UTF-8 column can store): never part of an event's name.
_BAD_NAME_CHARS = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")


def event_name_problem(name: object) -> str | None:
    """What is wrong with ``name`` as an event's name, or None when it is a valid one: a
    non-empty string of at most MAX_EVENT_NAME characters without control characters or
    lone surrogates. Checked before anything is written, by ``Wait(event=)`` (the model may
    choose the name: a bad one is the tool's error, which the model sees) and ``send_event``."""
    if not isinstance(name, str):
        return f"a name is a string, not {type(name).__name__}"
    if not name:
        return "a name cannot be empty"
    if len(name) > MAX_EVENT_NAME:
        return f"a name has at most {MAX_EVENT_NAME} characters, this one has {len(name)}"
    bad = _BAD_NAME_CHARS.search(name)
    if bad is not None:
        return (
            f"a name cannot contain control characters or lone surrogates "
            f"({bad.group()!a} at position {bad.start()})"
        )
    return None


class Wait(Exception):  # not ...Error: it is control flow, and its name is public API
    """Raised by tool code to park its run until a timer, an event, child runs or a callback.

    Exactly one of ``seconds`` (a durable timer), ``until`` (an aware datetime), ``event`` (a
    name given to ``send_event``), ``runs`` (ids of runs this run spawned) or ``callback=True``
    (a POST to the call's ``callback_url()``); ``timeout`` (seconds) bounds any of them but a
    timer. Do not catch it in the tool: it must reach the
    runtime (it is an ``Exception`` so that it crosses threads and event loops like any other).
    """

    kind: str

    def __init__(
        self,
        *,
        seconds: float | None = None,
        until: datetime.datetime | None = None,
        event: str | None = None,
        runs: Sequence[Any] | None = None,
        callback: bool = False,
        timeout: float | None = None,
    ) -> None:
        if not isinstance(callback, bool):
            raise ValueError(f"Wait(callback=) is True or False, not {callback!r}")
        given = [
            n
            for n, v in (
                ("seconds", seconds),
                ("until", until),
                ("event", event),
                ("runs", runs),
                ("callback", callback or None),
            )
            if v is not None
        ]
        if len(given) != 1:
            raise ValueError(
                "Wait takes exactly one of seconds=, until=, event=, runs= or callback=True "
                f"(got {', '.join(given) or 'none'})"
            )
        self.seconds: float | None = None
        self.until: datetime.datetime | None = None
        self.event: str | None = None
        self.runs: tuple[str, ...] = ()
        self.timeout: float | None = None
        if seconds is not None:
            self.kind = "timer"
            self.seconds = _positive("seconds", seconds)
        elif until is not None:
            if not isinstance(until, datetime.datetime) or until.tzinfo is None:
                raise ValueError("Wait(until=) needs a timezone-aware datetime")
            self.kind = "timer"
            self.until = until
        elif event is not None:
            problem = event_name_problem(event)
            if problem is not None:
                raise ValueError(f"Wait(event=) needs a valid event name: {problem}")
            self.kind = "event"
            self.event = event
        elif callback:
            self.kind = "callback"
        else:
            assert runs is not None
            if isinstance(runs, str | bytes) or not runs:
                raise ValueError("Wait(runs=) needs a non-empty list of run ids")
            self.kind = "runs"
            self.runs = tuple(dict.fromkeys(_run_id(r) for r in runs))
        if timeout is not None:
            if self.kind == "timer":
                raise ValueError("a timer has no timeout: it is one")
            self.timeout = _positive("timeout", timeout)
        super().__init__(self.describe())

    def describe(self) -> str:
        """What the run waits for, in words (logs and the admin)."""
        if self.kind == "timer":
            what = f"a timer of {self.seconds:g}s" if self.seconds else f"until {self.until}"
        elif self.kind == "event":
            what = f"event {self.event!r}"
        elif self.kind == "runs":
            what = f"{len(self.runs)} run(s) to end"
        elif self.kind == "callback":
            what = "a callback"
        else:
            what = "a person's answer"
        if self.timeout is not None:
            what += f" (timeout {self.timeout:g}s)"
        return f"Wait for {what}"


class AskPerson(Wait):
    """The wait of the built-in ``ask_person`` tool: a question that a person answers."""

    def __init__(self, question: str) -> None:
        if not isinstance(question, str) or not question.strip():
            raise ValueError("ask_person needs a non-empty question")
        self.kind = "question"
        self.question = question
        self.seconds = self.timeout = None
        self.until = None
        self.event = None
        self.runs = ()
        Exception.__init__(self, self.describe())


def _run_id(value: Any) -> str:
    """A run id (a UUID, a run, or its text) as the canonical text of the UUID."""
    value = getattr(value, "pk", value)
    try:
        return str(value if isinstance(value, uuid.UUID) else uuid.UUID(str(value)))
    except ValueError:
        raise ValueError(f"Wait(runs=) takes run ids; {value!r} is not one") from None


def _positive(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"Wait({name}=) must be a number of seconds, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"Wait({name}=) must be a positive, finite number of seconds")
    return float(value)


@tool(effect="idempotent", name="ask_person")
def ask_person(question: str, *, woken_by: dict[str, Any] | None = None) -> dict[str, Any]:
    """Ask a person a question and wait for the answer (it may take hours). Use it when you
    need a decision or information that only a person can give.

    Args:
        question: the question, complete enough to be answered without other context.
    """
    if woken_by is None or "answer" not in woken_by:
        raise AskPerson(question)
    return {
        "answer": woken_by["answer"],
        "answered_by": woken_by.get("answered_by"),
        "answered_at": woken_by.get("at"),
    }


# -- the call in progress ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CallContext:
    """The tool call running on this thread (or task): what ``spawn_run`` needs to know."""

    run_id: Any
    depth: int
    key: str
    seq: int = 0  # the model turn that asked for the call
    # The run's metadata: what a child run spawned by the call inherits unless given its own.
    metadata: Any = None


_current_call: contextvars.ContextVar[CallContext | None] = contextvars.ContextVar(
    "durable_agents_call", default=None
)


def current_call() -> CallContext | None:
    """The tool call this code runs in, or None outside tool code."""
    return _current_call.get()


@contextlib.contextmanager
def calling(context: CallContext) -> Iterator[None]:
    """Mark the code inside as the tool call ``context`` (set on the thread that runs it)."""
    token = _current_call.set(context)
    try:
        yield
    finally:
        _current_call.reset(token)
