"""The submitter and the poller: what every worker runs for the runs in batches.

    submit_due(owner)   stale submissions back to waiting; requests of runs that moved on
                        dropped; then, per betas header whose window is over
                        (BATCH_WINDOW_SECONDS, or BATCH_MAX_REQUESTS waiting), the requests
                        taken (SKIP LOCKED) into a batch row, created at the API, and the
                        API's id recorded
    poll_due(owner)     each batch whose next retrieve is due, leased to this worker: a batch
                        whose every run was cancelled is cancelled at the API; one retrieve;
                        still in progress, the next retrieve later (a growing backoff); ended,
                        its results read line by line and committed in chunks, then the batch
                        ended (what it did not answer is sent again)

Neither holds a transaction across a call to the API: a batch row is leased (``owner``,
``owner_until``) to the worker that submits or polls it, and the lease, not a lock, keeps the
others away. Both are called by ``BatchService`` on a thread of the worker's own, and by the
test driver (``durable_agents.testing``) in the test's thread.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import threading
import time
from collections.abc import Callable
from decimal import Decimal
from typing import Any

from django.db import DatabaseError
from django.utils import timezone

from durable_agents import observers, signals
from durable_agents.batches.results import Problem, read_line
from durable_agents.conf import app_settings
from durable_agents.engine import services as worker_services
from durable_agents.flow.pricing import add_cost
from durable_agents.llm import batches as endpoints
from durable_agents.llm.batches import BatchCallFailed
from durable_agents.models import AgentBatch, AgentRun, BatchStatus
from durable_agents.store import batches as rows
from durable_agents.store import current
from durable_agents.store.batches import Answer, Committed

logger = logging.getLogger("durable_agents.batches")


def submit_lease() -> float:
    """How long a worker holds the batch row it submits: past this, another worker sends its
    requests again (the submitter died). Longer than a create call can take (it times out
    after MODEL_TIMEOUT), so that a slow create is never taken for a dead one."""
    return float(app_settings.MODEL_TIMEOUT) + float(app_settings.LEASE_SECONDS)


def poll_lease() -> float:
    """How long a worker holds a batch it polls, renewed by each chunk of results it commits:
    past this, another worker polls it (the poller died). Polling a batch twice is harmless:
    its answers commit once."""
    return float(app_settings.LEASE_SECONDS)


# Results committed per transaction.
CHUNK = 500
# Bodies one batch carries at most (the API takes 256 MB).
MAX_BATCH_BYTES = 200 * 1024 * 1024
# Batches one poll takes at once.
POLL_LIMIT = 20
# A batch still in progress this long after the API's expires_at is lost: its requests are
# sent again.
STUCK_GRACE = datetime.timedelta(hours=1)
# Failed results downloads of one ended batch before it is given up (its requests sent again).
MAX_RESULT_FAILURES = 5
# After the API refused a create with a 429 or an overload and named no wait.
CREATE_BACKOFF_SECONDS = 30.0


@dataclasses.dataclass
class Tally:
    """What one ``submit_due`` or ``poll_due`` did (logged, and returned to tests)."""

    batches: int = 0
    requests: int = 0
    committed: int = 0
    ignored: int = 0
    resent: int = 0
    direct: int = 0
    failed: int = 0
    problems: int = 0
    retrieves: int = 0


class Submitter:
    """``submit_due`` with this worker's backoff after the API refused a create."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.not_before = 0.0

    def submit_due(self, *, force: bool = False) -> Tally:
        """Submit what is due (``force``: whatever waits, window or not)."""
        tally = Tally()
        if time.monotonic() < self.not_before:
            return tally
        rows.recover_stale_submissions()
        max_requests = max(1, int(app_settings.BATCH_MAX_REQUESTS))
        window = 0.0 if force else float(app_settings.BATCH_WINDOW_SECONDS)
        for betas in rows.due_groups(window, max_requests):
            while True:
                draft = rows.take_requests(
                    betas, self.owner, submit_lease(), max_requests, MAX_BATCH_BYTES
                )
                if draft is None:
                    break
                if not self._create(draft, tally):
                    return tally
                if len(draft.requests) < max_requests:
                    break
        return tally

    def _create(self, draft: rows.Draft, tally: Tally) -> bool:
        requests = [(str(request_id), body) for request_id, body in draft.requests]
        try:
            batch = endpoints.create_batch(requests, draft.betas)
        except BatchCallFailed as exc:
            error = exc.error
            refused_for_now = error.rate_limited or error.overloaded or exc.status is None
            wait = error.retry_after if error.retry_after is not None else CREATE_BACKOFF_SECONDS
            logger.warning(
                "creating a batch of %d request(s) failed: %s", len(requests), error.message
            )
            outcome = rows.return_requests(
                draft.batch_id,
                f"creating its batch failed: {error.message}",
                count_try=not refused_for_now and exc.status is not None,
                max_tries=int(app_settings.MAX_ATTEMPTS),
                not_before=wait if refused_for_now else 0.0,
            )
            _after(outcome, tally)
            if refused_for_now:
                self.not_before = time.monotonic() + wait
            return False
        rows.record_submission(
            draft.batch_id,
            str(batch["id"]),
            _moment(batch.get("expires_at")),
            float(app_settings.BATCH_POLL_SECONDS),
        )
        tally.batches += 1
        tally.requests += len(requests)
        logger.info(
            "batch %s submitted: %d request(s)%s",
            batch["id"],
            len(requests),
            f" (anthropic-beta: {draft.betas})" if draft.betas else "",
        )
        return True


