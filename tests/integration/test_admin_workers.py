"""The fleet in the admin: the Workers and Agent versions pages (view only, escaped), the
operations page's lines about workers (none live, or none defining a version runs in flight
need, in one statement more), and the run page of a pending run no live worker can serve."""

from __future__ import annotations

import datetime
import uuid
from typing import Any

import pytest
from django.contrib.admin.utils import quote
from django.contrib.auth.models import Permission, User
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

import durable_agents
from durable_agents.admin import operations
from durable_agents.declare.agents import registry
from durable_agents.models import (
    AgentRun,
    AgentVersion,
    AgentWorker,
    RunStatus,
    WaitKind,
)
from durable_agents.observe.fleet import read_fleet
from tests.integration.test_admin import ESCAPED, SCRIPT, run_url

pytestmark = pytest.mark.django_db

WORKERS = "admin:durable_agents_agentworker_changelist"
VERSIONS = "admin:durable_agents_agentversion_changelist"
OPERATIONS = "admin:durable_agents_agentrun_operations"


def defines(agent: str = "tester", version: str = "v1", **entry: str) -> dict[str, str]:
    """A worker row's entry for an agent version (the registered one's model and
    fingerprint unless given)."""
    try:
        registered = registry.get(agent, version)
        model, fingerprint = registered.model, registered.fingerprint()
    except LookupError:
        model, fingerprint = "claude-test-1", "f" * 64
    return {
        "agent": agent,
        "version": version,
        "model": entry.get("model", model),
        "fingerprint": entry.get("fingerprint", fingerprint),
    }


def worker(
    worker_id: str = "w1",
    *,
    live: bool = True,
    versions: list[dict[str, str]] | None = None,
    host: str = "host-a",
    beat_ago: float = 1,
    **fields: Any,
) -> AgentWorker:
    now = timezone.now()
    beat = now - datetime.timedelta(seconds=beat_ago)
    return AgentWorker.objects.create(
        id=worker_id,
        instance=uuid.uuid4(),
        host=host,
        pid=4242,
        started_at=now - datetime.timedelta(hours=2),
        beat_at=beat,
        alive_until=now + datetime.timedelta(seconds=60) if live else beat,
        concurrency=8,
        versions=[defines()] if versions is None else versions,
        **fields,
    )


def pinned_run(
    agent: str = "rollout",
    version: str = "1",
    status: str = RunStatus.PENDING,
    **fields: Any,
) -> AgentRun:
    """A run pinned to a version the test app may not define (written as an older release's
    code would have)."""
    fields.setdefault("fingerprint", "a" * 64)
    fields.setdefault("model", "claude-test-1")
    return AgentRun.objects.create(
        agent=agent, prompt_version=version, task="Roll it out.", status=status, **fields
    )


def staff(*codenames: str) -> Client:
    user = User.objects.create_user(f"staff-{User.objects.count()}", is_staff=True)
    for codename in codenames:
        user.user_permissions.add(
            Permission.objects.get(codename=codename, content_type__app_label="durable_agents")
        )
    client = Client()
    client.force_login(user)
    return client


# ---------------------------------------------------------------------------------------------
# 1. The Workers page


def test_the_workers_page_lists_live_and_gone_workers_with_their_versions(
    admin_client: Client,
) -> None:
    worker("pod-a", versions=[defines(), defines("rollout", "2", fingerprint="b" * 64)])
    worker("pod-b", live=False, beat_ago=600, host="host-b")
    worker("pod-c", draining=True, runs_held=3)
    response = admin_client.get(reverse(WORKERS))
    assert response.status_code == 200
    page = response.content.decode()
    for text in ("pod-a", "pod-b", "pod-c", "host-a", "host-b", "4242"):
        assert text in page
    assert "tester@v1" in page
    assert "rollout@2" in page
    # The short fingerprint, the whole one on hover.
    assert f'<code class="da-meta">{"b" * 12}</code>' in page
    assert f'title="model claude-test-1, fingerprint {"b" * 64}"' in page
    assert page.count('title="no heartbeat for a lease">gone</span>') == 1
    assert "live, draining" in page
    assert "10m ago" in page  # the gone worker's last heartbeat
    # Only live ones, only gone ones.
    live = admin_client.get(reverse(WORKERS) + "?state=live").content.decode()
    assert "pod-a" in live
    assert "pod-b" not in live
    gone = admin_client.get(reverse(WORKERS) + "?state=gone").content.decode()
    assert "pod-b" in gone
    assert "pod-a" not in gone


