"""django-q2 schedules, the sweep, retention and metrics snapshots."""

from __future__ import annotations

import datetime
import io
import uuid
from typing import Any

import pytest
from django.core.management import call_command
from django.db.models.functions import Now
from django.utils import timezone

import durable_agents
from durable_agents import signals, store
from durable_agents.housekeeping import metrics
from durable_agents.housekeeping import sweeps as housekeeping
from durable_agents.models import (
    AgentEvent,
    AgentRun,
    AgentStep,
    AgentVersion,
    AgentWorker,
    MetricsSnapshot,
    RunStatus,
    ToolEffect,
)
from tests.conftest import run_worker

pytestmark = pytest.mark.django_db


def test_schedules_are_installed_once() -> None:
    from django_q.models import Schedule

    out = io.StringIO()
    call_command("durable_agents_schedules", stdout=out)
    call_command("durable_agents_schedules", stdout=out)
    rows = {s.name: (s.func, s.schedule_type, s.minutes, s.repeats) for s in Schedule.objects.all()}
    assert rows == {
        "durable_agents: sweep": ("durable_agents.housekeeping.sweep", "I", 5, -1),
        "durable_agents: retention": ("durable_agents.housekeeping.apply_retention", "I", 60, -1),
        "durable_agents: metrics": ("durable_agents.housekeeping.snapshot_metrics", "I", 5, -1),
        "durable_agents: webhooks": ("durable_agents.housekeeping.deliver_webhooks", "I", 1, -1),
    }
    assert out.getvalue().count("created schedule") == 4
    assert out.getvalue().count("updated schedule") == 4


def test_the_scheduled_functions_run_through_django_q() -> None:
    from django_q.tasks import async_task, result

    durable_agents.start_run("tester", "hello", model="claude-gone-1")
    task_id = async_task("durable_agents.housekeeping.snapshot_metrics")  # sync in tests
    assert MetricsSnapshot.objects.filter(pk=result(task_id)).exists()


def test_sweep_dead_letters_retired_models_and_undeployed_prompts(da_settings: Any) -> None:
    da_settings(RETIRED_MODELS=["claude-gone-1"])
    retired = durable_agents.start_run("tester", "a", model="claude-gone-1")
    retired_waiting = durable_agents.start_run("tester", "b", model="claude-gone-1")
    AgentRun.objects.filter(pk=retired_waiting.pk).update(status=RunStatus.WAITING)
    held = durable_agents.start_run("tester", "c", model="claude-gone-1")
    assert store.current().claim_run(held.pk, "busy-worker", 60) is not None
    week_ago = timezone.now() - datetime.timedelta(days=8)
    # v0: no live worker has defined it for longer than UNDEPLOYED_GRACE (7 days).
    undeployed = durable_agents.start_run("tester", "d")
    AgentRun.objects.filter(pk=undeployed.pk).update(prompt_version="v0", created_at=week_ago)
    AgentVersion.objects.create(
        agent="tester",
        version="v0",
        fingerprint="f0",
        model="m",
        binding="b",
        first_defined_at=week_ago,
        last_defined_at=week_ago,
    )
    # v-1: a gone worker defined it yesterday; within the grace, it waits.
    recent = durable_agents.start_run("tester", "d2")
    AgentRun.objects.filter(pk=recent.pk).update(prompt_version="v-1", created_at=week_ago)
    AgentVersion.objects.create(
        agent="tester",
        version="v-1",
        fingerprint="f1",
        model="m",
        binding="b",
        last_defined_at=timezone.now() - datetime.timedelta(days=1),
    )
    # v-2: this process lacks it, but a live worker defines it: never the sweep's to judge.
    elsewhere = durable_agents.start_run("tester", "d3")
    AgentRun.objects.filter(pk=elsewhere.pk).update(prompt_version="v-2", created_at=week_ago)
    AgentWorker.objects.create(
        id="old-code",
        instance=uuid.uuid4(),
        host="h",
        pid=1,
        concurrency=1,
        alive_until=timezone.now() + datetime.timedelta(minutes=1),
        versions=[{"agent": "tester", "version": "v-2", "model": "m", "fingerprint": "f2"}],
    )
    # v-3: started an hour ago by code no worker ever ran: the grace counts from its start.
    fresh = durable_agents.start_run("tester", "d4")
    AgentRun.objects.filter(pk=fresh.pk).update(prompt_version="v-3")
    healthy = durable_agents.start_run("tester", "e")
    finished = durable_agents.start_run("tester", "f", model="claude-gone-1")
    AgentRun.objects.filter(pk=finished.pk).update(status=RunStatus.SUCCEEDED)

    heard: list[Any] = []

    def listener(sender: Any, run_id: Any, reason: str, **kwargs: Any) -> None:
        heard.append(run_id)

    signals.run_dead_lettered.connect(listener)
    try:
        assert housekeeping.sweep() == {
            "retired_model": 2,
            "undeployed_prompt": 1,
            "parents_woken": 0,
            "cascades_finished": 0,
            "budget_woken": 0,
            "capacity_events_pruned": 0,
            "step_partitions_made": 0,  # the days ahead exist (made by migrate)
            "workers_aged_out": 0,
        }
    finally:
        signals.run_dead_lettered.disconnect(listener)

    status = dict(AgentRun.objects.values_list("pk", "status"))
    assert status[retired.pk] == status[retired_waiting.pk] == RunStatus.DEAD
    assert status[undeployed.pk] == RunStatus.DEAD
    assert status[held.pk] == RunStatus.RUNNING  # its worker decides
    assert status[recent.pk] == status[elsewhere.pk] == status[fresh.pk] == RunStatus.PENDING
    assert status[healthy.pk] == RunStatus.PENDING
    assert status[finished.pk] == RunStatus.SUCCEEDED
    assert "model 'claude-gone-1' is retired" in AgentRun.objects.get(pk=retired.pk).error
    assert (
        "agent version tester@v0 has not been defined by any live worker since "
        in AgentRun.objects.get(pk=undeployed.pk).error
    )
    assert "UNDEPLOYED_GRACE is 7 days" in AgentRun.objects.get(pk=undeployed.pk).error
    assert sorted(heard) == sorted([retired.pk, retired_waiting.pk, undeployed.pk])


