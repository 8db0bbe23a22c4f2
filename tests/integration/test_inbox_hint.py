"""A worker skips the inbox's look while it has heard of no message for the run
(engine/inbox_hint.py), and looks again when one is queued.

PostgreSQL with a real worker and its listener, the real SDK over the fake API. The store is
the real PostgresStore, which also counts the inbox looks the runner sends."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connection, connections

import durable_agents
from durable_agents import api
from durable_agents._internal import inbox_bell
from durable_agents.engine.worker import Worker
from durable_agents.models import AgentMessage, AgentRun, RunStatus
from durable_agents.store.base import NextClaim, RunId
from durable_agents.store.postgres import PostgresStore
from durable_agents.testing import plan
from tests.conftest import run_worker, wait_for, worker_in_a_thread
from tests.fakeserver import FakeAnthropic

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

THREE_TURNS = plan(("lookup", {"key": "a"}), ("lookup", {"key": "b"}), ("lookup", {"key": "c"}))


class CountingStore(PostgresStore):
    """PostgresStore, counting the runner's looks at an inbox."""

    def __init__(self) -> None:
        super().__init__()
        self.looks = 0

    def has_waiting_messages(self, run_id: RunId) -> bool:
        self.looks += 1
        return super().has_waiting_messages(run_id)


@pytest.fixture
def worker(fake_api: FakeAnthropic, request: pytest.FixtureRequest) -> Iterator[Worker]:
    listen = getattr(request, "param", True)
    with worker_in_a_thread(
        concurrency=2, poll_interval=30, store=CountingStore(), listen=listen
    ) as w:
        yield w


def looks(w: Worker) -> int:
    assert isinstance(w.store, CountingStore)
    return w.store.looks


def ended(run: AgentRun) -> AgentRun:
    wait_for(lambda: AgentRun.objects.get(pk=run.pk).status == RunStatus.SUCCEEDED)
    return AgentRun.objects.get(pk=run.pk)


def user_texts(body: dict[str, Any]) -> list[str]:
    content = body["messages"][-1]["content"]
    return [b["text"] for b in content if isinstance(b, dict) and b["type"] == "text"]


@pytest.mark.parametrize("worker", [True, False], indirect=True, ids=["listening", "deaf"])
def test_a_run_looks_once_while_nothing_is_queued_unless_the_worker_cannot_hear(
    worker: Worker, fake_api: FakeAnthropic
) -> None:
    run = durable_agents.start_run("tester", THREE_TURNS)
    worker._wake.set()  # without a listener the claimer is told, as a poll would
    ended(run)
    wait_for(lambda: worker.in_flight() == 0)
    assert len(fake_api.ok_requests()) == 4
    # The claim looked into the inbox (and found nothing): the first model call sends no
    # look. Listening, the next three know nothing came since; deaf, each looks.
    assert looks(worker) == (0 if worker.listen else 3)


def test_a_message_queued_elsewhere_is_heard_and_folded_at_the_next_call(
    worker: Worker, fake_api: FakeAnthropic
) -> None:
    # As if sent by another process: this process's own bell is not rung for the worker,
    # only the database's notification (the trigger on agent_message) tells it.
    inbox_bell.stop_listening(worker.inbox.heard)
    sent = threading.Event()
    run = durable_agents.start_run("tester", THREE_TURNS)

    def hold_the_second_call(body: dict[str, Any]) -> None:
        if len(fake_api.requests) == 1 and not sent.is_set():  # the second request
            api.send_message(run.pk, "one more thing")
            connection.close()  # this thread's, opened by the call
            # Released once the worker heard it: it had looked at the first call.
            wait_for(lambda: worker.inbox.may_wait(run.pk))
            sent.set()

    fake_api.before_answer = hold_the_second_call
    ended(run)
    assert sent.is_set()
    bodies = [r.json() for r in fake_api.ok_requests()]
    assert len(bodies) == 4
    assert user_texts(bodies[2]) == ["one more thing"]
    assert AgentMessage.objects.get(run_id=run.pk).folded_seq == 5
    # The claim looked for the first call; the third call looked (a message was heard), and
    # the fourth (the look before it found one); the second did not.
    assert looks(worker) == 2


def test_a_message_a_tool_of_the_run_queues_is_folded_at_the_next_call(
    worker: Worker, fake_api: FakeAnthropic
) -> None:
    # This process's bell: heard as the tool's transaction commits, before the tool returns.
    # (The listener is told to ignore the notification: it may come a moment too late.)
    assert worker.listener is not None
    worker.listener.on_inbox = None
    run = durable_agents.start_run("messenger", plan(("tell", {"text": "from the tool"})))
    ended(run)
    bodies = [r.json() for r in fake_api.ok_requests()]
    assert user_texts(bodies[1]) == ["from the tool"]


def test_a_new_listening_connection_is_a_new_generation(worker: Worker) -> None:
    listener = worker.listener
    assert listener is not None
    first = listener.generation
    with connections["default"].cursor() as cursor:
        cursor.execute(
            # Only this test database's: other test processes listen on the same cluster.
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND query LIKE 'LISTEN %%' "
            "AND pid <> pg_backend_pid()"
        )
    wait_for(lambda: listener.generation > first and listener.listening.is_set(), timeout=30)
    run = "01a25050-7871-7477-bb48-983a951d76b3"
    worker.inbox.looked(run, worker.inbox.mark(), found=False)
    assert not worker.inbox.may_wait(run)


class ClaimNotingStore(CountingStore):
    """CountingStore, noting the runs the last steps claimed."""

    def __init__(self) -> None:
        super().__init__()
        self.claimed_by_last_steps: list[RunId] = []

    def _finish_and_claim(
        self, params: dict[str, Any], then_claim: NextClaim, unless_messages: bool
    ) -> bool:
        try:
            return super()._finish_and_claim(params, then_claim, unless_messages)
        finally:
            if then_claim.claim is not None:
                self.claimed_by_last_steps.append(then_claim.claim.run_id)


def test_the_claim_looks_into_the_inbox_for_the_first_model_call(fake_api: FakeAnthropic) -> None:
    """Whether the claimer or another run's last step claims it, the claim statement says
    whether a message waits: the run's first model call sends no look of its own, and folds
    a message queued before the claim."""
    first = durable_agents.start_run("tester", "Say hello.")
    second = durable_agents.start_run("tester", "Say hello again.")
    api.send_message(second.pk, "and say goodbye")
    store = ClaimNotingStore()
    run_worker(concurrency=1, store=store)
    assert AgentRun.objects.get(pk=first.pk).status == RunStatus.SUCCEEDED
    assert ended(second).status == RunStatus.SUCCEEDED
    assert store.claimed_by_last_steps == [second.pk]
    [to_first, to_second] = [r.json() for r in fake_api.ok_requests()]
    assert to_first["messages"] == [{"role": "user", "content": "Say hello."}]
    # The message joins the task's user turn.
    assert user_texts(to_second) == ["Say hello again.", "and say goodbye"]
    assert AgentMessage.objects.get(run_id=second.pk).folded_seq == 1
    assert store.looks == 0
