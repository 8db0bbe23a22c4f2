"""Model turns through Message Batches: every statement of the flow, through the Django ORM
(SQLite and PostgreSQL alike: none of them is on a run's hot path).

    park_on_batch       the run's worker: running -> waiting (``WaitKind.BATCH``) on a request
                        row holding the exact body a direct call would send; fenced. A request
                        marked ``direct`` (the fallback) is not parked again: the run calls
    take_requests       a submitter: stale submissions (a worker died mid-create) go back to
                        waiting; then the requests whose window is over, by betas header, locked
                        (SKIP LOCKED), into a new batch row (``submitting``), in one transaction
    record_submission   the create answered: the batch is ``in_progress`` with the API's id
    return_requests     the create failed: its requests wait again (or fail, past their tries)
    take_due_batches    a poller: batches whose next retrieve is due, leased to it (SKIP LOCKED)
    poll_later          the batch is still in progress: its counts, the next retrieve
    commit_answers      the results, a chunk a transaction: each succeeded answer is committed
                        as its run's step ``seq``, verbatim, only while the run still waits on
                        that request at that position (the fence: the store's
                        ``wake_batch_answers``, one statement for the chunk on PostgreSQL,
                        store/postgres_batches.py); the run becomes pending. A request error
                        dead-letters the run; an expiry, a cancellation or a transient error
                        sends the request again (or directly, past BATCH_FALLBACK_SECONDS)
    end_batch           every result is in: the batch is ``ended``; the requests it never
                        answered are sent again
    abandon_batch       the batch is lost (404, past its expiry): its requests are sent again

The fence of an answer is the run's row: ``status = waiting``, ``waiting_for = batch``,
``wait_key`` = the request's id, ``last_seq = seq - 1``. A late answer, a duplicate, the answer
of a resubmission that crossed another, an answer for a run cancelled meanwhile: each finds the
fence closed and changes nothing but the counters of what was paid.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
from collections.abc import Callable, Sequence
from decimal import Decimal
from typing import Any

from django.db import transaction
from django.db.models import Count, F, Min, Q, QuerySet
from django.db.models.functions import Greatest, Now
from django.utils import timezone

from durable_agents._internal.text import json_text, storable_text
from durable_agents.flow import pricing
from durable_agents.flow.pricing import Price, Usage, add_cost
from durable_agents.models import (
    AgentBatch,
    AgentBatchRequest,
    AgentRun,
    AgentStep,
    BatchStatus,
    RequestStatus,
    RunStatus,
    StepKind,
    WaitKind,
)
from durable_agents.models.batches import POLLED_STATUSES
from durable_agents.store.base import MAX_REASON_CHARS, Claim, Parked, ended
from durable_agents.store.rollup import added_cost, record_usages

logger = logging.getLogger("durable_agents.batches")


@dataclasses.dataclass(frozen=True)
class BatchTurn:
    """A model turn a run in batches asks for (what ``park_on_batch`` records)."""

    seq: int  # the step its answer becomes: the run's last_seq + 1
    body: str  # the Messages request body, JSON text, exactly as a direct call sends it
    model: str
    betas: str  # the anthropic-beta header of the call ("" for none)


@dataclasses.dataclass(frozen=True)
class Draft:
    """A batch taken for submission: its row, its header and its requests (id, body)."""

    batch_id: int
    betas: str
    requests: list[tuple[int, str]]


@dataclasses.dataclass(frozen=True)
class Answer:
    """One result of a batch, read from its results (see ``batches.results``)."""

    request_id: int
    kind: str  # succeeded, errored, expired, canceled
    # succeeded: the message's JSON text as the API sent it, where its content lies, and
    # what it billed (priced at the request's model when committed).
    body: str = ""
    content_span: tuple[int, int] | None = None
    tokens: int = 0
    usage: Usage | None = None
    # errored: the API's error type and message.
    error_type: str = ""
    error: str = ""


@dataclasses.dataclass
class Committed:
    """What ``commit_answers`` did with a chunk of answers."""

    committed: int = 0  # answers that became steps
    ignored: int = 0  # answers whose run no longer waited on them (paid, not committed)
    resent: int = 0  # requests sent again (expired, canceled, transient errors)
    direct: int = 0  # requests whose run now calls directly (BATCH_FALLBACK_SECONDS)
    failed: int = 0  # runs dead-lettered (a request error, or tries run out)
    unknown: list[int] = dataclasses.field(default_factory=list)  # ids not of this batch
    cost: Decimal | None = None  # of the answers committed or ignored, at batch prices
    direct_cost: Decimal | None = None  # of the same answers, had they been sent directly
    # (agent, model, cost) of each answer paid, for the observers.
    paid: list[tuple[str, str, Decimal | None]] = dataclasses.field(default_factory=list)
    # Runs dead-lettered, as (run id, parent id, reason): the caller signals each, and tells
    # the store of each parent (it may wait on its children).
    dead: list[tuple[Any, Any, str]] = dataclasses.field(default_factory=list)


# Errors of a request that asking again cannot mend: the run is dead-lettered with the reason,
# as a direct call's 400 would. Any other error (overloaded, api_error, rate limits) is sent
# again.
REQUEST_ERRORS = frozenset(
    {
        "invalid_request_error",
        "not_found_error",
        "permission_error",
        "authentication_error",
        "request_too_large",
        "billing_error",
    }
)


# What sending a request again reads of it and of its run.
_RESEND_FIELDS = ("id", "run_id", "seq", "tries", "created_at", "run__id", "run__parent_id")


def _waiting_on(request: AgentBatchRequest) -> QuerySet[AgentRun]:
    """The fence of ``request``'s answer: its run, still waiting on it at its position."""
    return AgentRun.objects.filter(
        pk=request.run_id,
        status=RunStatus.WAITING,
        waiting_for=WaitKind.BATCH,
        wait_key=str(request.pk),
        last_seq=request.seq - 1,
    )


