"""``make run``'s demo, end to end: ``manage.py demo`` in a subprocess on a fresh SQLite
database with the offline model, as a new user runs it; then what it left in the database."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from django.conf import settings

from tests.fakeserver import FakeAnthropic, api_error

ROOT = Path(__file__).resolve().parents[2]

# The demo runs on a SQLite file of its own whatever the test database is: the SQLite pass of
# `make test` runs it, and the PostgreSQL pass would only run it again.
pytestmark = pytest.mark.skipif(
    settings.DATABASES["default"]["ENGINE"] != "django.db.backends.sqlite3",
    reason="the demo runs on its own SQLite file: the SQLite pass runs it",
)


def run_demo(
    database: Path, *args: str, settings: str = "project.settings", **env: str
) -> subprocess.CompletedProcess[str]:
    """``migrate`` then ``demo`` on a fresh SQLite file, as ``make run`` does."""
    full_env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC", "DURABLE"))},
        "DATABASE_URL": f"sqlite:///{database}",
        "DJANGO_SETTINGS_MODULE": settings,
        "DJANGO_DEBUG": "1",
        **env,
    }
    manage = [sys.executable, str(ROOT / "manage.py")]
    subprocess.run([*manage, "migrate", "--verbosity", "0"], env=full_env, cwd=ROOT, check=True)
    return subprocess.run(
        [*manage, "demo", *args],
        env=full_env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_the_demo_tells_its_story_forks_a_run_and_fires_a_schedule(tmp_path: Path) -> None:
    database = tmp_path / "demo.sqlite3"
    # The defaults of `make run`: the whole story, as a new user reads it.
    demo = run_demo(database)
    assert demo.returncode == 0, demo.stderr[-3000:]
    assert "the fork succeeded" in demo.stdout
    assert "NOT AS EXPECTED" not in demo.stdout
    # A story, not a log: no worker's step-by-step lines, no traceback, one screenful or so.
    printed = (demo.stdout + demo.stderr).splitlines()
    assert len(printed) < 80, "\n".join(printed)
    assert not [line for line in printed if "Traceback" in line or " INFO " in line]
    chapters = [line for line in printed if line[:2] in {f"{n}." for n in range(1, 10)}]
    assert len(chapters) == 6, chapters
    assert any("Message Batches" in chapter for chapter in chapters), chapters

    with sqlite3.connect(database) as db:
        forks = db.execute(
            "SELECT f.status, f.fork_seq, f.result, p.status, p.result, p.last_seq"
            " FROM agent_run f JOIN agent_run p ON p.id = f.forked_from_id"
        ).fetchall()
        assert len(forks) == 1
        status, fork_seq, result, parent_status, parent_result, parent_last = forks[0]
        assert (status, fork_seq, result) == ("succeeded", 2, "Done. 2 planned turns completed.")
        # The run it came from stopped at the failed call and is left as it was.
        assert parent_status == "succeeded"
        assert parent_result.startswith("Stopped: a tool call failed")
        assert parent_last == 3
        # Steps 0-1 are shared, not copied; the edited result and what followed are its own.
        own = db.execute(
            "SELECT s.seq FROM agent_step s JOIN agent_run f ON f.id = s.run_id"
            " WHERE f.forked_from_id IS NOT NULL ORDER BY s.seq"
        ).fetchall()
        assert [seq for (seq,) in own] == [2, 3, 4, 5]
        shared = db.execute("SELECT lo, hi FROM agent_step_share").fetchall()
        assert shared == [(0, 2)]
        # The migration story: every run ended but the question left open for the reader.
        statuses = dict(
            db.execute("SELECT status, COUNT(*) FROM agent_run GROUP BY status").fetchall()
        )
        assert statuses.get("waiting") == 1
        assert set(statuses) <= {"succeeded", "waiting"}
        # On a clock: the demo's schedule fired some slots, each started one run whose key is
        # the schedule's name and its slot, every one ran, and the schedule is paused at the end.
        fired = db.execute(
            "SELECT start_key, status FROM agent_run WHERE start_key LIKE 'demo-every-3s@%'"
        ).fetchall()
        assert len(fired) >= 1
        assert len({key for key, _ in fired}) == len(fired)
        assert {status for _, status in fired} == {"succeeded"}
        schedule = db.execute(
            "SELECT enabled, last_slot FROM agent_schedule WHERE name = 'demo-every-3s'"
        ).fetchone()
        assert schedule is not None
        enabled, last_slot = schedule
        assert enabled == 0
        assert last_slot is not None


@pytest.mark.slow
def test_a_demo_whose_runs_do_not_end_as_it_says_fails(tmp_path: Path) -> None:
    """`make run` (and CI's first step) must fail when the story is not what happened: here
    the API refuses every request, so no run ends as the demo says. The story is told to its
    end, each broken claim named, and the command exits 1 without a traceback."""
    api = FakeAnthropic()
    api.fail_next(api_error(400, "invalid_request_error", "this demo is refused"), times=10_000)
    try:
        demo = run_demo(
            tmp_path / "demo.sqlite3",
            "--extra-runs",
            "0",
            "--speed-runs",
            "0",
            ANTHROPIC_BASE_URL=api.base_url,
            ANTHROPIC_API_KEY="sk-test-not-a-real-key",
            DURABLE_AGENTS_OFFLINE="0",
        )
    finally:
        api.close()
    assert demo.returncode == 1, demo.stdout[-3000:]
    assert "the demo did not end as it says" in demo.stderr
    assert "- all 1 runs succeeded" in demo.stderr
    assert "- the fork succeeded" not in demo.stderr  # no fork: its run never stopped there
    assert "Traceback" not in demo.stdout + demo.stderr


@pytest.mark.slow
def test_the_demo_without_credentials_says_what_to_set(tmp_path: Path) -> None:
    demo = run_demo(tmp_path / "demo.sqlite3", DURABLE_AGENTS_OFFLINE="0")
    assert demo.returncode == 1
    assert "DURABLE_AGENTS_OFFLINE=1" in demo.stderr
    assert "Traceback" not in demo.stderr
