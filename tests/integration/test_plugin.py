"""The pytest plugin that users test their own agents with, used on the demo agent."""

from __future__ import annotations

import json
from typing import Any

from durable_agents import api
from durable_agents.engine.effects import idempotency_key
from durable_agents.models import IntentStatus, QuestionStatus, RunStatus, WaitKind
from durable_agents.testing import KEEP_WAITING


def test_the_demo_migrator_end_to_end(agent_runner: Any, durable_plan: Any) -> None:
    task = durable_plan(
        ("get_schema", {"table": "orders"}),
        [
            ("apply_migration_step", {"statement": "ALTER TABLE orders ADD COLUMN note text"}),
            ("record_progress", {"ticket": "MIG-1", "status": "applied"}),
        ],
        ("drop_table", {"table": "orders_old"}),
        task="Migrate orders.",
    )
    result = agent_runner("migrator", task)
    assert result.status == RunStatus.SUCCEEDED
    assert result.tool_names() == [
        "get_schema",
        "apply_migration_step",
        "record_progress",
        "drop_table",
    ]
    apply = result.tool_calls()[1]
    assert apply.key == idempotency_key(
        result.run.pk, apply.turn_seq, 0, "apply_migration_step", apply.input
    )
    assert apply.key[:12] in apply.result  # the tool received its key
    assert [i.status for i in result.intents] == [IntentStatus.DONE]
    transcript = result.transcript()
    assert transcript.startswith("0 task: " + task + "\n1 assistant: Step 1")
    assert '5 call drop_table {"table": "orders_old"}\n6 result: table orders_old dropped' in (
        transcript
    )
    assert result.messages()[-1]["role"] == "assistant"


def test_a_test_can_stop_at_the_approval(agent_runner: Any, durable_plan: Any) -> None:
    result = agent_runner(
        "migrator", durable_plan(("drop_table", {"table": "orders"})), intents="wait"
    )
    assert result.status == RunStatus.WAITING
    assert [(i.tool, i.input, i.status) for i in result.intents] == [
        ("drop_table", {"table": "orders"}, IntentStatus.PENDING)
    ]


def test_a_rejection_reaches_the_model(agent_runner: Any, durable_plan: Any) -> None:
    result = agent_runner(
        "migrator", durable_plan(("drop_table", {"table": "orders"})), intents="reject"
    )
    assert result.status == RunStatus.SUCCEEDED
    [call] = result.tool_calls()
    assert call.is_error
    assert "rejected by durable-agents-test-operator: rejected by the test" in call.result


# -------------------------------------------------------------------- long-running runs
# The "waiter" agent of tests/testapp/wait_agents.py; its tools log each invocation with the
# woken_by it got (the receiver). No test sleeps: an hour-long timer ends because the driver
# moved the fake clock, which durable_clock.offset shows.

HOUR = 3600


def waiter_task(*lines: str) -> str:
    return "\n".join(["Wait for something.", *lines])


def test_a_timer_ends_by_moving_the_fake_clock(
    agent_runner: Any, durable_clock: Any, receiver: Any
) -> None:
    result = agent_runner("waiter", waiter_task('@nap {"seconds": 3600}'))
    assert result.status == RunStatus.SUCCEEDED, result.error
    assert [c["woken_by"] for c in receiver.calls("nap")] == [None, {"timer": True}]
    assert result.woken_by == {"timer": True}
    assert json.loads(result.tool_calls()[0].result) == {"timer": True}
    # The driver moved the clock to the timer's due time: an hour, less the milliseconds
    # between the park and the move, plus the driver's millisecond past it.
    assert HOUR - 5 < durable_clock.offset <= HOUR + 0.01
    assert result.waits_for == ""
    assert result.waiting_for == ""


def test_timers_wait_leaves_the_run_waiting_until_the_test_moves_the_clock(
    agent_runner: Any, durable_clock: Any
) -> None:
    result = agent_runner("waiter", waiter_task('@nap {"seconds": 3600}'), timers="wait")
    assert (result.status, result.waiting_for) == (RunStatus.WAITING, WaitKind.TIMER)
    assert result.waits_for.startswith("a timer due at ")
    assert result.waits_for.endswith('[timers="wait"]')
    assert durable_clock.offset == 0

    assert durable_clock.advance(HOUR / 2) == 1  # one run has a timer
    result = agent_runner.drive(result, timers="wait")
    assert result.status == RunStatus.WAITING  # half an hour to go

    durable_clock.advance(HOUR / 2)
    result = agent_runner.drive(result, timers="wait")
    assert result.status == RunStatus.SUCCEEDED, result.error
    assert result.woken_by == {"timer": True}
    assert durable_clock.offset == HOUR


def test_an_event_from_the_test_wakes_the_run_before_its_timeout(
    agent_runner: Any, durable_clock: Any, receiver: Any
) -> None:
    result = agent_runner(
        "waiter",
        waiter_task('@await_event {"name": "refund:o-1", "timeout": 3600}'),
        events={"refund:o-1": {"status": "refunded"}},
    )
    assert result.status == RunStatus.SUCCEEDED, result.error
    first, second = receiver.calls("await_event")
    assert first["woken_by"] is None
    assert first["key"] == second["key"]
    assert second["woken_by"]["event"] == "refund:o-1"
    assert second["woken_by"]["payload"] == {"status": "refunded"}
    assert durable_clock.offset == 0  # the event, not the clock, ended the wait


def test_events_may_be_a_function_of_the_name(agent_runner: Any) -> None:
    result = agent_runner(
        "waiter",
        waiter_task('@await_event {"name": "build:17"}'),
        events=lambda name: {"build": name.split(":")[1], "ok": True},
    )
    assert result.status == RunStatus.SUCCEEDED, result.error
    assert result.woken_by["payload"] == {"build": "17", "ok": True}


