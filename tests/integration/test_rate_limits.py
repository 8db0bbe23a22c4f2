"""A worker against a rate-limited fake API: real 429s with ``retry-after`` and the
``anthropic-ratelimit-*`` headers, through the real SDK over HTTP.

The limiter's clock moves one second per 429 answered and never otherwise, so which requests
are refused does not depend on the pace of this machine: one request a second, a bucket of
one, every request but the first of a run is refused once, then let through on its retry.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from durable_agents.api import start_run
from durable_agents.models import AgentRun
from durable_agents.offline import RateLimits
from tests.conftest import run_worker, serve_fake_api
from tests.fakeserver import FakeAnthropic

pytestmark = pytest.mark.django_db(transaction=True)

T0 = 1_700_000_000.0


@pytest.fixture
def limited_api(settings: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeAnthropic]:
    servers: list[FakeAnthropic] = []  # the clock is read before the server exists

    def clock() -> float:
        return T0 + sum(1 for s in servers for r in list(s.requests) if r.status == 429)

    limits = RateLimits(requests_per_minute=60, burst_seconds=1, clock=clock)
    server = FakeAnthropic(rate_limits=limits)
    servers.append(server)
    yield from serve_fake_api(server, settings, monkeypatch)


def test_a_429_pauses_the_model_until_retry_after_and_the_run_succeeds(
    limited_api: FakeAnthropic,
) -> None:
    # Each 429 pauses the model for the fleet and hands the run back (throttled, uncounted);
    # the next claim sends the same request once the pause is over.
    run = start_run(
        "tester", '[key:tenant-1] two lookups\n@lookup {"key": "a"}\n@lookup {"key": "b"}'
    )
    worker = run_worker()
    assert worker.stats.dispositions == {"succeeded": 1, "throttled": 2}
    assert AgentRun.objects.get(pk=run.pk).status == "succeeded"
    requests = limited_api.requests
    assert [r.status for r in requests] == [200, 429, 200, 429, 200]
    for refused, retried in ((requests[1], requests[2]), (requests[3], requests[4])):
        assert refused.answer_headers["retry-after"] == "1"
        assert refused.answer_headers["anthropic-ratelimit-requests-remaining"] == "0"
        assert retried.body == refused.body  # the same request, again
        assert retried.at - refused.at >= 0.9  # after the second it was told to wait
    assert requests[0].answer_headers["anthropic-ratelimit-requests-limit"] == "60"
    stats = limited_api.model.rate_limits.stats()  # type: ignore[union-attr]
    assert stats["keys"]["tenant-1"] == {
        "answered": 3,
        "rejected_429": 2,
        "in_flight": 0,
        "peak_in_flight": 1,
    }
