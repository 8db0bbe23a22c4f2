"""A model turn whose calls are all plain pure ones is committed with their results.

The turn waits, answered but not committed, for its calls (``FUSE_WITHIN_SECONDS`` at most),
then goes with their results in one commit (``Store.append_turn_and_results``; one statement on
PostgreSQL). A call that runs longer has the turn committed while it runs, as any turn is. A real
worker, the real SDK against the fake API, on both databases.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from durable_agents.api import start_run
from durable_agents.engine import runner
from durable_agents.engine.worker import Worker
from durable_agents.flow.pricing import Usage
from durable_agents.models import AgentRun, AgentStep, StepKind, ToolEffect
from durable_agents.store import Claim, StepWrite, current
from tests.conftest import Receiver, wait_for
from tests.fakeserver import FakeAnthropic

pytestmark = pytest.mark.django_db(transaction=True)

THREE_TURNS_PURE = '@lookup {"key": "a"}\n@lookup {"key": "b"}\n@lookup {"key": "c"}'


class Commits:
    """Which store method committed which seqs, in order (the worker's commits all go
    through the store the runner uses)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.made: list[tuple[str, tuple[int, ...]]] = []
        chosen = current()
        append_step = chosen.append_step
        together = chosen.append_turn_and_results

        inside = threading.local()  # a store may commit the two through its append_step

        def one(claim: Any, step: StepWrite, *args: Any, **kwargs: Any) -> bool:
            if not getattr(inside, "two", False):
                self.made.append(("append_step", (step.seq,)))
            return append_step(claim, step, *args, **kwargs)

        def two(claim: Any, turn: StepWrite, results: StepWrite) -> bool:
            self.made.append(("append_turn_and_results", (turn.seq, results.seq)))
            inside.two = True
            try:
                return together(claim, turn, results)
            finally:
                inside.two = False

        monkeypatch.setattr(chosen, "append_step", one)
        monkeypatch.setattr(chosen, "append_turn_and_results", two)


def records_on_their_own(monkeypatch: pytest.MonkeyPatch) -> list[ToolEffect]:
    """The calls the store records in statements of their own (``record_effect``), in order."""
    recorded: list[ToolEffect] = []
    chosen = current()
    record_effect = chosen.record_effect

    def record(effect: ToolEffect) -> None:
        recorded.append(effect)
        record_effect(effect)

    monkeypatch.setattr(chosen, "record_effect", record)
    return recorded


@contextlib.contextmanager
def slow_call_running(receiver: Receiver) -> Iterator[None]:
    """A burst worker on a thread of its own; inside, its run's ``slow`` call has started. On
    the way out the call is let go and the worker is waited for."""
    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    try:
        wait_for(lambda: receiver.marker("slow-started"), timeout=30)
        yield
    finally:
        (receiver.directory / "slow-release").touch()
        thread.join(60)


def kinds(run_id: Any) -> list[tuple[int, str]]:
    return list(AgentStep.objects.filter(run_id=run_id).order_by("seq").values_list("seq", "kind"))


def work() -> Worker:
    worker = Worker(burst=True, handle_signals=False)
    worker.run()
    return worker


