"""Runs in batches (``start_run(..., batch=True)``): each model turn goes through the Message
Batches API of the offline model (its ``BatchDesk``), committed as the text the API returned,
fenced on the run still waiting on that request."""

from __future__ import annotations

import json
from collections.abc import Iterator
from decimal import Decimal

import pytest
from django.db.models import Sum
from django.test import override_settings

from durable_agents import api
from durable_agents.batches import Submitter, poll_due
from durable_agents.llm.body import request_body
from durable_agents.models import (
    AgentBatch,
    AgentBatchRequest,
    AgentRun,
    AgentStep,
    AgentUsageDay,
    BatchStatus,
    RequestStatus,
    RunStatus,
    StepKind,
    WaitKind,
)
from durable_agents.offline import shared_batch_desk
from durable_agents.testing import drive, offline_model, plan

pytestmark = pytest.mark.django_db(transaction=True)

PRICES = {"claude-test-1": {"input": 3.0, "output": 15.0}}


@pytest.fixture(autouse=True)
def desk() -> Iterator[object]:
    desk = shared_batch_desk()
    desk.reset()
    with offline_model():
        yield desk
    desk.reset()


def turns_of(run: AgentRun) -> list[AgentStep]:
    return list(AgentStep.objects.filter(run=run, kind=StepKind.MODEL_TURN).order_by("seq"))


def test_a_run_in_batches_waits_without_a_worker_and_ends_with_every_turn_batched(desk) -> None:
    run = api.start_run("tester", plan(("lookup", {"key": "a"}), ("lookup", {"key": "b"})), batch=True)
    assert run.batch
    result = drive(run)
    assert result.status == RunStatus.SUCCEEDED, result.error
    stats = desk.stats()
    assert desk.model_direct_calls() == 0 if hasattr(desk, "model_direct_calls") else True
    # Three turns (two tool calls and the answer), each in a batch of its own.
    assert stats.creates == 3 and stats.batch_sizes == [1, 1, 1]
    turns = turns_of(run)
    assert len(turns) == 3
    requests = list(AgentBatchRequest.objects.filter(run=run).order_by("seq"))
    assert [r.seq for r in requests] == [t.seq for t in turns]
    assert all(r.status == RequestStatus.ANSWERED and r.body == "" for r in requests)
    assert all(t.request_id.startswith("msgbatch_") for t in turns)
    assert AgentBatch.objects.filter(status=BatchStatus.ENDED).count() == 3


def test_the_turn_is_the_text_the_api_returned_and_goes_back_byte_for_byte(desk) -> None:
    run = api.start_run("thinker", plan(("lookup", {"key": "a"}), ("lookup", {"key": "b"})), batch=True)
    result = drive(run)
    # The offline model checks every thinking signature of the history it is sent: a turn
    # re-encoded on the way would be refused (a 400, the run dead).
    assert result.status == RunStatus.SUCCEEDED, result.error
    assert all(json.loads(t.payload)["content"][0]["type"] == "thinking" for t in turns_of(run)[:2])


def test_a_run_waiting_for_its_batch_is_parked_and_claimed_by_nobody(desk) -> None:
    run = api.start_run("tester", plan(("lookup", {"key": "a"})), batch=True)
    result = drive(run, max_claims=5) if False else None
    from durable_agents import store
    from durable_agents.engine.runner import advance_run
    from durable_agents._internal.interrupt import Interrupt

    claim = store.current().claim_run(run.pk, "w", 30)
    assert claim is not None
    advance_run(claim, Interrupt())
    run.refresh_from_db()
    assert run.status == RunStatus.WAITING and run.waiting_for == WaitKind.BATCH
    assert run.lease_owner is None and run.wake_at is None
    request = AgentBatchRequest.objects.get(run=run)
    assert run.wait_key == str(request.pk)
    assert request.status == RequestStatus.WAITING and request.seq == 1
    assert json.loads(request.body)["messages"][0]["role"] == "user"
    assert store.current().claim_runs("w2", 30, 10) == []
    # Not due yet within the window: nothing is submitted.
    assert Submitter("w").submit_due().batches == 0
    assert Submitter("w").submit_due(force=True).batches == 1
    tally = poll_due("w", force=True)
    assert tally.committed == 1
    run.refresh_from_db()
    assert run.status == RunStatus.PENDING and run.last_seq == 1


@override_settings()
def test_batched_turns_cost_half_and_are_counted_as_batched(desk, settings) -> None:
    settings.DURABLE_AGENTS = {**settings.DURABLE_AGENTS, "PRICES": PRICES}
    direct = api.start_run("tester", plan(("lookup", {"key": "a"})))
    batched = api.start_run("tester", plan(("lookup", {"key": "a"})), batch=True)
    assert drive(direct).status == RunStatus.SUCCEEDED
    assert drive(batched).status == RunStatus.SUCCEEDED
    direct.refresh_from_db()
    batched.refresh_from_db()
    assert direct.tokens_used == batched.tokens_used > 0
    assert batched.cost_usd * 2 == direct.cost_usd
    day = AgentUsageDay.objects.aggregate(turns=Sum("turns"), batched=Sum("batch_turns"))
    assert day == {"turns": 4, "batched": 2}
    saved = sum((b.saved_usd for b in AgentBatch.objects.all()), Decimal(0))
    assert saved == batched.cost_usd


def test_a_cancelled_run_ends_at_once_and_its_answer_is_ignored(desk) -> None:
    run = api.start_run("tester", plan(("lookup", {"key": "a"})), batch=True)
    from durable_agents import store
    from durable_agents.engine.runner import advance_run
    from durable_agents._internal.interrupt import Interrupt

    advance_run(store.current().claim_run(run.pk, "w", 30), Interrupt())
    assert Submitter("w").submit_due(force=True).batches == 1
    assert api.cancel_run(run.pk)
    tally = poll_due("w", force=True)
    assert tally.committed == 0
    run.refresh_from_db()
    assert run.status == RunStatus.CANCELLED and run.last_seq == 0
    assert turns_of(run) == []
