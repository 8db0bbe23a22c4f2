"""The worker process: a loop of claims per slot, a heartbeat thread, signal handling.

The state machine of a run is in ``runner.py``; this module only decides *which* run a slot
works on and keeps the leases of the runs it holds alive.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field

from django.db import DatabaseError, close_old_connections, connection

from durable_agents import calls, leases
from durable_agents.conf import app_settings
from durable_agents.leases import Claim
from durable_agents.logging import bind_run
from durable_agents.models import RunStatus
from durable_agents.runner import Interrupt, advance_run

logger = logging.getLogger("durable_agents.worker")


def default_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


@dataclass
class _Held:
    claim: Claim
    interrupt: Interrupt = field(default_factory=Interrupt)


@dataclass
class WorkerStats:
    claims: int = 0
    dispositions: dict[str, int] = field(default_factory=dict)


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
    ) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        self.worker_id = worker_id or default_worker_id()
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
        # Set by the first signal: claim nothing new, stop each run after its current step.
        self.stopping = threading.Event()
        # Set by a second signal (or the end of the grace period): abandon what is in flight.
        self.abandon = threading.Event()
        self.stats = WorkerStats()
        self._held: dict[object, _Held] = {}
        self._lock = threading.Lock()
        # Set when a slot thread ended by an exception: the worker stops and exits non-zero,
        # so that its supervisor restarts it instead of leaving it running short of a slot.
        self.slot_died = threading.Event()

    # -- lifecycle -------------------------------------------------------------------------

    def run(self) -> int:
        """Work until burst-empty, max_runs, or a signal. Returns the exit code: 0, or 1 when
        a slot died of an unexpected error (the worker stopped because of it)."""
        if self.handle_signals and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, self._on_signal)
        logger.info(
            "worker %s started: concurrency=%d lease=%.1fs heartbeat=%.1fs burst=%s",
            self.worker_id,
            self.concurrency,
            self.lease_seconds,
            self.heartbeat_seconds,
            self.burst,
        )
        heartbeat = threading.Thread(target=self._heartbeat, name="da-heartbeat", daemon=True)
        heartbeat.start()
        slots = [
            threading.Thread(target=self._slot, name=f"da-slot-{i}", daemon=True)
            for i in range(self.concurrency)
        ]
        for slot in slots:
            slot.start()
        while any(slot.is_alive() for slot in slots):
            if self.stopping.wait(0.1):
                break
        if self.stopping.is_set():
            self._drain(slots)
        self.stopping.set()
        logger.info(
            "worker %s stopped after %d claims: %s",
            self.worker_id,
            self.stats.claims,
            self.stats.dispositions,
        )
        if self.slot_died.is_set():
            logger.critical("worker %s exits with status 1: a slot died", self.worker_id)
            return 1
        return 0

    def stop(self) -> None:
        self.stopping.set()

    def _on_signal(self, signum: int, frame: object) -> None:
        if self.stopping.is_set():
            logger.info("worker %s: second signal, abandoning the steps in flight", self.worker_id)
            self.abandon.set()
            return
        logger.info(
            "worker %s got signal %d: draining (steps in flight get %.1fs to commit)",
            self.worker_id,
            signum,
            self.grace_seconds,
        )
        self.stopping.set()

    def _drain(self, slots: list[threading.Thread]) -> None:
        """Let steps in flight finish within the grace period, then abandon the rest."""
        deadline = time.monotonic() + self.grace_seconds
        while any(slot.is_alive() for slot in slots):
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self.abandon.wait(min(0.05, remaining)):
                break
        self._release_all()

    def _release_all(self) -> None:
        """Hand every held run back at once, uncounted: the next worker claims it directly.
        A step still in flight cannot commit afterwards: its fence no longer holds."""
        with self._lock:
            held = list(self._held.values())
        for item in held:
            item.interrupt.trigger("shutdown")
            with bind_run(item.claim.run_id):
                try:
                    if leases.release_lease(item.claim, count_claim=False):
                        logger.info("released run %s", item.claim.run_id)
                except DatabaseError:
                    logger.exception(
                        "could not release run %s; its lease will expire", item.claim.run_id
                    )
        connection.close()

    # -- slots -----------------------------------------------------------------------------

    def _take_ticket(self) -> bool:
        with self._lock:
            if self.max_runs is not None and self.stats.claims >= self.max_runs:
                return False
            self.stats.claims += 1
            return True

    def _slot(self) -> None:
        idle = True
        failed_claims = 0  # in a row: the database is unreachable or refusing
        try:
            while not self.stopping.is_set():
                if not self._take_ticket():
                    return
                try:
                    if idle:
                        # CONN_MAX_AGE and CONN_HEALTH_CHECKS, as between two requests. Not
                        # between two runs of a busy slot: a health check is a round trip, and
                        # a dead connection fails the claim, which reconnects below.
                        close_old_connections()
                    claims = leases.claim_runs(self.worker_id, self.lease_seconds, 1)
                except DatabaseError as exc:
                    # One line when the database goes away, not a traceback every poll.
                    failed_claims += 1
                    log = logger.error if failed_claims == 1 else logger.debug
                    log(
                        "claim failed (%s: %s); retrying every %.1fs until the database answers",
                        type(exc).__name__,
                        " ".join(str(exc).split()),
                        max(self.poll_interval, 0.5),
                        exc_info=logger.isEnabledFor(logging.DEBUG),
                    )
                    self._forget_ticket()
                    connection.close()
                    self.stopping.wait(max(self.poll_interval, 0.5))
                    continue
                if failed_claims:
                    logger.info("claims work again after %d failed attempts", failed_claims)
                    failed_claims = 0
                idle = not claims
                if not claims:
                    self._forget_ticket()
                    if self.burst:
                        return
                    self.stopping.wait(self.poll_interval)
                    continue
                claim: Claim | None = claims[0]
                while claim is not None:  # the next run may come with the last step
                    claim = self._work(claim)
        except BaseException:
            # Only a bug in this app gets here (a run's own errors are handled in _advance):
            # stop the whole worker, loudly, rather than go on a slot short.
            logger.critical("worker slot %s died", threading.current_thread().name, exc_info=True)
            self.slot_died.set()
            self.stopping.set()
        finally:
            calls.close_caller()
            connection.close()

    def _forget_ticket(self) -> None:
        with self._lock:
            self.stats.claims -= 1

    def _work(self, claim: Claim) -> Claim | None:
        """Advance ``claim``; returns the run claimed with its last step, if any."""
        then_claim = leases.NextClaim(
            self.worker_id,
            self.lease_seconds,
            take=lambda: not self.stopping.is_set() and self._take_ticket(),
            give_back=self._forget_ticket,
        )
        with bind_run(claim.run_id):
            self._advance(claim, then_claim)
        return then_claim.claim

    def _advance(self, claim: Claim, then_claim: leases.NextClaim) -> None:
        held = _Held(claim)
        with self._lock:
            self._held[claim.run_id] = held
        logger.info("claimed run %s (attempt %d)", claim.run_id, claim.attempt)
        disposition = "error"
        try:
            disposition = advance_run(
                claim, held.interrupt, drain=self.stopping, then_claim=then_claim
            )
        except Exception as exc:  # a bug or a database outage: never take the worker down
            logger.exception("run %s: unexpected error", claim.run_id)
            try:
                connection.close()
                leases.release_lease(claim, error=f"worker error: {type(exc).__name__}: {exc}")
            except DatabaseError:
                logger.warning("run %s: could not release; its lease will expire", claim.run_id)
        finally:
            with self._lock:
                self._held.pop(claim.run_id, None)
                self.stats.dispositions[disposition] = (
                    self.stats.dispositions.get(disposition, 0) + 1
                )

    # -- heartbeat -------------------------------------------------------------------------

    def _beat(self, item: _Held) -> None:
        try:
            close_old_connections()
            if leases.renew_lease(item.claim):
                return
            status = leases.current_status(item.claim.run_id)
        except DatabaseError:
            logger.exception("heartbeat failed for run %s", item.claim.run_id)
            connection.close()
            return
        if status == RunStatus.CANCELLED:
            reason = "cancelled"
        elif status == RunStatus.RUNNING:
            reason = "lost"  # another worker holds it now
        else:
            return  # its slot just finished, parked or released it: nothing to interrupt
        logger.warning("run %s: %s (noticed by the heartbeat)", item.claim.run_id, reason)
        item.interrupt.trigger(reason)

    def _heartbeat(self) -> None:
        """Renew every held lease; tell a run's slot when it was cancelled or taken over."""
        while not self.stopping.wait(self.heartbeat_seconds):
            with self._lock:
                held = list(self._held.values())
            for item in held:
                if item.interrupt.is_set():
                    continue
                with bind_run(item.claim.run_id):
                    self._beat(item)
        connection.close()
