"""``runs/<id>/events``: a run's events as Server-Sent Events (``include("durable_agents.urls")``).

Who may read: staff with the view permission on runs, or whoever holds a ``stream_token`` of
the run (``?token=``, for pages of end users). Resume with the ``Last-Event-ID`` header (the
browser's EventSource sends it by itself when it reconnects) or ``?after=``. A comment line
every HEARTBEAT_SECONDS keeps proxies from closing an idle stream; the response ends when the
run is over.

Under ASGI the events come from the process's hub (one connection for every reader, text
deltas of streamed turns included); under WSGI the view reads the run every
LIVE_WSGI_POLL_SECONDS on its own connection, without deltas, for at most
LIVE_WSGI_MAX_SECONDS, after which the browser reconnects and goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterator

from asgiref.sync import sync_to_async
from django.core.handlers.asgi import ASGIRequest
from django.http import HttpRequest, HttpResponse, StreamingHttpResponse
from django.http.response import HttpResponseBase

from durable_agents.conf import app_settings
from durable_agents.live import ReaderDropped, stream, token_run
from durable_agents.live.events import BadEventId, Cursor, Event, events_after
from durable_agents.models import AgentRun

logger = logging.getLogger("durable_agents.live")

VIEW_PERMISSION = "durable_agents.view_agentrun"
HEARTBEAT_SECONDS = 15.0
KEEPALIVE = b": keepalive\n\n"
# What the browser waits before it reconnects after the stream ends or breaks (ms).
RETRY = b"retry: 2000\n\n"


async def run_events(request: HttpRequest, run_id: uuid.UUID) -> HttpResponseBase:
    if request.method not in ("GET", "HEAD"):
        return HttpResponse(status=405, headers={"Allow": "GET"})
    token = request.GET.get("token")
    if token is not None:
        if token_run(token, app_settings.LIVE_TOKEN_SECONDS) != run_id:
            return _refused(403, "the token is not valid for this run (forged or expired)")
    elif not await _staff_may_view(request):
        return _refused(403, "reading a run's events needs staff with view permission on runs")
    after = request.headers.get("Last-Event-ID") or request.GET.get("after")
    try:
        Cursor.parse(run_id, after)
    except BadEventId as exc:
        return _refused(400, f"Last-Event-ID: {exc}")
    if not await AgentRun.objects.filter(pk=run_id).aexists():
        return _refused(404, "no such run")
    content: AsyncIterator[bytes] | Iterator[bytes]
    if request.method == "HEAD":
        # The headers alone: under a server, a body the client never reads would still follow
        # the run (and hold a reader) for as long as the run lasts.
        content = _nothing() if isinstance(request, ASGIRequest) else iter(())
    elif isinstance(request, ASGIRequest):
        content = _from_hub(run_id, after)
    else:
        content = _by_polling(run_id, after)
    response = StreamingHttpResponse(content, content_type="text/event-stream")
    response["Cache-Control"] = "no-cache, no-transform"
    response["X-Accel-Buffering"] = "no"  # nginx: pass each event on at once
    return response


async def _staff_may_view(request: HttpRequest) -> bool:
    user = await request.auser()
    if not (user.is_active and user.is_staff):
        return False
    return bool(await sync_to_async(user.has_perm)(VIEW_PERMISSION))


def _refused(status: int, reason: str) -> HttpResponse:
    return HttpResponse(reason + "\n", status=status, content_type="text/plain; charset=utf-8")


async def _nothing() -> AsyncIterator[bytes]:
    return
    yield  # an async generator that yields nothing


async def _from_hub(run_id: uuid.UUID, after: str | None) -> AsyncIterator[bytes]:
    """The events from the process's hub, with a keepalive comment whenever none came for
    HEARTBEAT_SECONDS. The next event is awaited as a task that a heartbeat never cancels."""
    yield RETRY
    events = stream(run_id, after)
    following: asyncio.Future[Event] | None = None
    try:
        while True:
            waiting = following or asyncio.ensure_future(anext(events))
            following = waiting
            done, _ = await asyncio.wait({waiting}, timeout=HEARTBEAT_SECONDS)
            if not done:
                yield KEEPALIVE
                continue
            following = None
            try:
                event = waiting.result()
            except (StopAsyncIteration, ReaderDropped, LookupError):
                return
            yield event.sse()
    finally:
        if following is not None:
            following.cancel()
        with contextlib.suppress(Exception):
            await events.aclose()


def _by_polling(run_id: uuid.UUID, after: str | None) -> Iterator[bytes]:
    """WSGI: read the run every LIVE_WSGI_POLL_SECONDS on this thread's connection, for at
    most LIVE_WSGI_MAX_SECONDS; no text deltas."""
    yield RETRY
    cursor = Cursor.parse(run_id, after)
    poll = float(app_settings.LIVE_WSGI_POLL_SECONDS)
    deadline = time.monotonic() + float(app_settings.LIVE_WSGI_MAX_SECONDS)
    quiet_since = time.monotonic()
    while True:
        read = events_after(run_id, cursor)
        if read is None:
            return
        cursor = read.cursor
        for event in read.events:
            yield event.sse()
        if read.events:
            quiet_since = time.monotonic()
        if read.over or time.monotonic() >= deadline:
            return
        if read.more:
            continue
        if time.monotonic() - quiet_since >= HEARTBEAT_SECONDS:
            yield KEEPALIVE
            quiet_since = time.monotonic()
        time.sleep(poll)
