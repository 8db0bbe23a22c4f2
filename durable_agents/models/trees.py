"""A run with its descendants (its child runs, their children, ...): what they cost together.

The admin's run page and the command line (``manage.py durable_agents show``, ``runs --json``)
print a run's cost and its family's; both read it here, with one query for any number of runs.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterable
from decimal import Decimal

from django.db import connection

from durable_agents.models.runs import AgentRun

# Descendants added up per query at most; past it the figures say "at least".
FAMILY_LIMIT = 10_000
# Generations read at most: far past MAX_RUN_DEPTH, a guard against a cycle written by hand.
FAMILY_DEPTH = 64
# Runs whose families one query reads (each is a parameter of the query).
FAMILY_BATCH = 500
# The descendants of the runs given, generation by generation through the index on parent_id,
# each row carrying the run it descends from; read until FAMILY_LIMIT + 1 are found (the
# recursion stops there on PostgreSQL and SQLite alike): how many each run has and what they
# cost together, in one query.
FAMILY_SQL = """
WITH RECURSIVE family(root, id, cost_usd, generation) AS (
    SELECT parent_id, id, cost_usd, 1 FROM agent_run WHERE parent_id IN ({roots})
    UNION ALL
    SELECT family.root, run.id, run.cost_usd, family.generation + 1
      FROM agent_run AS run JOIN family ON run.parent_id = family.id
     WHERE family.generation < %s
)
SELECT root, count(*), sum(cost_usd)
  FROM (SELECT root, cost_usd FROM family LIMIT %s) AS found
 GROUP BY root"""


@dataclasses.dataclass(frozen=True)
class FamilyCost:
    """A run's cost with all its descendants' (child runs, their children, ...)."""

    cost: Decimal | None  # None: neither the run nor any descendant had a priced turn
    descendants: int
    complete: bool  # False: past FAMILY_LIMIT descendants, the figures are lower bounds


def _quantized(value: object) -> Decimal:
    # SQLite sums decimals as floats: through their text, to the stored precision.
    places = AgentRun._meta.get_field("cost_usd").decimal_places
    return Decimal(str(value)).quantize(Decimal(1).scaleb(-places))


def family_costs(runs: Iterable[AgentRun]) -> dict[uuid.UUID, FamilyCost]:
    """Each run's cost plus its descendants' (``FAMILY_SQL``), by run id: one query per
    ``FAMILY_BATCH`` runs."""
    given = list(runs)
    pk = AgentRun._meta.pk
    assert pk is not None
    costs: dict[uuid.UUID, FamilyCost] = {}
    for start in range(0, len(given), FAMILY_BATCH):
        batch = given[start : start + FAMILY_BATCH]
        sql = FAMILY_SQL.format(roots=", ".join(["%s"] * len(batch)))
        params = [pk.get_db_prep_value(run.pk, connection) for run in batch]
        with connection.cursor() as cursor:
            cursor.execute(sql, [*params, FAMILY_DEPTH, FAMILY_LIMIT + 1])
            rows = cursor.fetchall()
        complete = sum(row[1] for row in rows) <= FAMILY_LIMIT
        found = {_as_uuid(root): (count, cost) for root, count, cost in rows}
        for run in batch:
            count, cost = found.get(run.pk, (0, None))
            descendants = None if cost is None else _quantized(cost)
            costs[run.pk] = FamilyCost(_plus(run.cost_usd, descendants), count, complete)
    return costs


def _as_uuid(value: object) -> uuid.UUID:
    """A run id as the cursor returns it: a UUID on PostgreSQL, 32 hex digits on SQLite."""
    return value if isinstance(value, uuid.UUID) else uuid.UUID(str(value))


def _plus(own: Decimal | None, descendants: Decimal | None) -> Decimal | None:
    """A cost plus another: None ("no price") only while neither had one."""
    if descendants is None:
        return own
    return descendants if own is None else own + descendants


def family_cost(run: AgentRun) -> FamilyCost:
    """The run's cost plus its descendants' (one query)."""
    return family_costs([run])[run.pk]
