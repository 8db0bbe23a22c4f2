"""Retry policies of tools: ``@tool(effect="pure", retry=Retry(attempts=3))``.

A tool's transient failure (a timeout, a dropped connection) is tried again by the runtime
before the model is told: the model reads only what the last attempt came to. Each attempt is
the same call: a non-idempotent tool receives the same ``idempotency_key`` every time (the key
depends on the call's place in the run, its tool and its input, never on the attempt), so the
system it writes to can tell the attempts are one call. An irreversible tool is never retried:
a person approved one execution.

``Retry`` is checked when it is made (a ``DefinitionError`` says what is wrong), so a policy
that cannot work fails at import of the ``agents.py`` that declares it, not in a run.

This module never imports Django models: it is imported by every ``agents.py`` at app loading.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable
from typing import Any, ClassVar, TypeAlias

from durable_agents.exceptions import DefinitionError

__all__ = ["MAX_ATTEMPTS", "MAX_DELAY_SECONDS", "ExponentialBackoff", "Retry"]

# More attempts than this is a loop, not a retry: the model is better told.
MAX_ATTEMPTS = 20
# The longest pause between two attempts. The run's worker slot is held while it waits (its
# lease stays renewed); a longer pause is better spent as a ``Wait(seconds=...)``.
MAX_DELAY_SECONDS = 300.0


def _seconds(value: Any, what: str) -> float:
    """``value`` as a number of seconds between 0 and MAX_DELAY_SECONDS, or a DefinitionError."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise DefinitionError(f"{what} must be a number of seconds, not {value!r}")
    if not 0 <= value <= MAX_DELAY_SECONDS:
        raise DefinitionError(
            f"{what} must be between 0 and {MAX_DELAY_SECONDS:g} seconds, not {value!r}"
        )
    return float(value)


@dataclasses.dataclass(frozen=True)
class ExponentialBackoff:
    """``base * factor ** (n - 1)`` seconds before retry ``n`` (1 for the second attempt),
    never more than ``cap``. With ``jitter``, a random point of the upper half of that: workers
    that failed together do not all try again at the same moment."""

    base: float = 0.5
    factor: float = 2.0
    cap: float = 30.0
    jitter: bool = True

    def __post_init__(self) -> None:
        _seconds(self.base, "ExponentialBackoff(base=)")
        _seconds(self.cap, "ExponentialBackoff(cap=)")
        factor = self.factor
        if isinstance(factor, bool) or not isinstance(factor, int | float) or not 1 <= factor <= 10:
            raise DefinitionError(
                f"ExponentialBackoff(factor=) must be between 1 and 10, not {factor!r}"
            )
        if not isinstance(self.jitter, bool):
            raise DefinitionError(
                f"ExponentialBackoff(jitter=) is True or False, not {self.jitter!r}"
            )

    def ceiling(self, retry: int) -> float:
        """The pause before retry ``retry`` without jitter."""
        # min() first on the exponent: factor ** 1000 would overflow a float.
        return float(min(self.cap, self.base * self.factor ** min(retry - 1, 64)))

    def seconds(self, retry: int, draw: float) -> float:
        """The pause before retry ``retry``; ``draw`` is a random number in [0, 1)."""
        ceiling = self.ceiling(retry)
        return ceiling * (0.5 + draw / 2) if self.jitter else ceiling


# What ``backoff=`` takes: seconds (the same pause before every retry), a tuple of seconds (the
# pause before retry 1, 2, ...; its last value for the retries after), an ExponentialBackoff,
# or a function of the retry's number (1, 2, ...) that returns the seconds.
BackoffSpec: TypeAlias = float | tuple[float, ...] | ExponentialBackoff | Callable[[int], float]

DEFAULT_BACKOFF = ExponentialBackoff()


def _exception_classes(on: Any) -> tuple[type[Exception], ...]:
    from durable_agents.declare.waits import Wait  # waits imports the tools, which import us

    classes = tuple(on) if isinstance(on, tuple | list) else (on,)
    if not classes:
        raise DefinitionError("Retry(on=) is empty: name the exceptions worth another attempt")
    for cls in classes:
        if not isinstance(cls, type) or not issubclass(cls, BaseException):
            raise DefinitionError(f"Retry(on=) takes exception classes, not {cls!r}")
        if not issubclass(cls, Exception):
            # KeyboardInterrupt, SystemExit, GeneratorExit: a stop, never a transient failure.
            raise DefinitionError(
                f"Retry(on=) cannot retry {cls.__name__}: it is no Exception but a request to stop"
            )
        if issubclass(cls, Wait):
            raise DefinitionError(
                f"Retry(on=) cannot retry {cls.__name__}: a Wait parks the run, it is no failure"
            )
    return classes


