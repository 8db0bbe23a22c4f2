"""A run's events, read from the database: what ``stream`` yields and from where it resumes.

Events, in the order a run makes them::

    status    where the run stands (sent first, then at every change): status, waiting_for
    step      a committed step: seq, kind and its content as sent or received
    progress  a ``progress(...)`` message of a tool call: seq (its model turn) and text
    delta     text of the model turn in flight (streamed agents on PostgreSQL): seq, attempt,
              n (the chunk's place: 0 starts the turn's text over) and text. Ephemeral: the
              turn's step event supersedes its deltas, also those of an attempt a crash cut
    end       the run is over (succeeded, failed, cancelled, dead): the stream ends

Every event carries an id: ``<the run's short id>:<seq>.<progress>.<status>.<attempt>.<n>``
(the short id: ``models.ids.short_id``, the last 8 hex digits of a time-ordered run id), the
cursor just after it (the newest step, the newest progress message and the status delivered,
in upper case once the end was, and the deltas of the turn in flight delivered so far).
``after=`` (or SSE's ``Last-Event-ID``) resumes from any id: nothing missed, nothing twice.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from collections.abc import Mapping
from typing import Any

from django.db import connection
from django.db.models import BooleanField, F, Max, Window
from django.db.models.expressions import RawSQL
from django.db.models.functions import RowNumber

from durable_agents._internal.deepjson import loads_deep
from durable_agents.engine.history import message_text
from durable_agents.exceptions import BadEventId as BadEventId  # in the one error tree
from durable_agents.models import (
    ENDED_STATUSES,
    AgentProgress,
    AgentRun,
    AgentStep,
    RunStatus,
    short_id,
    steps_of,
)

# One letter per status in event ids.
STATUS_CODES: dict[str, str] = {
    RunStatus.PENDING: "p",
    RunStatus.RUNNING: "r",
    RunStatus.WAITING: "w",
    RunStatus.SUCCEEDED: "s",
    RunStatus.FAILED: "f",
    RunStatus.CANCELLED: "c",
    RunStatus.DEAD: "d",
}
# A step's content beyond this many characters is cut in its event (a 5 MB tool result is not
# for watching; the transcript has it whole).
MAX_EVENT_CHARS = 100_000
# Steps (and progress messages) read per query while catching up.
BATCH = 200
# Every number of an id is a run of ASCII digits (re.ASCII: no other script's digits) of
# bounded length, so it fits the column it is compared with (seq, attempt and n: integer;
# a progress message's id: bigint). The seq alone may be -1: the cursor before the first step.
_ID = re.compile(
    r"([0-9a-f]{8}):(-1|\d{1,9})\.(\d{1,18})\.([a-zA-Z]?)\.(\d{1,9})\.(\d{1,9})", re.ASCII
)


_JSON_HTML_ESCAPES = str.maketrans({"<": "\\u003c", ">": "\\u003e", "&": "\\u0026"})


@dataclasses.dataclass(frozen=True)
class Cursor:
    """Where a reader stands: what it has been given so far."""

    seq: int = -1  # the newest step given
    progress: int = 0  # the newest progress message given (its id)
    status: str = ""  # the status code given last ("" none yet; upper case: and the end)
    attempt: int = 0  # deltas given of turn seq + 1: the attempt they came from
    chunks: int = 0  # and how many of them

    def id_for(self, run_id: uuid.UUID) -> str:
        return (
            f"{short_id(run_id)}:{self.seq}.{self.progress}.{self.status}."
            f"{self.attempt}.{self.chunks}"
        )

    @classmethod
    def parse(cls, run_id: uuid.UUID, event_id: str | None) -> Cursor:
        """The cursor an event id names; ``BadEventId`` for an id that is malformed, another
        run's, or has a number out of range (a seq below -1 would start the run's shared hub
        watch so far back that no read ever reaches its steps: every reader of the run would
        wait for ever while the hub polls it)."""
        if event_id is None or event_id == "":
            return cls()
        # fullmatch: ``$`` would let a trailing newline through.
        match = _ID.fullmatch(event_id) if isinstance(event_id, str) else None
        if match is None:
            raise BadEventId("not an event id of a run's stream")
        tag, seq, progress, status, attempt, chunks = match.groups()
        # Ids were tagged with the first 8 digits of the run id before short ids of
        # time-ordered runs became their last 8: a page open across the upgrade reconnects
        # with such an id, and resumes where it was.
        if tag not in (short_id(run_id), run_id.hex[:8]):
            raise BadEventId("an event id of another run's stream")
        if status and status.lower() not in STATUS_CODES.values():
            raise BadEventId("not an event id of a run's stream")
        return cls(int(seq), int(progress), status, int(attempt), int(chunks))


@dataclasses.dataclass(frozen=True)
class Event:
    """One event of a run's stream: ``type``, ``data`` (JSON values) and ``id``."""

    type: str  # status, step, progress, delta, end
    data: dict[str, Any]
    cursor: Cursor
    run_id: uuid.UUID

    @property
    def id(self) -> str:
        """What ``stream(run_id, after=...)`` and ``Last-Event-ID`` resume after."""
        return self.cursor.id_for(self.run_id)

    def sse(self) -> bytes:
        """The event as text/event-stream: id, event and one data line of JSON, ASCII with
        ``<``, ``>`` and ``&`` escaped too: what the model wrote reaches the page as JSON
        escapes, never as raw control characters or markup."""
        data = json.dumps(self.data, ensure_ascii=True, separators=(",", ":")).translate(
            _JSON_HTML_ESCAPES
        )
        return f"id: {self.id}\nevent: {self.type}\ndata: {data}\n\n".encode()


