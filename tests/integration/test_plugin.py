"""The pytest plugin that users test their own agents with, used on the demo agent."""

from __future__ import annotations

from typing import Any

from durable_agents.effects import idempotency_key
from durable_agents.models import IntentStatus, RunStatus


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
