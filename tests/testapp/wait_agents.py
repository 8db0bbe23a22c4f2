"""Agents and tools for the long-running runs: timers, events, child runs,
questions. Every tool records what it was called with in the receiver's log (``attempts``), so
a test sees each invocation: its idempotency key and the ``woken_by`` it got."""

from __future__ import annotations

import datetime
from typing import Any

from durable_agents import Agent, Wait, ask_person, callback_url, spawn_run, tool
from tests.testapp import receiver
from tests.testapp.agents import lookup


@tool(effect="pure")
def nap(seconds: float, *, woken_by: dict | None = None) -> Any:
    """Wait on a durable timer of ``seconds``."""
    receiver.log_call("nap", None, woken_by)
    if woken_by is None:
        raise Wait(seconds=seconds)
    return woken_by


@tool(effect="pure")
def nap_until(at: str, *, woken_by: dict | None = None) -> Any:
    """Wait on a durable timer until the ISO 8601 time ``at``."""
    receiver.log_call("nap_until", None, woken_by)
    if woken_by is None:
        raise Wait(until=datetime.datetime.fromisoformat(at))
    return woken_by


@tool(effect="non_idempotent")
def await_event(
    name: str,
    timeout: float | None = None,
    *,
    idempotency_key: str,
    woken_by: dict | None = None,
) -> Any:
    """Ask a provider for something, then wait for its event (or the timeout)."""
    receiver.log_call("await_event", idempotency_key, woken_by)
    if woken_by is None:
        receiver.deliver("request", idempotency_key, {"event": name})  # the side effect
        receiver.touch("await-event-raising")
        # A test may hold the park back here (the marker below), to kill the worker between
        # the Wait and the commit of the park.
        receiver.pause(float(receiver.env("DA_WAIT_PAUSE", "0")), until="wait-release")
        raise Wait(event=name, timeout=timeout)
    return woken_by


@tool(effect="non_idempotent")
def await_callback(
    timeout: float | None = None,
    answer_first: Any = None,
    again: bool = False,
    patient: bool = False,
    *,
    idempotency_key: str,
    woken_by: dict | None = None,
) -> Any:
    """Ask a service for something, handing it this call's callback URL, then wait for the
    service's POST (or the timeout). ``answer_first``: the service answers at once, before the
    wait is raised. ``again``: wait for a second callback once woken by the first.
    ``patient``: wait again after a timeout."""
    receiver.log_call("await_callback", idempotency_key, woken_by)
    if (
        woken_by is None
        or (again and "callback" in woken_by)
        or (patient and woken_by == {"timeout": True})
    ):
        url = callback_url()
        # The side effect: the service is given the URL (twice: the URL is the call's own).
        receiver.deliver("callback_url", idempotency_key, {"url": url, "again": callback_url()})
        if answer_first is not None:
            from django.test import Client

            Client().post(url, answer_first, content_type="application/json")
        raise Wait(callback=True, timeout=timeout)
    return woken_by


@tool(effect="idempotent")
def fan_out(
    topics: list[str],
    timeout: float | None = None,
    *,
    idempotency_key: str,
    woken_by: dict | None = None,
) -> Any:
    """Start one child run per topic and wait for them all."""
    receiver.log_call("fan_out", idempotency_key, woken_by)
    if woken_by is None:
        children = [
            spawn_run("waiter_child", f"Research {topic}", key=f"{idempotency_key}:{i}")
            for i, topic in enumerate(topics)
        ]
        raise Wait(runs=[child.id for child in children], timeout=timeout)
    return woken_by


@tool(effect="idempotent")
def spawn_only(task: str, *, idempotency_key: str) -> str:
    """Start one child run and do not wait for it."""
    child = spawn_run("waiter_child", task, key=idempotency_key)
    again = spawn_run("waiter_child", task, key=idempotency_key)
    assert again.id == child.id
    return str(child.id)


@tool(effect="pure")
def wait_on_run(run_id: str) -> Any:
    """Wait on any run (only children are allowed)."""
    raise Wait(runs=[run_id])


@tool(effect="pure")
def bad_wait() -> Any:
    """Raise an invalid Wait."""
    raise Wait(seconds=-1)


@tool(effect="irreversible")
def wait_irreversibly(*, idempotency_key: str) -> Any:
    """An irreversible tool that tries to wait."""
    raise Wait(seconds=1)


@tool(effect="pure")
def spawn_outside() -> str:
    """Spawn a child deeper than allowed (the child spawns again)."""
    return str(spawn_run("waiter", "@spawn_outside {}", key="deeper").id)


WAIT_TOOLS = [
    nap,
    nap_until,
    await_event,
    await_callback,
    fan_out,
    spawn_only,
    wait_on_run,
    bad_wait,
    wait_irreversibly,
    spawn_outside,
    ask_person,
    lookup,
]

waiter = Agent(
    name="waiter",
    version="v1",
    model="claude-test-1",
    system="You wait for things.",
    tools=WAIT_TOOLS,
    max_tokens=1024,
)

waiter_child = Agent(
    name="waiter_child",
    version="v1",
    model="claude-test-1",
    system="You research one topic.",
    tools=[lookup, nap],
    max_tokens=1024,
)