# -- the run's worker ---------------------------------------------------------------------


def park_on_batch(claim: Claim, turn: BatchTurn) -> Parked:
    """``Store.park_on_batch``: record the turn's request and park the run on it, fenced on
    the claim and on ``turn.seq`` being the next step. ``READY`` when the request is marked
    ``direct`` (it waited past BATCH_FALLBACK_SECONDS): the run sends it itself."""
    with transaction.atomic():
        fenced = AgentRun.objects.filter(
            pk=claim.run_id,
            lease_owner=claim.owner,
            attempt=claim.attempt,
            status=RunStatus.RUNNING,
            last_seq=turn.seq - 1,
        )
        if not fenced.select_for_update(no_key=True).exists():
            return Parked.FENCE_FAILED
        request = (
            AgentBatchRequest.objects.select_for_update()
            .filter(run_id=claim.run_id, seq=turn.seq)
            .first()
        )
        if request is not None and request.status == RequestStatus.DIRECT:
            return Parked.READY
        if request is None:
            request = AgentBatchRequest.objects.create(
                run_id=claim.run_id,
                seq=turn.seq,
                body=turn.body,
                model=turn.model,
                betas=turn.betas,
            )
        else:
            # Parked at this position before (claimed again after a crash, requeued): the
            # same request, waiting again; an answer of its earlier batch still matches it.
            if request.status in (RequestStatus.FAILED, RequestStatus.DROPPED):
                # A person requeued the run (dead-lettered when its tries ran out, or after a
                # request error): its tries start again.
                request.tries = 0
                request.reason = ""
            request.status = RequestStatus.WAITING
            request.body = turn.body
            request.model = turn.model
            request.betas = turn.betas
            request.batch = None
            request.save(
                update_fields=["status", "body", "model", "betas", "batch", "tries", "reason"]
            )
            AgentBatchRequest.objects.filter(pk=request.pk).update(queued_at=Now())
        fenced.update(
            status=RunStatus.WAITING,
            lease_owner=None,
            lease_until=None,
            stalled_claims=0,
            waiting_for=WaitKind.BATCH,
            waiting_since=Now(),
            wait_key=str(request.pk),
            wake_at=None,
            wait_event=None,
            wait_runs=None,
            woken_by=None,
            updated_at=Now(),
        )
    return Parked.PARKED


# -- the submitter ------------------------------------------------------------------------


