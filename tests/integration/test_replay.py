"""Replay: a recorded run's tool calls played to today's tool code, without the model.

Each run is recorded here with the offline model, then the tools' code changes (a module switch
read by the tool functions: the user's code, not ours) and the run is replayed.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest
from django.apps import apps
from django.core.management import CommandError, call_command
from django.db import connection
from django.test import override_settings

from durable_agents import Agent, Wait, api, ask_person, llm, tool
from durable_agents.declare.agents import registry
from durable_agents.models import AgentRun, RunStatus
from durable_agents.testing import ReplayError, ReplayReport, plan, replay
from tests.integration.conftest import agents_registered

# What today's tool code does: a test changes it after recording.
CODE: dict[str, Any] = {}
REFUNDS: list[str] = []  # the idempotency keys each call of ``refund`` received
CLIENTS: list[str] = []  # every model client created (the replay must create none)
ANNOUNCED = itertools.count()


@tool(effect="pure")
def quote(item: str) -> dict[str, Any]:
    """The price of an item."""
    if CODE.get("quote") == "raise":
        raise LookupError(f"no price list for {item}")
    cents = 1299 if CODE.get("quote") == "new prices" else 999
    return {"item": item, "cents": cents}


@tool(effect="idempotent")
def announce(name: str) -> str:
    """Send an event: a new row in the durable_agents tables at every call."""
    api.send_event(f"{name}:{next(ANNOUNCED)}", {"by": "announce"})
    return f"sent {name}"


@tool(effect="non_idempotent")
def refund(order: str, *, idempotency_key: str) -> str:
    """Refund an order."""
    REFUNDS.append(idempotency_key)
    return f"refunded {order}" + (" twice" if CODE.get("refund") == "changed" else "")


@tool(effect="idempotent")
def await_parcel(parcel: str, *, woken_by: dict[str, Any] | None = None) -> Any:
    """Wait until the parcel arrives."""
    if woken_by is None:
        raise Wait(event=f"parcel:{parcel}")
    return woken_by["payload"]


@tool(effect="irreversible")
def close_account(customer: str, *, idempotency_key: str) -> str:
    """Close a customer's account (a person approves it first)."""
    REFUNDS.append(idempotency_key)
    return f"closed {customer}" + (" and archived" if CODE.get("close") == "archive" else "")


@tool(effect="pure")
def export(rows: int) -> str:
    """A long result."""
    return "".join(f"row {i}\n" for i in range(rows)) + CODE.get("export", "")


