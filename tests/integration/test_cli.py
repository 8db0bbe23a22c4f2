"""``manage.py durable_agents``: the operations of the admin from a shell. Through
``call_command`` on the real database, with runs a real in-process worker advanced: every
subcommand, its ``--json`` document, text from outside escaped for a terminal, ids checked
before anything is done, decisions only by a user who may and audited as the admin's."""

from __future__ import annotations

import base64
import datetime
import json
import uuid
from decimal import Decimal
from io import StringIO
from typing import Any

import pytest
from django.contrib.admin.models import CHANGE, LogEntry
from django.contrib.auth.models import Permission, User
from django.contrib.contenttypes.models import ContentType
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

import durable_agents
from durable_agents import store
from durable_agents.models import (
    AgentRun,
    IntentStatus,
    RunStatus,
    ToolIntent,
    short_id,
)
from durable_agents.models.trees import family_costs
from durable_agents.offline.script import final_directive
from tests.conftest import approver, run_worker
from tests.integration.test_admin import approve as approve_in_admin
from tests.integration.test_admin import parked_intent
from tests.integration.test_admin_workers import worker

pytestmark = pytest.mark.django_db(transaction=True)

ANSI = "\x1b[2J\x1b]0;pwned\x07"  # clear the screen, retitle the window, ring the bell
DROP_TASK = 'Drop the old table.\n@drop_table {"table": "t1"}'


def cli(*args: str) -> str:
    """The text the command prints on stdout."""
    out = StringIO()
    call_command("durable_agents", *args, stdout=out, stderr=StringIO())
    return out.getvalue()


def cli_json(*args: str) -> Any:
    return json.loads(cli(*args, "--json"))


def failing(*args: str) -> tuple[str, CommandError]:
    """What a subcommand that fails printed on stdout, and its error."""
    out = StringIO()
    with pytest.raises(CommandError) as caught:
        call_command("durable_agents", *args, stdout=out, stderr=StringIO())
    return out.getvalue(), caught.value


def finished_run(task: str, agent: str = "tester") -> AgentRun:
    run = durable_agents.start_run(agent, task)
    run_worker()
    run.refresh_from_db()
    return run


def waiting_run(task: str = DROP_TASK) -> tuple[AgentRun, ToolIntent]:
    run = finished_run(task)
    assert run.status == RunStatus.WAITING, run.error
    return run, ToolIntent.objects.get(run=run)


def terminal_safe(text: str) -> bool:
    """No character that can drive a terminal: no C0 control but newline (tab too), no DEL,
    no C1 control, no direction override."""
    return not any(
        (ord(c) < 0x20 and c not in "\n") or 0x7F <= ord(c) <= 0x9F or c in "\u202e\u2066"
        for c in text
    )


def user_without_permission(username: str = "mallory") -> User:
    return User.objects.create_user(username, is_staff=True)


# -- runs --------------------------------------------------------------------------------------


def test_runs_lists_newest_first_with_columns_and_json() -> None:
    first = durable_agents.start_run("tester", "the first task")
    second = durable_agents.start_run("tester", "the second task\nsecond line")
    text = cli("runs")
    lines = text.splitlines()
    assert lines[0].split() == [
        "ID",
        "AGENT",
        "STATUS",
        "CREATED",
        "UPDATED",
        "ATTEMPTS",
        "COST",
        "TASK",
    ]
    assert lines[1].startswith(short_id(second.pk))
    assert lines[2].startswith(short_id(first.pk))
    assert "tester@v1" in lines[1]
    assert "pending" in lines[1]
    assert "the second task\\nsecond line" in lines[1]  # one line per run
    # Columns are aligned: each row's task starts where the header's does.
    assert lines[1].index("the second") == lines[0].index("TASK")

    document = cli_json("runs")
    assert document["count"] == 2
    assert [run["id"] for run in document["runs"]] == [str(second.pk), str(first.pk)]
    assert document["runs"][0]["short_id"] == short_id(second.pk)
    assert document["runs"][0]["task_head"] == "the second task\nsecond line"
    assert document["runs"][0]["status"] == "pending"
    created = datetime.datetime.fromisoformat(document["runs"][0]["created_at"])
    assert created.utcoffset() == datetime.timedelta(0)


