"""Budgets per concurrency key per UTC day: the ``BUDGETS`` setting, read and checked.

``BUDGETS`` maps a concurrency key (or ``"*"`` for any other key) to ``{"usd_per_day": N}``.
Before each model call of a run with a key that has a budget, the runner reads what the key
spent today (the rollup ``agent_usage_day``, priced by ``PRICES``); a key that spent its
budget hands the run back, pending with ``waiting_for="budget"``, until the next UTC day or
until someone raises the budget (``durable_agents.set_key_budget``, or the admin), which
wakes its runs at once. Every run checks before each call, so the overshoot is at most the
turns already in flight when the budget ran out: one per run.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Mapping
from decimal import Decimal, InvalidOperation
from typing import Any

from durable_agents.conf import app_settings
from durable_agents.exceptions import InvalidArgument

ANY_KEY = "*"


def _amount(where: str, value: Any) -> Decimal:
    if isinstance(value, bool) or not isinstance(value, (int, float, Decimal, str)):
        raise InvalidArgument(f"{where} must be a number of USD, not {value!r}")
    try:
        amount = Decimal(str(value))
    except InvalidOperation:
        raise InvalidArgument(f"{where} must be a number of USD, not {value!r}") from None
    if not amount.is_finite() or amount < 0:
        raise InvalidArgument(f"{where} must be a finite number >= 0, not {value!r}")
    return amount


def parse_budget(key: str, entry: Any) -> Decimal:
    where = f"BUDGETS[{key!r}]"
    if not isinstance(entry, Mapping):
        raise ValueError(f"{where} must be a dict like {{'usd_per_day': 50}}, not {entry!r}")
    unknown = sorted(set(entry) - {"usd_per_day"})
    if unknown or "usd_per_day" not in entry:
        raise ValueError(f"{where} must have exactly the key 'usd_per_day', not {sorted(entry)}")
    return _amount(f"{where}['usd_per_day']", entry["usd_per_day"])


def budget_problems(setting: Any) -> list[str]:
    """What is wrong with a ``BUDGETS`` value, one message per problem (system checks)."""
    if not isinstance(setting, Mapping):
        return [f"BUDGETS must be a dict of concurrency key to budget, not {setting!r}"]
    problems = []
    for key, entry in setting.items():
        if not isinstance(key, str) or not key or "\x00" in key:
            problems.append(f"BUDGETS has a key that is not a concurrency key: {key!r}")
            continue
        try:
            parse_budget(key, entry)
        except ValueError as exc:
            problems.append(str(exc))
    return problems


def configured_budget(key: str) -> Decimal | None:
    """``BUDGETS``' budget of ``key`` (or of ``"*"``), None when it has none. An entry the
    checks refuse counts as none: they say why at start-up."""
    setting: Any = app_settings.BUDGETS or {}
    if not isinstance(setting, Mapping):
        return None
    entry = setting.get(key, setting.get(ANY_KEY))
    if entry is None:
        return None
    try:
        return parse_budget(key, entry)
    except ValueError:
        return None


def in_force(key: str, override: Decimal | None) -> Decimal | None:
    """The budget that holds ``key``'s runs: none unless ``BUDGETS`` gives the key one (its
    own, or ``"*"``'s), and then the one staff set (``override``) if any. So a run of a key
    without a BUDGETS entry never costs a read of what its key spent."""
    configured = configured_budget(key)
    if configured is None:
        return None
    return configured if override is None else override


def check_amount(value: Any) -> Decimal:
    """A budget set at run time (``set_key_budget``): a finite number >= 0, or
    ``InvalidArgument`` (a ``ValueError``)."""
    return _amount("usd_per_day", value)


def seconds_to_next_day(now: datetime.datetime) -> float:
    """Seconds from ``now`` to the next midnight, UTC: when a key's spending starts again."""
    utc = now.astimezone(datetime.UTC)
    midnight = datetime.datetime.combine(
        utc.date() + datetime.timedelta(days=1), datetime.time(), tzinfo=datetime.UTC
    )
    return max(math.ceil((midnight - utc).total_seconds()), 1)
