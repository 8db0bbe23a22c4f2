"""The offline model's Message Batches API, driven through the real anthropic SDK (in-process
over ``offline_client``, and over real HTTP behind ``FakeAnthropic``): every outcome, the exact
bytes of the answers in the results, their order, validation, cancel, expiry, the error and
expiry shares, the faults for tests of bad input, the queue limit and the statistics."""

from __future__ import annotations

import json
import threading
from datetime import timedelta
from typing import Any

import anthropic
import httpx2
import pytest

from durable_agents.offline import (
    COMPACT_BETA,
    BatchDesk,
    ScriptedModel,
    offline_client,
    shared_batch_desk,
)
from durable_agents.offline.wire import json_bytes
from tests.fakeserver import FakeAnthropic, api_error


def sdk_bytes(params: Any) -> bytes:
    """``params`` as the SDK (httpx) writes them in a request body: compact JSON, UTF-8. The
    desk answers each request of a batch from these bytes, as cut from the create's body."""
    text = json.dumps(params, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return text.encode("utf-8", "surrogatepass")


MODEL = "claude-sonnet-4-6"
T0 = 1_700_000_000.0
DAY = 24 * 3600.0


class Clock:
    """A clock a test moves by hand."""

    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


def params(task: str = 'Look.\n@noop {"n": 1}\n', **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "max_tokens": 1000,
        "messages": [{"role": "user", "content": task}],
        **extra,
    }


def requests(n: int, prefix: str = "r") -> list[Any]:
    return [
        {"custom_id": f"{prefix}{i}", "params": params(f"Task {i}.\n@noop {{}}\n")}
        for i in range(n)
    ]


def setup(**knobs: Any) -> tuple[anthropic.Anthropic, ScriptedModel, BatchDesk]:
    desk = BatchDesk(**knobs)
    model = ScriptedModel(batches=desk)
    return offline_client(scripted=model, max_retries=0), model, desk


def raw_results(client: anthropic.Anthropic, batch_id: str) -> bytes:
    """The results body as sent: a GET of the batch's ``results_url``."""
    url = client.messages.batches.retrieve(batch_id).results_url
    assert url is not None
    response = client.get(url, cast_to=httpx2.Response)
    assert response.headers["content-type"] == "application/binary"
    return response.content


def lines_by_id(body: bytes) -> dict[str, bytes]:
    lines = body.splitlines()
    by_id = {json.loads(line)["custom_id"]: line for line in lines}
    assert len(by_id) == len(lines)
    return by_id


def test_a_batch_is_created_in_progress_and_ends_at_the_next_look() -> None:
    client, model, _ = setup()
    batch = client.messages.batches.create(requests=requests(3))
    assert batch.id.startswith("msgbatch_")
    assert len(batch.id) == len("msgbatch_") + 24
    assert batch.type == "message_batch"
    assert batch.processing_status == "in_progress"
    assert batch.request_counts.processing == 3
    assert batch.request_counts.succeeded == 0
    assert batch.results_url is None
    assert batch.ended_at is None
    assert batch.expires_at - batch.created_at == timedelta(hours=24)
    again = client.messages.batches.create(requests=requests(3))
    assert again.id != batch.id  # same body, a new batch

    ended = client.messages.batches.retrieve(batch.id)
    assert ended.processing_status == "ended"
    assert ended.request_counts.model_dump() == {
        "processing": 0,
        "succeeded": 3,
        "errored": 0,
        "canceled": 0,
        "expired": 0,
    }
    assert ended.results_url == (f"http://offline.invalid/v1/messages/batches/{batch.id}/results")
    results = {r.custom_id: r.result for r in client.messages.batches.results(batch.id)}
    assert set(results) == {"r0", "r1", "r2"}
    for result in results.values():
        assert result.type == "succeeded"
        assert result.message.stop_reason == "tool_use"
    assert model.direct_calls == 0  # every turn went through the batch


def test_each_message_is_the_exact_bytes_respond_gives_for_its_request() -> None:
    client, _, _ = setup()
    sent = requests(5)
    sent.append({"custom_id": "hostile", "params": params('@@final "a\\ud800b \\u0000"\n')})
    batch = client.messages.batches.create(requests=sent)
    by_id = lines_by_id(raw_results(client, batch.id))
    plain = ScriptedModel(batches=BatchDesk())
    for request in sent:
        status, _, expected = plain.respond(
            "POST", "/v1/messages", {}, sdk_bytes(request["params"])
        )
        assert status == 200
        prefix = b'{"custom_id":"' + request["custom_id"].encode() + b'","result":'
        assert by_id[request["custom_id"]] == (
            prefix + b'{"type":"succeeded","message":' + expected + b"}}"
        )
    # The lone surrogate came back escaped, as the model wrote it.
    assert b"\\ud800" in by_id["hostile"]


def test_errored_results_hold_the_error_the_model_answered() -> None:
    client, _, _ = setup()
    sent: list[Any] = [
        {"custom_id": "ok", "params": params()},
        {"custom_id": "retired", "params": params(model="claude-2.0")},
        {"custom_id": "no_tokens", "params": {"model": MODEL, "messages": []}},
    ]
    batch = client.messages.batches.create(requests=sent)
    ended = client.messages.batches.retrieve(batch.id)
    assert ended.request_counts.succeeded == 1
    assert ended.request_counts.errored == 2
    results = {r.custom_id: r.result for r in client.messages.batches.results(batch.id)}
    assert results["retired"].type == "errored"
    assert results["retired"].error.error.type == "not_found_error"
    assert results["no_tokens"].type == "errored"
    assert results["no_tokens"].error.error.type == "invalid_request_error"
    by_id = lines_by_id(raw_results(client, batch.id))
    plain = ScriptedModel(batches=BatchDesk())
    status, _, body = plain.respond("POST", "/v1/messages", {}, sdk_bytes(sent[1]["params"]))
    assert status == 404
    assert by_id["retired"].endswith(b'"result":{"type":"errored","error":' + body + b"}}")


def test_the_betas_of_the_create_apply_to_every_request() -> None:
    client, _, _ = setup()
    compacting = params(context_management={"edits": [{"type": "compact_20260112"}]})
    sent: list[Any] = [
        {"custom_id": "a", "params": compacting},
        {"custom_id": "b", "params": compacting},
    ]
    without = client.messages.batches.create(requests=sent)
    assert client.messages.batches.retrieve(without.id).request_counts.errored == 2
    batch = client.messages.batches.create(
        requests=sent, extra_headers={"anthropic-beta": COMPACT_BETA}
    )
    assert client.messages.batches.retrieve(batch.id).request_counts.succeeded == 2
    plain = ScriptedModel(batches=BatchDesk())
    _, _, expected = plain.respond(
        "POST", "/v1/messages", {"anthropic-beta": COMPACT_BETA}, sdk_bytes(compacting)
    )
    assert expected in lines_by_id(raw_results(client, batch.id))["a"]
    # The SDK's beta resource sends its betas the same way (and ``?beta=true``).
    beta = client.beta.messages.batches.create(requests=sent, betas=[COMPACT_BETA])
    assert client.beta.messages.batches.retrieve(beta.id).request_counts.succeeded == 2


def test_results_come_in_a_shuffled_order_the_same_at_every_download() -> None:
    client, _, _ = setup()
    sent = requests(30)
    batch = client.messages.batches.create(requests=sent)
    first = raw_results(client, batch.id)
    assert raw_results(client, batch.id) == first
    order = [json.loads(line)["custom_id"] for line in first.splitlines()]
    assert sorted(order) == sorted(r["custom_id"] for r in sent)
    assert order != [r["custom_id"] for r in sent]
    decoded = [r.custom_id for r in client.messages.batches.results(batch.id)]
    assert decoded == order


@pytest.mark.parametrize(
    ("sent", "message"),
    [
        ([], "non-empty"),
        ([{"custom_id": "has space", "params": params()}], "custom_id"),
        ([{"custom_id": "x" * 65, "params": params()}], "custom_id"),
        (
            [{"custom_id": "a", "params": params()}, {"custom_id": "a", "params": params()}],
            "unique",
        ),
        ([{"custom_id": "a", "params": "not an object"}], "params"),
        ([{"custom_id": "a", "params": params(stream=True)}], "stream"),
    ],
)
def test_a_bad_create_is_an_invalid_request_error(sent: list[Any], message: str) -> None:
    client, _, desk = setup()
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.batches.create(requests=sent)
    assert caught.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert message in caught.value.body["error"]["message"]  # type: ignore[index]
    assert desk.batch_ids() == []
    assert desk.stats().creates == 0


def test_a_batch_holds_at_most_100000_requests() -> None:
    _, model, desk = setup()
    item = {"custom_id": "a", "params": {}}
    body = json_bytes({"requests": [item] * 100_001})
    status, _, out = model.respond("POST", "/v1/messages/batches", {}, body)
    assert status == 400
    assert b"at most 100000" in out
    assert desk.batch_ids() == []


def test_an_unknown_batch_is_not_found() -> None:
    client, _, _ = setup()
    missing = "msgbatch_" + "0" * 24
    with pytest.raises(anthropic.NotFoundError):
        client.messages.batches.retrieve(missing)
    with pytest.raises(anthropic.NotFoundError):
        client.messages.batches.cancel(missing)
    with pytest.raises(anthropic.NotFoundError):
        client.get(f"/v1/messages/batches/{missing}/results", cast_to=httpx2.Response)


def test_a_batch_ends_processing_seconds_after_its_create() -> None:
    clock = Clock()
    client, _, _ = setup(processing_seconds=60.0, clock=clock)
    batch = client.messages.batches.create(requests=requests(2))
    clock.now += 59
    looked = client.messages.batches.retrieve(batch.id)
    assert looked.processing_status == "in_progress"
    assert looked.request_counts.processing == 2  # the others stay 0 until the end
    with pytest.raises(anthropic.AnthropicError, match="results_url"):
        client.messages.batches.results(batch.id)
    with pytest.raises(anthropic.BadRequestError):  # the results of a batch not ended: a 400
        client.get(f"/v1/messages/batches/{batch.id}/results", cast_to=httpx2.Response)
    clock.now += 30
    ended = client.messages.batches.retrieve(batch.id)
    assert ended.processing_status == "ended"
    assert ended.ended_at is not None
    assert ended.ended_at - ended.created_at == timedelta(seconds=60)


def test_a_cancel_ends_the_batch_with_the_requests_not_done_canceled() -> None:
    clock = Clock()
    client, _, desk = setup(processing_seconds=40.0, clock=clock)
    batch = client.messages.batches.create(requests=requests(4))
    clock.now += 20  # two of the four are done (one every 10 s)
    canceling = client.messages.batches.cancel(batch.id)
    assert canceling.processing_status == "canceling"
    assert canceling.cancel_initiated_at is not None
    assert canceling.results_url is None
    clock.now += 1
    ended = client.messages.batches.retrieve(batch.id)
    assert ended.processing_status == "ended"
    assert ended.request_counts.succeeded == 2
    assert ended.request_counts.canceled == 2
    kinds = sorted(r.result.type for r in client.messages.batches.results(batch.id))
    assert kinds == ["canceled", "canceled", "succeeded", "succeeded"]
    assert sum(desk.stats().succeeded.values()) == 2
    # Cancelling an ended batch returns it unchanged.
    assert client.messages.batches.cancel(batch.id) == ended


def test_a_batch_not_done_in_24_hours_expires_what_is_left() -> None:
    clock = Clock()
    client, _, _ = setup(processing_seconds=2 * DAY, clock=clock)
    batch = client.messages.batches.create(requests=requests(4))  # one done every 12 hours
    clock.now += DAY - 1
    assert client.messages.batches.retrieve(batch.id).processing_status == "in_progress"
    clock.now += 1
    ended = client.messages.batches.retrieve(batch.id)
    assert ended.processing_status == "ended"
    assert ended.ended_at == ended.expires_at
    assert ended.request_counts.succeeded == 2
    assert ended.request_counts.expired == 2
    assert b'"result":{"type":"expired"}}' in raw_results(client, batch.id)


def test_expire_and_error_ratios_draw_per_batch_and_request() -> None:
    client, _, desk = setup(expire_ratio=0.25, error_ratio=0.25)
    sent = requests(200)
    first = client.messages.batches.create(requests=sent)
    counts = client.messages.batches.retrieve(first.id).request_counts
    assert counts.expired + counts.errored + counts.succeeded == 200
    assert 20 < counts.expired < 80
    assert 10 < counts.errored < 80  # drawn from those not expired
    results = {r.custom_id: r.result for r in client.messages.batches.results(first.id)}
    for result in results.values():
        if result.type == "errored":
            assert result.error.error.type == "overloaded_error"
    # The same requests in a new batch: a fresh draw for each.
    second = client.messages.batches.create(requests=sent)
    again = {r.custom_id: r.result.type for r in client.messages.batches.results(second.id)}
    assert again != {cid: r.type for cid, r in results.items()}
    assert desk.stats().paid_twice  # some were answered in both batches

    everything, _, _ = setup(expire_ratio=1.0)
    batch = everything.messages.batches.create(requests=requests(5))
    assert everything.messages.batches.retrieve(batch.id).request_counts.expired == 5


def test_fail_results_answers_the_next_downloads_with_that_status() -> None:
    client, _, desk = setup()
    batch = client.messages.batches.create(requests=requests(2))
    desk.fail_results(404, times=2)
    for _ in range(2):
        with pytest.raises(anthropic.NotFoundError):
            raw_results(client, batch.id)
    assert len(raw_results(client, batch.id).splitlines()) == 2
    desk.fail_results(500)
    with pytest.raises(anthropic.InternalServerError) as caught:
        list(client.messages.batches.results(batch.id))
    assert caught.value.body["error"]["type"] == "api_error"  # type: ignore[index]
    assert desk.stats().results_downloads[batch.id] == 4


def test_an_extra_line_for_a_custom_id_never_sent() -> None:
    client, _, desk = setup()
    desk.add_unknown_result()
    batch = client.messages.batches.create(requests=requests(3))
    ids = [json.loads(line)["custom_id"] for line in raw_results(client, batch.id).splitlines()]
    assert len(ids) == 4
    assert len(set(ids) - {"r0", "r1", "r2"}) == 1
    # The fault was taken by that batch: the next one is whole.
    nxt = client.messages.batches.create(requests=requests(3))
    assert len(raw_results(client, nxt.id).splitlines()) == 3


def test_a_duplicate_line_for_one_request() -> None:
    client, _, desk = setup()
    desk.duplicate_result()
    batch = client.messages.batches.create(requests=requests(3))
    lines = raw_results(client, batch.id).splitlines()
    ids = [json.loads(line)["custom_id"] for line in lines]
    assert len(ids) == 4
    assert len(set(ids)) == 3
    assert lines[0] == lines[-1]


def test_a_line_that_is_not_json() -> None:
    client, _, desk = setup()
    desk.break_result_line()
    batch = client.messages.batches.create(requests=requests(3))
    broken = 0
    for line in raw_results(client, batch.id).splitlines():
        try:
            json.loads(line)
        except json.JSONDecodeError:
            broken += 1
    assert broken == 1


def test_a_raw_nul_byte_in_a_message() -> None:
    client, _, desk = setup()
    desk.put_nul_in_result()
    batch = client.messages.batches.create(requests=requests(3))
    body = raw_results(client, batch.id)
    assert body.count(b"\x00") == 1
    [bad] = [line for line in body.splitlines() if b"\x00" in line]
    with pytest.raises(json.JSONDecodeError):  # a raw control character in a string
        json.loads(bad)
    assert json.loads(bad, strict=False)["result"]["type"] == "succeeded"


def test_an_escaped_lone_surrogate_in_a_message() -> None:
    client, _, desk = setup()
    desk.put_lone_surrogate_in_result()
    batch = client.messages.batches.create(requests=requests(3))
    texts = [
        block["text"]
        for line in raw_results(client, batch.id).splitlines()
        for block in json.loads(line)["result"]["message"]["content"]
        if block["type"] == "text"
    ]
    assert sum(1 for t in texts if t.startswith("\ud800")) == 1


def test_a_stuck_batch_stays_in_progress_past_its_expiry_until_cancelled() -> None:
    clock = Clock()
    client, _, desk = setup(clock=clock)
    desk.stick_next()
    stuck = client.messages.batches.create(requests=requests(2))
    fine = client.messages.batches.create(requests=requests(2))
    clock.now += 3 * DAY
    looked = client.messages.batches.retrieve(stuck.id)
    assert looked.processing_status == "in_progress"
    assert clock.now > looked.expires_at.timestamp()
    assert client.messages.batches.retrieve(fine.id).processing_status == "ended"
    client.messages.batches.cancel(stuck.id)
    ended = client.messages.batches.retrieve(stuck.id)
    assert ended.processing_status == "ended"
    assert ended.request_counts.canceled == 2


def test_a_create_past_the_queue_limit_is_a_rate_limit_error() -> None:
    clock = Clock()
    client, _, desk = setup(processing_seconds=100.0, clock=clock, max_queued_requests=5)
    client.messages.batches.create(requests=requests(3))
    clock.now += 30
    with pytest.raises(anthropic.RateLimitError) as caught:
        client.messages.batches.create(requests=requests(3))
    assert caught.value.response.headers["retry-after"] == "70"  # when the first batch ends
    assert caught.value.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]
    client.messages.batches.create(requests=requests(2))  # fits
    assert desk.queued_requests() == 5
    clock.now += 70
    assert desk.queued_requests() == 2
    client.messages.batches.create(requests=requests(3))
    stats = desk.stats()
    assert stats.creates == 3
    assert stats.rejected_creates == 1
    assert stats.batch_sizes == [3, 2, 3]


