"""Forks end to end: ``fork_run`` on recorded runs, driven by an in-process worker through the
real SDK over HTTP to the offline model (``FakeAnthropic``), which checks every thinking
signature it reads: a fork that sent anything but the parent's bytes would get a 400.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Iterator
from typing import Any

import pytest
from django.contrib.auth.models import Permission
from django.core.exceptions import PermissionDenied
from django.utils import timezone

from durable_agents import Agent, api, tool
from durable_agents.declare.agents import registry
from durable_agents.housekeeping.sweeps import apply_retention
from durable_agents.models import (
    AgentRun,
    AgentStep,
    IntentStatus,
    RunStatus,
    SharedSteps,
    ToolEffect,
    ToolIntent,
    steps_of,
)
from durable_agents.testing import plan
from tests.conftest import run_worker
from tests.fakeserver import FakeAnthropic, api_error
from tests.integration.conftest import agents_registered

pytestmark = pytest.mark.django_db(transaction=True)

CHARGES: list[str] = []  # the idempotency key of every call of ``charge`` that ran
CLOSED: list[str] = []
LOOKUPS: list[str] = []


@tool(effect="pure")
def lookup(order: str) -> dict[str, Any]:
    """Look an order up."""
    LOOKUPS.append(order)
    return {"order": order, "total": 120}


@tool(effect="non_idempotent")
def charge(order: str, cents: int, *, idempotency_key: str) -> str:
    """Charge a card."""
    CHARGES.append(idempotency_key)
    return f"charged {cents} for {order}"


@tool(effect="irreversible")
def close_account(customer: str, *, idempotency_key: str) -> str:
    """Close an account for good."""
    CLOSED.append(idempotency_key)
    return f"closed {customer}"


TOOLS = [lookup, charge, close_account]
THINKING = {"type": "enabled", "budget_tokens": 1024}
thinker = Agent(
    name="fork-thinker",
    version="v1",
    model="claude-test-1",
    system="You settle orders.",
    tools=TOOLS,
    thinking=THINKING,
    max_tokens=2048,
)
# Another version: only max_tokens differs (not bound by thinking signatures).
thinker_roomier = Agent(
    name="fork-thinker",
    version="v1-roomier",
    model="claude-test-1",
    system="You settle orders.",
    tools=TOOLS,
    thinking=THINKING,
    max_tokens=4096,
)
# Another version with another system prompt (bound by thinking signatures).
thinker_reworded = Agent(
    name="fork-thinker",
    version="v2",
    model="claude-test-1",
    system="You settle orders, politely.",
    tools=TOOLS,
    thinking=THINKING,
    max_tokens=2048,
)
plain = Agent(
    name="fork-plain",
    version="v1",
    model="claude-test-1",
    system="You settle orders.",
    tools=TOOLS,
    max_tokens=1024,
)
plain_reworded = Agent(
    name="fork-plain",
    version="v2",
    model="claude-test-1",
    system="You settle orders, politely.",
    tools=TOOLS,
    max_tokens=1024,
)
AGENTS = [thinker, thinker_roomier, thinker_reworded, plain, plain_reworded]

# seq 1: lookup, 2: its result, 3: charge, 4: its result, 5: charge, 6: its result, 7: the end.
TASK = plan(
    ("lookup", {"order": "o-1"}),
    ("charge", {"order": "o-1", "cents": 120}),
    ("charge", {"order": "o-1", "cents": 5}),
    task="Settle order o-1.",
)


@pytest.fixture(autouse=True)
def registered() -> Iterator[None]:
    with agents_registered(*AGENTS):
        CHARGES.clear()
        CLOSED.clear()
        LOOKUPS.clear()
        yield


def finished(agent: Agent, task: str = TASK) -> AgentRun:
    run = api.start_run(agent.name, task, version=agent.version)
    run_worker()
    run.refresh_from_db()
    assert (run.status, run.error) == (RunStatus.SUCCEEDED, "")
    return run


def log(run: AgentRun) -> list[tuple[int, str, str]]:
    return list(steps_of(run.pk).order_by("seq").values_list("seq", "kind", "payload"))


def drive(run: AgentRun) -> AgentRun:
    run_worker()
    run.refresh_from_db()
    return run


def test_a_fork_sends_the_parents_request_byte_for_byte_and_goes_on(
    fake_api: FakeAnthropic,
) -> None:
    parent = finished(thinker)
    parent_requests = [r.body for r in fake_api.ok_requests()]
    assert len(parent_requests) == 4
    CHARGES.clear()

    fork = api.fork_run(parent.pk, at_seq=4)
    assert (fork.forked_from_id, fork.fork_seq, fork.last_seq) == (parent.pk, 4, 4)
    assert fork.status == RunStatus.PENDING
    # The prefix is shared, not copied: no step row of the fork's own yet, one stretch.
    assert AgentStep.objects.filter(run_id=fork.pk).count() == 0
    assert list(SharedSteps.objects.filter(fork=fork).values_list("source_id", "lo", "hi")) == [
        (parent.pk, 0, 5)
    ]
    assert log(fork) == log(parent)[:5]

    fork = drive(fork)
    assert (fork.status, fork.error) == (RunStatus.SUCCEEDED, "")
    fork_requests = [r.body for r in fake_api.ok_requests()][4:]
    # Its first request is the one the parent sent after step 4, byte for byte (thinking
    # signatures included: the offline model checked them).
    assert fork_requests[0] == parent_requests[2]
    assert len(fork_requests) == 2
    assert [s[:2] for s in log(fork)] == [s[:2] for s in log(parent)]
    assert log(fork)[:5] == log(parent)[:5]
    assert fork.result == parent.result
    # Its own calls: the charge of turn 5 ran again, under the fork's key.
    assert len(CHARGES) == 1
    parent_keys = set(ToolEffect.objects.filter(run=parent).values_list("key", flat=True))
    assert CHARGES[0] not in parent_keys
    assert ToolEffect.objects.filter(run=fork, key=CHARGES[0], seq=5).exists()


def test_calls_before_the_fork_point_are_not_made_again(fake_api: FakeAnthropic) -> None:
    parent = finished(plain)
    assert len(CHARGES) == 2
    parent_charges = list(CHARGES)
    CHARGES.clear()
    LOOKUPS.clear()

    # At the model turn asking for the second charge: that call was recorded by the parent,
    # so the fork reads its result (under a key of its own) and charges nothing.
    at_turn = drive(api.fork_run(parent.pk, at_seq=5))
    assert (at_turn.status, at_turn.error) == (RunStatus.SUCCEEDED, "")
    assert CHARGES == []
    inherited = ToolEffect.objects.get(run=at_turn, seq=5)
    recorded = ToolEffect.objects.get(run=parent, seq=5)
    assert inherited.result == recorded.result
    assert inherited.key != recorded.key
    assert log(at_turn)[6][2] == log(parent)[6][2]  # the same results, as sent

    # At the results of the first charge: the second charge is after the fork point, the
    # fork's own, made once with a key of the fork.
    after = drive(api.fork_run(parent.pk, at_seq=4))
    assert (after.status, after.error) == (RunStatus.SUCCEEDED, "")
    assert len(CHARGES) == 1
    assert CHARGES[0] not in parent_charges
    assert LOOKUPS == []  # the lookup of turn 1 is in the shared log, never made again


def test_an_irreversible_call_after_the_fork_point_needs_a_new_approval(
    fake_api: FakeAnthropic, superuser: Any
) -> None:
    task = plan(("close_account", {"customer": "c-9"}), task="Close c-9.")
    parent = api.start_run(plain.name, task, version=plain.version)
    run_worker()
    intent = ToolIntent.objects.get(run=parent)
    api.approve_intent(intent.pk, user=superuser)
    parent = drive(parent)
    assert parent.status == RunStatus.SUCCEEDED
    assert len(CLOSED) == 1

    fork = drive(api.fork_run(parent.pk, at_seq=0))
    assert fork.status == RunStatus.WAITING
    fresh = ToolIntent.objects.get(run=fork)
    assert fresh.status == IntentStatus.PENDING
    assert fresh.key != intent.key
    assert len(CLOSED) == 1  # nothing ran without the approval
    api.approve_intent(fresh.pk, user=superuser)
    fork = drive(fork)
    assert fork.status == RunStatus.SUCCEEDED
    assert CLOSED == [intent.key, fresh.key]


def test_an_edited_tool_result_is_what_the_fork_sends(fake_api: FakeAnthropic) -> None:
    parent = finished(thinker)
    original = json.loads(log(parent)[2][2])
    edited = [{**original[0], "content": '{"order": "o-1", "total": 95}'}]
    fork = api.fork_run(parent.pk, at_seq=2, edit=edited)
    assert [s[0] for s in AgentStep.objects.filter(run=fork).values_list("seq")] == [2]
    assert list(SharedSteps.objects.filter(fork=fork).values_list("lo", "hi")) == [(0, 2)]
    sent_before = len(fake_api.ok_requests())
    fork = drive(fork)
    assert (fork.status, fork.error) == (RunStatus.SUCCEEDED, "")
    first = fake_api.ok_requests()[sent_before].json()
    assert first["messages"][2] == {"role": "user", "content": edited}
    assert json.loads(log(fork)[2][2]) == edited
    assert log(parent)[2][2] != log(fork)[2][2]  # the parent is untouched


def test_an_edited_task(fake_api: FakeAnthropic) -> None:
    parent = finished(plain)
    fork = api.fork_run(parent.pk, at_seq=0, edit="Settle order o-1.\nNothing to do.")
    assert fork.task == "Settle order o-1.\nNothing to do."
    fork = drive(fork)
    assert (fork.status, fork.error) == (RunStatus.SUCCEEDED, "")
    assert fork.last_seq == 1  # the edited plan calls nothing
    assert fake_api.ok_requests()[-1].json()["messages"] == [
        {"role": "user", "content": "Settle order o-1.\nNothing to do."}
    ]


def test_another_version_or_model_where_thinking_allows_it(fake_api: FakeAnthropic) -> None:
    thought = finished(thinker)
    # max_tokens is not bound by signatures: allowed.
    roomier = drive(api.fork_run(thought.pk, at_seq=4, version="v1-roomier"))
    assert (roomier.status, roomier.error) == (RunStatus.SUCCEEDED, "")
    assert roomier.prompt_version == "v1-roomier"
    assert fake_api.ok_requests()[-1].json()["max_tokens"] == 4096
    before = AgentRun.objects.count()
    # The system prompt or the model: refused, naming the block.
    with pytest.raises(ValueError, match=r"step 1 \(a model turn\), content block 0 \(thinking\)"):
        api.fork_run(thought.pk, at_seq=4, version="v2")
    with pytest.raises(ValueError, match=r"different model: step 1"):
        api.fork_run(thought.pk, at_seq=4, model="claude-test-2")
    assert AgentRun.objects.count() == before
    # Before the first thinking block there is nothing to bind: allowed.
    early = drive(api.fork_run(thought.pk, at_seq=0, model="claude-test-2"))
    assert (early.status, early.error) == (RunStatus.SUCCEEDED, "")

    # Without thinking in the log, another version and model are fine.
    unthought = finished(plain)
    moved = drive(api.fork_run(unthought.pk, at_seq=4, version="v2", model="claude-test-2"))
    assert (moved.status, moved.error) == (RunStatus.SUCCEEDED, "")
    body = fake_api.ok_requests()[-1].json()
    assert (body["model"], body["system"]) == ("claude-test-2", "You settle orders, politely.")


def test_a_fork_of_a_fork_and_retention_of_what_it_was_forked_from(
    fake_api: FakeAnthropic, da_settings: Any
) -> None:
    root = finished(plain)
    first = drive(api.fork_run(root.pk, at_seq=4))
    second = api.fork_run(first.pk, at_seq=6)
    # Steps 0-4 from the root, 5-6 from the first fork.
    assert list(SharedSteps.objects.filter(fork=second).values_list("source_id", "lo", "hi")) == [
        (root.pk, 0, 5),
        (first.pk, 5, 7),
    ]
    assert log(second) == log(first)[:7]
    expected = log(second)
    messages = api.messages_for(second.pk)

    # The root and the first fork end long ago: retention deletes them; the second fork's
    # log is copied in first, whole.
    da_settings(RETENTION_DAYS=1)
    long_ago = timezone.now() - datetime.timedelta(days=3)
    AgentRun.objects.filter(pk__in=[root.pk, first.pk]).update(finished_at=long_ago)
    assert apply_retention() == 2
    assert not AgentRun.objects.filter(pk__in=[root.pk, first.pk]).exists()
    assert not SharedSteps.objects.filter(fork=second).exists()
    assert log(second) == expected
    assert api.messages_for(second.pk) == messages
    second.refresh_from_db()
    assert second.forked_from_id is None
    assert second.fork_seq == 6
    second = drive(second)
    assert (second.status, second.error) == (RunStatus.SUCCEEDED, "")


def test_a_run_a_fork_reads_cannot_be_deleted_by_hand(fake_api: FakeAnthropic) -> None:
    from django.db.models import RestrictedError

    root = finished(plain)
    api.fork_run(root.pk, at_seq=2)
    with pytest.raises(RestrictedError):
        AgentRun.objects.filter(pk=root.pk).delete()


def test_a_dead_run_forked_before_the_step_that_killed_it(fake_api: FakeAnthropic) -> None:
    # The model call after the lookup's result is refused (400): the run goes to the dead
    # letter with steps 0-2 committed.
    task = plan(("lookup", {"order": "o-1"}), ("charge", {"order": "o-1", "cents": 1}))
    run = api.start_run(plain.name, task, version=plain.version)
    # (A fault queued while the first request is answered is the answer to the second.)
    fake_api.before_answer = lambda body: (
        fake_api.fail_next(api_error(400, "invalid_request_error", "prompt is too long"))
        if len(body["messages"]) == 1
        else None
    )
    run = drive(run)
    assert (run.status, run.last_seq) == (RunStatus.DEAD, 2)
    fake_api.before_answer = None
    fork = drive(api.fork_run(run.pk, at_seq=2))
    assert (fork.status, fork.error) == (RunStatus.SUCCEEDED, "")
    assert LOOKUPS == ["o-1"]  # made once, by the run, and read by the fork
    assert len(CHARGES) == 1
    run.refresh_from_db()
    assert run.status == RunStatus.DEAD  # the original stays in the dead letter


@pytest.mark.parametrize(
    ("at_seq", "edit", "message"),
    [
        (-1, None, "there is no step -1"),
        (99, None, "there is no step 99"),
        (True, None, "an int, not bool"),
        ("2", None, "an int, not str"),
        (1, [], "is a model turn, which cannot be edited"),
        (0, ["task"], "a string, not list"),
        (0, "   ", "empty"),
        (0, "nul \x00 here", "NUL"),
        (2, {"type": "tool_result"}, "the list of its tool_result blocks"),
        (2, [], "answers 1 tool call"),
        (2, [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "x"}], "answers"),
        (2, [{"type": "text", "text": "x"}], '"type": "tool_result"'),
        (2, "BLOCK:content=7", '"content" is a string or a list'),
        (2, "BLOCK:is_error=yes", '"is_error" is true or false'),
        (2, "BLOCK:extra=1", "keys a tool_result cannot have: extra"),
        (2, "BLOCK:content=\ud800", "lone surrogate"),
        (2, "BLOCK:content=\x00", "NUL"),
        (2, "BLOCK:content=nan", "not JSON"),
        (2, "BLOCK:content=set", '"content" is a string or a list'),
        (2, "BLOCK:content=deep", "deeper than"),
    ],
)
def test_bad_forks_are_refused_and_create_nothing(
    fake_api: FakeAnthropic, at_seq: Any, edit: Any, message: str
) -> None:
    parent = finished(plain)
    if isinstance(edit, str) and edit.startswith("BLOCK:"):
        field, _, value = edit[len("BLOCK:") :].partition("=")
        block = json.loads(log(parent)[2][2])[0]
        shaped: Any = {
            "7": 7,
            "nan": [{"type": "text", "text": float("nan")}],
            "set": {1, 2},
            "deep": [{"type": "text", "text": "x", "n": _nested(120)}],
        }.get(value, value)
        edit = [{**block, field: shaped}]
    before = (AgentRun.objects.count(), AgentStep.objects.count(), SharedSteps.objects.count())
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        api.fork_run(parent.pk, at_seq=at_seq, edit=edit)
    after = (AgentRun.objects.count(), AgentStep.objects.count(), SharedSteps.objects.count())
    assert after == before


def _nested(depth: int) -> Any:
    value: Any = "bottom"
    for _ in range(depth):
        value = [value]
    return value


def test_forks_of_what_cannot_be_forked(fake_api: FakeAnthropic, django_user_model: Any) -> None:
    parent = finished(plain)
    with pytest.raises(ValueError, match="no run 'not-an-id'"):
        api.fork_run("not-an-id", at_seq=0)
    with pytest.raises(ValueError, match="no run"):
        api.fork_run("6f1c0d7e-0000-4000-8000-000000000000", at_seq=0)
    with pytest.raises(ValueError, match="version 'v9' is not registered"):
        api.fork_run(parent.pk, at_seq=0, version="v9")
    with pytest.raises(ValueError, match="a model name"):
        api.fork_run(parent.pk, at_seq=0, model="")
    clerk = django_user_model.objects.create_user("clerk", password="x")
    with pytest.raises(PermissionDenied, match="fork_agentrun"):
        api.fork_run(parent.pk, at_seq=0, user=clerk)
    registry.unregister(plain.name, plain.version)
    try:
        with pytest.raises(ValueError, match="version 'v1' is not registered"):
            api.fork_run(parent.pk, at_seq=0)
    finally:
        registry.register(plain)
    assert AgentRun.objects.count() == 1
    clerk.user_permissions.add(Permission.objects.get(codename="fork_agentrun"))
    clerk = django_user_model.objects.get(pk=clerk.pk)  # a fresh permission cache
    # A fork reads the run: forking needs the permission to view runs too.
    with pytest.raises(PermissionDenied, match="view_agentrun"):
        api.fork_run(parent.pk, at_seq=0, user=clerk)
    clerk.user_permissions.add(Permission.objects.get(codename="view_agentrun"))
    clerk = django_user_model.objects.get(pk=clerk.pk)
    assert api.fork_run(parent.pk, at_seq=0, user=clerk).forked_from_id == parent.pk
