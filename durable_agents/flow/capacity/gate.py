"""``CapacityGate``: the fleet's grants of model capacity, one interface per kind of store.

The whole flow of one model call, from the runner's side:

    acquire   before the call: refill the model's buckets, then take one request, the
              estimated input tokens and max_tokens; or refuse, with how long to wait
              (the run is then handed back, pending, and holds nothing while it waits)
    settle    when the call answered: give back what the estimate took too much, per the
              answer's usage; lower the buckets to what the API's headers say remains
    rate_limited
              a 429: pause the model for the whole fleet until its retry-after, once
    queued    the claimer found a run of a higher priority waiting to be claimed: lower
              priorities are refused for a moment, so that the room goes to it
    outlook   the claimer's view: how many calls each model has room for now

Every operation locks the model's row (``ModelCapacity``), changes it with the arithmetic of
``buckets.py`` and saves it, so every worker of the fleet shares one set of buckets. A model
without ``RATE_LIMITS`` and without a row (the API never sent rate-limit headers, never
answered 429) costs no database access at all.
"""

from __future__ import annotations

import abc
import datetime
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TypeVar

from durable_agents.flow.capacity import buckets
from durable_agents.flow.capacity.buckets import Estimate
from durable_agents.flow.capacity.headers import Observed
from durable_agents.flow.capacity.limits import ModelLimits, configured_limits
from durable_agents.models import CapacityEventKind, ModelCapacity

T = TypeVar("T")

# How long a worker trusts that a model has no row (no limits configured or learned): a
# worker that learns limits creates the row, and the others see it within this time. When it
# is over, one call of the process reads the row again; the calls that come meanwhile go on
# trusting it until that read is done (a thousand calls at once would otherwise all queue on
# the row's lock, each holding a pooled connection while it waits).
ABSENT_TTL_SECONDS = 2.0
# The longest a run refused for want of room is held back before it is claimable again (a
# paused model holds its runs until the pause ends).
MAX_HOLD_SECONDS = 1.0
# The shortest wait a refused run is given: below it, handing a run back costs more than
# the wait.
MIN_WAIT_SECONDS = 0.05


@dataclass(frozen=True)
class Grant:
    """The answer to ``acquire``: granted, or how long to wait and why."""

    model: str
    estimate: Estimate
    granted: bool
    wait_seconds: float = 0.0
    reason: str = ""
    # Whether the model has buckets at all: an unlimited grant needs no settling.
    limited: bool = False


@dataclass(frozen=True)
class Outlook:
    """The claimer's view of capacity: calls each model has room for now (None: not limited,
    any number), and how soon one more call fits where none does."""

    calls: dict[str, int | None] = field(default_factory=dict)
    next_in: float = 0.0

    @property
    def room(self) -> int | None:
        """Calls the models have room for in all, or None when one of them is not limited
        (any number of its runs may be claimed)."""
        if not self.calls or any(calls is None for calls in self.calls.values()):
            return None
        return sum(calls for calls in self.calls.values() if calls is not None)