def test_runs_filters_by_status_agent_key_metadata_since_and_limit() -> None:
    acme = durable_agents.start_run("tester", "acme", metadata={"tenant": "acme", "order": 42})
    durable_agents.start_run("tester", "other", metadata={"tenant": "other", "order": "42"})
    keyed = durable_agents.start_run("short", "keyed", key="ticket-7")
    AgentRun.objects.filter(pk=keyed.pk).update(status=RunStatus.DEAD)

    def ids(*args: str) -> list[str]:
        return [run["id"] for run in cli_json("runs", *args)["runs"]]

    assert ids("--metadata", "tenant=acme") == [str(acme.pk)]
    # A value is JSON when it parses: 42 the number matches one run, "42" the string the other.
    assert ids("--metadata", "order=42") == [str(acme.pk)]
    assert len(ids("--metadata", 'order="42"')) == 1
    assert ids("--metadata", "tenant=acme", "--metadata", "order=41") == []
    assert ids("--status", "dead") == [str(keyed.pk)]
    assert len(ids("--status", "dead", "--status", "pending")) == 3
    assert ids("--agent", "short") == [str(keyed.pk)]
    assert ids("--key", "ticket-7") == [str(keyed.pk)]
    assert len(ids("--limit", "2")) == 2
    assert len(ids("--since", "1h")) == 3
    AgentRun.objects.filter(pk=acme.pk).update(
        created_at=timezone.now() - datetime.timedelta(days=3)
    )
    assert str(acme.pk) not in ids("--since", "2d")
    assert str(acme.pk) in ids("--since", "4d")
    since = (timezone.now() - datetime.timedelta(days=1)).strftime("%Y-%m-%dT%H:%M:%S")
    assert len(ids("--since", since)) == 2
    assert "No runs match." in cli("runs", "--agent", "nobody")


def test_runs_refuses_an_unknown_status_naming_the_valid_ones() -> None:
    _, error = failing("runs", "--status", "finished")
    assert "unknown run status 'finished'" in str(error)
    for status in RunStatus:
        assert status.value in str(error)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("--since", "yesterday"), "--since 'yesterday' is neither"),
        (("--metadata", "tenant"), "--metadata takes key=value"),
        (("--limit", "0"), "--limit is a whole number of at least 1"),
    ],
)
def test_runs_refuses_bad_filters(args: tuple[str, ...], says: str) -> None:
    _, error = failing("runs", *args)
    assert says in str(error)


def test_runs_and_show_give_a_runs_cost_with_its_descendants() -> None:
    parent = durable_agents.start_run("tester", "parent")
    child = durable_agents.start_run("tester", "child")
    grandchild = durable_agents.start_run("tester", "grandchild")
    AgentRun.objects.filter(pk=parent.pk).update(cost_usd=Decimal("0.5"), tokens_used=10)
    AgentRun.objects.filter(pk=child.pk).update(
        cost_usd=Decimal("0.25"), parent=parent, depth=1, tokens_used=10
    )
    AgentRun.objects.filter(pk=grandchild.pk).update(
        cost_usd=Decimal("0.125"), parent=child, depth=2, tokens_used=10
    )
    by_id = {run["id"]: run for run in cli_json("runs")["runs"]}
    assert Decimal(by_id[str(parent.pk)]["cost_usd"]) == Decimal("0.5")
    assert Decimal(by_id[str(parent.pk)]["cost_with_descendants_usd"]) == Decimal("0.875")
    assert by_id[str(parent.pk)]["descendants"] == 2
    assert Decimal(by_id[str(child.pk)]["cost_with_descendants_usd"]) == Decimal("0.375")
    assert by_id[str(grandchild.pk)]["descendants"] == 0
    assert Decimal(by_id[str(grandchild.pk)]["cost_with_descendants_usd"]) == Decimal("0.125")

    text = cli("show", str(parent.pk))
    assert "$0.5000" in text
    assert "$0.8750 (2 descendant runs)" in text
    shown = cli_json("show", str(parent.pk))["run"]
    assert Decimal(shown["cost_with_descendants_usd"]) == Decimal("0.875")


def test_the_costs_of_many_families_are_one_query() -> None:
    runs = [durable_agents.start_run("tester", f"root {i}") for i in range(3)]
    for i, root in enumerate(runs):
        child = durable_agents.start_run("tester", f"child {i}")
        AgentRun.objects.filter(pk=child.pk).update(parent=root, depth=1, cost_usd=Decimal(i + 1))
    rows = list(AgentRun.objects.filter(pk__in=[run.pk for run in runs]))
    with CaptureQueriesContext(connection) as queries:
        costs = family_costs(rows)
    assert len(queries) == 1
    assert [costs[run.pk].cost for run in runs] == [Decimal(1), Decimal(2), Decimal(3)]
    assert all(costs[run.pk].descendants == 1 and costs[run.pk].complete for run in runs)


