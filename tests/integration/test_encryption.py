"""Encryption at rest (ENCRYPTION_KEYS): what the columns hold, what the app reads back, resume
byte for byte under the offline model's thinking signatures, rotation, unknown keys, the admin.

Runs on both databases (the raw statements of PostgresStore and the ORM of PortableStore)."""

from __future__ import annotations

import base64
import json
import re
import threading
from io import StringIO
from typing import Any

import pytest
from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection
from django.urls import reverse

from durable_agents import api, llm, store
from durable_agents._internal import encryption
from durable_agents._internal.interrupt import Interrupt
from durable_agents.declare.agents import registry
from durable_agents.engine.history import load_log
from durable_agents.engine.runner import advance_run
from durable_agents.housekeeping import rekey
from durable_agents.models import AgentEvent, AgentQuestion, AgentRun, ToolEffect
from durable_agents.store import StepWrite
from tests.conftest import before_commit_of, own_steps, run_worker, wait_for
from tests.fakeserver import FakeAnthropic
from tests.integration.conftest import conversation_of

pytestmark = pytest.mark.django_db(transaction=True)

ON_POSTGRES = settings.DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql"

KEY_A = base64.urlsafe_b64encode(b"A" * 32).decode()
KEY_B = base64.urlsafe_b64encode(b"B" * 32).decode()
ID_A = encryption.key_id(b"A" * 32)
ID_B = encryption.key_id(b"B" * 32)

THREE_TURNS = 'Think, then look.\n@lookup {"key": "a"}\n@lookup {"key": "b"} && lookup {"key": "c"}'


def raw(table: str, column: str, where: str = "", params: tuple[Any, ...] = ()) -> list[Any]:
    """The stored text of a column, as SQL reads it (no field conversion)."""
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT {column} FROM {table} {where}", params)
        return [row[0] for row in cursor.fetchall()]


def raw_steps(run: AgentRun) -> list[str]:
    rid = run.pk.hex if connection.vendor == "sqlite" else str(run.pk)
    return raw("agent_step", "payload", "WHERE run_id = %s ORDER BY seq", (rid,))


def under(key_id: str, values: list[Any]) -> bool:
    return bool(values) and all(
        isinstance(v, str) and v.startswith(f"da:enc:v1:{key_id}:") for v in values
    )


# --------------------------------------------------------------------------- resume


def interrupted_then_resumed(
    fake_api: FakeAnthropic, monkeypatch: pytest.MonkeyPatch, da_settings: Any
) -> AgentRun:
    """A thinking run committed up to its second turn under key A (the worker drains), then
    claimed again with keys [B, A]: its log is rebuilt by decrypting under A."""
    da_settings(ENCRYPTION_KEYS=[KEY_A])
    run = api.start_run("thinker", THREE_TURNS)
    drain = threading.Event()
    chosen = store.current()
    before_commit_of(monkeypatch, 2, lambda claim: drain.set())
    first = chosen.claim_run(run.pk, "w1", 30)
    assert first is not None
    assert advance_run(first, drain=drain) == "released"
    assert under(ID_A, raw_steps(run))
    da_settings(ENCRYPTION_KEYS=[KEY_B, KEY_A])
    second = chosen.claim_run(run.pk, "w2", 30)
    assert second is not None
    advance_run(second)
    return AgentRun.objects.get(pk=run.pk)


def test_a_thinking_run_resumed_with_encryption_sends_the_history_byte_for_byte(
    fake_api: FakeAnthropic, monkeypatch: pytest.MonkeyPatch, da_settings: Any
) -> None:
    run = interrupted_then_resumed(fake_api, monkeypatch, da_settings)
    # The offline model checks every thinking signature over the history: a changed value or
    # key order anywhere would have been a 400 and a failed run.
    assert run.status == "succeeded", run.error
    assert len(fake_api.requests) == 3
    # The resumed request extends the first claim's last request (built in memory, never
    # read back) by exactly the steps committed since: byte for byte.
    assert fake_api.requests[2].body.startswith(fake_api.requests[1].body[: -len(b"]}")])
    params = registry.get("thinker").request_for(run.model)
    steps = own_steps(run.pk)
    assert fake_api.requests[2].body == llm.request_body(params, conversation_of(steps[:5]).json())
    stored = raw_steps(run)
    assert under(ID_A, stored[:4])
    assert under(ID_B, stored[4:])
    assert not any("lookup" in text for text in stored)