@tool(effect="pure")
def report_rows() -> str:
    """Count the rows of the report table."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT COUNT(*) FROM " + CODE.get("table", "agent_run"))
        cursor.fetchone()
    return "counted"


shop = Agent(
    name="replay-shop",
    version="v1",
    model="claude-test-1",
    system="You run the shop.",
    tools=[
        quote,
        announce,
        refund,
        await_parcel,
        ask_person,
        close_account,
        export,
        report_rows,
    ],
    max_tokens=1024,
)


def forbidden_client() -> Any:
    CLIENTS.append("created")
    raise AssertionError("a replay must not create a model client")


@pytest.fixture(autouse=True)
def registered() -> Iterator[None]:
    with agents_registered(shop):
        CODE.clear()
        REFUNDS.clear()
        CLIENTS.clear()
        yield


@pytest.fixture
def recorded(agent_runner: Any) -> AgentRun:
    """A finished run: a quote, an event sent, a refund, a wait, a question."""
    task = plan(
        ("quote", {"item": "mug"}),
        [("announce", {"name": "shop:opened"}), ("refund", {"order": "o-1"})],
        ("await_parcel", {"parcel": "p-1"}),
        ("ask_person", {"question": "Ship today?"}),
        ("quote", {"item": "\x1b[31mred\u202e"}),
        task="Serve the customer.",
    )
    result = agent_runner(
        "replay-shop",
        task,
        events={"parcel:p-1": {"arrived": True}},
        answers={"Ship today?": "yes"},
    )
    assert result.status == RunStatus.SUCCEEDED, result.error
    REFUNDS.clear()
    run: AgentRun = result.run
    return run


def offline_only() -> Any:
    """Settings under which any model client would be created by ``forbidden_client``."""
    return override_settings(
        DURABLE_AGENTS={
            "OFFLINE": False,
            "CLIENT_FACTORY": "tests.integration.test_replay.forbidden_client",
        }
    )


def replay_without_model(run: AgentRun, **options: Any) -> ReplayReport:
    with offline_only():
        llm.reset_clients()
        try:
            return replay(run.pk, **options)
        finally:
            llm.reset_clients()


def test_unchanged_tools_replay_clean_and_waits_are_not_replayed(recorded: AgentRun) -> None:
    report = replay_without_model(recorded)
    assert report.ok, str(report)
    assert CLIENTS == []
    assert report.calls == 3  # quote twice, announce
    assert report.matches == 3
    assert [(c.tool, c.reason) for c in report.skipped] == [
        ("refund", "a non_idempotent tool; allow_effects does not name it")
    ]
    assert REFUNDS == []  # not called
    reasons = {c.tool: c.reason for c in report.not_replayed}
    assert set(reasons) == {"await_parcel", "ask_person"}
    assert "Wait for event 'parcel:p-1'" in reasons["await_parcel"]
    assert "person" in reasons["ask_person"]


def test_a_changed_result_is_a_difference_with_both_results(recorded: AgentRun) -> None:
    CODE["quote"] = "new prices"
    report = replay_without_model(recorded)
    assert not report.ok
    assert report.errors == []
    assert [(c.seq, c.tool, c.input) for c in report.differences] == [
        (1, "quote", {"item": "mug"}),
        (9, "quote", {"item": "\x1b[31mred\u202e"}),
    ]
    first = report.differences[0]
    assert first.old == '{"item": "mug", "cents": 999}'
    assert first.new == '{"item": "mug", "cents": 1299}'
    text = str(report)
    assert '-{"item": "mug", "cents": 999}' in text
    assert '+{"item": "mug", "cents": 1299}' in text
    # The model's text is shown escaped: no escape sequence, no direction override.
    assert "\x1b" not in text
    assert "\u202e" not in text
    assert '+{"item": "\\u001b[31mred\\u202e", "cents": 1299}' in text


def test_a_tool_that_now_raises_is_an_error(recorded: AgentRun) -> None:
    CODE["quote"] = "raise"
    report = replay_without_model(recorded)
    assert not report.ok
    assert report.differences == []
    assert [c.tool for c in report.errors] == ["quote", "quote"]
    error = report.errors[0]
    assert error.new == "quote raised LookupError: no price list for mug"
    assert error.new_is_error
    assert not error.old_is_error
    assert "ERROR turn 1 call 0: quote" in str(report)


def test_a_non_idempotent_tool_runs_only_when_allowed(recorded: AgentRun) -> None:
    CODE["refund"] = "changed"
    assert replay_without_model(recorded).ok  # skipped: the change goes unseen
    assert REFUNDS == []

    report = replay_without_model(recorded, allow_effects={"refund"})
    assert report.skipped == []
    assert [(c.tool, c.old, c.new) for c in report.differences] == [
        ("refund", "refunded o-1", "refunded o-1 twice")
    ]
    # The call got the key the runtime gave it when it ran: the remote system deduplicates.
    refunded = next(c for c in recorded.effects.all() if c.tool == "refund")
    assert REFUNDS == [refunded.key]
    assert replay_without_model(recorded, allow_effects=True).differences[0].tool == "refund"
    assert replay_without_model(recorded, allow_effects="refund").differences[0].tool == "refund"


def test_a_run_of_an_agent_version_no_longer_registered_is_refused(recorded: AgentRun) -> None:
    registry.unregister(shop.name, shop.version)
    with pytest.raises(ReplayError, match=r"agent 'replay-shop' version 'v1' is not registered"):
        replay(recorded.pk)


def test_an_unknown_run_is_refused(db: None) -> None:
    with pytest.raises(ReplayError, match="no run 00000000-0000-0000-0000-000000000000"):
        replay("00000000-0000-0000-0000-000000000000")
    with pytest.raises(ReplayError, match="is not a run id"):
        replay("nope")


def row_counts() -> dict[str, int]:
    return {
        model._meta.db_table: model._base_manager.count()
        for model in apps.get_app_config("durable_agents").get_models()
        if not model._meta.proxy
    }


@pytest.mark.postgres
def test_a_replay_writes_nothing(recorded: AgentRun) -> None:
    before = row_counts()
    report = replay_without_model(recorded, allow_effects=True)
    assert report.ok, str(report)
    assert report.calls == 4  # announce sent its event again, in the scratch transaction
    assert row_counts() == before


def test_the_command_prints_each_report_and_exits_1_on_a_difference(
    recorded: AgentRun, capsys: pytest.CaptureFixture[str]
) -> None:
    with offline_only():
        call_command("durable_agents_replay", str(recorded.pk))
        assert "0 different, 0 error(s), 1 skipped" in capsys.readouterr().out

        CODE["refund"] = "changed"
        call_command("durable_agents_replay", str(recorded.pk))  # refund is skipped
        with pytest.raises(SystemExit) as exited:
            call_command(
                "durable_agents_replay",
                str(recorded.pk),
                str(recorded.pk),
                "--allow-effects",
                "refund",
            )
        assert exited.value.code == 1
        out = capsys.readouterr().out
        assert out.count("DIFFERENT turn 3 call 1: refund") == 2

        with pytest.raises(CommandError, match="'nope' is not a run id"):
            call_command("durable_agents_replay", "nope")
        with pytest.raises(CommandError, match="no run"):
            call_command("durable_agents_replay", "00000000-0000-0000-0000-000000000000")


def test_the_replay_run_fixture(recorded: AgentRun, replay_run: Any) -> None:
    assert replay_run(recorded.pk).ok
    CODE["quote"] = "raise"
    assert not replay_run(recorded.pk).ok


def test_irreversible_calls_rejected_are_not_replayed_approved_ones_only_when_allowed(
    agent_runner: Any,
) -> None:
    task = plan(("close_account", {"customer": "c-1"}), ("close_account", {"customer": "c-2"}))
    result = agent_runner(
        "replay-shop",
        task,
        intents=lambda i: "reject" if i.input["customer"] == "c-1" else "approve",
    )
    assert result.status == RunStatus.SUCCEEDED, result.error
    REFUNDS.clear()
    CODE["close"] = "archive"

    report = replay_without_model(result.run)
    assert [(c.input, c.reason) for c in report.not_replayed] == [
        ({"customer": "c-1"}, "a person rejected the call: the tool never ran")
    ]
    assert [c.input for c in report.skipped] == [{"customer": "c-2"}]
    assert REFUNDS == []

    report = replay_without_model(result.run, allow_effects=["close_account"])
    assert [(c.old, c.new) for c in report.differences] == [
        ("closed c-2", "closed c-2 and archived")
    ]
    assert len(REFUNDS) == 1  # the approved call only, without asking anyone again


def test_a_long_difference_is_shown_cut(agent_runner: Any) -> None:
    result = agent_runner("replay-shop", plan(("export", {"rows": 1000})))
    CODE["export"] = "one more line"
    report = replay_without_model(result.run)
    [difference] = report.differences
    assert difference.new is not None
    assert difference.new.endswith("one more line")  # compared whole
    text = str(report)
    # Shown around the change, which lies past the first 2,000 characters.
    assert "+one more line" in text
    assert "--- recorded (from character 6890)" in text
    assert "row 0\n" not in text
    assert len(text) < 6_000


def test_a_failed_query_in_one_tool_does_not_fail_the_next_calls(agent_runner: Any) -> None:
    task = plan(("report_rows", {}), ("announce", {"name": "shop:counted"}))
    result = agent_runner("replay-shop", task)
    assert result.status == RunStatus.SUCCEEDED, result.error
    CODE["table"] = "no_such_table"
    report = replay_without_model(result.run)
    assert [c.tool for c in report.errors] == ["report_rows"]
    assert report.matches == 1  # announce wrote its event after the failed query
