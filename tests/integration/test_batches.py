"""Runs in batches (``start_run(..., batch=True)``): each model turn goes through the Message
Batches API of the offline model (its ``BatchDesk``), committed as the text the API returned,
fenced on the run still waiting on that request."""

from __future__ import annotations

import json
import time
from decimal import Decimal

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db.models import Sum
from django.db.models.functions import Now
from django.test import override_settings

from durable_agents import Agent, api, store
from durable_agents._internal.interrupt import Interrupt
from durable_agents.batches import Submitter, Tally, poll_due
from durable_agents.engine.runner import advance_run
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
from durable_agents.testing import drive, plan

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("desk")]

PRICES = {"claude-test-1": {"input": 3.0, "output": 15.0}}


def turns_of(run: AgentRun) -> list[AgentStep]:
    return list(AgentStep.objects.filter(run=run, kind=StepKind.MODEL_TURN).order_by("seq"))


def test_a_run_in_batches_waits_without_a_worker_and_ends_with_every_turn_batched(desk) -> None:
    run = api.start_run(
        "tester", plan(("lookup", {"key": "a"}), ("lookup", {"key": "b"})), batch=True
    )
    assert run.batch
    result = drive(run)
    assert result.status == RunStatus.SUCCEEDED, result.error
    stats = desk.stats()
    # Three turns (two tool calls and the answer), each in a batch of its own.
    assert stats.creates == 3
    assert stats.batch_sizes == [1, 1, 1]
    turns = turns_of(run)
    assert len(turns) == 3
    requests = list(AgentBatchRequest.objects.filter(run=run).order_by("seq"))
    assert [r.seq for r in requests] == [t.seq for t in turns]
    assert all(r.status == RequestStatus.ANSWERED and r.body == "" for r in requests)
    assert all((t.request_id or "").startswith("msgbatch_") for t in turns)
    assert AgentBatch.objects.filter(status=BatchStatus.ENDED).count() == 3


def test_the_turn_is_the_text_the_api_returned_and_goes_back_byte_for_byte(desk) -> None:
    run = api.start_run(
        "thinker", plan(("lookup", {"key": "a"}), ("lookup", {"key": "b"})), batch=True
    )
    result = drive(run)
    # The offline model checks every thinking signature of the history it is sent: a turn
    # re-encoded on the way would be refused (a 400, the run dead).
    assert result.status == RunStatus.SUCCEEDED, result.error
    assert all(json.loads(t.payload)["content"][0]["type"] == "thinking" for t in turns_of(run)[:2])


def test_a_run_waiting_for_its_batch_is_parked_and_claimed_by_nobody(desk) -> None:
    run = api.start_run("tester", plan(("lookup", {"key": "a"})), batch=True)
    claim = store.current().claim_run(run.pk, "w", 30)
    assert claim is not None
    advance_run(claim, Interrupt())
    run.refresh_from_db()
    assert run.status == RunStatus.WAITING
    assert run.waiting_for == WaitKind.BATCH
    assert run.lease_owner is None
    assert run.wake_at is None
    request = AgentBatchRequest.objects.get(run=run)
    assert run.wait_key == str(request.pk)
    assert request.status == RequestStatus.WAITING
    assert request.seq == 1
    assert json.loads(request.body)["messages"][0]["role"] == "user"
    assert store.current().claim_runs("w2", 30, 10) == []
    # Not due yet within the window: nothing is submitted.
    assert Submitter("w").submit_due().batches == 0
    assert Submitter("w").submit_due(force=True).batches == 1
    tally = poll_due("w", force=True)
    assert tally.committed == 1
    run.refresh_from_db()
    assert run.status == RunStatus.PENDING
    assert run.last_seq == 1


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
    assert batched.cost_usd is not None
    assert batched.cost_usd * 2 == direct.cost_usd
    day = AgentUsageDay.objects.aggregate(turns=Sum("turns"), batched=Sum("batch_turns"))
    assert day == {"turns": 4, "batched": 2}
    saved = sum((b.saved_usd or Decimal(0) for b in AgentBatch.objects.all()), Decimal(0))
    assert saved == batched.cost_usd


