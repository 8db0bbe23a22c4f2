"""``Agent(output_schema=...)``: the final answer validated as JSON and stored as ``run.output``,
through an in-process worker and the real SDK over HTTP to the fake API (the offline scripted
model: ``@@answer "..."`` lines are final turns with that text, in order with the tool turns)."""

from __future__ import annotations

import base64
import datetime
import json
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import connection
from django.db.models.functions import Now
from django.urls import reverse

from durable_agents import Agent, Wait, api, llm, spawn_run, store, tool
from durable_agents._internal.interrupt import Interrupt
from durable_agents.models import AgentRun, RunStatus
from durable_agents.offline import answer_directive
from durable_agents.store import StepWrite
from durable_agents.testing import run_agent
from tests.conftest import own_steps, run_worker
from tests.fakeserver import FakeAnthropic
from tests.integration.conftest import agents_registered

pytestmark = pytest.mark.django_db(transaction=True)

TOTAL_SCHEMA = {
    "type": "object",
    "properties": {"total": {"type": "integer", "minimum": 0}, "note": {"type": "string"}},
    "required": ["total"],
    "additionalProperties": False,
}

# What the parent's waiting tool received when its children ended.
WOKEN: list[dict[str, Any]] = []


@tool(effect="pure")
def count_items(box: str) -> str:
    """How many items a box holds."""
    return f"{box} holds 12 items"


@tool(effect="idempotent")
def ask_counter(task: str, *, idempotency_key: str, woken_by: dict | None = None) -> Any:
    """Start a counting child run and wait for its answer."""
    if woken_by is None:
        child = spawn_run("counter", task, key=idempotency_key)
        raise Wait(runs=[child.id])
    WOKEN.append(woken_by)
    return woken_by


COUNTER = Agent(
    name="counter",
    version="1",
    model="claude-test-1",
    tools=[count_items],
    output_schema=TOTAL_SCHEMA,
    max_turns=4,
    register=False,
)
PLAIN_COUNTER = Agent(
    name="plain_counter", version="1", model="claude-test-1", tools=[count_items], register=False
)
MANAGER = Agent(
    name="manager", version="1", model="claude-test-1", tools=[ask_counter], register=False
)


@pytest.fixture(autouse=True)
def _agents() -> Iterator[None]:
    WOKEN.clear()
    with agents_registered(COUNTER, PLAIN_COUNTER, MANAGER):
        yield


def script(*lines: str) -> str:
    return "\n".join(["Count the items.", *lines])


def answer(value: Any) -> str:
    return answer_directive(value if isinstance(value, str) else json.dumps(value))


def reload(run: AgentRun) -> AgentRun:
    return AgentRun.objects.get(pk=run.pk)


def sent(fake_api: FakeAnthropic) -> list[dict[str, Any]]:
    return [recorded.json() for recorded in fake_api.ok_requests()]


# --------------------------------------------------------------------------- the answer


def test_a_valid_first_answer_is_the_runs_output(fake_api: FakeAnthropic) -> None:
    run = api.start_run("counter", script(answer({"total": 12, "note": "<b>all</b>"})))
    run_worker()

    done = reload(run)
    assert done.status == RunStatus.SUCCEEDED, done.error
    assert done.output == {"total": 12, "note": "<b>all</b>"}
    assert done.result == '{"total": 12, "note": "<b>all</b>"}'  # the text, as today
    (body,) = sent(fake_api)
    assert body["output_config"] == {"format": {"type": "json_schema", "schema": TOTAL_SCHEMA}}


def test_a_run_without_a_schema_sends_no_format_and_has_no_output(fake_api: FakeAnthropic) -> None:
    run = api.start_run("plain_counter", script(answer({"total": 12})))
    run_worker()

    done = reload(run)
    assert done.status == RunStatus.SUCCEEDED
    assert (done.result, done.output) == ('{"total": 12}', None)
    assert "output_config" not in sent(fake_api)[0]


