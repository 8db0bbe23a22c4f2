"""What a fork may repeat and who may make one: a call the original may have made keeps the
original's idempotency key in the fork; an irreversible call whose outcome is unknown refuses
the fork until a person resolved it; a fork of a child run stays in its tree; the fork pages
ask for the permissions the run's own pages ask for, and the edit form stands hostile input.

Real parts throughout: PostgreSQL (or SQLite), an in-process worker driving the real SDK over
HTTP to the offline model (``FakeAnthropic``), and the real admin through the test client."""

from __future__ import annotations

import datetime
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from django.contrib.auth.models import Permission
from django.core.exceptions import PermissionDenied
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from durable_agents import Agent, Wait, api, spawn_run, tool
from durable_agents.forks.planning import ForkRefused
from durable_agents.forks.replay import replay
from durable_agents.housekeeping.sweeps import apply_retention
from durable_agents.models import (
    AgentRun,
    IntentStatus,
    RunStatus,
    ToolEffect,
    ToolIntent,
    steps_of,
)
from durable_agents.testing import plan
from tests.conftest import run_worker
from tests.fakeserver import FakeAnthropic
from tests.integration.conftest import agents_registered

pytestmark = pytest.mark.django_db(transaction=True)

# A receiver that deduplicates by idempotency key, as a payment provider does: every call it
# got (key, order, cents), and what it applied, once per key.
RECEIVED: list[tuple[str, str, int]] = []
APPLIED: dict[str, tuple[str, int]] = {}
CLOSED: list[str] = []  # the key of every close_account call that ran
# Called by ``charge`` before it charges, once (then cleared): what a test does while the
# parent's call is in flight.
IN_FLIGHT: list[Any] = []
# Holds close_account until the test lets it go (it times out first: its outcome is unknown).
RELEASE = threading.Event()


@tool(effect="non_idempotent")
def charge(order: str, cents: int, *, idempotency_key: str) -> str:
    """Charge a card."""
    if IN_FLIGHT:
        IN_FLIGHT.pop()()
    RECEIVED.append((idempotency_key, order, cents))
    APPLIED.setdefault(idempotency_key, (order, cents))
    return f"charged {cents} for {order}"


@tool(effect="irreversible", timeout=0.5)
def close_account(customer: str, *, idempotency_key: str) -> str:
    """Close an account for good."""
    CLOSED.append(idempotency_key)
    # Closed, but the answer never comes back in time: the worker abandons the call.
    RELEASE.wait(30)
    return f"closed {customer}"


@tool(effect="pure")
def delegate(task: str, *, idempotency_key: str) -> str:
    """Start a child run and wait for an event that never comes (the root stays waiting)."""
    spawn_run("fork-sec", task, key=idempotency_key)
    raise Wait(event="fork-sec-never", timeout=3600)


agent = Agent(
    name="fork-sec",
    version="v1",
    model="claude-test-1",
    system="You settle orders.",
    tools=[charge, close_account, delegate],
    max_tokens=1024,
)

# seq 1: the charge, 2: its result, 3: the end.
CHARGE = plan(("charge", {"order": "o-7", "cents": 999}), task="Charge o-7.")
CLOSE = plan(("close_account", {"customer": "c-1"}), task="Close c-1.")


@pytest.fixture(autouse=True)
def registered() -> Iterator[None]:
    with agents_registered(agent):
        RECEIVED.clear()
        APPLIED.clear()
        CLOSED.clear()
        IN_FLIGHT.clear()
        RELEASE.clear()
        yield
        RELEASE.set()  # an abandoned call ends


def drive(run: AgentRun) -> AgentRun:
    run_worker()
    run.refresh_from_db()
    return run


def staff(django_user_model: Any, name: str, *codenames: str) -> Client:
    user = django_user_model.objects.create_user(name, password="pw", is_staff=True)
    user.user_permissions.add(
        *Permission.objects.filter(codename__in=codenames, content_type__app_label="durable_agents")
    )
    client = Client()
    client.force_login(user)
    return client


def fork_url(run: AgentRun, seq: int, edit: bool = False) -> str:
    name = "fork_edit" if edit else "fork"
    return reverse(f"admin:durable_agents_agentrun_{name}", args=[run.pk, seq])


# -- 1. what a fork may repeat ----------------------------------------------------------------


