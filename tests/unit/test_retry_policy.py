"""durable_agents.declare.retries: what ``Retry`` accepts at definition, which failures it
retries and the pauses it asks for. No database."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest

from durable_agents import Agent, Retry, Wait, tool
from durable_agents.declare.retries import MAX_ATTEMPTS, ExponentialBackoff
from durable_agents.declare.waits import AskPerson
from durable_agents.exceptions import DefinitionError


def fixed(draw: float) -> Callable[[], float]:
    """A jitter source that always draws ``draw``."""
    return lambda: draw


# --------------------------------------------------------------------------- definition


def test_the_default_policy() -> None:
    policy = Retry()
    assert policy.attempts == 3
    assert policy.on == (TimeoutError, ConnectionError)
    assert policy.backoff == ExponentialBackoff(base=0.5, factor=2.0, cap=30.0, jitter=True)


@pytest.mark.parametrize(
    ("attempts", "message"),
    [
        (0, r"Retry\(attempts=\) must be between 1 and 20, not 0"),
        (MAX_ATTEMPTS + 1, r"between 1 and 20, not 21"),
        (-3, r"between 1 and 20, not -3"),
        (2.5, r"must be a whole number, not 2\.5"),
        (True, r"must be a whole number, not True"),
        ("3", r"must be a whole number, not '3'"),
    ],
)
def test_attempts_out_of_bounds_are_a_definition_error(attempts: Any, message: str) -> None:
    with pytest.raises(DefinitionError, match=message):
        Retry(attempts=attempts)


def test_one_attempt_and_the_maximum_are_accepted() -> None:
    assert Retry(attempts=1).attempts == 1
    assert Retry(attempts=MAX_ATTEMPTS).attempts == MAX_ATTEMPTS


@pytest.mark.parametrize(
    ("on", "message"),
    [
        ((), r"Retry\(on=\) is empty"),
        ((TimeoutError, "ValueError"), r"takes exception classes, not 'ValueError'"),
        ((TimeoutError(),), r"takes exception classes, not TimeoutError\(\)"),
        ((int,), r"takes exception classes, not <class 'int'>"),
        ((KeyboardInterrupt,), r"cannot retry KeyboardInterrupt: it is no Exception"),
        ((SystemExit,), r"cannot retry SystemExit"),
        ((BaseException,), r"cannot retry BaseException"),
        ((Wait,), r"cannot retry Wait: a Wait parks the run"),
        ((AskPerson,), r"cannot retry AskPerson"),
    ],
)
def test_on_takes_exception_classes_only(on: Any, message: str) -> None:
    with pytest.raises(DefinitionError, match=message):
        Retry(on=on)


def test_a_subclass_of_wait_is_refused_too() -> None:
    class Later(Wait):
        pass

    with pytest.raises(DefinitionError, match="cannot retry Later"):
        Retry(on=(ConnectionError, Later))


def test_on_takes_a_single_class_or_a_list_and_keeps_a_tuple() -> None:
    assert Retry(on=TimeoutError).on == (TimeoutError,)  # type: ignore[arg-type]
    assert Retry(on=[OSError, ValueError]).on == (OSError, ValueError)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("backoff", "message"),
    [
        (-1, r"Retry\(backoff=\) must be between 0 and 300 seconds, not -1"),
        (301, r"between 0 and 300 seconds, not 301"),
        (float("nan"), r"must be a number of seconds, not nan"),
        (True, r"takes seconds, a tuple of seconds"),
        ("1s", r"takes seconds, a tuple of seconds, an ExponentialBackoff or a function"),
        ((), r"is an empty tuple"),
        ((0.1, -2), r"each pause of Retry\(backoff=\) must be between 0 and 300"),
        ((0.1, "2"), r"each pause of Retry\(backoff=\) must be a number of seconds, not '2'"),
    ],
)
def test_a_backoff_that_cannot_be_a_pause_is_a_definition_error(backoff: Any, message: str) -> None:
    with pytest.raises(DefinitionError, match=message):
        Retry(backoff=backoff)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"base": -0.5}, r"ExponentialBackoff\(base=\) must be between 0 and 300"),
        ({"cap": 1000}, r"ExponentialBackoff\(cap=\) must be between 0 and 300"),
        ({"factor": 0.5}, r"ExponentialBackoff\(factor=\) must be between 1 and 10, not 0\.5"),
        ({"jitter": "yes"}, r"ExponentialBackoff\(jitter=\) is True or False"),
    ],
)
def test_exponential_backoff_is_checked(options: dict[str, Any], message: str) -> None:
    with pytest.raises(DefinitionError, match=message):
        ExponentialBackoff(**options)


def test_a_policy_is_frozen_and_comparable() -> None:
    policy = Retry(attempts=2, backoff=0)
    with pytest.raises(AttributeError):
        policy.attempts = 5  # type: ignore[misc]
    assert policy == Retry(attempts=2, backoff=0.0)
    assert hash(policy) == hash(Retry(attempts=2, backoff=0.0))


# --------------------------------------------------------------------------- on a tool


def test_retry_on_a_tool() -> None:
    policy = Retry(attempts=4, backoff=0)

    @tool(effect="non_idempotent", retry=policy)
    def charge(cents: int, *, idempotency_key: str) -> str:
        """Charge."""
        return "ok"

    assert charge.retry is policy

    @tool(effect="pure")
    def lookup(key: str) -> str:
        """Look up."""
        return key

    assert lookup.retry is None


def test_an_irreversible_tool_with_retry_is_a_definition_error() -> None:
    with pytest.raises(
        DefinitionError,
        match=r"tool .*drop in .*: an irreversible tool is never retried: .*remove retry=",
    ):

        @tool(effect="irreversible", retry=Retry())
        def drop(table: str) -> str:
            """Drop a table."""
            return table


def test_retry_must_be_a_retry() -> None:
    with pytest.raises(DefinitionError, match=r"tool .*lookup in .*: retry takes a Retry\("):

        @tool(effect="pure", retry=3)  # type: ignore[call-overload]
        def lookup(key: str) -> str:
            """Look up."""
            return key


def test_retry_is_in_neither_the_fingerprint_nor_the_digests() -> None:
    """It changes how the runtime runs a call, never what the model is shown or what a call
    means (its effect class and schema): runs and upgrades are not told apart by it."""

    def lookup(key: str) -> str:
        """Look up."""
        return key

    def agent_with(**options: Any) -> Agent:
        return Agent(
            name="retried",
            version="v1",
            model="claude-test-1",
            tools=[tool(effect="pure", **options)(lookup)],
            register=False,
        )

    plain, retried = agent_with(), agent_with(retry=Retry(attempts=5, backoff=0))
    assert retried.fingerprint() == plain.fingerprint()
    assert retried.digests() == plain.digests()
    assert retried.request_params() == plain.request_params()


# --------------------------------------------------------------------------- what is retried


def test_retries_matches_the_classes_and_their_subclasses() -> None:
    policy = Retry(on=(ConnectionError, TimeoutError))
    assert policy.retries(ConnectionResetError("reset"))
    assert policy.retries(TimeoutError("slow"))
    assert not policy.retries(ValueError("bad"))
    assert not policy.retries(OSError("disk"))  # a base of ConnectionError, not a subclass


def test_a_wait_is_never_retried_even_when_on_matches_it() -> None:
    policy = Retry(on=(Exception,))
    assert policy.retries(RuntimeError("anything"))
    assert not policy.retries(Wait(seconds=5))
    assert not policy.retries(AskPerson("Which one?"))


def test_retries_timeouts_when_on_covers_timeout_error() -> None:
    assert Retry().retries_timeouts
    assert Retry(on=(OSError,)).retries_timeouts  # TimeoutError is an OSError
    assert Retry(on=(Exception,)).retries_timeouts
    assert not Retry(on=(ConnectionError,)).retries_timeouts


# --------------------------------------------------------------------------- the pauses


def test_the_default_backoff_doubles_from_half_a_second_up_to_thirty() -> None:
    policy = Retry(attempts=MAX_ATTEMPTS)
    no_jitter = [policy.backoff.ceiling(n) for n in range(1, 10)]  # type: ignore[union-attr]
    assert no_jitter == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
    # The jitter draws a point of the upper half: a draw of 0 halves, a draw near 1 keeps it.
    assert [policy.delay(n, fixed(0.0)) for n in (1, 2, 3)] == [0.25, 0.5, 1.0]
    assert [policy.delay(n, fixed(0.5)) for n in (1, 2, 3)] == [0.375, 0.75, 1.5]
    assert policy.delay(12, fixed(0.999)) == pytest.approx(29.985)
    assert policy.delay(1000, fixed(0.0)) == 15.0  # no overflow, capped


def test_seeded_jitter_stays_within_the_upper_half_of_the_ceiling() -> None:
    import random

    draws = random.Random(1234)
    policy = Retry(attempts=MAX_ATTEMPTS)
    for n in range(1, MAX_ATTEMPTS):
        ceiling = policy.backoff.ceiling(n)  # type: ignore[union-attr]
        delay = policy.delay(n, draws.random)
        assert ceiling / 2 <= delay <= ceiling


def test_exponential_backoff_without_jitter() -> None:
    policy = Retry(backoff=ExponentialBackoff(base=1, factor=3, cap=20, jitter=False))
    assert [policy.delay(n, fixed(0.7)) for n in range(1, 6)] == [1.0, 3.0, 9.0, 20.0, 20.0]


def test_a_constant_backoff() -> None:
    assert [Retry(backoff=0).delay(n) for n in (1, 2, 3)] == [0.0, 0.0, 0.0]
    assert [Retry(backoff=1.5).delay(n) for n in (1, 2)] == [1.5, 1.5]


def test_a_tuple_of_pauses_repeats_its_last() -> None:
    policy = Retry(attempts=6, backoff=(0.1, 1, 5))
    assert [policy.delay(n) for n in range(1, 6)] == [0.1, 1.0, 5.0, 5.0, 5.0]


def test_a_backoff_function_gets_the_retry_number() -> None:
    asked: list[int] = []

    def linear(retry: int) -> float:
        asked.append(retry)
        return retry * 0.25

    policy = Retry(attempts=4, backoff=linear)
    assert [policy.delay(n) for n in (1, 2, 3)] == [0.25, 0.5, 0.75]
    assert asked == [1, 2, 3]


@pytest.mark.parametrize("returned", [-1, 10_000, "soon", None, float("inf")])
def test_a_backoff_function_that_returns_no_pause_is_a_value_error(returned: Any) -> None:
    policy = Retry(backoff=lambda retry: returned)
    with pytest.raises(ValueError, match=r"the backoff function .*<lambda> returned a pause that"):
        policy.delay(1)


def test_describe() -> None:
    assert Retry(attempts=4, on=(ConnectionError,)).describe() == "4 attempts on ConnectionError"


def test_delays_never_draw_without_jitter() -> None:
    """A policy without jitter does not consume random numbers (a seeded test stays put)."""
    counter = itertools.count()

    def draw() -> float:
        next(counter)
        return 0.0

    Retry(backoff=(1, 2)).delay(1, draw)
    Retry(backoff=0).delay(1, draw)
    assert next(counter) == 0


def test_the_exponential_backoff_is_reachable_from_retry() -> None:
    policy = Retry(backoff=Retry.Exponential(base=1, factor=2, cap=3, jitter=False))
    assert [policy.delay(n) for n in (1, 2, 3)] == [1.0, 2.0, 3.0]
    assert Retry.Exponential is ExponentialBackoff