def _moment(value: Any) -> datetime.datetime | None:
    if not isinstance(value, str):
        return None
    try:
        return datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


def _next_poll(polls: int) -> float:
    first = float(app_settings.BATCH_POLL_SECONDS)
    return min(first * 1.5 ** min(polls, 40), float(app_settings.BATCH_POLL_MAX_SECONDS))


def _after(outcome: Committed, tally: Tally) -> None:
    """Count ``outcome`` in ``tally``, report what was paid, and tell what was dead-lettered."""
    tally.committed += outcome.committed
    tally.ignored += outcome.ignored
    tally.resent += outcome.resent
    tally.direct += outcome.direct
    tally.failed += outcome.failed
    for agent, model, cost in outcome.paid:
        observers.turn_cost(agent, model, cost)
    store = current()
    for run_id, parent_id, reason in outcome.dead:
        signals.run_dead_lettered.send(sender=AgentRun, run_id=run_id, reason=reason)
        store.child_ended(parent_id)


def poll_due(owner: str, *, force: bool = False) -> Tally:
    """Retrieve each batch whose next retrieve is due (``force``: every batch at the API) and
    commit the results of those that ended."""
    tally = Tally()
    for batch in rows.take_due_batches(owner, poll_lease(), POLL_LIMIT, due=not force):
        try:
            _poll(batch, owner, tally)
        except DatabaseError:
            raise
        except Exception:  # a batch's trouble must not stop the others, nor the worker
            logger.exception("polling batch %s failed", batch.provider_id)
            rows.poll_later(batch, {}, batch.status, _next_poll(batch.polls), "polling failed")
    return tally


