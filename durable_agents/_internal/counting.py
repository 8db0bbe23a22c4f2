"""Counting rows of a table that may hold millions, without reading them all.

A count is exact up to ``EXACT_COUNT_LIMIT`` rows, which it reads at most; past that it is the
planner's estimate and says so ("about 1.2 million"). The admin's lists and pages, the
operational figures (``figures.py``) and the Prometheus gauges all count this way, so none of
them costs more as the table grows.

What differs between databases is the estimate (``RowEstimator``): PostgreSQL asks its planner;
the portable estimator (SQLite) has none, and the count then says "more than 10,000".
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from django.contrib.humanize.templatetags.humanize import intcomma, intword
from django.db import connections
from django.db.models import QuerySet
from django.utils.translation import gettext

# A count reads at most this many rows; past it the count is an estimate, and pages stop.
EXACT_COUNT_LIMIT = 10_000


class RowEstimator:
    """The portable estimator: no estimate to be had."""

    def estimate_rows(self, queryset: QuerySet[Any]) -> int | None:
        """The planner's estimate of how many rows ``queryset`` yields; None if unknown."""
        return None


class PostgresRowEstimator(RowEstimator):
    def estimate_rows(self, queryset: QuerySet[Any]) -> int | None:
        compiler = queryset.order_by().query.get_compiler(using=queryset.db)
        sql, params = compiler.as_sql()
        with connections[queryset.db].cursor() as cursor:
            cursor.execute("EXPLAIN (FORMAT JSON) " + sql, params)
            (plan,) = cursor.fetchone()
        if isinstance(plan, str):
            plan = json.loads(plan)
        return int(plan[0]["Plan"]["Plan Rows"])


# The estimator of each database vendor; any other vendor gets the portable one.
ESTIMATORS: dict[str, type[RowEstimator]] = {"postgresql": PostgresRowEstimator}


def estimator(using: str = "default") -> RowEstimator:
    return ESTIMATORS.get(connections[using].vendor, RowEstimator)()


def count_at_most(queryset: QuerySet[Any], limit: int) -> int:
    """``min(count, limit + 1)``: reads at most ``limit + 1`` rows, through any index."""
    return queryset.order_by().values("pk")[: limit + 1].count()


@dataclass(frozen=True)
class Count:
    """A count as a page shows it: exact, or past EXACT_COUNT_LIMIT an estimate."""

    value: int
    exact: bool
    at_least: bool = False  # no estimate to be had: ``value`` is only a lower bound

    def describe(self, singular: str, plural: str) -> str:
        """ "1 agent run", "4 agent runs", "about 1.2 million agent runs"."""
        return f"{self} {singular if self.exact and self.value == 1 else plural}"

    def __str__(self) -> str:
        if self.exact:
            return str(intcomma(self.value))
        if self.at_least:
            return gettext("more than %(count)s") % {"count": intcomma(self.value)}
        return gettext("about %(count)s") % {"count": intword(self.value)}


def bounded_count(queryset: QuerySet[Any]) -> Count:
    """Exact up to EXACT_COUNT_LIMIT, else the planner's estimate (never below the limit)."""
    exact = count_at_most(queryset, EXACT_COUNT_LIMIT)
    if exact <= EXACT_COUNT_LIMIT:
        return Count(exact, True)
    estimate = estimator(queryset.db).estimate_rows(queryset)
    if estimate is None:
        return Count(EXACT_COUNT_LIMIT, exact=False, at_least=True)
    return Count(max(estimate, exact), exact=False)