def test_events_keep_waiting_sends_nothing(agent_runner: Any) -> None:
    task = waiter_task('@await_event {"name": "refund:o-1"}')
    result = agent_runner("waiter", task, events=KEEP_WAITING)
    assert (result.status, result.waiting_for) == (RunStatus.WAITING, WaitKind.EVENT)
    result = agent_runner.drive(result, events=lambda name: KEEP_WAITING)
    assert (result.status, result.waiting_for) == (RunStatus.WAITING, WaitKind.EVENT)


def test_an_event_the_test_does_not_know_leaves_the_run_waiting(agent_runner: Any) -> None:
    task = waiter_task('@await_event {"name": "refund:o-9"}')
    result = agent_runner("waiter", task, events={"refund:o-1": {"status": "refunded"}})
    assert (result.status, result.waiting_for) == (RunStatus.WAITING, WaitKind.EVENT)
    assert result.waits_for == "event 'refund:o-9' [no event of that name in events=]"

    api.send_event("refund:o-9", {"status": "refunded"})  # the test sends it itself
    result = agent_runner.drive(result)
    assert result.status == RunStatus.SUCCEEDED, result.error
    assert result.woken_by["payload"] == {"status": "refunded"}


def test_an_event_that_never_comes_times_out_on_the_fake_clock(
    agent_runner: Any, durable_clock: Any, receiver: Any
) -> None:
    result = agent_runner("waiter", waiter_task('@await_event {"name": "never", "timeout": 3600}'))
    assert result.status == RunStatus.SUCCEEDED, result.error
    assert [c["woken_by"] for c in receiver.calls("await_event")] == [None, {"timeout": True}]
    assert HOUR - 5 < durable_clock.offset <= HOUR + 0.01


def test_a_question_is_answered_from_the_test(agent_runner: Any) -> None:
    result = agent_runner(
        "waiter",
        waiter_task('@ask_person {"question": "Which region do we migrate first?"}'),
        answers={"Which region do we migrate first?": "eu-west"},
    )
    assert result.status == RunStatus.SUCCEEDED, result.error
    [question] = result.questions
    assert question.status == QuestionStatus.ANSWERED
    assert question.answered_by.username == "durable-agents-test-operator"
    answer = json.loads(result.tool_calls()[0].result)
    assert answer["answer"] == "eu-west"
    assert answer["answered_by"] == "durable-agents-test-operator"


def test_answers_may_be_a_function_and_an_unanswered_question_waits(agent_runner: Any) -> None:
    task = waiter_task('@ask_person {"question": "Go?"}')
    result = agent_runner("waiter", task, answers=lambda question: None)
    assert (result.status, result.waiting_for) == (RunStatus.WAITING, WaitKind.QUESTION)
    assert result.waits_for == "an answer to 'Go?' [no answer to it in answers=]"

    result = agent_runner.drive(result, answers=lambda question: question.upper() + " YES")
    assert result.status == RunStatus.SUCCEEDED, result.error
    assert json.loads(result.tool_calls()[0].result)["answer"] == "GO? YES"


# spawn_run writes from tool code: the driver runs it on the test's thread, in the test's
# transaction (the plain ``db`` fixture of agent_runner is enough).
def test_child_runs_are_played_to_their_end(
    agent_runner: Any, durable_clock: Any, receiver: Any
) -> None:
    # The second child naps for an hour: the driver advances the clock for it.
    topics = ["tides", 'moons\n@nap {"seconds": 3600}']
    result = agent_runner("waiter", waiter_task("@fan_out " + json.dumps({"topics": topics})))
    assert result.status == RunStatus.SUCCEEDED, result.error
    assert [c.run.task for c in result.children] == [f"Research {t}" for t in topics]
    assert [c.status for c in result.children] == [RunStatus.SUCCEEDED] * 2
    assert [c.run.depth for c in result.children] == [1, 1]
    assert result.children[1].woken_by == {"timer": True}
    outcomes = result.woken_by["runs"]
    assert set(outcomes) == {str(c.run.pk) for c in result.children}
    assert {o["status"] for o in outcomes.values()} == {"succeeded"}
    assert len(receiver.calls("fan_out")) == 2  # spawn and wait, then fan in
    assert HOUR - 5 < durable_clock.offset <= HOUR + 0.01


def test_children_wait_leaves_the_parent_waiting_on_them(agent_runner: Any) -> None:
    task = waiter_task('@fan_out {"topics": ["a", "b"]}')
    result = agent_runner("waiter", task, children="wait")
    assert (result.status, result.waiting_for) == (RunStatus.WAITING, WaitKind.RUNS)
    assert [c.status for c in result.children] == [RunStatus.PENDING] * 2
    assert result.waits_for.startswith("2 child run(s) to end: ")
    assert result.waits_for.endswith('(pending) [children="wait"]')

    result = agent_runner.drive(result)
    assert result.status == RunStatus.SUCCEEDED, result.error
    assert [c.status for c in result.children] == [RunStatus.SUCCEEDED] * 2


def test_a_parents_wait_names_what_its_children_wait_for(agent_runner: Any) -> None:
    topics = ['slow\n@nap {"seconds": 3600}']
    task = waiter_task("@fan_out " + json.dumps({"topics": topics}))
    result = agent_runner("waiter", task, timers="wait")
    assert result.status == RunStatus.WAITING
    [child] = result.children
    assert child.waiting_for == WaitKind.TIMER
    assert child.waits_for.endswith('[timers="wait"]')
    assert result.waits_for == f"1 child run(s) to end: {child.run.pk} (waiting: waits for " + (
        child.waits_for + ")"
    )
