"""Live streams of runs: the events of ``stream`` / ``stream_sync``, their ids and resuming,
``progress`` from tool code, stream tokens, and ``runs/<id>/events`` through the real test
clients (WSGI: polling; ASGI: the hub), with runs driven by real in-process workers."""

from __future__ import annotations

import asyncio
import functools
import json
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.contrib.auth.models import Permission
from django.db import connections
from django.http import StreamingHttpResponse
from django.test import AsyncClient, Client, override_settings

import durable_agents
from durable_agents import Agent, tool
from durable_agents.live import (
    STREAM_COOKIE,
    BadEventId,
    Event,
    progress,
    stream,
    stream_sync,
    stream_token,
    token_run,
)
from durable_agents.live.hub import Hub
from durable_agents.models import AgentProgress, AgentRun, RunStatus
from durable_agents.testing import plan
from tests.conftest import run_worker, wait_for
from tests.integration.conftest import in_thread, live_agents_registered

pytestmark = pytest.mark.django_db(transaction=True)

GATE = threading.Event()  # the tool ``slow_index`` waits for it, to hold a run mid-call


@tool(effect="pure")
def index_files(count: int) -> str:
    """Index some files, telling whoever watches how it goes."""
    for done in range(1, count + 1):
        progress(f"indexed {done} of {count} files")
    return f"{count} files indexed"


@tool(effect="pure")
def slow_index(count: int) -> str:
    """Index files, slowly."""
    progress(f"starting on {count} files")
    GATE.wait(30)
    return "done"


@tool(effect="pure")
def shout(text: str) -> str:
    """Say something hostile."""
    progress(text)
    return text


watcher = Agent(
    name="live-watcher",
    version="v1",
    model="claude-test-1",
    system="You index files.",
    tools=[index_files, slow_index, shout],
    max_tokens=1024,
)
TASK = plan(("index_files", {"count": 3}), ("index_files", {"count": 1}), task="Index.")


@pytest.fixture(autouse=True)
def registered() -> Iterator[None]:
    with live_agents_registered(watcher):
        GATE.clear()
        yield
        GATE.set()


def finished(task: str = TASK) -> AgentRun:
    run = durable_agents.start_run(watcher.name, task)
    run_worker()
    run.refresh_from_db()
    assert run.status == RunStatus.SUCCEEDED, run.error
    return run


def brief(events: list[Event]) -> list[tuple[str, Any]]:
    """Each event as (type, what tells it apart)."""
    out: list[tuple[str, Any]] = []
    for e in events:
        key = {
            "step": e.data.get("seq"),
            "progress": e.data.get("text"),
            "status": e.data.get("status"),
            "end": e.data.get("status"),
            "delta": (e.data.get("seq"), e.data.get("n")),
        }[e.type]
        out.append((e.type, key))
    return out


def test_a_finished_run_streams_what_happened_in_order_and_ends(fake_api: Any) -> None:
    run = finished()
    events = list(stream_sync(run.pk))
    assert brief(events) == [
        ("step", 0),
        ("step", 1),
        ("progress", "indexed 1 of 3 files"),
        ("progress", "indexed 2 of 3 files"),
        ("progress", "indexed 3 of 3 files"),
        ("step", 2),
        ("step", 3),
        ("progress", "indexed 1 of 1 files"),
        ("step", 4),
        ("step", 5),
        ("status", "succeeded"),
        ("end", "succeeded"),
    ]
    assert events[0].data == {"seq": 0, "kind": "task", "content": TASK}
    assert events[2].data["seq"] == 1  # the turn whose call said it
    assert events[-2].data["result"] == run.result
    assert events[5].data["content"][0]["content"] == "3 files indexed"
    # Progress is kept with the run.
    assert AgentProgress.objects.filter(run=run).count() == 4