def has_work() -> bool:
    """Whether any request waits for a batch or any batch is at the API (or being submitted):
    a fleet without runs in batches pays these two indexed looks a tick, and nothing more."""
    return (
        AgentBatchRequest.objects.filter(status=RequestStatus.WAITING).exists()
        or AgentBatch.objects.filter(status__in=(BatchStatus.SUBMITTING, *POLLED_STATUSES)).exists()
    )


def recover_stale_submissions() -> int:
    """Batches whose submitter died between taking their requests and recording the API's
    answer (``owner_until`` passed while ``submitting``): abandoned, their requests waiting
    again. If the create did reach the API, those turns are paid once more (the window is the
    create call itself: its answer is recorded the moment it arrives)."""
    stale = list(
        AgentBatch.objects.filter(status=BatchStatus.SUBMITTING, owner_until__lt=Now()).values_list(
            "pk", flat=True
        )
    )
    if not stale:
        return 0
    with transaction.atomic():
        AgentBatch.objects.filter(pk__in=stale, status=BatchStatus.SUBMITTING).update(
            status=BatchStatus.ABANDONED,
            owner=None,
            owner_until=None,
            error="its submitter stopped before the API's answer was recorded",
        )
        AgentBatchRequest.objects.filter(batch_id__in=stale, status=RequestStatus.SUBMITTED).update(
            status=RequestStatus.WAITING,
            batch=None,
            queued_at=Now(),
            tries=Greatest(F("tries") - 1, 0),
            reason="its batch was never recorded (its submitter stopped)",
        )
    logger.warning("batches %s abandoned: their submitter stopped mid-create", stale)
    return len(stale)


def due_groups(window_seconds: float, max_requests: int) -> list[str]:
    """The betas headers whose waiting requests are due for a batch: the oldest has waited
    ``window_seconds``, or ``max_requests`` of them wait. One indexed read, no lock."""
    now = timezone.now()
    due: list[str] = []
    groups = (
        AgentBatchRequest.objects.filter(status=RequestStatus.WAITING)
        .values("betas")
        .annotate(waiting=Count("id"), oldest=Min("queued_at"))
    )
    for group in groups:
        oldest = group["oldest"]
        if group["waiting"] >= max_requests or (
            oldest is not None and (now - oldest).total_seconds() >= window_seconds
        ):
            due.append(group["betas"])
    return due


def take_requests(
    betas: str, owner: str, lease_seconds: float, max_requests: int, max_bytes: int
) -> Draft | None:
    """Lock up to ``max_requests`` waiting requests with header ``betas`` (at most
    ``max_bytes`` of bodies), oldest first, skipping those another submitter holds, and move
    them into a new batch row (``submitting``, leased to ``owner``); None when none waits.
    Requests whose run no longer waits on them are dropped on the way. The requests are read
    from their own index and their runs by primary key: no plan depends on how many runs wait."""
    with transaction.atomic():
        rows = list(
            AgentBatchRequest.objects.filter(
                status=RequestStatus.WAITING, betas=betas, queued_at__lte=Now()
            )
            .select_for_update(skip_locked=True)
            .order_by("queued_at", "id")
            .only("id", "run_id", "body")[:max_requests]
        )
        if not rows:
            return None
        waiting_on = dict(
            AgentRun.objects.filter(
                pk__in={row.run_id for row in rows},
                status=RunStatus.WAITING,
                waiting_for=WaitKind.BATCH,
            ).values_list("pk", "wait_key")
        )
        orphans = [row.pk for row in rows if waiting_on.get(row.run_id) != str(row.pk)]
        if orphans:
            AgentBatchRequest.objects.filter(pk__in=orphans).update(
                status=RequestStatus.DROPPED, body="", reason="its run no longer waited on it"
            )
        taken: list[AgentBatchRequest] = []
        size = 0
        for row in rows:
            if waiting_on.get(row.run_id) != str(row.pk):
                continue
            size += len(row.body) + 64
            if taken and size > max_bytes:
                break
            taken.append(row)
        if not taken:
            return None
        batch = AgentBatch.objects.create(
            status=BatchStatus.SUBMITTING,
            betas=betas,
            requests=len(taken),
            owner=owner,
            owner_until=timezone.now() + datetime.timedelta(seconds=lease_seconds),
        )
        AgentBatchRequest.objects.filter(pk__in=[row.pk for row in taken]).update(
            status=RequestStatus.SUBMITTED,
            batch=batch,
            tries=F("tries") + 1,
            submitted_at=Now(),
        )
    return Draft(batch.pk, betas, [(row.pk, row.body) for row in taken])


