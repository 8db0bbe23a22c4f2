"""The step log in day partitions on PostgreSQL (migration 0025, models/step_partitions.py,
housekeeping/step_log.py): where steps land, what retention drops whole and what it keeps,
what a killed retention leaves and the next one settles, a step whose day has no partition,
and the conversion of a filled table while steps are committed."""

from __future__ import annotations

import datetime
import importlib
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from django.core import checks
from django.db import IntegrityError, connection, transaction
from django.utils import timezone

import durable_agents
from durable_agents import api
from durable_agents.housekeeping import sweeps as housekeeping
from durable_agents.models import AgentRun, AgentStep, RunStatus, step_partitions, steps_of
from durable_agents.models.ids import MS_PER_DAY, new_run_id, part_of_day, step_part
from durable_agents.store import current
from tests.conftest import database_url, run_worker, wait_for

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

MIGRATION = importlib.import_module("durable_agents.migrations.0025_step_log_partitions")


def where(run_id: uuid.UUID) -> set[str]:
    """The partitions that hold the steps of ``run_id``."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT DISTINCT tableoid::regclass::text FROM agent_step WHERE run_id = %s", [run_id]
        )
        return {row[0] for row in cursor.fetchall()}


def exists(table: str) -> bool:
    with connection.cursor() as cursor:
        cursor.execute("SELECT to_regclass(%s) IS NOT NULL", [table])
        return bool(cursor.fetchone()[0])


def w060() -> list[checks.CheckMessage]:
    return [m for m in checks.run_checks(databases=["default"]) if m.id == "durable_agents.W060"]


def today_part() -> int:
    return part_of_day(datetime.datetime.now(datetime.UTC).date())


@pytest.fixture
def days_ago(monkeypatch: pytest.MonkeyPatch) -> Callable[[int], int]:
    """``days_ago(40)``: runs started from now on get ids of that many days ago (their
    partition made first), as if a clock had started them then."""

    def shift(days: int) -> int:
        ms = time.time_ns() // 1_000_000 - days * MS_PER_DAY
        monkeypatch.setattr(api, "new_run_id", lambda: new_run_id(ms))
        part = ms // MS_PER_DAY
        step_partitions.ensure_days(connection, part, part)
        return part

    return shift


def test_a_new_runs_steps_live_in_the_partition_of_its_day() -> None:
    run = durable_agents.start_run("tester", "hello")
    run_worker()
    assert where(run.pk) == {step_partitions.partition_name(today_part())}
    assert step_part(run.pk) == today_part()
    run.refresh_from_db()
    assert run.status == RunStatus.SUCCEEDED
    assert [s.seq for s in steps_of(run.pk).order_by("seq")] == list(range(run.last_seq + 1))


def test_a_run_with_a_random_id_keeps_its_steps_in_the_legacy_partition() -> None:
    run = durable_agents.start_run("tester", "hello")
    legacy_id = run.pk = uuid.uuid4()
    run.save(force_insert=True)
    AgentStep.objects.create(run_id=legacy_id, seq=0, kind="task", payload='"hi"')
    assert where(legacy_id) == {step_partitions.LEGACY}
    assert [row[0] for row in current().load_log_rows(legacy_id)] == [0]


def test_a_step_whose_part_is_not_its_runs_is_refused_by_the_database() -> None:
    run = durable_agents.start_run("tester", "hello")
    with pytest.raises(IntegrityError), transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO agent_step (run_id, seq, part, kind, payload, attempt, worker)"
            " VALUES (%s, 1, %s, 'task', 'x', 0, '')",
            [run.pk, today_part() + 3],
        )


def test_a_day_without_partition_keeps_its_steps_in_the_default_until_the_sweep_moves_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A clock a year ahead: no partition for that day. The step is not refused.
    ahead = time.time_ns() // 1_000_000 + 365 * MS_PER_DAY
    monkeypatch.setattr(api, "new_run_id", lambda: new_run_id(ahead))
    run = durable_agents.start_run("tester", "from the future")
    assert where(run.pk) == {step_partitions.DEFAULT}
    found = checks.run_checks(databases=["default"])
    warned = [m for m in found if m.id == "durable_agents.W060"]
    assert len(warned) == 1
    assert "(1 steps)" in warned[0].msg
    # Creating the days ahead leaves that day alone (its steps are in the default)...
    assert step_partitions.ensure_days(connection, ahead // MS_PER_DAY, ahead // MS_PER_DAY) == []
    # ...the sweep moves them into a partition of their own, and the warning goes.
    housekeeping.sweep()
    assert where(run.pk) == {step_partitions.partition_name(ahead // MS_PER_DAY)}
    assert [s.seq for s in steps_of(run.pk)] == [0]
    assert not [
        m for m in checks.run_checks(databases=["default"]) if (m.id or "").endswith("W060")
    ]


def test_a_missing_day_ahead_is_made_by_the_sweep_and_warned_about_until_then() -> None:
    tomorrow = step_partitions.partition_name(today_part() + 1)
    with connection.cursor() as cursor:
        cursor.execute(f"ALTER TABLE agent_step DETACH PARTITION {tomorrow}")
        cursor.execute(f"DROP TABLE {tomorrow}")
    warned = [m for m in checks.run_checks(databases=["default"]) if (m.id or "").endswith("W060")]
    assert len(warned) == 1
    assert "no partition for" in warned[0].msg
    assert housekeeping.sweep()["step_partitions_made"] == 1
    assert exists(tomorrow)


def finished_long_ago(runs: list[AgentRun], status: str = RunStatus.SUCCEEDED) -> None:
    AgentRun.objects.filter(pk__in=[r.pk for r in runs]).update(
        status=status, finished_at=timezone.now() - datetime.timedelta(days=35)
    )


def test_retention_drops_a_day_whose_runs_all_go_and_keeps_a_day_with_a_dead_run(
    da_settings: Any, days_ago: Any
) -> None:
    da_settings(RETENTION_DAYS=30, RETENTION_BATCH=2)
    dropped_day = days_ago(40)
    gone = [durable_agents.start_run("tester", f"old {i}") for i in range(3)]
    kept_day = days_ago(39)
    ended = durable_agents.start_run("tester", "ended")
    dead = durable_agents.start_run("tester", "dead")
    finished_long_ago([*gone, ended])
    finished_long_ago([dead], RunStatus.DEAD)
    recent = durable_agents.start_run("tester", "also 39 days ago, but ended yesterday")
    AgentRun.objects.filter(pk=recent.pk).update(
        status=RunStatus.SUCCEEDED, finished_at=timezone.now() - datetime.timedelta(days=1)
    )

    assert housekeeping.apply_retention() == 4
    assert not exists(step_partitions.partition_name(dropped_day))
    assert exists(step_partitions.partition_name(kept_day))
    # The ended run of the kept day lost its steps row by row; the dead and recent keep theirs.
    assert not AgentStep.objects.filter(run_id=ended.pk).exists()
    assert steps_of(dead.pk).count() == 1
    assert steps_of(recent.pk).count() == 1
    assert set(AgentRun.objects.values_list("pk", flat=True)) == {dead.pk, recent.pk}
    assert housekeeping.apply_retention() == 0


def test_a_fork_outside_a_dropped_day_keeps_the_steps_it_shares(
    da_settings: Any, days_ago: Any
) -> None:
    da_settings(RETENTION_DAYS=30)
    old_day = days_ago(40)
    parent = durable_agents.start_run("tester", 'old\n@lookup {"key": "a"}')
    run_worker()
    parent.refresh_from_db()
    before = [(s.seq, s.kind, s.payload) for s in steps_of(parent.pk)]
    assert len(before) >= 3
    finished_long_ago([parent])
    days_ago(0)
    fork = durable_agents.fork_run(parent.pk, at_seq=2)
    assert housekeeping.apply_retention() == 1
    assert not exists(step_partitions.partition_name(old_day))
    assert [(s.seq, s.kind, s.payload) for s in steps_of(fork.pk)][:2] == before[:2]
    assert where(fork.pk) == {step_partitions.partition_name(today_part())}


def test_what_a_killed_retention_left_is_settled_by_the_next(
    da_settings: Any, days_ago: Any
) -> None:
    da_settings(RETENTION_DAYS=30)
    empty_day = days_ago(45)  # its runs deleted, killed before the DROP
    live_day = days_ago(44)  # killed after DETACH, before attaching it back
    survivor = durable_agents.start_run("tester", "still waiting")
    AgentRun.objects.filter(pk=survivor.pk).update(status=RunStatus.WAITING)
    with connection.cursor() as cursor:
        for part in (empty_day, live_day):
            cursor.execute(
                f"ALTER TABLE agent_step DETACH PARTITION {step_partitions.partition_name(part)}"
            )
    assert steps_of(survivor.pk).count() == 0  # detached: not read
    housekeeping.apply_retention()
    assert not exists(step_partitions.partition_name(empty_day))
    assert steps_of(survivor.pk).count() == 1  # attached again
    assert where(survivor.pk) == {step_partitions.partition_name(live_day)}


def test_converting_a_filled_table_never_stops_the_commits() -> None:
    """Back to one table (0024), filled with steps of random-id runs, converted again (0025)
    while another connection commits a step every few milliseconds under lock_timeout 1 s: no
    commit fails, every step is in the legacy partition."""
    editor = type("Editor", (), {"connection": connection})
    MIGRATION.PartitionStepLog().database_backwards("durable_agents", editor, None, None)
    assert not step_partitions.is_partitioned(connection.cursor())
    assert not exists(step_partitions.DEFAULT)
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO agent_run (id, agent, prompt_version, fingerprint, model, task,"
            " status, attempt, stalled_claims, last_seq, error, tokens_used, depth, waiting_for,"
            " dead_cause, priority, created_at, updated_at, fair_at)"
            # md5 ids: random, but one in 64 looks time-ordered (version 7), as ids written
            # by another tool might: the conversion must not refuse the rows it has.
            " SELECT md5('run' || g)::uuid, 'tester', 'v', 'f', 'm', 't', 'succeeded', 0, 0, 0,"
            " '',"
            " 0, 0, '', '', 0, now(), now(), now() FROM generate_series(1, 2000) g"
        )
        cursor.execute(
            "INSERT INTO agent_step (run_id, seq, kind, payload, attempt, worker)"
            " SELECT id, s, 'task', repeat('x', 200), 0, '' FROM agent_run,"
            " generate_series(0, 49) s"
        )
        cursor.execute("SELECT count(*) FROM agent_step")
        (filled,) = cursor.fetchone()
    assert filled == 100_000

    committed: list[int] = []
    failures: list[BaseException] = []
    stop = threading.Event()

    def commit_steps() -> None:
        with psycopg.connect(database_url(), autocommit=True) as conn:
            conn.execute("SET lock_timeout = '1s'")
            row = conn.execute("SELECT id FROM agent_run LIMIT 1").fetchone()
            assert row is not None
            (run_id,) = row
            seq = 1000
            while not stop.is_set():
                try:
                    conn.execute(
                        "INSERT INTO agent_step (run_id, seq, kind, payload, attempt, worker)"
                        " VALUES (%s, %s, 'tool_result', 'x', 0, '')",
                        [run_id, seq],
                    )
                    committed.append(seq)
                    seq += 1
                except BaseException as exc:  # noqa: BLE001 - reported below
                    failures.append(exc)
                    return
                time.sleep(0.002)

    committer = threading.Thread(target=commit_steps)
    committer.start()
    try:
        while len(committed) < 20:
            time.sleep(0.01)
        MIGRATION.PartitionStepLog().database_forwards("durable_agents", editor, None, None)
        converted_at = len(committed)
        while len(committed) < converted_at + 20 and not failures:
            time.sleep(0.01)
    finally:
        stop.set()
        committer.join(30)
    assert failures == []
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT tableoid::regclass::text, count(*) FROM agent_step GROUP BY 1 ORDER BY 1"
        )
        counts = dict(cursor.fetchall())
    assert counts == {step_partitions.LEGACY: filled + len(committed)}
    assert step_partitions.is_partitioned(connection.cursor())
    assert exists(step_partitions.DEFAULT)
    assert exists(step_partitions.partition_name(today_part() + 1))


def test_a_running_worker_makes_the_days_ahead_again(
    monkeypatch: pytest.MonkeyPatch, worker_thread: Any
) -> None:
    """A worker that runs for weeks without housekeeping keeps its days ahead: its service
    makes them again while it runs (every hour; here every 0.1 s)."""
    monkeypatch.setattr(housekeeping, "STEP_PARTITIONS_EVERY_SECONDS", 0.1)
    worker_thread(concurrency=1)
    tomorrow = step_partitions.partition_name(today_part() + 1)
    wait_for(lambda: exists(tomorrow))
    with connection.cursor() as cursor:
        cursor.execute(f"ALTER TABLE agent_step DETACH PARTITION {tomorrow}")
        cursor.execute(f"DROP TABLE {tomorrow}")
    connection.close()
    wait_for(lambda: exists(tomorrow), timeout=30)


def test_a_partition_dropped_by_hand_under_a_waiting_run_is_named_by_the_check(
    days_ago: Any,
) -> None:
    day = days_ago(3)
    waiting = durable_agents.start_run("tester", "waits for days")
    AgentRun.objects.filter(pk=waiting.pk).update(status=RunStatus.WAITING)
    assert not [
        m for m in checks.run_checks(databases=["default"]) if m.id == "durable_agents.W060"
    ]
    with connection.cursor() as cursor:
        name = step_partitions.partition_name(day)
        cursor.execute(f"ALTER TABLE agent_step DETACH PARTITION {name}")
        cursor.execute(f"DROP TABLE {name}")
    (warned,) = [
        m for m in checks.run_checks(databases=["default"]) if m.id == "durable_agents.W060"
    ]
    assert "(1 runs)" in warned.msg
    assert "a worker cannot resume them" in warned.msg


def test_a_day_whose_run_appears_during_its_drop_is_attached_again(days_ago: Any) -> None:
    """A clock set back can start a run on a day retention is dropping: after its DETACH the
    drop reads the day's runs again, and a day that has one is attached back, steps and all."""
    from durable_agents.housekeeping.step_log import _id_range

    day = days_ago(50)
    late = durable_agents.start_run("tester", "started by a clock fifty days behind")
    (partition,) = [p for p in step_partitions.partitions(connection.cursor()) if p.lo == day]
    assert step_partitions.drop_day(connection, partition, _id_range(day)) is False
    assert exists(step_partitions.partition_name(day))
    assert where(late.pk) == {step_partitions.partition_name(day)}
    AgentRun.objects.filter(pk=late.pk).delete()
    assert step_partitions.drop_day(connection, partition, _id_range(day)) is True
    assert not exists(step_partitions.partition_name(day))