def _poll(batch: AgentBatch, owner: str, tally: Tally) -> None:
    assert batch.provider_id is not None
    if batch.status == BatchStatus.IN_PROGRESS and rows.live_requests(batch.pk) == 0:
        # Every run in it was cancelled (or moved on): nobody waits for its answers.
        try:
            endpoints.cancel_batch(batch.provider_id)
            batch.status = BatchStatus.CANCELING
            logger.info("batch %s cancelled: no run waits on it any more", batch.provider_id)
        except BatchCallFailed as exc:
            logger.warning("cancelling batch %s failed: %s", batch.provider_id, exc)
    tally.retrieves += 1
    try:
        info = endpoints.retrieve_batch(batch.provider_id)
    except BatchCallFailed as exc:
        if exc.status == 404:
            _after(_abandon(batch, f"the API does not know batch {batch.provider_id} (404)"), tally)
            return
        rows.poll_later(
            batch,
            {},
            batch.status,
            exc.error.retry_after or _next_poll(batch.polls),
            f"retrieve failed: {exc.error.message}",
        )
        return
    counts = info.get("request_counts") if isinstance(info.get("request_counts"), dict) else {}
    status = info.get("processing_status")
    if status != "ended":
        expires = _moment(info.get("expires_at")) or batch.expires_at
        if expires is not None and timezone.now() > expires + STUCK_GRACE:
            with _quietly(f"cancelling stuck batch {batch.provider_id}"):
                endpoints.cancel_batch(batch.provider_id)
            reason = (
                f"batch {batch.provider_id} was still {status} past its expiry "
                f"({expires.isoformat()})"
            )
            _after(_abandon(batch, reason), tally)
            return
        polled = BatchStatus.CANCELING if status == "canceling" else BatchStatus.IN_PROGRESS
        rows.poll_later(batch, counts or {}, polled, _next_poll(batch.polls))
        return
    url = info.get("results_url")
    if not isinstance(url, str) or not url:
        _after(_abandon(batch, f"batch {batch.provider_id} ended without results"), tally)
        return
    _commit_results(batch, url, counts or {}, owner, tally)


class _quietly:
    """Log and swallow a failed call to a batch endpoint that is only a courtesy."""

    def __init__(self, what: str) -> None:
        self.what = what

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> bool:
        if isinstance(exc, BatchCallFailed):
            logger.warning("%s failed: %s", self.what, exc)
            return True
        return False


def _abandon(batch: AgentBatch, reason: str) -> Committed:
    return rows.abandon_batch(
        batch,
        reason,
        max_tries=int(app_settings.MAX_ATTEMPTS),
        fallback_seconds=app_settings.BATCH_FALLBACK_SECONDS,
    )


class _Results:
    """The answers of one ended batch as they are read, committed ``CHUNK`` a transaction,
    with what they cost at batch and at direct prices."""

    def __init__(self, batch: AgentBatch, owner: str, tally: Tally) -> None:
        self.batch, self.owner, self.tally = batch, owner, tally
        self.chunk: dict[int, Answer] = {}
        self.cost: Decimal | None = None
        self.direct_cost: Decimal | None = None

    def add(self, line: bytes) -> None:
        read = read_line(line, self.batch.provider_id or "")
        if isinstance(read, Problem):
            logger.warning("batch %s: %s", self.batch.provider_id, read.reason)
            self.tally.problems += 1
        elif read.request_id in self.chunk:
            logger.warning(
                "batch %s: two results for request %s: the first is used",
                self.batch.provider_id,
                read.request_id,
            )
            self.tally.problems += 1
        else:
            self.chunk[read.request_id] = read
            if len(self.chunk) >= CHUNK:
                self.commit()

    def commit(self) -> None:
        if not self.chunk:
            return
        outcome = rows.commit_answers(
            self.batch,
            list(self.chunk.values()),
            owner=self.owner,
            max_tries=int(app_settings.MAX_ATTEMPTS),
            fallback_seconds=app_settings.BATCH_FALLBACK_SECONDS,
            wake=current().wake_batch_answers,
        )
        for request_id in outcome.unknown:
            logger.warning(
                "batch %s: a result for request %s, which is not in the database (its run "
                "was deleted?): ignored",
                self.batch.provider_id,
                request_id,
            )
            self.tally.problems += 1
        rows.renew_batch(self.batch, poll_lease())
        self.cost = add_cost(self.cost, outcome.cost)
        self.direct_cost = add_cost(self.direct_cost, outcome.direct_cost)
        _after(outcome, self.tally)
        self.chunk.clear()


