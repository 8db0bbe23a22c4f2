"""How retention and the sweep treat the step log, one class per layout of ``agent_step``.

    OneTable       (SQLite, and PostgreSQL before migration 0025) a run's steps are deleted
                   with the run, row by row
    DayPartitions  (PostgreSQL) a day older than RETENTION_DAYS whose every run is deleted by
                   this retention is detached and dropped whole; the steps of its runs are not
                   deleted one by one. The steps of the other runs (the legacy partition, a day
                   that keeps a dead or recent run, the default partition) go row by row, as
                   with one table. Killed at any point, it leaves a state the next retention
                   finishes: runs are deleted in transactions as before (their steps either
                   with them or by the drop to come), a pending DETACH is finalized, a
                   detached day's table is dropped or put back.

``step_log(connection)`` picks the layout. The sweep asks it to make the days ahead
(``make_days_ahead``), and so does every worker when it starts.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Sequence
from typing import Any, Protocol

from django.db import connection as default_connection

from durable_agents.models import FINISHED_STATUSES, AgentRun, AgentStep, step_part
from durable_agents.models import step_partitions as partitions
from durable_agents.models.ids import LEGACY_PART, day_of_part, first_id_at
from durable_agents.store.base import RunId

logger = logging.getLogger("durable_agents.housekeeping")


class StepLog(Protocol):
    def droppable_days(self, cutoff: datetime.datetime) -> set[int]:
        """Days whose steps retention will drop whole (after deleting their runs)."""

    def delete_steps(self, run_ids: Sequence[RunId], dropping: set[int]) -> int:
        """The steps of ``run_ids`` that no dropped day takes away, deleted now."""

    def drop_days(self, days: set[int]) -> list[int]:
        """The days of ``days`` that no run is left in, dropped; returns them."""

    def make_days_ahead(self) -> list[str]:
        """Partitions for the days to come; the names made."""


def _delete_rows(run_ids: Sequence[RunId]) -> int:
    deleted, _ = AgentStep.objects.filter(run_id__in=list(run_ids)).delete()
    return deleted


class OneTable:
    def droppable_days(self, cutoff: datetime.datetime) -> set[int]:
        return set()

    def delete_steps(self, run_ids: Sequence[RunId], dropping: set[int]) -> int:
        return _delete_rows(run_ids)

    def drop_days(self, days: set[int]) -> list[int]:
        return []

    def make_days_ahead(self) -> list[str]:
        return []


def _id_range(part: int) -> tuple[Any, Any]:
    """The run ids made on day ``part``: [first id of the day, first id of the next)."""
    day = datetime.datetime.combine(day_of_part(part), datetime.time(), tzinfo=datetime.UTC)
    return first_id_at(day), first_id_at(day + datetime.timedelta(days=1))


class DayPartitions:
    def __init__(self, connection: Any) -> None:
        self.connection = connection

    def droppable_days(self, cutoff: datetime.datetime) -> set[int]:
        """Days wholly before ``cutoff`` none of whose runs retention keeps (running, waiting,
        dead, or ended since ``cutoff``). Pending detaches and detached leftovers a killed
        retention left are settled first."""
        self._settle_killed_retention()
        with self.connection.cursor() as cursor:
            days = partitions.partitions(cursor)
        last_day = cutoff.astimezone(datetime.UTC).date() - datetime.timedelta(days=1)
        droppable = set()
        for partition in days:
            if partition.lo is None or partition.lo == LEGACY_PART:
                continue
            if day_of_part(partition.lo) > last_day:
                continue
            lo, hi = _id_range(partition.lo)
            kept = (
                AgentRun.objects.filter(pk__gte=lo, pk__lt=hi)
                .exclude(status__in=FINISHED_STATUSES, finished_at__lt=cutoff)
                .exists()
            )
            if not kept:
                droppable.add(partition.lo)
        return droppable

    def delete_steps(self, run_ids: Sequence[RunId], dropping: set[int]) -> int:
        return _delete_rows([r for r in run_ids if step_part(r) not in dropping])

    def drop_days(self, days: set[int]) -> list[int]:
        dropped = []
        with self.connection.cursor() as cursor:
            by_part = {p.lo: p for p in partitions.partitions(cursor) if p.lo is not None}
        for part in sorted(days):
            partition = by_part.get(part)
            if partition is None:
                continue
            if partitions.drop_day(self.connection, partition, _id_range(part)):
                dropped.append(part)
        if dropped:
            logger.info(
                "retention dropped the step partitions of %s",
                ", ".join(str(day_of_part(p)) for p in dropped),
            )
        return dropped

    def make_days_ahead(self) -> list[str]:
        return [
            *partitions.adopt_default_days(self.connection),
            *partitions.ensure_ahead(self.connection),
        ]

    def _settle_killed_retention(self) -> None:
        finished = partitions.finish_pending_detaches(self.connection)
        with self.connection.cursor() as cursor:
            leftovers = partitions.detached_leftovers(cursor)
        for name in [*leftovers, *(n for n in finished if n not in leftovers)]:
            part = int(name.rsplit("_p", 1)[1])
            partitions.settle_leftover(self.connection, name, _id_range(part))


def step_log(connection: Any = None) -> StepLog:
    connection = connection or default_connection
    if connection.vendor != "postgresql":
        return OneTable()
    with connection.cursor() as cursor:
        partitioned = partitions.is_partitioned(cursor)
    return DayPartitions(connection) if partitioned else OneTable()