def test_resuming_after_any_id_misses_nothing_and_repeats_nothing(fake_api: Any) -> None:
    run = finished()
    events = list(stream_sync(run.pk))
    ids = [e.id for e in events]
    assert len(set(ids)) == len(ids)
    for position, event in enumerate(events[:-1]):
        rest = list(stream_sync(run.pk, after=event.id))
        # The status event comes once the reader is caught up, so compare without it.
        expected = [e for e in events[position + 1 :] if e.type != "status"]
        assert [x for x in brief(rest) if x[0] != "status"] == brief(expected)
        expected_end = [("end", "succeeded")]
        if event.type != "status":  # the status is given once the reader has caught up
            expected_end.insert(0, ("status", "succeeded"))
        assert brief(rest)[-len(expected_end) :] == expected_end
    assert list(stream_sync(run.pk, after=events[-1].id)) == []


@pytest.mark.parametrize(
    "after",
    ["nonsense", "1.2.3", "0000000g:1.0.s.0.0", "deadbeef:1.0.s.0.0", "x" * 5000, "ab:1.0.q.0.0"],
)
def test_an_event_id_that_is_not_one_of_this_runs_is_refused(fake_api: Any, after: str) -> None:
    run = finished()
    with pytest.raises(BadEventId):
        list(stream_sync(run.pk, after=after))


def test_bad_run_ids(fake_api: Any) -> None:
    with pytest.raises(ValueError, match="not a run id"):
        list(stream_sync("not-a-run"))
    with pytest.raises(LookupError):
        list(stream_sync(uuid.uuid4()))


def test_progress_outside_tool_code_and_hostile_messages(fake_api: Any, monkeypatch: Any) -> None:
    with pytest.raises(RuntimeError, match="tool code"):
        progress("hello")
    hostile = "\x1b[2J<script>alert(1)</script>\u202e\x00 " + "x" * 5000
    run = finished(plan(("shout", {"text": hostile}), task="Shout."))
    [note] = AgentProgress.objects.filter(run=run)
    assert "\x00" not in note.message
    assert len(note.message) < 2100  # cut, with a note of the length
    monkeypatch.setattr("durable_agents.live.MAX_PROGRESS_PER_RUN", 2)
    run = finished()
    assert AgentProgress.objects.filter(run=run).count() == 2


def test_stream_tokens() -> None:
    run_id = uuid.uuid4()
    token = stream_token(run_id)
    assert token_run(token) == run_id
    assert token_run(token + "x") is None
    assert token_run("forged:token") is None
    assert token_run(token, max_age=-1) is None  # expired
    assert str(run_id) in token  # it names the run, nothing else


# -- the SSE view --------------------------------------------------------------------------


def body_of(response: Any) -> bytes:
    """The whole body of a streaming response (a finished run's stream ends)."""
    assert isinstance(response, StreamingHttpResponse)
    return b"".join(response)


def streamed(response: Any) -> Any:
    assert isinstance(response, StreamingHttpResponse)
    return response.streaming_content


def sse_events(body: bytes) -> list[dict[str, Any]]:
    out = []
    for block in body.decode().split("\n\n"):
        fields = dict(
            line.split(": ", 1) for line in block.splitlines() if line and not line.startswith(":")
        )
        if "event" in fields:
            out.append(
                {"id": fields["id"], "event": fields["event"], "data": json.loads(fields["data"])}
            )
    return out


@pytest.fixture
def viewer(django_user_model: Any) -> Any:
    user = django_user_model.objects.create_user("viewer", password="x", is_staff=True)
    user.user_permissions.add(Permission.objects.get(codename="view_agentrun"))
    return user