def test_a_byte_changed_by_decryption_is_refused_by_the_model(
    fake_api: FakeAnthropic, monkeypatch: pytest.MonkeyPatch, da_settings: Any
) -> None:
    # The guard of the test above: decryption that changes one character of a thinking text
    # makes the resumed request fail the signature check.
    unseal = encryption.Keyring.unseal

    def one_byte_off(self: encryption.Keyring, stored: str, column: str) -> str:
        text = unseal(self, stored, column)
        return re.sub(
            r'("thinking"\s*:\s*")(.)', lambda m: m[1] + chr(ord(m[2]) ^ 1), text, count=1
        )

    monkeypatch.setattr(encryption.Keyring, "unseal", one_byte_off)
    run = interrupted_then_resumed(fake_api, monkeypatch, da_settings)
    assert run.status == "dead"
    assert "Invalid `signature` in `thinking` block" in run.error


# --------------------------------------------------------------------------- every column


def test_every_customer_column_holds_ciphertext_and_reads_back_plain(
    fake_api: FakeAnthropic, receiver: Any, da_settings: Any
) -> None:
    da_settings(ENCRYPTION_KEYS=[KEY_A])
    staff = get_user_model().objects.create_superuser("ops", "ops@example.com", "pw")
    evented = api.start_run("waiter", 'Wait.\n@await_event {"name": "refund:o-1"}')
    asked = api.start_run("waiter", '@ask_person {"question": "Which region?"}')
    dropped = api.start_run("tester", 'Drop it.\n@drop_table {"table": "orders"}')
    run_worker()
    api.send_event("refund:o-1", {"card": "4242-secret"})
    api.answer_question(asked.pk, "eu-west, secretly", user=staff)
    # The payload is stored once, on the event; the woken run refers to it.
    assert AgentRun.objects.get(pk=evented.pk).woken_by["event"] == "refund:o-1"
    assert AgentEvent.objects.get(name="refund:o-1").payload == {"card": "4242-secret"}
    assert "4242-secret" not in str(raw("agent_run", "woken_by"))
    api.approve_intent(dropped.intents.get().pk, user=staff)
    run_worker()
    for run in (evented, asked, dropped):
        assert AgentRun.objects.get(pk=run.pk).status == "succeeded"
    for table, column in [
        ("agent_step", "payload"),
        ("tool_effect", "result"),
        ("tool_intent", "input"),
        ("agent_event", "payload"),
        ("agent_question", "answer"),
    ]:
        assert under(ID_A, raw(table, column)), (table, column)
    assert not any("secret" in text for text in raw("agent_step", "payload"))
    assert AgentEvent.objects.get().payload == {"card": "4242-secret"}
    assert AgentQuestion.objects.get().answer == "eu-west, secretly"
    assert dropped.intents.get().input == {"table": "orders"}
    assert ToolEffect.objects.filter(tool="drop_table").get().result is not None
    assert "4242-secret" in json.dumps(api.messages_for(evented.pk))


# --------------------------------------------------------------------------- unknown keys