def test_a_charge_in_flight_when_forked_is_made_by_the_fork_under_the_parents_key(
    fake_api: FakeAnthropic, admin_client: Client, da_settings: Any
) -> None:
    parent = api.start_run(agent.name, CHARGE, version=agent.version)
    made: list[AgentRun] = []
    pages: list[str] = []

    def fork_now() -> None:
        # The parent's charge has started; its result is not recorded: the fork inherits
        # nothing of step 1 and makes the call itself.
        made.append(api.fork_run(parent.pk, at_seq=1))
        pages.append(admin_client.get(fork_url(parent, 1)).content.decode())

    IN_FLIGHT.append(fork_now)
    parent = drive(parent)  # the worker takes the fork too, once it is pending
    assert (parent.status, parent.error) == (RunStatus.SUCCEEDED, "")
    [fork] = made
    # The fork page said so while the call was in flight.
    assert 'id="fork-unrecorded"' in pages[0]
    assert "charge" in pages[0]
    fork.refresh_from_db()
    assert (fork.status, fork.error) == (RunStatus.SUCCEEDED, "")
    # Two calls reached the receiver, under one key: it charged once.
    assert len(RECEIVED) == 2
    assert RECEIVED[0][0] == RECEIVED[1][0]
    assert APPLIED == {RECEIVED[0][0]: ("o-7", 999)}
    parent_key = RECEIVED[0][0]
    # Each run's result is its own row, found by (run_id, seq).
    assert ToolEffect.objects.get(run=parent, seq=1).key == RECEIVED[0][0]
    assert ToolEffect.objects.get(run=fork, seq=1).key != RECEIVED[0][0]

    # Retention deletes the parent afterwards: the fork's log and results stay found.
    da_settings(RETENTION_DAYS=1)
    long_ago = timezone.now() - datetime.timedelta(days=3)
    AgentRun.objects.filter(pk=parent.pk).update(finished_at=long_ago)
    assert apply_retention() == 1
    assert not AgentRun.objects.filter(pk=parent.pk).exists()
    assert ToolEffect.objects.get(run=fork, seq=1).result == "charged 999 for o-7"
    assert [s.seq for s in steps_of(fork.pk).order_by("seq")] == [0, 1, 2, 3]
    # A fork of the fork at the same turn reads the fork's result: nothing is charged.
    RECEIVED.clear()
    again = drive(api.fork_run(fork.pk, at_seq=1))
    assert (again.status, RECEIVED) == (RunStatus.SUCCEEDED, [])

    # A turn after the fork point is the fork's own: a new key.
    again = drive(api.fork_run(fork.pk, at_seq=0))
    assert again.status == RunStatus.SUCCEEDED
    assert len(RECEIVED) == 1
    assert RECEIVED[0][0] != parent_key


def test_a_replay_of_a_fork_gives_its_fork_point_calls_the_keys_they_were_made_with(
    fake_api: FakeAnthropic,
) -> None:
    parent = api.start_run(agent.name, CHARGE, version=agent.version)
    made: list[AgentRun] = []
    IN_FLIGHT.append(lambda: made.append(api.fork_run(parent.pk, at_seq=1)))
    drive(parent)
    [fork] = made
    drive(fork)
    [(parent_key, *_), (fork_sent, *_)] = RECEIVED
    assert fork_sent == parent_key  # the fork's call carried the parent's key
    RECEIVED.clear()
    report = replay(fork.pk, allow_effects=["charge"])
    assert report.calls == 1
    # Today's tool got the key the recorded call got (before: one derived from the fork's
    # own id, which no receiver had seen).
    assert [key for key, *_ in RECEIVED] == [parent_key]


def test_a_fork_at_a_turn_before_its_parents_own_fork_point_reads_who_made_the_calls(
    fake_api: FakeAnthropic,
) -> None:
    # The original charged at turn 1; an edited rerun forked it at the results (seq 2), so the
    # rerun never made turn 1's calls: a fork of the rerun at turn 1 finds them recorded by
    # the original, reads the result, and charges nothing (before, it looked in the rerun's
    # empty ledger and charged again under a key nobody had used).
    original = drive(api.start_run(agent.name, CHARGE, version=agent.version))
    assert original.status == RunStatus.SUCCEEDED
    assert len(RECEIVED) == 1
    results = steps_of(original.pk).get(seq=2).data()
    edited = [{**block, "content": "charged 999 for o-7 (edited)"} for block in results]
    rerun = drive(api.fork_run(original.pk, at_seq=2, edit=edited))
    assert rerun.status == RunStatus.SUCCEEDED
    again = drive(api.fork_run(rerun.pk, at_seq=1))
    assert again.status == RunStatus.SUCCEEDED
    assert len(RECEIVED) == 1, RECEIVED
    assert ToolEffect.objects.get(run=again, seq=1).result == "charged 999 for o-7"


