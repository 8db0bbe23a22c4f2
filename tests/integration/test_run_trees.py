"""Trees of child runs: MAX_TREE_RUNS bounds a whole tree (MAX_CHILD_RUNS and MAX_RUN_DEPTH
alone allow exponentially many runs), and a cancel reaches every descendant in bounded
batches, settling what waited for a person on the way."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from durable_agents import api
from durable_agents.housekeeping.sweeps import sweep
from durable_agents.models import AgentRun, IntentStatus, RunStatus, ToolIntent
from durable_agents.store import current, portable_trees
from durable_agents.store.base import WaitRefused
from tests.conftest import run_worker
from tests.fakeserver import FakeAnthropic

pytestmark = pytest.mark.django_db(transaction=True)


def reload(run: AgentRun) -> AgentRun:
    return AgentRun.objects.get(pk=run.pk)


def spawn(parent: AgentRun, key: str, max_tree_runs: int | None) -> AgentRun:
    """A child of ``parent`` through the store, as ``spawn_run`` in a tool makes it."""
    child = api._new_run("tester", f"Child {key}.", None, None)
    child.parent_id = parent.pk
    child.spawn_key = key
    child.depth = parent.depth + 1
    run, created = current().spawn_run(
        child, json.dumps(child.task), max_children=100, max_tree_runs=max_tree_runs
    )
    assert created
    return run


def test_max_tree_runs_counts_the_whole_tree_not_one_parents_children() -> None:
    root = api.start_run("tester", "The root.")
    child = spawn(root, "c", max_tree_runs=4)
    grandchild = spawn(child, "g", max_tree_runs=4)
    assert (child.root_id, grandchild.root_id) == (root.pk, root.pk)
    spawn(grandchild, "gg", max_tree_runs=4)  # the tree's 4th run
    # Each parent has one child, far below MAX_CHILD_RUNS: the tree is full all the same.
    with pytest.raises(WaitRefused, match=r"tree holds 4 runs already.*MAX_TREE_RUNS=4"):
        spawn(child, "c2", max_tree_runs=4)
    with pytest.raises(WaitRefused, match="MAX_TREE_RUNS"):
        spawn(root, "c3", max_tree_runs=4)
    assert AgentRun.objects.count() == 4
    # Another tree has its own count.
    other = api.start_run("tester", "Another root.")
    assert spawn(other, "c", max_tree_runs=4).root_id == other.pk


def test_a_spawn_past_max_tree_runs_is_a_tool_error_the_model_sees(
    fake_api: FakeAnthropic, receiver: Any, da_settings: Any
) -> None:
    da_settings(MAX_TREE_RUNS=3)
    task = 'Wait for something.\n@fan_out {"topics": ["a", "b", "c"]}'
    run = api.start_run("waiter", task)
    run_worker()
    done = reload(run)
    assert done.status == RunStatus.SUCCEEDED, done.error
    assert AgentRun.objects.filter(parent_id=run.pk).count() == 2  # the root and two children
    step = done.steps.filter(kind="tool_result").order_by("seq").first()
    assert step is not None
    [block] = json.loads(step.payload)
    assert block["is_error"] is True
    assert "MAX_TREE_RUNS" in block["content"]


def _tree(fanout: int, depth: int) -> tuple[AgentRun, list[uuid.UUID]]:
    """A root with ``fanout`` children per run down to ``depth`` (rows written directly)."""
    root = api.start_run("tester", "The root of a big tree.")
    AgentRun.objects.filter(pk=root.pk).update(status=RunStatus.WAITING)
    template = AgentRun.objects.get(pk=root.pk)
    everyone: list[uuid.UUID] = []
    generation = [root.pk]
    for level in range(1, depth + 1):
        rows = [
            AgentRun(
                id=uuid.uuid4(),
                agent=template.agent,
                prompt_version=template.prompt_version,
                fingerprint=template.fingerprint,
                model=template.model,
                task="A descendant.",
                status=RunStatus.PENDING,
                parent_id=parent,
                root_id=root.pk,
                spawn_key=str(i),
                depth=level,
            )
            for parent in generation
            for i in range(fanout)
        ]
        AgentRun.objects.bulk_create(rows)
        generation = [row.pk for row in rows]
        everyone += generation
    return root, everyone


def test_a_cancel_reaches_every_descendant_in_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(portable_trees, "CANCEL_BATCH", 10, raising=False)
    root, descendants = _tree(fanout=3, depth=4)  # 3 + 9 + 27 + 81 = 120 descendants
    with CaptureQueriesContext(connection) as queries:
        assert api.cancel_run(root.pk)
    assert reload(root).status == RunStatus.CANCELLED
    statuses = set(
        AgentRun.objects.filter(pk__in=descendants).values_list("status", flat=True).distinct()
    )
    assert statuses == {RunStatus.CANCELLED}
    # Each statement that cancels runs names at most CANCEL_BATCH of them.
    cancels = [
        q["sql"]
        for q in queries.captured_queries
        if q["sql"].startswith('UPDATE "agent_run" SET "status"')
    ]
    assert len(cancels) >= 1 + 120 // 10
    named = [sum(1 for d in descendants if d.hex in q or str(d) in q) for q in cancels]
    assert max(named) <= 10
    assert sum(named) == 120


def test_cancel_rejects_the_intents_that_wait_for_approval(receiver: Any) -> None:
    run = api.start_run("tester", '@drop_table {"table": "orders"}')
    run_worker()
    [intent] = ToolIntent.objects.filter(run_id=run.pk)
    assert intent.status == IntentStatus.PENDING
    # A child run of it with an intent waiting too: the cascade settles it as well.
    child = api.start_run("tester", '@drop_table {"table": "users"}')
    run_worker()
    AgentRun.objects.filter(pk=child.pk).update(parent_id=run.pk, root_id=run.pk)
    [child_intent] = ToolIntent.objects.filter(run_id=child.pk)

    assert api.cancel_run(run.pk)
    for each in (intent, child_intent):
        each.refresh_from_db()
        assert (each.status, each.reason) == (IntentStatus.REJECTED, "run cancelled")
        assert each.decided_at is not None
    assert not ToolIntent.objects.awaiting_person().exists()
    # Approving it afterwards changes nothing: it stays rejected.
    boss = _superuser()
    assert api.approve_intent(intent.pk, user=boss).status == IntentStatus.REJECTED
    assert not receiver.applied("drop")


def _superuser() -> Any:
    from django.contrib.auth import get_user_model

    return get_user_model().objects.create_superuser("boss", "boss@example.com", "pw")


def test_the_sweep_finishes_a_cascade_a_dead_process_left_behind() -> None:
    root, descendants = _tree(fanout=2, depth=3)
    # What a process that died after cancelling the root and one batch leaves behind.
    AgentRun.objects.filter(pk=root.pk).update(status=RunStatus.CANCELLED)
    children = list(AgentRun.objects.filter(parent_id=root.pk).values_list("pk", flat=True))
    AgentRun.objects.filter(pk=children[0]).update(status=RunStatus.CANCELLED)
    # The other child of the root and the two children of the cancelled one.
    assert sweep()["cascades_finished"] == 3
    statuses = set(AgentRun.objects.filter(pk__in=descendants).values_list("status", flat=True))
    assert statuses == {RunStatus.CANCELLED}
