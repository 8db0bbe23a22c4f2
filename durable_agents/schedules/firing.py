"""Firing schedules: each due slot starts its run, once, across the whole fleet.

    fire_due(now=None)   one look at the schedules; fires the due ones, a batch at a time

Every worker calls ``fire_due`` a few times a second (``ScheduleFirer``, on a thread of its
own). Each look is one transaction; the store does its writes (store/postgres_schedules.py,
store/portable_schedules.py). What it costs on PostgreSQL:

    nothing due      one indexed statement (``agent_schedule_due``, a partial index on
                     next_slot), which locks nothing: the earliest next slot and the
                     database's clock; the firer sleeps until that slot (at most
                     ``TICK_SECONDS``)
    a due batch      the same statement takes up to ``BATCH`` due schedules (FOR UPDATE SKIP
                     LOCKED); Python plans their slots, runs and next slots (no database);
                     one statement fires the batch: every slot's run and task step, and every
                     schedule moved on (next_slot, last_slot, last_run, broken)

Elsewhere (SQLite) the look and the take are two statements, and the runs take three
(``Store.create_runs``) and the moves one.

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

If starting the batch's runs together fails (a trigger or a constraint of the project's
refuses one), the transaction is rolled back and the batch taken again, its runs started one
by one, each in a savepoint: a run that fails to start leaves its schedule at that slot (the
next firing tries it again), and the others start.

On PostgreSQL the clock is the database's (``now()``), as for leases and timers; on SQLite,
``Now()`` of the same machine.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from cronsim import CronSimError
from django.db import DatabaseError, connection, transaction
from django.utils import timezone

from durable_agents.engine import services as worker_services
from durable_agents.exceptions import AgentNotFound
from durable_agents.models import AgentRun, AgentSchedule, new_run_id
from durable_agents.schedules.defining import MAX_CATCH_UP, due_slots, next_slot, slot_key
from durable_agents.store import current, dialect_store
from durable_agents.store.base import ScheduleStore, schedule_store
from durable_agents.store.rows import SlotStart

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

# The firer plans a batch in Python (about 0.1 ms a schedule) while the worker's claimer and
# heartbeat share its process: CPython hands the GIL to a waiting thread only after a switch
# interval (5 ms), so a whole batch planned at once would hold a claim up by that much, twice.
# A short sleep every ``YIELD_EVERY`` schedules hands the GIL over at once (about 2 ms a full
# batch).
YIELD_EVERY = 10
YIELD_SECONDS = 0.0002

# When this process started (imported the firing): a schedule declared or edited since, whose
# agent it does not know, is left to other workers rather than called broken.
PROCESS_STARTED = timezone.now()

# Consecutive refusals of each schedule's run (by id), in this process.
_start_failures: dict[int, int] = {}


@dataclass
class Fired:
    """What one ``fire_due`` call did."""

    # The ids of the runs the slots started (or found started already, by their key), oldest
    # slot of each schedule first.
    run_ids: list[uuid.UUID] = field(default_factory=list)
    # The schedules taken (fired, or found broken).
    schedules: int = 0
    # The names of the schedules found broken by this call.
    broken: list[str] = field(default_factory=list)
    # The names of the schedules left to other workers (an agent this process does not know,
    # declared after it started).
    left: list[str] = field(default_factory=list)
    # Seconds until the next known slot (0: more are due now); None when no schedule fires.
    next_in: float | None = None

    @cached_property
    def runs(self) -> list[AgentRun]:
        """The runs of ``run_ids``, in that order (read on first use: a worker's firer
        needs only their number)."""
        if not self.run_ids:
            return []
        found = AgentRun.objects.in_bulk(self.run_ids)
        return [found[run_id] for run_id in self.run_ids]


def fire_due(
    now: dt.datetime | None = None, *, batch: int = BATCH, max_batches: int = MAX_BATCHES
) -> Fired:
    """Fire every slot that is due (``next_slot`` <= ``now``) of the enabled, sound schedules,
    ``batch`` schedules per transaction, at most ``max_batches`` batches per call. ``now``:
    the time to fire at (a test's fake clock); by default the database's clock."""
    fired = Fired()
    for _ in range(max_batches):
        try:
            taken = _fire_batch(now, batch, fired, together=True)
        except _TogetherRefused:
            logger.debug("starting a batch of scheduled runs together failed; one by one")
            taken = _fire_batch(now, batch, fired, together=False)
        if taken < batch:
            return fired
    fired.next_in = 0.0
    return fired


# Not a DurableAgentsError: private control flow of the firing (caught by its own caller above).
class _TogetherRefused(Exception):
    """The statement that starts a batch's runs together failed (its transaction is rolled
    back): the batch is taken again and its runs started one by one."""


@dataclass
class _Plan:
    """What a batch fires: each schedule's slots and its move, computed before any write."""

    starts: list[SlotStart] = field(default_factory=list)
    # The schedules to save (moved on, or broken); the left ones are not among them.
    rows: list[AgentSchedule] = field(default_factory=list)
    # Each schedule's slots to start, oldest first (schedule id -> its starts).
    slots_of: dict[int, list[SlotStart]] = field(default_factory=dict)
    # Each schedule's next and last slot as taken (the plan moves them on in memory).
    was: dict[int, tuple[dt.datetime | None, dt.datetime | None]] = field(default_factory=dict)
    broken: list[str] = field(default_factory=list)
    left: list[str] = field(default_factory=list)


