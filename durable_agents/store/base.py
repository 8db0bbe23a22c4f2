"""The store: every statement that changes the status of a run or of a tool intent.

A run travels through these operations, in this order; each is one method of ``Store``::

    create_run        -> agent_run (pending) + agent_step seq 0 (the task); once per
                         (agent, start_key) when the run has a key
    create_fork       -> agent_run (pending, last_seq = the fork point) + the stretches of
                         other runs' logs it reads (agent_step_share) + its edited step, if
                         any + the effects of the fork point's calls it inherits
    claim_runs        -> pending (or running with an expired lease) -> running, leased to one
                         worker; ``attempt`` + 1 (the fence), ``stalled_claims`` + 1
    renew_leases      -> the heartbeat: every lease one worker holds, in one statement
    append_step       -> the next step (a ``StepWrite``) is committed here, FENCED: only
                         while (owner, attempt, status running, last_seq = seq - 1) still
                         hold; renews the lease, resets ``stalled_claims``; with ``finish``
                         it also ends the run (its last step) and may claim the worker's
                         next run in the same statement
    finish_run        -> succeeded / failed / dead, lease freed (fenced)
    release_lease     -> running -> pending, handed back (fenced)
    park_on_intent    -> running -> waiting on a person's decision (fenced)
    decide_intent / resolve_intent / complete_intent
                      -> the intent is decided or done, and wake_run: waiting -> pending
    park_on_wait      -> running -> waiting on a timer, an event, child runs, a question or
                         a callback (fenced); or not parked at all when that is over already
    claim_runs        -> also takes waiting runs whose timer or timeout is due -> running,
                         ``woken_by`` = {"timer": true} / {"timeout": true}
    send_event        -> the event stored once; every run waiting on it -> pending (one UPDATE)
    answer_question   -> the question answered; its run -> pending
    receive_callback  -> a call's callback body stored once; the run waiting on it -> pending
    spawn_run         -> a child run (pending), once per (parent, key)
    wake_parent       -> after a child ends: its parent -> pending once all it waits on ended
    cancel_run, requeue_run, dead_letter
                      -> a person's or the housekeeping's operations on any run (a cancel
                         takes the run's unfinished descendants with it)

No wake-up is lost: a wait and what ends it lock the same row (the event's row, the run's row
for a question, for children or for a callback), so whichever commits second sees the first. A
wake changes only a run that is still ``waiting``, so a timer and an event that race resume the
run once.

The fence is the invariant: a worker changes a run only while the run still carries the
(owner, attempt) of its claim and is running. A claim increments ``attempt``, so a worker whose
lease expired and was taken over never commits again, even if it wakes up later. A step commits
only as seq ``last_seq + 1``, so the log has no gaps.

Implementations (``store_for`` in ``durable_agents.store`` picks one, once per vendor):

- ``PostgresStore`` (``postgres.py``): the claim, the step commit, the finish-and-claim and the
  heartbeat are each one statement, on the database clock;
- ``PortableStore`` (``portable.py``): the Django ORM, one transaction per operation, for
  SQLite and for a caller's open transaction on PostgreSQL;
- ``InMemoryStore`` (``memory.py``): dicts under a lock, the same semantics, for unit tests of
  the state machine without a database.
"""

from __future__ import annotations

import abc
import dataclasses
import datetime
import enum
import functools
import logging
import time
import typing
import uuid
from collections.abc import Callable, Collection, Sequence
from decimal import Decimal
from typing import TYPE_CHECKING, Any, TypeAlias

from django.db.backends.base.base import BaseDatabaseWrapper
from django.utils import timezone

from durable_agents._internal import encryption
from durable_agents._internal.text import storable_text
from durable_agents.causes import cause_of
from durable_agents.exceptions import WaitRefused as WaitRefused
from durable_agents.flow.pricing import Usage
from durable_agents.models import (
    STEP_PAYLOAD,
    AgentCallback,
    AgentEvent,
    AgentMessage,
    AgentQuestion,
    AgentRun,
    AgentWorker,
    RunStatus,
    ToolEffect,
    ToolIntent,
    WaitKind,
)
from durable_agents.store.event_payloads import SentPayloads

if TYPE_CHECKING:
    from collections.abc import Mapping

    from durable_agents.flow.capacity.gate import CapacityGate
    from durable_agents.models import AgentSchedule
    from durable_agents.store.batches import BatchTurn, Candidate
    from durable_agents.store.rows import DueSchedules, SlotStart

# A reason (error) longer than this is cut with a note: it is shown on pages and in e-mails.
MAX_REASON_CHARS = 20_000
# The reason of an intent that waited for approval when its run was cancelled: the cancel
# rejects it, so that no person is asked to decide a call that can no longer happen.
RUN_CANCELLED = "run cancelled"

# A run's id (its primary key). What also takes the text of one says so: ``RunId | str``.
RunId: TypeAlias = uuid.UUID
# Who decides, answers or sends: an instance of the project's AUTH_USER_MODEL (the class of the
# foreign keys it is stored in), which a reusable app cannot name in an annotation. ``api``
# checks its permission before a store sees it.
AuthUser: TypeAlias = Any
# One row of a run's log as the rebuild reads it: seq, kind, payload, content_start, content_end.
LogRow: TypeAlias = tuple[int, str, str, int | None, int | None]
# One row of ``load_steps``: seq, kind, payload.
StepTuple: TypeAlias = tuple[int, str, str]