def test_housekeeping_ages_out_killed_workers_keeping_when_they_defined_their_versions() -> None:
    long_ago = timezone.now() - datetime.timedelta(hours=2)
    AgentVersion.objects.create(
        agent="tester",
        version="v9",
        fingerprint="f9",
        model="m",
        binding="b",
        last_defined_at=long_ago - datetime.timedelta(days=3),
    )
    for worker_id, alive_until in [
        ("killed", long_ago),
        ("just-gone", timezone.now() - datetime.timedelta(minutes=5)),
        ("live", timezone.now() + datetime.timedelta(minutes=1)),
    ]:
        AgentWorker.objects.create(
            id=worker_id,
            instance=uuid.uuid4(),
            host="h",
            pid=1,
            concurrency=1,
            beat_at=alive_until - datetime.timedelta(seconds=60),
            alive_until=alive_until,
            versions=[{"agent": "tester", "version": "v9", "model": "m", "fingerprint": "f9"}],
        )
    assert housekeeping.age_out_workers() == 1
    assert sorted(AgentWorker.objects.values_list("id", flat=True)) == ["just-gone", "live"]
    recorded = AgentVersion.objects.get(version="v9").last_defined_at
    assert recorded == long_ago - datetime.timedelta(seconds=60)  # the killed one's last beat


ARCHIVED: list[list[Any]] = []


def archive(runs: Any) -> None:
    ARCHIVED.append(sorted(runs.values_list("pk", flat=True)))


