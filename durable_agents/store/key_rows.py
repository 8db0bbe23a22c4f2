"""Concurrency keys through the Django ORM (``PortableStore``): a keyed run's turn when it is
created, and a claim's candidates within their keys' limits, race-free on PostgreSQL too (the
rows of ``agent_concurrency_key`` locked in key order, then the holders counted in a statement
of their own: a fresh snapshot under READ COMMITTED). store/concurrency.py says why."""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Mapping, Sequence
from decimal import Decimal
from typing import Any

from django.db import transaction
from django.db.models import (
    Case,
    Count,
    DateTimeField,
    ExpressionWrapper,
    F,
    IntegerField,
    OuterRef,
    Q,
    QuerySet,
    Subquery,
    Sum,
    Value,
    When,
)
from django.db.models.functions import Coalesce, Greatest, Now

from durable_agents.models import AgentRun, AgentUsageDay, ConcurrencyKey, RunStatus, WaitKind
from durable_agents.store import concurrency
from durable_agents.store.rows import utc_day


def take_turn(key: str) -> datetime.datetime:
    """The turn (``fair_at``) of a run of ``key`` created now, and the key's next turn moved
    on past it, under the key's row lock (held until the caller's transaction ends)."""
    ConcurrencyKey.objects.get_or_create(key=key)
    ConcurrencyKey.objects.filter(key=key).update(
        next_fair_at=ExpressionWrapper(
            Greatest(F("next_fair_at"), Now()) + concurrency.FAIR_SPACING,
            output_field=DateTimeField(),
        )
    )
    following: datetime.datetime = (
        ConcurrencyKey.objects.filter(key=key).values_list("next_fair_at", flat=True).get()
    )
    return following - concurrency.FAIR_SPACING


def _holders() -> QuerySet[AgentRun]:
    """Runs that hold a slot of their key: running with a live lease."""
    return AgentRun.objects.filter(
        concurrency_key__isnull=False, status=RunStatus.RUNNING, lease_until__gte=Now()
    )


def within_limits(queryset: QuerySet[AgentRun], limits: Mapping[str, int]) -> QuerySet[AgentRun]:
    """``queryset`` without the keyed runs whose key is at its limit, counted on the
    statement's snapshot: the cheap filter of a claim's candidates (``admit_locked`` decides)."""
    held = Subquery(
        _holders()
        .filter(concurrency_key=OuterRef("concurrency_key"))
        .order_by()
        .values("concurrency_key")
        .annotate(n=Count("pk"))
        .values("n")[:1],
        output_field=IntegerField(),
    )
    cap: Any = F("concurrency_limit")
    if limits:
        cap = Case(
            *(When(concurrency_key=key, then=Value(value)) for key, value in limits.items()),
            default=F("concurrency_limit"),
            output_field=IntegerField(),
        )
    return queryset.alias(key_held=Coalesce(held, 0), key_cap=cap).filter(
        Q(concurrency_key__isnull=True) | Q(key_cap__isnull=True) | Q(key_held__lt=F("key_cap"))
    )


def admit_locked(ids: Sequence[Any], limits: Mapping[str, int]) -> list[Any]:
    """Of the claim's candidates ``ids`` (locked, in claim order), those it may take: the rows
    of their keys locked in key order, the holders counted afresh, and each key it takes runs
    of marked (``claimed_at``), which a claim waiting for the row sees when it gets it."""
    if not ids:
        return []
    found = {
        run.pk: run
        for run in AgentRun.objects.filter(pk__in=list(ids)).only(
            "pk", "concurrency_key", "concurrency_limit"
        )
    }
    runs = [found[pk] for pk in ids if pk in found]
    keyed = sorted({run.concurrency_key for run in runs if run.concurrency_key is not None})
    if not keyed:
        return [run.pk for run in runs]
    ConcurrencyKey.objects.bulk_create(
        [ConcurrencyKey(key=key) for key in keyed], ignore_conflicts=True
    )
    locked = ConcurrencyKey.objects.select_for_update(no_key=True).filter(key__in=keyed)
    list(locked.order_by("key").values_list("key", flat=True))  # the locks, in key order
    counts = (
        _holders()
        .filter(concurrency_key__in=keyed)
        .order_by()
        .values("concurrency_key")
        .annotate(n=Count("pk"))
        .values_list("concurrency_key", "n")
    )
    held = {key: n for key, n in counts if key is not None}
    taken = concurrency.admit(runs, held, limits, len(runs))
    served = {run.concurrency_key for run in taken if run.concurrency_key is not None}
    ConcurrencyKey.objects.filter(key__in=served).update(claimed_at=Now())
    return [run.pk for run in taken]


def spent_today(key: str) -> tuple[Decimal, Decimal | None]:
    """What runs of ``key`` cost today (UTC; the rollup, every shard, agent and model) and
    the budget staff set for the key (None: BUDGETS decides)."""
    spent = AgentUsageDay.objects.filter(day=utc_day(), concurrency_key=key).aggregate(
        total=Sum("cost_usd")
    )["total"]
    override = ConcurrencyKey.objects.filter(key=key).values_list("usd_per_day", flat=True).first()
    return Decimal(spent or 0), override


def set_budget(key: str, usd_per_day: Decimal | None) -> int:
    """Set ``key``'s budget (None: clear it) and hand back its runs waiting for the budget (a
    budget still spent parks them again at their next call); returns how many."""
    with transaction.atomic():
        ConcurrencyKey.objects.update_or_create(key=key, defaults={"usd_per_day": usd_per_day})
        return AgentRun.objects.filter(
            status=RunStatus.PENDING, waiting_for=WaitKind.BUDGET, concurrency_key=key
        ).update(lease_until=None, updated_at=Now())


# How long a process trusts the limits staff set in the admin before it reads them again: a
# raised limit reaches every worker's claims within this time.
LIMIT_OVERRIDES_TTL = 2.0
_limit_cache: dict[str, Any] = {"at": None, "limits": {}, "reading": False}
_limit_lock = threading.Lock()


def limit_overrides() -> dict[str, int]:
    """The concurrency limits staff set per key (``ConcurrencyKey.concurrency_limit``), read
    at most once per LIMIT_OVERRIDES_TTL per process: the claims' hot path stays one statement.
    One thread reads them again when they are due; the others meanwhile take the last ones
    read (a slot that ends a run claims the next with them: a thousand slots ending together
    would otherwise each read them)."""
    now = time.monotonic()
    with _limit_lock:
        at = _limit_cache["at"]
        if at is not None and (now - at < LIMIT_OVERRIDES_TTL or _limit_cache["reading"]):
            return dict(_limit_cache["limits"])
        _limit_cache["reading"] = True
    try:
        limits = {
            key: limit
            for key, limit in ConcurrencyKey.objects.filter(
                concurrency_limit__isnull=False
            ).values_list("key", "concurrency_limit")
            if limit is not None
        }
    except BaseException:
        with _limit_lock:
            _limit_cache["reading"] = False  # the next caller reads them
        raise
    with _limit_lock:
        _limit_cache.update(at=now, limits=limits, reading=False)
    return dict(limits)


def forget_limit_overrides() -> None:
    with _limit_lock:
        _limit_cache["at"] = None


def set_limit(key: str, limit: int | None) -> None:
    """Set ``key``'s concurrency limit (None: clear it); this process's claims see it at once,
    the fleet's within LIMIT_OVERRIDES_TTL."""
    ConcurrencyKey.objects.update_or_create(key=key, defaults={"concurrency_limit": limit})
    forget_limit_overrides()
