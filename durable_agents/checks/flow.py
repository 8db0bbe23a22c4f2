"""The settings of flow control: ``RATE_LIMITS`` (E030), ``BUDGETS`` (E031), ``PRICES`` (E020 to
E023) and ``CONCURRENCY_LIMITS`` (E014 to E016); and the models that ``RATE_LIMITS`` (W030) or
``PRICES`` (W010) name but no registered agent uses."""

from __future__ import annotations

from typing import Any

from django.core.checks import CheckMessage, Error, Warning

from durable_agents.conf import app_settings
from durable_agents.flow.budgets import budget_problems
from durable_agents.flow.capacity.limits import ANY_MODEL, limit_problems
from durable_agents.store.concurrency import check_concurrency_key


def bad_rate_limits() -> list[CheckMessage]:
    """Each problem of ``RATE_LIMITS`` (a limit that is not a positive number, an unknown key):
    at start-up, rather than a model whose limit is silently not enforced."""
    return [
        Error(
            f"DURABLE_AGENTS['RATE_LIMITS']: {problem}.",
            hint='For example {"claude-fable-5-1": {"requests_per_minute": 4000, '
            '"input_tokens_per_minute": 2000000, "output_tokens_per_minute": 400000}}.',
            id="durable_agents.E030",
        )
        for problem in limit_problems(app_settings.RATE_LIMITS)
    ]


def bad_budgets() -> list[CheckMessage]:
    """Each problem of ``BUDGETS`` (a budget that is not a number >= 0, a wrong shape)."""
    return [
        Error(
            f"DURABLE_AGENTS['BUDGETS']: {problem}.",
            hint='For example {"tenant:acme": {"usd_per_day": 50}, "*": {"usd_per_day": 5}}; '
            "a budget needs PRICES for the models its runs use.",
            id="durable_agents.E031",
        )
        for problem in budget_problems(app_settings.BUDGETS)
    ]


# One id per kind of problem in PRICES (see ``pricing.price_problems``).
PRICE_CHECK_IDS = {
    "entry": "durable_agents.E020",  # not a dict of model -> dict, or a key not a model name
    "missing": "durable_agents.E021",  # an entry without "input" or "output"
    "unknown": "durable_agents.E022",  # an entry with a key that is not a price
    "number": "durable_agents.E023",  # a price that is not a finite number >= 0
}
PRICE_HINT = (
    'USD per million tokens by model, e.g. {"claude-fable-5-1": {"input": 3.0, "output": 15.0, '
    '"cache_read": 0.3, "cache_write": 3.75}}; "*" prices any other model.'
)


def bad_prices() -> list[CheckMessage]:
    """Each problem of ``PRICES``, under the id of its kind (``PRICE_CHECK_IDS``)."""
    from durable_agents.flow.pricing import price_problems

    prices = app_settings.PRICES
    if not isinstance(prices, dict):
        return [
            Error(
                f"DURABLE_AGENTS['PRICES'] must be a dict, not {prices!r}.",
                hint=PRICE_HINT,
                id=PRICE_CHECK_IDS["entry"],
            )
        ]
    return [
        Error(f"DURABLE_AGENTS['PRICES']{text}.", hint=PRICE_HINT, id=PRICE_CHECK_IDS[kind])
        for model, entry in prices.items()
        for kind, text in price_problems(model, entry)
    ]


def bad_concurrency_limits() -> list[CheckMessage]:
    """CONCURRENCY_LIMITS: a dict of concurrency keys (as ``start_run`` takes them) to whole
    numbers >= 0. A claim leaves a bad entry out rather than fail on it."""
    limits = app_settings.CONCURRENCY_LIMITS
    if not isinstance(limits, dict):
        return [
            Error(
                "DURABLE_AGENTS['CONCURRENCY_LIMITS'] must be a dict of concurrency keys to "
                f"limits, not {limits!r}.",
                id="durable_agents.E014",
            )
        ]
    messages: list[CheckMessage] = []
    for key, limit in limits.items():
        try:
            check_concurrency_key(key)
        except ValueError as exc:
            messages.append(
                Error(
                    f"DURABLE_AGENTS['CONCURRENCY_LIMITS'] has the key {key!r}: {exc}.",
                    id="durable_agents.E015",
                )
            )
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            messages.append(
                Error(
                    f"DURABLE_AGENTS['CONCURRENCY_LIMITS'][{key!r}] must be a whole number "
                    f">= 0, not {limit!r}.",
                    hint="0 holds the key's runs pending (a pause); remove the entry for the "
                    "agent's own concurrency_limit.",
                    id="durable_agents.E016",
                )
            )
    return messages


def rate_limits_for_unknown_models(models: set[str]) -> list[CheckMessage]:
    """A model in RATE_LIMITS that no agent uses: most likely a typo, and the model meant
    goes unlimited."""
    limits = app_settings.RATE_LIMITS
    if not isinstance(limits, dict) or not models:
        return []
    return [
        Warning(
            f"DURABLE_AGENTS['RATE_LIMITS'] names model {name!r}, which no registered agent uses.",
            hint=f"The agents use {', '.join(sorted(models))}. A misspelt model goes unlimited; "
            'use "*" for the limits of any model not named.',
            id="durable_agents.W030",
        )
        for name in sorted(set(limits) - models - {ANY_MODEL}, key=str)
        if isinstance(name, str)
    ]


def unused_prices(agents: list[Any]) -> list[CheckMessage]:
    """A model in PRICES that no registered agent uses is most likely a typo: the runs of
    the model meant would go unpriced (runs started with another model than their agent's
    are possible, hence a warning)."""
    prices = app_settings.PRICES
    if not isinstance(prices, dict):
        return []
    used = {agent.model for agent in agents}
    return [
        Warning(
            f"DURABLE_AGENTS['PRICES'] prices {model!r}, which no registered agent uses.",
            hint=f"Agents use: {', '.join(sorted(used)) or 'none'}. A misspelt model name "
            'leaves its runs without a price ("no price" in the admin).',
            id="durable_agents.W010",
        )
        for model in prices
        if isinstance(model, str) and model != "*" and model not in used
    ]