def test_the_view_under_wsgi(fake_api: Any, viewer: Any, django_user_model: Any) -> None:
    run = finished()
    url = f"/agents/runs/{run.pk}/events"
    client = Client()
    assert client.get(url).status_code == 403  # anonymous
    clerk = django_user_model.objects.create_user("clerk", password="x", is_staff=True)
    client.force_login(clerk)
    assert client.get(url).status_code == 403  # staff without the view permission
    client.force_login(viewer)
    response = client.get(url)
    assert response.status_code == 200
    assert response["Content-Type"] == "text/event-stream"
    assert response["Cache-Control"] == "no-store, private, no-transform"
    events = sse_events(body_of(response))
    assert [e["event"] for e in events][-2:] == ["status", "end"]
    assert events == [
        {"id": e.id, "event": e.type, "data": json.loads(json.dumps(e.data))}
        for e in stream_sync(run.pk)
    ]
    # Last-Event-ID resumes.
    resumed = client.get(url, HTTP_LAST_EVENT_ID=events[3]["id"])
    rest = sse_events(body_of(resumed))
    assert rest[0]["id"] == events[4]["id"]
    assert client.get(url, HTTP_LAST_EVENT_ID="garbage").status_code == 400
    other = finished()
    other_id = next(iter(stream_sync(other.pk))).id
    assert client.get(url, HTTP_LAST_EVENT_ID=other_id).status_code == 400
    assert client.get(f"/agents/runs/{uuid.uuid4()}/events").status_code == 404
    assert client.get("/agents/runs/not-a-uuid/events").status_code == 404
    assert client.post(url).status_code == 405


def test_a_token_opens_one_run_to_anyone(fake_api: Any) -> None:
    run, other = finished(), finished()
    client = Client()
    token = stream_token(run.pk)
    ok = client.get(f"/agents/runs/{run.pk}/events", {"token": token})
    assert ok.status_code == 200
    assert sse_events(body_of(ok))[-1]["event"] == "end"
    assert client.get(f"/agents/runs/{other.pk}/events", {"token": token}).status_code == 403
    assert client.get(f"/agents/runs/{run.pk}/events", {"token": token[:-2]}).status_code == 403
    with override_settings(DURABLE_AGENTS={"LIVE_TOKEN_SECONDS": -1}):
        expired = client.get(f"/agents/runs/{run.pk}/events", {"token": token})
    assert expired.status_code == 403


def test_the_view_under_asgi_and_hostile_text_is_escaped(fake_api: Any, viewer: Any) -> None:
    hostile = "\x1b[2J</script><script>alert(1)</script>\u202e"
    run = finished(plan(("shout", {"text": hostile}), task="Shout."))
    client = AsyncClient()

    async def read() -> tuple[int, bytes]:
        await sync_to_async(client.force_login)(viewer)
        response = await client.get(f"/agents/runs/{run.pk}/events")
        body = b"".join([chunk async for chunk in streamed(response)])
        await sync_to_async(connections.close_all)()  # the connection of Django's thread
        return response.status_code, body

    status, body = asyncio.run(read())
    assert status == 200
    assert body.isascii()
    assert b"<" not in body  # JSON escapes: the text arrives whole, never as markup
    assert b"\x1b" not in body
    events = sse_events(body)
    assert [e["event"] for e in events][-1] == "end"
    [note] = [e for e in events if e["event"] == "progress"]
    assert note["data"]["text"] == hostile


# -- following a live run (the hub) ----------------------------------------------------------


def test_the_hub_follows_a_live_run_to_its_end(fake_api: Any) -> None:
    run = durable_agents.start_run(
        watcher.name,
        plan(("slow_index", {"count": 2}), ("index_files", {"count": 1}), task="Slowly."),
    )

    worker = in_thread(run_worker)

    async def follow() -> list[Event]:
        seen: list[Event] = []
        async for event in stream(run.pk):
            seen.append(event)
            if event.type == "status" and event.data["status"] == "pending":
                worker.start()
            if event.type == "progress" and event.data["text"] == "starting on 2 files":
                GATE.set()  # the reader saw the call at work: let it finish
        return seen

    events = asyncio.run(asyncio.wait_for(follow(), 60))
    worker.join(30)
    without_status = [x for x in brief(events) if x[0] != "status"]
    assert without_status == [
        ("step", 0),
        ("step", 1),
        ("progress", "starting on 2 files"),
        ("step", 2),
        ("step", 3),
        ("progress", "indexed 1 of 1 files"),
        ("step", 4),
        ("step", 5),
        ("end", "succeeded"),
    ]
    statuses = [e.data["status"] for e in events if e.type == "status"]
    assert statuses[0] == "pending"
    assert statuses[-1] == "succeeded"
    assert set(statuses) <= {"pending", "running", "succeeded"}
    assert "running" in statuses  # it ran for as long as the reader took to see its progress
    ids = [e.id for e in events]
    assert len(set(ids)) == len(ids)