@pytest.mark.django_db(transaction=True)
def test_retention_deletes_only_old_finished_runs_in_batches(da_settings: Any) -> None:
    da_settings(
        RETENTION_DAYS=30, RETENTION_BATCH=2, ARCHIVER="tests.integration.test_housekeeping.archive"
    )
    ARCHIVED.clear()
    old = [
        durable_agents.start_run("tester", f'old {i}\n@lookup {{"key": "{i}"}}') for i in range(5)
    ]
    run_worker()
    keep_recent = durable_agents.start_run("tester", "recent")
    keep_dead = durable_agents.start_run("tester", "dead")
    keep_pending = durable_agents.start_run("tester", "pending")
    long_ago = timezone.now() - datetime.timedelta(days=31)
    AgentRun.objects.filter(pk__in=[r.pk for r in old]).update(finished_at=long_ago)
    AgentRun.objects.filter(pk=keep_recent.pk).update(status=RunStatus.SUCCEEDED, finished_at=Now())
    AgentRun.objects.filter(pk=keep_dead.pk).update(status=RunStatus.DEAD, finished_at=long_ago)
    AgentRun.objects.filter(pk=keep_pending.pk).update(created_at=long_ago)
    assert ToolEffect.objects.count() == 5

    assert housekeeping.apply_retention() == 5
    assert [len(batch) for batch in ARCHIVED] == [2, 2, 1]
    assert sorted(pk for batch in ARCHIVED for pk in batch) == sorted(r.pk for r in old)
    assert set(AgentRun.objects.values_list("pk", flat=True)) == {
        keep_recent.pk,
        keep_dead.pk,
        keep_pending.pk,
    }
    assert not AgentStep.objects.filter(run_id__in=[r.pk for r in old]).exists()
    assert ToolEffect.objects.count() == 0
    assert housekeeping.apply_retention() == 0


def test_retention_forgets_old_events_that_no_run_waits_on(da_settings: Any) -> None:
    da_settings(RETENTION_DAYS=30)
    for name in ("old-sent", "old-awaited", "recent"):
        durable_agents.send_event(name, {"n": name})
    waiting = durable_agents.start_run("tester", "waits")
    AgentRun.objects.filter(pk=waiting.pk).update(
        status=RunStatus.WAITING, waiting_for="event", wait_event="old-awaited"
    )
    long_ago = timezone.now() - datetime.timedelta(days=31)
    AgentEvent.objects.exclude(name="recent").update(created_at=long_ago)
    housekeeping.apply_retention()
    assert set(AgentEvent.objects.values_list("name", flat=True)) == {"old-awaited", "recent"}


def test_retention_is_off_by_default() -> None:
    run = durable_agents.start_run("tester", "x")
    AgentRun.objects.filter(pk=run.pk).update(
        status=RunStatus.SUCCEEDED, finished_at=timezone.now() - datetime.timedelta(days=3650)
    )
    assert housekeeping.apply_retention() == 0
    assert AgentRun.objects.filter(pk=run.pk).exists()


@pytest.mark.django_db(transaction=True)
def test_metrics_and_snapshots() -> None:
    for task in (
        'm\n@lookup {"key": "a"}',
        'm\n@lookup {"key": "a"}\n@lookup {"key": "b"}',
        'drop\n@drop_table {"table": "t"}',
    ):
        durable_agents.start_run("tester", task)
    run_worker()
    pending = durable_agents.start_run("tester", "still pending")
    # Times set on the rows, and the snapshot taken as of a given now: the ages are exact.
    now = timezone.now()
    AgentRun.objects.filter(pk=pending.pk).update(created_at=now - datetime.timedelta(hours=2))
    waited = AgentRun.objects.filter(status=RunStatus.WAITING)
    assert waited.update(waiting_since=now - datetime.timedelta(minutes=90)) == 1
    figures = metrics.collect(now)
    assert figures["runs_by_status"]["succeeded"] == 2
    assert figures["runs_by_status"]["waiting"] == 1
    assert figures["runs_by_status"]["pending"] == 1
    assert figures["steps_per_run_p50"] == 5.0  # 4 and 6 steps
    assert figures["steps_per_run_p95"] == pytest.approx(5.9)
    assert figures["attempts_distribution"] == {"1": 2}
    assert figures["intents_waiting"] == 1
    assert figures["waits_by_kind"]["intent"]["runs"] == 1
    assert figures["waits_by_kind"]["intent"]["oldest_age_seconds"] == 90 * 60
    assert figures["questions_open"] == 0
    assert figures["finished_per_hour"][-1] == 2
    assert sum(figures["finished_per_hour"]) == 2
    assert figures["oldest_pending_age_seconds"] == 2 * 3600
    out = io.StringIO()
    call_command("durable_agents_housekeeping", "--metrics", stdout=out)
    snapshot = MetricsSnapshot.objects.latest()
    assert snapshot.data["runs_by_status"] == figures["runs_by_status"]
    assert f"snapshot {snapshot.pk} stored" in out.getvalue()