class CapacityGate(abc.ABC):
    """Grants of model capacity shared by the fleet; see the flow above."""

    def __init__(self) -> None:
        self._absent: dict[str, float] = {}
        # The models whose row one call of this process is reading again (``_known_absent``).
        self._rereading: set[str] = set()
        self._absent_lock = threading.Lock()

    # -- what a store provides ---------------------------------------------------------------

    @abc.abstractmethod
    def _locked(
        self, model: str, create: bool
    ) -> AbstractContextManager[tuple[ModelCapacity | None, datetime.datetime]]:
        """The model's row locked for update and the store's time (the database's clock),
        the row created first if ``create``; saved on a clean exit when ``save`` was called."""

    @abc.abstractmethod
    def _save(self, row: ModelCapacity) -> None:
        """Store ``row`` (inside ``_locked``)."""

    @abc.abstractmethod
    def _rows(self) -> tuple[list[ModelCapacity], datetime.datetime]:
        """Every model's row (unlocked) and the store's time."""

    @abc.abstractmethod
    def _record_event(self, model: str, kind: str, seconds: float | None) -> None:
        """Append a ``CapacityEvent``."""

    # -- the flow ----------------------------------------------------------------------------

    def acquire(
        self, model: str, estimate: Estimate, priority: int, max_wait: float = 0.0
    ) -> Grant:
        """Capacity for one call of ``priority``. ``max_wait``: when the buckets would have
        room within that many seconds, the call reserves it now (the buckets go into debt)
        and is granted with ``wait_seconds`` to wait before it goes out; longer waits, a
        pause and higher priorities waiting are refusals."""
        limits = configured_limits(model)
        if limits is None and self._known_absent(model):
            return Grant(model, estimate, granted=True)

        def grant(row: ModelCapacity | None, now: datetime.datetime) -> Grant:
            assert row is not None
            self._configure(row, limits)
            if limits is None and not _limited(row) and row.calls == 0:
                buckets.start_probing(row)  # never called: ramp up until the headers say
            if not _limited(row) and not _paused(row, now):
                self._mark_absent(model)
                return Grant(model, estimate, granted=True)
            buckets.refill(row, now)
            refused = buckets.refusal(row, estimate, priority, now)
            reserve = (
                refused is not None
                and refused.kind is buckets.RefusalKind.BUCKET
                and refused.seconds <= max_wait
            )
            if refused is not None and not reserve:
                wait = max(refused.seconds, MIN_WAIT_SECONDS)
                if refused.kind is not buckets.RefusalKind.PAUSED:
                    # Short of room (or behind a higher priority): claimable again soon, and
                    # claimed in priority order as room returns; the claimer takes no more
                    # runs than there is room for, so they do not come back all at once.
                    wait = min(wait, MAX_HOLD_SECONDS)
                # The run is handed back for this long: counted, and its priority served
                # first meanwhile (in the same write: no second round trip).
                buckets.note_waiting(row, priority, wait, now)
                self._save(row)
                return Grant(model, estimate, False, wait, refused.reason, limited=True)
            buckets.take(row, estimate)
            self._save(row)
            wait = refused.seconds if refused is not None else 0.0
            return Grant(model, estimate, True, wait, limited=True)

        return self._with_row(model, True, grant)

    def settle(self, grant: Grant, used: tuple[int, int] | None, observed: Observed | None) -> None:
        """The call of ``grant`` ended: ``used`` is (input tokens charged, output tokens) from
        its usage, None if it charged nothing; ``observed``, its rate-limit headers."""
        if not grant.limited and observed is None:
            return
        limits = configured_limits(grant.model)

        def apply(row: ModelCapacity | None, now: datetime.datetime) -> None:
            assert row is not None
            self._configure(row, limits)
            buckets.refill(row, now)
            if grant.limited:
                buckets.give_back(row, grant.estimate, used)
            if observed is not None:
                buckets.learn(row, observed)
            elif row.probing and used is not None:
                buckets.stop_probing(row)  # an answer without headers: the API sends none
            self._save(row)

        self._with_row(grant.model, True, apply)

    def rate_limited(
        self, model: str, retry_after: float, observed: Observed | None, priority: int = 0
    ) -> None:
        """A 429: the model pauses for the whole fleet for ``retry_after`` seconds; the run of
        ``priority`` that got it is handed back to wait for the pause's end."""
        limits = configured_limits(model)

        def apply(row: ModelCapacity | None, now: datetime.datetime) -> None:
            assert row is not None
            self._configure(row, limits)
            buckets.refill(row, now)
            if observed is not None:
                buckets.learn(row, observed)
            buckets.pause(row, retry_after, now)
            buckets.note_waiting(row, priority, retry_after, now)
            self._save(row)

        self._with_row(model, True, apply)
        self._record_event(model, CapacityEventKind.RATE_LIMITED, retry_after)

    def overloaded(self, model: str) -> None:
        """A 529: the API is busy for everyone; recorded, the fleet's share unchanged."""
        self._record_event(model, CapacityEventKind.OVERLOADED, None)

    def queued(self, model: str, priority: int) -> None:
        """Runs of ``priority`` wait to be claimed for this model: lower priorities are
        refused its capacity for a moment, so that the claim finds room for them."""

        def apply(row: ModelCapacity | None, now: datetime.datetime) -> None:
            if row is not None and (
                row.waiting_priority is None
                or row.waiting_priority_until is None
                or row.waiting_priority_until <= now
                or row.waiting_priority <= priority
            ):
                buckets.note_waiting(row, priority, 0.0, now, count=False)
                self._save(row)

        self._with_row(model, False, apply)

    def outlook(self, models: set[str]) -> Outlook:
        """Room for calls to each of ``models`` now: a model without a row has the burst of its
        ``RATE_LIMITS`` (a full bucket), or no limit at all."""
        rows, now = self._rows()
        by_model = {row.model: row for row in rows if row.model in models}
        calls: dict[str, int | None] = {}
        next_in = 0.0
        for model in models:
            row = by_model.get(model)
            if row is None:
                calls[model] = _full_bucket(configured_limits(model))
                continue
            self._configure(row, configured_limits(model))
            # A row without limits is still paused after a 429; once that is over it has
            # room for any number of calls.
            room, wait = buckets.calls_available(row, now)
            calls[model] = None if room >= buckets.UNLIMITED else room
            if room == 0:
                next_in = wait if next_in == 0 else min(next_in, wait)
        return Outlook(calls, next_in)

    # -- helpers -----------------------------------------------------------------------------

    def _with_row(
        self,
        model: str,
        create: bool,
        then: Callable[[ModelCapacity | None, datetime.datetime], T],
    ) -> T:
        try:
            with self._locked(model, create) as (row, now):
                if row is None:
                    self._mark_absent(model)
                else:
                    self._forget_absent(model)
                return then(row, now)
        finally:
            with self._absent_lock:
                self._rereading.discard(model)

    @staticmethod
    def _configure(row: ModelCapacity, limits: ModelLimits | None) -> None:
        if limits is not None:
            buckets.configure(row, limits)
        elif row.configured:
            # RATE_LIMITS no longer names the model: no limits until the API's headers teach
            # them again.
            row.configured = False
            for limit_field, _ in buckets.BUCKETS:
                setattr(row, limit_field, None)

    def _known_absent(self, model: str) -> bool:
        """Whether ``model`` is known to have no limits. Past ``ABSENT_TTL_SECONDS`` the first
        call to ask reads the row again (False: it goes on to ``_with_row``); until that read
        ends, the others are told what was known."""
        with self._absent_lock:
            until = self._absent.get(model)
            if until is None:
                return False
            if until > time.monotonic() or model in self._rereading:
                return True
            self._rereading.add(model)
            return False

    def _mark_absent(self, model: str) -> None:
        with self._absent_lock:
            self._absent[model] = time.monotonic() + ABSENT_TTL_SECONDS

    def _forget_absent(self, model: str) -> None:
        with self._absent_lock:
            self._absent.pop(model, None)


def _limited(row: ModelCapacity) -> bool:
    return any(getattr(row, limit_field) is not None for limit_field, _ in buckets.BUCKETS)


def _paused(row: ModelCapacity, now: datetime.datetime) -> bool:
    return row.paused_until is not None and row.paused_until > now


def _full_bucket(limits: ModelLimits | None) -> int | None:
    """Calls a full bucket of ``limits`` has room for (requests alone: what a call of the
    model charges in tokens is not known before its first answer). Without limits, the model
    was never called: as many calls as its probe lets through (``buckets.start_probing``)."""
    if limits is None:
        return int(buckets.PROBE_REQUESTS_PER_MINUTE * buckets.PROBE_BURST_SECONDS / 60.0)
    if limits.requests_per_minute is None:
        return None
    return max(int(limits.requests_per_minute * limits.burst_seconds / 60.0), 1)


def new_row(model: str, now: datetime.datetime) -> ModelCapacity:
    return ModelCapacity(model=model, refilled_at=now, updated_at=now)


__all__ = ["CapacityGate", "Estimate", "Grant", "Outlook", "new_row"]
