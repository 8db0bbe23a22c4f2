"""The SSE view under a real ASGI server (uvicorn, on a thread of this process so the test can
look at its hub): a client that goes away mid-stream leaves no reader and no watch behind, and
the server goes on serving the next one."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from django.core.handlers.asgi import ASGIHandler

import durable_agents
from durable_agents.live import stream_token
from durable_agents.live.hub import Hub
from tests.conftest import free_port, wait_for
from tests.integration.conftest import live_agents_registered
from tests.integration.test_live import watcher
from tests.integration.test_live_limits import TASK, events_url

uvicorn = pytest.importorskip("uvicorn")

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgres]


@pytest.fixture(autouse=True)
def registered() -> Iterator[None]:
    with live_agents_registered(watcher):
        yield


@pytest.fixture
def server() -> Iterator[tuple[int, Any]]:
    """uvicorn serving Django's ASGI handler on a free port; yields the port and the server."""
    port = free_port()
    config = uvicorn.Config(
        ASGIHandler(), host="127.0.0.1", port=port, lifespan="off", log_level="warning"
    )
    served = uvicorn.Server(config)
    thread = threading.Thread(target=served.run, daemon=True)
    thread.start()
    wait_for(lambda: served.started, what="uvicorn to start")
    try:
        yield port, served
    finally:
        served.should_exit = True
        thread.join(30)


def the_hub() -> Hub | None:
    hubs = list(Hub._hubs.values())
    return hubs[0] if hubs else None


def open_stream(port: int, run_id: Any) -> tuple[socket.socket, bytes]:
    """A GET of the run's stream on a raw socket, read up to its first step event."""
    client = socket.create_connection(("127.0.0.1", port), timeout=30)
    path = f"{events_url(run_id)}?token={stream_token(run_id)}"
    client.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
    got = b""
    while b"event: step" not in got:
        chunk = client.recv(65536)
        if not chunk:
            break
        got += chunk
    return client, got


def test_a_client_that_goes_away_mid_stream_leaves_no_reader(server: tuple[int, Any]) -> None:
    port, _ = server
    # A pending run with no worker: its stream would go on (heartbeats) until someone leaves.
    run = durable_agents.start_run(watcher.name, TASK)
    client, got = open_stream(port, run.pk)
    assert got.startswith(b"HTTP/1.1 200")
    assert b"text/event-stream" in got
    assert b"event: step" in got
    wait_for(lambda: (hub := the_hub()) is not None and hub.readers == 1, what="the reader to join")
    hub = the_hub()
    assert hub is not None
    assert run.pk in hub.watches

    client.close()  # the client goes away mid-stream

    wait_for(lambda: hub.readers == 0 and not hub.watches, what="the reader and its watch to go")
    # The server goes on: the next client of the same run is served from the start.
    again, got = open_stream(port, run.pk)
    try:
        assert b"event: step" in got
        wait_for(lambda: hub.readers == 1, what="the next reader to join")
    finally:
        again.close()
    wait_for(lambda: hub.readers == 0, what="the next reader to go")