def test_statistics() -> None:
    client, _, desk = setup()
    sent = requests(3)
    batch = client.messages.batches.create(requests=sent)
    client.messages.batches.retrieve(batch.id)
    results = list(client.messages.batches.results(batch.id))  # a retrieve, then the download
    stats = desk.stats()
    assert stats.creates == 1
    assert stats.retrieves == {batch.id: 2}
    assert stats.results_downloads == {batch.id: 1}
    assert stats.batch_sizes == [3]
    assert stats.succeeded == {"r0": 1, "r1": 1, "r2": 1}
    assert stats.paid_twice == {}
    usages = [r.result.message.usage for r in results if r.result.type == "succeeded"]
    assert stats.usage["input_tokens"] == sum(u.input_tokens for u in usages)
    assert stats.usage["output_tokens"] == sum(u.output_tokens for u in usages)
    client.messages.batches.create(requests=sent[:1])
    client.messages.batches.retrieve(desk.batch_ids()[-1])
    assert desk.stats().paid_twice == {"r0": 2}
    desk.reset()
    assert desk.stats().creates == 0
    assert desk.batch_ids() == []


def test_list_and_delete() -> None:
    clock = Clock()
    client, _, desk = setup(processing_seconds=10.0, clock=clock)
    ids = [client.messages.batches.create(requests=requests(1)).id for _ in range(3)]
    page = client.messages.batches.list(limit=2)
    assert [b.id for b in page.data] == ids[::-1][:2]
    assert page.has_next_page()
    assert [b.id for b in page] == ids[::-1]  # the SDK pages on, after the page's last id
    with pytest.raises(anthropic.BadRequestError):  # not ended
        client.messages.batches.delete(ids[0])
    clock.now += 10
    assert client.messages.batches.delete(ids[0]).type == "message_batch_deleted"
    assert desk.batch_ids() == ids[1:]


