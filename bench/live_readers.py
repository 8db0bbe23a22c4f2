"""What live readers cost one uvicorn process's database: 1,000 readers of ``runs/<id>/events``
at once (PostgreSQL only).

    python -m bench.live_readers                    # 1,000 readers of 100 runs, 50 refused
    python -m bench.live_readers --readers 200 --runs 20 --over 10      # a quick look

Workload: ``--runs`` pending runs (no worker: their streams stay open, with heartbeats) and one
``uvicorn project.asgi:application`` process (the bench settings: CONN_MAX_AGE=600, as the
demo's), with LIVE_MAX_READERS and LIVE_MAX_READERS_PER_RUN raised to ``--readers``. This
process opens ``--readers`` streams at once over raw asyncio connections, a third of them
with a staff session's cookie (the view reads the session and the user from the database),
the others with a ``stream_token``, each read up to its first step event; then ``--over``
more, which must be refused.

Figures:

  * backends: the most PostgreSQL backends of the server process (by its application_name)
    seen at once, sampled every 20 ms, while the readers are admitted and while they read.
    Target <= 2 (the hub's reads and its LISTEN), whatever the number of readers; plus one at
    most while an admin page is being served beside them;
  * an admin page beside them: the admin's list of runs (as a superuser), ``--pings`` times
    one after the other while every reader holds its stream. Target p95 under 200 ms;
  * readers past the cap: how many of the ``--over`` got 503 with a Retry-After header.
    Target: all of them;
  * backends left once every reader has gone. Target <= 2.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import threading
import time
from typing import Any

from bench import common
from bench.common import log

DB = "da_bench_live_readers"
APP_NAME = "da_bench_live_readers_server"


class BackendSampler(threading.Thread):
    """The most backends of the server process (by application_name) seen at once."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.stop = threading.Event()
        self.peak = 0
        self.now = 0
        self.samples = 0

    def reset(self) -> None:
        self.peak = 0

    def run(self) -> None:
        import psycopg

        with psycopg.connect(self.url, autocommit=True) as conn:
            while not self.stop.is_set():
                self.now = conn.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s",
                    [APP_NAME],
                ).fetchone()[0]
                self.peak = max(self.peak, self.now)
                self.samples += 1
                time.sleep(0.02)


def staff_sessions(n: int, superuser: bool = False) -> list[str]:
    """Cookie headers of ``n`` sessions of one staff member who may view runs."""
    from django.contrib.auth import BACKEND_SESSION_KEY, HASH_SESSION_KEY, SESSION_KEY
    from django.contrib.auth.models import Permission, User
    from django.contrib.sessions.backends.db import SessionStore

    name = "bench-admin" if superuser else "bench-watcher"
    user = User.objects.create_user(name, password="x", is_staff=True, is_superuser=superuser)
    user.user_permissions.add(Permission.objects.get(codename="view_agentrun"))
    cookies = []
    for _ in range(n):
        session = SessionStore()
        session[SESSION_KEY] = str(user.pk)
        session[BACKEND_SESSION_KEY] = "django.contrib.auth.backends.ModelBackend"
        session[HASH_SESSION_KEY] = user.get_session_auth_hash()
        session.create()
        cookies.append(f"sessionid={session.session_key}")
    return cookies


