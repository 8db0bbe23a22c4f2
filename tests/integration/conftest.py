"""What the integration tests (a real database, in-process workers) share besides
tests/conftest.py: the ``spy`` and ``unpooled`` fixtures, and helpers to import like
``from tests.integration.conftest import call_at_once``."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest
from django.db import connection, connections

import durable_agents
from durable_agents import api
from durable_agents.admin.run_actions import RunActions
from durable_agents.declare.agents import Agent, registry
from durable_agents.engine.history import Conversation, step_message
from durable_agents.live import publish as live_publish
from durable_agents.live.hub import Hub
from durable_agents.models import AgentRun, AgentStep, IntentStatus, RunStatus, StepKind, ToolIntent
from durable_agents.offline import BatchDesk

T = TypeVar("T")


@pytest.fixture(autouse=True)
def _content_types_cached(request: pytest.FixtureRequest) -> None:
    """An admin page looks its models' content types up once per process, then in a cache:
    the first page a process serves runs a query more. The tests that count a page's queries
    would count it or not depending on the order pytest-xdist dealt the tests in; with the
    cache filled before each admin test, every count is the page's own."""
    if "admin_client" not in request.fixturenames:
        return
    from django.apps import apps
    from django.contrib.contenttypes.models import ContentType

    request.getfixturevalue("admin_client")  # the test database is set up by then
    ContentType.objects.get_for_models(*apps.get_models())


@contextlib.contextmanager
def agents_registered(*agents: Agent) -> Iterator[None]:
    """The module's ``agents`` in the registry for the ``with`` block (in an autouse fixture:
    for one test), unregistered at its end."""
    for agent in agents:
        registry.register(agent)
    yield
    for agent in reversed(agents):
        registry.unregister(agent.name, agent.version)


@contextlib.contextmanager
def live_agents_registered(*agents: Agent) -> Iterator[None]:
    """``agents_registered`` for the tests of the live streams: at the end of the block the
    agents are unregistered, then every hub is closed and the delta publisher stopped."""
    with agents_registered(*agents):
        yield
    Hub.close_all()
    live_publish.stop()


def in_thread(fn: Callable[[], Any]) -> threading.Thread:
    """A daemon thread (not started yet) that calls ``fn`` (a worker beside the readers, say)
    and then closes the connections it opened."""

    def target() -> None:
        try:
            fn()
        finally:
            connections.close_all()

    return threading.Thread(target=target, daemon=True)


def call_at_once(
    call: Callable[[int], T],
    callers: int,
    *,
    at_once: int | None = None,
    join_seconds: float = 60,
) -> tuple[list[T], list[BaseException]]:
    """``call(0)`` to ``call(callers - 1)``, each on a thread of its own, released together (a
    barrier); with ``at_once``, at most that many call at a time (each holds a database
    connection, which it closes when done). Returns what the calls returned, in the order they
    returned, and what the threads raised; each thread is joined for ``join_seconds``."""
    barrier = threading.Barrier(callers)
    slots = threading.BoundedSemaphore(at_once or callers)
    got: list[T] = []
    errors: list[BaseException] = []

    def caller(i: int) -> None:
        try:
            barrier.wait(timeout=30)
            with slots:
                try:
                    got.append(call(i))
                finally:
                    connections.close_all()
        except BaseException as exc:  # noqa: BLE001 - every failure of a thread is reported
            errors.append(exc)

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(callers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(join_seconds)
    return got, errors


@pytest.fixture
def unpooled() -> Iterator[None]:
    """A connection per thread, not a worker's pool: an in-process ``runagents`` earlier in the
    session (its command tests) turns that pool on for the whole process."""
    options = connections.settings["default"].get("OPTIONS", {})
    pool = options.pop("pool", None)
    if pool is not None:
        connection.close()
    yield
    if pool is not None:
        connection.close()
        options["pool"] = pool


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> Callable[..., list[tuple[Any, ...]]]:
    """Record the calls the admin makes to one api function (and still make them):
    ``calls = spy("cancel_run")`` is the list of their positional arguments, and with
    ``keywords=True`` each entry ends with the dict of their keyword arguments. The runs'
    actions (RunActions.RUN_OPERATIONS) hold the api function itself: they call the spy too."""

    def watch(name: str, *, keywords: bool = False) -> list[tuple[Any, ...]]:
        calls: list[tuple[Any, ...]] = []
        real = getattr(api, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls.append((*args, kwargs) if keywords else args)
            return real(*args, **kwargs)

        monkeypatch.setattr(api, name, wrapper)
        for key, operation in RunActions.RUN_OPERATIONS.items():
            if operation.function is real:
                replaced = dataclasses.replace(operation, function=wrapper)
                monkeypatch.setitem(RunActions.RUN_OPERATIONS, key, replaced)
        return calls

    return watch


def written_intent(
    task: str,
    tool: str,
    tool_input: dict[str, Any],
    *,
    says: str,
    status: str = IntentStatus.PENDING,
) -> ToolIntent:
    """A run of the agent "tester" waiting on an intent of ``status`` for one call of ``tool``
    with ``tool_input``, written directly (no worker): ``start_run(task)``, then a model turn
    that ``says`` something and asks for the call, the run parked, and the intent."""
    run = durable_agents.start_run("tester", task)
    turn = {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "claude-test-1",
        "content": [
            {"type": "text", "text": says},
            {"type": "tool_use", "id": "toolu_1", "name": tool, "input": tool_input},
        ],
        "stop_reason": "tool_use",
        "usage": {"input_tokens": 10, "output_tokens": 5},
    }
    AgentStep.objects.create(
        run=run, seq=1, kind=StepKind.MODEL_TURN, payload=json.dumps(turn), request_id="req_1"
    )
    AgentRun.objects.filter(pk=run.pk).update(status=RunStatus.WAITING, last_seq=1)
    return ToolIntent.objects.create(  # type: ignore[misc]  # a JSONTextField takes any JSON value; the stubs say str
        run=run,
        seq=1,
        call_index=0,
        tool=tool,
        input=tool_input,
        key=uuid.uuid4().hex,
        status=status,
    )


def conversation_of(steps: list[AgentStep]) -> Conversation:
    """The conversation that ``steps`` (a run's log, in seq order) make."""
    conversation = Conversation()
    for step in steps:
        conversation.append(step_message(step.kind, step.payload, step.content_span))
    return conversation


@pytest.fixture
def desk() -> Iterator[BatchDesk]:
    """The offline model's Message Batches (the process-wide desk), fresh for the test, with
    the offline model in use: runs in batches are driven to their end at once."""
    from durable_agents.offline import shared_batch_desk
    from durable_agents.testing import offline_model

    desk = shared_batch_desk()
    desk.reset()
    with offline_model():
        yield desk
    desk.reset()
