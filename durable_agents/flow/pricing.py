"""What a model turn cost, in US dollars, from its ``usage`` and the ``PRICES`` setting.

``PRICES`` maps a model name (or ``"*"``, any other model) to its prices in USD per million
tokens::

    "PRICES": {"claude-fable-5-1": {"input": 3.0, "output": 15.0,
                                    "cache_read": 0.3, "cache_write": 3.75}}

``input`` and ``output`` are required. The cache prices are optional: without them a turn is
priced as the Messages API bills it, relative to the input price (cache reads 0.1x, 5-minute
cache writes 1.25x, 1-hour cache writes 2x). A turn's ``usage.cache_creation`` splits its
cache writes by lifetime (``ephemeral_5m_input_tokens``, ``ephemeral_1h_input_tokens``);
without it every write is a 5-minute one, the API's default. ``cache_write`` prices the
5-minute writes and ``cache_write_1h`` the 1-hour ones.

When the server ran several passes for one turn (``usage.iterations``: a compaction, then the
message), the top-level figures cover the last pass only: the passes are priced and summed,
as ``runner.tokens_of`` sums their tokens.

Turns answered through Message Batches cost half: every price of the entry halved, unless the
entry gives batch prices of its own under ``"batch"`` (an entry of the same shape, its cache
prices derived from its input price as above)::

    "PRICES": {"claude-fable-5-1": {"input": 3.0, "output": 15.0,
                                    "batch": {"input": 1.5, "output": 7.5}}}

A cost is a ``Decimal`` rounded to ``COST_PLACES`` decimal places (a nano-dollar): exact
arithmetic, so that a run's total and the daily rollup add up to the cent however many turns
they sum. A model without a price (and no ``"*"``) gives ``None``: "no price", never $0.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

from durable_agents.conf import app_settings

__all__ = [
    "COST_PLACES",
    "OPTIONAL_PRICES",
    "QUANTUM",
    "REQUIRED_PRICES",
    "Price",
    "Usage",
    "add_cost",
    "cost_of",
    "format_usd",
    "price_for",
    "price_problems",
    "usage_of",
]

logger = logging.getLogger("durable_agents.pricing")

# Decimal places of a stored cost: a nano-dollar. A cache read of one token at $0.30 per
# million is $0.0000003, exact at this precision; the columns are numeric(20, 9).
COST_PLACES = 9
QUANTUM = Decimal(1).scaleb(-COST_PLACES)
MILLION = Decimal(1_000_000)

REQUIRED_PRICES = ("input", "output")
OPTIONAL_PRICES = ("cache_read", "cache_write", "cache_write_1h")
# The key of an entry's own batch prices; without it a batched turn costs half.
BATCH_PRICES = "batch"
BATCH_FACTOR = Decimal("0.5")
# The Messages API's prompt caching prices, relative to the input price.
CACHE_READ_FACTOR = Decimal("0.1")
CACHE_WRITE_5M_FACTOR = Decimal("1.25")
CACHE_WRITE_1H_FACTOR = Decimal(2)


@dataclasses.dataclass(frozen=True, slots=True)
class Usage:
    """The tokens of one turn by how they are billed, summed over its passes."""

    input_tokens: int = 0  # uncached input
    output_tokens: int = 0
    cache_read_tokens: int = 0
    cache_write_5m_tokens: int = 0
    cache_write_1h_tokens: int = 0

    @property
    def cache_write_tokens(self) -> int:
        return self.cache_write_5m_tokens + self.cache_write_1h_tokens

    @property
    def total(self) -> int:
        """What ``runner.tokens_of`` counts: every input, cached or not, and the output."""
        cached = self.cache_read_tokens + self.cache_write_tokens
        return self.input_tokens + self.output_tokens + cached


@dataclasses.dataclass(frozen=True, slots=True)
class Price:
    """USD per million tokens of each kind, the cache prices filled in from the input's."""

    input: Decimal
    output: Decimal
    cache_read: Decimal
    cache_write: Decimal  # 5-minute writes
    cache_write_1h: Decimal

    def cost(self, usage: Usage) -> Decimal:
        micro = (
            usage.input_tokens * self.input
            + usage.output_tokens * self.output
            + usage.cache_read_tokens * self.cache_read
            + usage.cache_write_5m_tokens * self.cache_write
            + usage.cache_write_1h_tokens * self.cache_write_1h
        )
        return (micro / MILLION).quantize(QUANTUM)


def _count(value: Any) -> int:
    """A token count as the API reports it; anything else (missing, null, garbage) is 0."""
    if isinstance(value, bool) or not isinstance(value, int):
        return 0
    return max(value, 0)


def _pass_usage(usage: Mapping[str, Any]) -> Usage:
    written = _count(usage.get("cache_creation_input_tokens"))
    split = usage.get("cache_creation")
    one_hour = 0
    if isinstance(split, dict):
        one_hour = _count(split.get("ephemeral_1h_input_tokens"))
        five = _count(split.get("ephemeral_5m_input_tokens"))
        # The split is the breakdown of the total; when it is all there is, it is the total.
        written = max(written, five + one_hour)
        one_hour = min(one_hour, written)
    return Usage(
        input_tokens=_count(usage.get("input_tokens")),
        output_tokens=_count(usage.get("output_tokens")),
        cache_read_tokens=_count(usage.get("cache_read_input_tokens")),
        cache_write_5m_tokens=written - one_hour,
        cache_write_1h_tokens=one_hour,
    )


