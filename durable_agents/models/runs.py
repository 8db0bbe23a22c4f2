"""``agent_run``: a run, the statuses it goes through (``RunStatus``), what a waiting run waits
for (``WaitKind``), the querysets of the claim and the housekeeping, and the two proxies that
put the operations and dead-letter pages in the admin's list of models. Status changes live in
``store/``, not here."""

from __future__ import annotations

import json
import re
import uuid
from typing import TYPE_CHECKING, Any, ClassVar

from django.db import connections, models
from django.db.models.expressions import RawSQL
from django.db.models.functions import Cast, Now, Replace, Right, Substr
from django.db.models.lookups import Exact, In
from django.utils.translation import gettext_lazy as _

from durable_agents.declare.context import RunContext
from durable_agents.models.fields import JSONTextField
from durable_agents.models.ids import SHORT_ID_DIGITS, new_run_id

if TYPE_CHECKING:
    from django.db.backends.base.base import BaseDatabaseWrapper
    from django.db.models.sql.compiler import SQLCompiler
    from django_stubs_ext import StrOrPromise


class RunStatus(models.TextChoices):
    PENDING = "pending", _("Pending")
    RUNNING = "running", _("Running")
    WAITING = "waiting", _("Waiting")
    SUCCEEDED = "succeeded", _("Succeeded")
    FAILED = "failed", _("Failed")
    CANCELLED = "cancelled", _("Cancelled")
    DEAD = "dead", _("Dead letter")


# A worker may claim a run in these statuses (when its lease is free or expired).
CLAIMABLE_STATUSES = (RunStatus.PENDING, RunStatus.RUNNING)
# A person may cancel a run in these statuses (a dead run too: closing it is triage).
CANCELLABLE_STATUSES = (RunStatus.PENDING, RunStatus.RUNNING, RunStatus.WAITING, RunStatus.DEAD)
FINISHED_STATUSES = (RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.CANCELLED)
# A run that waits on runs (``Wait(runs=...)``) is woken when each is in one of these: a child's
# failure, cancellation or dead letter is its parent's information, not its parent's failure.
ENDED_STATUSES = (*FINISHED_STATUSES, RunStatus.DEAD)
# The longest key ``start_run(..., key=...)`` takes (the column agent_run.start_key).
MAX_START_KEY = 200
# The longest ``start_run(..., concurrency_key=...)`` (the column agent_run.concurrency_key).
MAX_CONCURRENCY_KEY = 200


class WaitKind(models.TextChoices):
    """What a ``waiting`` run waits for (``AgentRun.waiting_for``)."""

    INTENT = "intent", _("an approval")
    TIMER = "timer", _("a timer")
    EVENT = "event", _("an event")
    RUNS = "runs", _("child runs")
    QUESTION = "question", _("an answer")
    # ``Wait(callback=True)``: a service's POST to the call's signed URL (``callback_url``).
    CALLBACK = "callback", _("a callback")
    # A pending run handed back until its model has capacity again (a rate limit, a 429's
    # pause): it holds no slot, no connection and no attempt meanwhile.
    CAPACITY = "capacity", _("model capacity")
    # A pending run whose concurrency key spent its budget for the UTC day: handed back until
    # the next day, or until someone raises the budget.
    BUDGET = "budget", _("its key's budget")
    # A debounced start (``start_run(..., key=, debounce=)``): the run has not started yet and
    # starts once its start key has been quiet until wake_at; no model has seen its task.
    DEBOUNCE = "debounce", _("a quiet window")
    # A pending run no live worker can serve: none defines its agent version, or none with
    # the definition (fingerprint) the run started with. It costs no attempt meanwhile; a
    # worker that defines it claims it as any pending run.
    WORKER = "worker", _("a worker that defines its version")
    # A run in batches (``start_run(..., batch=True)``): its next model turn is a request in a
    # Message Batch (``agent_batch_request``, by ``wait_key``); the batch poller commits the
    # answer and makes it pending. No slot, no connection and no attempt meanwhile.
    BATCH = "batch", _("a batched model turn")