def test_hostile_worker_ids_and_hosts_are_escaped_on_the_list_and_the_page(
    admin_client: Client,
) -> None:
    hostile = worker(
        SCRIPT,
        host=f"{SCRIPT}\u202e",
        versions=[defines(SCRIPT, f"1{SCRIPT}", fingerprint=SCRIPT), "not a dict"],  # type: ignore[list-item]
    )
    listing = admin_client.get(reverse(WORKERS)).content.decode()
    assert SCRIPT not in listing
    assert ESCAPED in listing
    assert "\u202e" not in listing  # drawn as a marker
    url = reverse("admin:durable_agents_agentworker_change", args=[quote(hostile.pk)])
    response = admin_client.get(url)
    assert response.status_code == 200
    page = response.content.decode()
    assert SCRIPT not in page
    assert ESCAPED in page
    assert 'name="_save"' not in page  # view only, even for a superuser


def test_ids_no_row_can_hold_are_a_404_not_a_500(admin_client: Client) -> None:
    for bad in ("a\x00b", "x" * 300):
        url = reverse("admin:durable_agents_agentworker_change", args=[quote(bad)])
        assert admin_client.get(url).status_code == 404


def test_nobody_adds_changes_or_deletes_a_worker_or_a_version(admin_client: Client) -> None:
    row = worker("pod-a")
    version = AgentVersion.objects.create(
        agent="tester", version="v1", fingerprint="c" * 64, model="m", binding="b"
    )
    assert admin_client.get(reverse("admin:durable_agents_agentworker_add")).status_code == 403
    delete = reverse("admin:durable_agents_agentworker_delete", args=[row.pk])
    assert admin_client.post(delete, {"post": "yes"}).status_code == 403
    change = reverse("admin:durable_agents_agentworker_change", args=[row.pk])
    admin_client.post(change, {"host": "elsewhere"})
    assert AgentWorker.objects.get(pk=row.pk).host == "host-a"
    assert admin_client.get(reverse("admin:durable_agents_agentversion_add")).status_code == 403
    delete = reverse("admin:durable_agents_agentversion_delete", args=[version.pk])
    assert admin_client.post(delete, {"post": "yes"}).status_code == 403
    assert AgentWorker.objects.exists()
    assert AgentVersion.objects.exists()
    # No action either (Django's "delete selected" needs the delete permission).
    assert 'name="action"' not in admin_client.get(reverse(WORKERS)).content.decode()


def test_staff_need_the_view_permission(admin_client: Client) -> None:
    worker("pod-a")
    assert staff().get(reverse(WORKERS)).status_code == 403
    assert staff("view_agentrun").get(reverse(VERSIONS)).status_code == 403
    viewer = staff("view_agentworker", "view_agentversion")
    assert viewer.get(reverse(WORKERS)).status_code == 200
    assert viewer.get(reverse(VERSIONS)).status_code == 200
    page = viewer.get(reverse("admin:durable_agents_agentworker_change", args=["pod-a"]))
    assert page.status_code == 200
    assert viewer.get(reverse("admin:durable_agents_agentworker_add")).status_code == 403


# ---------------------------------------------------------------------------------------------
# 2. The Agent versions page