def test_an_irreversible_call_with_an_unknown_outcome_refuses_the_fork_until_resolved(
    fake_api: FakeAnthropic, admin_client: Client, superuser: Any
) -> None:
    parent = drive(api.start_run(agent.name, CLOSE, version=agent.version))
    intent = ToolIntent.objects.get(run=parent)
    api.approve_intent(intent.pk, user=superuser)
    parent = drive(parent)  # the call runs, and is abandoned after its timeout
    intent.refresh_from_db()
    assert intent.status == IntentStatus.UNKNOWN
    assert CLOSED == [intent.key]

    before = AgentRun.objects.count()
    with pytest.raises(ForkRefused, match=rf"intent {intent.pk} \(close_account, call 0"):
        api.fork_run(parent.pk, at_seq=1)
    page = admin_client.get(fork_url(parent, 1)).content.decode()
    assert 'id="fork-in-doubt"' in page
    assert reverse("admin:durable_agents_toolintent_change", args=[intent.pk]) in page
    response = admin_client.post(fork_url(parent, 1), {"post": "yes"})
    assert response.status_code == 400
    assert f"intent {intent.pk}" in response.content.decode()
    assert AgentRun.objects.count() == before
    assert not ToolIntent.objects.exclude(pk=intent.pk).exists()

    # A person says it happened: the fork inherits the result and never closes again.
    api.resolve_intent(intent.pk, user=superuser, happened=True, result="closed c-1 (by hand)")
    fork = drive(api.fork_run(parent.pk, at_seq=1))
    assert (fork.status, fork.error) == (RunStatus.SUCCEEDED, "")
    assert CLOSED == [intent.key]
    assert ToolEffect.objects.get(run=fork, seq=1).result == "closed c-1 (by hand)"
    assert not ToolIntent.objects.filter(run=fork).exists()


# -- 2. who may fork ---------------------------------------------------------------------------


def test_the_fork_permission_alone_reads_nothing_and_starts_nothing(
    fake_api: FakeAnthropic, django_user_model: Any
) -> None:
    parent = drive(api.start_run(agent.name, CHARGE, version=agent.version))
    RECEIVED.clear()
    fork_only = staff(django_user_model, "fork-only", "fork_agentrun")
    assert (
        fork_only.get(reverse("admin:durable_agents_agentrun_change", args=[parent.pk])).status_code
        == 403
    )
    for url in (
        fork_url(parent, 2),
        fork_url(parent, 2, edit=True),
        fork_url(parent, 0, edit=True),
    ):
        assert fork_only.get(url).status_code == 403
    task = plan(("charge", {"order": "o-9", "cents": 999}), task="Charge o-9.")
    assert (
        fork_only.post(fork_url(parent, 0, edit=True), {"post": "yes", "edit": task}).status_code
        == 403
    )
    assert fork_only.post(fork_url(parent, 2), {"post": "yes"}).status_code == 403

    # To see runs and fork them: the unedited fork and the edit of tool results, not a task.
    viewer = staff(django_user_model, "view-fork", "view_agentrun", "fork_agentrun")
    page = viewer.get(reverse("admin:durable_agents_agentrun_change", args=[parent.pk]))
    assert fork_url(parent, 0, edit=True) not in page.content.decode()
    assert fork_url(parent, 2, edit=True) in page.content.decode()
    assert viewer.get(fork_url(parent, 0, edit=True)).status_code == 403
    assert (
        viewer.post(fork_url(parent, 0, edit=True), {"post": "yes", "edit": task}).status_code
        == 403
    )
    assert AgentRun.objects.filter(forked_from=parent).count() == 0

    # With the permission to add runs too, the edited task is a fork.
    adder = staff(django_user_model, "add-fork", "view_agentrun", "fork_agentrun", "add_agentrun")
    assert adder.get(fork_url(parent, 0, edit=True)).status_code == 200
    assert (
        adder.post(fork_url(parent, 0, edit=True), {"post": "yes", "edit": task}).status_code == 302
    )
    assert AgentRun.objects.get(forked_from=parent).task == task
    assert RECEIVED == []  # nothing ran: the fork waits for a worker