def test_models_not_given_a_desk_share_the_process_wide_one() -> None:
    one, two = offline_client(max_retries=0), offline_client(max_retries=0)
    assert ScriptedModel().batches is shared_batch_desk()
    batch = one.messages.batches.create(requests=requests(1, prefix="shared"))
    assert two.messages.batches.retrieve(batch.id).processing_status == "ended"


def test_direct_calls_count_messages_requests_only() -> None:
    client, model, _ = setup()
    client.messages.create(**params())
    with client.messages.stream(**params()) as stream:
        stream.get_final_message()
    client.messages.batches.create(requests=requests(2))
    assert model.direct_calls == 2


def test_concurrent_clients_of_one_desk() -> None:
    desk = BatchDesk()
    made: list[str] = []

    def work(n: int) -> None:
        client = offline_client(scripted=ScriptedModel(batches=desk), max_retries=0)
        for _ in range(5):
            batch = client.messages.batches.create(requests=requests(2, prefix=f"t{n}_"))
            made.append(batch.id)
            assert len(list(client.messages.batches.results(batch.id))) == 2

    threads = [threading.Thread(target=work, args=(n,)) for n in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(made)) == 30
    stats = desk.stats()
    assert stats.creates == 30
    assert stats.succeeded == {f"t{n}_{i}": 5 for n in range(6) for i in range(2)}


