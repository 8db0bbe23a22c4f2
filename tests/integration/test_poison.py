"""Rows the engine cannot read back: a stored JSON text that does not decode (written by hand,
by a bug, or encrypted under a key that is gone) or a wait on ids that are not run ids. Such a
run is poison: it is dead-lettered with the reason, and the worker, the sweep and the admin go
on with everything else."""

from __future__ import annotations

import json
from typing import Any

import pytest
from django.conf import settings
from django.core.management import call_command
from django.db import connection
from django.test import Client
from django.urls import reverse

from durable_agents import api
from durable_agents.engine.worker import Worker
from durable_agents.exceptions import DurableAgentsError, StoredValueError
from durable_agents.housekeeping.sweeps import sweep
from durable_agents.models import AgentRun, AgentStep, RunStatus, ToolIntent, WaitKind, short_id
from tests.conftest import run_worker

pytestmark = pytest.mark.django_db(transaction=True)

ON_POSTGRES = settings.DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql"


def reload(run: AgentRun) -> AgentRun:
    return AgentRun.objects.get(pk=run.pk)


def write_raw(table: str, column: str, text: str, where: str, value: Any) -> None:
    """Store ``text`` as it is (no encoding by the field): what a bug or a hand edit leaves."""
    with connection.cursor() as cursor:
        cursor.execute(f"UPDATE {table} SET {column} = %s WHERE {where} = %s", [text, value])


def status_and_error(run: AgentRun) -> tuple[str, str]:
    row = AgentRun.objects.filter(pk=run.pk).values_list("status", "error").get()
    return row[0], row[1]


def test_a_stored_value_error_is_ours_and_names_its_column() -> None:
    run = api.start_run("tester", "Say hello.")
    write_raw("agent_run", "woken_by", "{broken", "id", run.pk.hex)
    with pytest.raises(StoredValueError, match=r"agent_run\.woken_by cannot be decoded") as caught:
        reload(run)
    assert isinstance(caught.value, DurableAgentsError)
    assert caught.value.column == "agent_run.woken_by"


def test_a_run_whose_woken_by_does_not_decode_is_dead_lettered_and_the_worker_goes_on() -> None:
    poison = api.start_run("tester", "Say hello.")
    healthy = api.start_run("tester", "Say hello too.")
    write_raw("agent_run", "woken_by", "{broken", "id", poison.pk.hex)

    worker = Worker(burst=True, handle_signals=False, concurrency=2)
    assert worker.run() == 0
    status, error = status_and_error(poison)
    assert status == RunStatus.DEAD
    assert "poison run: agent_run.woken_by cannot be decoded: JSONDecodeError" in error
    assert status_and_error(healthy)[0] == RunStatus.SUCCEEDED
    # Dead-lettered by its first claim, not after MAX_ATTEMPTS of them.
    assert AgentRun.objects.filter(pk=poison.pk).values_list("attempt", flat=True).get() == 1


@pytest.mark.postgres
def test_a_poison_run_claimed_with_the_last_step_of_another_is_dead_lettered() -> None:
    """On PostgreSQL the statement that commits a run's last step claims the slot's next run:
    that path reads the next run's row too."""
    first = api.start_run("tester", "Say hello.", priority=50)
    poison = api.start_run("tester", "Say hello too.")
    write_raw("agent_run", "woken_by", "{broken", "id", poison.pk.hex)

    worker = Worker(burst=True, handle_signals=False, concurrency=1)
    assert worker.run() == 0
    assert status_and_error(first)[0] == RunStatus.SUCCEEDED
    status, error = status_and_error(poison)
    assert status == RunStatus.DEAD
    assert "agent_run.woken_by cannot be decoded" in error
    # It was taken by the finishing statement: one claim, and no claim of the claimer's.
    assert worker.stats.claims == 1


def test_an_intent_whose_input_does_not_decode_dead_letters_its_run_at_once() -> None:
    run = api.start_run("tester", '@drop_table {"table": "orders"}')
    run_worker()
    intent = ToolIntent.objects.get(run_id=run.pk)
    write_raw("tool_intent", "input", '{"table": ', "id", intent.pk)
    AgentRun.objects.filter(pk=run.pk).update(status=RunStatus.PENDING)

    run_worker()
    status, error = status_and_error(run)
    assert status == RunStatus.DEAD
    assert "poison run: tool_intent.input cannot be decoded" in error


