"""What live readers cost the database and the process, through the real view under a real
uvicorn (on a thread of this process, so the test can look at its hub and count its
backends in pg_stat_activity): the readers of one process hold the hub's connection and its
LISTEN, never one each, while they read and after they leave, whatever CONN_MAX_AGE says;
past LIVE_MAX_READERS and LIVE_MAX_READERS_PER_RUN a reader gets 503 with Retry-After, and
a reader's place comes back when it leaves."""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.contrib.auth.models import Permission
from django.db import connection, connections
from django.test import Client

import durable_agents
from durable_agents.live import stream_token
from durable_agents.live.hub import Hub
from tests.conftest import wait_for
from tests.integration.conftest import live_agents_registered
from tests.integration.test_live import watcher
from tests.integration.test_live_limits import TASK, events_url
from tests.integration.test_live_server import server, the_hub

pytest.importorskip("uvicorn")

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.postgres]

__all__ = ["server"]  # the fixture, imported to be used here

# The hub's two connections: its reads (one thread) and its LISTEN for text deltas.
HUB_CONNECTIONS = 2


@pytest.fixture(autouse=True)
def registered() -> Iterator[None]:
    with live_agents_registered(watcher):
        yield


@pytest.fixture(autouse=True)
def persistent_connections(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """CONN_MAX_AGE=600 for every connection opened from now on, in any thread (the server's
    request threads included): Django keeps a connection that long after a request ends, so a
    stream's request must not leave its own open however long the stream lasts."""
    monkeypatch.setitem(connections.settings["default"], "CONN_MAX_AGE", 600)
    yield
    Hub.close_all()


@pytest.fixture
def staff_cookie(django_user_model: Any) -> str:
    """The Cookie header of a logged-in staff member who may view runs (a session in the
    database, read by the view on each request)."""
    user = django_user_model.objects.create_user("watcher", password="x", is_staff=True)
    user.user_permissions.add(Permission.objects.get(codename="view_agentrun"))
    client = Client()
    client.force_login(user)
    return f"sessionid={client.cookies['sessionid'].value}"


def other_backends() -> set[int]:
    """The backends connected to the test database, other than this test's own connection:
    their pids (a test counts the ones that came after its start, so that a connection an
    earlier test of this process left behind is not counted as the server's)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pid FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        return {pid for (pid,) in cursor.fetchall()}


def request(port: int, path: str, headers: str = "") -> socket.socket:
    client = socket.create_connection(("127.0.0.1", port), timeout=30)
    client.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{headers}\r\n".encode())
    return client


def read_until(client: socket.socket, done: Callable[[bytes], bool]) -> bytes:
    got = b""
    while not done(got):
        chunk = client.recv(65536)
        if not chunk:
            break
        got += chunk
    return got


def open_stream(port: int, run_id: Any, cookie: str | None = None) -> tuple[socket.socket, bytes]:
    """A reader of the run's stream (a token, or a staff session's cookie), read up to its
    first step event."""
    if cookie is None:
        client = request(port, f"{events_url(run_id)}?token={stream_token(run_id)}")
    else:
        client = request(port, events_url(run_id), f"Cookie: {cookie}\r\n")
    return client, read_until(client, lambda got: b"event: step" in got)


def refused(port: int, run_id: Any) -> bytes:
    """The status line and headers of the answer to one more token reader of the run (read
    up to their end only: a stream that was let in would never end)."""
    client = request(port, f"{events_url(run_id)}?token={stream_token(run_id)}")
    try:
        return read_until(client, lambda got: b"\r\n\r\n" in got)
    finally:
        client.close()


def test_readers_hold_the_hubs_connections_only_while_they_read_and_after(
    server: tuple[int, Any], staff_cookie: str
) -> None:
    port, _ = server
    before = other_backends()

    def new_backends() -> int:
        return len(other_backends() - before)

    # Pending runs with no worker: their streams go on until their readers leave.
    runs = [durable_agents.start_run(watcher.name, TASK) for _ in range(2)]
    readers = []
    try:
        for n in range(12):
            run = runs[n % 2]
            client, got = open_stream(port, run.pk, staff_cookie if n % 3 == 0 else None)
            readers.append(client)
            assert got.startswith(b"HTTP/1.1 200"), got[:200]
        wait_for(lambda: (hub := the_hub()) is not None and hub.readers == 12, what="12 readers")
        # Twelve readers, token holders and staff sessions: the hub's connections, none of
        # the requests' (their backends may take a moment to go once closed).
        wait_for(
            lambda: new_backends() <= HUB_CONNECTIONS,
            what=f"at most {HUB_CONNECTIONS} backends for 12 readers (not one each)",
        )
    finally:
        for client in readers:
            client.close()
    hub = the_hub()
    assert hub is not None
    wait_for(lambda: hub.readers == 0, what="the readers to go")
    # Nothing the streams' requests opened is left idle behind them, CONN_MAX_AGE=600 or not.
    wait_for(lambda: new_backends() <= HUB_CONNECTIONS, what="no idle request connections")
    # A refusal (a token of another run) and a HEAD leave nothing open either.
    other = durable_agents.start_run(watcher.name, TASK)
    for path in (
        f"{events_url(runs[0].pk)}?token={stream_token(other.pk)}",
        f"{events_url(runs[0].pk)}?token={stream_token(runs[0].pk)}&after=x",
    ):
        client = request(port, path)
        assert read_until(client, lambda got: b"\r\n\r\n" in got).split(b" ")[1] in (b"403", b"400")
        client.close()
    head = socket.create_connection(("127.0.0.1", port), timeout=30)
    head.sendall(
        f"HEAD {events_url(runs[0].pk)} HTTP/1.1\r\nHost: 127.0.0.1\r\nCookie: {staff_cookie}"
        "\r\n\r\n".encode()
    )
    assert read_until(head, lambda got: b"\r\n\r\n" in got).startswith(b"HTTP/1.1 200")
    head.close()
    wait_for(lambda: new_backends() <= HUB_CONNECTIONS, what="no connection left by refusals")


def test_readers_past_the_caps_get_503_with_retry_after(
    server: tuple[int, Any], da_settings: Callable[..., None], staff_cookie: str
) -> None:
    port, _ = server
    da_settings(LIVE_MAX_READERS=5, LIVE_MAX_READERS_PER_RUN=3)
    busy, other, third = (durable_agents.start_run(watcher.name, TASK) for _ in range(3))
    readers = []
    try:
        for n in range(3):
            client, got = open_stream(port, busy.pk, staff_cookie if n == 0 else None)
            readers.append(client)
            assert got.startswith(b"HTTP/1.1 200"), got[:200]
        # The run has as many readers as one process gives a run.
        answer = refused(port, busy.pk)
        assert answer.startswith(b"HTTP/1.1 503"), answer[:200]
        assert b"\r\nretry-after: " in answer.lower()
        # Other runs still get readers, up to the process's cap.
        for _ in range(2):
            client, got = open_stream(port, other.pk)
            readers.append(client)
            assert got.startswith(b"HTTP/1.1 200"), got[:200]
        assert refused(port, third.pk).startswith(b"HTTP/1.1 503")
        # A reader that leaves gives its place back: the next one is served.
        readers.pop().close()
        hub = the_hub()
        assert hub is not None
        wait_for(lambda: hub.readers == 4, what="the reader that left to go")

        def served() -> bool:
            client, got = open_stream(port, third.pk)
            readers.append(client)
            return got.startswith(b"HTTP/1.1 200")

        # Its place comes back when its stream has ended on the server: soon, not at once.
        wait_for(served, what="a reader of the third run to be served")
    finally:
        for client in readers:
            client.close()
