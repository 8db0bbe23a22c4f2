"""The daily rollup of model turns (``agent_usage_day``) and a run's cost, through the ORM:
what ``PortableStore`` writes in the transaction of a turn's commit. ``PostgresStore`` writes
the same in the commit statement itself (``RECORD_USAGE``, ``ADD_COST``)."""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Sequence
from decimal import Decimal
from typing import Any

from django.db import IntegrityError, transaction
from django.db.models import DecimalField, F, Value
from django.db.models.functions import Coalesce

from durable_agents.flow.pricing import Usage, add_cost
from durable_agents.models import AgentRun, AgentUsageDay
from durable_agents.store.rows import usage_shard, utc_day

# The rollup's rows in memory (``InMemoryStore``), by the key of the table's unique index.
UsageRows = dict[tuple[datetime.date, str, str, str, int], AgentUsageDay]

COST_FIELD = AgentRun._meta.get_field("cost_usd")


def added_cost(cost: Decimal) -> Any:
    """The expression of a cost column plus ``cost``: the cost itself while the column is
    NULL (no priced turn yet). An unpriced turn (None) leaves the column alone: callers do
    not set it."""
    value = Value(cost, output_field=DecimalField(max_digits=20, decimal_places=9))
    return Coalesce(F("cost_usd") + value, value, output_field=COST_FIELD)


def record_usage(run: AgentRun, usage: Usage, cost: Decimal | None, *, batch: bool = False) -> None:
    """Count one model turn of ``run`` in today's row of its (agent, model, shard), creating
    the row with the day's first turn. Inside the caller's transaction. ``batch``: the turn
    was answered through a Message Batch (counted in ``batch_turns`` too)."""
    record_usages([(run, usage, cost)], batch=batch)


def record_usages(
    turns: Sequence[tuple[AgentRun, Usage, Decimal | None]], *, batch: bool = False
) -> None:
    """Count ``turns`` (run, usage, cost) in today's rows: one statement per row of the rollup
    they fall in, however many turns (the answers of a batch). Inside the caller's
    transaction."""
    day = utc_day()
    groups: dict[tuple[Any, ...], list[tuple[Usage, Decimal | None]]] = {}
    for run, usage, cost in turns:
        key = (run.concurrency_key or "", run.agent, run.model, usage_shard(run.pk))
        groups.setdefault(key, []).append((usage, cost))
    for (concurrency_key, agent, model, shard), items in sorted(groups.items()):
        _count_turns(
            {
                "day": day,
                "concurrency_key": concurrency_key,
                "agent": agent,
                "model": model,
                "shard": shard,
            },
            items,
            batch,
        )


def _count_turns(
    key: dict[str, Any], items: list[tuple[Usage, Decimal | None]], batch: bool
) -> None:
    summed = Usage(*(sum(getattr(usage, name) for usage, _ in items) for name in _USAGE_FIELDS))
    cost: Decimal | None = None
    for _, one in items:
        cost = add_cost(cost, one)
    counts: dict[str, Any] = {
        "turns": F("turns") + len(items),
        "input_tokens": F("input_tokens") + summed.input_tokens,
        "output_tokens": F("output_tokens") + summed.output_tokens,
        "cache_read_tokens": F("cache_read_tokens") + summed.cache_read_tokens,
        "cache_write_tokens": F("cache_write_tokens") + summed.cache_write_tokens,
    }
    if cost is not None:
        counts["cost_usd"] = added_cost(cost)
    if batch:
        counts["batch_turns"] = F("batch_turns") + len(items)
    rows = AgentUsageDay.objects.filter(**key)
    if rows.update(**counts):
        return
    try:
        with transaction.atomic():
            AgentUsageDay.objects.create(
                **key,
                turns=len(items),
                input_tokens=summed.input_tokens,
                output_tokens=summed.output_tokens,
                cache_read_tokens=summed.cache_read_tokens,
                cache_write_tokens=summed.cache_write_tokens,
                cost_usd=cost,
                batch_turns=len(items) if batch else 0,
            )
    except IntegrityError:  # another commit created the day's row first (PostgreSQL)
        rows.update(**counts)


_USAGE_FIELDS = [field.name for field in dataclasses.fields(Usage)]


def count_in_rows(
    rows: UsageRows, day: datetime.date, run: AgentRun, usage: Usage, cost: Decimal | None
) -> None:
    """``record_usage`` on rows kept in memory (unsaved instances), for ``InMemoryStore``."""
    shard = usage_shard(run.pk)
    key = run.concurrency_key or ""
    row = rows.setdefault(
        (day, key, run.agent, run.model, shard),
        AgentUsageDay(day=day, concurrency_key=key, agent=run.agent, model=run.model, shard=shard),
    )
    row.turns += 1
    row.input_tokens += usage.input_tokens
    row.output_tokens += usage.output_tokens
    row.cache_read_tokens += usage.cache_read_tokens
    row.cache_write_tokens += usage.cache_write_tokens
    row.cost_usd = add_cost(row.cost_usd, cost)