def test_a_last_step_that_does_not_decode_dead_letters_its_run_at_once() -> None:
    run = api.start_run("tester", '@lookup {"key": "a"}')
    run_worker(max_runs=1)
    AgentRun.objects.filter(pk=run.pk).update(status=RunStatus.PENDING, lease_until=None)
    last_seq = reload(run).last_seq
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE agent_step SET payload = %s WHERE run_id = %s AND seq = %s",
            ["[{not json", run.pk.hex, last_seq],
        )
    run_worker()
    status, error = status_and_error(run)
    assert status == RunStatus.DEAD
    assert "agent_step.payload cannot be decoded" in error


def test_a_recorded_effect_that_does_not_decode_dead_letters_its_run_at_once() -> None:
    run = api.start_run("tester", '@lookup {"key": "a"}')
    run_worker()
    assert reload(run).status == RunStatus.SUCCEEDED
    # Back to the moment after the call was recorded and before its result step committed
    # (a worker that died there): the resume reads the recorded effect.
    AgentStep.objects.filter(run_id=run.pk, seq__gte=2).delete()
    AgentRun.objects.filter(pk=run.pk).update(
        status=RunStatus.PENDING, last_seq=1, result=None, finished_at=None
    )
    write_raw("tool_effect", "result", "{broken", "run_id", run.pk.hex)
    run_worker()
    status, error = status_and_error(run)
    assert status == RunStatus.DEAD
    assert "poison run: tool_effect.result cannot be decoded" in error


def test_the_run_page_of_a_poison_run_renders_and_says_what_is_undecodable(
    admin_client: Client,
) -> None:
    run = api.start_run("tester", "Say hello.")
    AgentRun.objects.filter(pk=run.pk).update(
        waiting_for=WaitKind.EVENT, status=RunStatus.DEAD, wait_event="x"
    )
    write_raw("agent_run", "woken_by", "{broken", "id", run.pk.hex)
    response = admin_client.get(reverse("admin:durable_agents_agentrun_change", args=[run.pk]))
    assert response.status_code == 200
    page = response.content.decode()
    assert "undecodable: agent_run.woken_by cannot be decoded" in page


def test_the_runs_list_renders_past_a_run_whose_wait_cannot_be_read(
    admin_client: Client,
) -> None:
    bad = _waiting_on("{broken")
    good = api.start_run("tester", "Say hello.")
    response = admin_client.get(reverse("admin:durable_agents_agentrun_changelist"))
    assert response.status_code == 200
    page = response.content.decode()
    assert short_id(bad.pk) in page
    assert short_id(good.pk) in page


def _waiting_on(ids_text: str) -> AgentRun:
    run = api.start_run("tester", "Wait on children.")
    AgentRun.objects.filter(pk=run.pk).update(status=RunStatus.WAITING, waiting_for=WaitKind.RUNS)
    write_raw("agent_run", "wait_runs", ids_text, "id", run.pk.hex)
    return run


@pytest.mark.parametrize(
    "ids_text", ['["not-a-uuid"]', "{broken", "42"], ids=["not-a-uuid", "not-json", "not-list"]
)
def test_the_sweep_dead_letters_a_run_whose_wait_cannot_be_read_and_goes_on(
    ids_text: str,
) -> None:
    bad = _waiting_on(ids_text)
    child = api.start_run("tester", "A child that ended.")
    AgentRun.objects.filter(pk=child.pk).update(status=RunStatus.SUCCEEDED)
    good = _waiting_on(json.dumps([str(child.pk)]))
    AgentRun.objects.filter(pk=child.pk).update(parent_id=good.pk)

    call_command("durable_agents_housekeeping", "--sweep")
    status, error = status_and_error(bad)
    assert status == RunStatus.DEAD
    assert error.startswith("poison run: its wait on child runs cannot be read")
    assert status_and_error(good)[0] == RunStatus.PENDING  # the sweep went on past it
    assert sweep()["parents_woken"] == 0  # and a second sweep finds nothing to do


def test_runagents_starts_and_works_past_a_run_whose_wait_cannot_be_read() -> None:
    bad = _waiting_on('["not-a-uuid"]')
    other = api.start_run("tester", "Say hello.")
    call_command("runagents", "--burst", "--allow-offline")
    assert status_and_error(bad)[0] == RunStatus.DEAD
    assert status_and_error(other)[0] == RunStatus.SUCCEEDED
