"""The admin and encryption at rest: with ENCRYPTION_KEYS set, the audit log
(``django_admin_log``, plain text in every dump and backup) records that a person answered,
sent or resolved, and who, never the answer, the payload or the result. Without keys it quotes
them as before.

Through the real admin (Django's test client) on the real database."""

from __future__ import annotations

import base64
from typing import Any

import pytest
from django.contrib.admin.models import LogEntry
from django.test import Client
from django.urls import reverse

from durable_agents.models import AgentEvent, AgentQuestion, IntentStatus, ToolEffect, WaitKind
from tests.integration.test_admin import hidden_fields, intent_url, parked_intent
from tests.integration.test_admin_waits import answer_url, park, parked, question_url, send_url

pytestmark = pytest.mark.django_db(transaction=True)

KEY = base64.urlsafe_b64encode(b"K" * 32).decode()
SECRET = "account password hunter2"


def audit_text() -> str:
    """Everything the audit log holds, as one text: the message and the object's name."""
    return "\n".join(
        f"{entry.object_repr}\n{entry.change_message}" for entry in LogEntry.objects.all()
    )


def act_everywhere(client: Client) -> int:
    """Answer a question on the run page and on the question page, send an event from its
    form and from the runs list, and resolve an intent, each with SECRET in what is typed.
    Returns how many LogEntry rows the actions were expected to write."""
    for view in ("run", "question"):
        run = parked('@ask_person {"question": "The password?"}')
        question = AgentQuestion.objects.get(run_id=run.pk)
        url = answer_url(run) if view == "run" else question_url(question, "answer")
        response = client.post(url, {"question": question.pk, "answer": SECRET})
        assert response.status_code == 302, view
        assert AgentQuestion.objects.get(pk=question.pk).answer == SECRET

    park(WaitKind.EVENT, wait_event="deploy:1")
    payload = f'{{"note": "{SECRET}"}}'
    assert client.post(send_url(), {"name": "deploy:1", "payload": payload}).status_code == 302
    waiting = park(WaitKind.EVENT, wait_event="deploy:2")
    runs = reverse("admin:durable_agents_agentrun_changelist")
    data = {"action": "send_events", "_selected_action": [waiting.pk], "index": 0}
    confirm = client.post(runs, data)
    assert client.post(runs, {**hidden_fields(confirm), "payload": payload}).status_code == 302
    for name in ("deploy:1", "deploy:2"):
        assert AgentEvent.objects.get(name=name).payload == {"note": SECRET}

    intent = parked_intent(IntentStatus.UNKNOWN)
    response = client.post(intent_url(intent, "resolve"), {"happened": "yes", "result": SECRET})
    assert response.status_code == 302
    assert ToolEffect.objects.get(key=intent.key).result == SECRET
    # Two per answer (the question and its run), one per send and one per woken run, one for
    # the resolution.
    return 2 + 2 + 1 + 2 + 1


def test_with_encryption_no_audit_entry_holds_an_encrypted_value(
    admin_client: Client, superuser: Any, da_settings: Any
) -> None:
    da_settings(ENCRYPTION_KEYS=[KEY])
    expected = act_everywhere(admin_client)
    entries = list(LogEntry.objects.all())
    # Each action is still audited, by whom.
    assert len(entries) == expected
    assert {entry.user_id for entry in entries} == {superuser.pk}
    text = audit_text()
    assert "hunter2" not in text
    assert "encrypted at rest" in text


def test_with_a_first_entry_of_none_values_stay_out_of_the_audit(
    admin_client: Client, da_settings: Any
) -> None:
    """Turning encryption on or off ([None, KEY]): rows may be encrypted, so the audit keeps
    to the rule while any key is configured."""
    da_settings(ENCRYPTION_KEYS=[None, KEY])
    act_everywhere(admin_client)
    assert "hunter2" not in audit_text()


def test_without_encryption_the_audit_quotes_what_was_typed(admin_client: Client) -> None:
    act_everywhere(admin_client)
    text = audit_text()
    assert f"Answered: “{SECRET}”." in text
    assert "Sent from the admin with payload" in text
    assert f"recorded result '{SECRET}'" in text
    assert "encrypted at rest" not in text


def test_a_progress_message_never_reaches_its_str() -> None:
    # str() of a row lands in LogEntry.object_repr and in log lines: never the encrypted value.
    import uuid

    from durable_agents.models import AgentProgress

    # A fixed run id: a random one holds "4111" in about one run of two thousand.
    run_id = uuid.UUID("01a24d54-2288-7307-8b14-42f33e9ee71c")
    progress = AgentProgress(run_id=run_id, seq=3, message="card 4111 1111 1111 1111")
    assert "4111" not in str(progress)
    assert "#3" in str(progress)
