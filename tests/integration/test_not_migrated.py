"""The public API on a database that ``manage.py migrate`` never ran on (or that lacks a
migration after an upgrade) says so in one ``NotMigrated`` error, chained from the database's
own error, instead of "relation agent_run does not exist" / "no such table: agent_run".

Each case runs the real API in a subprocess against a real database without our tables: an
empty SQLite file, or a PostgreSQL database created empty for the test (whichever the suite
runs on)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.db import connection

from tests.conftest import ROOT

TIMEOUT = 120

# Calls every public door that touches the tables first, each in its own try, and prints one
# JSON line per door: what it raised, whether that is ours and a DatabaseError, its cause.
SCRIPT = """
import json, sys, uuid

import django

django.setup()

from django.db import DatabaseError, transaction

import durable_agents
from durable_agents.exceptions import DurableAgentsError


class Approver:
    # A person who holds every permission (what api.Person asks of request.user).
    def has_perm(self, perm, obj=None):
        return True


RUN = uuid.uuid4()


def in_transaction(call):
    with transaction.atomic():
        return call()


DOORS = {
    "start_run": lambda: durable_agents.start_run("tester", "hello"),
    "start_run with a key": lambda: durable_agents.start_run("tester", "hello", key="k-1"),
    "start_run in a transaction": lambda: in_transaction(
        lambda: durable_agents.start_run("tester", "hello")
    ),
    "send_event": lambda: durable_agents.send_event("order:1", {"ok": True}),
    "cancel_run": lambda: durable_agents.cancel_run(RUN),
    "requeue_run": lambda: durable_agents.requeue_run(RUN),
    "fork_run": lambda: durable_agents.fork_run(RUN, 0),
    "fork_run in a transaction": lambda: in_transaction(lambda: durable_agents.fork_run(RUN, 0)),
    "messages_for": lambda: durable_agents.messages_for(RUN),
    "approve_intent": lambda: durable_agents.approve_intent(1, Approver()),
    "answer_question": lambda: durable_agents.answer_question(RUN, Approver(), "yes"),
    "set_key_limit": lambda: durable_agents.set_key_limit("tenant:a", 2),
    "schedule": lambda: durable_agents.schedule(
        "nightly", "tester", "Summarise.", cron="0 6 * * *"
    ),
}

for door in sys.argv[1:]:
    try:
        DOORS[door]()
    except Exception as exc:
        cause = exc.__cause__
        print(json.dumps({
            "door": door,
            "raised": type(exc).__name__,
            "ours": isinstance(exc, DurableAgentsError),
            "database_error": isinstance(exc, DatabaseError),
            "cause": type(cause).__name__ if cause is not None else None,
            "message": str(exc),
        }))
    else:
        print(json.dumps({"door": door, "raised": None}))
"""

DOORS = [
    "start_run",
    "start_run with a key",
    "start_run in a transaction",
    "send_event",
    "cancel_run",
    "requeue_run",
    "fork_run",
    "fork_run in a transaction",
    "messages_for",
    "approve_intent",
    "answer_question",
    "set_key_limit",
    "schedule",
]


@pytest.fixture
def empty_database(tmp_path: Path) -> Iterator[str]:
    """The URL of a database without a single table, on the suite's database engine."""
    settings_dict = connection.settings_dict
    if settings_dict["ENGINE"] == "django.db.backends.sqlite3":
        yield f"sqlite:///{tmp_path / 'never-migrated.sqlite3'}"
        return
    import psycopg

    user = settings_dict.get("USER") or "root"
    host = settings_dict.get("HOST") or "127.0.0.1"
    port = settings_dict.get("PORT") or 5432
    # Named after the suite's database, so that suites on other databases never collide.
    name = f"{settings_dict['NAME']}_unmigrated_{uuid.uuid4().hex[:8]}"
    server = f"host={host} port={port} user={user} dbname=postgres"
    with psycopg.connect(server, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"postgres://{user}@{host}:{port}/{name}"
    finally:
        with psycopg.connect(server, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def python(args: list[str], url: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "DATABASE_URL": url,
        "DURABLE_AGENTS_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )


def call_doors(url: str, doors: list[str]) -> dict[str, dict[str, Any]]:
    done = python(["-c", SCRIPT, *doors], url)
    assert done.returncode == 0, done.stderr
    outcomes = [json.loads(line) for line in done.stdout.splitlines()]
    return {outcome["door"]: outcome for outcome in outcomes}


def test_every_door_says_run_migrate_on_a_database_without_tables(empty_database: str) -> None:
    outcomes = call_doors(empty_database, DOORS)
    assert sorted(outcomes) == sorted(DOORS)
    for door, outcome in outcomes.items():
        assert outcome["raised"] == "NotMigrated", (door, outcome)
        assert outcome["ours"], door  # a DurableAgentsError
        assert outcome["database_error"], door  # still what `except DatabaseError` caught
        # Chained from the database's own error, which says which table it missed.
        assert outcome["cause"] in ("ProgrammingError", "OperationalError"), (door, outcome)
        message = outcome["message"]
        assert "has no durable_agents tables" in message, (door, message)
        assert message.endswith("run `manage.py migrate` first."), (door, message)
        assert "\n" not in message


def test_a_missing_migration_after_an_upgrade_is_named(empty_database: str) -> None:
    # An upgrade deployed without `migrate`: the database is at migration 0017, without the
    # table of 0018 (schedules). Migrated in full first, then back: Django's own apps must be
    # complete for their post-migrate steps.
    manage = str(ROOT / "manage.py")
    for target in ([], ["durable_agents", "0017"]):
        migrated = python([manage, "migrate", *target, "--no-input"], empty_database)
        assert migrated.returncode == 0, migrated.stderr
    outcomes = call_doors(empty_database, ["schedule", "start_run"])
    schedule = outcomes["schedule"]
    assert schedule["raised"] == "NotMigrated", schedule
    assert "lacks the migration durable_agents.0018_schedule" in schedule["message"]
    assert schedule["message"].endswith("run `manage.py migrate` first.")
    # A table that exists but lacks a later migration's column (agent_run's fork_key_run_id,
    # 0021) is named the same way: the first migration the database lacks.
    start = outcomes["start_run"]
    assert start["raised"] == "NotMigrated", start
    assert start["cause"] in ("ProgrammingError", "OperationalError"), start
    assert "lacks the migration durable_agents.0018_schedule" in start["message"]