@dataclasses.dataclass(frozen=True)
class RunState:
    """What a poll reads of a run: enough to tell whether it has anything new."""

    last_seq: int
    progress: int
    status: str

    def ahead_of(self, cursor: Cursor) -> bool:
        return (
            self.last_seq > cursor.seq
            or self.progress > cursor.progress
            or STATUS_CODES.get(self.status, "") != cursor.status.lower()
        )


@dataclasses.dataclass(frozen=True)
class Read:
    """One read of a run's events: them, the cursor after them, and whether more are there
    already (a batch was full) or the run is over (and everything was given)."""

    events: list[Event]
    cursor: Cursor
    more: bool = False
    over: bool = False


def within_run(run_id: uuid.UUID, cursor: Cursor) -> Cursor:
    """``cursor`` with a progress message id ahead of the run's newest brought back to it: a
    made-up id that a hub watch started from would otherwise pass over every message still to
    come, for every reader of the run (``events_after`` does the same for a step ahead)."""
    if not cursor.progress:
        return cursor
    newest = AgentProgress.objects.filter(run_id=run_id).aggregate(newest=Max("id"))["newest"] or 0
    if cursor.progress <= newest:
        return cursor
    return dataclasses.replace(cursor, progress=newest)


def events_after(run_id: uuid.UUID, cursor: Cursor) -> Read | None:
    """What happened in the run after ``cursor`` (up to BATCH steps and progress messages).
    None: no such run. Reads the run row first, so a status is never given ahead of its
    steps."""
    return events_after_many({run_id: cursor})[run_id]


def events_after_many(cursors: Mapping[uuid.UUID, Cursor]) -> dict[uuid.UUID, Read | None]:
    """``events_after`` of many runs (one cursor each) in three statements whatever their
    number: the run rows, then the steps of them all, then their progress messages (a fork's
    steps are read on their own: its log is spread over several runs)."""
    runs = {
        row["id"]: row
        for row in AgentRun.objects.filter(pk__in=list(cursors)).values(
            "id", "status", "waiting_for", "last_seq", "result", "error", "fork_seq"
        )
    }
    reads: dict[uuid.UUID, Read | None] = dict.fromkeys(cursors)
    starts: dict[uuid.UUID, Cursor] = {}
    for run_id, run in runs.items():
        cursor = cursors[run_id]
        if cursor.seq > run["last_seq"]:
            # An id ahead of the run (made up, or kept from before a restore of the database):
            # go on from the run's newest step, so that a hub watch started from this reader's
            # cursor does not pass over the steps still to come for every other reader.
            cursor = dataclasses.replace(cursor, seq=run["last_seq"], attempt=0, chunks=0)
        starts[run_id] = cursor
    steps = _steps_after(runs, starts)
    notes = _notes_after(runs, starts)
    for run_id, run in runs.items():
        reads[run_id] = _read(
            run_id, run, starts[run_id], steps.get(run_id, []), notes.get(run_id, [])
        )
    return reads


_Step = tuple[int, str, str, "int | None", "int | None"]
_Note = tuple[int, int, str, Any]


def _steps_after(
    runs: Mapping[uuid.UUID, Mapping[str, Any]], starts: Mapping[uuid.UUID, Cursor]
) -> dict[uuid.UUID, list[_Step]]:
    """Each run's steps after its cursor, BATCH at most. A run's own log has every seq from 0
    to last_seq (a step commits only as last_seq + 1), so a range of seqs bounds the rows."""
    out: dict[uuid.UUID, list[_Step]] = {}
    wanted: list[tuple[uuid.UUID, int, int]] = []
    for run_id, run in runs.items():
        after, last = starts[run_id].seq, run["last_seq"]
        if last <= after:
            continue
        if run["fork_seq"] is not None:
            # A fork's log includes steps of the runs it was forked from.
            out[run_id] = list(
                steps_of(run_id)
                .filter(seq__gt=after, seq__lte=last)
                .order_by("seq")
                .values_list("seq", "kind", "payload", "content_start", "content_end")[:BATCH]
            )
            continue
        wanted.append((run_id, after, min(last, after + BATCH)))
    if wanted:
        rows = (
            AgentStep.objects.filter(_any_of("(run_id = %s AND seq > %s AND seq <= %s)", wanted))
            .order_by("run_id", "seq")
            .values_list("run_id", "seq", "kind", "payload", "content_start", "content_end")
        )
        for run_id, *step in rows:
            out.setdefault(run_id, []).append(tuple(step))  # type: ignore[arg-type]
    return out