def test_a_run_under_a_key_no_longer_configured_is_dead_lettered_naming_the_key(
    fake_api: FakeAnthropic, da_settings: Any, admin_client: Any
) -> None:
    da_settings(ENCRYPTION_KEYS=[KEY_A])
    fresh = api.start_run("tester", "Only a task.")
    going = api.start_run("tester", '@lookup {"key": "a"}')
    claim = store.current().claim_run(going.pk, "w1", 30)
    assert claim is not None
    turn = llm.create_turn(
        registry.get("tester").request_for(going.model),
        api.messages_for(going.pk),
        interrupt=Interrupt(),
    )
    assert store.current().append_step(claim, StepWrite(1, "model_turn", turn.body))
    assert store.current().release_lease(claim)
    da_settings(ENCRYPTION_KEYS=[KEY_B])  # key A is gone
    worker = run_worker()
    for run in (fresh, going):
        dead = AgentRun.objects.get(pk=run.pk)
        assert dead.status == "dead"
        assert f"key id {ID_A}" in dead.error
        assert "agent_step.payload" in dead.error
        assert KEY_A not in dead.error
        assert KEY_B not in dead.error
    assert worker.stats.dispositions.get("dead") == 2
    # The transcript names the problem in place of each step it cannot read.
    page = admin_client.get(reverse("admin:durable_agents_agentrun_change", args=[going.pk]))
    assert page.status_code == 200
    assert f"[cannot decrypt: agent_step.payload is encrypted with key id {ID_A}" in (
        page.content.decode()
    )


def test_an_event_payload_under_a_missing_key_dead_letters_the_woken_run(
    fake_api: FakeAnthropic, receiver: Any, da_settings: Any, admin_client: Any
) -> None:
    # woken_by is read by the claim itself: the run is dead-lettered, and the other run the
    # same worker claims goes on.
    run = api.start_run("waiter", 'Wait.\n@await_event {"name": "gone"}')
    run_worker()
    da_settings(ENCRYPTION_KEYS=[KEY_A])
    api.send_event("gone", {"x": 1})
    da_settings(ENCRYPTION_KEYS=[KEY_B])
    other = api.start_run("tester", "Just answer.")
    run_worker(concurrency=2)
    dead = AgentRun.objects.defer("woken_by").get(pk=run.pk)
    assert dead.status == "dead"
    assert f"agent_run.woken_by is encrypted with key id {ID_A}" in dead.error
    assert AgentRun.objects.get(pk=other.pk).status == "succeeded"
    # Its page names the problem where the value would be, instead of failing.
    page = admin_client.get(reverse("admin:durable_agents_agentrun_change", args=[run.pk]))
    assert page.status_code == 200
    assert f"[cannot decrypt: agent_run.woken_by is encrypted with key id {ID_A}" in (
        page.content.decode()
    )
    events = admin_client.get(reverse("admin:durable_agents_agentevent_changelist"))
    assert f"key id {ID_A}" in events.content.decode()


# --------------------------------------------------------------------------- rotation


def test_rotation_encrypts_plain_rows_and_rewrites_old_keys_under_the_first(
    fake_api: FakeAnthropic, da_settings: Any
) -> None:
    plain = api.start_run("tester", '@lookup {"key": "plain"}')
    run_worker()
    da_settings(ENCRYPTION_KEYS=[KEY_A])
    old = api.start_run("tester", '@lookup {"key": "old"}')
    run_worker()
    before = {run.pk: api.messages_for(run.pk) for run in (plain, old)}
    logs = {run.pk: load_log(run.pk, trim=False).conversation.json() for run in (plain, old)}
    da_settings(ENCRYPTION_KEYS=[KEY_B, KEY_A])
    out = StringIO()
    call_command("durable_agents_rotate_keys", "--dry-run", stdout=out)
    assert "agent_step.payload: 8 rows to rewrite" in out.getvalue()
    assert under(ID_A, raw_steps(old))
    assert raw_steps(plain)[0].startswith('"')
    out = StringIO()
    call_command("durable_agents_rotate_keys", "--batch-size", "3", stdout=out)
    assert "agent_step.payload: 3 rewritten so far" in out.getvalue()
    assert "agent_step.payload: done, 8 rewritten" in out.getvalue()
    for run in (plain, old):
        assert under(ID_B, raw_steps(run))
        assert api.messages_for(run.pk) == before[run.pk]
        assert load_log(run.pk, trim=False).conversation.json() == logs[run.pk]
    assert under(ID_B, raw("tool_effect", "result"))
    # Resumable: a second pass finds nothing; and key A can go now.
    da_settings(ENCRYPTION_KEYS=[KEY_B])
    out = StringIO()
    call_command("durable_agents_rotate_keys", "--dry-run", stdout=out)
    assert "0 rows to rewrite in all" in out.getvalue()


