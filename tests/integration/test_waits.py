"""Long-running runs: timers, events, child runs and questions, through a
real worker and the offline model over HTTP. The tools (tests/testapp/wait_agents.py) log every
invocation with its key and ``woken_by``, so each test sees exactly how often a call ran.

Time is moved by setting a waiting run's ``wake_at`` into the past (what the clock would do),
except in the test that lets a worker pick a real short timer up by itself."""

from __future__ import annotations

import datetime
import json
import threading
from typing import Any

import pytest
from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.exceptions import PermissionDenied
from django.db import connection
from django.db.models.functions import Now
from django.utils import timezone

from durable_agents import api
from durable_agents.models import (
    AgentEvent,
    AgentQuestion,
    AgentRun,
    AgentStep,
    QuestionStatus,
    RunStatus,
    ToolEffect,
    WaitKind,
)
from durable_agents.store import StepWrite, current
from tests.conftest import run_worker, wait_for
from tests.fakeserver import FakeAnthropic

pytestmark = pytest.mark.django_db(transaction=True)

ON_POSTGRES = settings.DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql"


def reload(run: AgentRun) -> AgentRun:
    return AgentRun.objects.get(pk=run.pk)


def start(task: str, agent: str = "waiter") -> AgentRun:
    return api.start_run(agent, f"Wait for something.\n{task}")


def tool_results(run: AgentRun) -> list[dict[str, Any]]:
    """Every tool_result block the run sent, in order."""
    blocks: list[dict[str, Any]] = []
    for step in AgentStep.objects.filter(run_id=run.pk, kind="tool_result").order_by("seq"):
        blocks += json.loads(step.payload)
    return blocks


def result_value(run: AgentRun, index: int = 0) -> Any:
    return json.loads(tool_results(run)[index]["content"])


def time_passes(run: AgentRun) -> None:
    """The run's timer or timeout is due now."""
    AgentRun.objects.filter(pk=run.pk).update(wake_at=Now() - datetime.timedelta(seconds=1))


@pytest.fixture
def staff() -> Any:
    return get_user_model().objects.create_superuser("ops", "ops@example.com", "pw")


# --------------------------------------------------------------------------- timers


def test_a_timer_parks_the_run_without_a_worker_and_calls_the_tool_again(
    fake_api: FakeAnthropic, receiver: Any
) -> None:
    run = start('@nap {"seconds": 3600}')
    run_worker()
    parked = reload(run)
    assert parked.status == RunStatus.WAITING
    assert parked.waiting_for == WaitKind.TIMER
    assert parked.lease_owner is None
    assert parked.lease_until is None
    assert parked.wake_at is not None
    assert parked.waiting_since is not None
    due_in = (parked.wake_at - parked.waiting_since).total_seconds()
    assert 3599 <= due_in <= 3601
    assert not ToolEffect.objects.filter(run_id=run.pk).exists()  # no effect for the call
    requests = len(fake_api.requests)

    run_worker()  # nothing is due: the waiting run is not claimed
    assert reload(run).status == RunStatus.WAITING
    assert len(fake_api.requests) == requests

    time_passes(run)
    run_worker()
    done = reload(run)
    assert done.status == RunStatus.SUCCEEDED, done.error
    calls = receiver.calls("nap")
    assert [c["woken_by"] for c in calls] == [None, {"timer": True}]
    assert result_value(done) == {"timer": True}
    assert done.woken_by == {"timer": True}


def test_the_pure_calls_before_a_wait_are_recorded_as_the_run_parks(
    fake_api: FakeAnthropic, receiver: Any
) -> None:
    # A completed pure call goes with its turn's results, but a run that parks before they are
    # committed keeps it: the resumed run reads it from the ledger instead of calling again.
    run = start('@lookup {"key": "a"} && nap {"seconds": 3600}')
    run_worker()
    parked = reload(run)
    assert parked.status == RunStatus.WAITING
    assert list(
        ToolEffect.objects.filter(run_id=run.pk).values_list("seq", "call_index", "tool")
    ) == [(1, 0, "lookup")]
    time_passes(run)
    run_worker()
    done = reload(run)
    assert done.status == RunStatus.SUCCEEDED, done.error
    assert [block["content"] for block in tool_results(done)] == [
        "value-of-a",
        json.dumps({"timer": True}),
    ]


