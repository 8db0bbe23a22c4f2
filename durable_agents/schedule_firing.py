"""Firing schedules: each due slot starts its run, once, across the whole fleet.

    fire_due(now=None)   one look at the schedules; fires the due ones, a batch at a time

Every worker calls ``fire_due`` a few times a second (``ScheduleFirer``, on a thread of its
own). What it costs:

    nothing due      one indexed statement (``agent_schedule_due``, a partial index on
                     next_slot): the earliest next slot and the database's clock, outside any
                     transaction; it also says how long until that slot, so the firer sleeps
                     until then (at most ``TICK_SECONDS``)
    a due batch      one transaction: one SELECT ... FOR UPDATE SKIP LOCKED of up to
                     ``BATCH`` due schedules, the runs of all their due slots started
                     together (``Store.create_runs``: one INSERT of the runs, one read of
                     their keys, one INSERT of their task steps), one UPDATE of every row
                     taken (next_slot, last_slot, last_run, broken)

Exactly one run per slot, whatever happens:

- A slot's run is started with the start key ``slot_key(name, slot)``: whichever worker fires
  the slot, however many times, it starts one run (start keys are unique per agent).
- The slot's run and the schedule's move to the next slot commit together. A worker that dies
  in between commits neither: the row lock goes with its connection, and the next worker
  fires the slot again (its key makes that the only run of the slot).
- SKIP LOCKED: two workers firing at once take different schedules instead of waiting for
  each other, and never the same one.

Missed slots (no worker ran through them): only the newest is fired, unless the schedule has
``catch_up``: then each, oldest first, ``MAX_CATCH_UP`` per schedule per firing.

A schedule that cannot fire (its agent is not registered any more, its cron expression or its
time zone no longer parses, its task is refused) gets the reason in ``broken`` and fires
nothing until ``schedule()`` or an edit in the admin clears it: the worker that notices logs
it once, and goes on with the others. A schedule declared after this process started, of an
agent it does not know, is left to other workers instead (a rolling deploy: the new code
declared it while this worker still runs the old).

If starting the batch's runs together fails, they are started one by one, each in a
savepoint: a run that fails to start leaves its schedule as it was (the next firing tries it
again), and the others start.

On PostgreSQL the clock is the database's (``now()``), as for leases and timers; on SQLite,
``Now()`` of the same machine.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from cronsim import CronSimError
from django.db import DatabaseError, connection, transaction
from django.db.models import Value
from django.db.models.expressions import Expression
from django.db.models.functions import Now
from django.utils import timezone

from durable_agents.exceptions import AgentNotFound
from durable_agents.models import AgentRun
from durable_agents.schedule_models import AgentSchedule
from durable_agents.schedules import MAX_CATCH_UP, due_slots, next_slot, slot_key
from durable_agents.store import current

logger = logging.getLogger("durable_agents.schedules")

# Due schedules one transaction takes (each with its slots' runs).
BATCH = 100
# Batches one ``fire_due`` call takes at most before it hands back (the rest: the next call).
MAX_BATCHES = 10
# How often a worker looks for due schedules when none is due sooner: a slot's run starts at
# most this late when the slot was unknown at the last look (a schedule just created).
TICK_SECONDS = 0.25
# After a database error, the firer waits this long before it looks again.
ERROR_WAIT_SECONDS = 1.0
# A schedule whose run the database refused this many times in a row (in one process: a
# trigger, a constraint of yours) is broken rather than tried every tick forever.
MAX_START_FAILURES = 40

# When this process started (imported the firing): a schedule declared or edited since, whose
# agent it does not know, is left to other workers rather than called broken.
PROCESS_STARTED = timezone.now()

# Consecutive refusals of each schedule's run (by id), in this process.
_start_failures: dict[int, int] = {}

_FIELDS = ["next_slot", "last_slot", "last_run", "broken", "updated_at"]


@dataclass
class Fired:
    """What one ``fire_due`` call did."""

    # The runs the slots started (or found started already, by their key), oldest slot first.
    runs: list[AgentRun] = field(default_factory=list)
    # The schedules taken (fired, or found broken).
    schedules: int = 0
    # The names of the schedules found broken by this call.
    broken: list[str] = field(default_factory=list)
    # The names of the schedules left to other workers (an agent this process does not know,
    # declared after it started).
    left: list[str] = field(default_factory=list)
    # Seconds until the next known slot (0: more are due now); None when no schedule fires.
    next_in: float | None = None


def fire_due(
    now: dt.datetime | None = None, *, batch: int = BATCH, max_batches: int = MAX_BATCHES
) -> Fired:
    """Fire every slot that is due (``next_slot`` <= ``now``) of the enabled, sound schedules,
    ``batch`` schedules per transaction, at most ``MAX_BATCHES`` batches per call. ``now``:
    the time to fire at (a test's fake clock); by default the database's clock."""
    cutoff: Expression = Now() if now is None else Value(now)
    fired = Fired()
    first = (
        AgentSchedule.objects.firing()
        .filter(next_slot__isnull=False)
        .annotate(db_now=cutoff)
        .order_by("next_slot")
        .values_list("next_slot", "db_now")
        .first()
    )
    if first is None:
        return fired
    earliest, clock = first
    if earliest > clock:
        fired.next_in = (earliest - clock).total_seconds()
        return fired
    for _ in range(max_batches):
        taken, next_in = _fire_batch(cutoff, batch, fired)
        fired.next_in = next_in
        if taken < batch:
            return fired
    fired.next_in = 0.0
    return fired


# The rows of a batch moved on, in one statement whatever their number (PostgreSQL): the ORM's
# bulk_update builds a CASE per column and row, which costs more Python than the firing.
MOVE_ON_SQL = """\
UPDATE agent_schedule AS s
   SET next_slot = v.next_slot, last_slot = v.last_slot, last_run_id = v.last_run_id,
       broken = v.broken, updated_at = now()
  FROM unnest(%s::bigint[], %s::timestamptz[], %s::timestamptz[], %s::uuid[], %s::text[])
       AS v(id, next_slot, last_slot, last_run_id, broken)
 WHERE s.id = v.id"""


def _save_moves(rows: list[AgentSchedule], clock: dt.datetime) -> None:
    """One UPDATE of every row taken: next_slot, last_slot, last_run, broken."""
    if connection.vendor != "postgresql":
        for row in rows:
            row.updated_at = clock
        AgentSchedule.objects.bulk_update(rows, _FIELDS)
        return
    with connection.cursor() as cursor:
        cursor.execute(
            MOVE_ON_SQL,
            [
                [row.pk for row in rows],
                [row.next_slot for row in rows],
                [row.last_slot for row in rows],
                [row.last_run_id for row in rows],
                [row.broken for row in rows],
            ],
        )


def _fire_batch(cutoff: Expression, batch: int, fired: Fired) -> tuple[int, float | None]:
    """One transaction: take up to ``batch`` due schedules (skipping those another worker
    holds), start their slots' runs, move them on. Returns how many were taken, and the
    seconds until the earliest next slot among them (0 when a batch was full: more may be
    due)."""
    with transaction.atomic():
        rows = list(
            AgentSchedule.objects.firing()
            .filter(next_slot__lte=cutoff)
            .annotate(db_now=cutoff)
            .order_by("next_slot")
            .select_for_update(skip_locked=True)[:batch]
        )
        if not rows:
            return 0, None
        clock: dt.datetime = rows[0].db_now  # type: ignore[attr-defined]
        slots = [
            _SlotRun(row, slot, run) for row in rows for slot, run in _slot_runs(row, clock, fired)
        ]
        _start(slots)
        _move_on(slots, fired)
        _save_moves(rows, clock)
    fired.schedules += len(rows)
    if len(rows) == batch:
        return len(rows), 0.0
    # A schedule whose run was refused is tried at the next tick, not at once again.
    refused = {id(s.schedule) for s in slots if s.refused is not None}
    upcoming = [
        row.next_slot
        for row in rows
        if row.next_slot is not None
        and not row.broken
        and id(row) not in refused
        and row.name not in fired.left
    ]
    if not upcoming:
        return len(rows), None
    return len(rows), max(0.0, (min(upcoming) - clock).total_seconds())


@dataclass
class _SlotRun:
    """A due slot of a schedule and its run: unsaved until started; None when it could not
    start (``refused``: why)."""

    schedule: AgentSchedule
    slot: dt.datetime
    run: AgentRun | None
    refused: DatabaseError | None = None


def _slot_runs(
    row: AgentSchedule, clock: dt.datetime, fired: Fired
) -> list[tuple[dt.datetime, AgentRun]]:
    """The due slots of ``row`` and their runs to start (unsaved), oldest first; none when the
    schedule cannot fire (then it is broken, with the reason)."""
    from durable_agents import api
    from durable_agents.store.concurrency import check_concurrency_key

    try:
        slots = due_slots(row, clock, MAX_CATCH_UP)
    except (ValueError, CronSimError) as exc:
        _break(row, f"its timing no longer parses: {exc}", fired)
        return []
    runs = []
    try:
        # The schedule's own fields once; each slot's key and run (a catch-up has up to 100).
        api.check_priority(row.priority)
        if row.concurrency_key is not None:
            check_concurrency_key(row.concurrency_key)
        for slot in slots:
            key = slot_key(row.name, slot)
            api._check_start_key(key)
            run = api._new_run(row.agent, row.task, None, None)
            run.start_key, run.priority = key, row.priority
            run.concurrency_key = row.concurrency_key
            runs.append((slot, run))
    except AgentNotFound:
        if row.updated_at >= PROCESS_STARTED:
            # Declared or edited since this process started: in a rolling deploy that adds
            # the agent, this worker may run the deploy before it. A worker that knows the
            # agent fires it; one started later that does not know it says it is broken.
            fired.left.append(row.name)
            return []
        _break(row, f"no agent named {row.agent!r} is registered", fired)
        return []
    except ValueError as exc:
        _break(row, f"its run is refused: {exc}", fired)
        return []
    # A bug, a check of a deploy's own: it breaks the schedule, not the worker.
    except Exception as exc:  # noqa: BLE001
        _break(row, f"starting a run failed: {type(exc).__name__}: {exc}", fired)
        return []
    return runs


def _start(slots: list[_SlotRun]) -> None:
    """Start the runs of ``slots`` (each ``run`` becomes the stored run, or None): all
    together (a few statements for the whole batch), or, if that fails, one by one, each in
    its savepoint, so that one the database refuses (its schedule is left as it was, tried
    again at the next firing) does not hold back the others."""
    payloads = []
    for slot_run in slots:
        assert slot_run.run is not None  # unsaved, not started yet
        payloads.append((slot_run.run, json.dumps(slot_run.run.task, ensure_ascii=False)))
    try:
        started = current().create_runs(payloads)  # in a savepoint of its own
    except DatabaseError:
        logger.debug("starting %d scheduled runs together failed; one by one", len(slots))
    else:
        for slot_run, run in zip(slots, started, strict=True):
            slot_run.run = run
        return
    refused: dict[int, DatabaseError] = {}
    for slot_run, (run, payload) in zip(slots, payloads, strict=True):
        slot_run.run = None
        slot_run.refused = refused.get(id(slot_run.schedule))
        if slot_run.refused is not None:
            continue  # an older slot of its schedule was refused: this one waits
        try:
            with transaction.atomic():
                slot_run.run = current().create_run(run, payload)
        except DatabaseError as exc:
            slot_run.refused = refused[id(slot_run.schedule)] = exc


def _move_on(slots: list[_SlotRun], fired: Fired) -> None:
    """Each schedule's last slot and run are its newest started slot's; its next slot is the
    one after it (or the first slot whose run failed to start: it is due again)."""
    counted: set[int] = set()
    for slot_run in slots:
        row, run = slot_run.schedule, slot_run.run
        if slot_run.refused is not None and not row.broken and id(row) not in counted:
            counted.add(id(row))  # once per firing, at its oldest slot
            _refused(row, slot_run, slot_run.refused, fired)
        if run is None or row.broken:
            continue
        _start_failures.pop(row.pk, None)
        fired.runs.append(run)
        row.last_slot, row.last_run_id = slot_run.slot, run.pk
        try:
            following = next_slot(row, slot_run.slot)
        except (ValueError, CronSimError) as exc:  # pragma: no cover - due_slots parsed it
            _break(row, f"its timing no longer parses: {exc}", fired)
            continue
        if following is None:
            _break(row, "its cron expression fires on no day of the next five years", fired)
            continue
        row.next_slot = following


def _refused(row: AgentSchedule, slot_run: _SlotRun, exc: DatabaseError, fired: Fired) -> None:
    """The database refused the run of a slot: said once, tried again at the next firing;
    after ``MAX_START_FAILURES`` refusals in a row the schedule is broken."""
    failures = _start_failures.get(row.pk, 0) + 1
    _start_failures[row.pk] = failures
    if failures >= MAX_START_FAILURES:
        _start_failures.pop(row.pk, None)
        _break(row, f"the database refused its run {failures} times in a row: {exc}", fired)
    elif failures == 1:
        logger.warning(
            "schedule %r: the database refused the run of the slot %s (%s); retrying at the "
            "next firing",
            row.name,
            slot_run.slot.isoformat(),
            " ".join(str(exc).split()),
        )


def _break(row: AgentSchedule, reason: str, fired: Fired) -> None:
    row.broken = reason
    fired.broken.append(row.name)
    logger.error(
        "schedule %r fires nothing until it is saved again (schedule() or the admin): %s",
        row.name,
        reason,
    )


class ScheduleFirer:
    """A worker's firing loop: ``fire_due`` every ``TICK_SECONDS``, or at the next known slot
    if that comes sooner, until ``stopping`` is set. Never raises: a database error is logged
    once and retried; any other error is logged and the loop goes on."""

    def __init__(
        self,
        stopping: threading.Event,
        *,
        tick_seconds: float = TICK_SECONDS,
        release: Callable[[], None] = lambda: None,
        close: Callable[[], None] = lambda: None,
    ) -> None:
        self.stopping = stopping
        self.tick_seconds = tick_seconds
        # Hand the thread's connection back to the pool between looks / drop it after an error.
        self.release = release
        self.close = close
        self.failures = 0

    def serve(self) -> None:
        wait = 0.0
        try:
            while not self.stopping.wait(wait):
                wait = self.tick()
        finally:
            self.close()

    def tick(self) -> float:
        """One look (and firing); returns how long to wait before the next."""
        try:
            fired = fire_due()
        except DatabaseError as exc:
            self.failures += 1
            (logger.error if self.failures == 1 else logger.debug)(
                "firing schedules failed (%s: %s); retrying every %.1fs",
                type(exc).__name__,
                " ".join(str(exc).split()),
                ERROR_WAIT_SECONDS,
            )
            self.close()
            return ERROR_WAIT_SECONDS
        except Exception:
            self.failures += 1
            logger.exception("firing schedules failed")
            self.close()
            return ERROR_WAIT_SECONDS
        finally:
            self.release()
        if self.failures:
            logger.info("firing schedules works again after %d failures", self.failures)
            self.failures = 0
        if fired.runs:
            logger.info("fired %d slot(s) of %d schedule(s)", len(fired.runs), fired.schedules)
        if fired.next_in is None:
            return self.tick_seconds
        return min(self.tick_seconds, fired.next_in)