def test_fork_run_with_a_user_checks_the_same_permissions(
    fake_api: FakeAnthropic, django_user_model: Any
) -> None:
    parent = drive(api.start_run(agent.name, CHARGE, version=agent.version))

    def user(*codenames: str) -> Any:
        made = django_user_model.objects.create_user("-".join(codenames))
        made.user_permissions.add(*Permission.objects.filter(codename__in=codenames))
        return django_user_model.objects.get(pk=made.pk)  # a fresh permission cache

    with pytest.raises(PermissionDenied, match="view_agentrun"):
        api.fork_run(parent.pk, at_seq=2, user=user("fork_agentrun"))
    viewer = user("fork_agentrun", "view_agentrun")
    with pytest.raises(PermissionDenied, match="add_agentrun"):
        api.fork_run(parent.pk, at_seq=0, edit="Charge o-9 999.", user=viewer)
    assert AgentRun.objects.count() == 1
    assert api.fork_run(parent.pk, at_seq=2, user=viewer).forked_from_id == parent.pk
    adder = user("fork_agentrun", "view_agentrun", "add_agentrun")
    assert api.fork_run(parent.pk, at_seq=0, edit="Other.", user=adder).task == "Other."


# -- 3, 4. the edit form and hostile input ------------------------------------------------


def test_json_nested_too_deep_is_a_form_error_not_a_crash(
    fake_api: FakeAnthropic, admin_client: Client
) -> None:
    parent = drive(api.start_run(agent.name, CHARGE, version=agent.version))
    for depth in (100_000, 150):
        response = admin_client.post(
            fork_url(parent, 2, edit=True), {"post": "yes", "edit": "[" * depth + "]" * depth}
        )
        assert response.status_code == 400
        assert "The JSON nests deeper than 100 levels." in response.content.decode()
    assert not AgentRun.objects.filter(forked_from=parent).exists()


def test_the_task_box_holds_no_bidi_character_and_lists_each_above_it(
    fake_api: FakeAnthropic, admin_client: Client
) -> None:
    task = "Refund o-1\nthen \u202eexe.txt\u200b done"
    parent = drive(api.start_run(agent.name, task, version=agent.version))
    page = admin_client.get(fork_url(parent, 0, edit=True)).content.decode()
    assert "\u202e" not in page
    assert "\u200b" not in page
    assert "&#x202E;exe.txt&#x200B;" in page  # posted back as it is
    assert 'id="edit-hidden"' in page
    assert "line 2, column 6" in page
    assert "U+202E RIGHT-TO-LEFT OVERRIDE" in page
    assert "line 2, column 14" in page
    assert "U+200B ZERO WIDTH SPACE" in page
    # What the browser posts back (the characters themselves) forks with that task.
    response = admin_client.post(fork_url(parent, 0, edit=True), {"post": "yes", "edit": task})
    assert response.status_code == 302
    assert AgentRun.objects.get(forked_from=parent).task == task


# -- 5. a fork of a child run ------------------------------------------------------------------


def test_a_fork_of_a_child_run_stays_in_its_tree(fake_api: FakeAnthropic, da_settings: Any) -> None:
    root = api.start_run(
        agent.name, plan(("delegate", {"task": CHARGE}), task="Delegate."), version=agent.version
    )
    root = drive(root)
    assert root.status == RunStatus.WAITING
    child = AgentRun.objects.get(parent=root)
    assert child.status == RunStatus.SUCCEEDED
    fork = api.fork_run(child.pk, at_seq=0)
    assert (fork.parent_id, fork.root_id, fork.depth) == (root.pk, root.pk, 1)
    assert fork.spawn_key is None

    # The tree's limits count it: root, child and fork are three.
    da_settings(MAX_TREE_RUNS=3)
    with pytest.raises(ForkRefused, match="MAX_TREE_RUNS=3"):
        api.fork_run(child.pk, at_seq=0)
    assert AgentRun.objects.count() == 3

    # Cancelling the root cancels it, and no fork joins a cancelled tree afterwards.
    assert api.cancel_run(root.pk)
    fork.refresh_from_db()
    assert fork.status == RunStatus.CANCELLED
    da_settings(MAX_TREE_RUNS=100)
    with pytest.raises(ForkRefused, match="cancelled"):
        api.fork_run(child.pk, at_seq=0)