def _fire_batch(now: dt.datetime | None, batch: int, fired: Fired, *, together: bool) -> int:
    """One transaction: take up to ``batch`` due schedules (skipping those another worker
    holds), start their slots' runs, move them on; ``fired`` gets what it did (only once it
    committed) and the seconds until the next slot. Returns how many were taken."""
    with transaction.atomic():
        due = _store().take_due_schedules(now, batch)
        if not due.rows:
            fired.next_in = _seconds_until(due.earliest, due.clock)
            return 0
        plan = _plan(due.rows, due.clock)
        if together:
            try:
                ids = _store().fire_slots(plan.starts, plan.rows, _last_keys(plan))
            except DatabaseError as exc:
                raise _TogetherRefused from exc
            refused: set[int] = set()
        else:
            ids, refused = _fire_one_by_one(plan)
    for start in plan.starts:
        if start.key in ids:
            fired.run_ids.append(ids[start.key])
    for row in plan.rows:
        if row.pk not in refused and not row.broken:
            _start_failures.pop(row.pk, None)
    fired.schedules += len(due.rows)
    fired.broken += plan.broken
    fired.left += plan.left
    fired.next_in = _next_in(due.rows, due.clock, batch, refused, plan)
    return len(due.rows)


def _store() -> ScheduleStore:
    """The database's own store, also inside the firing's transaction (``current()`` is the
    portable one there): its schedule statements are written to run in one."""
    return schedule_store(dialect_store(connection.vendor))


def _seconds_until(earliest: dt.datetime | None, clock: dt.datetime) -> float | None:
    if earliest is None:
        return None
    if earliest <= clock:
        return None  # due, but another firer holds it: look again at the next tick
    return (earliest - clock).total_seconds()


def _next_in(
    rows: list[AgentSchedule],
    clock: dt.datetime,
    batch: int,
    refused: set[int],
    plan: _Plan,
) -> float | None:
    """Seconds until the earliest next slot of a batch's schedules (0 when the batch was
    full: more may be due); a schedule whose run was refused is tried at the next tick, not
    at once again."""
    if len(rows) == batch:
        return 0.0
    upcoming = [
        row.next_slot
        for row in rows
        if row.next_slot is not None
        and not row.broken
        and row.pk not in refused
        and row.name not in plan.left
    ]
    if not upcoming:
        return None
    return max(0.0, (min(upcoming) - clock).total_seconds())


def _plan(rows: list[AgentSchedule], clock: dt.datetime) -> _Plan:
    """The slots each schedule fires at ``clock`` with their runs, and where each schedule
    moves: its last slot the newest of them, its next slot the one after."""
    plan = _Plan()
    templates: dict[str, AgentRun] = {}  # one run template per agent per batch
    for i, row in enumerate(rows):
        if i and i % YIELD_EVERY == 0:
            time.sleep(YIELD_SECONDS)
        plan.was[row.pk] = (row.next_slot, row.last_slot)
        starts = _slot_starts(row, clock, templates, plan)
        if starts is None:  # left to other workers: not saved
            continue
        plan.rows.append(row)
        if row.broken or not starts:
            continue
        plan.starts += starts
        plan.slots_of[row.pk] = starts
        newest = starts[-1].slot
        try:
            following = next_slot(row, newest)
        except (ValueError, CronSimError) as exc:  # pragma: no cover - due_slots parsed it
            _break(row, f"its timing no longer parses: {exc}", plan)
            continue
        if following is None:
            _break(row, "its cron expression fires on no day of the next five years", plan)
            continue
        row.last_slot, row.next_slot = newest, following
    # A schedule found to have no slot after these (a cron that stops firing) still starts
    # them: it is broken after them, and fires nothing more until it is saved again.
    return plan