@dataclasses.dataclass(frozen=True)
class ForkWrite:
    """What ``create_fork`` writes besides the run (``forks.plan_fork`` prepares it)."""

    # (source run, lo, hi): steps lo to hi - 1 of source's log are the fork's too.
    shares: list[tuple[RunId, int, int]]
    # The fork's own step at the fork point when it was edited: (seq, kind, payload).
    own_step: tuple[int, str, str] | None
    # The fork point's recorded calls, under the fork's keys: not made again by the fork.
    effects: list[ToolEffect]
    # A fork of a child run joins the child's tree (``run.parent_id`` set): it is counted
    # there as a spawn is (MAX_CHILD_RUNS of the parent, MAX_TREE_RUNS of the tree).
    max_children: int | None = None
    max_tree_runs: int | None = None


@dataclasses.dataclass(frozen=True)
class Presence:
    """A worker as its row in ``agent_worker`` says it, sent with each heartbeat."""

    worker_id: str
    instance: uuid.UUID  # this process's: a second process with the same id never beats
    host: str
    pid: int
    concurrency: int
    # [{"agent", "version", "model", "fingerprint"}]: the agent versions its code defines.
    versions: tuple[dict[str, str], ...]
    # Seconds the row counts as live after a beat (the worker's lease).
    alive_seconds: float
    runs_held: int = 0
    draining: bool = False


@dataclasses.dataclass(frozen=True)
class ReadAhead:
    """What the resume of a claimed run reads first, read with its claim's batch
    (``Store.read_ahead``): its log, the calls recorded at its last step, and whether a
    message waited in its inbox. Each is used once, by the claim's first read of it."""

    log: list[LogRow]  # decrypted, in seq order
    last_seq: int
    effects: dict[str, ToolEffect]  # the calls recorded at last_seq, by key
    messages_waiting: bool


@dataclasses.dataclass(frozen=True)
class Claim:
    """A run leased to one worker for one attempt; the (owner, attempt) pair is the fence."""

    run: AgentRun
    owner: str
    attempt: int
    lease_seconds: float
    # The payload of the task step when it is the run's only step (PostgreSQL claims).
    task_payload: str | None = None
    # Why a value the claim read did not decrypt (its key is not in ENCRYPTION_KEYS): the
    # runner dead-letters the run with this reason instead of advancing it.
    unreadable: str | None = None
    # When the lease was taken (monotonic, as the claim came back): where the worker starts
    # counting how long the lease holds (outage.LeaseClock).
    leased_at: float = dataclasses.field(default_factory=time.monotonic, compare=False)
    # What its resume reads first, read with its batch (``Store.read_ahead``), or None.
    ahead: ReadAhead | None = dataclasses.field(default=None, compare=False, repr=False)
    # Whether a message waited in the run's inbox when the claim took it (PostgreSQL claims;
    # None: not looked). Stands for the look before its first model call, as ``ahead`` does.
    messages_waiting: bool | None = dataclasses.field(default=None, compare=False)

    @property
    def run_id(self) -> RunId:
        return self.run.pk


@dataclasses.dataclass
class NextClaim:
    """A worker slot's offer to take its next run with the last step of the current one.

    ``take`` reserves the right to claim (False: the slot must not, e.g. it is stopping);
    ``give_back`` returns it when no run was claimable. ``claim`` is the run taken, if any."""

    owner: str
    lease_seconds: float
    take: Callable[[], bool]
    give_back: Callable[[], None]
    claim: Claim | None = None


@dataclasses.dataclass(frozen=True)
class StepWrite:
    """One step to commit: what ``Store.append_step`` writes (the step row, the effects that go
    with it, and the run's end when it is the last step). Every step of every run is committed
    through ``Store.append_step(claim, StepWrite(...))``; the runner builds it in ``_commit``.
    """

    seq: int  # must be the run's last_seq + 1 (the fence checks it)
    kind: str  # a StepKind: task, model_turn, tool_result
    payload: str  # the step's JSON text, stored verbatim
    request_id: str | None = None  # the model call's request id (model turns)
    # Completed tool calls committed with the step, recorded even when the fence fails.
    effects: Sequence[ToolEffect] = ()
    # (status, result): the last step of the run, which ends it in the same commit.
    finish: tuple[str, str | None] | None = None
    # With ``finish``: the run's validated final answer (``agent_run.output``; None: none).
    output: Any = None
    # Where the turn's content array lies in ``payload`` (the rebuild splices it verbatim).
    content_span: tuple[int, int] | None = None
    tokens: int = 0  # tokens the step billed, added to the run's tokens_used
    # A model turn's billed tokens by kind: the turn is counted in the daily rollup
    # (agent_usage_day) by the same commit. None for other steps.
    usage: Usage | None = None
    # What the turn cost in USD at PRICES, added to the run's cost_usd and the rollup's; None:
    # no price (the run's cost stays NULL, "no price", rather than $0).
    cost: Decimal | None = None


class LeaseLoss(enum.Enum):
    """Why a held run was not renewed and its work must stop."""

    CANCELLED = "cancelled"
    LOST = "lost"  # another worker holds it now (or it was handed back)


logger = logging.getLogger("durable_agents.store")


class Parked(enum.Enum):
    """What ``park_on_intent`` and ``park_on_wait`` did."""

    PARKED = "parked"  # the run is waiting
    DECIDED = "decided"  # the intent was decided meanwhile: go on, do not park
    READY = "ready"  # what the wait is for happened already: go on (with ``woken_by``)
    FENCE_FAILED = "fence_failed"  # the run is no longer this claim's


class CallbackReceipt(enum.Enum):
    """What ``receive_callback`` did with a body POSTed to a call's callback URL."""

    WOKEN = "woken"  # the run waited on this callback: pending now, the call gets the body
    KEPT = "kept"  # the call has not parked on it (yet): its park will find the body
    USED = "used"  # the call received its callback already: nothing changed
    OVER = "over"  # the call is over (its result recorded), or its run finished, or is gone