# -- show ------------------------------------------------------------------------------------


def test_show_prints_the_header_and_transcript_by_short_or_whole_id() -> None:
    run = finished_run('Look it up.\n@lookup {"key": "k1"}')
    assert run.status == RunStatus.SUCCEEDED, run.error
    by_short = cli("show", short_id(run.pk))
    assert by_short == cli("show", str(run.pk))
    assert f"run:      {run.pk} ({short_id(run.pk)})" in by_short
    assert "status:   succeeded" in by_short
    assert "agent:    tester@v1" in by_short
    assert "model:    claude-test-1" in by_short
    assert "#0 task (user)" in by_short
    assert "#1 model_turn (assistant)" in by_short
    assert "tool_use lookup (" in by_short
    assert '{"key": "k1"}' in by_short
    assert "#2 tool_result (user)" in by_short
    assert "tool_result of lookup (" in by_short
    assert "value-of-k1" in by_short
    assert "result:" in by_short

    document = cli_json("show", short_id(run.pk))
    assert document["run"]["id"] == str(run.pk)
    assert document["run"]["status"] == "succeeded"
    assert document["steps_total"] == 4
    kinds = [step["kind"] for step in document["steps"]]
    assert kinds == ["task", "model_turn", "tool_result", "model_turn"]
    call = document["steps"][1]["blocks"][-1]
    assert call["type"] == "tool_use"
    assert call["name"] == "lookup"
    assert call["input"] == {"key": "k1"}
    result = document["steps"][2]["blocks"][0]
    assert result["tool_name"] == "lookup"
    assert result["content"] == "value-of-k1"


def test_show_prints_thinking_as_its_length_only() -> None:
    run = finished_run('Think, then look.\n@lookup {"key": "k"}', agent="thinker")
    document = cli_json("show", str(run.pk))
    thinking = [
        block
        for step in document["steps"]
        for block in step["blocks"]
        if block["type"] == "thinking"
    ]
    assert thinking
    assert all(block["chars"] > 0 for block in thinking)
    text = cli("show", str(run.pk))
    assert f"[thinking, {thinking[0]['chars']} chars]" in text


def test_show_takes_the_last_steps_or_all() -> None:
    run = finished_run("Three calls.\n" + "\n".join(f'@lookup {{"key": "k{i}"}}' for i in range(3)))
    assert cli_json("show", str(run.pk))["steps_total"] == 8
    last = cli_json("show", str(run.pk), "--steps", "2")["steps"]
    assert [step["seq"] for step in last] == [6, 7]
    # The results that open the page are named by the turn before it.
    assert last[0]["blocks"][0]["tool_name"] == "lookup"
    assert "the last 3 of 8" in cli("show", str(run.pk), "--steps", "3")
    assert len(cli_json("show", str(run.pk), "--all")["steps"]) == 8


def test_hostile_text_is_escaped_for_the_terminal() -> None:
    task = (
        f"Title {ANSI} \u202eevil\n"
        '@weird {"kind": "nul"}\n'
        f"@@turn {json.dumps([{'name': 'lookup', 'input': {'key': ANSI}}])}\n"
        f"{final_directive('done ' + ANSI)}"
    )
    run = finished_run(task)
    assert run.status == RunStatus.SUCCEEDED, run.error
    for args in (("runs",), ("show", str(run.pk)), ("show", str(run.pk), "--all")):
        text = cli(*args)
        assert terminal_safe(text), args
        assert "\\x1b[2J" in text
    text = cli("show", str(run.pk))
    assert "⟨U+202E⟩evil" in text
    assert "before\u2400after" in text  # the tool's NUL, as stored
    assert "value-of-\\x1b[2J\\x1b]0;pwned\\x07" in text  # a tool result quoting it
    assert "done \\x1b[2J" in text  # the run's result
    # The JSON document holds the values exactly, written as ASCII escapes.
    raw = cli("show", str(run.pk), "--json")
    assert terminal_safe(raw)
    assert json.loads(raw)["run"]["result"].endswith(ANSI)