def _notes_after(
    runs: Mapping[uuid.UUID, Mapping[str, Any]], starts: Mapping[uuid.UUID, Cursor]
) -> dict[uuid.UUID, list[_Note]]:
    """Each run's progress messages after its cursor, BATCH at most; only those of steps the
    run row says are there: one of a call whose turn was committed after the row was read
    waits for the next read, so that a message never comes ahead of the turn that made the
    call (and is never given before it, by cursor)."""
    wanted = [(run_id, starts[run_id].progress, run["last_seq"]) for run_id, run in runs.items()]
    out: dict[uuid.UUID, list[_Note]] = {}
    if not wanted:
        return out
    rows = (
        AgentProgress.objects.filter(_any_of("(run_id = %s AND id > %s AND seq <= %s)", wanted))
        .annotate(nth=Window(RowNumber(), partition_by=[F("run_id")], order_by=F("id").asc()))
        .filter(nth__lte=BATCH)
        .order_by("run_id", "id")
        .values_list("run_id", "id", "seq", "message", "created_at")
    )
    for run_id, *note in rows:
        out.setdefault(run_id, []).append(tuple(note))  # type: ignore[arg-type]
    return out


def _any_of(term: str, rows: list[tuple[Any, ...]]) -> RawSQL:
    """``term OR term OR ...``, one per row of parameters (the first, a run id): as SQL text.
    The ORM's Q objects would say the same at a cost (building and compiling a hundred of them
    takes longer than running the query) that a poll every 0.1 s cannot pay."""
    run_field = AgentStep._meta.get_field("run").target_field
    params: list[Any] = []
    for run_id, *rest in rows:
        params += [run_field.get_db_prep_value(run_id, connection), *rest]
    return RawSQL(" OR ".join([term] * len(rows)), params, output_field=BooleanField())


def _read(
    run_id: uuid.UUID,
    run: Mapping[str, Any],
    cursor: Cursor,
    steps: list[_Step],
    notes: list[_Note],
) -> Read:
    more_notes = len(notes) == BATCH
    events: list[Event] = []
    at = cursor
    for seq, kind, payload, start, end in steps:
        # A tool call's messages come before the step that holds its result.
        while notes and notes[0][1] < seq:
            at = _progress(events, at, notes.pop(0), run_id)
        at = dataclasses.replace(at, seq=seq, attempt=0, chunks=0)
        events.append(Event("step", step_data(seq, kind, payload, start, end), at, run_id))
    caught_up = len(steps) < BATCH and (not steps or steps[-1][0] >= run["last_seq"])
    if not caught_up:
        return Read(events, at, more=True)
    while notes:
        at = _progress(events, at, notes.pop(0), run_id)
    if more_notes:
        return Read(events, at, more=True)
    code = STATUS_CODES.get(run["status"], "")
    if code != at.status.lower():
        at = dataclasses.replace(at, status=code)
        events.append(Event("status", status_data(run), at, run_id))
    over = run["status"] in ENDED_STATUSES
    if over and not at.status.isupper():
        at = dataclasses.replace(at, status=code.upper())
        events.append(Event("end", {"status": run["status"]}, at, run_id))
    return Read(events, at, over=over)


def _progress(events: list[Event], at: Cursor, note: _Note, run_id: uuid.UUID) -> Cursor:
    pk, seq, message, created_at = note
    at = dataclasses.replace(at, progress=pk)
    data = {"seq": seq, "text": message, "at": created_at.isoformat()}
    events.append(Event("progress", data, at, run_id))
    return at


def step_data(
    seq: int, kind: str, payload: str, start: int | None, end: int | None
) -> dict[str, Any]:
    """A step as an event gives it: its content as the model was sent it (the task's text, the
    tool_result blocks, the model turn's content blocks), cut at MAX_EVENT_CHARS."""
    text = message_text(kind, payload, start, end)
    if len(text) > MAX_EVENT_CHARS:
        return {
            "seq": seq,
            "kind": kind,
            "truncated": len(text),
            "content": text[:MAX_EVENT_CHARS],
        }
    return {"seq": seq, "kind": kind, "content": loads_deep(text)["content"]}


def status_data(run: Mapping[str, Any]) -> dict[str, Any]:
    data = {"status": run["status"], "waiting_for": run["waiting_for"] or None}
    if run["status"] == RunStatus.SUCCEEDED:
        data["result"] = (run["result"] or "")[:MAX_EVENT_CHARS]
    elif run["status"] in ENDED_STATUSES:
        data["error"] = (run["error"] or "")[:MAX_EVENT_CHARS]
    return data


def delta_event(
    run_id: uuid.UUID, cursor: Cursor, seq: int, attempt: int, n: int, text: str
) -> Event:
    """A chunk of the turn in flight (seq = the turn's, one past the cursor's step)."""
    at = dataclasses.replace(cursor, attempt=attempt, chunks=n + 1)
    return Event("delta", {"seq": seq, "attempt": attempt, "n": n, "text": text}, at, run_id)