def test_the_versions_page_says_which_a_live_worker_defines_now(admin_client: Client) -> None:
    now = timezone.now()
    current = defines()
    AgentVersion.objects.create(
        agent="tester",
        version="v1",
        fingerprint=current["fingerprint"],
        model=current["model"],
        binding="b",
        first_defined_at=now - datetime.timedelta(days=3),
        last_defined_at=now - datetime.timedelta(hours=1),
    )
    AgentVersion.objects.create(
        agent="tester", version="v0", fingerprint="d" * 64, model="m", binding="b"
    )
    AgentVersion.objects.create(
        agent=SCRIPT, version=SCRIPT, fingerprint=SCRIPT, model=SCRIPT, binding="b"
    )
    worker("pod-a")  # defines tester@v1 with the registered fingerprint
    worker("pod-b", live=False, versions=[defines("tester", "v0", fingerprint="d" * 64)])

    def get() -> Any:
        return admin_client.get(reverse(VERSIONS))

    response = get()
    assert response.status_code == 200
    rows = {(r.agent, r.version): r.defined_now for r in response.context["cl"].result_list}
    assert rows == {("tester", "v1"): True, ("tester", "v0"): False, (SCRIPT, SCRIPT): False}
    page = response.content.decode()
    assert current["fingerprint"][:12] in page
    assert "3d ago" in page
    assert SCRIPT not in page
    assert ESCAPED in page
    with CaptureQueriesContext(connection) as first:
        get()
    for n in range(5):
        AgentVersion.objects.create(agent="more", version=str(n), fingerprint="e", model="m")
        worker(f"pod-{n}-more")
    with CaptureQueriesContext(connection) as more:
        get()
    assert len(more) == len(first)


# ---------------------------------------------------------------------------------------------
# 3. The operations page


def test_no_live_worker_while_runs_are_in_flight_is_said_first(admin_client: Client) -> None:
    page = admin_client.get(reverse(OPERATIONS)).content.decode()
    assert 'id="fleet"' not in page  # nothing in flight, nothing to say
    durable_agents.start_run("tester", "Pending work")
    worker("pod-gone", live=False)
    response = admin_client.get(reverse(OPERATIONS))
    page = response.content.decode()
    assert "No live worker: nothing will advance until a worker runs" in page
    assert "<code>python manage.py runagents</code>" in page
    assert page.index('id="fleet"') < page.index('id="runs-by-status"')
    # Not also a line per version: none has a live worker then.
    assert "which no live worker defines" not in page
    worker("pod-live")
    page = admin_client.get(reverse(OPERATIONS)).content.decode()
    assert 'id="fleet"' not in page  # tester@v1 is served


def test_versions_runs_need_that_no_live_worker_defines(admin_client: Client) -> None:
    now = timezone.now()
    worker("pod-a")  # defines tester@v1 only
    durable_agents.start_run("tester", "Served")
    pinned_run()
    pinned_run()
    pinned_run(status=RunStatus.WAITING, waiting_for=WaitKind.TIMER)
    pinned_run(status=RunStatus.SUCCEEDED)  # finished: needs nobody
    AgentVersion.objects.create(
        agent="rollout",
        version="1",
        fingerprint="a" * 64,
        model="claude-test-1",
        binding="b",
        last_defined_at=now - datetime.timedelta(days=3),
    )
    # A gone worker defined it more recently than agent_version says.
    worker("pod-old", live=False, beat_ago=7200, versions=[defines("rollout", "1")])
    pinned_run(agent=SCRIPT, version="9")
    response = admin_client.get(reverse(OPERATIONS))
    page = response.content.decode()
    lines = response.context["fleet_lines"]
    assert [line.need.label for line in lines] == ["rollout@1", f"{SCRIPT}@9"]
    rollout = lines[0].text
    assert rollout.startswith(
        "2 pending and 1 waiting runs need rollout@1, which no live worker defines (last defined "
    )
    assert ", 2h ago; housekeeping dead-letters them after UNDEPLOYED_GRACE, from " in rollout
    assert lines[1].text.startswith(f"1 pending run needs {SCRIPT}@9, which no live worker")
    assert "no worker on record has defined it" in lines[1].text
    assert "2 pending and 1 waiting runs need rollout@1" in page
    assert SCRIPT not in page
    assert ESCAPED in page
    assert "No live worker" not in page