def test_show_refuses_what_names_no_run_or_several() -> None:
    _, error = failing("show", "not-an-id")
    assert "is not a run id" in str(error)
    _, error = failing("show", str(uuid.uuid4()))
    assert "there is no run" in str(error)
    _, error = failing("show", "deadbeef")
    assert "no run has the short id 'deadbeef'" in str(error)
    # Two random (version 4) ids that start alike: their short ids are their first digits.
    for tail in ("1", "2"):
        AgentRun.objects.filter(pk=durable_agents.start_run("tester", tail).pk).update(
            id=uuid.UUID(f"abcdef12-0000-4000-8000-00000000000{tail}")
        )
    _, error = failing("show", "abcdef12")
    assert "several runs have the short id 'abcdef12'" in str(error)
    assert "tester@v1" in cli("show", "abcdef12-0000-4000-8000-000000000001")


# -- cancel, requeue -------------------------------------------------------------------------


def test_cancel_says_what_happened_to_each_run() -> None:
    waiting, _ = waiting_run()
    done = finished_run("done")
    pending = durable_agents.start_run("tester", "pending")  # after the worker's runs
    out, error = failing(
        "cancel", short_id(pending.pk), str(waiting.pk), str(done.pk), short_id(pending.pk)
    )
    assert error.returncode == 1
    assert "1 of 3 run(s) not cancelled" in str(error)
    lines = out.splitlines()
    assert len(lines) == 3  # the repeated id acts once
    assert "cancelled (was pending)" in lines[0]
    assert "cancelled (was waiting)" in lines[1]
    assert "already finished: it is succeeded" in lines[2]
    statuses = dict(AgentRun.objects.values_list("pk", "status"))
    assert statuses[pending.pk] == statuses[waiting.pk] == RunStatus.CANCELLED
    assert statuses[done.pk] == RunStatus.SUCCEEDED


def test_cancel_json_and_exit_status_zero_when_every_run_changed() -> None:
    runs = [durable_agents.start_run("tester", f"t{i}") for i in range(2)]
    document = cli_json("cancel", *(str(run.pk) for run in runs))
    assert document["changed"] == 2
    assert document["failed"] == 0
    assert [r["outcome"] for r in document["runs"]] == ["cancelled", "cancelled"]
    assert [r["status_before"] for r in document["runs"]] == ["pending", "pending"]
    assert LogEntry.objects.count() == 0  # no --user: nobody to name


@pytest.mark.parametrize(
    "bad", ["nope", "12345678-zz", "deadbeef", "0b8e2a8c-5a7f-4d55-9c51-3f0f3c2b1a77"]
)
@pytest.mark.parametrize("subcommand", ["cancel", "requeue"])
def test_an_id_that_names_no_run_changes_nothing(subcommand: str, bad: str) -> None:
    pending = durable_agents.start_run("tester", "pending")
    dead = durable_agents.start_run("tester", "dead")
    assert store.current().dead_letter(dead.pk, "it broke")
    out, error = failing(subcommand, str(pending.pk), str(dead.pk), bad)
    assert out == ""
    assert error.returncode == 1
    statuses = dict(AgentRun.objects.values_list("pk", "status"))
    assert statuses == {pending.pk: RunStatus.PENDING, dead.pk: RunStatus.DEAD}


def test_requeue_sends_dead_runs_back_and_says_which_were_not_dead() -> None:
    dead = durable_agents.start_run("tester", "dead")
    assert store.current().dead_letter(dead.pk, "it broke")
    pending = durable_agents.start_run("tester", "pending")
    out, error = failing("requeue", short_id(dead.pk), short_id(pending.pk))
    assert "requeued (was dead)" in out
    assert "not dead, nothing changed: it is pending" in out
    assert "1 of 2 run(s) not requeued" in str(error)
    dead.refresh_from_db()
    assert dead.status == RunStatus.PENDING


def test_cancel_with_a_user_is_audited_and_needs_the_change_permission() -> None:
    run = durable_agents.start_run("tester", "pending")
    refused = user_without_permission()
    _, error = failing("cancel", str(run.pk), "--user", refused.username)
    assert "does not hold the durable_agents.change_agentrun permission" in str(error)
    assert "cancelling runs is refused" in str(error)
    run.refresh_from_db()
    assert run.status == RunStatus.PENDING
    operator = User.objects.create_user("ops")
    operator.user_permissions.add(Permission.objects.get(codename="change_agentrun"))
    cli("cancel", str(run.pk), "--user", "ops")
    entry = LogEntry.objects.get()
    assert entry.user_id == operator.pk
    assert entry.object_id == str(run.pk)
    assert entry.change_message == "Cancelled from the command line (was pending)."


# -- intents and decisions -------------------------------------------------------------------