def test_an_invalid_answer_is_told_to_the_model_which_answers_again(
    fake_api: FakeAnthropic,
) -> None:
    run = api.start_run("counter", script(answer({"total": "twelve"}), answer({"total": 12})))
    run_worker()

    done = reload(run)
    assert done.status == RunStatus.SUCCEEDED, done.error
    assert done.output == {"total": 12}
    assert [s.kind for s in own_steps(done)] == ["task", "model_turn", "tool_result", "model_turn"]

    messages = api.messages_for(run.pk)
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
    correction = messages[2]["content"]
    assert isinstance(correction, str)
    assert "answer.total: 'twelve' is not of type 'integer'" in correction
    # The second call sent the refused turn back as it was received, then the correction.
    first, second = fake_api.ok_requests()
    stored_turn = json.loads(own_steps(done)[1].payload)
    assert second.json()["messages"][1] == {"role": "assistant", "content": stored_turn["content"]}
    assert second.json()["messages"][2] == {"role": "user", "content": correction}
    assert second.json()["output_config"] == first.json()["output_config"]


def test_an_answer_that_is_not_json_is_refused_too(fake_api: FakeAnthropic) -> None:
    run = api.start_run("counter", script(answer("Twelve items."), answer({"total": 12})))
    run_worker()

    done = reload(run)
    assert done.status == RunStatus.SUCCEEDED, done.error
    assert done.output == {"total": 12}
    assert "the answer is not valid JSON" in api.messages_for(run.pk)[2]["content"]


def test_a_run_that_never_answers_validly_fails_with_the_validation_error_after_max_turns(
    fake_api: FakeAnthropic,
) -> None:
    # max_turns is 4: four answers, each refused.
    run = api.start_run("counter", script(*[answer({"total": -i}) for i in range(1, 6)]))
    run_worker()

    done = reload(run)
    assert done.status == RunStatus.FAILED
    assert done.output is None
    assert "the final answer was refused" in done.error
    assert "answer.total: -4 is less than the minimum of 0" in done.error
    assert "max_turns (4) reached" in done.error
    assert len(fake_api.ok_requests()) == 4
    # Three corrections were sent; the fourth refusal ended the run instead.
    kinds = [s.kind for s in own_steps(done)]
    assert kinds == ["task"] + ["model_turn", "tool_result"] * 3 + ["model_turn"]


def test_tool_turns_before_the_answer(fake_api: FakeAnthropic) -> None:
    run = api.start_run(
        "counter",
        script(
            '@count_items {"box": "a"}',
            answer({"note": "no total"}),
            '@count_items {"box": "b"}',
            answer({"total": 24}),
        ),
    )
    run_worker()

    done = reload(run)
    assert done.status == RunStatus.SUCCEEDED, done.error
    assert done.output == {"total": 24}
    kinds = [s.kind for s in own_steps(done)]
    assert kinds == ["task"] + ["model_turn", "tool_result"] * 3 + ["model_turn"]
    # Every call of the run, tool turns included, carried the format.
    assert all("format" in body["output_config"] for body in sent(fake_api))


def test_a_childs_output_reaches_its_parent(fake_api: FakeAnthropic) -> None:
    child_task = script(answer({"total": 7}))
    run = api.start_run("manager", "Delegate.\n@ask_counter " + json.dumps({"task": child_task}))
    run_worker()

    done = reload(run)
    assert done.status == RunStatus.SUCCEEDED, done.error
    (child,) = AgentRun.objects.filter(parent_id=run.pk)
    (woken_by,) = WOKEN
    assert woken_by["runs"] == {
        str(child.pk): {
            "status": "succeeded",
            "result": '{"total": 7}',
            "error": "",
            "task": child_task,
            "output": {"total": 7},
        }
    }


def test_with_encryption_the_output_is_stored_as_the_result_is(
    fake_api: FakeAnthropic, da_settings: Any
) -> None:
    key = base64.urlsafe_b64encode(b"K" * 32).decode()
    da_settings(ENCRYPTION_KEYS=[key])
    child_task = script(answer({"total": 3, "note": "secret"}))
    run = api.start_run("manager", "Delegate.\n@ask_counter " + json.dumps({"task": child_task}))
    run_worker()

    assert reload(run).status == RunStatus.SUCCEEDED
    (child,) = AgentRun.objects.filter(parent_id=run.pk)
    assert child.output == {"total": 3, "note": "secret"}
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT result, output FROM agent_run WHERE id = %s",
            [child.pk.hex if connection.vendor == "sqlite" else str(child.pk)],
        )
        result, output = cursor.fetchone()
        cursor.execute(
            "SELECT woken_by FROM agent_run WHERE id = %s",
            [run.pk.hex if connection.vendor == "sqlite" else str(run.pk)],
        )
        (woken_by,) = cursor.fetchone()
    # Plain at rest, as the result is; the parent's wake payload, which carries both, is
    # encrypted as it always was.
    assert result == '{"total": 3, "note": "secret"}'
    assert json.loads(output) == {"total": 3, "note": "secret"}
    assert woken_by.startswith("da:enc:v1:")
    assert "secret" not in woken_by
    assert WOKEN[0]["runs"][str(child.pk)]["output"] == {"total": 3, "note": "secret"}