async def http_get(port: int, path: str, cookie: str = "") -> tuple[int, bytes, Any]:
    """GET ``path``; the status, the head and the stream (left open for a 200 stream)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    extra = f"Cookie: {cookie}\r\n" if cookie else ""
    writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{extra}\r\n".encode())
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), head, (reader, writer)


async def open_reader(port: int, path: str, cookie: str) -> tuple[int, bytes, Any]:
    status, head, (reader, writer) = await http_get(port, path, cookie)
    if status == 200:
        await reader.readuntil(b"event: step")
    else:
        writer.close()
    return status, head, (reader, writer)


async def admin_page_timed(port: int, cookie: str) -> float:
    started = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        f"GET /admin/durable_agents/agentrun/ HTTP/1.1\r\nHost: 127.0.0.1\r\nCookie: {cookie}"
        "\r\nConnection: close\r\n\r\n".encode()
    )
    await writer.drain()
    answer = await reader.read()
    writer.close()
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    return time.perf_counter() - started


def readers_paths(readers: int, run_ids: list[str]) -> tuple[list[tuple[str, str]], str]:
    """Each reader's path and Cookie header (a third staff sessions, the others tokens), and
    the Cookie header of a superuser for the admin page."""
    from durable_agents.live import stream_token

    cookies = staff_sessions(max(1, readers // 3))
    [admin] = staff_sessions(1, superuser=True)
    paths = []
    for n in range(readers):
        run = run_ids[n % len(run_ids)]
        if n % 3 == 0:
            paths.append((f"/agents/runs/{run}/events", cookies[(n // 3) % len(cookies)]))
        else:
            paths.append((f"/agents/runs/{run}/events?token={stream_token(run)}", ""))
    return paths, admin


async def scenario(
    args: argparse.Namespace,
    port: int,
    sampler: BackendSampler,
    paths: list[tuple[str, str]],
    admin: str,
) -> dict[str, Any]:
    sampler.reset()
    started = time.perf_counter()
    opened = await asyncio.gather(*(open_reader(port, p, c) for p, c in paths))
    admitted_s = time.perf_counter() - started
    statuses = [status for status, _, _ in opened]
    peak_admitting = sampler.peak
    # Every reader holds its stream: the server's backends now, then an admin page beside them.
    sampler.reset()
    await asyncio.sleep(1.0)
    peak_reading = sampler.peak
    pings = [await admin_page_timed(port, admin) for _ in range(args.pings)]
    peak_with_admin = sampler.peak
    over = await asyncio.gather(
        *(open_reader(port, paths[n % len(paths)][0], paths[n % len(paths)][1])
          for n in range(args.over))
    )  # fmt: skip
    refused = [status == 503 and b"\r\nretry-after: " in head.lower() for status, head, _ in over]
    for _, _, (_, writer) in opened:
        writer.close()
    deadline = time.monotonic() + 60
    while sampler.now > 2 and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    await asyncio.sleep(1.0)
    return {
        "readers": args.readers,
        "served": statuses.count(200),
        "other_statuses": sorted({s for s in statuses if s != 200}),
        "seconds_to_admit_all": round(admitted_s, 2),
        "backends_peak_while_admitting": peak_admitting,
        "backends_peak_while_reading": peak_reading,
        "backends_peak_with_admin_pages": peak_with_admin,
        "admin_page_ms": {
            **common.summary_ms(pings),
            "p95_ms": common.pct([p * 1000 for p in pings], 95),
        },
        "over_cap": args.over,
        "over_cap_refused_503_retry_after": sum(refused),
        "backends_after_readers_left": sampler.now,
        "samples": sampler.samples,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--readers", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--over", type=int, default=50)
    parser.add_argument("--pings", type=int, default=40)
    args = parser.parse_args()

    url = common.fresh_db(DB)
    common.setup_django(url)
    common.bulk_insert_runs(url, args.runs, turns=2)
    from durable_agents.models import AgentRun

    runs = [str(pk) for pk in AgentRun.objects.values_list("pk", flat=True)]
    paths, admin = readers_paths(args.readers, runs)
    port = _free_port()
    env = common.bench_env(
        url,
        DA_BENCH_LIVE_MAX_READERS=str(args.readers),
        DA_BENCH_APPLICATION_NAME=APP_NAME,
        # The admin page's own request leaves its connection behind under ASGI with
        # CONN_MAX_AGE (Django's, not the stream's); 0 keeps the count to the streams'.
        DA_BENCH_CONN_MAX_AGE="0",
    )
    server = subprocess.Popen(
        [common.PY, "-m", "uvicorn", "project.asgi:application", "--host", "127.0.0.1",
         "--port", str(port), "--no-access-log", "--log-level", "warning",
         "--backlog", str(args.readers * 2)],
        cwd=common.ROOT, env=env,
    )  # fmt: skip
    sampler = BackendSampler(url)
    sampler.start()
    try:
        _wait_listening(port)
        from django.db import connections

        result = asyncio.run(scenario(args, port, sampler, paths, admin))
        connections.close_all()
    finally:
        sampler.stop.set()
        common.stop(server, 10)
    result["targets"] = {
        "backends <= 2 while reading": common.verdict(result["backends_peak_while_reading"] <= 2),
        "admin page p95 < 200 ms": common.verdict(result["admin_page_ms"]["p95_ms"] < 200),
        "every reader past the cap got 503 + Retry-After": common.verdict(
            result["over_cap_refused_503_retry_after"] == args.over
        ),
        "backends <= 2 after the readers left": common.verdict(
            result["backends_after_readers_left"] <= 2
        ),
    }
    for key, value in result.items():
        log(f"{key}: {value}")
    common.write_result("live_readers", result)
    common.drop_db(DB)


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _wait_listening(port: int, limit: float = 60) -> None:
    import socket

    deadline = time.monotonic() + limit
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.settings")
    main()