def in_flight_version_index() -> models.Index:
    """The index ``agent_run_in_flight_version``: (agent, prompt_version, status, created_at)
    of the runs in flight (pending, running, waiting): the operations page counts them by
    version and status, with the oldest, from the index alone."""
    return models.Index(
        fields=["agent", "prompt_version", "status", "created_at"],
        name="agent_run_in_flight_version",
        condition=models.Q(status__in=["pending", "running", "waiting"]),
    )


def id_tail_index() -> models.Index:
    """The index ``agent_run_id_tail``: on the last ``SHORT_ID_DIGITS`` hex digits of a run's
    id, as text, the short id of a time-ordered id (``ids.short_id``). SQLite stores a UUID as
    its 32 hex digits, PostgreSQL's ``id::text`` has dashes, but its last 12 characters are one
    group without any: the same digits on both. Migration 0026 builds it."""
    tail = Right(Cast("id", output_field=models.TextField()), SHORT_ID_DIGITS)
    return models.Index(tail, name="agent_run_id_tail")


# The index ``agent_run_metadata`` (PostgreSQL only): a GIN index (``jsonb_path_ops``) on the
# runs' metadata, for containment (``metadata @> '{"tenant": "acme"}'``, ``with_metadata``).
# Migration 0029 builds it CONCURRENTLY in SQL of its own and leaves it out of the model's
# state: declared here as a GinIndex it would make django.contrib.postgres a requirement of
# every project (Django 6 checks it, postgres.E005), SQLite ones included. Metadata never
# changes once the run has started, so updates stay HOT.
METADATA_INDEX = "agent_run_metadata"


class IdTail(Right):
    """The expression of ``agent_run_id_tail`` in a query: a database uses the index only for
    a condition spelled as the index is. SQLite also wants the same constants where the index
    has them (it plans before a parameter's value is known): its numbers are written into the
    statement as the schema editor wrote them into the index's."""

    def __init__(self) -> None:
        super().__init__(Cast("id", output_field=models.TextField()), SHORT_ID_DIGITS)

    def as_sqlite(
        self, compiler: SQLCompiler, connection: BaseDatabaseWrapper, **extra_context: Any
    ) -> tuple[str, tuple[str | int, ...]]:
        sql, params = super().as_sqlite(compiler, connection, **extra_context)
        return sql % tuple(str(int(param)) for param in params), ()


def _id_digit(position: int) -> Substr:
    """The hex digit of a run's id at ``position`` (1 to 32, dashes left out: the same on
    both databases)."""
    digits = Replace(Cast("id", output_field=models.TextField()), models.Value("-"))
    return Substr(digits, position, 1)


def time_ordered_id_ending(digits: str) -> models.Q:
    """The runs with a time-ordered id whose last hex digits are ``digits`` (lowercase,
    ``SHORT_ID_DIGITS`` of them): the run whose short id they are. Found through the index
    ``agent_run_id_tail``; its version (7) and variant digits (8, 9, a, b) are checked on the
    rows the index found, so that a random id that happens to end so is not taken for it (the
    short id of a random id is its first digits)."""
    return (
        models.Q(Exact(IdTail(), digits))
        & models.Q(Exact(_id_digit(13), "7"))
        & models.Q(In(_id_digit(17), ["8", "9", "a", "b"]))
    )


# How the admin and the command line read a run id typed by a person: the first characters
# of an id (4 to 36 hex digits and dashes), or the short id of a time-ordered one.
_HEX_PREFIX = re.compile(r"^[0-9a-fA-F-]{4,36}$")
_SHORT_ID = re.compile(rf"^[0-9a-fA-F]{{{SHORT_ID_DIGITS}}}$")


def run_id_prefix(term: str) -> str | None:
    """``term`` as the first characters of a run id (4 to 31 hex digits, dashes ignored, as the
    admin shows ids: "3f2a1c9e"), lowercase; None for anything else, a whole id included."""
    if not _HEX_PREFIX.match(term):
        return None
    digits = term.replace("-", "").lower()
    return digits if 4 <= len(digits) < 32 else None


def run_id_tail(term: str) -> str | None:
    """``term`` as the short id of a time-ordered run, the last 8 hex digits of its id as the
    admin shows them ("9c41e07b"), lowercase; None for anything else."""
    return term.lower() if _SHORT_ID.match(term) else None


