"""``runs/<id>/events``: a run's events as Server-Sent Events (``include("durable_agents.urls")``).

Who may read: staff with the view permission on runs, or whoever holds a ``stream_token`` of
the run (for pages of end users: in the cookie ``set_stream_cookie`` sets, which keeps it out
of URLs and access logs, or in ``?token=``). Each process serves at most LIVE_MAX_READERS
readers, LIVE_MAX_READERS_PER_RUN of one run; past them, 503 with Retry-After. Resume with
the ``Last-Event-ID`` header (the browser's EventSource sends it by itself when it
reconnects) or ``?after=``. A comment line
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
import weakref
from collections.abc import AsyncIterator, Callable, Iterator

from asgiref.sync import sync_to_async
from django.core.handlers.asgi import ASGIRequest
from django.db import connections
from django.http import HttpRequest, HttpResponse, StreamingHttpResponse
from django.http.response import HttpResponseBase

from durable_agents.conf import app_settings
from durable_agents.live import STREAM_COOKIE, ReaderDropped, stream, token_run
from durable_agents.live.admission import Admission, slots
from durable_agents.live.events import BadEventId, Cursor, Event, events_after
from durable_agents.models import AgentRun

logger = logging.getLogger("durable_agents.live")

VIEW_PERMISSION = "durable_agents.view_agentrun"
HEARTBEAT_SECONDS = 15.0
KEEPALIVE = b": keepalive\n\n"
# What the browser waits before it reconnects after the stream ends or breaks (ms).
RETRY = b"retry: 2000\n\n"
# What a reader past the caps is told to wait before it tries again (Retry-After, seconds).
BUSY_RETRY_AFTER_SECONDS = 10
# Requests of one process checking a reader (its session, its run) on the database at once.
CHECKS_AT_ONCE = 4


async def run_events(request: HttpRequest, run_id: uuid.UUID) -> HttpResponseBase:
    if not isinstance(request, ASGIRequest):
        return await _answer(request, run_id)  # WSGI: the request's thread reads the run
    # Under ASGI each request's database work runs in a thread of its own, so on a connection
    # of its own: a crowd of readers arriving at once would open as many. CHECKS_AT_ONCE of
    # them check (and hold a connection) at a time, the others wait their turn.
    async with _checks_of_this_loop():
        try:
            return await _answer(request, run_id)
        finally:
            # Before the first byte of the stream: the connection the checks opened (the
            # session, the user, the run) belongs to this request's own thread, and Django
            # would only close it when the response ends, which for a stream is when its
            # reader leaves (an hour later, or never under CONN_MAX_AGE, since the thread is
            # gone by then). The hub reads for every reader on its own connection.
            await sync_to_async(_close_request_connections)()


_checks: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
    weakref.WeakKeyDictionary()
)


def _checks_of_this_loop() -> asyncio.Semaphore:
    loop = asyncio.get_running_loop()
    checks = _checks.get(loop)
    if checks is None:
        checks = _checks[loop] = asyncio.Semaphore(CHECKS_AT_ONCE)
    return checks


async def _answer(request: HttpRequest, run_id: uuid.UUID) -> HttpResponseBase:
    if request.method not in ("GET", "HEAD"):
        return HttpResponse(status=405, headers={"Allow": "GET"})
    token = request.GET.get("token")
    if token is not None:
        if token_run(token, app_settings.LIVE_TOKEN_SECONDS) != run_id:
            return _refused(403, "the token is not valid for this run (forged or expired)")
    elif not _cookie_opens(request, run_id) and not await _staff_may_view(request):
        return _refused(403, "reading a run's events needs staff with view permission on runs")
    after = request.headers.get("Last-Event-ID") or request.GET.get("after")
    try:
        Cursor.parse(run_id, after)
    except BadEventId as exc:
        return _refused(400, f"Last-Event-ID: {exc}")
    if request.method == "HEAD":
        # The headers alone, and no reader counted: under a server, a body the client never
        # reads would still follow the run (and hold a reader) for as long as the run lasts.
        if not await AgentRun.objects.filter(pk=run_id).aexists():
            return _refused(404, "no such run")
        return _event_stream(_nothing() if isinstance(request, ASGIRequest) else iter(()))
    # Counted before the run is looked up: a reader past the caps costs no query.
    admission = slots.admit(run_id)
    if admission is None:
        return _busy()
    try:
        if not await AgentRun.objects.filter(pk=run_id).aexists():
            admission.release()
            return _refused(404, "no such run")
        content: AsyncIterator[bytes] | Iterator[bytes]
        if isinstance(request, ASGIRequest):
            content = _from_hub(run_id, after, admission)
        else:
            content = _by_polling(run_id, after, admission)
        response = _event_stream(content)
    except BaseException:
        admission.release()  # an error, or the request's task cancelled (the client left)
        raise
    # The stream's own ``finally`` gives the place back when it ends however it ends; these
    # two cover a stream that never started: Django closes a response it did not send, and a
    # response dropped unsent (its task cancelled before sending) is collected.
    response.on_close = admission.release
    weakref.finalize(response, admission.release)
    return response


class _EventStreamResponse(StreamingHttpResponse):
    """A text/event-stream response that calls ``on_close`` when Django closes it."""

    on_close: Callable[[], None] | None = None

    def close(self) -> None:
        try:
            if self.on_close is not None:
                self.on_close()
        finally:
            super().close()


def _event_stream(content: AsyncIterator[bytes] | Iterator[bytes]) -> _EventStreamResponse:
    response = _EventStreamResponse(content, content_type="text/event-stream")
    # no-store: what a run did (its steps, a model's text) is nobody's to keep, not a
    # browser's cache nor a shared one's; private: no proxy may keep or serve it to another.
    response["Cache-Control"] = "no-store, private, no-transform"
    response["X-Accel-Buffering"] = "no"  # nginx: pass each event on at once
    return response


def _busy() -> HttpResponse:
    """503 for a reader past LIVE_MAX_READERS or LIVE_MAX_READERS_PER_RUN."""
    response = _refused(503, "this server has as many readers as it serves; try again later")
    response["Retry-After"] = str(BUSY_RETRY_AFTER_SECONDS)
    response["Cache-Control"] = "no-store"
    # One line here, not Django's ERROR with a traceback-free "Service Unavailable" for each:
    # a crowd past the cap is expected load, and would fill the error log.
    logger.info("live: a reader refused, %d readers in this process", slots.total)
    response._has_been_logged = True  # type: ignore[attr-defined]
    return response


def _cookie_opens(request: HttpRequest, run_id: uuid.UUID) -> bool:
    """Whether the request carries the stream cookie of this run (``set_stream_cookie``)."""
    token = request.COOKIES.get(STREAM_COOKIE)
    return token is not None and token_run(token, app_settings.LIVE_TOKEN_SECONDS) == run_id


def _close_request_connections() -> None:
    """Close this thread's database connections, whatever CONN_MAX_AGE says: a stream lasts
    as long as its run, and a connection kept for it would sit idle all that time. One in an
    atomic block is someone's transaction (a test's): it is left alone."""
    for conn in connections.all(initialized_only=True):
        if not conn.in_atomic_block:
            conn.close()


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


async def _from_hub(
    run_id: uuid.UUID, after: str | None, admission: Admission
) -> AsyncIterator[bytes]:
    """The events from the process's hub, with a keepalive comment whenever none came for
    HEARTBEAT_SECONDS. The next event is awaited as a task that a heartbeat never cancels."""
    events = stream(run_id, after)
    following: asyncio.Future[Event] | None = None
    try:
        yield RETRY
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
        admission.release()
        if following is not None:
            following.cancel()
        with contextlib.suppress(Exception):
            await events.aclose()


def _by_polling(run_id: uuid.UUID, after: str | None, admission: Admission) -> Iterator[bytes]:
    """WSGI: read the run every LIVE_WSGI_POLL_SECONDS on this thread's connection, for at
    most LIVE_WSGI_MAX_SECONDS; no text deltas."""
    try:
        yield RETRY
        yield from _polled(run_id, after)
    finally:
        admission.release()


def _polled(run_id: uuid.UUID, after: str | None) -> Iterator[bytes]:
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
