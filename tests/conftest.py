"""Shared fixtures: a fake Messages API over HTTP, the side-effect receiver, in-process and
subprocess workers. PostgreSQL-only tests carry the ``postgres`` marker and are skipped on
SQLite."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth.models import Permission, User
from django.db import connection
from django.test import Client

from durable_agents import llm
from durable_agents.declare.agents import registry
from durable_agents.engine import credentials
from durable_agents.engine.worker import Worker
from durable_agents.models import AgentRun, AgentStep
from tests.fakeserver import FakeAnthropic
from tests.testapp import receiver as receiver_module

ROOT = Path(__file__).resolve().parent.parent


def pytest_configure(config: pytest.Config) -> None:
    """The users' plugin: loaded by its entry point when the package is pip-installed, and
    registered here for a plain checkout."""
    import durable_agents.pytest_plugin as plugin

    if not config.pluginmanager.is_registered(plugin):
        config.pluginmanager.register(plugin, "durable_agents")
    _flush_postgresql_by_delete()


def _flush_postgresql_by_delete() -> None:
    """A transactional test ends with a flush of every table. On PostgreSQL, Django flushes
    with one TRUNCATE, which makes new files for each table and index: about 0.1 s a test, a
    minute and a half of the suite. The tests leave a few rows, which DELETE removes in a few
    milliseconds. Every foreign key of the schema is DEFERRABLE INITIALLY DEFERRED (Django
    creates them so), so the order of the DELETEs does not matter inside the flush's
    transaction. Sequences are not reset either way (no test asks for it)."""
    from django.core.management.color import Style
    from django.db.backends.base.operations import BaseDatabaseOperations
    from django.db.backends.postgresql.operations import DatabaseOperations

    truncate = DatabaseOperations.sql_flush

    def sql_flush(
        self: BaseDatabaseOperations,
        style: Style,
        tables: Sequence[str],
        *,
        reset_sequences: bool = False,
        allow_cascade: bool = False,
    ) -> list[str]:
        if reset_sequences or allow_cascade or not tables:
            return truncate(
                self, style, tables, reset_sequences=reset_sequences, allow_cascade=allow_cascade
            )
        return [f"DELETE FROM {self.quote_name(table)}" for table in tables]

    DatabaseOperations.sql_flush = sql_flush  # type: ignore[method-assign]  # on purpose


# The three kinds of test, one folder each: unit (no database; the state machine against the
# in-memory store), integration (a real database, in-process workers), acceptance (real
# `runagents` subprocesses, signals, PgBouncer, Chromium). `pytest -m unit` runs a kind.
KINDS = ("unit", "integration", "acceptance")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    from django.conf import settings

    for item in items:
        kind = item.path.parent.name
        if kind in KINDS:
            item.add_marker(getattr(pytest.mark, kind))

    if settings.DATABASES["default"]["ENGINE"] != "django.db.backends.postgresql":
        skip = pytest.mark.skip(reason="needs PostgreSQL (set DATABASE_URL; make test does)")
        for item in items:
            if "postgres" in item.keywords:
                item.add_marker(skip)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """What a test captured (logs, stdout) may hold the hostile text it fed the app, lone
    surrogates included; pytest-xdist sends reports between processes as UTF-8 and would die
    on them. Escape such characters in the report only: the test saw them as they were."""
    report = yield
    report.sections = [
        (title, content.encode("utf-8", "backslashreplace").decode("utf-8"))
        for title, content in report.sections
    ]
    return report


# -- how long each test took (make test and CI print the slowest) ----------------------------

_durations: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Setup, call and teardown of each test, summed; under pytest-xdist the reports reach
    the controller, so one process sees every test."""
    _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    """With DA_TEST_TIMES set, append "seconds<TAB>tier<TAB>test id" lines to that file:
    scripts/slowest-tests.py reads what every pass of `make test` wrote."""
    path = os.environ.get("DA_TEST_TIMES")
    if not path or hasattr(session.config, "workerinput"):  # an xdist worker: not the summary
        return
    from django.conf import settings

    tier = settings.DATABASES["default"]["ENGINE"].rsplit(".", 1)[-1]
    with open(path, "a", encoding="utf-8") as out:
        for nodeid, seconds in _durations.items():
            out.write(f"{seconds:.2f}\t{tier}\t{nodeid}\n")