@dataclasses.dataclass(frozen=True)
class Retry:
    """How often a tool's call is tried, and after which failures:
    ``@tool(effect="pure", retry=Retry(attempts=3, on=(TimeoutError, ConnectionError)))``.

    ``attempts``: how many times in all, the first included (1 to 20).
    ``backoff``: the pause before each retry: seconds (0: none), a tuple of seconds (before
    retry 1, 2, ...; its last for the retries after), ``Retry.Exponential(base, factor, cap,
    jitter)`` (the default: 0.5 s doubling up to 30 s, jittered), or a function of the retry's
    number (1, 2, ...) that returns seconds. At most 300 s each.
    ``on``: the exceptions worth another attempt, their subclasses too (``Exception``
    subclasses only). ``TimeoutError`` covers the tool's own timeout as well: an attempt that
    overran it is abandoned (it may still finish in the background) and the next one has a
    timeout of its own. ``Wait`` is never retried, whatever ``on`` says: it parks the run.

    Pure, idempotent and non-idempotent tools take a policy (a non-idempotent tool gets the
    same ``idempotency_key`` on every attempt); an irreversible one refuses it. The model
    reads what the last attempt came to. A wrong policy is a ``DefinitionError``.
    """

    # ``Retry(backoff=Retry.Exponential(base=1, cap=10))``: the exponential pauses, tuned.
    Exponential: ClassVar[type[ExponentialBackoff]] = ExponentialBackoff

    attempts: int = 3
    backoff: BackoffSpec = DEFAULT_BACKOFF
    on: tuple[type[Exception], ...] = (TimeoutError, ConnectionError)

    def __post_init__(self) -> None:
        attempts = self.attempts
        if isinstance(attempts, bool) or not isinstance(attempts, int):
            raise DefinitionError(f"Retry(attempts=) must be a whole number, not {attempts!r}")
        if not 1 <= attempts <= MAX_ATTEMPTS:
            raise DefinitionError(
                f"Retry(attempts=) must be between 1 and {MAX_ATTEMPTS}, not {attempts}"
            )
        object.__setattr__(self, "on", _exception_classes(self.on))
        object.__setattr__(self, "backoff", _checked_backoff(self.backoff))

    def retries(self, error: BaseException) -> bool:
        """Whether a call that raised ``error`` is worth another attempt (attempts left
        aside). A ``Wait`` never is, even when ``on`` names one of its bases."""
        from durable_agents.declare.waits import Wait

        return isinstance(error, self.on) and not isinstance(error, Wait)

    @property
    def retries_timeouts(self) -> bool:
        """Whether an attempt that overran the tool's timeout is tried again (``on`` covers
        ``TimeoutError``)."""
        return any(issubclass(TimeoutError, cls) for cls in self.on)

    def delay(self, retry: int, draw: Callable[[], float] = random.random) -> float:
        """Seconds to pause before retry ``retry`` (1: before the second attempt). ``draw``
        gives the jitter's random numbers. A backoff function that fails or returns no
        number of seconds in [0, MAX_DELAY_SECONDS] raises ``ValueError``."""
        backoff = self.backoff
        if isinstance(backoff, ExponentialBackoff):
            return backoff.seconds(retry, draw())
        if isinstance(backoff, float):
            return backoff
        if isinstance(backoff, tuple):
            return backoff[min(retry, len(backoff)) - 1]
        value = backoff(retry)
        try:
            return _seconds(value, f"the backoff function {_name(backoff)} returned a pause that")
        except DefinitionError as exc:
            raise ValueError(str(exc)) from None

    def describe(self) -> str:
        """The policy in a few words (logs and the docs' examples)."""
        names = ", ".join(cls.__name__ for cls in self.on)
        return f"{self.attempts} attempts on {names}"


def _name(func: Callable[..., Any]) -> str:
    return str(getattr(func, "__qualname__", None) or repr(func))


def _checked_backoff(backoff: Any) -> BackoffSpec:
    if isinstance(backoff, ExponentialBackoff):
        return backoff
    if isinstance(backoff, tuple | list):
        if not backoff:
            raise DefinitionError("Retry(backoff=) is an empty tuple: give one pause at least")
        return tuple(_seconds(value, "each pause of Retry(backoff=)") for value in backoff)
    if isinstance(backoff, int | float) and not isinstance(backoff, bool):
        return _seconds(backoff, "Retry(backoff=)")
    if callable(backoff):
        return backoff  # type: ignore[no-any-return]  # checked at each call: see Retry.delay
    raise DefinitionError(
        "Retry(backoff=) takes seconds, a tuple of seconds, an ExponentialBackoff or a function "
        f"of the retry's number, not {backoff!r}"
    )