# -- text deltas of streamed turns (PostgreSQL: NOTIFY) ------------------------------------


def _follow_with_worker(run: AgentRun, start: Any) -> list[Event]:
    async def follow() -> list[Event]:
        seen: list[Event] = []
        async for event in stream(run.pk):
            seen.append(event)
            if event.type == "status" and event.data["status"] == "pending" and len(seen) < 3:
                start()
        return seen

    return asyncio.run(asyncio.wait_for(follow(), 60))


@pytest.mark.postgres
def test_a_streamed_turn_reaches_readers_while_it_comes(fake_api: Any) -> None:
    run = durable_agents.start_run(
        "streamer", 'Stream.\n@@chunk_latency 0.05\n@lookup {"key": "a"}'
    )

    worker = in_thread(run_worker)
    events = _follow_with_worker(run, worker.start)
    worker.join(30)
    assert events[-1].type == "end"
    for seq in (1, 3):
        deltas = [e for e in events if e.type == "delta" and e.data["seq"] == seq]
        step = next(e for e in events if e.type == "step" and e.data["seq"] == seq)
        assert deltas, f"no text of turn {seq} before its step"
        assert all(events.index(d) < events.index(step) for d in deltas)
        assert [d.data["n"] for d in deltas] == list(range(len(deltas)))
        assert {d.data["attempt"] for d in deltas} == {1}
        text = next(b["text"] for b in step.data["content"] if b["type"] == "text")
        assert "".join(d.data["text"] for d in deltas) == text
    ids = [e.id for e in events]
    assert len(set(ids)) == len(ids)


@pytest.mark.postgres
def test_the_text_of_a_cut_attempt_is_superseded(fake_api: Any) -> None:
    """Attempt 1's text of turn 1 (its worker died mid-turn), then attempt 2's from n=0, then
    the committed step: a reader sees each attempt's text start over, and the step last."""
    from durable_agents.live.publish import DeltaPublisher

    run = durable_agents.start_run(watcher.name, "Say hello.")
    publisher = DeltaPublisher()

    async def follow() -> list[Event]:
        seen: list[Event] = []
        sent = False
        async for event in stream(run.pk):
            seen.append(event)
            if not sent and event.type == "status":
                sent = True
                listening = Hub.current().listening
                assert await asyncio.to_thread(listening.wait, 30)
                # The worker's side, on a thread of its own while this reader reads on.
                worker_side.append(
                    threading.Thread(target=_cut_then_commit, args=(publisher, run, seen))
                )
                worker_side[0].start()
        return seen

    worker_side: list[threading.Thread] = []
    events = asyncio.run(asyncio.wait_for(follow(), 60))
    for thread in worker_side:
        thread.join(30)  # its worker stops (and removes its row) before the teardown
    deltas = [(e.data["attempt"], e.data["n"], e.data["text"]) for e in events if e.type == "delta"]
    assert deltas == [(1, 0, "Hel"), (1, 1, "lo, w"), (2, 0, "Hello"), (2, 1, ", world")]
    types = [e.type for e in events]
    assert types.index("step", 1) > max(i for i, t in enumerate(types) if t == "delta")
    assert events[-1].type == "end"


def _cut_then_commit(publisher: Any, run: AgentRun, seen: list[Event]) -> None:
    """Publish each chunk once the reader has been given the one before (so that each is a
    delta of its own, whatever the machine's speed), then commit the turn."""

    def given(attempt: int, n: int) -> bool:
        return any(
            e.type == "delta" and (e.data["attempt"], e.data["n"]) == (attempt, n)
            for e in list(seen)
        )

    try:
        for attempt, parts in ((1, ["Hel", "lo, w"]), (2, ["Hello", ", world"])):
            for n, part in enumerate(parts):
                publisher.publish((run.pk, 1, attempt), part)
                wait_for(functools.partial(given, attempt, n), timeout=30)
        run_worker()
    finally:
        publisher._close()
        connections.close_all()