@dataclasses.dataclass(frozen=True)
class WaitSpec:
    """One wait of one tool call, as the store parks it (built from ``waits.Wait``)."""

    kind: WaitKind
    key: str  # the idempotency key of the call that waits
    seconds: float | None = None  # a timer's length, or the timeout of an event/runs wait
    until: datetime.datetime | None = None  # a timer's due time
    event: str | None = None
    runs: tuple[str, ...] = ()
    question: str | None = None


def refuse_strangers(strangers: Sequence[str]) -> None:
    """``Wait(runs=...)`` waits on this run's own children only: ``strangers`` are not."""
    if strangers:
        raise WaitRefused(
            "Wait(runs=...) waits only on runs that this run spawned with spawn_run; "
            f"not spawned by it: {', '.join(strangers[:10])}"
        )


def refuse_spawn(
    parent_status: str | None,
    children: int,
    max_children: int,
    tree_runs: int = 0,
    max_tree_runs: int | None = None,
) -> None:
    """``spawn_run`` starts no child of a parent that is over (or gone), nor past
    ``MAX_CHILD_RUNS`` children of the parent, nor past ``max_tree_runs`` runs in the tree
    (``tree_runs``: its root and every descendant so far)."""
    if parent_status not in (RunStatus.PENDING, RunStatus.RUNNING, RunStatus.WAITING):
        raise WaitRefused(f"the parent run is {parent_status or 'gone'}: no new child runs")
    if children >= max_children:
        raise WaitRefused(f"this run has {max_children} child runs already (MAX_CHILD_RUNS)")
    if max_tree_runs is not None and tree_runs >= max_tree_runs:
        raise WaitRefused(
            f"this run's tree holds {tree_runs} runs already, its root included "
            f"(MAX_TREE_RUNS={max_tree_runs}): no new child runs"
        )


def refuse_fork_in_tree(
    parent_status: str | None,
    root_status: str | None,
    children: int,
    tree_runs: int,
    write: ForkWrite,
) -> None:
    """A fork of a child run joins the child's tree: refused (``WaitRefused``) when the
    child's parent or the tree's root was cancelled (the cancel reached every run of the tree
    then, and would never reach the fork), or when the parent has ``max_children`` children
    or the tree holds ``max_tree_runs`` runs, its root included. A parent that ended otherwise
    does not refuse it: forking a dead child of a finished tree is how it is debugged."""
    for who, status in (("parent", parent_status), ("root", root_status)):
        if status == RunStatus.CANCELLED:
            raise WaitRefused(
                f"the {who} of the run's tree was cancelled: a fork of a run in it would run "
                "outside that cancel"
            )
    if write.max_children is not None and children >= write.max_children:
        raise WaitRefused(
            f"the run's parent has {write.max_children} child runs already (MAX_CHILD_RUNS), "
            "and a fork of a child run counts as one more"
        )
    if write.max_tree_runs is not None and tree_runs >= write.max_tree_runs:
        raise WaitRefused(
            f"the run's tree holds {tree_runs} runs already, its root included "
            f"(MAX_TREE_RUNS={write.max_tree_runs}), and a fork of a run in it counts as one more"
        )


def tree_root(parent: AgentRun) -> RunId:
    """The root of the tree a child of ``parent`` joins: the parent's root, or the parent."""
    return parent.root_id or parent.pk


def run_outcome(run: AgentRun) -> dict[str, Any]:
    """What a run waiting on ``run`` learns of it (``woken_by["runs"][id]``)."""
    outcome = {"status": run.status, "result": run.result, "error": run.error, "task": run.task}
    if run.output is not None:
        # Only a run whose agent has an output schema has one: other payloads stay as they were.
        outcome["output"] = run.output
    return outcome


def timer_woken_by(waiting_for: str) -> dict[str, Any]:
    """What a call gets when its wait ended by time: its timer, or the timeout of the wait."""
    return {"timer": True} if waiting_for == WaitKind.TIMER else {"timeout": True}


def ended(status: str, result: str | None, error: str, output: Any = None) -> dict[str, Any]:
    """The columns a run's end sets, but ``finished_at`` (each store writes its own clock's
    now). PostgreSQL's ``APPEND_LAST_STEP_SQL`` sets the same columns in SQL, with error ''
    (a run that succeeds in its last step is never dead: its ``dead_cause`` is already '').
    ``output``: the validated final answer (a JSON value), written with the status."""
    return {
        "status": status,
        "result": None if result is None else storable_text(result),
        "output": output,
        "error": storable_text(error, MAX_REASON_CHARS),
        "dead_cause": cause_of(error) if status == RunStatus.DEAD else "",
        "lease_owner": None,
        "lease_until": None,
    }


def lease_losses(missed: Sequence[tuple[RunId, str | None]]) -> dict[RunId, LeaseLoss]:
    """``renew_leases``'s answer from the runs it did not renew, with the status each had: a
    run that its own slot just finished, parked or released is not a loss."""
    lost: dict[RunId, LeaseLoss] = {}
    for run_id, status in missed:
        if status == RunStatus.CANCELLED:
            lost[run_id] = LeaseLoss.CANCELLED
        elif status == RunStatus.RUNNING:
            lost[run_id] = LeaseLoss.LOST
    return lost