def test_a_cancelled_run_ends_at_once_and_its_answer_is_ignored(desk) -> None:
    run = api.start_run("tester", plan(("lookup", {"key": "a"})), batch=True)
    park(run)
    assert Submitter("w").submit_due(force=True).batches == 1
    assert api.cancel_run(run.pk)
    tally = poll_due("w", force=True)
    assert tally.committed == 0
    run.refresh_from_db()
    assert run.status == RunStatus.CANCELLED
    assert run.last_seq == 0
    assert turns_of(run) == []


# -- every outcome of a request ------------------------------------------------------------


def park(run: AgentRun) -> None:
    """Claim ``run`` and advance it until it parks on its next batched turn."""
    claim = store.current().claim_run(run.pk, "w", 30)
    assert claim is not None
    advance_run(claim, Interrupt())
    run.refresh_from_db()
    assert run.waiting_for == WaitKind.BATCH
    assert run.status == RunStatus.WAITING


def submit_and_poll() -> Tally:
    assert Submitter("w").submit_due(force=True).batches == 1
    return poll_due("w", force=True)


def the_request(run: AgentRun) -> AgentBatchRequest:
    return AgentBatchRequest.objects.get(run=run, seq=run.last_seq + 1)


def test_an_expired_request_goes_into_a_later_batch_and_the_run_goes_on(desk) -> None:
    run = api.start_run("tester", plan(("lookup", {"key": "a"})), batch=True)
    park(run)
    desk.expire_ratio = 1.0
    tally = submit_and_poll()
    assert (tally.committed, tally.resent) == (0, 1)
    request = the_request(run)
    assert request.status == RequestStatus.WAITING
    assert request.tries == 1
    assert "expired" in request.reason
    desk.expire_ratio = 0.0
    assert submit_and_poll().committed == 1
    assert the_request_after(run).tries == 2
    assert drive(run).status == RunStatus.SUCCEEDED


def the_request_after(run: AgentRun) -> AgentBatchRequest:
    return AgentBatchRequest.objects.filter(run=run).order_by("seq")[0]


def test_an_overloaded_answer_is_sent_again_and_a_request_error_dead_letters(desk) -> None:
    run = api.start_run("tester", plan(("lookup", {"key": "a"})), batch=True)
    retired = api.start_run("tester", "Hello.", model="claude-2.0", batch=True)
    park(run)
    park(retired)
    desk.error_ratio = 1.0
    tally = poll_after_submit_all()
    # Both came back overloaded (an error of the API, not of the request): sent again.
    assert (tally.resent, tally.failed, tally.committed) == (2, 0, 0)
    desk.error_ratio = 0.0
    tally = poll_after_submit_all()
    assert (tally.resent, tally.failed, tally.committed) == (0, 1, 1)
    retired.refresh_from_db()
    assert retired.status == RunStatus.DEAD
    assert "not_found_error" in retired.error
    assert "claude-2.0" in retired.error
    run.refresh_from_db()
    assert run.status == RunStatus.PENDING
    assert run.last_seq == 1


def poll_after_submit_all() -> Tally:
    Submitter("w").submit_due(force=True)
    return poll_due("w", force=True)


@override_settings()
def test_tries_run_out_and_the_run_is_dead_lettered_with_why(desk, settings) -> None:
    settings.DURABLE_AGENTS = {**settings.DURABLE_AGENTS, "MAX_ATTEMPTS": 2}
    run = api.start_run("tester", plan(("lookup", {"key": "a"})), batch=True)
    park(run)
    desk.expire_ratio = 1.0
    assert submit_and_poll().resent == 1
    assert submit_and_poll().failed == 1
    run.refresh_from_db()
    assert run.status == RunStatus.DEAD
    assert "tried in 2 batches" in run.error
    assert "expired" in run.error
    assert the_request(run).status == RequestStatus.FAILED
    # A person requeues it: the same request waits again, its tries counted from zero.
    desk.expire_ratio = 0.0
    assert api.requeue_run(run.pk)
    park(run)
    request = the_request(run)
    assert request.status == RequestStatus.WAITING
    assert request.tries == 0
    assert drive(run).status == RunStatus.SUCCEEDED