def short_id_match(term: str) -> models.Q | None:
    """The runs ``term`` names as the admin shows ids, each way it can: the runs whose id
    starts with it (a random id's short id is its first digits: ``id_range``) and the
    time-ordered run whose short id it is (its last digits: ``time_ordered_id_ending``, through
    the index ``agent_run_id_tail``). None for a term that is neither."""
    by_head = id_range(term)
    tail = run_id_tail(term)
    by_tail = None if tail is None else time_ordered_id_ending(tail)
    if by_head is None or by_tail is None:
        return by_head or by_tail
    return by_head | by_tail


def id_range(term: str) -> models.Q | None:
    """A run id's first characters as a range of the primary key. The same on PostgreSQL
    (uuid, ordered bytewise) and SQLite (32 lowercase hex digits); dashes are ignored, as in a
    pasted "3f2a1c9e-12"."""
    if not _HEX_PREFIX.match(term):
        return None
    digits = term.replace("-", "").lower()
    if not 4 <= len(digits) <= 32:
        return None
    low = uuid.UUID(digits.ljust(32, "0"))
    high = uuid.UUID(digits.ljust(32, "f"))
    return models.Q(pk__gte=low, pk__lte=high)


class AgentRunQuerySet(models.QuerySet["AgentRun"]):
    def claimable(self) -> AgentRunQuerySet:
        """Runs a worker may take now but due waits (``due``); served by the partial index
        ``agent_run_claim_fair``. Concurrency limits are the claim's (store/concurrency.py)."""
        return self.filter(status__in=CLAIMABLE_STATUSES).filter(
            models.Q(lease_until__isnull=True) | models.Q(lease_until__lt=Now())
        )

    def due(self) -> AgentRunQuerySet:
        """Waiting runs whose timer or timeout is past: a worker may take them too; served by
        the partial index ``agent_run_wake``."""
        return self.filter(status=RunStatus.WAITING, wake_at__lte=Now())

    def not_leased(self) -> AgentRunQuerySet:
        """Active runs no worker holds right now (pending, waiting, or running with a lease
        that is missing or expired): what housekeeping may dead-letter."""
        return self.filter(
            models.Q(status__in=(RunStatus.PENDING, RunStatus.WAITING))
            | models.Q(status=RunStatus.RUNNING, lease_until__lt=Now())
            | models.Q(status=RunStatus.RUNNING, lease_until__isnull=True)
        )

    def active(self) -> AgentRunQuerySet:
        return self.filter(status__in=(*CLAIMABLE_STATUSES, RunStatus.WAITING))

    def dead(self) -> AgentRunQuerySet:
        return self.filter(status=RunStatus.DEAD)

    def with_metadata(self, **pairs: Any) -> AgentRunQuerySet:
        """Runs whose metadata holds each ``key=value`` given: ``with_metadata(tenant="acme")``.
        On PostgreSQL a containment (``metadata__contains``) that the GIN index
        ``agent_run_metadata`` serves; a nested value matches when the run's value contains it.
        SQLite has no containment of JSON: there each key's value is compared whole."""
        return self.filter(metadata_match(connections[self.db].vendor, pairs))


def metadata_match(vendor: str, pairs: dict[str, Any]) -> models.Q:
    """The condition ``with_metadata`` filters on: containment on PostgreSQL (served by the
    index ``agent_run_metadata``), each key's value on other databases."""
    if not pairs:
        return models.Q()
    if vendor == "postgresql":
        return models.Q(metadata__contains=pairs)
    # SQLite's JSON functions: the key's value, of the same JSON type, equal (an object or a
    # list compared as its JSON text). A key is quoted in the path, so "0" or "a.b" is a key.
    return models.Q(
        *(
            RawSQL(
                "(json_type(metadata, %s) = json_type(%s) AND"
                " json_extract(metadata, %s) IS json_extract(%s, '$'))",
                [path, text, path, text],
                output_field=models.BooleanField(),
            )
            for path, text in (
                ('$."' + key.replace('"', '""') + '"', json.dumps(value, sort_keys=False))
                for key, value in pairs.items()
            )
        )
    )


