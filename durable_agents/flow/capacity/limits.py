"""What a model may take: the ``RATE_LIMITS`` setting, read and checked.

``RATE_LIMITS`` maps a model name (or ``"*"`` for any other model) to its limits per minute,
for the whole fleet::

    "RATE_LIMITS": {"claude-fable-5-1": {"requests_per_minute": 4000,
                                         "input_tokens_per_minute": 2_000_000,
                                         "output_tokens_per_minute": 400_000,
                                         "burst_seconds": 10}}

Each limit is optional (a missing one is not enforced). ``burst_seconds``: how much of a
minute's limit a bucket holds, i.e. the largest burst the fleet sends at once (default 10 s:
the API also refuses sharp increases below its stated limits, so the fleet ramps up).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from durable_agents.conf import app_settings

LIMIT_FIELDS = ("requests_per_minute", "input_tokens_per_minute", "output_tokens_per_minute")
DEFAULT_BURST_SECONDS = 10.0
ANY_MODEL = "*"


@dataclass(frozen=True)
class ModelLimits:
    """Limits per minute; None: not enforced."""

    requests_per_minute: float | None = None
    input_tokens_per_minute: float | None = None
    output_tokens_per_minute: float | None = None
    burst_seconds: float = DEFAULT_BURST_SECONDS

    @property
    def any(self) -> bool:
        return any(getattr(self, name) is not None for name in LIMIT_FIELDS)


def _number(name: str, value: Any, *, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, not {value!r}")
    number = float(value)
    if math.isnan(number) or math.isinf(number) or number < 0 or (number == 0 and not allow_zero):
        raise ValueError(f"{name} must be a positive number, not {value!r}")
    return number


def parse_limits(model: str, entry: Any) -> ModelLimits:
    """One entry of ``RATE_LIMITS``; a ``ValueError`` that says what is wrong."""
    where = f"RATE_LIMITS[{model!r}]"
    if not isinstance(entry, Mapping):
        raise ValueError(f"{where} must be a dict of limits, not {type(entry).__name__}")
    unknown = sorted(set(entry) - {*LIMIT_FIELDS, "burst_seconds"})
    if unknown:
        raise ValueError(
            f"{where} has unknown keys {unknown}; the limits are {', '.join(LIMIT_FIELDS)} "
            "and burst_seconds"
        )
    values: dict[str, float | None] = {
        name: None if entry.get(name) is None else _number(f"{where}[{name!r}]", entry[name])
        for name in LIMIT_FIELDS
    }
    burst = entry.get("burst_seconds", DEFAULT_BURST_SECONDS)
    burst = _number(f"{where}['burst_seconds']", burst)
    if burst > 60:
        raise ValueError(f"{where}['burst_seconds'] is at most 60 (a minute's limit), not {burst}")
    return ModelLimits(**values, burst_seconds=burst)


def limit_problems(setting: Any) -> list[str]:
    """What is wrong with a ``RATE_LIMITS`` value, one message per problem (system checks)."""
    if setting is None:
        return []
    if not isinstance(setting, Mapping):
        return [f"RATE_LIMITS must be a dict of model name to limits, not {type(setting).__name__}"]
    problems = []
    for model, entry in setting.items():
        if not isinstance(model, str) or not model.strip():
            problems.append(f"RATE_LIMITS has a key that is not a model name: {model!r}")
            continue
        try:
            parse_limits(model, entry)
        except ValueError as exc:
            problems.append(str(exc))
    return problems


def configured_limits(model: str) -> ModelLimits | None:
    """The ``RATE_LIMITS`` of ``model`` (or of ``"*"``), None when it has none. An entry the
    checks would refuse counts as none here: the checks say why at start-up."""
    setting = app_settings.RATE_LIMITS or {}
    entry = setting.get(model, setting.get(ANY_MODEL))
    if entry is None:
        return None
    try:
        return parse_limits(model, entry)
    except ValueError:
        return None
