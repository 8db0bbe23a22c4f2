"""The flow-control tables: ``agent_concurrency_key`` (each concurrency key's lock, fair-share
clock, limit and budget as staff set them), ``model_capacity`` (the fleet's share of each
model's rate limits), ``capacity_event`` (each wait and pause, for the capacity page) and
``agent_usage_day`` (the daily rollup of tokens and cost)."""

from __future__ import annotations

from typing import ClassVar

from django.db import models
from django.db.models.functions import Now
from django.utils import timezone
from django.utils.translation import gettext_lazy as _

from durable_agents.models.runs import MAX_CONCURRENCY_KEY


class ConcurrencyKey(models.Model):
    """One row per concurrency key ever used: what claims of the key's runs lock, one after
    the other, to count its running runs race-free, and the key's fair-share clock.

    A claim that takes runs of the key updates ``claimed_at`` under the row's lock; a claim
    that meets the row locked waits, and PostgreSQL then checks the key's count again with
    what the first claim committed (store/concurrency.py says why this is race-free)."""

    key = models.CharField(max_length=MAX_CONCURRENCY_KEY, primary_key=True)
    # The turn (``AgentRun.fair_at``) of the key's next run, unless that is in the past.
    next_fair_at = models.DateTimeField(db_default=Now())
    # The last claim that took a run of the key.
    claimed_at = models.DateTimeField(null=True, blank=True)
    # The key's concurrency limit as staff set it in the admin, replacing CONCURRENCY_LIMITS'
    # and the agents' (NULL: they decide; 0 holds the key's runs pending).
    concurrency_limit = models.PositiveIntegerField(
        null=True,
        blank=True,
        help_text=_(
            "runs of the key running at once; empty: CONCURRENCY_LIMITS and the agents decide"
        ),
    )
    # The key's budget in USD per UTC day as staff set it in the admin, replacing BUDGETS'
    # (NULL: BUDGETS decides).
    usd_per_day = models.DecimalField(
        max_digits=14,
        decimal_places=4,
        null=True,
        blank=True,
        help_text=_("USD per UTC day; empty: the BUDGETS setting decides"),
    )

    class Meta:
        db_table = "agent_concurrency_key"

    def __str__(self) -> str:
        return self.key


class ModelCapacity(models.Model):
    """The fleet's share of one model's rate limits: three token buckets (requests, input
    tokens, output tokens per minute) refilled continuously, and a pause after a 429.

    One row per model, shared by every worker: a grant takes from the buckets under the row's
    lock (``durable_agents.flow.capacity``), so the fleet as a whole stays within the limits, not
    each worker on its own. Limits come from ``RATE_LIMITS`` or, without it, from what the API
    says in its ``anthropic-ratelimit-*`` headers. A limit of NULL means none (no bucket).
    """

    model = models.CharField(max_length=200, primary_key=True)
    # Whether the limits are RATE_LIMITS' (True) or learned from the API's headers.
    configured = models.BooleanField(default=False)
    # Limits not known yet (no RATE_LIMITS, no answer so far): the first calls go out at a
    # modest pace until an answer's headers say the real limits (or that there are none).
    probing = models.BooleanField(default=False)
    requests_per_minute = models.FloatField(null=True, blank=True)
    input_tokens_per_minute = models.FloatField(null=True, blank=True)
    output_tokens_per_minute = models.FloatField(null=True, blank=True)
    # A bucket holds this many seconds of its limit: what a burst may take at once.
    burst_seconds = models.FloatField(default=10.0)
    # What each bucket holds as of refilled_at (may go below 0: a call larger than a bucket
    # goes out when the bucket is full, and the debt is paid back before the next one).
    requests_level = models.FloatField(default=0.0)
    input_level = models.FloatField(default=0.0)
    output_level = models.FloatField(default=0.0)
    refilled_at = models.DateTimeField(default=timezone.now)
    # After a 429: no call to this model goes out before then, from any worker.
    paused_until = models.DateTimeField(null=True, blank=True)
    # The highest priority among runs handed back for capacity lately, and until when it
    # counts: a run of a lower priority is refused capacity meanwhile, so grants go to the
    # higher priority first.
    waiting_priority = models.SmallIntegerField(null=True, blank=True)
    waiting_priority_until = models.DateTimeField(null=True, blank=True)
    # Moving averages of what one call charges (estimates settled by usage): how many calls
    # the token buckets have room for, for a claimer deciding how many runs to take.
    input_per_call = models.FloatField(default=0.0)
    output_per_call = models.FloatField(default=0.0)
    calls = models.BigIntegerField(default=0)
    rate_limited = models.BigIntegerField(default=0, help_text=_("429 answers"))
    pauses = models.BigIntegerField(default=0)
    capacity_waits = models.BigIntegerField(
        default=0, help_text=_("runs handed back to wait for capacity")
    )
    updated_at = models.DateTimeField(default=timezone.now)

    class Meta:
        db_table = "model_capacity"
        verbose_name_plural = "model capacity"

    def __str__(self) -> str:
        return self.model