def _slot_starts(
    row: AgentSchedule, clock: dt.datetime, templates: dict[str, AgentRun], plan: _Plan
) -> list[SlotStart] | None:
    """The due slots of ``row`` and their runs, oldest first; [] when the schedule cannot
    fire (then it is broken, with the reason); None when it is left to other workers."""
    from durable_agents import api
    from durable_agents.store.concurrency import check_concurrency_key

    try:
        slots = due_slots(row, clock, MAX_CATCH_UP)
    except (ValueError, CronSimError) as exc:
        _break(row, f"its timing no longer parses: {exc}", plan)
        return []
    try:
        template = templates.get(row.agent)
        if template is None:
            template = templates[row.agent] = api._new_run(row.agent, "-", None, None)
        # The schedule's own fields once; each slot's key (a catch-up has up to 100).
        api.check_task(row.task)
        api.check_priority(row.priority)
        if row.concurrency_key is not None:
            check_concurrency_key(row.concurrency_key)
        payload = json.dumps(row.task, ensure_ascii=False)
        starts = []
        for slot in slots:
            key = slot_key(row.name, slot)
            api._check_start_key(key)
            starts.append(
                SlotStart(
                    schedule_id=row.pk,
                    slot=slot,
                    key=key,
                    run_id=new_run_id(),
                    template=template,
                    task=row.task,
                    payload=payload,
                    priority=row.priority,
                    concurrency_key=row.concurrency_key,
                )
            )
    except AgentNotFound:
        if row.updated_at >= PROCESS_STARTED:
            # Declared or edited since this process started: in a rolling deploy that adds
            # the agent, this worker may run the deploy before it. A worker that knows the
            # agent fires it; one started later that does not know it says it is broken.
            plan.left.append(row.name)
            return None
        _break(row, f"no agent named {row.agent!r} is registered", plan)
        return []
    except ValueError as exc:
        _break(row, f"its run is refused: {exc}", plan)
        return []
    # A bug, a check of a deploy's own: it breaks the schedule, not the worker.
    except Exception as exc:  # noqa: BLE001
        _break(row, f"starting a run failed: {type(exc).__name__}: {exc}", plan)
        return []
    return starts


def _last_keys(plan: _Plan) -> dict[int, str]:
    """Each firing schedule's newest slot's key: its run becomes the schedule's last run."""
    return {schedule_id: starts[-1].key for schedule_id, starts in plan.slots_of.items()}


def _fire_one_by_one(plan: _Plan) -> tuple[dict[str, uuid.UUID], set[int]]:
    """Start the runs of ``plan`` one by one, each in its savepoint, so that one the database
    refuses does not hold back the others. A schedule whose slot's run was refused stops at
    that slot: its older slots' runs start, the refused slot is due again (tried at the next
    firing), its newer ones wait. Then the schedules are saved. Returns the stored run id of
    each started key, and the schedules that met a refusal."""
    ids: dict[str, uuid.UUID] = {}
    refused: set[int] = set()
    for row in plan.rows:
        starts = plan.slots_of.get(row.pk, [])
        newest: SlotStart | None = None
        for start in starts:
            try:
                with transaction.atomic():
                    run = current().create_run(start.new_run(), start.payload)
            except DatabaseError as exc:
                refused.add(row.pk)
                _refused(row, start.slot, exc, plan)
                break
            ids[start.key] = run.pk
            newest = start
        if newest is None and row.pk in refused:  # nothing started: as it was
            row.next_slot, row.last_slot = plan.was[row.pk]
        elif newest is not None:
            row.last_slot, row.last_run_id = newest.slot, ids[newest.key]
            if row.pk in refused:
                row.next_slot = starts[starts.index(newest) + 1].slot
    _store().move_schedules(plan.rows)
    return ids, refused


def _refused(row: AgentSchedule, slot: dt.datetime, exc: DatabaseError, plan: _Plan) -> None:
    """The database refused the run of a slot: said once, tried again at the next firing;
    after ``MAX_START_FAILURES`` refusals in a row the schedule is broken."""
    failures = _start_failures.get(row.pk, 0) + 1
    _start_failures[row.pk] = failures
    if failures >= MAX_START_FAILURES:
        _start_failures.pop(row.pk, None)
        _break(row, f"the database refused its run {failures} times in a row: {exc}", plan)
    elif failures == 1:
        logger.warning(
            "schedule %r: the database refused the run of the slot %s (%s); retrying at the "
            "next firing",
            row.name,
            slot.isoformat(),
            " ".join(str(exc).split()),
        )


def _break(row: AgentSchedule, reason: str, plan: _Plan) -> None:
    row.broken = reason
    plan.broken.append(row.name)
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
        if fired.run_ids:
            logger.info("fired %d slot(s) of %d schedule(s)", len(fired.run_ids), fired.schedules)
        if fired.next_in is None:
            return self.tick_seconds
        return min(self.tick_seconds, fired.next_in)


class Firing(worker_services.WorkerService):
    """The thread that fires agent schedules in a worker that fires them (``Worker.schedules``):
    apart from the claimer, so that a batch of due slots never delays a claim (their runs wake
    the claimer like any new run)."""

    def start(self, worker: Any) -> threading.Thread | None:
        if not worker.schedules:
            return None
        firer = ScheduleFirer(
            worker.stopping, release=worker.connections.release, close=worker.connections.close
        )
        thread = threading.Thread(target=firer.serve, name="da-schedules", daemon=True)
        thread.start()
        return thread


worker_services.register("durable_agents.schedules.firing", Firing())