def test_the_grace_is_dated_when_the_setting_is_there(
    admin_client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(operations, "undeployed_grace", lambda: datetime.timedelta(days=7))
    worker("pod-a")
    at = timezone.now() - datetime.timedelta(days=1)
    AgentVersion.objects.create(
        agent="rollout", version="1", fingerprint="a", model="m", last_defined_at=at
    )
    pinned_run()
    (line,) = admin_client.get(reverse(OPERATIONS)).context["fleet_lines"]
    assert line.dead_letter_from == at + datetime.timedelta(days=7)
    assert "after UNDEPLOYED_GRACE, from " in line.text


def test_the_page_names_the_versions_most_runs_need_then_counts_the_rest(
    admin_client: Client,
) -> None:
    worker("pod-a")
    for n in range(operations.FLEET_LINES + 2):
        for _ in range(1 + (n == 3)):
            pinned_run(version=str(n))
    lines = admin_client.get(reverse(OPERATIONS)).context["fleet_lines"]
    assert len(lines) == operations.FLEET_LINES + 1
    assert lines[0].need.label == "rollout@3"  # two runs need it
    assert lines[-1].text == ("2 more agent versions that runs in flight need have no live worker.")


def test_the_fleet_is_one_statement_more_on_the_operations_page(admin_client: Client) -> None:
    def fleet_statements() -> tuple[int, int]:
        with CaptureQueriesContext(connection) as ctx:
            assert admin_client.get(reverse(OPERATIONS)).status_code == 200
        statements = [q["sql"] for q in ctx.captured_queries]
        fleet = [s for s in statements if "agent_worker" in s or "agent_version" in s]
        return len(fleet), len(statements)

    worker("pod-a")
    pinned_run()
    one, total = fleet_statements()
    assert one == 1
    for n in range(5):
        worker(f"pod-{n}", versions=[defines("rollout", str(n))])
        pinned_run(version=str(n + 10))
        pinned_run(agent=f"other{n}", status=RunStatus.WAITING, waiting_for=WaitKind.EVENT)
    assert fleet_statements() == (1, total)


def test_read_fleet_reads_the_runs_in_flight_and_the_workers() -> None:
    assert read_fleet().no_live_worker is False  # nothing in flight
    pinned_run(status=RunStatus.RUNNING)
    pinned_run(agent="tester", version="v1")
    worker("pod-a")
    worker("pod-b", live=False, versions=[defines("rollout", "1")])
    fleet = read_fleet()
    assert fleet.live_workers == 1
    assert fleet.runs_in_flight == 2
    (need,) = fleet.needs
    assert (need.label, need.pending, need.running, need.waiting) == ("rollout@1", 0, 1, 0)
    assert need.last_defined_at is not None
    assert not fleet.no_live_worker


# ---------------------------------------------------------------------------------------------
# 4. The run page


def test_a_pending_run_of_a_version_no_live_worker_defines_says_so(admin_client: Client) -> None:
    run = pinned_run()
    page = admin_client.get(run_url(run)).content.decode()
    assert "Waiting for a worker that defines rollout@1</h3>" in page
    assert "No live worker defines this version now" in page
    worker("pod-a", versions=[defines("rollout", "1", fingerprint="b" * 64)])
    page = admin_client.get(run_url(run)).content.decode()
    assert (
        "Waiting for a worker that defines rollout@1 with fingerprint <code>aaaaaaaaaaaa</code>"
        in page
    )
    assert "define this version with fingerprint bbbbbbbbbbbb" in page


def test_a_served_run_says_nothing_unless_marked_as_waiting_for_a_worker(
    admin_client: Client,
) -> None:
    worker("pod-a", versions=[defines("rollout", "1", fingerprint="a" * 64)])
    run = pinned_run()
    assert "run-worker-wait" not in admin_client.get(run_url(run)).content.decode()
    # Another model: its fingerprint there is not known, so it is not said to differ.
    other = pinned_run(model="claude-test-2", fingerprint="9" * 64)
    assert "run-worker-wait" not in admin_client.get(run_url(other)).content.decode()
    AgentRun.objects.filter(pk=run.pk).update(
        status=RunStatus.WAITING, waiting_for=WaitKind.WORKER
    )  # as a worker that could not serve it leaves it
    page = admin_client.get(run_url(run)).content.decode()
    assert "Waiting for a worker that defines rollout@1</h3>" in page
    assert "A live worker defines this version" in page
    done = pinned_run(status=RunStatus.SUCCEEDED, agent="gone")
    assert "run-worker-wait" not in admin_client.get(run_url(done)).content.decode()


def test_the_run_page_escapes_the_version_it_waits_for(admin_client: Client) -> None:
    run = pinned_run(agent=SCRIPT, version=SCRIPT)
    page = admin_client.get(run_url(run)).content.decode()
    assert "run-worker-wait" in page
    assert SCRIPT not in page
    assert f"Waiting for a worker that defines {ESCAPED}@{ESCAPED}" in page