class CapacityEventKind(models.TextChoices):
    RATE_LIMITED = "rate_limited", _("429 rate limited")
    OVERLOADED = "overloaded", _("529 overloaded")
    PAUSED = "paused", _("paused")


class CapacityEvent(models.Model):
    """A 429, a 529 or a fleet-wide pause of a model: rare by design (the buckets keep the fleet
    under the limits), kept for the capacity page's last hour and pruned by housekeeping."""

    model = models.CharField(max_length=200)
    kind = models.CharField(max_length=16, choices=CapacityEventKind.choices)
    at = models.DateTimeField(default=timezone.now)
    # The pause's length, or the retry-after the API asked for.
    seconds = models.FloatField(null=True, blank=True)

    class Meta:
        db_table = "capacity_event"
        indexes: ClassVar[list[models.Index]] = [
            models.Index(fields=["at"], name="capacity_event_at"),
        ]

    def __str__(self) -> str:
        return f"{self.model} {self.kind} at {self.at}"


# The rollup's rows of one (day, key, agent, model) are spread over this many shards by run,
# so that concurrent commits of one agent's turns rarely wait for each other's row lock (8
# threads committing turns of one agent on 2 CPUs: 1 shard 0.55x, 16 shards 0.6-0.7x, 64
# shards 0.85x the commits per second of steps without the rollup). Readers sum the shards;
# a day has at most this many rows per key, agent and model, and fewer when fewer runs ran.
USAGE_SHARDS = 64


class AgentUsageDay(models.Model):
    """Model turns, tokens and cost by UTC day, concurrency key, agent and model: the rollup
    that the statement committing a model turn upserts, so that "spent today" and the cost
    per agent and day are one small indexed read whatever the number of runs and steps.

    Rows of one (day, concurrency_key, agent, model) are split over ``USAGE_SHARDS`` shards
    (the run's id picks one): readers sum them. ``concurrency_key`` is '' for runs without
    one."""

    day = models.DateField()
    # The run's concurrency key ('' = none): "spent today by key" reads (day, key) as a prefix
    # of the unique index below.
    concurrency_key = models.CharField(max_length=200, default="", db_default="", blank=True)
    agent = models.CharField(max_length=200)
    model = models.CharField(max_length=200)
    shard = models.SmallIntegerField(default=0)
    turns = models.BigIntegerField(default=0)
    input_tokens = models.BigIntegerField(default=0)
    output_tokens = models.BigIntegerField(default=0)
    cache_read_tokens = models.BigIntegerField(default=0)
    cache_write_tokens = models.BigIntegerField(default=0)
    # Of ``turns``, those answered through a Message Batch (the rest were sent directly).
    batch_turns = models.BigIntegerField(default=0, db_default=0)
    # NULL: none of these turns had a price.
    cost_usd = models.DecimalField(max_digits=20, decimal_places=9, null=True, blank=True)

    class Meta:
        db_table = "agent_usage_day"
        constraints: ClassVar[list[models.BaseConstraint]] = [
            # The upsert's conflict target, and the index every read goes through (by day).
            models.UniqueConstraint(
                fields=["day", "concurrency_key", "agent", "model", "shard"],
                name="agent_usage_day_key",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.day} {self.agent} {self.model}"