def test_a_pure_turn_goes_with_its_results(
    fake_api: FakeAnthropic, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A window no thread scheduling can outlast: the calls end within it on any machine.
    monkeypatch.setattr(runner, "FUSE_WITHIN_SECONDS", 60.0)
    commits = Commits(monkeypatch)
    run = start_run("tester", THREE_TURNS_PURE)
    work()
    run = AgentRun.objects.get(pk=run.pk)
    assert run.status == "succeeded", run.error
    # A claim's first turn is committed before its calls; the later ones go with theirs.
    assert commits.made[:4] == [
        ("append_step", (1,)),
        ("append_step", (2,)),
        ("append_turn_and_results", (3, 4)),
        ("append_turn_and_results", (5, 6)),
    ]
    turn, results = StepKind.MODEL_TURN, StepKind.TOOL_RESULT
    assert kinds(run.pk) == [
        (0, StepKind.TASK),
        (1, turn),
        (2, results),
        (3, turn),
        (4, results),
        (5, turn),
        (6, results),
        (7, turn),
    ]
    # The third call sent the results as they were committed with their turn, and the turns
    # were counted.
    sent = json.loads(fake_api.requests[2].body)["messages"]
    stored = AgentStep.objects.get(run_id=run.pk, seq=4).payload
    assert sent[4] == {"role": "user", "content": json.loads(stored)}
    assert run.tokens_used > 0
    assert ToolEffect.objects.filter(run_id=run.pk, seq__in=[1, 3, 5]).count() == 3


def test_a_turn_of_several_pure_calls_commits_once(
    fake_api: FakeAnthropic, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runner, "FUSE_WITHIN_SECONDS", 60.0)
    commits = Commits(monkeypatch)
    recorded = records_on_their_own(monkeypatch)
    # The second turn asks for three pure calls and one to a tool that does not exist.
    run = start_run(
        "tester",
        '@lookup {"key": "a"}\n'
        '@lookup {"key": "b"} && lookup {"key": "c"} && no_such_tool {} && lookup {"key": "d"}',
    )
    work()
    run = AgentRun.objects.get(pk=run.pk)
    assert run.status == "succeeded", run.error
    # No call recorded on its own: the turn, its results and its four calls, one statement.
    assert recorded == []
    assert commits.made[:3] == [
        ("append_step", (1,)),
        ("append_step", (2,)),
        ("append_turn_and_results", (3, 4)),
    ]
    ledger = ToolEffect.objects.filter(run_id=run.pk, seq=3).order_by("call_index")
    assert [(e.call_index, e.tool, e.is_error) for e in ledger] == [
        (0, "lookup", False),
        (1, "lookup", False),
        (2, "no_such_tool", True),
        (3, "lookup", False),
    ]
    stored = json.loads(AgentStep.objects.get(run_id=run.pk, seq=4).payload)
    assert [block["content"] for block in stored] == [e.result for e in ledger]


def test_a_call_with_a_side_effect_is_recorded_at_once_after_the_pure_ones_before_it(
    fake_api: FakeAnthropic, monkeypatch: pytest.MonkeyPatch
) -> None:
    recorded = records_on_their_own(monkeypatch)
    run = start_run(
        "tester",
        '@lookup {"key": "a"} && set_flag {"name": "f", "value": true} && lookup {"key": "b"}'
        ' && set_flag {"name": "g", "value": true}',
    )
    work()
    run = AgentRun.objects.get(pk=run.pk)
    assert run.status == "succeeded", run.error
    # The idempotent call is recorded as soon as it completes, the pure call before it first
    # (before the side effect starts); the pure call before the last call is recorded before
    # that call starts; the last call goes with the tool_result step.
    assert [(e.seq, e.call_index) for e in recorded] == [(1, 0), (1, 1), (1, 2)]
    assert ToolEffect.objects.filter(run_id=run.pk, seq=1).count() == 4


def test_the_pure_calls_before_an_intent_are_recorded_as_the_run_parks(
    fake_api: FakeAnthropic,
) -> None:
    run = start_run("tester", '@lookup {"key": "a"} && drop_table {"table": "t1"}')
    work()
    run = AgentRun.objects.get(pk=run.pk)
    assert run.status == "waiting", run.error
    assert list(
        ToolEffect.objects.filter(run_id=run.pk).values_list("seq", "call_index", "tool")
    ) == [(1, 0, "lookup")]


def test_a_slow_pure_call_has_its_turn_committed_while_it_runs(
    fake_api: FakeAnthropic, receiver: Receiver
) -> None:
    # The second turn calls the slow tool (a claim's first turn never waits for its calls).
    run = start_run("tester", '@lookup {"key": "a"}\n@slow {"seconds": 3600}')
    with slow_call_running(receiver):
        # The call goes on; its turn does not wait for it.
        wait_for(lambda: AgentStep.objects.filter(run_id=run.pk, seq=3).exists(), timeout=30)
        assert not AgentStep.objects.filter(run_id=run.pk, seq=4).exists()
    run = AgentRun.objects.get(pk=run.pk)
    assert run.status == "succeeded", run.error
    assert [seq for seq, _ in kinds(run.pk)] == [0, 1, 2, 3, 4, 5]


def test_a_slow_pure_call_has_the_calls_before_it_recorded_while_it_runs(
    fake_api: FakeAnthropic, receiver: Receiver
) -> None:
    run = start_run(
        "tester",
        '@lookup {"key": "a"}\n@lookup {"key": "b"} && slow {"seconds": 3600}',
    )
    with slow_call_running(receiver):
        # The slow call goes on; its turn, and the call that ended before it, do not wait.
        wait_for(lambda: ToolEffect.objects.filter(run_id=run.pk, seq=3).exists(), timeout=30)
        assert AgentStep.objects.filter(run_id=run.pk, seq=3).exists()
        assert list(
            ToolEffect.objects.filter(run_id=run.pk, seq=3).values_list("call_index", "tool")
        ) == [(0, "lookup")]
    run = AgentRun.objects.get(pk=run.pk)
    assert run.status == "succeeded", run.error
    assert ToolEffect.objects.filter(run_id=run.pk, seq=3).count() == 2


def _claimed() -> Claim:
    start_run("tester", "t")
    [claim] = current().claim_runs("w1", 30)
    return claim


def _turn_and_results(claim: Claim) -> tuple[StepWrite, StepWrite]:
    turn = StepWrite(
        1,
        StepKind.MODEL_TURN,
        '{"role": "assistant", "content": [], "stop_reason": "tool_use"}',
        request_id="req_1",
        tokens=30,
        usage=Usage(input_tokens=20, output_tokens=10),
    )
    effect = ToolEffect(
        key="k-1", run_id=claim.run_id, seq=1, call_index=0, tool="lookup", result="v"
    )
    results = StepWrite(2, StepKind.TOOL_RESULT, "[]", effects=[effect])
    return turn, results


def test_both_steps_are_committed_together_and_a_retry_finds_them() -> None:
    claim = _claimed()
    turn, results = _turn_and_results(claim)
    with CaptureQueriesContext(connection) as ctx:
        assert current().append_turn_and_results(claim, turn, results) is True
    if connection.vendor == "postgresql":
        inserts = [q for q in ctx.captured_queries if "INSERT INTO agent_step" in q["sql"]]
        assert len(inserts) == 1, "one statement for both steps"
    run = AgentRun.objects.get(pk=claim.run_id)
    assert (run.last_seq, run.tokens_used) == (2, 30)
    assert [seq for seq, _ in kinds(run.pk)] == [0, 1, 2]
    assert AgentStep.objects.get(run_id=run.pk, seq=1).request_id == "req_1"
    assert AgentStep.objects.get(run_id=run.pk, seq=2).request_id is None
    assert ToolEffect.objects.filter(key="k-1").count() == 1
    # Sent again (a retry whose first try landed): this claim's own steps, nothing doubled.
    assert current().append_turn_and_results(claim, turn, results) is True
    run = AgentRun.objects.get(pk=claim.run_id)
    assert (run.last_seq, run.tokens_used) == (2, 30)
    assert [seq for seq, _ in kinds(run.pk)] == [0, 1, 2]


def test_a_failed_fence_appends_neither_and_counts_the_paid_turn() -> None:
    claim = _claimed()
    turn, results = _turn_and_results(claim)
    stale = Claim(claim.run, claim.owner, claim.attempt + 1, claim.lease_seconds)
    assert current().append_turn_and_results(stale, turn, results) is False
    run = AgentRun.objects.get(pk=claim.run_id)
    assert [seq for seq, _ in kinds(run.pk)] == [0]
    assert run.last_seq == 0
    # Paid for whatever the fence says. The pure call's result goes only with its turn: a
    # later claim's own turn at this seq reads no ledger (it is fresh) and runs it again.
    assert run.tokens_used == 30
    assert ToolEffect.objects.filter(key="k-1").count() == 0