def record_submission(
    batch_id: int,
    provider_id: str,
    expires_at: datetime.datetime | None,
    first_poll_seconds: float,
) -> None:
    """The create answered: the batch is at the API, its first retrieve due soon."""
    AgentBatch.objects.filter(pk=batch_id).update(
        provider_id=provider_id,
        status=BatchStatus.IN_PROGRESS,
        submitted_at=Now(),
        expires_at=expires_at,
        poll_at=timezone.now() + datetime.timedelta(seconds=first_poll_seconds),
        owner=None,
        owner_until=None,
    )


def return_requests(
    batch_id: int, reason: str, *, count_try: bool, max_tries: int, not_before: float = 0.0
) -> Committed:
    """The create of ``batch_id`` failed: the batch is abandoned and its requests wait again
    (``count_try=False``: the failure was not theirs, e.g. a 429). A request past
    ``max_tries`` fails and its run is dead-lettered."""
    with transaction.atomic():
        AgentBatch.objects.filter(pk=batch_id).update(
            status=BatchStatus.ABANDONED,
            owner=None,
            owner_until=None,
            error=storable_text(reason, MAX_REASON_CHARS),
        )
        if not count_try:
            AgentBatchRequest.objects.filter(
                batch_id=batch_id, status=RequestStatus.SUBMITTED, tries__gt=0
            ).update(tries=F("tries") - 1)
        outcome = Committed()
        for request in _unanswered(batch_id):
            _send_again(request, reason, max_tries, None, outcome, not_before=not_before)
    return outcome


# -- the poller ---------------------------------------------------------------------------


def take_due_batches(
    owner: str, lease_seconds: float, limit: int, *, due: bool = True
) -> list[AgentBatch]:
    """Batches at the API whose next retrieve is due (``due=False``: all of them) and that no
    poller holds, leased to ``owner`` for ``lease_seconds`` (one poller per batch across the
    fleet)."""
    until = timezone.now() + datetime.timedelta(seconds=lease_seconds)
    polled = AgentBatch.objects.filter(status__in=POLLED_STATUSES)
    if due:
        polled = polled.filter(poll_at__lte=Now())
    with transaction.atomic():
        batches = list(
            polled.filter(Q(owner_until__isnull=True) | Q(owner_until__lt=Now()))
            .select_for_update(skip_locked=True)
            .order_by("poll_at")[:limit]
        )
        if batches:
            AgentBatch.objects.filter(pk__in=[b.pk for b in batches]).update(
                owner=owner, owner_until=until
            )
    for batch in batches:
        batch.owner, batch.owner_until = owner, until
    return batches


def renew_batch(batch: AgentBatch, seconds: float) -> None:
    """The poller of ``batch`` is still at it: its lease runs ``seconds`` from now."""
    AgentBatch.objects.filter(pk=batch.pk, owner=batch.owner).update(
        owner_until=timezone.now() + datetime.timedelta(seconds=seconds)
    )


def live_requests(batch_id: int) -> int:
    """How many requests of the batch a run still waits on (its runs read by primary key)."""
    pairs = list(
        AgentBatchRequest.objects.filter(
            batch_id=batch_id, status=RequestStatus.SUBMITTED
        ).values_list("pk", "run_id")
    )
    if not pairs:
        return 0
    waiting_on = dict(
        AgentRun.objects.filter(
            pk__in={run_id for _, run_id in pairs},
            status=RunStatus.WAITING,
            waiting_for=WaitKind.BATCH,
        ).values_list("pk", "wait_key")
    )
    return sum(1 for pk, run_id in pairs if waiting_on.get(run_id) == str(pk))


def poll_later(
    batch: AgentBatch,
    counts: dict[str, int],
    status: str,
    seconds: float,
    error: str = "",
    *,
    results_failed: bool = False,
) -> None:
    """The batch is still at work (or the retrieve failed, or the download of its results:
    ``results_failed``): its counts as the API gave them, and the next retrieve in
    ``seconds``."""
    AgentBatch.objects.filter(pk=batch.pk, owner=batch.owner).update(
        status=status,
        polls=F("polls") + 1,
        result_failures=F("result_failures") + int(results_failed),
        poll_at=timezone.now() + datetime.timedelta(seconds=seconds),
        owner=None,
        owner_until=None,
        error=storable_text(error, MAX_REASON_CHARS),
        **_count_columns(counts),
    )