def _commit_results(
    batch: AgentBatch, url: str, counts: dict[str, int], owner: str, tally: Tally
) -> None:
    """Read the results of an ended batch and commit them, ``CHUNK`` answers a transaction;
    then end the batch. A failed download leaves what was committed, and is tried again at
    the next poll (the answers committed are not paid twice); after
    ``MAX_RESULT_FAILURES`` the batch is given up and its unanswered requests sent again."""
    results = _Results(batch, owner, tally)
    try:
        for line in endpoints.result_lines(url):
            results.add(line)
    except BatchCallFailed as exc:
        results.commit()
        if batch.result_failures + 1 >= MAX_RESULT_FAILURES:
            _after(_abandon(batch, f"its results could not be read: {exc}"), tally)
            return
        rows.poll_later(
            batch,
            counts,
            BatchStatus.IN_PROGRESS,
            exc.error.retry_after or _next_poll(batch.result_failures),
            f"reading its results failed: {exc}",
            results_failed=True,
        )
        return
    results.commit()
    outcome = rows.end_batch(
        batch,
        counts,
        cost=add_cost(batch.cost_usd, results.cost),
        direct_cost=add_cost(batch.direct_cost_usd, results.direct_cost),
        max_tries=int(app_settings.MAX_ATTEMPTS),
        fallback_seconds=app_settings.BATCH_FALLBACK_SECONDS,
    )
    _after(outcome, tally)
    logger.info(
        "batch %s ended: %d answer(s) committed, %d ignored, %d sent again",
        batch.provider_id,
        tally.committed,
        tally.ignored,
        tally.resent,
    )


# -- the worker's thread ------------------------------------------------------------------

# How often the service looks (at most; the window and the backoffs decide what it does).
TICK_SECONDS = 1.0
ERROR_WAIT_SECONDS = 5.0


class BatchService:
    """A worker's batch loop: submit what is due, poll what is due, every ``TICK_SECONDS``
    until ``stopping`` is set. Never raises: an error is logged and the loop goes on."""

    def __init__(
        self,
        owner: str,
        stopping: threading.Event,
        *,
        release: Callable[[], None] = lambda: None,
        close: Callable[[], None] = lambda: None,
    ) -> None:
        self.owner = owner
        self.stopping = stopping
        self.submitter = Submitter(owner)
        self.failures = 0
        self.release = release
        self.close = close

    def serve(self) -> None:
        # The first look a tick after the worker starts: a burst worker done sooner (tests,
        # one-off drains) costs the database nothing.
        wait = TICK_SECONDS
        try:
            while not self.stopping.wait(wait):
                wait = self.tick()
        finally:
            self.close()

    def tick(self) -> float:
        try:
            if not rows.has_work():
                return TICK_SECONDS
            submitted = self.submitter.submit_due()
            polled = poll_due(self.owner)
        except DatabaseError as exc:
            # The database is away (a restart, a failover): said once, then quietly retried.
            self.failures += 1
            (logger.error if self.failures == 1 else logger.debug)(
                "the batch service cannot reach the database (%s: %s); trying again every %.0fs",
                type(exc).__name__,
                " ".join(str(exc).split()),
                ERROR_WAIT_SECONDS,
            )
            self.close()
            return ERROR_WAIT_SECONDS
        except Exception:
            self.failures += 1
            logger.exception("the batch service failed; trying again in %.0fs", ERROR_WAIT_SECONDS)
            self.close()
            return ERROR_WAIT_SECONDS
        finally:
            self.release()
        if self.failures:
            logger.info("the batch service works again after %d failures", self.failures)
            self.failures = 0
        if submitted.batches or polled.committed or polled.resent or polled.failed:
            logger.debug("batches: submitted %s, polled %s", submitted, polled)
        return min(TICK_SECONDS, float(app_settings.BATCH_WINDOW_SECONDS) / 2 or TICK_SECONDS)


class Batching(worker_services.WorkerService):
    """The thread that submits and polls Message Batches in every worker: apart from the
    claimer and the slots, so that a results download never delays a claim (the runs it wakes
    wake the claimer like any pending run)."""

    def start(self, worker: Any) -> threading.Thread | None:
        if worker.store is not None:
            return None  # a worker given a store of its own (tests): batches live in the database
        service = BatchService(
            worker.worker_id,
            worker.stopping,
            release=worker.connections.release,
            close=worker.connections.close,
        )
        thread = threading.Thread(target=service.serve, name="da-batches", daemon=True)
        thread.start()
        return thread


worker_services.register("durable_agents.batches", Batching())