@pytest.mark.postgres
def test_a_reader_that_joins_mid_turn_gets_the_text_so_far_once(fake_api: Any) -> None:
    """A reader busy with its catch-up while both attempts send text: it is given the text of
    the attempt in flight, whole and once, never the cut attempt's after it."""
    from durable_agents.live.publish import DeltaPublisher

    run = durable_agents.start_run(watcher.name, "Say hello.")
    publisher = DeltaPublisher()

    def send_both() -> None:
        for attempt, parts in ((1, ["Hel", "lo, w"]), (2, ["Hello", ", world"])):
            for part in parts:
                publisher.publish((run.pk, 1, attempt), part)
        publisher._close()

    async def follow() -> list[Event]:
        seen: list[Event] = []
        hub = Hub.current()
        async for event in stream(run.pk):
            seen.append(event)
            if len(seen) == 1:  # the task; the status comes next, from the same catch-up
                assert await asyncio.to_thread(hub.listening.wait, 30)
                # Held here (not reading) while both attempts send their text.
                await asyncio.to_thread(send_both)
                turn = hub.watches[run.pk].turn
                for _ in range(100):  # the notifications reach the hub
                    if turn is not None and len(turn.chunks) == 2 and turn.attempt == 2:
                        break
                    await asyncio.sleep(0.05)
                    turn = hub.watches[run.pk].turn
            if event.type == "delta" and event.data["n"] == 1:
                committer.start()
        return seen

    committer = threading.Thread(target=_commit, args=(run,))
    events = asyncio.run(asyncio.wait_for(follow(), 60))
    committer.join(30)  # its worker stops (and removes its row) before the teardown
    deltas = [(e.data["attempt"], e.data["n"], e.data["text"]) for e in events if e.type == "delta"]
    assert deltas == [(2, 0, "Hello"), (2, 1, ", world")]
    assert [e.data["seq"] for e in events if e.type == "step"] == [0, 1]
    assert events[-1].type == "end"
    ids = [e.id for e in events]
    assert len(set(ids)) == len(ids)


def _commit(run: AgentRun) -> None:
    try:
        run_worker()
    finally:
        connections.close_all()


def test_the_hub_of_a_loop_that_ended_stops(fake_api: Any) -> None:
    run = finished()

    async def read() -> tuple[list[Event], Hub]:
        return [e async for e in stream(run.pk)], Hub.current()

    events, first = asyncio.run(read())
    again, second = asyncio.run(read())
    assert [e.id for e in again] == [e.id for e in events]
    assert first is not second
    assert first.stopping.is_set()  # its thread and connections went with its loop
    assert not second.stopping.is_set()


def test_a_forks_stream_starts_with_the_steps_it_shares(fake_api: Any) -> None:
    run = finished()
    fork = durable_agents.fork_run(run.pk, at_seq=2)
    # The fork is pending: one read of what is there (max_seconds=0), not a follow.
    before = [e for e in stream_sync(fork.pk, max_seconds=0) if e.type == "step"]
    assert [e.data for e in before] == [e.data for e in stream_sync(run.pk) if e.type == "step"][:3]
    run_worker()
    after = [e.data["seq"] for e in stream_sync(fork.pk) if e.type == "step"]
    assert after == [0, 1, 2, 3, 4, 5]


def test_the_admin_page_of_an_active_run_follows_it_and_a_finished_one_does_not(
    fake_api: Any, admin_client: Any
) -> None:
    active = durable_agents.start_run(watcher.name, TASK)
    page = admin_client.get(f"/admin/durable_agents/agentrun/{active.pk}/change/")
    html = page.content.decode()
    assert 'id="run-live"' in html
    assert "durable_agents/live.js" in html
    url = html.split('data-live-events="', 1)[1].split('"', 1)[0].replace("&amp;", "&")
    # The box starts after what the page shows: the task and the status are on the page.
    events = list(stream_sync(active.pk, after=url.split("after=", 1)[1], max_seconds=0))
    assert events == []
    run_worker()
    after = list(stream_sync(active.pk, after=url.split("after=", 1)[1]))
    assert [e.data["seq"] for e in after if e.type == "step"] == [1, 2, 3, 4, 5]
    assert admin_client.get(url).status_code == 200
    finished_page = admin_client.get(f"/admin/durable_agents/agentrun/{active.pk}/change/")
    assert 'id="run-live"' not in finished_page.content.decode()