def _count_columns(counts: dict[str, int]) -> dict[str, int]:
    return {
        name: int(counts.get(name) or 0)
        for name in ("processing", "succeeded", "errored", "expired", "canceled")
    }


def commit_answers(
    batch: AgentBatch,
    answers: Sequence[Answer],
    *,
    owner: str,
    max_tries: int,
    fallback_seconds: float | None,
    wake: Wake,
) -> Committed:
    """Commit a chunk of a batch's results in one transaction (see the module's docstring):
    the fenced wake of the answered runs (``wake``: the store's ``wake_batch_answers``, one
    statement on PostgreSQL), the chunk's steps in one INSERT, its requests marked in one
    UPDATE, and the day's rollup in one statement per row it touches."""
    outcome = Committed()
    by_id = {answer.request_id: answer for answer in answers}
    with transaction.atomic():
        requests = {
            request.pk: request
            for request in AgentBatchRequest.objects.select_for_update(of=("self",))
            .filter(pk__in=list(by_id))
            .select_related("run")
            .only(
                "id",
                "run_id",
                "seq",
                "status",
                "tries",
                "created_at",
                "batch_id",
                "model",
                "run__id",
                "run__agent",
                "run__model",
                "run__concurrency_key",
                "run__attempt",
                "run__parent_id",
            )
        }
        outcome.unknown = [request_id for request_id in by_id if request_id not in requests]
        chunk = _Chunk()
        for request_id, request in requests.items():
            answer = by_id[request_id]
            if answer.kind == "succeeded":
                _commit_answer(batch, request, answer, outcome, chunk)
            elif request.status != RequestStatus.SUBMITTED or request.batch_id != batch.pk:
                # An outcome of an earlier batch of a request that moved on: nothing to do.
                continue
            elif answer.kind == "errored" and answer.error_type in REQUEST_ERRORS:
                reason = f"the API refused the batched request: {answer.error_type}: {answer.error}"
                _fail(request, reason, outcome)
            else:
                why = (
                    f"{answer.error_type}: {answer.error}"
                    if answer.kind == "errored"
                    else answer.kind
                )
                _send_again(
                    request,
                    f"batch {batch.provider_id}: {why}",
                    max_tries,
                    fallback_seconds,
                    outcome,
                )
        chunk.write(batch, owner, wake, outcome)
    return outcome


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A succeeded answer whose run may still wait on it: what the fenced wake is given."""

    request: AgentBatchRequest
    answer: Answer
    cost: Decimal | None


# The store's fenced wake of a chunk's answered runs: the request ids whose run it woke.
Wake = Callable[[Sequence[Candidate], str], set[int]]


@dataclasses.dataclass
class _Chunk:
    """What the answers of one chunk write together."""

    candidates: list[Candidate] = dataclasses.field(default_factory=list)
    # Answers of requests that are no longer in this batch: paid, never committed.
    strays: list[Candidate] = dataclasses.field(default_factory=list)
    paid: list[tuple[AgentRun, Usage, Decimal | None]] = dataclasses.field(default_factory=list)
    # Each model's (batch, direct) price, looked up once a chunk.
    prices: dict[str, tuple[Price | None, Price | None]] = dataclasses.field(default_factory=dict)

    def prices_of(self, model: str) -> tuple[Price | None, Price | None]:
        found = self.prices.get(model)
        if found is None:
            found = self.prices[model] = (
                pricing.price_for(model, batch=True),
                pricing.price_for(model),
            )
        return found

    def write(self, batch: AgentBatch, owner: str, wake: Wake, outcome: Committed) -> None:
        woken = (
            wake(self.candidates, json_text({"batch": batch.provider_id}))
            if self.candidates
            else set()
        )
        steps: list[AgentStep] = []
        answered: list[int] = []
        dropped: list[int] = []
        for candidate in (*self.candidates, *self.strays):
            request, answer = candidate.request, candidate.answer
            if request.pk in woken:
                steps.append(_step_of(batch, request, answer, owner))
                answered.append(request.pk)
                continue
            # Paid, but its run moved on (cancelled, answered already by a duplicate or
            # another batch): counted in the run's cost, never in its log.
            AgentRun.objects.filter(pk=request.run_id).update(**_paid_changes(candidate))
            outcome.ignored += 1
            if request.status == RequestStatus.SUBMITTED and request.batch_id == batch.pk:
                dropped.append(request.pk)
        outcome.committed += len(steps)
        if steps:
            AgentStep.objects.bulk_create(steps)
        if answered:
            AgentBatchRequest.objects.filter(pk__in=answered).update(
                status=RequestStatus.ANSWERED, batch=batch, body="", answered_at=Now()
            )
        if dropped:
            AgentBatchRequest.objects.filter(pk__in=dropped).update(
                status=RequestStatus.DROPPED, body="", reason="its run no longer waited on it"
            )
        record_usages(self.paid, batch=True)


def _paid_changes(candidate: Candidate) -> dict[str, Any]:
    """What an answer adds to its run's counters: its tokens, and its cost if priced."""
    changes: dict[str, Any] = {"tokens_used": F("tokens_used") + candidate.answer.tokens}
    if candidate.cost is not None:
        changes["cost_usd"] = added_cost(candidate.cost)
    return changes


