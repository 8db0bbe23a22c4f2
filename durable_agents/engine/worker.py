"""The worker process: one claimer, many slots, one heartbeat, one listener.

The state machine of a run is in ``runner.py``; this module only decides *which* run a slot
works on and keeps the leases of the runs it holds alive. The whole flow:

    claimer (the main thread)  claims up to as many runs as slots are free, in one statement,
                               whenever LISTEN says a run became claimable, a slot frees up
                               while runs wait, or POLL_INTERVAL passes; queues the claims
    slots (``concurrency``)    each advances one run at a time (``runner.advance_run``); the
                               statement that commits a run's last step may claim its next run
                               (while every other slot is busy and runs may be waiting:
                               ``claimable.py``; with a slot idle it wakes the claimer instead)
    heartbeat                  one statement per beat renews every lease the worker holds and
                               its row in agent_worker (idle or not), and names the runs that
                               were cancelled or taken over: their slots are interrupted
    its row                    written at start (refused while a live worker holds the id),
                               deleted at a clean stop; a killed worker's row ages out
    listener (PostgreSQL)      LISTEN: wakes the claimer, interrupts a cancelled run at once
    services                   what else the worker runs, registered with it
                               (``worker_services``): the schedules' firer, a few times a
                               second (``schedule_firing``: one indexed statement when none is
                               due); the wake of stranded parents at start (``housekeeping``)

A slot holds a database connection only while it talks to the database (``db.release``), so
on PostgreSQL a worker with a thousand runs in flight shares ``DB_POOL_SIZE`` connections.
Every claim, renewal and release goes through the store (``store.current()``, or the one the
worker was given: unit tests pass an ``InMemoryStore``), and every duty towards connections
through ``connections`` (nothing to do for a store without a database:
``Store.holds_connections``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import signal
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from django.db import DatabaseError, connection
from django.db.backends.base.base import BaseDatabaseWrapper
from django.utils import timezone

from durable_agents import observers
from durable_agents._internal import calls, db, inbox_bell
from durable_agents._internal.interrupt import Interrupt
from durable_agents.conf import app_settings
from durable_agents.declare.agents import registry
from durable_agents.engine import credentials
from durable_agents.engine import services as worker_services
from durable_agents.engine.claimable import ClaimableHint
from durable_agents.engine.connections import DatabaseConnections, WorkerConnections
from durable_agents.engine.inbox_hint import InboxHint, Mark
from durable_agents.engine.outage import LeaseClock
from durable_agents.engine.runner import SHUTDOWN, Disposition, advance_run
from durable_agents.engine.shutdown_signals import SignalRelay
from durable_agents.exceptions import InvalidArgument, WorkerIdInUse
from durable_agents.logging import bind_run
from durable_agents.models import MAX_WORKER_ID, AgentWorker
from durable_agents.store import Claim, LeaseLoss, NextClaim, Store, current, dialect_store
from durable_agents.store.base import Presence, RunId

logger = logging.getLogger("durable_agents.worker")


def default_worker_id() -> str:
    # A host name may be 255 characters; the id fits agent_worker.id.
    return f"{socket.gethostname()[:150]}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


# The workers of this process between their registration and their stop (their instances): a
# row of this process's host and pid under another instance is a worker that ended here.
_RUNNING: set[uuid.UUID] = set()
_RUNNING_LOCK = threading.Lock()


def _host() -> str:
    return socket.gethostname()[:255]


def checked_worker_id(worker_id: str) -> str:
    """A worker id as given (``runagents --worker-id``): printable text that fits the lease
    owner and agent_worker columns; ``InvalidArgument`` says what is wrong otherwise."""
    if not isinstance(worker_id, str) or not worker_id.strip():
        raise InvalidArgument("a worker id is a non-empty string")
    if len(worker_id) > MAX_WORKER_ID:
        raise InvalidArgument(
            f"a worker id has at most {MAX_WORKER_ID} characters; this one has {len(worker_id)}"
        )
    if not worker_id.isprintable():
        raise InvalidArgument(
            "a worker id cannot contain control characters (NUL, newlines, ...): "
            f"{worker_id[:40]!r}"
        )
    return worker_id


def defined_versions() -> tuple[tuple[dict[str, str], ...], list[dict[str, Any]]]:
    """What this process's code defines, as its worker row says it (agent, version, model,
    fingerprint) and as agent_version records it (with the digests)."""
    agents = registry.all()
    versions = tuple(
        {"agent": a.name, "version": a.version, "model": a.model, "fingerprint": a.fingerprint()}
        for a in agents
    )
    definitions = [{"agent": a.name, "version": a.version, **a.digests()} for a in agents]
    return versions, definitions


@dataclass
class _Held:
    claim: Claim
    interrupt: Interrupt = field(default_factory=Interrupt)
    # How long the lease holds as this worker last renewed it (the claim, a step, a beat).
    lease: LeaseClock = field(init=False)

    def __post_init__(self) -> None:
        self.lease = LeaseClock(self.claim.lease_seconds, self.claim.leased_at)


@dataclass
class WorkerStats:
    claims: int = 0
    dispositions: dict[str, int] = field(default_factory=dict)


# Most runs one claim statement takes: a worker starting with a thousand free slots fills
# them in a few statements, none of which holds row locks for long.
MAX_CLAIM_BATCH = 100
# Runs a worker claims before it knows their models (it has claimed nothing lately).
FIRST_CLAIMS = 10
# Runs to claim when no model limits them.
NO_LIMIT = 1 << 30
# The claimer waiting for model capacity looks again after at least this long.
MIN_CAPACITY_WAIT = 0.02
# How long after a timer comes due an idle worker claims (the database clock's resolution).
TIMER_MARGIN_SECONDS = 0.002
# How often a claimer short of capacity marks the first claimable run's priority (the mark
# lasts buckets.PRIORITY_HOLD_SECONDS, longer than this).
FIRST_IN_LINE_SECONDS = 0.5
# How long a model counts as one the claimable runs use after a run of it was last claimed.
MODELS_SEEN_SECONDS = 300.0
# After a failed heartbeat (the database restarts, or fails over), the next beat is tried this
# soon rather than a whole period later: the leases must be renewed as soon as it answers.
BEAT_RETRY_SECONDS = 1.0
# When the shutdown grace ends, the slots whose steps are abandoned get this long to hand their
# runs back themselves (an irreversible call's intent records why its outcome is unknown); the
# worker releases whatever is still held after it.
HANDBACK_SECONDS = 2.0


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _outcomes(dispositions: dict[str, int]) -> str:
    """ ": succeeded 3, dead 1" (plain words, not the enum's repr), or "" for none."""
    if not dispositions:
        return ""
    return ": " + ", ".join(f"{name!s} {count}" for name, count in dispositions.items())


class Worker:
    def __init__(
        self,
        *,
        worker_id: str | None = None,
        concurrency: int = 1,
        burst: bool = False,
        max_runs: int | None = None,
        lease_seconds: float | None = None,
        poll_interval: float | None = None,
        heartbeat_seconds: float | None = None,
        handle_signals: bool = True,
        grace_seconds: float | None = None,
        listen: bool | None = None,
        store: Store | None = None,
        schedules: bool | None = None,
    ) -> None:
        """``store``: where the runs live (default: each thread's ``store.current()``, as
        ``advance_run``'s); claims, heartbeats and releases go through it. ``schedules``:
        whether this worker fires agent schedules (default: yes, unless it is a burst worker
        or was given a store: schedules live in the database)."""
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        self.store = store
        # What this worker must do with connections (nothing, on a store without a database).
        self.connections: WorkerConnections = (
            DatabaseConnections()
            if store is None or store.holds_connections
            else WorkerConnections()
        )
        self.worker_id = default_worker_id() if worker_id is None else checked_worker_id(worker_id)
        # This process's, in its agent_worker row: another process started with the same id
        # never beats this one's row.
        self.instance = uuid.uuid4()
        # The agent versions this worker's code defines, as registered when it starts.
        self._versions: tuple[dict[str, str], ...] = ()
        self._definitions: list[dict[str, Any]] = []
        self._registered = False
        self.concurrency = concurrency
        self.burst = burst
        self.max_runs = max_runs
        self.lease_seconds = float(lease_seconds or app_settings.LEASE_SECONDS)
        self.poll_interval = float(
            app_settings.POLL_INTERVAL if poll_interval is None else poll_interval
        )
        # Renew well before expiry: a third of the lease leaves two missed beats of slack.
        self.heartbeat_seconds = min(
            float(heartbeat_seconds or app_settings.HEARTBEAT_SECONDS), self.lease_seconds / 3
        )
        self.handle_signals = handle_signals
        self.grace_seconds = float(
            app_settings.SHUTDOWN_GRACE_SECONDS if grace_seconds is None else grace_seconds
        )
        self.listen = bool(app_settings.LISTEN) if listen is None else listen
        self.schedules = (not burst and store is None) if schedules is None else schedules
        self._init_state()

    def _init_state(self) -> None:
        """What the worker keeps while it runs: its stop signals, its slots' claims and
        runs, what it learned of capacity, its listener and heartbeat."""
        # Set by the first signal: claim nothing new, stop each run after its current step.
        self.stopping = threading.Event()
        # Set by a second signal (or the end of the grace period): abandon what is in flight.
        self.abandon = threading.Event()
        # What stopped the worker, as a person reads it ("SIGTERM"), once it stops.
        self.stopped_by = ""
        self.stats = WorkerStats()
        self._held: dict[RunId, _Held] = {}
        # The last look at model capacity found less room than this worker has slots.
        self._capacity_short = False
        # When the claimer last marked the first claimable run's priority (monotonic).
        self._first_in_line_at = -FIRST_IN_LINE_SECONDS
        # The models of runs claimed lately, and when each was last seen (monotonic).
        self._models_seen: dict[str, float] = {}
        self._lock = threading.Lock()
        # Set when a slot thread ended by an exception: the worker stops and exits non-zero,
        # so that its supervisor restarts it instead of leaving it running short of a slot.
        self.slot_died = threading.Event()
        # Claims waiting for a slot (None tells a slot to end).
        self._claims: queue.SimpleQueue[Claim | None] = queue.SimpleQueue()
        # Slots working on a run, plus claims queued for one.
        self._busy = 0
        # Wakes the claimer: a notification, or a slot freed while runs may be waiting.
        self._wake = threading.Event()
        # The last claim filled every free slot: more runs may be claimable right now.
        self._backlog = False
        # Whether a slot's last step should try to claim the next run (``claimable.py``).
        self._claimable = ClaimableHint(self._hears_notifications)
        # Whether a message may wait in a held run's inbox since its last look (inbox_hint.py).
        self.inbox = InboxHint(self._listening_generation)
        # A burst worker whose key the API refuses stops claiming for good.
        self._burst_over = False
        self.listener: db.Listener | None = None
        # The heartbeat's and the listener's threads, once started: they end shortly after
        # ``run`` returns (whoever embeds a worker may join them).
        self.background_threads: list[threading.Thread] = []
        # Heartbeats in a row that failed (the database is away): the next is tried sooner.
        self._failed_beats = 0

    # -- lifecycle -------------------------------------------------------------------------

    def _store(self, using: Any = None) -> Store:
        """The store to call now: the worker's own, else the store of this thread's default
        connection, or of ``using`` (the heartbeat's own connection)."""
        if self.store is not None:
            return self.store
        return current() if using is None else dialect_store(using.vendor)

    def in_flight(self) -> int:
        """How many runs this worker holds now (claimed, not yet handed back or ended)."""
        with self._lock:
            return len(self._held)

    def run(self) -> int:
        """Work until burst-empty, max_runs, or a signal. Returns the exit code: 0, or 1 when
        a slot died of an unexpected error (the worker stopped because of it)."""
        try:
            return self._run()
        finally:
            # Whatever ended it: a later worker of this process may take its id at once.
            with _RUNNING_LOCK:
                _RUNNING.discard(self.instance)

    def _run(self) -> int:
        relay: SignalRelay | None = None
        if self.handle_signals and threading.current_thread() is threading.main_thread():
            relay = SignalRelay(self._on_signal)
            relay.install()
        # Messages this process queues are heard at once (as they commit), not only notified.
        inbox_bell.listen(self.inbox.heard)
        try:
            return self._work_until_stopped()
        finally:
            inbox_bell.stop_listening(self.inbox.heard)
            if relay is not None:
                relay.uninstall()

    def _work_until_stopped(self) -> int:
        logger.info(
            "worker %s started: concurrency=%d lease=%.1fs heartbeat=%.1fs burst=%s%s",
            self.worker_id,
            self.concurrency,
            self.lease_seconds,
            self.heartbeat_seconds,
            self.burst,
            self.connections.pool_note(),
        )
        if not self._registered:
            self.register()
        services = worker_services.registered()
        for service in services:
            service.starting(self)
        self._start_background(self._heartbeat, "da-heartbeat")
        self._start_listener()
        threads = [t for service in services if (t := service.start(self)) is not None]
        slots = [
            threading.Thread(target=self._slot, name=f"da-slot-{i}", daemon=True)
            for i in range(self.concurrency)
        ]
        for slot in slots:
            slot.start()
        try:
            self._claim_loop()
        except BaseException:
            logger.critical("worker %s: the claimer died", self.worker_id, exc_info=True)
            self.slot_died.set()
            self.stopping.set()
        if self.stopping.is_set():
            self._drain(slots)
        self.stopping.set()
        for _ in slots:
            self._claims.put(None)
        # Slots are idle by now (or were abandoned by the drain): let them close their
        # connections, within a bound a hung tool cannot stretch.
        deadline = time.monotonic() + 2.0
        for slot in slots:
            slot.join(timeout=max(0.0, deadline - time.monotonic()))
        for thread in threads:
            # A service's thread looks at ``stopping`` often (the firer: every TICK_SECONDS):
            # a second is plenty.
            thread.join(timeout=1.0)
        self.unregister()
        self.connections.close()
        logger.info(
            "worker %s stopped after %d claims%s",
            self.worker_id,
            self.stats.claims,
            _outcomes(self.stats.dispositions),
        )
        if self.slot_died.is_set():
            logger.critical("worker %s exits with status 1: a slot died", self.worker_id)
            return 1
        return 0

    def presence(self) -> Presence:
        """This worker as its row in agent_worker says it, now."""
        return Presence(
            worker_id=self.worker_id,
            instance=self.instance,
            host=_host(),
            pid=os.getpid(),
            concurrency=self.concurrency,
            versions=self._versions,
            alive_seconds=self.lease_seconds,
            runs_held=self.in_flight(),
            draining=self.stopping.is_set(),
        )

    def register(self) -> None:
        """Write this worker's row (and record the versions it defines); ``WorkerIdInUse``
        when a live worker of another process holds the id. A row under the id that stops
        beating is a worker that was killed (a pod restarted under its name): its row is taken
        over once it ages out, within one of its leases; a row that beats meanwhile is a live
        worker, and this one refuses to start. With the database away, the worker starts all
        the same: its first beat that reaches the database writes the row."""
        self._versions, self._definitions = defined_versions()
        # Counted as running from before its row is written: another worker of this process
        # starting at the same instant under the same id must see this one as live, not as
        # one that ended here (whose row it would take over).
        with _RUNNING_LOCK:
            _RUNNING.add(self.instance)
        try:
            holder = self._register_once()
            if holder is not None and self._stopped_here(holder):
                # An earlier worker of this very process that ended without removing its row
                # (an exception out of ``run``): nothing beats it any more.
                gone = dataclasses.replace(self.presence(), instance=holder.instance)
                self._store().unregister_worker(gone, [])
                holder = self._register_once()
            if holder is not None:
                holder = self._wait_until_aged_out(holder)
        except DatabaseError as exc:
            logger.error("worker %s: its row could not be written yet (%s)", self.worker_id, exc)
            holder = None
        except BaseException:
            with _RUNNING_LOCK:
                _RUNNING.discard(self.instance)
            raise
        if holder is not None:
            with _RUNNING_LOCK:
                _RUNNING.discard(self.instance)
            raise WorkerIdInUse(
                f"worker id {self.worker_id!r} is in use by a live worker: pid {holder.pid} on "
                f"host {holder.host!r}, started {holder.started_at:%Y-%m-%d %H:%M:%S %Z}, last "
                f"heartbeat {holder.beat_at:%H:%M:%S %Z}. Give this worker another "
                "--worker-id, or stop that one."
            )
        self._registered = True

    def _register_once(self) -> AgentWorker | None:
        return self._store().register_worker(self.presence(), self._definitions)

    @staticmethod
    def _stopped_here(holder: AgentWorker) -> bool:
        with _RUNNING_LOCK:
            running = holder.instance in _RUNNING
        return holder.pid == os.getpid() and holder.host == _host() and not running

    def _wait_until_aged_out(self, holder: AgentWorker) -> AgentWorker | None:
        """Wait, at most until the holder's row ages out, for a sign of life: a new beat
        (it is live: the holder is returned) or the row free (None: this worker's now)."""
        instance, last_beat = holder.instance, holder.beat_at
        wait = max(0.0, (holder.alive_until - timezone.now()).total_seconds()) + 0.5
        logger.warning(
            "worker %s: a worker with this id (pid %s on %s) beat last at %s; waiting up to "
            "%.0fs to see whether it is alive or was killed",
            self.worker_id,
            holder.pid,
            holder.host,
            last_beat,
            wait,
        )
        deadline = time.monotonic() + wait
        step = min(1.0, self.heartbeat_seconds)
        current: AgentWorker | None = holder
        while current is not None:
            if current.instance != instance or current.beat_at != last_beat:
                return current  # it beats: a live worker
            if time.monotonic() >= deadline:
                return current
            time.sleep(step)
            current = self._register_once()
        return None

    def unregister(self) -> None:
        """A clean stop: the row goes (a killed worker's row ages out instead)."""
        with _RUNNING_LOCK:
            _RUNNING.discard(self.instance)
        if not self._registered:
            return
        try:
            self._store().unregister_worker(self.presence(), self._definitions)
        except DatabaseError as exc:
            logger.warning("worker %s: its row stays until it ages out (%s)", self.worker_id, exc)
        self._registered = False

    def stop(self) -> None:
        # Called from the signals' relay thread (engine/shutdown_signals.py), never from a
        # signal handler: it only sets events.
        self.stopping.set()
        self._wake.set()

    def _on_signal(self, signum: int) -> None:
        if self.stopping.is_set():
            logger.info("worker %s: second signal, abandoning the steps in flight", self.worker_id)
            self.abandon.set()
            return
        self.stopped_by = _signal_name(signum)
        logger.info(
            "worker %s got %s: draining (steps in flight get %.1fs to commit)",
            self.worker_id,
            self.stopped_by,
            self.grace_seconds,
        )
        self.stop()

    def _drain(self, slots: list[threading.Thread]) -> None:
        """Let steps in flight finish within the grace period, then abandon the rest."""
        for _ in slots:
            self._claims.put(None)  # after any queued claim: it is handed back unstarted
        # Runs whose only work now is a pause (before a retried model call) are handed back at
        # once; what is in flight goes on for the grace period. A run claimed from now on is
        # drained by its slot (``_advance``).
        with self._lock:
            held = list(self._held.values())
        for item in held:
            item.interrupt.drain()
        deadline = time.monotonic() + self.grace_seconds
        while any(slot.is_alive() for slot in slots):
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self.abandon.wait(min(0.05, remaining)):
                break
        in_flight = self.in_flight()
        if in_flight:
            logger.warning(
                "worker %s: %s with %d step(s) in flight; abandoning them",
                self.worker_id,
                "a second signal came"
                if self.abandon.is_set()
                else f"the shutdown grace of {self.grace_seconds:g}s ran out",
                in_flight,
            )
        self._release_all(self._abandoned_because())

    def _abandoned_because(self) -> str:
        """Why the steps still in flight are abandoned, as a person reads it on what they
        leave behind (an irreversible call's intent whose outcome is unknown)."""
        how = f" ({self.stopped_by})" if self.stopped_by else ""
        if self.abandon.is_set():
            return (
                f"worker {self.worker_id} was shutting down{how} and a second signal abandoned "
                f"the call before its shutdown grace of {self.grace_seconds:g}s ran out"
            )
        return (
            f"worker {self.worker_id} was shutting down{how} and its shutdown grace of "
            f"{self.grace_seconds:g}s (SHUTDOWN_GRACE_SECONDS, or runagents --grace-seconds) "
            "ran out while the call was in flight"
        )

    def _release_all(self, detail: str = "") -> None:
        """Hand every held run back at once, uncounted: the next worker claims it directly.
        A step still in flight cannot commit afterwards: its fence no longer holds.

        Each slot is interrupted first and given HANDBACK_SECONDS to hand its run back itself
        (an abandoned irreversible call parks its run on its intent, marked unknown with
        ``detail``); the worker releases what is still held then."""
        with self._lock:
            held = list(self._held.values())
        for item in held:
            item.interrupt.trigger(SHUTDOWN, detail)
        deadline = time.monotonic() + HANDBACK_SECONDS
        while self.in_flight() and time.monotonic() < deadline:
            time.sleep(0.01)
        with self._lock:
            held = list(self._held.values())
        for item in held:
            with bind_run(item.claim.run_id):
                try:
                    if self._store().release_lease(item.claim, count_claim=False):
                        logger.info("released run %s", item.claim.run_id)
                except DatabaseError:
                    logger.exception(
                        "could not release run %s; its lease will expire", item.claim.run_id
                    )
        # Claims still queued for a slot never started: hand them back too.
        while True:
            try:
                claim = self._claims.get_nowait()
            except queue.Empty:
                break
            if claim is None:
                continue
            try:
                self._store().release_lease(claim, count_claim=False)
            except DatabaseError:
                logger.warning("could not release run %s; its lease will expire", claim.run_id)
        self.connections.close()

    # -- the claimer -----------------------------------------------------------------------

    def _take_tickets(self, wanted: int) -> int:
        """Reserve up to ``wanted`` claims under ``max_runs``; returns how many."""
        with self._lock:
            if self.max_runs is not None:
                wanted = min(wanted, self.max_runs - self.stats.claims)
            wanted = max(wanted, 0)
            self.stats.claims += wanted
            return wanted

    def _take_ticket(self) -> bool:
        return self._take_tickets(1) == 1

    def _forget_tickets(self, count: int = 1) -> None:
        with self._lock:
            self.stats.claims -= count

    def _forget_ticket(self) -> None:
        self._forget_tickets(1)

    def _claim_loop(self) -> None:
        """Claim runs for free slots until stopping (or, in burst mode, until nothing is
        claimable and no slot is busy; with max_runs, until that many were claimed and done)."""
        failed_claims = 0  # in a row: the database is unreachable or refusing
        idle = True
        while not self.stopping.is_set() and not self._burst_over:
            with self._lock:
                free = self.concurrency - self._busy
                busy = self._busy
            if free <= 0:
                # Every slot is busy: a slot that frees up wakes us (runs may be waiting).
                self._backlog = True
                self._wake.wait(self.poll_interval)
                self._wake.clear()
                continue
            if self._paused_for_credentials(busy):
                continue
            room, next_in = self._capacity_room()
            if room == 0:
                # No model the fleet uses has room for a call: claim when one has.
                self._wake.wait(min(max(next_in, MIN_CAPACITY_WAIT), self.poll_interval))
                self._wake.clear()
                continue
            wanted = self._take_tickets(min(free, MAX_CLAIM_BATCH, room))
            if wanted == 0:  # max_runs reached: end once the last run is done
                if busy == 0:
                    return
                self._wake.wait(self.poll_interval)
                self._wake.clear()
                continue
            # Cleared before the claim: a notification during it wakes the wait below at once.
            self._wake.clear()
            epoch = self._claimable.epoch()
            # Before the claim's inbox look (read_ahead): a message heard after it is news.
            inbox_mark = self.inbox.mark()
            try:
                if idle:
                    # CONN_MAX_AGE and CONN_HEALTH_CHECKS, as between two requests.
                    self.connections.refresh()
                claims = self._store().claim_runs(self.worker_id, self.lease_seconds, wanted)
                # Claimed again (woken, handed back): their resumes' first reads, per batch.
                claims = self._store().read_ahead(claims)
            except DatabaseError as exc:
                self._forget_tickets(wanted)
                failed_claims += 1
                # One line when the database goes away, not a traceback every poll.
                log = logger.error if failed_claims == 1 else logger.debug
                log(
                    "claim failed (%s: %s); retrying every %.1fs until the database answers",
                    type(exc).__name__,
                    " ".join(str(exc).split()),
                    max(self.poll_interval, 0.5),
                    exc_info=logger.isEnabledFor(logging.DEBUG),
                )
                self.connections.close()
                self.stopping.wait(max(self.poll_interval, 0.5))
                continue
            finally:
                self.connections.release()
            if failed_claims:
                logger.info("claims work again after %d failed attempts", failed_claims)
                failed_claims = 0
            self._forget_tickets(wanted - len(claims))
            if claims:
                self._hand_out(claims, inbox_mark)
            idle = not claims
            self._backlog = len(claims) == wanted
            self._claimable.claimed(epoch, asked=wanted, got=len(claims))
            if self._backlog:
                continue  # more may be claimable: fill the remaining slots now
            if self.burst:
                with self._lock:
                    if self._busy == 0:
                        return
            self._wake.wait(self._idle_wait())

    def _hand_out(self, claims: list[Claim], inbox_mark: Mark) -> None:
        """Queue ``claims`` for the slots; the inbox looks of the claim and of its read-ahead
        count as the runs' last looks (taken at ``inbox_mark``)."""
        self._saw_models(claims)
        for claim in claims:
            self._claim_looked(claim, inbox_mark)
        with self._lock:
            self._busy += len(claims)
        for claim in claims:
            self._claims.put(claim)

    def _claim_looked(self, claim: Claim, inbox_mark: Mark) -> None:
        """What the claim (or its read-ahead, after it) saw in the run's inbox, as the run's
        last look, begun at ``inbox_mark`` (taken before the claim was sent)."""
        found = claim.messages_waiting if claim.ahead is None else claim.ahead.messages_waiting
        self.inbox.looked(claim.run_id, inbox_mark, found=found)

    def _idle_wait(self) -> float:
        """How long the claimer waits after a claim that found too few runs: POLL_INTERVAL,
        or until the first timer or timeout of a waiting run comes due if that is sooner (a
        notification ends the wait earlier). A wait due already that the claim did not take
        is not this worker's to take now (another worker's agent version, a full key): the
        claimer does not spin on it. No wait once stopping: stop() sets ``stopping`` before it
        wakes the claimer, and that wake-up may be the one cleared before the claim."""
        if self.stopping.is_set():
            return 0.0
        try:
            due_in = self._store().next_wake_in()
        except DatabaseError:
            return self.poll_interval  # the next claim says what is wrong
        finally:
            self.connections.release()
        if due_in is None or due_in <= 0:
            return self.poll_interval
        # Just past it: the claim compares wake_at <= now().
        return min(self.poll_interval, due_in + TIMER_MARGIN_SECONDS)

    def _paused_for_credentials(self, busy: int) -> bool:
        """The API refuses this process's key (``credentials``): wait out the pause instead of
        claiming runs that would only be handed back. A burst worker ends instead."""
        paused = credentials.pause_remaining()
        if paused <= 0:
            return False
        if self.burst:
            if busy == 0:
                logger.info("worker %s: the burst ends, the API refuses its key", self.worker_id)
                self._burst_over = True
            else:
                self._wake.wait(self.poll_interval)
        else:
            self._wake.wait(paused)
        self._wake.clear()
        return True

    def _capacity_room(self) -> tuple[int, float]:
        """How many runs to claim at most for the models' capacity (``NO_LIMIT`` when a model
        the fleet's agents use has no limits), and how soon there is room where there is
        none. A claim takes no more runs than the buckets have calls for: the others stay
        pending, holding nothing, and are claimed highest priority first when there is room.
        A run that needs no call or finds the room taken meanwhile is handed back (runner)."""
        models = self._models_claimed()
        if not models:
            # Nothing claimed lately: a few runs first, whose models show what to ask about.
            return FIRST_CLAIMS, 0.0
        try:
            outlook = self._store().capacity.outlook(models)
        except DatabaseError:
            return NO_LIMIT, 0.0  # the claim that follows says what is wrong
        room = outlook.room
        self._capacity_short = room is not None and room < self.concurrency
        if self._capacity_short:
            self._claim_first_in_line()
        return (NO_LIMIT if room is None else room), outlook.next_in

    def _claim_first_in_line(self) -> None:
        """Capacity is short: the claimable run first in line (highest priority) asks its
        model's capacity to refuse lower priorities for a moment, so that the next claim
        finds room for it rather than the runs already in slots taking it all. At most once
        per FIRST_IN_LINE_SECONDS: the mark lasts longer than that."""
        now = time.monotonic()
        if now - self._first_in_line_at < FIRST_IN_LINE_SECONDS:
            return
        self._first_in_line_at = now
        try:
            first = self._store().first_claimable()
            if first is not None:
                model, priority = first
                self._store().capacity.queued(model, priority)
        except DatabaseError:
            logger.debug("looking for the first claimable run failed", exc_info=True)

    def _models_claimed(self) -> set[str]:
        """The models of the runs this worker claimed lately: the ones whose capacity decides
        how many runs to claim (a model no claimable run uses must not hold the others)."""
        horizon = time.monotonic() - MODELS_SEEN_SECONDS
        with self._lock:
            for model in [m for m, seen in self._models_seen.items() if seen < horizon]:
                del self._models_seen[model]
            return set(self._models_seen)

    def _saw_models(self, claims: list[Claim]) -> None:
        now = time.monotonic()
        with self._lock:
            for claim in claims:
                self._models_seen[claim.run.model] = now

    def _slots_idle(self) -> bool:
        """Whether a slot has no run and none is queued for it (the slot asking counts as
        busy until its run is over)."""
        with self._lock:
            return self._busy < self.concurrency

    def _slot_freed(self) -> None:
        with self._lock:
            self._busy -= 1
        if self._backlog or self.burst or self.max_runs is not None:
            self._wake.set()

    # -- slots -----------------------------------------------------------------------------

    def _slot(self) -> None:
        try:
            while (claim := self._claims.get()) is not None:
                try:
                    while claim is not None:  # the next run may come with the last step
                        claim = self._work(claim)
                finally:
                    self.connections.release()
                    self._slot_freed()
        except BaseException:
            # Only a bug in this app gets here (a run's own errors are handled in _advance):
            # stop the whole worker, loudly, rather than go on a slot short.
            logger.critical("worker slot %s died", threading.current_thread().name, exc_info=True)
            self.slot_died.set()
            self.stop()
        finally:
            calls.close_caller()
            self.connections.close()

    def _work(self, claim: Claim) -> Claim | None:
        """Advance ``claim``; returns the run claimed with its last step, if any."""
        self._saw_models([claim])
        epoch = 0
        inbox_mark: Mark | None = None

        def take() -> bool:
            # The next run comes with the last step only while capacity is plentiful (else the
            # claimer takes runs as the buckets have room, highest priority first), while runs
            # may be waiting (else the claim would be sent for nothing) and while every other
            # slot is busy: with a slot idle the claimer is woken instead, and takes the
            # waiting runs for all the idle slots, up to a hundred a statement, so that they
            # start at once rather than each waiting for a run in a busy slot to end.
            nonlocal epoch, inbox_mark
            if self.stopping.is_set() or self._capacity_short or not self._claimable.may_wait():
                return False
            if self._slots_idle():
                self._wake.set()
                return False
            epoch = self._claimable.epoch()
            inbox_mark = self.inbox.mark()  # before the claim's look into the inbox
            return self._take_ticket()

        def give_back() -> None:  # the claim found no run
            self._forget_ticket()
            self._claimable.found_none(epoch)

        then_claim = NextClaim(self.worker_id, self.lease_seconds, take=take, give_back=give_back)
        with bind_run(claim.run_id):
            self._advance(claim, then_claim)
        if then_claim.claim is not None and inbox_mark is not None:
            self._claim_looked(then_claim.claim, inbox_mark)
        return then_claim.claim

    def _advance(self, claim: Claim, then_claim: NextClaim) -> None:
        held = _Held(claim)
        with self._lock:
            self._held[claim.run_id] = held
            if self.stopping.is_set():  # _drain() drained the runs held before this one
                held.interrupt.drain()
        logger.info("claimed run %s (attempt %d)", claim.run_id, claim.attempt)
        disposition = Disposition.ERROR
        try:
            disposition = advance_run(
                claim,
                held.interrupt,
                drain=self.stopping,
                then_claim=then_claim,
                store=self.store,
                lease=held.lease,
                inbox=self.inbox,
            )
        except Exception as exc:  # a bug or a database outage: never take the worker down
            logger.exception("run %s: unexpected error", claim.run_id)
            try:
                self.connections.close()
                self._store().release_lease(
                    claim, error=f"worker error: {type(exc).__name__}: {exc}"
                )
            except DatabaseError:
                logger.warning("run %s: could not release; its lease will expire", claim.run_id)
        finally:
            self.inbox.forget(claim.run_id)
            with self._lock:
                self._held.pop(claim.run_id, None)
                self.stats.dispositions[disposition] = (
                    self.stats.dispositions.get(disposition, 0) + 1
                )
            observers.claim_ended(disposition, claim.run_id)

    # -- heartbeat and listener ------------------------------------------------------------

    def _heartbeat(self) -> None:
        """Renew every held lease in one statement per beat; interrupt the slots of runs that
        were cancelled or taken over. On PostgreSQL on its own connection, outside the pool:
        slow tool code holding every pooled connection never delays a renewal."""
        with self.connections.heartbeat() as own:
            retry = min(self.heartbeat_seconds, BEAT_RETRY_SECONDS)
            wait = self.heartbeat_seconds
            while not self.stopping.wait(wait):
                self.beat(own)
                wait = retry if self._failed_beats else self.heartbeat_seconds

    def beat(self, using: BaseDatabaseWrapper | None = None) -> dict[RunId, LeaseLoss]:
        """One heartbeat: renew every lease held and the worker's row (an idle worker beats
        too: its row says it is alive), in one statement; returns the runs that were
        interrupted."""
        with self._lock:
            held = {
                item.claim.run_id: item
                for item in self._held.values()
                if not item.interrupt.is_set()
            }
        presence = self.presence() if self._registered else None
        if not held and presence is None:
            return {}
        sent = time.monotonic()
        try:
            if using is None:
                self.connections.refresh()
            lost = self._store(using or connection).renew_leases(
                self.worker_id,
                [item.claim for item in held.values()],
                self.lease_seconds,
                using,
                presence,
            )
        except DatabaseError as exc:
            self._failed_beats += 1
            # One line when the database goes away, not one per retried beat.
            (logger.error if self._failed_beats == 1 else logger.debug)(
                "heartbeat failed for %d runs (%s: %s); retrying every %.1fs on a new connection",
                len(held),
                type(exc).__name__,
                " ".join(str(exc).split()),
                min(self.heartbeat_seconds, BEAT_RETRY_SECONDS),
            )
            self.connections.close_heartbeat(using)
            return {}
        if self._failed_beats:
            logger.info("heartbeat works again after %d failed beats", self._failed_beats)
            self._failed_beats = 0
        for run_id, item in held.items():
            if run_id not in lost:
                item.lease.renewed(sent)
        for run_id, loss in lost.items():
            item = held[run_id]
            with bind_run(run_id):
                logger.warning("run %s: %s (noticed by the heartbeat)", run_id, loss.value)
            item.interrupt.trigger(loss.value)
        return lost

    def _start_listener(self) -> None:
        if not self.listen:
            return
        self.listener = self.connections.listener(
            self._run_claimable,
            self._cancelled,
            self.stopping,
            on_message=self._message_sent,
            on_inbox=self.inbox.heard,
        )
        if self.listener is None:
            return
        self._start_background(self.listener.serve, "da-listener")

    def _start_background(self, target: Any, name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        self.background_threads.append(thread)
        thread.start()

    def _run_claimable(self) -> None:
        """A run may have become claimable (notified, or the listener is back after a gap)."""
        self._claimable.notified()
        self._wake.set()

    def _hears_notifications(self) -> bool:
        listener = self.listener
        return listener is not None and listener.listening.is_set()

    def _listening_generation(self) -> int | None:
        """The listener's connection while it listens (``InboxHint``), else None."""
        listener = self.listener
        if listener is None or not listener.listening.is_set():
            return None
        return listener.generation

    def _message_sent(self, run_id: str) -> None:
        """A message asks to interrupt the run's model call (``send_message(...,
        policy="interrupt")``): the call in flight, if any, is abandoned; a tool goes on."""
        with self._lock:
            item = next((i for key, i in self._held.items() if str(key) == run_id), None)
        if item is not None:
            item.interrupt.message_arrived()

    def _cancelled(self, run_id: str) -> None:
        """A cancellation notified by the database: interrupt its slot now, not at the next
        heartbeat (the run's fence already refuses any further step)."""
        with self._lock:
            item = next((i for key, i in self._held.items() if str(key) == run_id), None)
        if item is None:
            return
        with bind_run(item.claim.run_id):
            logger.info("run %s was cancelled (notified)", run_id)
        item.interrupt.trigger(LeaseLoss.CANCELLED.value)
