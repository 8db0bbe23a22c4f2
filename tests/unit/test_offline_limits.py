"""The offline model under rate limits, driven through the real anthropic SDK: 429s the SDK
raises as ``RateLimitError``, ``anthropic-ratelimit-*`` headers, and charges that agree with
the answers' usage."""

from __future__ import annotations

from typing import Any

import anthropic
import pytest

from durable_agents.offline import (
    OfflineServer,
    RateLimits,
    ScriptedModel,
    billed_input_tokens,
    offline_client,
)

MODEL = "claude-sonnet-4-6"
T0 = 1_700_000_000.0
TASK = 'Look twice.\n@noop {"n": 1}\n@noop {"n": 2}\n'


def frozen(**limits: Any) -> RateLimits:
    """Limits on a clock that never moves: nothing refills, so every figure is exact."""
    return RateLimits(clock=lambda: T0, **limits)


def create(client: anthropic.Anthropic, messages: list[Any], **params: Any) -> Any:
    params.setdefault("model", MODEL)
    params.setdefault("max_tokens", 1000)
    return client.messages.with_raw_response.create(messages=messages, **params)


def next_messages(messages: list[Any], content: list[dict[str, Any]]) -> list[Any]:
    results = [
        {"type": "tool_result", "tool_use_id": b["id"], "content": "ok"}
        for b in content
        if b["type"] == "tool_use"
    ]
    return [
        *messages,
        {"role": "assistant", "content": content},
        {"role": "user", "content": results},
    ]


def test_a_request_past_the_limit_is_a_rate_limit_error_with_retry_after() -> None:
    client = offline_client(rate_limits=frozen(requests_per_minute=2), max_retries=0)
    task = [{"role": "user", "content": TASK}]
    create(client, task)
    second = create(client, task)
    assert second.headers["anthropic-ratelimit-requests-remaining"] == "0"
    with pytest.raises(anthropic.RateLimitError) as caught:
        create(client, task)
    exc = caught.value
    assert exc.status_code == 429
    assert exc.response.headers["retry-after"] == "30"  # one request back every 30 s
    assert exc.response.headers["anthropic-ratelimit-requests-limit"] == "2"
    assert exc.response.headers["anthropic-ratelimit-requests-remaining"] == "0"
    assert exc.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]
    assert "2 requests per minute" in exc.body["error"]["message"]  # type: ignore[index]


def test_the_charge_is_what_the_usage_bills() -> None:
    limits = frozen(input_tokens_per_minute=100_000, output_tokens_per_minute=100_000)
    client = offline_client(rate_limits=limits, max_retries=0)
    messages: list[Any] = [{"role": "user", "content": TASK * 40}]
    input_used = output_used = 0
    cache = {"cache_control": {"type": "ephemeral"}}
    for _ in range(3):  # from the third request on, automatic caching reads from the cache
        raw = create(client, messages, max_tokens=5000, extra_body=cache)
        body = raw.http_response.json()
        usage = body["usage"]
        input_used += billed_input_tokens(usage)
        output_used += usage["output_tokens"]
        assert int(raw.headers["anthropic-ratelimit-input-tokens-remaining"]) == (
            100_000 - input_used
        )
        # Held at max_tokens while it ran, settled to the output tokens before it was sent.
        assert int(raw.headers["anthropic-ratelimit-output-tokens-remaining"]) == (
            100_000 - output_used
        )
        messages = next_messages(messages, body["content"])
    assert usage["cache_read_input_tokens"] > 0  # cache reads were left out of the charge
    assert usage["input_tokens"] == 0
    assert billed_input_tokens(usage) == usage["cache_creation_input_tokens"]


def test_without_caching_the_charge_is_usage_input_tokens() -> None:
    limits = frozen(input_tokens_per_minute=50_000)
    client = offline_client(rate_limits=limits, max_retries=0)
    raw = create(client, [{"role": "user", "content": TASK}])
    charged = 50_000 - int(raw.headers["anthropic-ratelimit-input-tokens-remaining"])
    assert charged == raw.parse().usage.input_tokens
    assert raw.headers["anthropic-ratelimit-tokens-limit"] == "50000"


def test_input_tokens_reject_a_long_transcript() -> None:
    limits = frozen(input_tokens_per_minute=1000)
    client = offline_client(rate_limits=limits, max_retries=0)
    create(client, [{"role": "user", "content": TASK}])
    with pytest.raises(anthropic.RateLimitError) as caught:
        create(client, [{"role": "user", "content": TASK + "x" * 8000}])
    assert "1000 input tokens per minute" in str(caught.value)
    assert limits.stats()["rejected_429"] == 1


def test_a_stream_holds_its_output_until_it_ends() -> None:
    limits = frozen(output_tokens_per_minute=10_000)
    client = offline_client(rate_limits=limits, max_retries=0)
    task = "[key:tenant-1] " + TASK
    with client.messages.stream(
        model=MODEL, max_tokens=4000, messages=[{"role": "user", "content": task}]
    ) as stream:
        headers = stream.response.headers
        assert headers["anthropic-ratelimit-output-tokens-remaining"] == "6000"
        stats = limits.stats()
        assert stats["keys"]["tenant-1"]["in_flight"] == 1
        message = stream.get_final_message()
    stats = limits.stats()
    assert stats["in_flight"] == 0
    assert stats["keys"]["tenant-1"] == {
        "answered": 1,
        "rejected_429": 0,
        "in_flight": 0,
        "peak_in_flight": 1,
    }
    remaining = stats["buckets"]["output-tokens"]["remaining"]
    assert remaining == 10_000 - message.usage.output_tokens


def test_a_streamed_request_past_the_limit_is_a_rate_limit_error() -> None:
    client = offline_client(rate_limits=frozen(output_tokens_per_minute=600), max_retries=0)
    create(client, [{"role": "user", "content": TASK}], max_tokens=600, stream=True)
    with pytest.raises(anthropic.RateLimitError) as caught:  # its 600 are held until it ends
        create(client, [{"role": "user", "content": TASK}], max_tokens=600, stream=True)
    assert caught.value.response.headers["retry-after"] == "60"


def test_a_malformed_request_is_not_charged_and_carries_the_headers() -> None:
    limits = frozen(requests_per_minute=5)
    client = offline_client(rate_limits=limits, max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as caught:
        create(client, [{"role": "assistant", "content": "hi"}])
    assert caught.value.response.headers["anthropic-ratelimit-requests-remaining"] == "5"


def test_over_real_http() -> None:
    model = ScriptedModel(rate_limits=frozen(requests_per_minute=1))
    with OfflineServer(model) as server:
        client = anthropic.Anthropic(api_key="x", base_url=server.base_url, max_retries=0)
        create(client, [{"role": "user", "content": TASK}])
        with pytest.raises(anthropic.RateLimitError) as caught:
            create(client, [{"role": "user", "content": TASK}])
    assert caught.value.response.headers["retry-after"] == "60"


def test_limits_given_twice_are_a_value_error() -> None:
    with pytest.raises(ValueError, match="not both"):
        offline_client(scripted=ScriptedModel(), rate_limits=frozen(requests_per_minute=1))


def test_without_limits_no_ratelimit_headers() -> None:
    raw = create(offline_client(max_retries=0), [{"role": "user", "content": TASK}])
    assert not [h for h in raw.headers if h.startswith("anthropic-ratelimit")]