def _step_of(
    batch: AgentBatch, request: AgentBatchRequest, answer: Answer, owner: str
) -> AgentStep:
    return AgentStep(
        run_id=request.run_id,
        seq=request.seq,
        kind=StepKind.MODEL_TURN,
        payload=answer.body,
        content_start=answer.content_span[0] if answer.content_span else None,
        content_end=answer.content_span[1] if answer.content_span else None,
        request_id=f"{batch.provider_id}/{request.pk}"[:200],
        attempt=request.run.attempt,
        worker=owner,
    )


def wake_answers(candidates: Sequence[Candidate], woken_by: str) -> set[int]:
    """The fenced wake through the ORM (``PortableStore.wake_batch_answers``): one UPDATE per
    answer, each on its run's primary key and the fence; the request ids it woke."""
    woken: set[int] = set()
    for candidate in candidates:
        request = candidate.request
        if _waiting_on(request).update(
            status=RunStatus.PENDING,
            last_seq=request.seq,
            stalled_claims=0,
            lease_owner=None,
            lease_until=None,
            wait_key=None,
            woken_by=woken_by,
            updated_at=Now(),
            **_paid_changes(candidate),
        ):
            woken.add(request.pk)
    return woken


def _commit_answer(
    batch: AgentBatch,
    request: AgentBatchRequest,
    answer: Answer,
    outcome: Committed,
    chunk: _Chunk,
) -> None:
    """One succeeded answer: a candidate for its run's step; paid either way."""
    run = request.run
    if request.status == RequestStatus.ANSWERED and request.batch_id == batch.pk:
        # This batch's answer, committed already: a results file read again after a failed
        # download, or a line the API sent twice. Neither paid nor committed again.
        logger.warning("batch %s: a second result for request %s", batch.provider_id, request.pk)
        return
    usage = answer.usage or Usage()
    batch_price, direct_price = chunk.prices_of(request.model)
    cost = None if batch_price is None else batch_price.cost(usage)
    outcome.cost = add_cost(outcome.cost, cost)
    outcome.direct_cost = add_cost(
        outcome.direct_cost, None if direct_price is None else direct_price.cost(usage)
    )
    outcome.paid.append((run.agent, request.model, cost))
    chunk.paid.append((run, usage, cost))
    candidate = Candidate(request, answer, cost)
    if request.status == RequestStatus.SUBMITTED and request.batch_id == batch.pk:
        chunk.candidates.append(candidate)
    else:
        # The request is no longer in this batch (its run asked again since: requeued,
        # upgraded, or the request was sent in a later batch): only the batch it is in now
        # answers it. Paid, never committed.
        chunk.strays.append(candidate)


