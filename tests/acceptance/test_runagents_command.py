"""``manage.py runagents`` refuses to start when it could only do harm or spin, says why in one
line, and exits non-zero when its worker died."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError, CommandParser

import durable_agents
from durable_agents import store
from durable_agents.declare.agents import registry
from durable_agents.management.commands.runagents import Command
from durable_agents.models import AgentRun, RunStatus
from tests.conftest import ROOT, database_url, free_port

TIMEOUT = 60  # seconds; a worker that spins instead of exiting fails the test


def runagents(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``manage.py runagents`` as a subprocess with the test settings, its output merged."""
    full_env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "DJANGO_DEBUG": "1",
        "DURABLE_AGENTS_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
        **env,
    }
    return subprocess.run(
        [sys.executable, str(ROOT / "manage.py"), "runagents", *args],
        cwd=ROOT,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=TIMEOUT,
    )


# -- the database --------------------------------------------------------------------------


@pytest.mark.slow
def test_an_unmigrated_database_says_migrate_once_and_exits_1(tmp_path: Path) -> None:
    empty = tmp_path / "never-migrated.sqlite3"
    done = runagents("--burst", env={"DATABASE_URL": f"sqlite:///{empty}"})
    assert done.returncode == 1, done.stdout
    assert done.stdout.count("run `manage.py migrate`") == 1, done.stdout
    assert "has no durable_agents tables" in done.stdout
    assert "Traceback" not in done.stdout
    assert "no such table" not in done.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    "url",
    [
        "sqlite:////nonexistent-directory-for-da-tests/db.sqlite3",
        f"postgres://root@127.0.0.1:{free_port()}/da_nowhere",
    ],
    ids=["sqlite-unopenable", "postgres-refused"],
)
def test_an_unreachable_database_is_one_line_and_exit_1(url: str) -> None:
    done = runagents("--burst", env={"DATABASE_URL": url})
    assert done.returncode == 1, done.stdout
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1, done.stdout
    assert lines[0].startswith("CommandError: cannot reach the database 'default'"), lines[0]


@pytest.mark.django_db(transaction=True)
def test_a_migrated_database_passes_and_the_worker_runs(
    keep_signal_handlers: None, settings: Any
) -> None:
    settings.DEBUG = True
    runs = [durable_agents.start_run("tester", f"hello {i}") for i in range(2)]
    call_command("runagents", "--burst")  # returns: no CommandError, no SystemExit
    # Past the start-up checks, the worker worked every run to its end, then stopped.
    done = AgentRun.objects.filter(pk__in=[run.pk for run in runs])
    assert sorted(done.values_list("status", "last_seq", "lease_owner")) == [
        (RunStatus.SUCCEEDED, 1, None),
        (RunStatus.SUCCEEDED, 1, None),
    ]


# -- OFFLINE with DEBUG off ----------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_offline_without_debug_refuses_to_start() -> None:
    run = durable_agents.start_run("tester", "hello")
    done = runagents("--burst", env={"DJANGO_DEBUG": "0", "DATABASE_URL": database_url()})
    assert done.returncode == 1, done.stdout
    assert "durable_agents.E011" in done.stdout
    assert "--allow-offline" in done.stdout
    assert AgentRun.objects.get(pk=run.id).status == RunStatus.PENDING  # nothing ran


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_allow_offline_starts_with_a_loud_warning() -> None:
    run = durable_agents.start_run("tester", "hello")
    done = runagents(
        "--burst", "--allow-offline", env={"DJANGO_DEBUG": "0", "DATABASE_URL": database_url()}
    )
    assert done.returncode == 0, done.stdout
    assert "durable_agents.E011" not in done.stdout
    assert "WARNING" in done.stdout
    assert "OFFLINE is on with DEBUG off" in done.stdout
    assert AgentRun.objects.get(pk=run.id).status == RunStatus.SUCCEEDED


def test_skipping_the_checks_does_not_skip_the_offline_guard(settings: Any) -> None:
    # call_command skips the system checks, like --skip-checks; pytest-django has DEBUG off.
    settings.DEBUG = False
    settings.DURABLE_AGENTS = {**settings.DURABLE_AGENTS, "OFFLINE": True}
    with pytest.raises(CommandError, match="--allow-offline"):
        call_command("runagents", "--burst")


# -- start and end ----------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_no_registered_agent_is_a_warning_at_start(
    keep_signal_handlers: None,
    settings: Any,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings.DEBUG = True
    monkeypatch.setattr(registry, "_agents", {})
    caplog.set_level(logging.INFO, logger="durable_agents")
    call_command("runagents", "--burst")
    [warning] = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert "no agents are registered" in warning.getMessage()
    assert "agents.py" in warning.getMessage()
    assert "INSTALLED_APPS" in warning.getMessage()


@pytest.mark.django_db(transaction=True)
def test_registered_agents_start_quietly(
    keep_signal_handlers: None, settings: Any, caplog: pytest.LogCaptureFixture
) -> None:
    settings.DEBUG = True
    caplog.set_level(logging.INFO, logger="durable_agents")
    call_command("runagents", "--burst")
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


@pytest.mark.django_db(transaction=True)
def test_a_dead_slot_makes_the_command_exit_non_zero(
    keep_signal_handlers: None, settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings.DEBUG = True

    def bug(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a bug in the claim")

    monkeypatch.setattr(store.current(), "claim_runs", bug)
    with pytest.raises(SystemExit) as exited:
        call_command("runagents", "--burst")
    assert exited.value.code == 1


def test_every_flag_has_help() -> None:
    parser = CommandParser()
    Command().add_arguments(parser)
    own = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert {a.dest for a in own} >= {"lease_seconds", "poll_interval", "allow_offline"}
    assert [a.dest for a in own if not a.help] == []
