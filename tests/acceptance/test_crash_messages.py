"""Messages sent to a run while its workers are SIGKILLed (real ``runagents`` subprocesses on
PostgreSQL, the real SDK over the fake API, which refuses a malformed request with a 400):
every message reaches the model once, in the order it was sent, after the tool results of
its turn."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from django.db.models.functions import Now

import durable_agents
from durable_agents.engine.history import load_log
from durable_agents.models import AgentMessage, AgentRun, AgentStep, RunStatus, StepKind
from durable_agents.testing import plan
from tests.conftest import Receiver, WorkerProcess, wait_for
from tests.fakeserver import FakeAnthropic

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True),
]

Spawn = Callable[..., WorkerProcess]
SIGKILLED = -9
LEASE = "2"


def sent_messages(body: bytes) -> bytes:
    """The raw ``messages`` array of a request body (its last member, never re-encoded)."""
    return body[body.index(b',"messages":[') + len(b',"messages":') : -1]


def user_texts(messages: list[dict[str, object]]) -> list[str]:
    texts: list[str] = []
    for message in messages:
        content = message["content"]
        if message["role"] != "user" or not isinstance(content, list):
            continue
        texts.extend(str(b["text"]) for b in content if b["type"] == "text")
    return texts


def test_messages_sent_while_workers_are_killed_are_delivered_once_in_order(
    receiver: Receiver, fake_api: FakeAnthropic, spawn_worker: Spawn
) -> None:
    env = {"ANTHROPIC_BASE_URL": fake_api.base_url, "ANTHROPIC_API_KEY": "sk-test"}
    run = durable_agents.start_run(
        "messenger", plan(("pause", {"label": "b"}), ("pause", {"label": "c"}))
    )
    durable_agents.send_message(run.pk, "m0 before the start")

    def worker(name: str) -> WorkerProcess:
        return spawn_worker("--burst", "--lease-seconds", LEASE, "--worker-id", name, env=env)

    def lease_expired() -> None:
        # A burst worker started before the killed one's lease expires finds nothing to do.
        wait_for(
            AgentRun.objects.filter(pk=run.pk, lease_until__lt=Now()).exists,
            timeout=10,
            what="the killed worker's lease to expire",
        )

    def paused(label: str) -> None:
        marker = receiver.directory / f"pause-{label}"
        wait_for(marker.exists, timeout=30, what=f"the tool call {label}")
        marker.unlink()

    # w1 is killed while call b runs; m1 arrived meanwhile.
    first = worker("w1")
    paused("b")
    durable_agents.send_message(run.pk, "m1 during b", key="m1")
    assert first.kill() == SIGKILLED
    lease_expired()
    # w2 runs call b again (it is pure); m2 arrives, b ends: m1 and m2 follow b's result.
    second = worker("w2")
    paused("b")
    durable_agents.send_message(run.pk, "m2 during b again")
    durable_agents.send_message(run.pk, "m1 during b", key="m1")  # a client's retry
    (receiver.directory / "go-b").touch()
    paused("c")
    durable_agents.send_message(run.pk, "m3 during c")
    assert second.kill() == SIGKILLED
    lease_expired()
    # w3 runs call c again and finishes the run: m3 follows c's result.
    (receiver.directory / "go-c").touch()
    assert worker("w3").wait() == 0

    run = AgentRun.objects.get(pk=run.pk)
    assert run.status == RunStatus.SUCCEEDED, run.error
    assert [r.status for r in fake_api.requests] == [200] * len(fake_api.requests)
    sent = ["m0 before the start", "m1 during b", "m2 during b again", "m3 during c"]
    last = fake_api.requests[-1].json()["messages"]
    # The task's text, then every message once, in the order sent.
    assert user_texts(last)[1:] == sent
    folds = list(
        AgentStep.objects.filter(run_id=run.pk, kind=StepKind.MESSAGE).values_list("seq", flat=True)
    )
    inbox = list(AgentMessage.objects.filter(run_id=run.pk).values_list("text", "folded_seq"))
    assert [text for text, _ in inbox] == sent
    folded_at = [seq for _, seq in inbox]
    assert None not in folded_at
    assert set(folded_at) == set(folds)
    assert folded_at == sorted(seq or 0 for seq in folded_at)
    # Every request is, byte for byte, the start of the transcript rebuilt from the log: the
    # workers that resumed after a kill sent what the killed one had built.
    transcript = load_log(run.pk, trim=False).conversation.json()
    for request in fake_api.requests:
        assert transcript.startswith(sent_messages(request.body)[:-1])
    # Each message step follows a user step: folded into the turn it follows.
    kinds = dict(AgentStep.objects.filter(run_id=run.pk).values_list("seq", "kind"))
    assert all(kinds[seq - 1] != StepKind.MODEL_TURN for seq in folds)