def test_intents_lists_those_waiting_for_a_person_first() -> None:
    done = parked_intent(IntentStatus.DONE, table="old")
    pending = parked_intent(IntentStatus.PENDING, table="t1")
    unknown = parked_intent(IntentStatus.UNKNOWN, table="t2")
    text = cli("intents")
    lines = text.splitlines()
    assert lines[0].split() == ["ID", "RUN", "TOOL", "STATUS", "CREATED", "INPUT"]
    assert [line.split()[0] for line in lines[1:]] == [
        str(pending.pk),
        str(unknown.pk),
        str(done.pk),
    ]
    assert short_id(pending.run_id) in lines[1]
    assert "drop_table" in lines[1]
    assert '{"table": "t1"}' in lines[1]
    document = cli_json("intents", "--status", "pending")
    assert [i["id"] for i in document["intents"]] == [pending.pk]
    assert document["intents"][0]["input"] == {"table": "t1"}
    assert document["intents"][0]["run_id"] == str(pending.run_id)
    _, error = failing("intents", "--status", "waiting")
    assert "unknown intent status 'waiting'" in str(error)
    assert "pending, approved, rejected" in str(error)


def test_approve_shows_what_runs_decides_and_audits_as_the_admin_does() -> None:
    run, intent = waiting_run()
    alice = approver("alice")
    text = cli("approve", str(intent.pk), "--user", "alice")
    before, after = text.split("After:")
    assert f"intent {intent.pk}: drop_table for run {run.pk}" in before
    assert '{"table": "t1"}' in before
    assert "pending" in before
    assert "approved" in after
    assert "decided by alice" in after
    assert f"Intent {intent.pk} approved by alice." in text
    intent.refresh_from_db()
    assert intent.status == IntentStatus.APPROVED
    assert intent.decided_by_id == alice.pk
    entry = LogEntry.objects.get()
    assert entry.user_id == alice.pk
    assert entry.action_flag == CHANGE
    assert entry.content_type == ContentType.objects.get_for_model(ToolIntent)
    assert entry.object_id == str(intent.pk)
    assert entry.change_message == "Approved."
    # The run goes on: the approved call runs.
    run_worker()
    run.refresh_from_db()
    assert run.status == RunStatus.SUCCEEDED, run.error


def test_a_decision_here_is_audited_like_one_in_the_admin(admin_client: Client) -> None:
    _, in_admin = waiting_run()
    _, here = waiting_run('Drop another.\n@drop_table {"table": "t2"}')
    approver("alice")
    assert approve_in_admin(admin_client, in_admin).status_code == 302
    cli("approve", str(here.pk), "--user", "alice")
    admin_entry = LogEntry.objects.get(object_id=str(in_admin.pk))
    cli_entry = LogEntry.objects.get(object_id=str(here.pk))
    for field in ("action_flag", "content_type_id", "change_message"):
        assert getattr(cli_entry, field) == getattr(admin_entry, field), field
    assert cli_entry.object_repr == str(ToolIntent.objects.get(pk=here.pk))


def test_reject_needs_a_reason_and_names_it_in_the_audit() -> None:
    run, intent = waiting_run()
    approver("alice")
    _, error = failing("reject", str(intent.pk), "--user", "alice")
    assert "--reason" in str(error)
    _, error = failing("reject", str(intent.pk), "--user", "alice", "--reason", "  ")
    assert "--reason cannot be empty" in str(error)
    _, error = failing("reject", str(intent.pk), "--user", "alice", "--reason", "x" * 5001)
    assert "--reason has at most 5000 characters" in str(error)
    document = cli_json("reject", str(intent.pk), "--user", "alice", "--reason", "not today")
    assert document["decided"] is True
    assert document["intent"]["status"] == "rejected"
    assert document["intent"]["reason"] == "not today"
    assert document["intent"]["decided_by"] == "alice"
    assert LogEntry.objects.get().change_message == "Rejected: not today."
    run_worker()
    run.refresh_from_db()
    assert run.status == RunStatus.SUCCEEDED  # the model read the refusal and ended