@override_settings()
def test_past_the_fallback_the_run_sends_its_turn_directly(desk, settings) -> None:
    settings.DURABLE_AGENTS = {**settings.DURABLE_AGENTS, "BATCH_FALLBACK_SECONDS": 0}
    run = api.start_run("tester", plan(("lookup", {"key": "a"})), batch=True)
    park(run)
    desk.expire_ratio = 1.0
    tally = submit_and_poll()
    assert tally.direct == 1
    run.refresh_from_db()
    assert run.status == RunStatus.PENDING
    request = the_request(run)
    assert request.status == RequestStatus.DIRECT
    desk.expire_ratio = 0.0
    direct_before = AgentStep.objects.filter(run=run).count()
    claim = store.current().claim_run(run.pk, "w", 30)
    assert claim is not None
    advance_run(claim, Interrupt())
    run.refresh_from_db()
    # The turn was sent directly and committed; the next turn goes into a batch again.
    assert run.last_seq == 2
    assert AgentStep.objects.filter(run=run).count() == direct_before + 2
    assert run.waiting_for == WaitKind.BATCH
    assert not (turns_of(run)[0].request_id or "").startswith("msgbatch_")


def test_a_batch_whose_every_run_was_cancelled_is_cancelled_at_the_api(desk) -> None:
    desk.processing_seconds = 3600
    runs = [api.start_run("tester", plan(("lookup", {"key": k})), batch=True) for k in "ab"]
    for run in runs:
        park(run)
    assert Submitter("w").submit_due(force=True).requests == 2
    api.cancel_run(runs[0].pk)
    poll_due("w", force=True)
    assert desk.stats().cancels == 0  # one run still waits on it
    api.cancel_run(runs[1].pk)
    poll_due("w", force=True)
    assert desk.stats().cancels == 1
    assert AgentBatch.objects.get().status in (BatchStatus.CANCELING, BatchStatus.ENDED)


# -- bad input -----------------------------------------------------------------------------


def test_a_result_for_a_request_never_sent_is_logged_and_ignored(desk, caplog) -> None:
    run = api.start_run("tester", plan(("lookup", {"key": "a"})), batch=True)
    park(run)
    desk.add_unknown_result()
    tally = submit_and_poll()
    assert tally.committed == 1
    assert tally.problems == 1
    assert "not ours" in caplog.text


def test_two_results_for_one_request_commit_one_turn_and_are_paid_once(desk) -> None:
    run = api.start_run("tester", plan(("lookup", {"key": "a"})), batch=True)
    park(run)
    desk.duplicate_result()
    tally = submit_and_poll()
    assert (tally.committed, tally.ignored, tally.problems) == (1, 0, 1)
    assert len(turns_of(run)) == 1
    assert drive(run).status == RunStatus.SUCCEEDED


@pytest.mark.parametrize("fault", ["break_result_line", "put_nul_in_result"])
def test_an_unreadable_line_sends_its_request_again_with_a_reason(desk, fault) -> None:
    run = api.start_run("tester", plan(("lookup", {"key": "a"})), batch=True)
    park(run)
    getattr(desk, fault)()
    tally = submit_and_poll()
    assert (tally.committed, tally.resent, tally.problems) == (0, 1, 1)
    request = the_request(run)
    assert request.status == RequestStatus.WAITING
    assert "without a result" in request.reason
    assert drive(run).status == RunStatus.SUCCEEDED


def test_a_lone_surrogate_in_an_answer_is_stored_as_sent_and_sent_back(desk) -> None:
    run = api.start_run("thinker", plan(("lookup", {"key": "a"})), batch=True)
    park(run)
    desk.put_lone_surrogate_in_result()
    assert submit_and_poll().committed == 1
    (turn,) = turns_of(run)
    assert "\\ud800" in turn.payload
    assert drive(run).status == RunStatus.SUCCEEDED


def test_a_batch_stuck_past_its_expiry_is_given_up_and_its_requests_sent_again(desk) -> None:
    run = api.start_run("tester", plan(("lookup", {"key": "a"})), batch=True)
    park(run)
    desk.stick_next()
    desk.clock = lambda: time.time() - 26 * 3600  # created 26 hours ago: expired 2 hours ago
    assert Submitter("w").submit_due(force=True).batches == 1
    desk.clock = time.time
    tally = poll_due("w", force=True)
    assert tally.resent == 1
    batch = AgentBatch.objects.get()
    assert batch.status == BatchStatus.ABANDONED
    assert "past its expiry" in batch.error
    assert drive(run).status == RunStatus.SUCCEEDED


