"""A retention SIGKILLed in the middle of a batch, on PostgreSQL's day partitions: nothing is
half done, and the next retention finishes it.

Six runs of a day forty days ago ended long ago (a day retention drops whole). A retention
runs in a subprocess with batches of two runs and an archiver that, in that subprocess,
hangs inside the second batch's transaction once it has written what it archived; the test
SIGKILLs it there. Then: the first batch's runs are gone (archived once), the second batch's
are all still there (its transaction died with the process), the day's partition still holds
every remaining run's steps. A retention in the test process then deletes the rest, archives
each run that was not deleted before (the second batch's again: an archive outside the
database is written at least once), and drops the day.
"""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from django.db import connection
from django.utils import timezone

import durable_agents
from durable_agents import api
from durable_agents.housekeeping import sweeps as housekeeping
from durable_agents.models import AgentRun, AgentStep, RunStatus, step_partitions
from durable_agents.models.ids import MS_PER_DAY, new_run_id
from tests.conftest import ROOT, database_url, wait_for

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

ARCHIVE_FILE = "DA_TEST_ARCHIVE_FILE"
HANG_MARKER = "DA_TEST_HANG_MARKER"


def archive(runs: Any) -> None:
    """The test's ARCHIVER: each run id on a line of ARCHIVE_FILE; in the subprocess, the
    second batch hangs after writing (HANG_MARKER appears), inside its transaction."""
    with Path(os.environ[ARCHIVE_FILE]).open("a") as out:
        for run in runs:
            out.write(f"{run.pk}\n")
    marker = os.environ.get(HANG_MARKER)
    if marker is None:
        return
    batches = Path(marker + ".batches")
    count = int(batches.read_text()) + 1 if batches.exists() else 1
    batches.write_text(str(count))
    if count == 2:
        Path(marker).touch()
        time.sleep(120)


RETENTION = """
import django
django.setup()
from django.conf import settings
settings.DURABLE_AGENTS = {
    **settings.DURABLE_AGENTS,
    "RETENTION_DAYS": 30,
    "RETENTION_BATCH": 2,
    "ARCHIVER": "tests.acceptance.test_crash_retention.archive",
}
from durable_agents.housekeeping import apply_retention
apply_retention()
"""


def test_a_retention_killed_mid_batch_is_finished_by_the_next(
    tmp_path: Path, da_settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    ms = time.time_ns() // 1_000_000 - 40 * MS_PER_DAY
    day = ms // MS_PER_DAY
    step_partitions.ensure_days(connection, day, day)
    monkeypatch.setattr(api, "new_run_id", lambda: new_run_id(ms))
    runs = [durable_agents.start_run("tester", f"old {i}") for i in range(6)]
    AgentRun.objects.filter(pk__in=[r.pk for r in runs]).update(
        status=RunStatus.SUCCEEDED, finished_at=timezone.now() - datetime.timedelta(days=35)
    )
    archived = tmp_path / "archived.txt"
    marker = tmp_path / "hanging"
    monkeypatch.setenv(ARCHIVE_FILE, str(archived))
    connection.close()  # the subprocess's DETACH must not wait for this test's session

    proc = subprocess.Popen(
        [sys.executable, "-c", RETENTION],
        cwd=ROOT,
        env={
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "tests.settings",
            "DATABASE_URL": database_url(),
            HANG_MARKER: str(marker),
        },
    )
    try:
        wait_for(marker.exists, timeout=60, what="the retention hangs in its second batch")
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()

    first_batch = set(archived.read_text().split()[:2])
    left = {str(pk) for pk in AgentRun.objects.values_list("pk", flat=True)}
    assert len(left) == 4
    assert not first_batch & left
    assert AgentStep.objects.filter(run_id__in=list(left)).count() == 4  # each its task step
    assert step_partitions.partition_name(day) in {
        p.name for p in step_partitions.partitions(connection.cursor())
    }

    da_settings(
        RETENTION_DAYS=30,
        RETENTION_BATCH=2,
        ARCHIVER="tests.acceptance.test_crash_retention.archive",
    )
    assert housekeeping.apply_retention() == 4
    assert not AgentRun.objects.exists()
    names = {p.name for p in step_partitions.partitions(connection.cursor())}
    assert step_partitions.partition_name(day) not in names
    lines = archived.read_text().split()
    # Each run archived; the first batch's once (deleted with it), the others at least once.
    assert set(lines) == {str(r.pk) for r in runs}
    assert all(lines.count(pk) == 1 for pk in first_batch)
