"""The values the store's modules share, below all of them (it imports no module of the
store): what a firing of schedules takes and starts (``DueSchedules``, ``SlotStart``), and the
day and shard of a run's row in the daily usage rollup (``utc_day``, ``usage_shard``)."""

from __future__ import annotations

import copy
import datetime as dt
import uuid
from dataclasses import dataclass

from django.utils import timezone

from durable_agents.models import USAGE_SHARDS, AgentRun, AgentSchedule


@dataclass(slots=True)
class DueSchedules:
    """What one look at the schedules found."""

    # The earliest next slot of the schedules that fire (due or not, locked or not); None:
    # no schedule fires.
    earliest: dt.datetime | None
    # The time the look fired at: the database's clock, or the caller's (a fake clock).
    clock: dt.datetime
    # The due schedules taken, earliest slot first, locked until the transaction ends.
    rows: list[AgentSchedule]


@dataclass(slots=True)
class SlotStart:
    """The run a due slot starts (not stored yet)."""

    schedule_id: int
    slot: dt.datetime
    # The slot's start key (``schedules.slot_key``): one run per slot, whoever fires it.
    key: str
    run_id: uuid.UUID
    # The run fields of the agent's current version, shared by all the agent's slots in a
    # firing (an unsaved run; its id and task are not this slot's).
    template: AgentRun
    task: str
    # The task as step 0 stores it (JSON text, not sealed yet).
    payload: str
    priority: int
    concurrency_key: str | None

    def new_run(self) -> AgentRun:
        """The slot's run, unsaved: the template with this slot's fields."""
        run = copy.copy(self.template)
        run.id, run.task, run.start_key = self.run_id, self.task, self.key
        run.priority, run.concurrency_key = self.priority, self.concurrency_key
        return run


def utc_day() -> dt.date:
    """Today in UTC. The ORM path uses this process's clock; the PostgreSQL statement the
    database's (a turn committed within a second of midnight may land on either day)."""
    return timezone.now().astimezone(dt.UTC).date()


def usage_shard(run_id: uuid.UUID) -> int:
    """The rollup shard of a run's turns: fixed per run, spread evenly over USAGE_SHARDS."""
    return run_id.int % USAGE_SHARDS