def test_the_demo_page_gives_a_token_only_for_the_sessions_own_runs(fake_api: Any) -> None:
    from django.test import Client as BrowserClient

    mine = BrowserClient(enforce_csrf_checks=True)
    page = mine.get("/demo/live/")
    assert mine.post("/demo/live/").status_code == 403  # no CSRF token: nothing started
    assert not AgentRun.objects.exists()
    token = page.cookies["csrftoken"].value
    started = mine.post("/demo/live/", {"csrfmiddlewaretoken": token})
    assert started.status_code == 302
    run = AgentRun.objects.get()
    page = mine.get(started["Location"])
    shown = page.content.decode()
    events = shown.split('data-live-events="', 1)[1].split('"', 1)[0]
    # The token is in a cookie only the run's events URL gets, not in the URL (nor the page).
    assert events == f"/agents/runs/{run.pk}/events"
    assert "token=" not in shown
    cookie = page.cookies[STREAM_COOKIE]
    assert token_run(cookie.value) == run.pk
    assert cookie["path"] == events
    assert cookie["httponly"] is True
    assert cookie["samesite"] == "Strict"
    assert not cookie["secure"]  # plain HTTP here; set_stream_cookie's own test covers HTTPS
    # The test client sends the cookie as a browser would (the run is pending: the stream
    # would go on, so it is closed once its status is known).
    streaming = mine.get(events)
    streaming.close()
    assert streaming.status_code == 200
    # Another visitor who knows the id gets no page, so no token.
    assert BrowserClient().get(started["Location"]).status_code == 404


def _demo_page_of_a_started_run(client: Any) -> tuple[AgentRun, str]:
    page = client.get("/demo/live/")
    started = client.post("/demo/live/", {"csrfmiddlewaretoken": page.cookies["csrftoken"].value})
    assert started.status_code == 302
    return AgentRun.objects.get(), started["Location"]


def test_the_demo_page_shows_the_task_a_person_wrote_not_the_offline_plan() -> None:
    from django.test import Client as BrowserClient

    from project.demo.views import TASK

    browser = BrowserClient(enforce_csrf_checks=True)
    run, url = _demo_page_of_a_started_run(browser)
    assert run.task == TASK  # stored as it was given, plan lines and all
    shown = browser.get(url).content.decode()
    assert '<q id="task">Check the orders tables and record what you found.</q>' in shown
    assert "#0 task: Check the orders tables and record what you found.</li>" in shown
    assert "@check_table" not in shown
    assert "@@chunk_latency" not in shown
    # Steps committed before the page is shown say what they hold, as live.js writes them.
    run_worker()
    done = browser.get(url).content.decode()
    assert "#1 model_turn: " in done
    assert "[calls check_table {&quot;table&quot;: &quot;orders&quot;}]" in done


def test_the_demo_page_escapes_what_the_run_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    from django.test import Client as BrowserClient

    from project.demo import views

    monkeypatch.setattr(
        views,
        "TASK",
        '<img src=x onerror="alert(1)"> tables\n@@final "<script>alert(2)</script>"',
    )
    browser = BrowserClient(enforce_csrf_checks=True)
    _, url = _demo_page_of_a_started_run(browser)
    run_worker()
    shown = browser.get(url).content.decode()
    assert "<img src=x" not in shown
    assert "&lt;img src=x onerror=&quot;alert(1)&quot;&gt; tables" in shown
    assert "<script>alert(2)" not in shown
    assert "&lt;script&gt;alert(2)&lt;/script&gt;" in shown