@pytest.mark.parametrize("who", ["nobody", "mallory", "inactive"])
def test_a_decision_by_a_user_who_may_not_decide_is_refused(who: str) -> None:
    _, intent = waiting_run()
    user_without_permission("mallory")
    inactive = approver("inactive")
    inactive.is_active = False
    inactive.save()
    for args in (("approve",), ("reject", "--reason", "no")):
        out, error = failing(args[0], str(intent.pk), "--user", who, *args[1:])
        assert out == ""
        message = str(error)
        if who == "nobody":
            assert "there is no user 'nobody'" in message
        elif who == "mallory":
            assert "does not hold the durable_agents.approve_toolintent permission" in message
        else:
            assert "is not active" in message
    intent.refresh_from_db()
    assert intent.status == IntentStatus.PENDING
    assert LogEntry.objects.count() == 0


def test_a_decided_or_unknown_intent_is_left_as_it_is() -> None:
    approver("alice")
    done = parked_intent(IntentStatus.REJECTED)
    out, error = failing("approve", str(done.pk), "--user", "alice")
    assert "is rejected, not pending: nothing was approved" in str(error)
    assert error.returncode == 1
    assert f"intent {done.pk}: drop_table" in out
    unknown = parked_intent(IntentStatus.UNKNOWN)
    _, error = failing("approve", str(unknown.pk), "--user", "alice")
    assert "outcome is unknown" in str(error)
    assert ToolIntent.objects.get(pk=unknown.pk).status == IntentStatus.UNKNOWN
    assert LogEntry.objects.count() == 0
    _, error = failing("approve", "12x", "--user", "alice")
    assert "'12x' is not an intent id" in str(error)
    _, error = failing("approve", "999999", "--user", "alice")
    assert "there is no intent 999999" in str(error)


def test_hostile_tool_input_is_escaped_before_a_decision() -> None:
    turn = json.dumps([{"name": "drop_table", "input": {"table": f"t1{ANSI}\u202e"}}])
    _, intent = waiting_run(f"Drop.\n@@turn {turn}")
    approver("alice")
    for text in (cli("intents"), cli("approve", str(intent.pk), "--user", "alice")):
        assert terminal_safe(text)
        # The input as JSON text: its control characters are JSON escapes.
        assert "t1\\u001b[2J\\u001b]0;pwned\\u0007" in text
        assert "⟨U+202E⟩" in text


KEY = base64.urlsafe_b64encode(b"K" * 32).decode()
SECRET = "hunter2-account-password"


def test_with_encryption_an_operator_reads_plain_text_and_the_audit_holds_none(
    da_settings: Any,
) -> None:
    da_settings(ENCRYPTION_KEYS=[KEY])
    run, intent = waiting_run(f'Drop.\n@drop_table {{"table": "{SECRET}"}}')
    approver("alice")
    with connection.cursor() as cursor:
        cursor.execute("SELECT input FROM tool_intent WHERE id = %s", [intent.pk])
        assert SECRET not in cursor.fetchone()[0]  # encrypted at rest
    # Whoever holds the keys reads what will run, as the admin shows it.
    assert SECRET in cli("intents")
    assert SECRET in cli("show", str(run.pk))
    text = cli("reject", str(intent.pk), "--user", "alice", "--reason", "wrong table")
    assert SECRET in text
    entry = LogEntry.objects.get()
    assert SECRET not in entry.change_message
    assert SECRET not in entry.object_repr
    assert entry.change_message == "Rejected: wrong table."


# -- workers ---------------------------------------------------------------------------------


def test_workers_lists_live_workers_first_with_what_they_hold() -> None:
    worker("w-gone", live=False, host="host-b")
    worker("w-live", runs_held=3, draining=True)
    worker(f"w-{ANSI}", host=f"h{ANSI}")
    text = cli("workers")
    assert terminal_safe(text)
    lines = text.splitlines()
    assert lines[0].split()[:6] == ["WORKER", "HOST", "PID", "STARTED", "LAST", "BEAT"]
    assert lines[-1].startswith("w-gone")
    assert " gone " in lines[-1]
    live_line = next(line for line in lines if line.startswith("w-live"))
    assert " live " in live_line
    assert " yes " in live_line
    assert "tester@v1" in live_line
    assert "w-\\x1b[2J" in text
    document = cli_json("workers")
    assert document["count"] == 3
    assert document["live"] == 2
    by_id = {w["id"]: w for w in document["workers"]}
    assert by_id["w-live"]["runs_held"] == 3
    assert by_id["w-live"]["draining"] is True
    assert by_id["w-gone"]["live"] is False
    assert by_id["w-live"]["versions"][0]["agent"] == "tester"
    assert by_id["w-live"]["pid"] == 4242


def test_every_subcommand_needs_a_known_name() -> None:
    _, error = failing("frobnicate")
    assert "invalid choice" in str(error)