def test_rotation_never_overwrites_a_value_written_after_it_was_read(da_settings: Any) -> None:
    da_settings(ENCRYPTION_KEYS=[KEY_A])
    event = api.send_event("e-1", {"v": "first"})
    da_settings(ENCRYPTION_KEYS=[KEY_B, KEY_A])
    ring = encryption.keyring()
    assert ring is not None
    column = next(c for c in rekey.encrypted_columns() if c.label == "agent_event.payload")
    (rows,) = list(rekey._batches(column, ring, 10))
    # A writer changes the row between the rotation's read and its write.
    AgentEvent.objects.filter(pk=event.pk).update(payload={"v": "newer"})
    tally = rekey.Tally()
    rekey._rewrite(column, ring, rows, tally)
    assert (tally.rewritten, tally.changed) == (0, 1)
    assert AgentEvent.objects.get(pk=event.pk).payload == {"v": "newer"}


def test_rotation_reports_rows_it_cannot_decrypt_and_fails(da_settings: Any) -> None:
    da_settings(ENCRYPTION_KEYS=[KEY_A])
    api.send_event("e-1", {"v": 1})
    da_settings(ENCRYPTION_KEYS=[KEY_B])
    err = StringIO()
    with pytest.raises(CommandError, match="1 rows could not be decrypted"):
        call_command("durable_agents_rotate_keys", stdout=StringIO(), stderr=err)
    assert f"key id {ID_A}" in err.getvalue()


def test_rotate_keys_prints_a_new_key_and_refuses_without_keys() -> None:
    out = StringIO()
    call_command("durable_agents_rotate_keys", "--new-key", stdout=out)
    assert len(encryption.parse_key(out.getvalue().strip())) == 32
    with pytest.raises(CommandError, match="ENCRYPTION_KEYS'] is empty"):
        call_command("durable_agents_rotate_keys", stdout=StringIO())


@pytest.mark.postgres
@pytest.mark.skipif(not ON_POSTGRES, reason="workers and rotation at once: PostgreSQL")
def test_rotation_while_a_worker_runs(
    fake_api: FakeAnthropic, da_settings: Any, worker_thread: Any
) -> None:
    da_settings(ENCRYPTION_KEYS=[KEY_A])
    runs = [api.start_run("tester", f'@lookup {{"key": "k{i}"}}') for i in range(12)]
    da_settings(ENCRYPTION_KEYS=[KEY_B, KEY_A])
    worker_thread(concurrency=4)
    # Small batches, pass after pass, while the worker commits steps (each encrypted under B
    # already) and claims runs whose task steps are under A.
    passes_during_runs = 0
    for _ in range(200):
        if not AgentRun.objects.exclude(status="succeeded").exists():
            break
        passes_during_runs += 1
        call_command("durable_agents_rotate_keys", "--batch-size", "2", stdout=StringIO())
    # 12 runs of 2 model calls each through a fake API over HTTP outlast the first check.
    assert passes_during_runs > 0
    wait_for(lambda: not AgentRun.objects.exclude(status="succeeded").exists(), timeout=60)
    call_command("durable_agents_rotate_keys", stdout=StringIO())
    for run in runs:
        assert under(ID_B, raw_steps(run))
        messages = api.messages_for(run.pk)
        assert len(messages) == 4
        assert messages[0]["content"].startswith("@lookup")


# --------------------------------------------------------------------------- the admin