class Store(abc.ABC):
    """Every operation that changes a run's or an intent's status, and the reads the state
    machine needs. See the module docstring for the flow; each method names its place in it."""

    # Whether the text of streamed turns can reach readers while it comes (LIVE_DELTAS):
    # PostgreSQL's NOTIFY carries it (``live.publish``); other stores' readers get each turn
    # when it is committed.
    sends_live_text: bool = False

    # Whether a worker using this store must look after the Django connections of its threads
    # besides calling it (a database store, this default): the worker then manages them
    # (``connections.DatabaseConnections``); a store without a database needs nothing.
    holds_connections: bool = True

    def now(self) -> datetime.datetime:
        """The time as this store tells it (``InMemoryStore``: its own clock)."""
        return timezone.now()

    # Whether the step log is partitioned by day (PostgreSQL): ``make_step_partitions`` then
    # has days to make, and a worker makes them again every hour.
    partitions_steps: bool = False

    def make_step_partitions(self) -> list[str]:
        """The step log's partitions for the days ahead, made if missing (a worker asks as it
        starts); the names made. Only PostgreSQL partitions the log."""
        return []

    @functools.cached_property
    def capacity(self) -> CapacityGate:
        """The fleet's grants of model capacity (rate limits, pauses after a 429), kept where
        this store keeps runs: the ORM's gate here, one in memory for ``InMemoryStore``."""
        from durable_agents.flow.capacity.portable import PortableCapacity

        return PortableCapacity()

    # -- create --------------------------------------------------------------------------

    @abc.abstractmethod
    def create_run(self, run: AgentRun, task_payload: str) -> AgentRun:
        """Start of the flow: insert ``run`` (an unsaved, pending AgentRun) and its task as
        step 0, together; returns the run as stored (database defaults filled in).

        A run with a ``start_key`` is inserted only if no run of its agent has that key,
        whatever that run's status: otherwise nothing is written and that run is returned
        as stored. Race-free: of concurrent callers with one key, one inserts and the others
        get its run."""

    def create_runs(self, runs: Sequence[tuple[AgentRun, str]]) -> list[AgentRun]:
        """``create_run`` of each ``(run, task payload)``, every run with a start key, in
        order; returns each key's run as stored (the new one, or the one that had the key). A
        database store does it in a few statements, whatever the number of runs."""
        return [self.create_run(run, payload) for run, payload in runs]

    @abc.abstractmethod
    def create_fork(self, run: AgentRun, write: ForkWrite) -> AgentRun:
        """Insert ``run`` (an unsaved, pending AgentRun whose ``last_seq`` is its fork point)
        with what ``write`` holds, together; returns the run as stored. The steps it shares
        stay the source runs' rows: the fork's log is its own rows plus those stretches.
        A fork of a child run (``run.parent_id`` set) joins its tree under the locks a spawn
        takes (the root's, then the parent's), its ``root_id`` the tree's; ``WaitRefused``
        as ``refuse_fork_in_tree`` says."""

    @abc.abstractmethod
    def debounce_run(self, run: AgentRun, task_payload: str, seconds: float) -> AgentRun:
        """A debounced start of ``run`` (unsaved, with a ``start_key``): returns the run of its
        agent and key as stored.

        No run with the key: ``run`` is inserted ``waiting`` for a quiet window
        (``waiting_for="debounce"``, ``wake_at`` ``seconds`` from now on the store's clock),
        with ``task_payload`` as step 0. A run with the key that still waits for its quiet
        window: one conditional update (guarded by that status and kind of wait) gives it
        ``run``'s task, version, model, priority and concurrency key, its step 0
        ``task_payload``, and a ``wake_at`` ``seconds`` from now. Any other run with the key
        (claimed, running, ended, or waiting on something else since) is returned unchanged.
        Race-free against other callers (one run per key) and against a claim of the run (a
        claim that took it first makes the update find nothing)."""

    # -- claim and renew -----------------------------------------------------------------

    @abc.abstractmethod
    def claim_runs(self, owner: str, lease_seconds: float, limit: int = 1) -> list[Claim]:
        """Claim: lease up to ``limit`` claimable runs, skipping rows others hold: first
        waiting runs whose ``wake_at`` is past (due timers and timeouts, in ``wake_at``
        order; ``woken_by`` becomes ``timer_woken_by``), then pending runs and running runs
        whose lease expired, highest ``priority`` first, then oldest ``created_at`` first.
        Each becomes running, owned by
        ``owner`` until now + ``lease_seconds``, with ``attempt`` and ``stalled_claims``
        incremented."""

    @abc.abstractmethod
    def claim_run(self, run_id: RunId, owner: str, lease_seconds: float) -> Claim | None:
        """Claim one given run if it is claimable now (tests, "run now" operations)."""

    @abc.abstractmethod
    def renew_leases(
        self,
        owner: str,
        claims: Sequence[Claim],
        lease_seconds: float,
        using: BaseDatabaseWrapper | None = None,
        presence: Presence | None = None,
    ) -> dict[RunId, LeaseLoss]:
        """Renew: the heartbeat of a whole worker. Renews the leases of ``claims`` (all of
        ``owner``) that still hold, and returns the runs whose work must stop: cancelled, or
        no longer this worker's. ``using``: a connection wrapper (database stores).
        ``presence``: the worker's row is beaten in the same statement (or transaction)."""

    # -- the worker's row (agent_worker) -------------------------------------------------

    @abc.abstractmethod
    def register_worker(
        self, presence: Presence, definitions: Sequence[dict[str, Any]]
    ) -> AgentWorker | None:
        """Write the worker's row and record the agent versions it defines (``definitions``:
        ``Agent.digests()`` with agent and version); or, when a live worker of another process
        holds the id, write nothing and return that worker's row."""

    @abc.abstractmethod
    def beat_worker(self, presence: Presence) -> None:
        """The worker's heartbeat when it holds no run (``renew_leases`` beats otherwise)."""

    @abc.abstractmethod
    def unregister_worker(self, presence: Presence, definitions: Sequence[dict[str, Any]]) -> None:
        """A clean stop: the row goes; its versions were defined until now."""

    @abc.abstractmethod
    def renew_lease(self, claim: Claim) -> bool:
        """Renew one lease, fenced; False when the run was cancelled or taken over."""

    # -- commit --------------------------------------------------------------------------

    @abc.abstractmethod
    def append_step(
        self, claim: Claim, step: StepWrite, then_claim: NextClaim | None = None
    ) -> bool:
        """Where a step is committed (the one method; each store's own ``append_step`` says
        how): commit ``step`` (fenced) if, and only if, this claim still holds the run and
        ``step.seq`` is ``last_seq + 1``. Renews the lease, resets ``stalled_claims`` and adds
        ``step.tokens``; with ``step.finish=(status, result)`` it ends the run instead of
        renewing (its last step), and with ``then_claim`` as well it may claim the worker's
        next run (``then_claim.claim`` is set, or left None).

        ``step.effects`` are recorded whatever the fence says (a recorded call never runs
        again); a key already recorded is left as it was. False: the fence failed, nothing
        appended. True too when the step is in the log as this claim's already (``committed_by``:
        a commit tried again after a lost connection, whose first try landed).

        A model turn (``step.usage``) adds ``step.cost`` to the run's ``cost_usd`` and is
        counted in the day's rollup (``agent_usage_day``), in the same commit. It was paid for
        whatever the fence says: when the fence fails, or the database refuses the step, the
        turn is still counted (``count_unstored_turn``) in the run's ``tokens_used`` and
        ``cost_usd`` and in the rollup, though not in its log."""

    def append_turn_and_results(self, claim: Claim, turn: StepWrite, results: StepWrite) -> bool:
        """Commit the model turn ``turn`` and its tool_result step ``results`` (seq + 1), each
        as ``append_step`` commits it; False when the fence failed (a paid turn not appended is
        counted as ``append_step`` counts it). The runner sends a turn this way when every call
        it asked for was pure and ended at once. This default commits them one after the other
        (the turn may land alone, as when they go one by one); PostgreSQL sends one statement
        that appends both or neither. Unlike ``append_step``'s, the results' effects are
        recorded only with the turn: a claim that commits a turn of its own at that seq later
        reads no ledger for it (the turn is fresh), and the calls, pure, may simply run again."""
        return self.append_step(claim, turn) and self.append_step(claim, results)

    def committed_by(self, claim: Claim, seq: int) -> bool:
        """Whether step ``seq`` of the run is in the log as this claim's (its attempt and its
        worker). ``append_step`` asks when its fence fails: a commit tried again after a lost
        connection, whose first try did reach the disk, is this claim's own step, committed,
        not a lost fence."""
        from durable_agents.models import AgentStep

        return AgentStep.objects.filter(
            run_id=claim.run_id, seq=seq, attempt=claim.attempt, worker=claim.owner
        ).exists()

    @abc.abstractmethod
    def count_unstored_turn(self, claim: Claim, step: StepWrite) -> None:
        """A model turn that was paid for but not committed (its fence failed, or the
        database refused it): its tokens and cost are added to the run and to the rollup,
        unfenced (counters only: no status, lease or log changes). Never called for a turn
        that was committed, so nothing is counted twice."""

    # -- end, hand back, park ------------------------------------------------------------

    @abc.abstractmethod
    def finish_run(
        self,
        claim: Claim,
        status: str,
        *,
        result: str | None = None,
        error: str = "",
        output: Any = None,
    ) -> bool:
        """Finish: end the run (succeeded, failed or dead) and free its lease; fenced.
        ``output``: the validated final answer, written by the same statement."""

    @abc.abstractmethod
    def release_lease(
        self,
        claim: Claim,
        *,
        error: str | None = None,
        count_claim: bool = True,
        hold_seconds: float | None = None,
        waiting_for: WaitKind | None = None,
    ) -> bool:
        """Release: hand the run back (pending); fenced. ``count_claim=False`` takes back the
        no-progress count of this claim (a shutdown is not the run's fault).
        ``hold_seconds`` keeps it claimable by nobody for that long (the lease column doubles
        as a not-before time); otherwise it is claimable at once. ``waiting_for`` records
        what the pending run waits for meanwhile (model capacity), since now."""

    @abc.abstractmethod
    def wait_for_worker(self, claim: Claim, reason: str) -> bool:
        """Park a run this worker cannot serve (its code lacks the run's agent version, or
        defines it differently): ``waiting`` for a worker that can (``WaitKind.WORKER``), out
        of every claim's way, with ``reason``; fenced. The claim costs the run no attempt.
        ``wake_served_runs`` of a worker that can serve it makes it pending again."""

    @abc.abstractmethod
    def park_unserved_runs(self, served: Collection[tuple[str, str]]) -> int:
        """Park the runs no worker holds (pending, or running with an expired lease) whose
        (agent, version) is not in ``served`` (what the live workers define): ``waiting`` for
        a worker, so that claims no longer read past them. Returns how many."""

    @abc.abstractmethod
    def wake_served_runs(self, can_serve: Callable[[str, str, str, str], bool]) -> int:
        """Make pending again the runs waiting for a worker that ``can_serve(agent, version,
        model, fingerprint)`` says this process serves. Returns how many."""

    @abc.abstractmethod
    def park_on_intent(
        self,
        claim: Claim,
        intent: ToolIntent,
        *,
        new: bool = False,
        unknown_because: str | None = None,
    ) -> Parked:
        """Park: the run becomes ``waiting`` on ``intent`` (lease freed, not claimable), in one
        transaction that also writes a ``new`` intent, or, with ``unknown_because`` (the
        intent was left ``executing``: its worker died, shut down or gave up at the timeout),
        marks it ``unknown`` and records why as the intent's ``reason`` and the run's
        ``error``, where a person reads it; fenced. ``intent`` gets the status and reason.

        An existing intent is locked first and the run is parked only while the intent still
        waits for a person. Decisions lock the intent and then wake the run, in the same
        order, so whichever commits first, no interleaving leaves a run waiting on an intent
        that was already decided."""

    @abc.abstractmethod
    def start_intent_execution(self, claim: Claim, intent: ToolIntent) -> bool:
        """approved -> executing, fenced on the run and renewing its lease, committed before
        the tool runs (after a crash an ``executing`` intent without an effect is how we know
        its outcome is unknown). False: the run is no longer this claim's or the intent is
        no longer approved; the call must not run. Sets ``intent.status`` when started."""

    @abc.abstractmethod
    def complete_intent(self, intent: ToolIntent, effect: ToolEffect) -> None:
        """The approved call ran: record its effect, mark the intent done (from executing or
        unknown) and wake the run if it is parked, together. Not fenced: the call happened
        whoever holds the run now. Sets ``intent.status``."""

    # -- wake and decide -----------------------------------------------------------------

    @abc.abstractmethod
    def wake_run(self, run_id: RunId) -> bool:
        """Wake: a parked run (waiting) becomes claimable again (pending). Callers hold the
        lock of what was decided (the intent), so a park and a wake never cross."""

    @abc.abstractmethod
    def decide_intent(
        self, intent_id: int, user: AuthUser, from_status: str, to_status: str, reason: str
    ) -> ToolIntent:
        """A person's decision: ``from_status`` -> ``to_status`` (approve, reject), by
        ``user``, then wake the run, under the intent's lock. An intent no longer in
        ``from_status`` is left as it is. Returns the intent as stored."""

    @abc.abstractmethod
    def resolve_intent(
        self, intent_id: int, user: AuthUser, *, outcome: tuple[str, bool] | None, reason: str
    ) -> ToolIntent:
        """Settle an ``unknown`` intent: ``outcome`` (text, is_error) of the call that did
        happen is recorded as its effect and the intent is done; None: it did not happen and
        the intent is approved again (the call runs again). Then wake the run. An intent that
        is not unknown is returned unchanged."""

    # -- batched model turns (store/batches.py on the database stores) ---------------------

    def park_on_batch(self, claim: Claim, turn: BatchTurn) -> Parked:
        """Park a run in batches on its next model turn: record the request (the body a direct
        call would send) and make the run ``waiting`` on it (``WaitKind.BATCH``, lease freed,
        ``stalled_claims`` 0); fenced on the claim and on ``turn.seq`` being ``last_seq + 1``.
        ``READY`` (nothing changed) when that request waited past BATCH_FALLBACK_SECONDS: the
        run sends it directly. Only the database stores keep batches."""
        raise TypeError(
            f"runs in batches need a database store: {type(self).__name__} keeps no batches"
        )

    def wake_batch_answers(self, candidates: Sequence[Candidate], woken_by: str) -> set[int]:
        """In the caller's transaction: make the run of each succeeded batch answer pending,
        its turn's seq its ``last_seq`` and its tokens and cost added, fenced on the run still
        waiting on that request at that position; the request ids whose run it woke (the
        batch poller then inserts their steps)."""
        raise TypeError(
            f"runs in batches need a database store: {type(self).__name__} keeps no batches"
        )

    # -- waits: timers, events, child runs, questions -------------------------------------

    @abc.abstractmethod
    def park_on_wait(self, claim: Claim, spec: WaitSpec) -> tuple[Parked, dict[str, Any] | None]:
        """Park: the run becomes ``waiting`` on ``spec`` (lease freed, ``stalled_claims`` 0,
        ``woken_by`` cleared); fenced. Not parked, ``(READY, woken_by)``, when what it waits
        for is over already: the event was sent, the runs ended, the question was answered.
        Raises ``WaitRefused`` for runs that this run did not spawn."""

    @abc.abstractmethod
    def send_event(self, name: str, payload: Any, user: AuthUser = None) -> tuple[AgentEvent, int]:
        """Store the event ``name`` once and wake every run waiting on it, in one transaction
        (the wake is one UPDATE). A second send of the name changes nothing and returns the
        first. Returns the stored event and the number of runs woken."""

    @abc.abstractmethod
    def receive_callback(self, run_id: RunId, key: str, body: Any) -> CallbackReceipt:
        """Store the callback ``body`` of the call ``key`` of run ``run_id``, once, and wake the
        run if it waits on that callback (one conditional UPDATE: still waiting, on a
        callback, of that call), in one transaction that first locks the run's row (which
        ``park_on_wait`` locks too: a park and a POST that race see each other). Nothing is
        stored when the call received its callback already (``USED``: the key is unique), when
        its result is recorded, or when its run finished or does not exist (``OVER``); a
        dead run keeps the body (it may be requeued)."""

    @abc.abstractmethod
    def received_callback(self, key: str) -> AgentCallback | None:
        """The callback the call ``key`` received, if any (a woken call reads its body here:
        the run stores only when it came)."""

    @abc.abstractmethod
    def answer_question(
        self, run_id: RunId | str, user: AuthUser, text: str, question_id: int | None = None
    ) -> AgentQuestion | None:
        """Answer the run's newest question (or ``question_id``, if it is the run's) while it
        is open, and wake the run. An answered question is returned as it is; None when there
        is no such question."""

    @abc.abstractmethod
    def spawn_run(
        self,
        child: AgentRun,
        task_payload: str,
        max_children: int,
        max_tree_runs: int | None = None,
    ) -> tuple[AgentRun, bool]:
        """Create ``child`` (unsaved, with ``parent_id`` and ``spawn_key`` set) and its task
        step, unless the parent already has a child with that key: that one is returned.
        The child gets its parent's ``priority`` and its tree's root (``root_id``), read
        under the locks of the root and the parent (in that order: concurrent spawns
        anywhere in one tree count its runs one at a time). Refused (``WaitRefused``) when
        the parent is over, has ``max_children`` already, or its tree holds
        ``max_tree_runs`` runs. Returns (run, created)."""

    @abc.abstractmethod
    def wake_parent(self, parent_id: RunId) -> bool:
        """After a child ended: wake its parent if it waits on runs that have all ended, with
        their outcomes as ``woken_by``. Locks the parent before reading the children, as
        ``park_on_wait`` does, so the last child to end always sees the parent parked."""

    @abc.abstractmethod
    def stranded_parents(self, limit: int) -> list[RunId]:
        """Runs waiting on runs (housekeeping checks them with ``wake_parent``: a worker that
        died between a child's end and the wake leaves its parent here)."""

    @abc.abstractmethod
    def sent_event(self, name: str) -> AgentEvent | None:
        """The event ``name`` if it was sent (a woken call reads its payload here: the runs
        it woke store only a reference to it)."""

    @functools.cached_property
    def _sent_payloads(self) -> SentPayloads:
        return SentPayloads()

    def sent_event_payload(self, name: str, at: str | None) -> Any:
        """The payload of the event ``name`` sent at ``at`` (what a woken run stores), read
        once per process for all the runs it woke (``SentPayloads``); None if not sent."""
        return self._sent_payloads.payload(self.sent_event, name, at)

    @abc.abstractmethod
    def question_for_key(self, key: str) -> AgentQuestion | None:
        """The question asked by the ``ask_person`` call with this idempotency key."""

    @abc.abstractmethod
    def run_outcomes(self, run_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
        """``run_outcome`` of each run, by id text (runs that do not exist are left out)."""

    def child_ended(self, parent_id: RunId | None) -> None:
        """Called by every end of a run (after its commit): wake its parent if it waits. A
        failure here is logged; housekeeping's sweep wakes the parent later."""
        if parent_id is None:
            return
        try:
            self.wake_parent(parent_id)
        except Exception:  # the child's end is committed; the sweep repairs
            logger.exception("waking parent run %s failed; housekeeping will", parent_id)

    # -- a run's inbox (store/inbox.py on the database stores) -----------------------------

    def queue_message(
        self,
        run_id: RunId,
        text: str,
        key: str | None,
        user: AuthUser = None,
        *,
        busy_refused: bool = False,
    ) -> tuple[AgentMessage, bool]:
        """Queue ``text`` in the run's inbox, under the run's lock: the message and True, or
        the message queued before with ``key`` and False (whatever the run's status now).
        ``RunNotFound``, ``RunFinished`` for a run that is over, and with ``busy_refused``
        ``RunBusy`` for a pending or running one; nothing is queued then."""
        from durable_agents.store import inbox

        return inbox.queue_message(run_id, text, key, user, busy_refused=busy_refused)

    def has_waiting_messages(self, run_id: RunId) -> bool:
        """Whether messages wait in the run's inbox (one index probe, before a model call)."""
        from durable_agents.store import inbox

        return inbox.has_waiting(run_id)

    def waiting_messages(self, run_id: RunId) -> list[AgentMessage]:
        """The run's messages not folded yet, in the order they were sent."""
        from durable_agents.store import inbox

        return inbox.waiting_messages(run_id)

    def fold_messages(self, claim: Claim, step: StepWrite, ids: Sequence[int]) -> bool:
        """Commit ``step`` (``append_step``, fenced) and mark the messages ``ids`` folded at
        its seq, in one transaction. False: the fence failed, nothing changed."""
        from durable_agents.store import inbox

        return inbox.fold_messages(self, claim, step, ids)

    def finish_unless_messages(
        self, claim: Claim, result: str | None, output: Any = None
    ) -> bool | None:
        """End the run as succeeded (``finish_run``) unless messages wait in its inbox (None:
        nothing changed), under the run's lock as ``append_last_step``: for a run whose final
        answer an earlier claim committed."""
        from durable_agents.store import inbox

        return inbox.finish_unless_messages(self, claim, result, output)

    def lock_run_row(self, run_id: RunId) -> None:
        """Lock the run's row until the transaction ends (``SELECT ... FOR NO KEY UPDATE``
        where the database has it): what ``queue_message`` and a run's last commit both take,
        so that each sees what the other committed."""
        AgentRun.objects.select_for_update(no_key=True).filter(pk=run_id).exists()

    def interrupt_model_call(self, run_id: RunId) -> None:
        """Ask the worker holding the run to abandon its model call in flight, if any
        (``send_message(..., policy="interrupt")``). A store without notifications does
        nothing: the message waits for the next turn boundary, as a queued one does."""
        return None

    def read_ahead(self, claims: Sequence[Claim]) -> list[Claim]:
        """``claims`` (just claimed, as ``claim_runs`` returned them), those of runs claimed
        again with what their resume reads first (``Claim.ahead``): their logs, the calls
        recorded at their last steps and whether messages wait, one statement each for the
        whole batch (store/read_ahead.py). A claim it cannot help comes back as it was."""
        from durable_agents.store import read_ahead

        return read_ahead.read_ahead(claims)

    def append_last_step(
        self, claim: Claim, step: StepWrite, then_claim: NextClaim | None = None
    ) -> bool | None:
        """``append_step`` of a step that ends the run, unless messages wait in its inbox
        (None: nothing appended, the run goes on to answer them), decided under the run's
        lock, which ``queue_message`` takes too: no message is accepted by a run that then
        ends without it."""
        from durable_agents.store import inbox

        return inbox.append_last_step(self, claim, step, then_claim)

    # -- operations on any run -----------------------------------------------------------

    @abc.abstractmethod
    def cancel_run(self, run_id: RunId | str) -> bool:
        """Cancel a pending, running, waiting or dead run (lease freed, finished now), with
        its unfinished descendants (database stores: in batches, a transaction each, after
        the run's own), and in the same transaction as each run its open questions and its
        intents that wait for approval (rejected, ``RUN_CANCELLED``). A worker holding one
        is refused by its fence from then on. Then its parent learns of it
        (``child_ended``). False if the run was over."""

    @abc.abstractmethod
    def requeue_run(self, run_id: RunId | str) -> bool:
        """A dead run back to pending, with a fresh no-progress count (its error stays)."""

    @abc.abstractmethod
    def dead_letter(self, run_id: RunId, reason: str) -> bool:
        """Send an active run that no worker holds (pending, waiting, or running with its
        lease expired) to the dead letter with ``reason``: the end of ``finish_run``, but not
        fenced on a claim. False if the run is held or over."""

    # -- reads ---------------------------------------------------------------------------

    @abc.abstractmethod
    def current_status(self, run_id: RunId) -> str | None:
        """The run's status now (None: no such run)."""

    @abc.abstractmethod
    def spent_today(self, key: str) -> tuple[Decimal, Decimal | None]:
        """What runs of concurrency key ``key`` cost in the UTC day so far (the rollup), and
        the key's budget as staff set it (None: the BUDGETS setting decides)."""

    @abc.abstractmethod
    def set_key_limit(self, key: str, limit: int | None) -> None:
        """Set (None: clear) ``key``'s concurrency limit, which wins over CONCURRENCY_LIMITS
        and the agents'; claims everywhere follow it within a few seconds."""

    @abc.abstractmethod
    def set_key_budget(self, key: str, usd_per_day: Decimal | None) -> int:
        """Set (None: clear) ``key``'s budget override and hand back at once the key's runs
        that wait for their budget; returns how many."""

    @abc.abstractmethod
    def next_wake_in(self) -> float | None:
        """Seconds until the first timer or timeout of a waiting run comes due, by the
        clock the claim compares ``wake_at`` with (negative: one is due already), or None when
        no waiting run has one. An idle worker sleeps until then rather than a whole poll."""

    @abc.abstractmethod
    def first_claimable(self) -> tuple[str, int] | None:
        """The model and priority of the pending run a claim would take first (due waits
        aside), or None: whom the next room for a model call is for."""

    @abc.abstractmethod
    def load_log_rows(self, run_id: RunId | str, *, shares: bool = True) -> list[LogRow]:
        """The whole log of a run, in seq order, for the rebuild (``history.load_log``).
        ``shares=False``: the run is no fork (``fork_seq`` is None), so it shares no stretch
        of another run's log and only its own rows are read."""

    @abc.abstractmethod
    def load_steps(self, run_id: RunId, after_seq: int = -1) -> list[StepTuple]:
        """The log of a run after ``after_seq``, in seq order (``history.load_steps``)."""

    @abc.abstractmethod
    def recorded_effects(self, run_id: RunId, seq: int) -> dict[str, ToolEffect]:
        """The calls of one turn that already completed, by key."""

    @abc.abstractmethod
    def record_effect(self, effect: ToolEffect) -> None:
        """Commit one completed call. A second recording of the same key changes nothing."""

    @abc.abstractmethod
    def intent_for_key(self, key: str) -> ToolIntent | None:
        """The intent of the irreversible call with this idempotency key, if written."""

    @abc.abstractmethod
    def reload_intent(self, intent: ToolIntent) -> None:
        """Read ``intent`` again, in place (its status may have been decided meanwhile)."""


def unsealed_log(rows: list[LogRow]) -> list[LogRow]:
    """The log's rows with their payloads decrypted (``UndecryptableValue`` for one whose key
    is not configured); plain rows are kept as they are, without a copy."""
    ring = encryption.keyring()  # once, not once a row: a rebuild may read thousands
    for index, (seq, kind, payload, start, end) in enumerate(rows):
        if payload.startswith(encryption.MARKED):
            rows[index] = (seq, kind, encryption.unseal(payload, STEP_PAYLOAD, ring), start, end)
    return rows


@typing.runtime_checkable
class ScheduleStore(typing.Protocol):
    """What firing schedules needs of a store besides ``Store`` (schedules/firing.py holds the
    flow): the database stores (``PortableStore``, ``PostgresStore``) implement it;
    ``InMemoryStore`` does not (it keeps no schedules). ``schedule_store`` says which."""

    def take_due_schedules(self, now: datetime.datetime | None, limit: int) -> DueSchedules:
        """In the caller's transaction: the earliest next slot of the schedules that fire,
        the clock (``now``, or the database's), and up to ``limit`` due schedules, earliest
        first, locked until the transaction ends (skipping those another firer holds)."""

    def fire_slots(
        self,
        starts: Sequence[SlotStart],
        rows: Sequence[AgentSchedule],
        last_keys: Mapping[int, str],
    ) -> dict[str, RunId]:
        """In the caller's transaction: start the run of each slot (none when its agent has
        a run with the slot's key) and save ``rows`` moved on (``last_keys[row.pk]``: the key
        whose run becomes the row's last run). Returns each key's run id as stored."""

    def move_schedules(self, rows: Sequence[AgentSchedule]) -> None:
        """Save the next slot, last slot, last run and broken of ``rows``."""


def schedule_store(store: Store) -> ScheduleStore:
    """``store`` as the schedule firer needs it; ``TypeError`` for a store that keeps no
    schedules (``InMemoryStore``): firing schedules needs a database store."""
    if not isinstance(store, ScheduleStore):
        raise TypeError(
            f"firing schedules needs a database store: {type(store).__name__} keeps no schedules"
        )
    return store