def _fail(request: AgentBatchRequest, reason: str, outcome: Committed) -> None:
    """The request cannot be answered: its run is dead-lettered with ``reason`` (fenced on
    the run still waiting on it)."""
    reason = storable_text(reason, MAX_REASON_CHARS)
    AgentBatchRequest.objects.filter(pk=request.pk).update(
        status=RequestStatus.FAILED, body="", reason=reason
    )
    fence = _waiting_on(request)
    if fence.update(updated_at=Now(), finished_at=Now(), **ended(RunStatus.DEAD, None, reason)):
        outcome.failed += 1
        outcome.dead.append((request.run_id, request.run.parent_id, reason))
        logger.error("run %s dead-lettered: %s", request.run_id, reason)


def _send_again(
    request: AgentBatchRequest,
    reason: str,
    max_tries: int,
    fallback_seconds: float | None,
    outcome: Committed,
    *,
    not_before: float = 0.0,
) -> None:
    """The request goes into a later batch; or, past ``fallback_seconds`` since its run
    asked, to its run, which sends it directly; or, past ``max_tries``, it fails."""
    if request.tries >= max_tries:
        _fail(
            request,
            f"the batched model turn was tried in {request.tries} batches without an answer "
            f"(MAX_ATTEMPTS={max_tries}); last: {reason}",
            outcome,
        )
        return
    waited = (timezone.now() - request.created_at).total_seconds()
    if fallback_seconds is not None and waited >= fallback_seconds:
        woken = _waiting_on(request).update(
            status=RunStatus.PENDING,
            lease_owner=None,
            lease_until=None,
            woken_by=json_text({"batch": "direct", "reason": storable_text(reason, 500)}),
            updated_at=Now(),
        )
        AgentBatchRequest.objects.filter(pk=request.pk).update(
            status=RequestStatus.DIRECT if woken else RequestStatus.DROPPED,
            batch=None,
            reason=storable_text(reason, MAX_REASON_CHARS),
        )
        outcome.direct += int(bool(woken))
        return
    AgentBatchRequest.objects.filter(pk=request.pk).update(
        status=RequestStatus.WAITING,
        batch=None,
        tries=request.tries,
        queued_at=timezone.now() + datetime.timedelta(seconds=not_before),
        reason=storable_text(reason, MAX_REASON_CHARS),
    )
    outcome.resent += 1


def end_batch(
    batch: AgentBatch,
    counts: dict[str, int],
    *,
    cost: Decimal | None,
    direct_cost: Decimal | None,
    max_tries: int,
    fallback_seconds: float | None,
) -> Committed:
    """Every result of the batch is committed: it is ``ended``, and each of its requests
    that got no result in it is sent again."""
    outcome = Committed()
    with transaction.atomic():
        reason = f"batch {batch.provider_id} ended without a result for it"
        for request in _unanswered(batch.pk):
            _send_again(request, reason, max_tries, fallback_seconds, outcome)
        AgentBatch.objects.filter(pk=batch.pk).update(
            status=BatchStatus.ENDED,
            ended_at=Now(),
            owner=None,
            owner_until=None,
            polls=F("polls") + 1,
            cost_usd=cost,
            direct_cost_usd=direct_cost,
            **_count_columns(counts),
        )
    return outcome


def abandon_batch(
    batch: AgentBatch, reason: str, *, max_tries: int, fallback_seconds: float | None
) -> Committed:
    """The batch is lost at the API (404, no results, stuck past its expiry): abandoned, and
    each request still in it is sent again with ``reason``."""
    outcome = Committed()
    with transaction.atomic():
        for request in _unanswered(batch.pk):
            _send_again(request, reason, max_tries, fallback_seconds, outcome)
        AgentBatch.objects.filter(pk=batch.pk).update(
            status=BatchStatus.ABANDONED,
            owner=None,
            owner_until=None,
            error=storable_text(reason, MAX_REASON_CHARS),
        )
    logger.warning("batch %s abandoned: %s", batch.provider_id or batch.pk, reason)
    return outcome


def _unanswered(batch_id: int) -> QuerySet[AgentBatchRequest]:
    """The requests still ``submitted`` in the batch (it gave them no answer), locked for the
    caller's transaction, with what ``_send_again`` reads."""
    return (
        AgentBatchRequest.objects.select_for_update(of=("self",))
        .filter(batch_id=batch_id, status=RequestStatus.SUBMITTED)
        .select_related("run")
        .only(*_RESEND_FIELDS)
    )