def test_a_worker_picks_a_due_timer_up_by_itself(
    fake_api: FakeAnthropic, receiver: Any, worker_thread: Any
) -> None:
    run = start('@nap {"seconds": 0.3}')
    worker_thread(poll_interval=0.05)
    wait_for(lambda: reload(run).status == RunStatus.SUCCEEDED, timeout=60)
    assert [c["woken_by"] for c in receiver.calls("nap")] == [None, {"timer": True}]


def test_an_idle_worker_claims_when_a_timer_comes_due_not_a_poll_later(
    fake_api: FakeAnthropic, receiver: Any, worker_thread: Any
) -> None:
    run = start('@nap {"seconds": 1}')
    # A poll of five minutes: only a claim timed by the run's own timer ends it within one.
    worker_thread(poll_interval=300)
    wait_for(lambda: reload(run).status == RunStatus.SUCCEEDED, timeout=60)
    assert [c["woken_by"] for c in receiver.calls("nap")] == [None, {"timer": True}]


def test_the_claimer_waits_for_the_first_timer_or_a_poll_whichever_is_sooner(
    fake_api: FakeAnthropic, receiver: Any
) -> None:
    from durable_agents.engine.worker import Worker

    napping = start('@nap {"seconds": 3600}')
    later = start('@nap {"seconds": 7000}')
    run_worker()
    assert reload(napping).status == reload(later).status == RunStatus.WAITING
    worker = Worker(poll_interval=7200, handle_signals=False)
    assert 3500 < worker._idle_wait() <= 3600.01
    assert Worker(poll_interval=60, handle_signals=False)._idle_wait() == 60
    # Due already, yet the claim did not take it (another worker's version, a full key):
    # the claimer does not spin on it, it polls.
    AgentRun.objects.filter(pk=napping.pk).update(wake_at=Now() - datetime.timedelta(seconds=5))
    assert worker._idle_wait() == 7200
    # No timer at all (both wait for something else now): a poll.
    AgentRun.objects.filter(pk__in=[napping.pk, later.pk]).update(wake_at=None)
    assert worker._idle_wait() == 7200


def test_wait_until_a_datetime(fake_api: FakeAnthropic, receiver: Any) -> None:
    until = (timezone.now() + datetime.timedelta(days=2)).replace(microsecond=0)
    run = start(f'@nap_until {{"at": "{until.isoformat()}"}}')
    run_worker()
    parked = reload(run)
    assert (parked.status, parked.waiting_for) == (RunStatus.WAITING, WaitKind.TIMER)
    assert parked.wake_at == until  # the tool's own time, not the database clock plus seconds
    run_worker()  # two days early: nothing is due
    assert reload(run).status == RunStatus.WAITING
    time_passes(run)
    run_worker()
    assert reload(run).status == RunStatus.SUCCEEDED
    assert [c["woken_by"] for c in receiver.calls("nap_until")] == [None, {"timer": True}]


# --------------------------------------------------------------------------- events


def test_an_event_wakes_the_run_once_and_a_second_send_is_a_no_op(
    fake_api: FakeAnthropic, receiver: Any
) -> None:
    run = start('@await_event {"name": "refund:o-1"}')
    run_worker()
    parked = reload(run)
    assert (parked.status, parked.waiting_for) == (RunStatus.WAITING, WaitKind.EVENT)
    assert parked.wait_event == "refund:o-1"
    assert parked.wake_at is None

    first = api.send_event("refund:o-1", {"status": "refunded"})
    second = api.send_event("refund:o-1", {"status": "SECOND"})
    assert second.pk == first.pk
    assert second.payload == {"status": "refunded"}
    assert AgentEvent.objects.filter(name="refund:o-1").count() == 1
    woken = reload(run)
    assert woken.status == RunStatus.PENDING
    # The woken run refers to the event; its payload is stored once, on the event's row.
    assert first.sent_at is not None
    assert woken.woken_by == {"event": "refund:o-1", "at": first.sent_at.isoformat()}

    run_worker()
    done = reload(run)
    assert done.status == RunStatus.SUCCEEDED, done.error
    calls = receiver.calls("await_event")
    assert [c["woken_by"] is None for c in calls] == [True, False]
    assert calls[0]["key"] == calls[1]["key"]  # the same call, the same idempotency key
    assert calls[1]["woken_by"]["event"] == "refund:o-1"
    assert calls[1]["woken_by"]["payload"] == {"status": "refunded"}
    assert calls[1]["woken_by"]["at"]


