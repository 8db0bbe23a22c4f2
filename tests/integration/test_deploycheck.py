"""``manage.py durable_agents_deploycheck``: with the code about to be deployed, the runs in
flight it does not define or defines with another fingerprint, by agent and version; whether an
``upgrades_from`` of this code covers them and whether a live worker still defines them; exit
status 1 with --fail-on-stranded when a run is stranded. Through call_command, and once as a
real subprocess (the code it checks is the test app's)."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

import durable_agents
from durable_agents.declare.agents import Agent, registry
from durable_agents.models import AgentRun, AgentWorker, RunStatus, WaitKind
from durable_agents.observe.fleet import deploy_check
from tests.conftest import ROOT, database_url
from tests.integration.conftest import agents_registered

pytestmark = pytest.mark.django_db


def run_of(agent: str, version: str, status: str = RunStatus.PENDING, **fields: Any) -> AgentRun:
    """A run in flight pinned as an older release's code would have pinned it."""
    fields.setdefault("fingerprint", "a" * 64)
    fields.setdefault("model", "claude-test-1")
    return AgentRun.objects.create(
        agent=agent, prompt_version=version, task="Go on.", status=status, **fields
    )


def deploycheck(*args: str) -> tuple[str, str]:
    out, err = StringIO(), StringIO()
    call_command("durable_agents_deploycheck", *args, stdout=out, stderr=err)
    return out.getvalue(), err.getvalue()


@pytest.fixture
def rollout_v2() -> Iterator[Agent]:
    """This code defines rollout@2, which upgrades the runs of rollout@1."""
    agent = Agent(
        name="rollout",
        version="2",
        model="claude-test-1",
        system="Roll it out, carefully.",
        upgrades_from=["1"],
        register=False,
    )
    with agents_registered(agent):
        yield agent


def test_nothing_to_say_when_this_code_defines_every_run_in_flight() -> None:
    durable_agents.start_run("tester", "Pending work")
    out, err = deploycheck("--fail-on-stranded")
    assert out.strip() == (
        "OK: this code defines the version and fingerprint of every run in flight (1)."
    )
    assert err == ""


def test_undefined_versions_are_listed_by_agent_and_version_with_what_serves_them(
    rollout_v2: Agent,
) -> None:
    old = timezone.now() - datetime.timedelta(days=2)
    for _ in range(3):
        run_of("rollout", "1")
    run_of("rollout", "1", RunStatus.WAITING, waiting_for=WaitKind.TIMER, model="claude-test-2")
    oldest = run_of("retired", "7", RunStatus.RUNNING)
    AgentRun.objects.filter(pk=oldest.pk).update(created_at=old)
    run_of("retired", "7", RunStatus.SUCCEEDED)  # finished: not in flight
    run_of("retired", "7", RunStatus.DEAD)
    durable_agents.start_run("tester", "Served by this code")
    AgentWorker.objects.create(
        id="pod-old",
        instance=uuid.uuid4(),
        host="h",
        pid=1,
        alive_until=timezone.now() + datetime.timedelta(minutes=1),
        concurrency=4,
        versions=[{"agent": "retired", "version": "7", "model": "m", "fingerprint": "x"}],
    )
    out, _err = deploycheck()
    blocks = out.strip().split("\n\n")
    assert len(blocks) == 3  # two versions, then the summary
    retired, rollout, summary = blocks
    assert retired.splitlines()[0].startswith(
        "retired@7: 1 run in flight (1 running), the oldest started "
    )
    assert "UTC, 2d ago" in retired
    assert "  not defined by this code" in retired
    assert "  a live worker still defines it: pod-old" in retired
    assert "  STRANDED: no worker of this code will take them" in retired
    assert rollout.splitlines()[0].startswith(
        "rollout@1: 4 runs in flight (3 pending, 1 waiting), the oldest started "
    )
    assert "  an agent of this code upgrades them where their history allows: rollout@2" in rollout
    assert "  no live worker defines it now" in rollout
    assert "STRANDED" not in rollout
    assert summary == (
        "6 runs in flight; 5 pinned to 2 agent version(s) this code does not serve as they "
        "started: 1 stranded, 4 upgradable."
    )


def test_a_version_defined_with_another_fingerprint_is_stranded() -> None:
    tester = registry.get("tester", "v1")
    durable_agents.start_run("tester", "Started with this definition")
    run_of("tester", "v1", model=tester.model, fingerprint="b" * 64)
    # Another model: this code's fingerprint for that model is what counts.
    run_of("tester", "v1", model="claude-test-2", fingerprint=tester.fingerprint("claude-test-2"))
    out, _err = deploycheck()
    (block, summary) = out.strip().split("\n\n")
    assert block.splitlines()[0].startswith("tester@v1: 1 run in flight (1 pending)")
    assert (
        f"  defined by this code with another fingerprint: 1 started with {'b' * 12} "
        f"(model {tester.model}), this code has {tester.fingerprint()[:12]}" in block
    )
    assert "STRANDED" in block
    assert "give the changed agent a new version" in block
    assert summary.endswith(": 1 stranded, 0 upgradable.")
    with pytest.raises(CommandError) as raised:
        deploycheck("--fail-on-stranded")
    assert raised.value.returncode == 1
    assert "1 run(s) in flight stranded by this code" in str(raised.value)


def test_upgradable_runs_pass_fail_on_stranded(rollout_v2: Agent) -> None:
    run_of("rollout", "1")
    out, _err = deploycheck("--fail-on-stranded")
    assert out.strip().endswith(": 0 stranded, 1 upgradable.")


def test_the_check_is_an_aggregate_not_a_row_per_run() -> None:
    for n in range(30):
        run_of("retired", str(n % 3), RunStatus.WAITING if n % 2 else RunStatus.PENDING)
    with CaptureQueriesContext(connection) as queries:
        check = deploy_check(registry)
    assert len(queries) == 2  # the grouped runs in flight, the live workers
    assert "GROUP BY" in queries[0]["sql"]
    assert [(f.label, f.runs) for f in check.findings] == [
        ("retired@0", 10),
        ("retired@1", 10),
        ("retired@2", 10),
    ]
    assert check.stranded == 30


def test_an_unknown_database_is_a_command_error() -> None:
    with pytest.raises(CommandError, match="no database 'nowhere'"):
        deploycheck("--database", "nowhere")


@pytest.mark.django_db(transaction=True)
def test_the_command_in_a_subprocess_exits_1_with_fail_on_stranded() -> None:
    run_of("retired", "7")
    durable_agents.start_run("tester", "Served by this code")
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "DATABASE_URL": database_url(),
    }
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "manage.py"),
            "durable_agents_deploycheck",
            "--fail-on-stranded",
            "--database",
            "default",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr
    assert done.stdout.startswith("retired@7: 1 run in flight (1 pending)")
    assert "STRANDED" in done.stdout
    assert done.stdout.rstrip().endswith(": 1 stranded, 0 upgradable.")
    assert "1 run(s) in flight stranded by this code (--fail-on-stranded)" in done.stderr
