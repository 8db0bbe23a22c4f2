"""``agent_schedule``: agents on a clock. One row per schedule, created or updated by name
(``durable_agents.schedule``); the workers fire its slots."""

from __future__ import annotations

import datetime as dt
from typing import TYPE_CHECKING, ClassVar

from django.db import models
from django.db.models.functions import Now
from django.utils.translation import gettext_lazy as _

if TYPE_CHECKING:
    from django_stubs_ext import StrOrPromise

# The longest schedule name: a slot's start key is the name and the slot time.
MAX_SCHEDULE_NAME = 150


class AgentScheduleQuerySet(models.QuerySet["AgentSchedule"]):
    def firing(self) -> AgentScheduleQuerySet:
        """The schedules the workers fire: enabled and not broken."""
        return self.filter(enabled=True, broken="")


class AgentSchedule(models.Model):
    """A schedule: ``cron`` (in ``timezone``) or ``every``; each slot starts one run of
    ``agent`` with ``task``, keyed by the name and the slot time across the whole fleet."""

    id = models.BigAutoField(primary_key=True)
    name = models.CharField(max_length=MAX_SCHEDULE_NAME, unique=True)
    agent = models.CharField(max_length=200)
    task = models.TextField()
    # Exactly one of cron and every is set (a check constraint says so).
    cron = models.CharField(max_length=200, blank=True, default="")
    every = models.DurationField(null=True, blank=True)
    # An IANA time zone name: what the cron expression's hours and days are in.
    timezone = models.CharField(max_length=64, default="UTC")
    priority = models.SmallIntegerField(default=0)
    concurrency_key = models.CharField(max_length=200, null=True, blank=True)
    # After an outage: False starts only the newest missed slot, True each (oldest first).
    catch_up = models.BooleanField(default=False)
    enabled = models.BooleanField(default=True)
    # The next slot to fire (UTC). Workers take the schedules whose next slot is past.
    next_slot = models.DateTimeField(null=True, blank=True)
    # The newest slot fired, and the run it started (kept when the run is deleted).
    last_slot = models.DateTimeField(null=True, blank=True)
    last_run = models.ForeignKey(
        "durable_agents.AgentRun",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        db_constraint=False,
        related_name="+",
    )
    # Why the schedule fires nothing until someone fixes it (its agent disappeared after a
    # deploy, say); empty when it is sound.
    broken = models.TextField(blank=True, default="")
    created_at = models.DateTimeField(db_default=Now(), editable=False)
    updated_at = models.DateTimeField(db_default=Now(), editable=False)

    objects = AgentScheduleQuerySet.as_manager()

    class Meta:
        db_table = "agent_schedule"
        ordering: ClassVar[list[str]] = ["name"]
        verbose_name = _("agent schedule")
        verbose_name_plural = _("agent schedules")
        permissions: ClassVar[list[tuple[str, StrOrPromise]]] = [
            ("run_agentschedule", _("Can start a schedule's run now")),
        ]
        indexes: ClassVar[list[models.Index]] = [
            # The workers' question, every few hundred milliseconds: which slots are due.
            models.Index(
                fields=["next_slot"],
                name="agent_schedule_due",
                condition=models.Q(enabled=True, broken=""),
            ),
        ]
        constraints: ClassVar[list[models.BaseConstraint]] = [
            models.CheckConstraint(
                condition=(models.Q(cron="") & models.Q(every__isnull=False))
                | (~models.Q(cron="") & models.Q(every__isnull=True)),
                name="agent_schedule_cron_or_every",
            ),
            # A zero or negative interval cannot fire (zero divides, a negative one goes
            # backwards); schedule() refuses them, this keeps hand-written rows out too.
            models.CheckConstraint(
                condition=models.Q(every__isnull=True) | models.Q(every__gt=dt.timedelta(0)),
                name="agent_schedule_every_positive",
            ),
        ]

    def __str__(self) -> str:
        return self.name