def test_an_event_sent_before_the_wait_does_not_park_the_run(
    fake_api: FakeAnthropic, receiver: Any
) -> None:
    api.send_event("ready:42", [1, 2, 3])
    run = start('@await_event {"name": "ready:42"}')
    run_worker()
    done = reload(run)
    assert done.status == RunStatus.SUCCEEDED, done.error
    assert done.waiting_for == ""  # never parked
    assert done.attempt == 1
    assert [c["woken_by"] and c["woken_by"]["payload"] for c in receiver.calls()] == [
        None,
        [1, 2, 3],
    ]


def test_an_event_wait_times_out(fake_api: FakeAnthropic, receiver: Any) -> None:
    run = start('@await_event {"name": "never", "timeout": 3600}')
    run_worker()
    parked = reload(run)
    assert parked.wake_at is not None
    assert parked.waiting_since is not None
    assert 3599 <= (parked.wake_at - parked.waiting_since).total_seconds() <= 3601
    time_passes(run)
    run_worker()
    done = reload(run)
    assert done.status == RunStatus.SUCCEEDED, done.error
    assert [c["woken_by"] for c in receiver.calls()] == [None, {"timeout": True}]
    # The event, sent late, wakes nothing: the run is over.
    api.send_event("never", "late")
    assert reload(run).status == RunStatus.SUCCEEDED


def test_one_send_wakes_every_run_waiting_on_the_name(
    fake_api: FakeAnthropic, receiver: Any
) -> None:
    runs = [start('@await_event {"name": "deploy:done"}') for _ in range(5)]
    other = start('@await_event {"name": "deploy:other"}')
    run_worker(concurrency=3)
    assert {reload(r).status for r in [*runs, other]} == {RunStatus.WAITING}
    api.send_event("deploy:done", {"ok": True})
    assert {reload(r).status for r in runs} == {RunStatus.PENDING}
    assert reload(other).status == RunStatus.WAITING
    run_worker(concurrency=3)
    assert {reload(r).status for r in runs} == {RunStatus.SUCCEEDED}


