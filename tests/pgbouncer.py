"""A private PgBouncer in transaction pooling mode, for tests that route worker subprocesses
through a pooler (tests/acceptance/test_crash.py).

``running_pgbouncer()`` never assumes one is running: it writes its own ini into a temporary
directory, starts ``pgbouncer`` in the foreground on a free port of 127.0.0.1, waits until the
port takes a connection and stops it again at exit. Without the binary it skips the test, or
fails it when ``DA_REQUIRE_PGBOUNCER=1`` (CI; scripts/install-pgbouncer.sh installs it).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest

from tests.conftest import free_port

USERS = ("root", "postgres")  # trust: no passwords, but PgBouncer only admits listed users


def find_binary() -> str | None:
    found = shutil.which("pgbouncer")
    if found:
        return found
    debian = "/usr/sbin/pgbouncer"  # not on a non-root PATH
    return debian if os.access(debian, os.X_OK) else None


@dataclass
class PgBouncer:
    port: int
    directory: Path
    process: subprocess.Popen[bytes]
    admin_user: str = "root"

    @property
    def log_path(self) -> Path:
        return self.directory / "pgbouncer.log"

    def log(self) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")
        return ""

    def url(self, database_url: str) -> str:
        """``database_url`` (postgres://user@host:port/name) pointed at this PgBouncer."""
        parts = urlsplit(database_url)
        user = f"{parts.username}@" if parts.username else ""
        return urlunsplit(parts._replace(netloc=f"{user}127.0.0.1:{self.port}"))

    def show(self, what: str) -> list[dict[str, Any]]:
        """``SHOW <what>`` on the admin console (simple query protocol, autocommit)."""
        import psycopg
        from psycopg.rows import dict_row

        with psycopg.connect(
            host="127.0.0.1",
            port=self.port,
            dbname="pgbouncer",
            user=self.admin_user,
            autocommit=True,
            cursor_factory=psycopg.ClientCursor,
            row_factory=dict_row,
        ) as conn:
            return conn.execute(f"SHOW {what}").fetchall()

    def transactions(self, dbname: str) -> int:
        """Transactions PgBouncer has passed to ``dbname`` so far."""
        return sum(r["total_xact_count"] for r in self.show("STATS") if r["database"] == dbname)


def _run_as() -> str | None:
    """PgBouncer refuses to run as root: the user to switch to (None when not root)."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        with contextlib.suppress(KeyError):
            pwd.getpwnam(name)
            return name
    raise RuntimeError("running as root and neither a postgres nor a nobody user exists")


def _write_config(directory: Path, port: int, upstream_host: str, upstream_port: int) -> Path:
    auth_file = directory / "userlist.txt"
    auth_file.write_text("".join(f'"{user}" ""\n' for user in USERS))
    ini = directory / "pgbouncer.ini"
    ini.write_text(
        f"""[databases]
* = host={upstream_host} port={upstream_port}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {port}
unix_socket_dir =
pool_mode = transaction
auth_type = trust
auth_file = {auth_file}
admin_users = {", ".join(USERS)}
max_client_conn = 2000
default_pool_size = 20
ignore_startup_parameters = extra_float_digits,options
logfile = {directory / "pgbouncer.log"}
"""
    )
    for path in (auth_file, ini):
        path.chmod(0o644)
    return ini


def _wait_until_ready(bouncer: PgBouncer, timeout: float) -> None:
    import psycopg

    deadline = time.monotonic() + timeout
    while True:
        if bouncer.process.poll() is not None:
            raise RuntimeError(
                f"pgbouncer exited with {bouncer.process.returncode}:\n"
                + (bouncer.directory / "pgbouncer.out").read_text(errors="replace")
                + bouncer.log()
            )
        try:
            bouncer.show("VERSION")
            return
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)  # immediate shutdown: closes its server connections
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


@contextlib.contextmanager
def running_pgbouncer(
    upstream_host: str = "127.0.0.1", upstream_port: int = 5432, timeout: float = 15
) -> Iterator[PgBouncer]:
    """A private PgBouncer (transaction pooling) in front of ``upstream_host:upstream_port``.

    Any database name is passed through (wildcard entry), so a client connects to the same
    database name on the yielded ``port``. Stopped (SIGTERM, then waited for) at exit, which
    closes its server connections: leave the block before the test database is dropped.
    """
    binary = find_binary()
    if binary is None:
        message = "pgbouncer is not installed (scripts/install-pgbouncer.sh)"
        if os.environ.get("DA_REQUIRE_PGBOUNCER") == "1":
            pytest.fail(message + " and DA_REQUIRE_PGBOUNCER=1")
        pytest.skip(message)

    user = _run_as()
    directory = Path(tempfile.mkdtemp(prefix="da-pgbouncer-"))
    try:
        if user is not None:
            entry = pwd.getpwnam(user)
            os.chown(directory, entry.pw_uid, entry.pw_gid)  # it writes its log there
        directory.chmod(0o755)
        for attempt in range(3):  # another process may take the free port first
            port = free_port()
            ini = _write_config(directory, port, upstream_host, upstream_port)
            command = [binary, *(("-u", user) if user else ()), str(ini)]
            with open(directory / "pgbouncer.out", "wb") as out:
                process = subprocess.Popen(
                    command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
                )
            bouncer = PgBouncer(port=port, directory=directory, process=process)
            try:
                _wait_until_ready(bouncer, timeout)
                break
            except Exception:
                _stop(process)
                if attempt == 2:
                    raise
        try:
            yield bouncer
        finally:
            _stop(bouncer.process)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
