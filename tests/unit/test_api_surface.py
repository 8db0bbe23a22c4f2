"""The public surface: ``durable_agents.__all__`` imports, ``durable_agents.api.__all__`` lists
the operations, every operation a view calls has its async twin, and options are keywords."""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

import pytest

import durable_agents
from durable_agents import api
from durable_agents.exceptions import InvalidArgument, RunNotFound, SpawnRefused


@pytest.mark.parametrize("name", durable_agents.__all__)
def test_every_name_of_the_package_imports(name: str) -> None:
    assert getattr(durable_agents, name) is not None


def test_the_package_lists_the_operations_of_the_api() -> None:
    operations = {name for name in api.__all__ if inspect.isfunction(getattr(api, name))}
    assert operations <= set(durable_agents.__all__)
    for name in api.__all__:
        assert hasattr(api, name), name


# The operations without an async twin, and why (api's docstring says the same).
NO_TWIN = {"spawn_run", "made_transition"}  # tool code (a worker's thread); no database


def test_every_operation_has_its_async_twin() -> None:
    operations = [
        name
        for name in api.__all__
        if inspect.isfunction(getattr(api, name))
        and not inspect.iscoroutinefunction(getattr(api, name))
    ]
    assert "fork_run" in operations
    for name in operations:
        if name in NO_TWIN:
            continue
        twin = getattr(api, f"a{name}", None)
        assert twin is not None, f"{name} has no async twin a{name}"
        assert inspect.iscoroutinefunction(twin), f"a{name}"
        sync, asynchronous = inspect.signature(getattr(api, name)), inspect.signature(twin)
        assert list(sync.parameters) == list(asynchronous.parameters), name
        for parameter in sync.parameters.values():
            assert asynchronous.parameters[parameter.name].kind == parameter.kind, (
                name,
                parameter.name,
            )


# Each twin added with the keyword-only options, called once: it runs its sync operation with
# the same arguments (in Django's thread) and returns what it returned.
TWINS = [
    ("arequeue_run", "requeue_run", ("r",), {}),
    (
        "afork_run",
        "fork_run",
        ("r", 3),
        {"edit": "e", "version": "v", "model": "m", "user": "u"},
    ),
    ("aapprove_intent", "approve_intent", (1,), {"user": "u"}),
    ("areject_intent", "reject_intent", (1,), {"user": "u", "reason": "no"}),
    (
        "aresolve_intent",
        "resolve_intent",
        (1,),
        {"user": "u", "happened": True, "result": {"ok": 1}, "reason": "seen"},
    ),
    ("aset_key_budget", "set_key_budget", ("tenant:a", 5), {"user": "u"}),
    ("aset_key_limit", "set_key_limit", ("tenant:a", 2), {"user": "u"}),
    ("aanswer_question", "answer_question", ("r", "yes"), {"user": "u", "question_id": 4}),
    (
        "asend_message",
        "send_message",
        ("r", "also March"),
        {"policy": "reject", "key": "k", "user": "u"},
    ),
    ("aupgrade_runs", "upgrade_runs", ("a", "1", "2"), {"run_ids": ["r"], "user": "u"}),
    ("acarry_over_runs", "carry_over_runs", ("a", "1", "2"), {"run_ids": ["r"], "user": "u"}),
]


@pytest.mark.parametrize(("twin", "sync", "args", "kwargs"), TWINS, ids=[t[0] for t in TWINS])
def test_an_async_twin_runs_its_operation(
    monkeypatch: pytest.MonkeyPatch,
    twin: str,
    sync: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> None:
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def operation(*a: Any, **k: Any) -> str:
        calls.append((a, k))
        return "done"

    monkeypatch.setattr(api, sync, operation)
    assert asyncio.run(getattr(api, twin)(*args, **kwargs)) == (
        None if sync == "set_key_limit" else "done"
    )
    defaults = {
        name: p.default
        for name, p in inspect.signature(getattr(api, twin)).parameters.items()
        if p.default is not inspect.Parameter.empty and name not in kwargs
    }
    assert calls == [(args, {**defaults, **kwargs})]


def test_the_errors_of_the_api_say_what_is_wrong() -> None:
    with pytest.raises(InvalidArgument, match="a priority is between 0 and 100"):
        api.check_priority(101)
    with pytest.raises(ValueError, match="a run needs a non-empty task"):
        api.check_task(" ")
    with pytest.raises(InvalidArgument, match="debounce= collapses the starts of one key"):
        api.start_run("agent", "task", debounce=5)
    assert issubclass(RunNotFound, LookupError)
    assert issubclass(SpawnRefused, ValueError)


def test_run_context_is_exported_from_the_package() -> None:
    from durable_agents.declare.context import RunContext

    assert "RunContext" in durable_agents.__all__
    assert durable_agents.RunContext is RunContext


def test_retry_is_exported_from_the_package() -> None:
    from durable_agents.declare.retries import Retry

    assert "Retry" in durable_agents.__all__
    assert durable_agents.Retry is Retry