def test_the_run_page_shows_the_output_escaped(fake_api: FakeAnthropic, admin_client: Any) -> None:
    run = api.start_run("counter", script(answer({"total": 1, "note": "<script>x()</script>"})))
    run_worker()
    assert reload(run).status == RunStatus.SUCCEEDED

    page = admin_client.get(reverse("admin:durable_agents_agentrun_change", args=[run.pk]))
    html = page.content.decode()
    assert page.status_code == 200
    assert "&lt;script&gt;x()&lt;/script&gt;" in html
    assert "<script>x()</script>" not in html
    assert "&quot;total&quot;: 1,\n  &quot;note&quot;" in html  # indented JSON


# --------------------------------------------------------------------------- resume


def crashed_after_the_final_turn(run: AgentRun) -> None:
    """An earlier worker committed the run's final turn (seq 1) and died before it did
    anything about it; its lease then expired."""
    crashed = store.current().claim_run(run.pk, "crashed-worker", 30)
    assert crashed is not None
    turn = llm.create_turn(
        COUNTER.request_params(run.model), api.messages_for(run.pk), interrupt=Interrupt()
    )
    assert turn.message["stop_reason"] == "end_turn"
    assert store.current().append_step(
        crashed, StepWrite(1, "model_turn", turn.body, turn.request_id)
    )
    AgentRun.objects.filter(pk=run.pk).update(lease_until=Now() - datetime.timedelta(seconds=1))


@pytest.mark.parametrize(
    ("answers", "kinds"),
    [
        ([{"total": 5}], ["task", "model_turn"]),
        ([{"total": "five"}, {"total": 5}], ["task", "model_turn", "tool_result", "model_turn"]),
    ],
    ids=["valid", "refused"],
)
def test_a_final_turn_committed_by_a_crashed_worker_is_validated_on_resume(
    fake_api: FakeAnthropic, answers: list[Any], kinds: list[str]
) -> None:
    run = api.start_run("counter", script(*[answer(value) for value in answers]))
    crashed_after_the_final_turn(run)
    run_worker()

    done = reload(run)
    assert done.status == RunStatus.SUCCEEDED, done.error
    assert done.output == {"total": 5}
    assert [s.kind for s in own_steps(done)] == kinds
    if len(kinds) > 2:
        assert "'five' is not of type 'integer'" in api.messages_for(run.pk)[2]["content"]


def test_run_agent_of_the_testing_helpers_returns_the_output() -> None:
    result = run_agent("counter", script('@count_items {"box": "a"}', answer({"total": 12})))

    assert result.status == RunStatus.SUCCEEDED, result.error
    assert result.output == {"total": 12}
    assert result.result == '{"total": 12}'


def test_a_long_output_is_cut_on_the_run_page_and_whole_on_its_text_page(
    fake_api: FakeAnthropic, admin_client: Any
) -> None:
    note = "<i>" + "n" * 20_000
    run = api.start_run("counter", script(answer({"total": 2, "note": note})))
    run_worker()
    assert reload(run).status == RunStatus.SUCCEEDED

    page = admin_client.get(reverse("admin:durable_agents_agentrun_change", args=[run.pk]))
    text_url = reverse("admin:durable_agents_agentrun_text", args=[run.pk, "output"])
    assert text_url in page.content.decode()
    assert "n" * 5_000 not in page.content.decode()  # cut to TEXT_SHOWN_CHARS
    whole = admin_client.get(text_url)
    assert whole.status_code == 200
    assert whole["Content-Type"] == "text/plain; charset=utf-8"
    assert json.loads(whole.content) == {"total": 2, "note": note}