def test_the_admin_shows_plain_text_of_encrypted_columns(
    fake_api: FakeAnthropic, admin_client: Any, da_settings: Any
) -> None:
    da_settings(ENCRYPTION_KEYS=[KEY_A])
    run = api.start_run("tester", '@lookup {"key": "zebra-crossing"}')
    run_worker()
    api.send_event("evt-1", {"note": "okapi-payload"})
    assert not any("zebra-crossing" in text for text in raw_steps(run)[1:])
    assert "okapi" not in raw("agent_event", "payload")[0]
    page = admin_client.get(reverse("admin:durable_agents_agentrun_change", args=[run.pk]))
    assert page.status_code == 200
    html = page.content.decode()
    assert "value-of-zebra-crossing" in html  # the tool's result, decrypted
    assert "da:enc:v1:" not in html.replace("(da:enc:v1:...)", "")
    assert f"durable_agents_decrypt --run {run.pk}" in html  # the SQL hint says how to read
    events = admin_client.get(reverse("admin:durable_agents_agentevent_changelist"))
    assert "okapi-payload" in events.content.decode()
    assert "da:enc:v1:" not in events.content.decode()


def test_decrypt_reads_values_pasted_from_sql_and_a_runs_log(
    fake_api: FakeAnthropic, da_settings: Any
) -> None:
    da_settings(ENCRYPTION_KEYS=[KEY_A])
    run = api.start_run("tester", '@lookup {"key": "pasted"}')
    run_worker()
    stored = raw_steps(run)
    out = StringIO()
    call_command("durable_agents_decrypt", "--column", "agent_step.payload", *stored, stdout=out)
    assert out.getvalue().splitlines() == [s.payload for s in own_steps(run.pk)]
    out = StringIO()
    call_command("durable_agents_decrypt", "--run", str(run.pk), stdout=out)
    assert "value-of-pasted" in out.getvalue()
    with pytest.raises(CommandError, match="copied from another column"):
        call_command("durable_agents_decrypt", "--column", "tool_effect.result", stored[1])


def test_turning_encryption_off_writes_every_row_back_plain(
    fake_api: FakeAnthropic, da_settings: Any
) -> None:
    da_settings(ENCRYPTION_KEYS=[KEY_A])
    run = api.start_run("tester", '@lookup {"key": "off"}')
    run_worker()
    before = load_log(run.pk, trim=False).conversation.json()
    da_settings(ENCRYPTION_KEYS=[None, KEY_A])
    out = StringIO()
    call_command("durable_agents_rotate_keys", stdout=out)
    assert "written back as plain text" in out.getvalue()
    assert not any(text.startswith("da:") for text in raw_steps(run))
    assert not any(text.startswith("da:") for text in raw("tool_effect", "result"))
    da_settings(ENCRYPTION_KEYS=[])  # the key can go now
    assert load_log(run.pk, trim=False).conversation.json() == before


def test_decrypt_escapes_terminal_controls_in_what_it_prints(da_settings: Any) -> None:
    """A model's progress message may hold terminal escapes: printed as visible text, never
    sent to the terminal, and one value stays one line."""
    da_settings(ENCRYPTION_KEYS=[KEY_A])
    message = "\x1b]0;owned\x07\x1b[2Jdone\nnext"
    stored = encryption.seal(message, "agent_progress.message")
    out = StringIO()
    call_command("durable_agents_decrypt", "--column", "agent_progress.message", stored, stdout=out)
    assert out.getvalue() == "\\x1b]0;owned\\x07\\x1b[2Jdone\\nnext\n"
    assert "\x1b" not in out.getvalue()


def test_rotation_reads_each_encrypted_column_once() -> None:
    """The run's proxy models share its table: woken_by is one column, rewritten once."""
    labels = [column.label for column in rekey.encrypted_columns()]
    assert sorted(labels) == sorted(set(labels))
    assert labels.count("agent_run.woken_by") == 1