class Receiver:
    def __init__(self, directory: Path):
        self.directory = directory

    def attempts(self, kind: str | None = None) -> list[dict[str, Any]]:
        rows = receiver_module.attempts(self.directory)
        return [r for r in rows if kind is None or r["kind"] == kind]

    def applied(self, kind: str | None = None) -> list[dict[str, Any]]:
        rows = receiver_module.applied(self.directory)
        return [r for r in rows if kind is None or r["kind"] == kind]

    def marker(self, name: str) -> bool:
        return (self.directory / name).exists()

    def calls(self, tool: str | None = None) -> list[dict[str, Any]]:
        """Invocations of the waiting tools (tests/testapp/wait_agents.py), in order."""
        return receiver_module.calls(self.directory, tool)


@pytest.fixture
def receiver(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Receiver:
    directory = tmp_path / "receiver"
    directory.mkdir()
    monkeypatch.setenv("DA_RECEIVER_DIR", str(directory))
    return Receiver(directory)


@pytest.fixture(autouse=True)
def _credentials_accepted() -> Iterator[None]:
    """A test whose fake API refused the key must not pause the next test's workers."""
    yield
    credentials.reset()


@pytest.fixture(autouse=True)
def _no_definitions_refused() -> Iterator[None]:
    """A test whose worker met a drifted run must not make the next test's claims skip it."""
    yield
    registry.forget_refusals()


def serve_fake_api(
    server: FakeAnthropic, settings: Any, monkeypatch: pytest.MonkeyPatch
) -> Iterator[FakeAnthropic]:
    """The body of a fixture that yields a fake API (``yield from serve_fake_api(...)``): the
    real SDK in this process talks HTTP to ``server`` (OFFLINE off) until the test ends; then
    the clients are dropped and the server is closed."""
    monkeypatch.setenv("ANTHROPIC_BASE_URL", server.base_url)
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-test-not-a-real-key")
    settings.DURABLE_AGENTS = {**settings.DURABLE_AGENTS, "OFFLINE": False}
    llm.reset_clients()
    yield server
    llm.reset_clients()
    server.close()


@pytest.fixture
def fake_api(settings: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeAnthropic]:
    """The real SDK in this process talks HTTP to a fake API (OFFLINE off)."""
    yield from serve_fake_api(FakeAnthropic(), settings, monkeypatch)


@pytest.fixture
def da_settings(settings: Any) -> Callable[..., None]:
    """Change DURABLE_AGENTS keys for one test: ``da_settings(MAX_ATTEMPTS=2)``."""

    def change(**values: Any) -> None:
        settings.DURABLE_AGENTS = {**settings.DURABLE_AGENTS, **values}
        llm.reset_clients()

    return change


@pytest.fixture
def superuser(django_user_model: Any) -> Any:
    return django_user_model.objects.create_superuser("boss", "boss@example.com", "pw")


def approver(username: str = "alice") -> User:
    """A staff user who may decide tool intents (the approve_toolintent permission) and
    nothing else."""
    user = User.objects.create_user(username, is_staff=True)
    user.user_permissions.add(
        Permission.objects.get(
            codename="approve_toolintent", content_type__app_label="durable_agents"
        )
    )
    return User.objects.get(pk=user.pk)  # a fresh instance: the permission cache is empty


@pytest.fixture
def admin_client(superuser: Any) -> Client:
    """The test client, logged in as a superuser (admin pages)."""
    client = Client()
    client.force_login(superuser)
    return client


@pytest.fixture
def keep_signal_handlers() -> Iterator[None]:
    """An in-process ``runagents`` (or worker) installs SIGTERM/SIGINT handlers; give pytest
    its own back."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


@contextlib.contextmanager
def worker_in_a_thread(**options: Any) -> Iterator[Worker]:
    """A ``Worker(**options)`` running on a thread of its own (its listener listening, unless
    ``listen=False``) until the block ends; then stopped, with every thread it started joined
    (their connections close with them: none outlives the test)."""
    options.setdefault("handle_signals", False)
    worker = Worker(**options)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    if options.get("listen", True):
        wait_for(lambda: worker.listener is not None and worker.listener.listening.is_set())
    try:
        yield worker
    finally:
        worker.stop()
        thread.join(30)
        for background in worker.background_threads:
            background.join(30)


def run_worker(**options: Any) -> Worker:
    """Run an in-process worker in burst mode until nothing is claimable."""
    options.setdefault("burst", True)
    options.setdefault("handle_signals", False)
    worker = Worker(**options)
    worker.run()
    return worker


def database_url() -> str:
    """The URL of the database the tests use (the test database), for subprocesses."""
    s = connection.settings_dict
    if s["ENGINE"] == "django.db.backends.sqlite3":
        return f"sqlite:///{s['NAME']}"
    user = s.get("USER") or "root"
    host = s.get("HOST") or "127.0.0.1"
    port = s.get("PORT") or 5432
    return f"postgres://{user}@{host}:{port}/{s['NAME']}"


class WorkerProcess:
    """``manage.py runagents`` as a real subprocess, with its output kept in a file."""

    def __init__(self, args: list[str], env: dict[str, str], log_path: Path):
        self.log_path = log_path
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in wait()/kill()
        self.proc = subprocess.Popen(
            # faulthandler: a worker that does not stop in time prints every thread's stack
            # on SIGABRT (``wait``), so the log says where it hung.
            [sys.executable, "-X", "faulthandler", str(ROOT / "manage.py"), "runagents", *args],
            cwd=ROOT,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill(self) -> int:
        self.proc.send_signal(signal.SIGKILL)
        return self.wait()

    def terminate(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float = 60) -> int:
        """The exit code; a worker still running after ``timeout`` is aborted with its
        threads' stacks in its log, and the test fails with the end of that log."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGABRT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(10)
            raise AssertionError(
                f"worker {self.pid} still ran {timeout:.0f} s later; its log ends:\n"
                + self.output()[-8000:]
            ) from None
        finally:
            self._log.close()

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")


@pytest.fixture
def spawn_worker(
    tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[Callable[..., WorkerProcess]]:
    """Start worker subprocesses against the test database; all are killed at teardown.

    Keyword ``env`` adds variables (e.g. ANTHROPIC_BASE_URL of a ``fake_api``); the
    receiver directory and the fake API of the test are passed on when those fixtures are
    in use.
    """
    started: list[WorkerProcess] = []

    def spawn(*args: str, env: dict[str, str] | None = None) -> WorkerProcess:
        full_env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "tests.settings",
            "DATABASE_URL": database_url(),
            "PYTHONUNBUFFERED": "1",
            **(env or {}),
        }
        if "fake_api" in request.fixturenames:
            full_env["DURABLE_AGENTS_OFFLINE"] = "0"
        worker = WorkerProcess(list(args), full_env, tmp_path / f"worker-{len(started)}.log")
        started.append(worker)
        return worker

    yield spawn
    for worker in started:
        if worker.proc.poll() is None:
            worker.proc.kill()
        with contextlib.suppress(Exception):  # teardown must go on
            worker.wait(10)


@pytest.fixture
def worker_thread() -> Iterator[Callable[..., Worker]]:
    """Start in-process workers on threads (``worker_thread(concurrency=4)``); each is stopped
    and joined at teardown."""
    started: list[tuple[Worker, threading.Thread]] = []

    def launch(**options: Any) -> Worker:
        options.setdefault("handle_signals", False)
        worker = Worker(**options)
        thread = threading.Thread(target=worker.run, name="test-worker", daemon=True)
        thread.start()
        started.append((worker, thread))
        return worker

    yield launch
    for worker, thread in started:
        worker.stop()
        thread.join(30)
        assert not thread.is_alive(), "the worker did not stop"
        # Their connections close with them: none outlives the test (nor the test database).
        for background in worker.background_threads:
            background.join(30)


@contextlib.contextmanager
def steps_refused(kind: str) -> Iterator[None]:
    """PostgreSQL refuses every step of ``kind`` inside (a trigger raises "value out of
    range", SQLSTATE 22003, a DataError): what the database does with a value it cannot store."""
    with connection.cursor() as cursor:
        cursor.execute(
            """
            CREATE FUNCTION da_refuse_step() RETURNS trigger AS $$
            BEGIN
                IF NEW.kind = '"""
            + kind
            + """' THEN
                    RAISE EXCEPTION 'value out of range' USING ERRCODE = '22003';
                END IF;
                RETURN NEW;
            END $$ LANGUAGE plpgsql;
            CREATE TRIGGER da_refuse_step BEFORE INSERT ON agent_step
                FOR EACH ROW EXECUTE FUNCTION da_refuse_step();
            """
        )
    try:
        yield
    finally:
        with connection.cursor() as cursor:
            cursor.execute(
                "DROP TRIGGER da_refuse_step ON agent_step; DROP FUNCTION da_refuse_step();"
            )


def backend_waits_on_lock(query_part: str = "") -> bool:
    """Some session of the test database is blocked on a lock, running a statement that
    contains ``query_part`` (read from a connection of its own)."""
    import psycopg

    with psycopg.connect(database_url(), autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND wait_event_type = 'Lock' AND query LIKE %s",
            (f"%{query_part}%",),
        ).fetchone()
    return bool(row and row[0])


def wait_for(
    predicate: Callable[[], Any],
    timeout: float = 30,
    interval: float = 0.02,
    *,
    what: str | None = None,
) -> Any:
    """Call ``predicate`` every ``interval`` seconds until it returns a true value, and return
    that; after ``timeout`` seconds fail the test, saying it waited for ``what`` (or for the
    predicate)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
        time.sleep(interval)


def free_port() -> int:
    """A TCP port of 127.0.0.1 that was free a moment ago: nothing listens on it (a connection
    is refused) until someone binds it, and another process may take it first."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def before_commit_of(
    monkeypatch: pytest.MonkeyPatch, seq: int, action: Callable[[Any], None]
) -> None:
    """Run ``action(claim)`` just before the runner commits step ``seq``: alone
    (``append_step``), or as the results that go with their turn
    (``append_turn_and_results``). The runner commits through the chosen store."""
    from durable_agents import store

    chosen = store.current()
    append_step = chosen.append_step
    together = chosen.append_turn_and_results

    def one(claim: Any, step: Any, *args: Any, **kwargs: Any) -> bool:
        if step.seq == seq:
            action(claim)
        return append_step(claim, step, *args, **kwargs)

    def two(claim: Any, turn: Any, results: Any) -> bool:
        if seq in (turn.seq, results.seq):
            action(claim)
        return together(claim, turn, results)

    monkeypatch.setattr(chosen, "append_step", one)
    monkeypatch.setattr(chosen, "append_turn_and_results", two)


def own_steps(run: AgentRun | uuid.UUID) -> list[AgentStep]:
    """The rows of agent_step that are a run's own (the run is given, or its id), in seq
    order: for a fork, not the stretches it shares (durable_agents.models.steps_of reads
    those too)."""
    run_id = run.pk if isinstance(run, AgentRun) else run
    return list(AgentStep.objects.filter(run_id=run_id).order_by("seq"))