def usage_of(message: Mapping[str, Any]) -> Usage:
    """The billed tokens of one model turn (a Messages API message), its passes summed."""
    usage = message.get("usage")
    if not isinstance(usage, dict):
        return Usage()
    iterations = usage.get("iterations")
    passes = (
        [item for item in iterations if isinstance(item, dict)]
        if isinstance(iterations, list) and iterations
        else [usage]
    )
    parts = [_pass_usage(item) for item in passes]
    return Usage(*(sum(getattr(part, f.name) for part in parts) for f in dataclasses.fields(Usage)))


def _number_problem(value: Any) -> str | None:
    if isinstance(value, bool) or not isinstance(value, (int, float, Decimal)):
        return f"must be a number, not {value!r}"
    if isinstance(value, float) and not math.isfinite(value):
        return f"must be a finite number, not {value!r}"
    if isinstance(value, Decimal) and not value.is_finite():
        return f"must be a finite number, not {value!r}"
    if value < 0:
        return f"must not be negative, not {value!r}"
    return None


def price_problems(model: Any, entry: Any) -> list[tuple[str, str]]:
    """What is wrong with one entry of PRICES, as (kind, text) pairs; kind is one of
    "entry", "missing", "unknown", "number" (each a system check id of its own)."""
    if not isinstance(model, str) or not model:
        return [("entry", f"has a key that is not a model name: {model!r}")]
    if not isinstance(entry, dict):
        return [("entry", f"[{model!r}] must be a dict of prices, not {entry!r}")]
    problems: list[tuple[str, str]] = []
    for name in REQUIRED_PRICES:
        if name not in entry:
            problems.append(("missing", f"[{model!r}] has no {name!r} price"))
    known = (*REQUIRED_PRICES, *OPTIONAL_PRICES)
    for name in entry:
        if name == BATCH_PRICES:
            problems.extend(
                (kind, text.replace(f"[{model!r}]", f"[{model!r}][{BATCH_PRICES!r}]", 1))
                for kind, text in price_problems(model, entry[name])
                if kind != "entry" or isinstance(entry[name], dict)
            )
            if not isinstance(entry[name], dict):
                problems.append(
                    ("entry", f"[{model!r}][{BATCH_PRICES!r}] must be a dict of prices")
                )
        elif name not in known:
            problems.append(("unknown", f"[{model!r}] has an unknown key {name!r}"))
    for name in known:
        if name in entry:
            problem = _number_problem(entry[name])
            if problem:
                problems.append(("number", f"[{model!r}][{name!r}] {problem}"))
    return problems


def _decimal(value: int | float | Decimal) -> Decimal:
    # Through its shortest text: 0.3 is Decimal("0.3"), not the binary float's expansion.
    return value if isinstance(value, Decimal) else Decimal(repr(value))


def _price(entry: Mapping[str, Any]) -> Price:
    def given(name: str, default: Decimal) -> Decimal:
        return _decimal(entry[name]) if name in entry else default

    base = _decimal(entry["input"])
    return Price(
        input=base,
        output=_decimal(entry["output"]),
        cache_read=given("cache_read", base * CACHE_READ_FACTOR),
        cache_write=given("cache_write", base * CACHE_WRITE_5M_FACTOR),
        cache_write_1h=given("cache_write_1h", base * CACHE_WRITE_1H_FACTOR),
    )


_warned: set[str] = set()


def price_for(model: str, *, batch: bool = False) -> Price | None:
    """The price of ``model`` (or of ``"*"``) in PRICES; None when there is none, or when its
    entry is unusable (the system checks name the problem; a run is never stopped by it).
    ``batch``: the price of a turn answered through Message Batches (the entry's ``"batch"``
    prices, or half of each of its prices)."""
    prices = app_settings.PRICES
    if not isinstance(prices, dict):
        return None
    key = model if model in prices else "*"
    entry = prices.get(key)
    if entry is None:
        return None
    if price_problems(key, entry):
        if key not in _warned:
            _warned.add(key)
            logger.warning("PRICES[%r] is not usable (see manage.py check): not priced", key)
        return None
    if not batch:
        return _price(entry)
    own: Any = entry.get(BATCH_PRICES)
    if isinstance(own, dict):
        return _price(own)
    direct = _price(entry)
    return Price(*(getattr(direct, f.name) * BATCH_FACTOR for f in dataclasses.fields(Price)))


def cost_of(model: str, usage: Usage, *, batch: bool = False) -> Decimal | None:
    """What ``usage`` cost at ``model``'s price, in USD; None: the model has no price.
    ``batch``: at the batch price (a turn answered through Message Batches)."""
    price = price_for(model, batch=batch)
    return None if price is None else price.cost(usage)


def add_cost(total: Decimal | None, cost: Decimal | None) -> Decimal | None:
    """A running cost plus one turn's: None ("no price") only while no turn had a price.
    The statements write the same as coalesce(total + cost, cost, total)."""
    if cost is None:
        return total
    return cost if total is None else total + cost


def format_usd(cost: Decimal | None, places: int = 4) -> str:
    """``$0.0123``: a cost as the admin prints it (rounded half up); "" for None. A cost that
    is not zero but rounds to it reads ``<$0.0001`` rather than a misleading $0."""
    if cost is None:
        return ""
    quantum = Decimal(1).scaleb(-places)
    if 0 < cost < quantum:
        return f"<${quantum}"
    return f"${cost.quantize(quantum, rounding='ROUND_HALF_UP'):,}"
