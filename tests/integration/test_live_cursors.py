"""Live streams: where a reader's cursor may stand. A progress message never comes ahead of the
turn that made its call, and a made-up progress id of the first reader of a run does not make
the hub pass over the messages still to come for the readers after it."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

import durable_agents
from durable_agents import Agent, tool
from durable_agents.live import Event, progress, stream, stream_sync
from durable_agents.models import AgentProgress, AgentRun, short_id
from durable_agents.testing import plan
from tests.conftest import run_worker
from tests.integration.conftest import in_thread, live_agents_registered

pytestmark = pytest.mark.django_db(transaction=True)


@tool(effect="pure")
def count_up(count: int) -> str:
    """Count, telling whoever watches how far."""
    for done in range(1, count + 1):
        progress(f"counted {done} of {count}")
    return f"counted to {count}"


counter = Agent(
    name="live-cursor-counter",
    version="v1",
    model="claude-test-1",
    system="You count.",
    tools=[count_up],
    max_tokens=1024,
)
TASK = plan(("count_up", {"count": 3}), ("count_up", {"count": 2}), task="Count.")
# What a reader of a run of TASK is given, statuses aside (they may come coalesced).
EXPECTED = [
    ("step", 0),
    ("step", 1),
    ("progress", "counted 1 of 3"),
    ("progress", "counted 2 of 3"),
    ("progress", "counted 3 of 3"),
    ("step", 2),
    ("step", 3),
    ("progress", "counted 1 of 2"),
    ("progress", "counted 2 of 2"),
    ("step", 4),
    ("step", 5),
    ("end", "succeeded"),
]


@pytest.fixture(autouse=True)
def registered() -> Iterator[None]:
    with live_agents_registered(counter):
        yield


def brief(events: list[Event]) -> list[tuple[str, Any]]:
    """Each event but the statuses as (type, what tells it apart)."""
    out: list[tuple[str, Any]] = []
    for e in events:
        if e.type == "step":
            out.append(("step", e.data["seq"]))
        elif e.type == "progress":
            out.append(("progress", e.data["text"]))
        elif e.type == "end":
            out.append(("end", e.data["status"]))
    return out


def test_a_progress_message_never_comes_ahead_of_its_turn(fake_api: Any) -> None:
    """A read sees the run row, then the progress messages: a message committed in between,
    of a call whose turn the row did not have yet, waits for the read that gives the turn
    (seen with 2,000 readers of a run: the hub's slower polls gave a call's messages before
    the turn that made the call)."""
    run = durable_agents.start_run(counter.name, TASK)
    # As a worker leaves it between the two queries: turn 1 committed after the run row was
    # read (last_seq still 0 here), its call's message already there.
    AgentProgress.objects.create(run=run, seq=1, message="early")
    events = list(stream_sync(run.pk, max_seconds=0))
    assert brief(events) == [("step", 0)]
    # Once the row has the turn, the message comes (this test moved last_seq alone: the
    # turn's step is not in the log).
    AgentRun.objects.filter(pk=run.pk).update(last_seq=1)
    later = list(stream_sync(run.pk, after=events[-1].id, max_seconds=0))
    assert ("progress", "early") in brief(later)


def test_a_first_reader_with_a_progress_id_ahead_does_not_blind_the_others(
    fake_api: Any,
) -> None:
    run = durable_agents.start_run(counter.name, TASK)
    ahead = f"{short_id(run.pk)}:0.999999999..0.0"  # well formed, past any message there is

    worker = in_thread(run_worker)

    async def follow() -> tuple[list[Event], list[Event]]:
        first = stream(run.pk, after=ahead)
        first_seen = [await anext(first)]  # its catch-up: the status; the hub's watch starts
        seen: list[Event] = []
        async for event in stream(run.pk):
            seen.append(event)
            if event.type == "status" and not worker.is_alive() and len(seen) < 3:
                worker.start()
        first_seen += [event async for event in first]
        return first_seen, seen

    first_seen, seen = asyncio.run(asyncio.wait_for(follow(), 60))
    worker.join(30)
    assert brief(seen) == EXPECTED
    # The first reader goes on from the run's newest message: it gets those still to come.
    assert brief(first_seen) == EXPECTED[1:]