class AgentRun(models.Model):
    # Time-ordered (models/ids.py): ids sort by start, and a run's step partition is its id's day.
    id = models.UUIDField(primary_key=True, default=new_run_id, editable=False)
    agent = models.CharField(max_length=200)
    prompt_version = models.CharField(max_length=200)
    # sha256 of everything sent besides the messages (model, parameters, system, tools):
    # checked whenever a worker takes the run, before its first model call, because a drifted
    # prompt breaks thinking signatures.
    fingerprint = models.CharField(max_length=64)
    model = models.CharField(max_length=200)
    task = models.TextField()
    status = models.CharField(max_length=16, choices=RunStatus.choices, default=RunStatus.PENDING)
    lease_owner = models.CharField(max_length=200, null=True, blank=True)
    lease_until = models.DateTimeField(null=True, blank=True)
    # Claims so far. Also the fencing token: a claim increments it, and a step commits only
    # while the run still carries the attempt that its worker claimed.
    attempt = models.PositiveIntegerField(default=0)
    # Claims in a row that committed no new step; MAX_ATTEMPTS of them send the run to the
    # dead letter. A committed step resets it, so a run that progresses is never dead.
    stalled_claims = models.PositiveIntegerField(default=0)
    # seq of the newest committed step; the fence also checks it, so the log has no gaps.
    last_seq = models.IntegerField(default=0)
    # Tokens billed so far (input, cache and output, from each turn's usage); kept by the
    # statement that commits a turn, so a token budget needs no pass over the log.
    tokens_used = models.BigIntegerField(
        default=0, db_default=0, help_text=_("input, cache and output tokens of its turns so far")
    )
    # What its model turns cost in USD, priced by the PRICES setting when each was committed
    # (by the same statement that adds to tokens_used); NULL: no turn of it had a price.
    # Exact decimals to the nano-dollar, so that sums over runs and days add up.
    cost_usd = models.DecimalField(
        max_digits=20,
        decimal_places=9,
        null=True,
        blank=True,
        help_text=_("what its model turns cost, in USD, at the PRICES setting"),
    )
    result = models.TextField(null=True, blank=True)
    # The final answer as a JSON value, for an agent with an output_schema: the result's text
    # parsed and validated against the schema (NULL otherwise). JSON text, not jsonb: it keeps
    # the answer's key order and any string the model wrote (jsonb refuses \u0000). Plain at
    # rest, as the result is.
    output = JSONTextField(
        null=True,
        blank=True,
        editable=False,
        help_text=_("the final answer as JSON, validated against the agent's output schema"),
    )
    error = models.TextField(blank=True, default="")
    # A dead run's reason with its variable parts folded away (causes.cause_of), written when
    # the run is dead-lettered and cleared when it leaves the dead letter: what the
    # dead-letter page groups on, through the index agent_run_dead_cause.
    dead_cause = models.CharField(
        max_length=255, blank=True, default="", db_default="", editable=False
    )
    created_at = models.DateTimeField(db_default=Now(), editable=False)
    updated_at = models.DateTimeField(db_default=Now(), editable=False)
    started_at = models.DateTimeField(null=True, blank=True, help_text=_("first claim"))
    finished_at = models.DateTimeField(null=True, blank=True)

    # -- waits (timers, events, child runs, questions). What a waiting run waits for; kept
    # after the wake, as the record of the last wait, and overwritten by the next.
    # Database defaults too: code deployed before this column existed (a rolling deploy) and
    # raw INSERTs can still create runs.
    waiting_for = models.CharField(
        max_length=16, choices=WaitKind.choices, blank=True, default="", db_default=""
    )
    waiting_since = models.DateTimeField(null=True, blank=True)
    # A timer's due time, or the timeout of an event or runs wait: the claim takes a waiting
    # run once it is past (index agent_run_wake).
    wake_at = models.DateTimeField(null=True, blank=True)
    wait_event = models.CharField(max_length=200, null=True, blank=True)
    # The runs a ``Wait(runs=...)`` waits on (a JSON list of ids).
    wait_runs = JSONTextField(null=True, blank=True)
    # The idempotency key of the call that waits: the call that gets ``woken_by``.
    wait_key = models.CharField(max_length=64, null=True, blank=True)
    # What ended the wait (JSON), set by the wake; the waiting call gets it when invoked again.
    woken_by = JSONTextField(null=True, blank=True, encrypted=True)

    # -- child runs (``spawn_run``): one per (parent, spawn_key).
    parent = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.SET_NULL, related_name="children"
    )
    spawn_key = models.CharField(max_length=200, null=True, blank=True)
    # The root of the run's tree (the run start_run started) for a child run; NULL for a root
    # itself. spawn_run counts a tree's runs by it (MAX_TREE_RUNS) through agent_run_root.
    # Never changes after the insert.
    root_id = models.UUIDField(null=True, blank=True, editable=False)
    depth = models.PositiveSmallIntegerField(
        default=0,
        db_default=0,
        help_text=_("0 for a run started by start_run, its parent's + 1 for a child"),
    )
    # How urgent the run is, 0 to 100 (``start_run(priority=...)``; a child run has its
    # parent's): a claim takes the highest first, then the oldest. A database default, so that
    # code deployed before this column existed (a rolling deploy) and raw INSERTs still create
    # runs (at 0). A plain smallint, no CHECK: adding one would scan the table under an
    # exclusive lock; start_run checks the range. Never changes after the insert.
    priority = models.SmallIntegerField(
        default=0,
        db_default=0,
        help_text=_("0 to 100: a claim takes the highest first, then the oldest"),
    )
    # The trace context of the code that started the run (W3C traceparent and tracestate as
    # JSON text; see telemetry.py): each claim's invoke_agent span joins that trace.
    trace_context = models.TextField(null=True, blank=True, editable=False)
    # The caller's idempotency key (``start_run(..., key=...)``): one run per (agent, key),
    # whatever its status, so a retried request gets the run it started the first time.
    start_key = models.CharField(max_length=MAX_START_KEY, null=True, blank=True, editable=False)

    # -- concurrency keys (``start_run(..., concurrency_key=...)``; a child run has its
    # parent's). At most the key's limit of runs with one key run at once, fleet-wide: the
    # claim enforces it (store/concurrency.py). None of these columns changes after the insert.
    concurrency_key = models.CharField(
        max_length=MAX_CONCURRENCY_KEY, null=True, blank=True, editable=False
    )
    # The agent's ``concurrency_limit`` when the run started, pinned like its version;
    # CONCURRENCY_LIMITS[key] overrides it at every claim. None: no limit of the agent's.
    # A plain integer, no CHECK: adding one would scan the table (``Agent`` checks it).
    concurrency_limit = models.IntegerField(null=True, blank=True, editable=False)
    # The run's turn among the runs of its priority: its creation for a run without a key; for
    # a keyed run, a second after the key's previous run's turn, or its creation if later (so
    # a key with a thousand queued runs does not hold back a key that starts ten). A claim
    # takes the highest priority first, then the earliest turn. A database default, as for
    # priority: code deployed before the column existed still creates runs.
    fair_at = models.DateTimeField(
        db_default=Now(),
        editable=False,
        help_text=_("its turn among the runs of its priority"),
    )

    # -- forks (``fork_run``): the run this one was forked from, and the step it was forked at.
    # Its log up to there is read from that run's rows (agent_step_share, forks.py), not
    # copied. NULL once the run it was forked from is deleted (its shared steps are copied
    # into the fork first). None of these columns changes after the insert.
    forked_from = models.ForeignKey(
        "self",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="forks",
        db_index=False,
        # No constraint in the database: adding one would scan agent_run under a lock that
        # stops every worker's commits; the ORM sets it NULL when the run is deleted.
        db_constraint=False,
        editable=False,
    )
    fork_seq = models.IntegerField(
        null=True, blank=True, editable=False, help_text=_("the step it was forked at")
    )
    # A fork at a model turn: the run whose id the idempotency keys of that turn's calls are
    # derived from (its own for any other turn). The calls the original did not record may
    # have happened (in flight, cut by a crash): made with the original's keys, a receiver
    # that deduplicates sees one call. A plain id, no foreign key: it outlives the original
    # (retention), and the keys with it. effects.key_run() reads it.
    fork_key_run_id = models.UUIDField(null=True, blank=True, editable=False)

    # What the product that started the run attaches to it (``start_run(..., metadata=...)``):
    # a JSON object such as a tenant, a user, an order. Stored in the clear even under
    # ENCRYPTION_KEYS, because it is meant to be searched (``with_metadata``, the admin's
    # filter): no secrets here. A child run and a fork have their parent's unless given
    # their own. A database default, so that code deployed before the column existed (a
    # rolling deploy) and raw INSERTs still create runs.
    metadata = models.JSONField(
        default=dict,
        db_default=models.Value({}, output_field=models.JSONField()),
        blank=True,
        editable=False,
        help_text=_("what the product attached to the run (a tenant, a user, an order)"),
    )

    # Whether its model turns go through Message Batches (``start_run(..., batch=...)``, by
    # default its agent's ``batch``): half the price, answered within hours, and the run waits
    # for each turn without a worker (``WaitKind.BATCH``). A database default, as for metadata.
    batch = models.BooleanField(
        default=False,
        db_default=False,
        editable=False,
        help_text=_("its model turns go through Message Batches"),
    )

    objects = AgentRunQuerySet.as_manager()

    class Meta:
        db_table = "agent_run"
        ordering: ClassVar[list[str]] = ["-created_at"]
        permissions: ClassVar[list[tuple[str, StrOrPromise]]] = [
            ("fork_agentrun", _("Can fork agent runs and rerun them with an edited step"))
        ]
        indexes: ClassVar[list[models.Index]] = [
            # The claim query scans only active runs, highest priority first, then by turn
            # (fair_at), then in creation order, and stops at its LIMIT. lease_until is left
            # out on purpose: heartbeats then touch no indexed column and stay HOT updates.
            models.Index(
                fields=["-priority", "fair_at", "created_at"],
                name="agent_run_claim_fair",
                condition=models.Q(status__in=["pending", "running"]),
            ),
            # The claim indexes of the previous releases (highest priority first then oldest;
            # oldest first): their workers read them during a rolling deploy. A later release
            # drops them.
            models.Index(
                fields=["-priority", "created_at"],
                name="agent_run_claim_priority",
                condition=models.Q(status__in=["pending", "running"]),
            ),
            models.Index(
                fields=["created_at"],
                name="agent_run_claim",
                condition=models.Q(status__in=["pending", "running"]),
            ),
            models.Index(fields=["status", "created_at"], name="agent_run_status"),
            # The runs of one tree (spawn_run's MAX_TREE_RUNS), child runs only; migration
            # 0014 builds it CONCURRENTLY. root_id never changes: no HOT update lost.
            models.Index(
                fields=["root_id"],
                name="agent_run_root",
                condition=models.Q(root_id__isnull=False),
            ),
            # The forks of a run (its page lists them); few runs are forks. Migration 0016
            # builds it CONCURRENTLY.
            models.Index(
                fields=["forked_from"],
                name="agent_run_forks",
                condition=models.Q(forked_from__isnull=False),
            ),
            # The admin at production size (docs/howto/admin-at-scale.md): the runs list newest
            # first, by agent and by model, windows of finished runs and the dead letter by cause.
            # None of these columns changes while a run is claimed, renewed or committed, so
            # the worker's updates stay HOT; migration 0006 creates them CONCURRENTLY.
            models.Index(fields=["created_at"], name="agent_run_created"),
            models.Index(fields=["agent", "created_at"], name="agent_run_agent"),
            models.Index(fields=["model", "created_at"], name="agent_run_model"),
            # The runs list by priority, newest first, and the filter's values by a skip scan
            # (migration 0009). priority never changes after the insert: no HOT update lost.
            models.Index(fields=["priority", "created_at"], name="agent_run_priority"),
            models.Index(
                fields=["finished_at"],
                name="agent_run_finished",
                condition=models.Q(finished_at__isnull=False),
            ),
            models.Index(
                fields=["dead_cause", "created_at"],
                name="agent_run_dead_cause",
                condition=models.Q(status="dead"),
            ),
            # Waiting runs by kind of wait and their oldest (the operations page), from the index.
            models.Index(
                fields=["waiting_for", "waiting_since"],
                name="agent_run_waiting",
                condition=models.Q(status="waiting"),
            ),
            # The runs in flight of each agent version: what the fleet must serve (the
            # operations page, the deploy check, the sweep) and what an upgrade moves, without
            # reading finished runs. Migration 0028 builds it CONCURRENTLY.
            in_flight_version_index(),
            # Timers and timeouts: the claim takes waiting runs that are due in wake_at order.
            models.Index(
                fields=["wake_at"],
                name="agent_run_wake",
                condition=models.Q(status="waiting", wake_at__isnull=False),
            ),
            # The runs of a key that hold its slots (a claim counts them under the key's lock),
            # and the runs list filtered by key, newest first (migration 0010).
            models.Index(
                fields=["concurrency_key"],
                name="agent_run_key_running",
                condition=models.Q(status="running", concurrency_key__isnull=False),
            ),
            models.Index(
                fields=["concurrency_key", "created_at"],
                name="agent_run_key",
                condition=models.Q(concurrency_key__isnull=False),
            ),
            # send_event wakes the runs waiting on its name.
            models.Index(
                fields=["wait_event"],
                name="agent_run_wait_event",
                condition=models.Q(status="waiting", wait_event__isnull=False),
            ),
            # The admin finds a time-ordered run by its short id, the last digits of its id
            # (time_ordered_id_ending): the primary key is ordered by the first ones. The id
            # never changes: no HOT update lost. Migration 0026 builds it CONCURRENTLY.
            id_tail_index(),
            # with_metadata and the admin's metadata filter: containment, on PostgreSQL only.
            # Migration 0029 builds it CONCURRENTLY (and none on SQLite).
        ]
        constraints: ClassVar[list[models.BaseConstraint]] = [
            models.UniqueConstraint(
                fields=["parent", "spawn_key"],
                name="agent_run_spawn_key",
                condition=models.Q(spawn_key__isnull=False),
            ),
            # One run per (agent, start key). The key leads, so that the admin's search finds
            # a run by its key alone through this index too; the pair is what is unique.
            # Migration 0008 builds it CONCURRENTLY on PostgreSQL.
            models.UniqueConstraint(
                fields=["start_key", "agent"],
                name="agent_run_start_key",
                condition=models.Q(start_key__isnull=False),
            ),
        ]

    def __str__(self) -> str:
        return f"{self.agent}@{self.prompt_version} {self.id} ({self.status})"

    @property
    def is_finished(self) -> bool:
        return self.status in FINISHED_STATUSES

    def run_context(self, *, attempt: int | None = None, tool: str = "") -> RunContext:
        """What a tool annotated with a ``RunContext`` parameter receives: this run, seen by
        the claim ``attempt`` (the run's own by default); its logger is
        ``durable_agents.tools.<tool>``, bound to the run."""
        name = f"durable_agents.tools.{tool}" if tool else "durable_agents.tools"
        return RunContext(
            id=self.pk,
            agent=self.agent,
            version=self.prompt_version,
            metadata=self.metadata or {},
            key=self.start_key,
            concurrency_key=self.concurrency_key,
            attempt=self.attempt if attempt is None else attempt,
            logger_name=name,
        )


class OperationsEntry(AgentRun):
    """No table of its own: the operations page's line in the admin's list of models (on
    /admin/ and /admin/durable_agents/), which lists registered models only."""

    class Meta:
        proxy = True
        default_permissions = ()  # the runs' view permission decides (admin/entries.py)
        # Capitalised as the page's own title (the same words, the same translation).
        verbose_name = _("Operations")
        verbose_name_plural = _("Operations")


class DeadLetterEntry(AgentRun):
    """No table of its own: the dead-letter page's line in the admin's list of models."""

    class Meta:
        proxy = True
        default_permissions = ()
        verbose_name = _("Dead letter")
        verbose_name_plural = _("Dead letter")
