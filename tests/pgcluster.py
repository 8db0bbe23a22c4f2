"""Private PostgreSQL clusters for the failover and restart tests: a primary, and a streaming
standby made with ``pg_basebackup -R``, each on a spare port of 127.0.0.1, in a temporary
directory, run as the ``postgres`` OS user (PostgreSQL refuses to run as root).

``Cluster`` starts, stops (``-m immediate``: a crash), restarts and promotes one; ``clusters``
(a context manager) stops every cluster it made and removes their directories on the way out,
killing a postmaster by its pid when ``pg_ctl stop`` does not answer. Without the binaries the
test is skipped, or fails when ``DA_REQUIRE_FAILOVER=1`` (CI).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

BIN = Path(os.environ.get("DA_PG_BIN", "/usr/lib/postgresql/15/bin"))
NEEDED = ("initdb", "pg_ctl", "pg_basebackup", "postgres")
# Spare ports these tests may use; each cluster takes the first one free. Under pytest-xdist
# each worker process has a range of its own: two clusters started at once by two workers
# would otherwise both find the same port free, and the second postmaster fail to bind it.
_XDIST_WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
PORTS = range(54331 + 10 * _XDIST_WORKER, 54340 + 10 * _XDIST_WORKER)
OS_USER = "postgres"
DB_USER = "postgres"


def require_binaries() -> None:
    """Skip (or, with DA_REQUIRE_FAILOVER=1, fail) the test when a binary or the postgres OS
    user is missing."""
    missing = [name for name in NEEDED if not os.access(BIN / name, os.X_OK)]
    reason = ""
    if missing:
        reason = f"PostgreSQL server binaries missing in {BIN}: {', '.join(missing)}"
    else:
        try:
            pwd.getpwnam(OS_USER)
        except KeyError:
            reason = f"no {OS_USER!r} OS user to run a private PostgreSQL cluster as"
        if not reason and os.geteuid() != 0 and pwd.getpwuid(os.geteuid()).pw_name != OS_USER:
            reason = f"needs root (to run as {OS_USER!r} with runuser) or the {OS_USER} user"
    if not reason:
        return
    import pytest  # only the tests get here; the bench checks the binaries before

    if os.environ.get("DA_REQUIRE_FAILOVER") == "1":
        pytest.fail(reason + " and DA_REQUIRE_FAILOVER=1")
    pytest.skip(reason)


def _as_postgres(args: list[str]) -> list[str]:
    if os.geteuid() == 0:
        return ["runuser", "-u", OS_USER, "--", *args]
    return args


def _run(args: list[str], timeout: float = 60) -> str:
    done = subprocess.run(
        _as_postgres(args),
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({done.returncode}): {done.stderr[-2000:]}")
    return done.stdout


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


@dataclass
class Cluster:
    data: Path
    port: int
    log: Path

    def url(self, dbname: str) -> str:
        return f"postgres://{DB_USER}@127.0.0.1:{self.port}/{dbname}"

    def pg_ctl(self, *args: str, timeout: float = 60) -> str:
        return _run([str(BIN / "pg_ctl"), "-D", str(self.data), *args], timeout)

    def start(self) -> None:
        self.pg_ctl("-l", str(self.log), "-w", "-t", "30", "start")

    def stop(self, mode: str = "immediate") -> None:
        self.pg_ctl("-m", mode, "-w", "-t", "30", "stop")

    def restart(self, mode: str = "immediate") -> None:
        self.pg_ctl("-m", mode, "-w", "-t", "30", "-l", str(self.log), "restart")

    def promote(self) -> None:
        self.pg_ctl("-w", "-t", "30", "promote")

    def pid(self) -> int | None:
        with contextlib.suppress(OSError, ValueError, IndexError):
            return int((self.data / "postmaster.pid").read_text().splitlines()[0])
        return None

    def kill(self) -> None:
        """Stop it for good: pg_ctl, else SIGKILL of the postmaster (its children follow)."""
        with contextlib.suppress(Exception):
            self.stop("immediate")
        pid = self.pid()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)

    def log_text(self) -> str:
        with contextlib.suppress(OSError):
            return self.log.read_text(errors="replace")[-5000:]
        return ""

    def execute(self, sql: str, dbname: str = "postgres") -> list[tuple[object, ...]]:
        import psycopg

        with psycopg.connect(self.url(dbname), autocommit=True) as conn:
            cursor = conn.execute(sql)
            return cursor.fetchall() if cursor.description else []


@dataclass
class Clusters:
    root: Path
    made: list[Cluster] = field(default_factory=list)

    def _new(self, name: str) -> tuple[Path, int, Path]:
        used = {c.port for c in self.made}
        port = next((p for p in PORTS if p not in used and _port_free(p)), None)
        if port is None:
            raise RuntimeError(f"no spare port free in {PORTS}")
        return self.root / name, port, self.root / f"{name}.log"

    def primary(self, name: str = "primary", *, synchronous_standby: str | None = None) -> Cluster:
        """A new primary that streams to standbys; with ``synchronous_standby`` (the standby's
        application name) every commit waits for that standby to have flushed it."""
        data, port, log = self._new(name)
        _run(
            [
                str(BIN / "initdb"),
                "-D",
                str(data),
                "-U",
                DB_USER,
                "--auth=trust",
                "--no-sync",
                "-E",
                "UTF8",
                "--locale=C",
            ]
        )
        settings = [
            f"port = {port}",
            "listen_addresses = '127.0.0.1'",
            f"unix_socket_directories = '{self.root}'",
            "wal_level = replica",
            "max_wal_senders = 4",
            "max_connections = 100",
            "fsync = off",  # a test cluster: a crash here is pg_ctl's, not the machine's
            "shared_buffers = 32MB",
            "hot_standby = on",
        ]
        if synchronous_standby:
            settings += [
                f"synchronous_standby_names = '{synchronous_standby}'",
                "synchronous_commit = on",
            ]
        with open(data / "postgresql.conf", "a") as conf:
            conf.write("\n".join(settings) + "\n")
        with open(data / "pg_hba.conf", "a") as hba:
            hba.write("host replication all 127.0.0.1/32 trust\n")
        cluster = Cluster(data, port, log)
        self.made.append(cluster)
        cluster.start()
        return cluster

    def standby(self, primary: Cluster, name: str = "standby") -> Cluster:
        """A streaming standby of ``primary`` (``application_name`` = ``name``)."""
        data, port, log = self._new(name)
        _run(
            [
                str(BIN / "pg_basebackup"),
                "-D",
                str(data),
                "-h",
                "127.0.0.1",
                "-p",
                str(primary.port),
                "-U",
                DB_USER,
                "-R",
                "-X",
                "stream",
                "--no-sync",
                "-c",
                "fast",
            ],
            timeout=120,
        )
        with open(data / "postgresql.auto.conf", "a") as conf:
            # Promoted, it must not wait for a synchronous standby of its own (it has none):
            # the primary's synchronous_standby_names came with the base backup.
            conf.write(
                f"port = {port}\n"
                "synchronous_standby_names = ''\n"
                f"primary_conninfo = 'host=127.0.0.1 port={primary.port} user={DB_USER} "
                f"application_name={name}'\n"
            )
        cluster = Cluster(data, port, log)
        self.made.append(cluster)
        cluster.start()
        return cluster


@contextlib.contextmanager
def clusters() -> Iterator[Clusters]:
    """Clusters in a temporary directory the postgres user owns; all stopped and removed on
    the way out, whatever happened."""
    require_binaries()
    root = Path(tempfile.mkdtemp(prefix="da-pgcluster-"))
    owner = pwd.getpwnam(OS_USER)
    os.chown(root, owner.pw_uid, owner.pw_gid)
    root.chmod(0o700)
    made = Clusters(root)
    try:
        yield made
    finally:
        for cluster in reversed(made.made):
            cluster.kill()
        shutil.rmtree(root, ignore_errors=True)


def wait_for_sql(cluster: Cluster, sql: str, timeout: float = 30) -> None:
    """Until ``sql`` (on ``postgres``) returns a true first value."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(Exception):
            rows = cluster.execute(sql)
            if rows and rows[0][0]:
                return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {sql!r}: {cluster.log_text()}")
        time.sleep(0.1)
