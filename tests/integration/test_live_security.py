"""The stream's answers that keep what it carries to its reader: event ids with numbers out of
range are refused, the response is never cached, a page can hand its reader the token in a
cookie only the run's events URL gets (no token in a URL), and an access log that does see
``?token=`` can redact it."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from django.core.handlers.asgi import ASGIHandler
from django.http import HttpResponse
from django.test import RequestFactory

import durable_agents
from durable_agents.live import STREAM_COOKIE, set_stream_cookie, stream_token, token_run
from durable_agents.logging import RedactStreamTokens
from durable_agents.models import short_id
from tests.conftest import free_port, wait_for
from tests.integration.conftest import live_agents_registered
from tests.integration.test_live import watcher
from tests.integration.test_live_limits import TASK, Exchange, asgi, events_url

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def registered() -> Iterator[None]:
    with live_agents_registered(watcher):
        yield


def header(exchange: Exchange, name: bytes) -> bytes | None:
    return dict(exchange.sent[0]["headers"]).get(name)


def test_an_event_id_with_a_negative_seq_is_refused() -> None:
    run = durable_agents.start_run(watcher.name, TASK)
    durable_agents.cancel_run(run.pk)  # over: a stream that was let in would end at once
    token = stream_token(run.pk)
    tag = short_id(run.pk)
    for after in (f"{tag}:-999999.0..0.0", f"{tag}:1.0.r.0.-5"):
        exchange = asgi(Exchange("GET", events_url(run.pk), f"token={token}&after={after}"))
        assert exchange.status == 400, exchange.body
        assert b"event: " not in exchange.body
    # The id of the first event is still taken (the cursor before any step is -1 too).
    assert asgi(Exchange("GET", events_url(run.pk), f"token={token}&after=")).status == 200


def test_the_stream_is_never_stored_by_a_cache() -> None:
    run = durable_agents.start_run(watcher.name, TASK)
    exchange = asgi(Exchange("HEAD", events_url(run.pk), f"token={stream_token(run.pk)}"))
    assert exchange.status == 200
    assert header(exchange, b"Cache-Control") == b"no-store, private, no-transform"


@pytest.mark.parametrize("secure", [False, True])
def test_the_stream_cookie_is_for_that_runs_events_url_only(secure: bool) -> None:
    run = durable_agents.start_run(watcher.name, TASK)
    response = HttpResponse()
    set_stream_cookie(response, run.pk, request=RequestFactory().get("/", secure=secure))
    cookie = response.cookies[STREAM_COOKIE]
    assert token_run(cookie.value) == run.pk
    assert cookie["path"] == events_url(run.pk)
    assert cookie["httponly"] is True
    assert cookie["samesite"] == "Strict"
    assert bool(cookie["secure"]) is secure
    assert cookie["max-age"] == 3600


def test_the_view_takes_the_stream_cookie_of_its_run_only() -> None:
    run, other = (durable_agents.start_run(watcher.name, TASK) for _ in range(2))
    response = HttpResponse()
    set_stream_cookie(response, run.pk, request=RequestFactory().get("/"))
    cookie = f"{STREAM_COOKIE}={response.cookies[STREAM_COOKIE].value}".encode()

    def head(run_id: Any, *headers: tuple[bytes, bytes]) -> int:
        return asgi(Exchange("HEAD", events_url(run_id), "", headers)).status

    assert head(run.pk, (b"cookie", cookie)) == 200
    assert head(other.pk, (b"cookie", cookie)) == 403  # a cookie of another run
    assert head(run.pk) == 403  # no cookie, no token, no staff
    forged = cookie[:-3] + b"xyz"
    assert head(run.pk, (b"cookie", forged)) == 403


class Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_the_access_log_of_uvicorn_keeps_no_stream_token() -> None:
    """uvicorn's own access log, through the filter a project adds to it."""
    uvicorn = pytest.importorskip("uvicorn")
    run = durable_agents.start_run(watcher.name, TASK)
    token = stream_token(run.pk)
    access = logging.getLogger("uvicorn.access")
    kept = Kept()
    kept.addFilter(RedactStreamTokens())
    level = access.level
    access.addHandler(kept)
    port = free_port()
    # log_config=None: uvicorn configures no logging of its own here, it sets the levels only.
    config = uvicorn.Config(
        ASGIHandler(), host="127.0.0.1", port=port, lifespan="off", log_level="info",
        log_config=None,
    )  # fmt: skip
    served = uvicorn.Server(config)
    thread = threading.Thread(target=served.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: served.started, what="uvicorn to start")
        import http.client

        client = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        client.request("HEAD", f"{events_url(run.pk)}?after=&token={token}")
        assert client.getresponse().status == 200
        client.close()
        line = wait_for(
            lambda: next((line for line in kept.lines if events_url(run.pk) in line), None),
            what="the request's access-log line",
        )
    finally:
        served.should_exit = True
        thread.join(30)
        access.removeHandler(kept)
        access.setLevel(level)
    assert token not in line
    assert "token=[redacted]" in line