def claim_while_sending(name: str) -> list[Any]:
    """Claim due runs on one thread while another sends the event ``name``, released together;
    returns the claims."""
    barrier = threading.Barrier(2)
    claimed: list[Any] = []

    def claim() -> None:
        barrier.wait()
        claimed.extend(current().claim_runs("racer", 30, limit=10))
        connection.close()

    def send() -> None:
        barrier.wait()
        api.send_event(name, "payload")
        connection.close()

    threads = [threading.Thread(target=claim), threading.Thread(target=send)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return claimed


@pytest.mark.postgres
def test_a_timeout_and_an_event_that_race_resume_the_run_once(
    fake_api: FakeAnthropic, receiver: Any
) -> None:
    for attempt in range(5):
        run = start(f'@await_event {{"name": "race:{attempt}", "timeout": 3600}}')
        run_worker()
        time_passes(run)
        claimed = claim_while_sending(f"race:{attempt}")
        state = reload(run)
        # Whichever committed first ended the wait; the other changed nothing.
        assert state.woken_by == {"timeout": True} or state.woken_by["event"] == f"race:{attempt}"
        if claimed:  # the claim took it (due, or already woken by the event)
            assert state.status == RunStatus.RUNNING
            # Hand it back as a worker that died would (its lease runs out).
            AgentRun.objects.filter(pk=run.pk).update(lease_until=Now())
        else:  # the event woke it before the claim looked
            assert state.status == RunStatus.PENDING
            assert state.woken_by["event"] == f"race:{attempt}"
        run_worker()
        assert reload(run).status == RunStatus.SUCCEEDED
    calls = receiver.calls()
    woken = [c for c in calls if c["woken_by"] is not None]
    # each run: one first call, one resume
    assert len(calls) == 10
    assert len(woken) == 5


# --------------------------------------------------------------------------- child runs


def test_fan_out_then_fan_in(fake_api: FakeAnthropic, receiver: Any) -> None:
    run = start('@fan_out {"topics": ["tides", "moons"]}')
    run_worker()
    done = reload(run)
    assert done.status == RunStatus.SUCCEEDED, done.error
    children = list(AgentRun.objects.filter(parent_id=run.pk).order_by("spawn_key"))
    assert [c.task for c in children] == ["Research tides", "Research moons"]
    assert {c.depth for c in children} == {1}
    assert {c.status for c in children} == {RunStatus.SUCCEEDED}
    calls = receiver.calls("fan_out")
    assert calls[0]["woken_by"] is None
    outcomes = calls[-1]["woken_by"]["runs"]
    assert set(outcomes) == {str(c.pk) for c in children}
    for child in children:
        assert outcomes[str(child.pk)] == {
            "status": "succeeded",
            "result": child.result,
            "error": "",
            "task": child.task,
        }
    # The fan-out call ran twice (spawn and wait, then fan in): the children were spawned once.
    assert AgentRun.objects.filter(parent_id=run.pk).count() == 2


def test_a_childs_failure_is_its_parents_information(
    fake_api: FakeAnthropic, receiver: Any
) -> None:
    run = start('@fan_out {"topics": ["a", "b"]}')
    # The children nap for an hour: the parent waits on them.
    run_worker(max_runs=1)
    children = list(AgentRun.objects.filter(parent_id=run.pk))
    assert len(children) == 2
    assert reload(run).status == RunStatus.WAITING
    api.cancel_run(children[0].pk)
    assert reload(run).status == RunStatus.WAITING  # one child is still going
    AgentRun.objects.filter(pk=children[1].pk).update(status=RunStatus.DEAD, error="boom")
    current().wake_parent(run.pk)  # what the dead-lettering worker would do after its commit
    woken = reload(run)
    assert woken.status == RunStatus.PENDING
    outcomes = woken.woken_by["runs"]
    assert outcomes[str(children[0].pk)]["status"] == "cancelled"
    assert outcomes[str(children[1].pk)]["status"] == "dead"
    run_worker(max_runs=1)
    assert reload(run).status == RunStatus.SUCCEEDED


def test_cancelling_a_parent_cancels_its_unfinished_children(
    fake_api: FakeAnthropic, receiver: Any
) -> None:
    run = start('@fan_out {"topics": ["x", "y"]}')
    run_worker(max_runs=1)
    child_ids = list(AgentRun.objects.filter(parent_id=run.pk).values_list("pk", flat=True))
    assert len(child_ids) == 2
    assert api.cancel_run(run.pk)
    assert reload(run).status == RunStatus.CANCELLED
    statuses = AgentRun.objects.filter(pk__in=child_ids).values_list("status", flat=True)
    assert set(statuses) == {RunStatus.CANCELLED}
    run_worker()
    assert set(AgentRun.objects.values_list("status", flat=True)) == {RunStatus.CANCELLED}


def test_the_fan_out_wait_times_out_with_the_runs_as_they_are(
    fake_api: FakeAnthropic, receiver: Any
) -> None:
    run = start('@fan_out {"topics": ["slow"], "timeout": 3600}')
    run_worker(max_runs=1)
    time_passes(run)
    run_worker(max_runs=1)
    woken_by = receiver.calls("fan_out")[-1]["woken_by"]
    assert woken_by["timeout"] is True
    (outcome,) = woken_by["runs"].values()
    assert outcome["status"] == "pending"
    assert outcome["task"] == "Research slow"


def test_spawn_run_is_idempotent_per_key(fake_api: FakeAnthropic, receiver: Any) -> None:
    run = start('@spawn_only {"task": "Research once"}')
    run_worker(max_runs=1)
    assert reload(run).status == RunStatus.SUCCEEDED
    (child,) = AgentRun.objects.filter(parent_id=run.pk)
    assert child.spawn_key
    assert child.depth == 1
    assert tool_results(run)[0]["content"] == str(child.pk)


def test_spawn_run_outside_tool_code_is_refused() -> None:
    with pytest.raises(RuntimeError, match="outside tool code"):
        api.spawn_run("waiter_child", "Research", key="k")


def test_the_depth_limit_is_a_tool_error(
    fake_api: FakeAnthropic, receiver: Any, da_settings: Any
) -> None:
    da_settings(MAX_RUN_DEPTH=2)
    start("@spawn_outside {}")
    run_worker()
    runs = {r.depth: r for r in AgentRun.objects.all()}
    assert sorted(runs) == [0, 1, 2]
    deepest = tool_results(runs[2])[0]
    assert deepest["is_error"] is True
    assert "MAX_RUN_DEPTH is 2" in deepest["content"]


def test_a_run_may_only_wait_on_its_own_children(fake_api: FakeAnthropic, receiver: Any) -> None:
    stranger = api.start_run("waiter_child", "Research alone")
    run = start(f'@wait_on_run {{"run_id": "{stranger.pk}"}}')
    run_worker()
    done = reload(run)
    assert done.status == RunStatus.SUCCEEDED
    (result,) = tool_results(done)
    assert result["is_error"] is True
    assert "only on runs that this run spawned" in result["content"]
    assert str(stranger.pk) in result["content"]


# --------------------------------------------------------------------------- bad waits


def test_an_invalid_wait_is_a_tool_error(fake_api: FakeAnthropic, receiver: Any) -> None:
    run = start("@bad_wait {}")
    run_worker()
    (result,) = tool_results(reload(run))
    assert result["is_error"] is True
    assert "positive, finite number of seconds" in result["content"]


def test_an_irreversible_tool_may_not_wait(
    fake_api: FakeAnthropic, receiver: Any, staff: Any
) -> None:
    run = start("@wait_irreversibly {}")
    run_worker()
    intent = reload(run).intents.get()
    api.approve_intent(intent.pk, user=staff)
    run_worker()
    done = reload(run)
    assert done.status == RunStatus.SUCCEEDED
    (result,) = tool_results(done)
    assert result["is_error"] is True
    assert "may not wait" in result["content"]


# --------------------------------------------------------------------------- questions


def test_a_question_waits_for_a_person_with_the_permission(
    fake_api: FakeAnthropic, receiver: Any, staff: Any, django_user_model: Any
) -> None:
    run = start('@ask_person {"question": "Which region do we migrate first?"}')
    run_worker()
    parked = reload(run)
    assert (parked.status, parked.waiting_for) == (RunStatus.WAITING, WaitKind.QUESTION)
    question = AgentQuestion.objects.get(run_id=run.pk)
    assert question.question == "Which region do we migrate first?"
    assert question.status == QuestionStatus.OPEN

    nobody = django_user_model.objects.create_user("clerk", password="pw", is_staff=True)
    with pytest.raises(PermissionDenied):
        api.answer_question(run.pk, "eu-west", user=nobody)
    assert reload(run).status == RunStatus.WAITING

    answered = api.answer_question(run.pk, "eu-west first, then us-east", user=staff)
    assert answered.status == QuestionStatus.ANSWERED
    assert answered.answered_by == staff
    again = api.answer_question(run.pk, "changed my mind", user=staff)
    assert again.answer == "eu-west first, then us-east"  # answered once

    run_worker()
    done = reload(run)
    assert done.status == RunStatus.SUCCEEDED, done.error
    value = result_value(done)
    assert value["answer"] == "eu-west first, then us-east"
    assert value["answered_by"] == "ops"
    assert value["answered_at"]


def test_cancelling_a_run_closes_its_open_question(fake_api: FakeAnthropic, receiver: Any) -> None:
    run = start('@ask_person {"question": "Go?"}')
    run_worker()
    api.cancel_run(run.pk)
    assert AgentQuestion.objects.get(run_id=run.pk).status == QuestionStatus.CANCELLED


def test_a_run_that_asked_nothing_has_no_question_to_answer(staff: Any) -> None:
    run = api.start_run("waiter", "Nothing to ask")
    with pytest.raises(AgentQuestion.DoesNotExist):
        api.answer_question(run.pk, "hello", user=staff)


# --------------------------------------------------------------------------- repairs


def strand_parent() -> AgentRun:
    """A parent waiting on one child that ended while the wake of its parent was lost (its
    worker died between the child's commit and the wake)."""
    run = start('@fan_out {"topics": ["a"]}')
    run_worker(max_runs=1)
    (child,) = AgentRun.objects.filter(parent_id=run.pk)
    AgentRun.objects.filter(pk=child.pk).update(
        status=RunStatus.SUCCEEDED, result="found it", finished_at=Now()
    )
    assert reload(run).status == RunStatus.WAITING
    return run


def test_a_stranded_parent_is_woken_by_the_next_worker_to_start(
    fake_api: FakeAnthropic, receiver: Any
) -> None:
    run = strand_parent()
    run_worker()
    assert reload(run).status == RunStatus.SUCCEEDED
    (outcome,) = receiver.calls("fan_out")[-1]["woken_by"]["runs"].values()
    assert outcome["result"] == "found it"


def test_housekeeping_wakes_a_stranded_parent(fake_api: FakeAnthropic, receiver: Any) -> None:
    from durable_agents.housekeeping import sweeps as housekeeping

    run = strand_parent()
    assert housekeeping.sweep()["parents_woken"] == 1
    assert reload(run).status == RunStatus.PENDING
    assert housekeeping.sweep()["parents_woken"] == 0


# --------------------------------------------------------------------------- wake-ups by NOTIFY


@pytest.mark.postgres
def test_idle_workers_hear_of_wakes_without_polling(
    fake_api: FakeAnthropic, receiver: Any, worker_thread: Any, staff: Any
) -> None:
    """With a poll interval of an hour, only LISTEN/NOTIFY can bring a woken run back: an
    event, an answer and the end of a parent's children each do."""
    listened = worker_thread(poll_interval=3600, concurrency=4)
    wait_for(lambda: listened.listener is not None and listened.listener.listening.is_set())
    event_run = start('@await_event {"name": "notify:1"}')
    question_run = start('@ask_person {"question": "Proceed?"}')
    parent = start('@fan_out {"topics": ["n"]}')
    wait_for(lambda: reload(event_run).status == RunStatus.WAITING)
    wait_for(lambda: reload(question_run).status == RunStatus.WAITING)
    # The parent parks, its child runs and ends, and the child's end wakes the parent.
    wait_for(lambda: reload(parent).status == RunStatus.SUCCEEDED)
    api.send_event("notify:1", "ok")
    api.answer_question(question_run.pk, "yes", user=staff)
    wait_for(lambda: reload(event_run).status == RunStatus.SUCCEEDED)
    wait_for(lambda: reload(question_run).status == RunStatus.SUCCEEDED)


@pytest.mark.postgres
def test_finish_and_claim_hands_a_due_wait_what_ended_it(
    fake_api: FakeAnthropic, receiver: Any
) -> None:
    """The statement that ends one run may claim the worker's next, a due timer included: that
    claim carries ``woken_by`` parsed, as a plain claim does (else the call would wait again)."""
    from durable_agents.store import NextClaim

    napping = start('@nap {"seconds": 3600}')
    run_worker()
    other = api.start_run("tester", "Say hello.")
    [claim] = current().claim_runs("w1", 30)
    assert claim.run_id == other.pk
    time_passes(napping)
    next_claim = NextClaim("w1", 30, take=lambda: True, give_back=lambda: None)
    assert current().append_step(
        claim,
        StepWrite(1, "model_turn", "{}", finish=(RunStatus.SUCCEEDED, "hi")),
        then_claim=next_claim,
    )
    assert next_claim.claim is not None
    assert next_claim.claim.run_id == napping.pk
    assert next_claim.claim.run.woken_by == {"timer": True}
    assert next_claim.claim.run.wait_runs is None
    assert next_claim.claim.run.depth == 0


def test_an_answer_goes_to_the_question_the_person_was_shown(
    fake_api: FakeAnthropic, receiver: Any, staff: Any
) -> None:
    run = start('@ask_person {"question": "First?"}')
    run_worker()
    shown = AgentQuestion.objects.get(run_id=run.pk)
    with pytest.raises(AgentQuestion.DoesNotExist, match="with id"):
        api.answer_question(run.pk, "no", user=staff, question_id=shown.pk + 1000)
    assert reload(run).status == RunStatus.WAITING
    answered = api.answer_question(run.pk, "yes", user=staff, question_id=shown.pk)
    assert answered.pk == shown.pk
    assert answered.answer == "yes"