def test_the_fake_server_answers_the_batch_endpoints_over_http() -> None:
    fake = FakeAnthropic()
    try:
        client = anthropic.Anthropic(api_key="x", base_url=fake.base_url, max_retries=0)
        fake.fail_next(api_error(529, "overloaded_error", "busy"))
        batch = client.messages.batches.create(requests=requests(2))
        ended = client.messages.batches.retrieve(batch.id)
        assert ended.results_url == f"{fake.base_url}/v1/messages/batches/{batch.id}/results"
        response = client.get(ended.results_url, cast_to=httpx2.Response)
        by_id = lines_by_id(response.content)
        plain = ScriptedModel(batches=BatchDesk())
        _, _, expected = plain.respond(
            "POST", "/v1/messages", {}, sdk_bytes(requests(2)[0]["params"])
        )
        assert expected in by_id["r0"]
        assert [r.custom_id for r in client.messages.batches.results(batch.id)] == list(by_id)
        assert [(c.method, c.path.split("/")[-1]) for c in fake.batch_calls] == [
            ("POST", "batches"),
            ("GET", batch.id),
            ("GET", "results"),
            ("GET", batch.id),
            ("GET", "results"),
        ]
        assert fake.requests == []  # batch calls are not Messages calls
        assert fake.batches.stats().creates == 1
        assert fake.batches is not shared_batch_desk()
        # The fault was left for the next Messages call.
        with pytest.raises(anthropic.APIStatusError) as caught:
            client.messages.create(**params())
        assert caught.value.status_code == 529
        assert fake.model.direct_calls == 0  # the fault answered it, not the model
    finally:
        fake.close()
