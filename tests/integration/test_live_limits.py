"""Live streams under bad input and at scale: a reader that never reads, ten thousand readers
of one run, the async API, and the SSE view's edge cases through Django's real ASGI handler
(HEAD, an event id from the future, a token of a deleted run, a client that goes away)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.core.exceptions import PermissionDenied
from django.core.handlers.asgi import ASGIHandler
from django.db import connections

import durable_agents
from durable_agents import Agent, api, tool
from durable_agents.declare.agents import AgentNotFound
from durable_agents.live import ReaderDropped, progress, stream, stream_token
from durable_agents.live import events as live_events
from durable_agents.live import hub as live_hub
from durable_agents.live.events import Event
from durable_agents.live.hub import Hub
from durable_agents.models import AgentQuestion, AgentRun, RunStatus, short_id
from durable_agents.testing import plan
from tests.conftest import run_worker
from tests.integration.conftest import in_thread, live_agents_registered
from tests.integration.test_live import index_files, watcher

pytestmark = pytest.mark.django_db(transaction=True)

TASK = plan(
    ("index_files", {"count": 3}),
    ("index_files", {"count": 2}),
    ("index_files", {"count": 1}),
    task="Index.",
)


@tool(effect="pure")
def paced_step(n: int) -> str:
    """One step of a slow job: a few of the hub's polls pass between two of its calls, so a
    reader that reads is never given more than a handful of events at once."""
    progress(f"step {n}")
    time.sleep(live_hub.POLL_SECONDS * 3)
    return f"step {n} done"


pacer = Agent(
    name="live-pacer",
    version="v1",
    model="claude-test-1",
    system="You work slowly.",
    tools=[paced_step, index_files],
    max_tokens=1024,
)
PACED = plan(*[("paced_step", {"n": n}) for n in range(8)], task="Slowly.")


@pytest.fixture(autouse=True)
def registered() -> Iterator[None]:
    with live_agents_registered(watcher, pacer):
        yield


def step_seqs(events: list[Event]) -> list[int]:
    return [e.data["seq"] for e in events if e.type == "step"]


# -- a reader that never reads ---------------------------------------------------------------


@pytest.mark.postgres
def test_a_reader_that_never_reads_is_dropped_and_holds_up_nobody(
    fake_api: Any, monkeypatch: Any
) -> None:
    # Room for what one poll brings of this run (a step or two and a progress message), not
    # for all of it (8 turns: 17 steps, 8 messages, the statuses and the end).
    monkeypatch.setattr(live_hub, "QUEUE_SIZE", 8)
    run = durable_agents.start_run(pacer.name, PACED)
    worker = in_thread(run_worker)

    async def follow() -> tuple[list[Event], Any, Hub]:
        hub = Hub.current()
        stalled = stream(run.pk)
        first = await anext(stalled)  # joined, caught up; never read again until the end
        assert first.type == "step"
        seen: list[Event] = []
        async for event in stream(run.pk):
            seen.append(event)
            if event.type == "status" and event.data["status"] == "pending":
                worker.start()
        # The run is over and the healthy reader had all of it while the stalled one held
        # its place: the worker finished without waiting for it.
        await asyncio.to_thread(worker.join, 60)
        assert not worker.is_alive()
        return seen, stalled, hub

    async def main() -> tuple[list[Event], BaseException | None, Hub]:
        seen, stalled, hub = await follow()
        assert run.pk not in hub.watches  # the stalled reader is no longer followed
        error: BaseException | None = None
        try:
            async for _ in stalled:
                pass
        except ReaderDropped as exc:
            error = exc
        return seen, error, hub

    seen, error, hub = asyncio.run(asyncio.wait_for(main(), 90))
    assert isinstance(error, ReaderDropped)
    run.refresh_from_db()
    assert run.status == RunStatus.SUCCEEDED
    assert step_seqs(seen) == list(range(run.last_seq + 1))
    assert seen[-1].type == "end"
    assert hub.watches == {}


# -- ten thousand readers of one run ---------------------------------------------------------


@pytest.mark.postgres
def test_ten_thousand_readers_of_one_run_cost_one_poll_per_tick(
    fake_api: Any, monkeypatch: Any
) -> None:
    readers = 10_000
    calls = {"states": 0, "reads": 0, "joining": 0, "ticks": 0}
    counting = {"on": False}
    states, reads = live_hub._states, live_events.events_after_many
    poll_once = Hub._poll_once

    async def counted_ticks(hub: Hub) -> None:
        if counting["on"]:
            calls["ticks"] += 1
        await poll_once(hub)

    def counted_states(run_ids: list[uuid.UUID]) -> Any:
        if counting["on"]:
            calls["states"] += 1
        return states(run_ids)

    def counted_reads(cursors: Any) -> Any:
        calls["reads" if counting["on"] else "joining"] += 1
        return reads(cursors)

    monkeypatch.setattr(Hub, "_poll_once", counted_ticks)
    monkeypatch.setattr(live_hub, "_states", counted_states)
    monkeypatch.setattr(live_hub, "events_after_many", counted_reads)
    run = durable_agents.start_run(watcher.name, TASK)
    worker = in_thread(run_worker)

    async def one(ready: asyncio.Event) -> list[Event]:
        seen: list[Event] = []
        async for event in stream(run.pk):
            seen.append(event)
            if event.type == "status":
                ready.set()
        return seen

    async def main() -> tuple[list[list[Event]], int]:
        hub = Hub.current()
        readies = [asyncio.Event() for _ in range(readers)]
        tasks = [asyncio.ensure_future(one(ready)) for ready in readies]
        for ready in readies:
            await ready.wait()
        # Every reader has caught up; from here on only the hub's poll reads the database.
        assert hub.readers == readers
        counting["on"] = True
        worker.start()
        everything = await asyncio.gather(*tasks)
        counting["on"] = False
        await asyncio.to_thread(worker.join, 60)
        return everything, len(hub.watches)

    everything, left = asyncio.run(asyncio.wait_for(main(), 600))
    run.refresh_from_db()
    assert run.status == RunStatus.SUCCEEDED
    assert left == 0
    # Each tick of the hub's poll queries the watched runs once, and reads the run at most
    # once: however many readers, neither is done per reader.
    assert 1 <= calls["states"] <= calls["ticks"], calls
    assert 1 <= calls["reads"] <= calls["states"], calls
    # Ten thousand readers joining at once from the start share their catch-up reads: a
    # handful of reads, not one each.
    assert 1 <= calls["joining"] <= 10, calls
    expected = list(range(run.last_seq + 1))
    first = everything[0]
    assert step_seqs(first) == expected
    assert first[-1].type == "end"
    progress = [e.data["text"] for e in first if e.type == "progress"]
    assert len(progress) == 6
    for seen in everything:
        assert step_seqs(seen) == expected
        assert [e.data["text"] for e in seen if e.type == "progress"] == progress
        assert seen[-1].type == "end"
    # Memory: every reader holds the hub's one copy of each event it broadcast, never a copy
    # of its own (so the cost is the events once plus a reference per reader).
    broadcast = {id(e) for e in first if e.type == "step" and e.data["seq"] > 0}
    for seen in everything[1:]:
        assert {id(e) for e in seen if e.type == "step" and e.data["seq"] > 0} == broadcast


# -- the async API ---------------------------------------------------------------------------


def _run_async(coro: Any) -> Any:
    async def main() -> Any:
        try:
            return await coro
        finally:
            await sync_to_async(connections.close_all)()

    return asyncio.run(main())


def test_the_async_api_behaves_as_the_sync_one(fake_api: Any, django_user_model: Any) -> None:
    staff = django_user_model.objects.create_superuser("ops", "ops@example.com", "pw")

    async def scenario() -> dict[str, Any]:
        out: dict[str, Any] = {}
        with pytest.raises(AgentNotFound):
            await api.astart_run("no-such-agent", "Hello.")
        run = await api.astart_run(watcher.name, TASK, key="order-1")
        again = await api.astart_run(watcher.name, "Another task.", key="order-1")
        out["run"], out["again"] = run, again
        asked = await api.astart_run("waiter", '@ask_person {"question": "Which region?"}')
        out["asked"] = asked
        await sync_to_async(run_worker)()
        out["messages"] = await api.amessages_for(run.pk)
        with pytest.raises(PermissionDenied):
            await api.aanswer_question(asked.pk, "eu-west", user=None)
        with pytest.raises(ValueError, match="empty"):
            await api.aanswer_question(asked.pk, "  ", user=staff)
        with pytest.raises(AgentQuestion.DoesNotExist):
            await api.aanswer_question(run.pk, "eu-west", user=staff)
        answered = await api.aanswer_question(asked.pk, "eu-west", user=staff)
        out["answered"] = answered
        out["answered_again"] = await api.aanswer_question(asked.pk, "us-east", user=staff)
        with pytest.raises(ValueError, match="valid name"):
            await api.asend_event("", {"a": 1})
        with pytest.raises(ValueError, match="JSON"):
            await api.asend_event("refund:o-1", {"a": float("nan")})
        first = await api.asend_event("refund:o-1", {"a": 1})
        second = await api.asend_event("refund:o-1", {"a": 2})
        out["events"] = (first, second)
        pending = await api.astart_run(watcher.name, TASK)
        out["cancelled"] = await api.acancel_run(pending.pk)
        out["cancelled_again"] = await api.acancel_run(pending.pk)
        out["pending"] = pending
        return out

    out = _run_async(scenario())
    run = out["run"]
    assert out["again"].pk == run.pk  # the key made the start idempotent, as start_run does
    run.refresh_from_db()
    assert run.status == RunStatus.SUCCEEDED
    assert out["messages"] == api.messages_for(run.pk)
    assert out["messages"][0]["content"] == TASK
    assert out["answered"].answer == "eu-west"
    assert out["answered_again"].answer == "eu-west"  # answered once
    first, second = out["events"]
    assert second.pk == first.pk  # stored once
    assert second.payload == {"a": 1}
    assert (out["cancelled"], out["cancelled_again"]) == (True, False)
    assert AgentRun.objects.get(pk=out["pending"].pk).status == RunStatus.CANCELLED
    run_worker()
    assert AgentRun.objects.get(pk=out["asked"].pk).status == RunStatus.SUCCEEDED


# -- the SSE view through Django's ASGI handler ----------------------------------------------


class Exchange:
    """One request to Django's ASGI handler, as a server makes it; ``disconnect`` plays the
    client going away."""

    def __init__(self, method: str, path: str, query: str = "", headers: Any = ()) -> None:
        self.scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": method,
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": query.encode(),
            "root_path": "",
            "headers": [(b"host", b"testserver"), *headers],
            "client": ("127.0.0.1", 50000),
            "server": ("testserver", 80),
        }
        self.sent: list[Mapping[str, Any]] = []
        self.disconnect = asyncio.Event()
        self.body_given = False
        self.got_body = asyncio.Event()

    async def receive(self) -> dict[str, Any]:
        if not self.body_given:
            self.body_given = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await self.disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: Mapping[str, Any]) -> None:
        self.sent.append(message)
        if message["type"] == "http.response.body" and b"event: " in message.get("body", b""):
            self.got_body.set()

    async def __call__(self) -> None:
        await ASGIHandler()(self.scope, self.receive, self.send)

    @property
    def status(self) -> int:
        return int(self.sent[0]["status"])

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.sent[1:])

    @property
    def finished(self) -> bool:
        return bool(self.sent) and not self.sent[-1].get("more_body", False)


def events_url(run_id: Any) -> str:
    return f"/agents/runs/{run_id}/events"


def asgi(exchange: Exchange, then: Callable[[Exchange], Any] | None = None) -> Exchange:
    async def main() -> None:
        try:
            if then is None:
                await asyncio.wait_for(exchange(), 60)
            else:
                await then(exchange)
        finally:
            await sync_to_async(connections.close_all)()

    asyncio.run(main())
    return exchange


@pytest.mark.postgres
def test_head_answers_at_once_without_following_the_run() -> None:
    """A HEAD gets the headers of the stream and no body, at once, even for a run that is
    still going (under a server, a HEAD that followed the run would hold a reader for as long
    as the run lasts, for a body nobody reads)."""
    run = durable_agents.start_run(watcher.name, TASK)  # pending: its stream would not end
    token = stream_token(run.pk)
    exchange = asgi(Exchange("HEAD", events_url(run.pk), f"token={token}"))
    assert exchange.status == 200
    assert dict(exchange.sent[0]["headers"])[b"Content-Type"] == b"text/event-stream"
    assert exchange.finished
    assert exchange.body == b""
    # And a GET of the same run's stream does follow it.
    get = Exchange("GET", events_url(run.pk), f"token={token}")

    async def first_event_then_leave(exchange: Exchange) -> None:
        request = asyncio.ensure_future(exchange())
        await asyncio.wait_for(exchange.got_body.wait(), 30)
        exchange.disconnect.set()
        await asyncio.wait_for(request, 30)

    asgi(get, first_event_then_leave)
    assert get.status == 200
    assert b"event: step" in get.body


@pytest.mark.postgres
def test_an_event_id_from_the_future_does_not_cut_other_readers_off(fake_api: Any) -> None:
    """An id of the right shape far ahead of the run (made up, or kept from a database since
    restored from a backup): its reader is told what comes next, and a reader that joins after
    it misses nothing."""
    run = durable_agents.start_run(watcher.name, TASK)
    future = f"{short_id(run.pk)}:999999.999999999.r.0.0"
    worker = in_thread(run_worker)

    async def main() -> tuple[list[Event], list[Event]]:
        ahead: list[Event] = []
        joined = asyncio.Event()

        async def from_the_future() -> None:
            async for event in stream(run.pk, after=future):
                ahead.append(event)
                joined.set()

        first = asyncio.ensure_future(from_the_future())
        await joined.wait()  # the status: it is the run's first reader, caught up
        seen: list[Event] = []
        async for event in stream(run.pk):
            seen.append(event)
            if event.type == "status" and event.data["status"] == "pending":
                worker.start()
        await asyncio.wait_for(first, 60)
        await asyncio.to_thread(worker.join, 60)
        return ahead, seen

    ahead, seen = asyncio.run(asyncio.wait_for(main(), 90))
    run.refresh_from_db()
    assert run.status == RunStatus.SUCCEEDED
    assert step_seqs(seen) == list(range(run.last_seq + 1))
    assert seen[-1].type == "end"
    assert ahead[-1].type == "end"
    ids = [e.id for e in seen]
    assert len(set(ids)) == len(ids)

    # The view: a finished run's stream after such an id is its end, and it ends.
    token = stream_token(run.pk)
    exchange = asgi(
        Exchange(
            "GET",
            events_url(run.pk),
            f"token={token}",
            headers=[(b"last-event-id", future.encode())],
        )
    )
    assert exchange.status == 200
    assert exchange.finished
    assert b"event: end" in exchange.body
    assert b"event: step" not in exchange.body


def test_a_token_of_a_deleted_run_finds_nothing(fake_api: Any) -> None:
    run = durable_agents.start_run(watcher.name, TASK)
    token = stream_token(run.pk)
    AgentRun.objects.filter(pk=run.pk).delete()
    exchange = asgi(Exchange("GET", events_url(run.pk), f"token={token}"))
    assert exchange.status == 404
    assert exchange.finished
    other = durable_agents.start_run(watcher.name, TASK)
    refused = asgi(Exchange("GET", events_url(other.pk), f"token={token}"))
    assert refused.status == 403  # the token names the deleted run, not this one


@pytest.mark.postgres
def test_readers_that_go_away_mid_stream_leave_no_reader_and_no_watch(
    fake_api: Any, django_user_model: Any
) -> None:
    """Three readers of a run that goes on (pending, no worker), through Django's ASGI
    handler with a stream token; each client goes away mid-stream. Every wait is bounded:
    a request that never answers fails the test instead of holding up the suite."""
    run = durable_agents.start_run(watcher.name, TASK)
    token = stream_token(run.pk)
    exchanges = [Exchange("GET", events_url(run.pk), f"token={token}") for _ in range(3)]

    async def until(condition: Callable[[], bool], what: str) -> None:
        for _ in range(3000):  # 30 s
            if condition():
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"waited 30 s for {what}")

    async def main() -> tuple[int, int]:
        hub = Hub.current()
        requests = [asyncio.ensure_future(asyncio.wait_for(e(), 60)) for e in exchanges]
        try:
            for exchange in exchanges:
                await asyncio.wait_for(exchange.got_body.wait(), 30)
            # The last reader's catch-up may still be under way when its first event is sent.
            await until(lambda: hub.readers == len(exchanges), "every reader to join")
            watching = hub.readers
            for exchange in exchanges:
                exchange.disconnect.set()  # the client goes away mid-stream
            await asyncio.gather(*requests)
        finally:
            for request in requests:
                request.cancel()
        # The cancelled streams close on the loop's next turns.
        await until(lambda: not hub.watches and hub.readers == 0, "the readers and watch to go")
        return watching, len(hub.watches)

    result: list[tuple[int, int]] = []

    async def keep(_: Exchange) -> None:
        result.append(await main())

    asgi(exchanges[0], keep)
    watching, left = result[0]
    assert (watching, left) == (3, 0)
    for exchange in exchanges:
        assert exchange.status == 200
        assert b"event: step" in exchange.body
