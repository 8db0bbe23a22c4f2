"""Live: a run's events as they happen, for the people waiting for it.

    stream(run_id, after=None)   async iterator of ``Event`` (ASGI: the process's ``Hub``)
    stream_sync(run_id, after)   the same, polling on the caller's connection (WSGI)
    progress(message)            from tool code: a message kept with the run and streamed
    stream_token(run_id)         a signed, expiring token that lets one page read one run
    set_stream_cookie(response, run_id, request=request)
                                 the same token in a cookie only that run's events URL gets

``events`` says what the events are and how their ids resume; ``hub`` how one ASGI process
follows a thousand readers on one connection; ``publish`` how a worker sends the text of a
streamed turn while it comes.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncGenerator, Iterator
from typing import Any

from django.core import signing
from django.http import HttpRequest
from django.http.response import HttpResponseBase
from django.urls import reverse

from durable_agents._internal.text import storable_text
from durable_agents.declare import waits
from durable_agents.live.events import BadEventId, Cursor, Event, events_after
from durable_agents.live.hub import Hub, ReaderDropped

__all__ = [
    "STREAM_COOKIE",
    "BadEventId",
    "Event",
    "ReaderDropped",
    "progress",
    "set_stream_cookie",
    "stream",
    "stream_sync",
    "stream_token",
    "token_run",
]

logger = logging.getLogger("durable_agents.live")

# The longest progress message kept (longer ones are cut, with a note of their length).
MAX_PROGRESS_CHARS = 2000
# Progress messages kept per run: later ones are dropped (a tool in a loop costs a bounded
# number of rows), with one log line.
MAX_PROGRESS_PER_RUN = 1000
# How long a stream_token lasts unless told otherwise.
TOKEN_SECONDS = 3600
_TOKEN_SALT = "durable_agents.live.stream"
# The cookie ``set_stream_cookie`` sets (one per run: each is scoped to its run's events URL).
STREAM_COOKIE = "durable_agents_stream"


def run_uuid(run_id: Any) -> uuid.UUID:
    """A run's id given as a UUID or its text; ``ValueError`` for anything else."""
    if isinstance(run_id, uuid.UUID):
        return run_id
    try:
        return uuid.UUID(str(run_id))
    except (ValueError, TypeError, AttributeError):
        raise ValueError(f"{storable_text(repr(run_id), 100)} is not a run id") from None


async def stream(run_id: Any, after: str | None = None) -> AsyncGenerator[Event, None]:
    """The run's events: what happened (after the event id ``after``), then, while the run is
    active, each event as it happens, until the run is over. ``ValueError`` for an id that is
    not a run's or an ``after`` that is not an event id of this run; ``LookupError`` for a run
    that does not exist; ``ReaderDropped`` for a reader that fell behind by thousands of
    events (it stopped reading)."""
    pk = run_uuid(run_id)
    cursor = Cursor.parse(pk, after)
    async for event in Hub.current().follow(pk, cursor):
        yield event


def stream_sync(
    run_id: Any,
    after: str | None = None,
    *,
    poll_seconds: float = 1.0,
    max_seconds: float | None = None,
) -> Iterator[Event]:
    """``stream`` for synchronous code (a WSGI view): it reads the database every
    ``poll_seconds`` on the caller's connection, gives no text deltas, and stops after
    ``max_seconds`` (a client resumes with the last id). Same errors as ``stream``."""
    pk = run_uuid(run_id)
    cursor = Cursor.parse(pk, after)
    deadline = None if max_seconds is None else time.monotonic() + max_seconds
    while True:
        read = events_after(pk, cursor)
        if read is None:
            raise LookupError(f"no run {pk}")
        cursor = read.cursor
        yield from read.events
        if read.over:
            return
        if read.more:
            continue
        if deadline is not None and time.monotonic() >= deadline:
            return
        time.sleep(poll_seconds)


def progress(message: Any) -> None:
    """From tool code: tell whoever watches the run how the call is going ("indexed 40 of 100
    files"). The message is kept with the run (``agent_progress``) and streamed; it is cut at
    MAX_PROGRESS_CHARS, NUL and lone surrogates are replaced, and past MAX_PROGRESS_PER_RUN
    messages a run's further ones are dropped. ``RuntimeError`` outside a tool call."""
    from durable_agents.models import AgentProgress

    call = waits.current_call()
    if call is None:
        raise RuntimeError(
            "progress() is called from tool code: it reports on the tool call running; "
            "outside one there is no run to report to"
        )
    text = storable_text(message, MAX_PROGRESS_CHARS)
    kept = AgentProgress.objects.filter(run_id=call.run_id)
    if kept.count() >= MAX_PROGRESS_PER_RUN:
        logger.info("run %s: progress message dropped (%d kept)", call.run_id, MAX_PROGRESS_PER_RUN)
        return
    AgentProgress.objects.create(run_id=call.run_id, seq=call.seq, message=text)


def stream_token(run_id: Any) -> str:
    """A signed token that lets whoever holds it read the run's stream (``?token=`` on
    ``runs/<id>/events``) for ``LIVE_TOKEN_SECONDS`` (default an hour), for pages of end users
    who are not staff. Signed with SECRET_KEY; it names the run and nothing else."""
    return signing.TimestampSigner(salt=_TOKEN_SALT).sign(str(run_uuid(run_id)))


def set_stream_cookie(response: HttpResponseBase, run_id: Any, *, request: HttpRequest) -> None:
    """Let the browser that gets ``response`` read the run's stream without a token in the
    URL: a ``stream_token`` in a cookie that is HttpOnly (no script reads it), SameSite=Strict
    (no other site's page sends it), Secure when the request came over HTTPS, and scoped by
    its path to this run's events URL (the browser sends it there only, and cookies of
    several runs do not meet). It lasts LIVE_TOKEN_SECONDS, as the token in it.

    Call it from the view of the page that shows the run, and give the page the events URL
    with no ``?token=``: a URL is written down by access logs, proxies and browser history;
    a cookie is not. Needs ``include("durable_agents.urls")`` (the path is reversed)."""
    from durable_agents.conf import app_settings

    pk = run_uuid(run_id)
    response.set_cookie(
        STREAM_COOKIE,
        stream_token(pk),
        max_age=int(app_settings.LIVE_TOKEN_SECONDS),
        path=reverse("durable_agents:run_events", args=[pk]),
        secure=request.is_secure(),
        httponly=True,
        samesite="Strict",
    )


def token_run(token: str, max_age: int = TOKEN_SECONDS) -> uuid.UUID | None:
    """The run a token lets its holder read; None for a forged, altered or expired one."""
    try:
        value = signing.TimestampSigner(salt=_TOKEN_SALT).unsign(token, max_age=max_age)
        return uuid.UUID(value)
    except (signing.BadSignature, ValueError, TypeError):
        return None