def test_results_that_answer_500_are_read_at_a_later_poll(desk) -> None:
    run = api.start_run("tester", plan(("lookup", {"key": "a"})), batch=True)
    park(run)
    desk.fail_results(500)
    tally = submit_and_poll()
    assert tally.committed == 0
    batch = AgentBatch.objects.get()
    assert batch.result_failures == 1
    assert "500" in batch.error
    assert poll_due("w", force=True).committed == 1


def test_results_that_stay_404_give_the_batch_up(desk) -> None:
    run = api.start_run("tester", plan(("lookup", {"key": "a"})), batch=True)
    park(run)
    desk.fail_results(404, times=10)
    submit_and_poll()
    for _ in range(10):
        if poll_due("w", force=True).resent:
            break
    assert AgentBatch.objects.get().status == BatchStatus.ABANDONED
    assert the_request(run).status == RequestStatus.WAITING


def test_a_run_deleted_while_its_request_waits_costs_a_log_line(desk, caplog) -> None:
    runs = [api.start_run("tester", plan(("lookup", {"key": k})), batch=True) for k in "ab"]
    for run in runs:
        park(run)
    Submitter("w").submit_due(force=True)
    runs[0].delete()
    tally = poll_due("w", force=True)
    assert tally.committed == 1
    assert tally.problems == 1
    assert "not in the database" in caplog.text


def test_the_api_refusing_a_create_for_its_queue_leaves_the_requests_waiting(desk) -> None:
    desk.max_queued_requests = 0
    run = api.start_run("tester", plan(("lookup", {"key": "a"})), batch=True)
    park(run)
    submitter = Submitter("w")
    assert submitter.submit_due(force=True).batches == 0
    request = the_request(run)
    assert request.status == RequestStatus.WAITING
    assert request.tries == 0
    assert "rate_limit" in request.reason or "429" in request.reason
    desk.max_queued_requests = None
    # The whole fleet waits out the retry-after: the request is not due before it.
    assert submitter.submit_due(force=True).batches == 0
    assert Submitter("w2").submit_due(force=True).batches == 0
    AgentBatchRequest.objects.update(queued_at=Now())
    assert Submitter("w2").submit_due(force=True).batches == 1


def test_batch_and_stream_exclude_each_other_and_batch_is_no_part_of_the_fingerprint() -> None:
    with pytest.raises(ImproperlyConfigured, match="batch=True and stream=True"):
        Agent(name="x", version="1", model="claude-test-1", batch=True, stream=True, register=False)
    plain = Agent(name="x", version="1", model="claude-test-1", register=False)
    batched = Agent(name="x", version="1", model="claude-test-1", batch=True, register=False)
    assert plain.fingerprint() == batched.fingerprint()


def test_a_streaming_agent_runs_in_batches_without_streaming(desk) -> None:
    run = api.start_run("streamer", plan(("lookup", {"key": "a"})), batch=True)
    assert drive(run).status == RunStatus.SUCCEEDED
    assert desk.stats().creates == 2


def test_only_the_batch_a_request_is_in_now_answers_it(desk) -> None:
    """A run that asked again while its request was in a batch (an upgrade hands it back, as
    here): the first batch's answer was for the request as it was, and is paid, not used."""
    run = api.start_run("tester", plan(("lookup", {"key": "a"})), batch=True)
    park(run)
    assert Submitter("w").submit_due(force=True).batches == 1
    AgentRun.objects.filter(pk=run.pk).update(status=RunStatus.PENDING, waiting_for="")
    park(run)  # the same request, waiting again for a batch
    tally = poll_due("w", force=True)
    assert (tally.committed, tally.ignored) == (0, 1)
    run.refresh_from_db()
    assert run.last_seq == 0
    assert run.tokens_used > 0  # the ignored answer was paid for
    assert submit_and_poll().committed == 1
    assert drive(run).status == RunStatus.SUCCEEDED
