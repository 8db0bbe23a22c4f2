"""One error tree: every exception class durable_agents defines that a user can meet is a
``DurableAgentsError`` importable from ``durable_agents.exceptions``; the others are the
runtime's control flow, named below with the reason."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import warnings

import pytest

import durable_agents
from durable_agents import exceptions
from durable_agents.exceptions import DurableAgentsError, DurableAgentsValueError

# Exceptions that are not errors a user meets, so not in the tree (each class says why too).
CONTROL_FLOW = {
    # Parks a run: tool code raises it, and it must get past `except DurableAgentsError`.
    "durable_agents.declare.waits.Wait",
    "durable_agents.declare.waits.AskPerson",  # the Wait of the built-in ask_person tool
    # The call thread's news to the dispatcher, which turns it into an interruption / a result.
    "durable_agents._internal.calls.CallInterrupted",
    "durable_agents._internal.calls.CallTimedOut",
    "durable_agents.engine.dispatch.WaitRaised",  # a tool's Wait on its way to the park
    # The slot's own commit failed while a call ran: raised again past the tool's handling.
    "durable_agents.engine.dispatch._SlotWorkFailed",
    "durable_agents.engine.dispositions.Stop",  # unwinds the runner's step loop
    "durable_agents.forks.upgrades._Raced",  # rolls back one batch of an upgrade
    "durable_agents.live.hub.ReaderDropped",  # ends a stream, as StopAsyncIteration would
    "durable_agents.offline.wire.RequestError",  # becomes the offline model's HTTP answer
    "durable_agents.offline.batches._QueueFull",  # the offline model's 429 of a batch create
    # A batch endpoint's failure, caught by the batch service (which logs it and goes on).
    "durable_agents.llm.batches.BatchCallFailed",
    "durable_agents.callbacks.BadBody",  # becomes the callback view's 400 or 413 answer
    # The model's answer refused by the output schema: told to the model, or the run's error.
    "durable_agents.declare.output.InvalidOutput",
    "durable_agents.webhooks.TemplateProblem",  # becomes a system check's message (E075)
    "durable_agents.schedules.firing._TogetherRefused",  # private: retries a batch one by one
    # A user's message cut the model call short: the runner calls again with it.
    "durable_agents.engine.runner._MessageArrived",
}


def _modules() -> list[str]:
    names = ["durable_agents"]
    for info in pkgutil.walk_packages(durable_agents.__path__, prefix="durable_agents."):
        if ".migrations" not in f"{info.name}.":
            names.append(info.name)
    return names


def _exception_classes() -> dict[str, type[BaseException]]:
    found: dict[str, type[BaseException]] = {}
    for name in _modules():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            # An optional extra that this environment lacks (as scripts/check-imports.py).
            if (exc.name or "").split(".")[0] in {
                "psycopg",
                "psycopg_pool",
                "django_q",
                "opentelemetry",
                "prometheus_client",
            }:
                continue
            raise
        for value in vars(module).values():
            if (
                inspect.isclass(value)
                and issubclass(value, BaseException)
                and value.__module__.startswith("durable_agents")
            ):
                found[f"{value.__module__}.{value.__qualname__}"] = value
    return found


CLASSES = _exception_classes()


def test_the_walk_found_the_tree_and_the_control_flow() -> None:
    assert "durable_agents.exceptions.ForkRefused" in CLASSES
    assert "durable_agents.exceptions.ModelError" in CLASSES
    assert set(CONTROL_FLOW) <= set(CLASSES), set(CONTROL_FLOW) - set(CLASSES)


@pytest.mark.parametrize("name", sorted(set(CLASSES) - CONTROL_FLOW))
def test_every_error_a_user_meets_is_in_the_tree(name: str) -> None:
    error = CLASSES[name]
    assert issubclass(error, DurableAgentsError), f"{name} is not a DurableAgentsError"
    assert getattr(exceptions, error.__name__, None) is error, (
        f"{name} is not importable from durable_agents.exceptions"
    )
    assert error.__name__ in exceptions.__all__


@pytest.mark.parametrize("name", sorted(CONTROL_FLOW))
def test_control_flow_stays_out_of_the_tree(name: str) -> None:
    assert not issubclass(CLASSES[name], DurableAgentsError)


def test_exceptions_all_is_the_tree() -> None:
    for name in exceptions.__all__:
        value = getattr(exceptions, name)
        assert issubclass(value, DurableAgentsError), name
    defined = {
        name
        for name, value in vars(exceptions).items()
        if inspect.isclass(value) and issubclass(value, DurableAgentsError)
    }
    assert defined == set(exceptions.__all__)


def test_value_errors_are_still_value_errors() -> None:
    assert issubclass(DurableAgentsValueError, ValueError)
    for error in (
        exceptions.ForkRefused,
        exceptions.BadEventId,
        exceptions.InvalidArgument,
        exceptions.RunNotFound,
        exceptions.SpawnRefused,
    ):
        assert issubclass(error, DurableAgentsValueError)
    assert issubclass(exceptions.RunNotFound, LookupError)


def test_old_names_give_the_same_classes() -> None:
    from durable_agents._internal import encryption
    from durable_agents.forks import planning as forks
    from durable_agents.forks import replay
    from durable_agents.live import BadEventId
    from durable_agents.live.events import BadEventId as BadEventIdOfEvents
    from durable_agents.llm import ModelError
    from durable_agents.llm.errors import CredentialsRefused, PermanentModelError
    from durable_agents.store.base import WaitRefused

    assert forks.ForkRefused is exceptions.ForkRefused
    assert BadEventId is BadEventIdOfEvents is exceptions.BadEventId
    assert replay.ReplayError is exceptions.ReplayError
    assert encryption.InvalidKey is exceptions.InvalidKey
    assert encryption.UndecryptableValue is exceptions.UndecryptableValue
    assert ModelError is exceptions.ModelError
    assert PermanentModelError is exceptions.PermanentModelError
    assert CredentialsRefused is exceptions.CredentialsRefused
    assert WaitRefused is exceptions.WaitRefused


def test_exceptions_stays_a_leaf() -> None:
    # It imports nothing of the package: every module may import it without a cycle.
    source = inspect.getsource(exceptions)
    assert "from durable_agents" not in source.replace("from durable_agents.exceptions", "")
    assert "import durable_agents" not in source
