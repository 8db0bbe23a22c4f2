"""``make run``'s demo, end to end: ``manage.py demo`` in a subprocess on a fresh SQLite
database with the offline model, as a new user runs it; then what it left in the database."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_demo_tells_its_story_forks_a_run_and_fires_a_schedule(tmp_path: Path) -> None:
    database = tmp_path / "demo.sqlite3"
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC", "DURABLE"))},
        "DATABASE_URL": f"sqlite:///{database}",
        "DJANGO_SETTINGS_MODULE": "project.settings",
        "DJANGO_DEBUG": "1",
    }
    manage = [sys.executable, str(ROOT / "manage.py")]
    subprocess.run([*manage, "migrate", "--verbosity", "0"], env=env, cwd=ROOT, check=True)
    demo = subprocess.run(
        [*manage, "demo", "--extra-runs", "1", "--speed-runs", "2"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert demo.returncode == 0, demo.stderr[-3000:]
    assert "the fork succeeded" in demo.stdout

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
