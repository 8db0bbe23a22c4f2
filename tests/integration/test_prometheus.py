"""Prometheus metrics (``durable_agents.observe.prometheus``, ``runagents --metrics-port``).

Real workers against the fake API, scraped over HTTP with urllib and parsed with
prometheus_client's own parser, while a burst runs and after it. Counters are process-wide
and other tests of this module count too, so they are compared before and after.
"""

from __future__ import annotations

import datetime
import re
import socket
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import DatabaseError, connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from durable_agents import observers, signals
from durable_agents.api import cancel_run, start_run
from durable_agents.engine.worker import Worker
from durable_agents.management.commands import runagents
from durable_agents.models import AgentQuestion, AgentRun, ToolIntent
from durable_agents.observe import figures, prometheus
from tests.conftest import WorkerProcess, run_worker, wait_for
from tests.fakeserver import FakeAnthropic, api_error

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]

OUTCOMES = prometheus.CLAIM_OUTCOMES


def samples_of(families: Any) -> Samples:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in families
        for sample in family.samples
    }


def scrape(url: str) -> Samples:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        text = response.read().decode()
    return samples_of(text_string_to_metric_families(text))


def value(samples: Samples, name: str, **labels: str) -> float:
    """One sample; a missing one fails the test (no silent 0)."""
    return samples[(name, tuple(sorted(labels.items())))]


def claims(before: Samples, after: Samples) -> dict[str, float]:
    """Claims counted between two scrapes, by outcome (the ones that moved)."""
    moved = {
        outcome: value(after, "durable_agents_claims_total", outcome=outcome)
        - value(before, "durable_agents_claims_total", outcome=outcome)
        for outcome in OUTCOMES
    }
    return {outcome: n for outcome, n in moved.items() if n}


@pytest.fixture
def metrics() -> Iterator[str]:
    """Metrics on, served on a free port of 127.0.0.1; the URL to scrape. The database
    figures are not cached here: each scrape reads them (caching has its own test)."""
    pytest.importorskip("prometheus_client")
    prometheus.enable(db_cache_seconds=0.0)
    server, thread = prometheus.serve(0, "127.0.0.1")
    yield prometheus.metrics_url(server)
    server.shutdown()
    server.server_close()
    thread.join(10)
    prometheus.disable()


# -- a worker, scraped while it runs a burst and after ---------------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_burst_scraped_while_it_runs_and_after_it(
    fake_api: FakeAnthropic, worker_thread: Callable[..., Any], metrics: str
) -> None:
    release = threading.Event()
    arrived: list[int] = []

    def hold(body: dict[str, Any]) -> None:
        arrived.append(1)
        release.wait(60)  # bounded: a failing test must not hang the server thread

    fake_api.before_answer = hold
    before = scrape(metrics)
    for i in range(10):
        start_run("tester", f'Run {i}.\n@lookup {{"key": "k{i}"}}')
    worker = worker_thread(concurrency=4)
    prometheus.track_worker(worker)

    # Four runs wait on the model (one per slot); six are pending.
    wait_for(lambda: len(arrived) >= 4)
    during = scrape(metrics)
    assert value(during, "durable_agents_runs_in_flight") == 4
    assert value(during, "durable_agents_worker_slots") == 4
    assert value(during, "durable_agents_database_up") == 1
    assert value(during, "durable_agents_runs", status="running") == 4
    assert value(during, "durable_agents_runs", status="pending") == 6
    assert value(during, "durable_agents_runs", status="succeeded") == 0
    assert value(during, "durable_agents_oldest_pending_age_seconds") > 0
    assert value(during, "durable_agents_runs_lease_expired") == 0
    assert claims(before, during) == {}

    release.set()
    wait_for(lambda: AgentRun.objects.filter(status="succeeded").count() == 10, timeout=60)
    wait_for(lambda: value(scrape(metrics), "durable_agents_runs_in_flight") == 0)
    after = scrape(metrics)
    assert claims(before, after) == {"succeeded": 10}
    assert value(after, "durable_agents_runs", status="succeeded") == 10
    assert value(after, "durable_agents_runs", status="pending") == 0
    assert value(after, "durable_agents_runs", status="running") == 0
    assert value(after, "durable_agents_oldest_pending_age_seconds") == 0

    # The hot paths' hooks: each run is 2 model calls, 1 tool call and 3 steps.
    def grew(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert grew("durable_agents_model_calls_total", outcome="ok") == 20
    assert grew("durable_agents_tool_calls_total", effect="pure", outcome="ok") == 10
    assert grew("durable_agents_steps_committed_total", kind="model_turn") == 20
    assert grew("durable_agents_steps_committed_total", kind="tool_result") == 10
    assert grew("durable_agents_step_commit_duration_seconds_count") == 30
    assert grew("durable_agents_model_call_duration_seconds_count") == 20
    # prometheus_client's own figures of the process come along (its default registry).
    if sys.platform == "linux":
        assert ("process_resident_memory_bytes", ()) in after


@pytest.mark.django_db(transaction=True)
def test_claim_outcomes_and_what_waits_for_people(fake_api: FakeAnthropic, metrics: str) -> None:
    before = scrape(metrics)
    # Claimed in this order by one slot: the first model call is refused for good.
    fake_api.fail_next(api_error(400, "invalid_request_error", "bad thing"))
    start_run("tester", '@lookup {"key": "a"}')  # dead
    approval = start_run("tester", '@drop_table {"table": "orders"}')  # waits for approval
    start_run("waiter", 'Wait for something.\n@ask_person {"question": "Go?"}')  # a question
    start_run("short", '@lookup {"key": "a"}\n@lookup {"key": "b"}\n@lookup {"key": "c"}')

    worker = run_worker()
    assert worker.stats.dispositions == {"dead": 1, "waiting": 2, "failed": 1}
    # The ages are read from times set on the rows (the question an hour older than the
    # intent, so that one age cannot stand for the other). The collector reads its clock
    # during the scrape, between started and ended: each age lies between the two bounds.
    intent_at = timezone.now() - datetime.timedelta(hours=1)
    question_at = intent_at - datetime.timedelta(hours=1)
    assert ToolIntent.objects.filter(run=approval).update(created_at=intent_at) == 1
    assert AgentQuestion.objects.update(created_at=question_at) == 1
    started = timezone.now()
    after = scrape(metrics)
    ended = timezone.now()
    assert claims(before, after) == {"dead": 1, "waiting": 2, "failed": 1}
    assert value(after, "durable_agents_runs", status="dead") == 1
    assert value(after, "durable_agents_runs", status="waiting") == 2
    assert value(after, "durable_agents_runs", status="failed") == 1
    assert value(after, "durable_agents_runs_waiting", waiting_for="intent") == 1
    assert value(after, "durable_agents_runs_waiting", waiting_for="question") == 1
    assert value(after, "durable_agents_runs_waiting", waiting_for="timer") == 0
    assert value(after, "durable_agents_intents_waiting") == 1
    assert value(after, "durable_agents_questions_open") == 1
    for name, created_at in (("intent", intent_at), ("question", question_at)):
        age = value(after, f"durable_agents_oldest_{name}_age_seconds")
        assert (started - created_at).total_seconds() <= age <= (ended - created_at).total_seconds()

    # A cancel from outside a worker is no claim's outcome.
    assert cancel_run(approval.pk)
    cancelled = scrape(metrics)
    assert claims(after, cancelled) == {}
    assert value(cancelled, "durable_agents_runs", status="cancelled") == 1
    assert value(cancelled, "durable_agents_runs_waiting", waiting_for="intent") == 0


@pytest.mark.django_db(transaction=True)
def test_each_model_call_attempt_is_counted_once_by_its_outcome(
    fake_api: FakeAnthropic, da_settings: Callable[..., None], metrics: str
) -> None:
    da_settings(MAX_BACKOFF_SECONDS=0.01, MODEL_RETRIES=1)
    before = scrape(metrics)
    # The first claim: a retry, then the retries are over (the run is handed back); the
    # next claim: a permanent refusal (the run is dead-lettered).
    fake_api.fail_next(api_error(500, "api_error", "Internal server error"), times=2)
    fake_api.fail_next(api_error(400, "invalid_request_error", "bad thing"))
    start_run("tester", '@lookup {"key": "a"}')
    assert run_worker().stats.dispositions == {"released": 1, "dead": 1}
    after = scrape(metrics)
    moved = {
        outcome: value(after, "durable_agents_model_calls_total", outcome=outcome)
        - value(before, "durable_agents_model_calls_total", outcome=outcome)
        for outcome in prometheus.MODEL_OUTCOMES
    }
    assert moved == {"ok": 0, "retried": 1, "transient_error": 1, "permanent_error": 1}
    assert claims(before, after) == {"released": 1, "dead": 1}


@pytest.mark.django_db(transaction=True)
def test_a_429_is_counted_as_a_wait_for_capacity_not_an_error(
    fake_api: FakeAnthropic, da_settings: Callable[..., None], metrics: str
) -> None:
    da_settings(MODEL_RETRIES=0)
    fake_api.fail_next(api_error(429, "rate_limit_error", "slow down", **{"retry-after": "2"}))
    start_run("tester", '@lookup {"key": "a"}')
    before = scrape(metrics)
    assert run_worker(max_runs=1).stats.dispositions == {"throttled": 1}
    after = scrape(metrics)

    def moved(name: str) -> float:
        labels = {"model": "claude-test-1", "reason": "rate_limited"}
        return value(after, name, **labels) - (
            value(before, name, **labels)
            if (name, tuple(sorted(labels.items()))) in before
            else 0.0
        )

    assert moved("durable_agents_capacity_waits_total") == 1
    assert moved("durable_agents_capacity_wait_seconds_total") == 2
    assert claims(before, after) == {"throttled": 1}


@pytest.mark.django_db(transaction=True)
def test_what_model_turns_cost_is_counted_by_agent_and_model(
    fake_api: FakeAnthropic, da_settings: Callable[..., None], metrics: str
) -> None:
    da_settings(PRICES={"claude-test-1": {"input": 3.0, "output": 15.0}})
    labels = {"agent": "tester", "model": "claude-test-1"}
    before = scrape(metrics).get(("durable_agents_cost_usd_total", tuple(sorted(labels.items()))))
    runs = [start_run("tester", '@lookup {"key": "a"}') for _ in range(2)]
    assert run_worker().stats.dispositions == {"succeeded": 2}
    after = value(scrape(metrics), "durable_agents_cost_usd_total", **labels)
    paid = sum(AgentRun.objects.get(pk=run.pk).cost_usd or 0 for run in runs)
    assert paid > 0
    assert after - (before or 0.0) == pytest.approx(float(paid), rel=1e-9)


# -- the counters: an observer of the engine's reports --------------------------------------


def sample(name: str, **labels: str) -> float:
    from prometheus_client import REGISTRY

    found = REGISTRY.get_sample_value(name, labels)
    assert found is not None, name
    return found


def test_recording_is_off_until_enabled_and_a_claim_is_counted_once() -> None:
    pytest.importorskip("prometheus_client")
    prometheus.enable()
    prometheus.disable()
    assert not any(isinstance(o, prometheus.Counting) for o in observers.subscribed())
    succeeded = sample("durable_agents_claims_total", outcome="succeeded")
    commits = sample("durable_agents_steps_committed_total", kind="model_turn")
    observers.claim_ended("succeeded", "r1")
    observers.step_committed("model_turn", 0.002)
    observers.model_attempt("claude-test-1", observers.ModelOutcome.OK, 1.5)
    observers.tool_call("lookup", "pure", "ok", 0.01)
    assert sample("durable_agents_claims_total", outcome="succeeded") == succeeded
    assert sample("durable_agents_steps_committed_total", kind="model_turn") == commits

    prometheus.enable()
    prometheus.enable()  # subscribed once however often it is enabled
    try:
        model_ok = sample("durable_agents_model_calls_total", outcome="ok")
        model_seconds = sample("durable_agents_model_call_duration_seconds_count")
        tool_timeouts = sample("durable_agents_tool_calls_total", effect="pure", outcome="timeout")
        tool_seconds = sample("durable_agents_tool_call_duration_seconds_count", effect="pure")
        commit_seconds = sample("durable_agents_step_commit_duration_seconds_count")
        released = sample("durable_agents_claims_total", outcome="released")
        dead = sample("durable_agents_claims_total", outcome="dead")

        retried = sample("durable_agents_model_calls_total", outcome="retried")
        observers.step_committed("model_turn", 0.002)
        observers.model_attempt("claude-test-1", observers.ModelOutcome.OK, 1.5)
        observers.model_attempt("claude-test-1", observers.ModelOutcome.RETRIED, 0.1)
        # An interrupted attempt has no label: the claim's outcome counts it.
        observers.model_attempt("claude-test-1", observers.ModelOutcome.INTERRUPTED, 0.1)
        observers.tool_call("sleepy", "pure", "timeout", 30.0, "timeout")
        assert sample("durable_agents_steps_committed_total", kind="model_turn") == commits + 1
        assert sample("durable_agents_step_commit_duration_seconds_count") == commit_seconds + 1
        assert sample("durable_agents_model_calls_total", outcome="ok") == model_ok + 1
        assert sample("durable_agents_model_call_duration_seconds_count") == model_seconds + 1
        assert sample("durable_agents_model_calls_total", outcome="retried") == retried + 1
        assert (
            sample("durable_agents_tool_calls_total", effect="pure", outcome="timeout")
            == tool_timeouts + 1
        )
        assert sample("durable_agents_tool_call_duration_seconds_count", effect="pure") == (
            tool_seconds + 1
        )

        # The worker reports each claim once; the runner's signals count nothing (a sweep's
        # dead letter or a cancel_run is no claim of this worker).
        observers.claim_ended("succeeded", "r1")
        assert sample("durable_agents_claims_total", outcome="succeeded") == succeeded + 1
        observers.claim_ended("released", "r1")
        assert sample("durable_agents_claims_total", outcome="released") == released + 1
        signals.run_finished.send(sender=AgentRun, run_id="r1", status="succeeded")
        signals.run_dead_lettered.send(sender=AgentRun, run_id="r3", reason="swept")
        assert sample("durable_agents_claims_total", outcome="succeeded") == succeeded + 1
        assert sample("durable_agents_claims_total", outcome="dead") == dead
    finally:
        prometheus.disable()


# -- the database collector ----------------------------------------------------------------


@pytest.mark.django_db
def test_the_collector_reads_the_database_once_per_cache_window() -> None:
    pytest.importorskip("prometheus_client")
    start_run("tester", "one")
    start_run("tester", "two")
    now = [1000.0]
    collector = prometheus.DatabaseCollector(cache_seconds=5.0, clock=lambda: now[0])
    with CaptureQueriesContext(connection) as queries:
        first = samples_of(collector.collect())
        now[0] += 4.9  # more scrapes inside the window
        second = samples_of(collector.collect())
        collector.collect()
    # One reading: the unfinished runs, then a bounded count of each of the four other
    # statuses (dead, succeeded, failed, cancelled), never the whole table.
    assert len(queries) == 5, [q["sql"] for q in queries]
    assert all("GROUP BY" not in q["sql"] or "IN ('pending'" in q["sql"] for q in queries)
    assert first == second
    assert value(first, "durable_agents_runs", status="pending") == 2

    start_run("tester", "three")
    now[0] += 0.2  # the window is over: the next scrape reads again
    with CaptureQueriesContext(connection) as queries:
        third = samples_of(collector.collect())
    assert len(queries) == 5
    assert value(third, "durable_agents_runs", status="pending") == 3


def test_concurrent_scrapes_share_one_reading(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("prometheus_client")
    readings: list[int] = []

    def read_figures(parts: figures.Part, *, using: str) -> figures.Figures:
        readings.append(1)
        time.sleep(0.2)  # a slow database: the other scrapes wait for this reading
        return figures.Figures(taken_at=timezone.now(), runs_by_status={"pending": 7})

    monkeypatch.setattr(figures, "read_figures", read_figures)
    collector = prometheus.DatabaseCollector(cache_seconds=60.0)
    results: list[Samples] = []
    threads = [
        threading.Thread(target=lambda: results.append(samples_of(collector.collect())))
        for _ in range(8)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert len(readings) == 1
    assert [value(r, "durable_agents_runs", status="pending") for r in results] == [7] * 8


def test_a_database_that_cannot_be_read_is_database_up_0(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("prometheus_client")

    def read_figures(parts: figures.Part, *, using: str) -> figures.Figures:
        raise DatabaseError("connection refused")

    monkeypatch.setattr(figures, "read_figures", read_figures)
    found = samples_of(prometheus.DatabaseCollector().collect())
    assert found == {("durable_agents_database_up", ()): 0.0}


# -- runagents -----------------------------------------------------------------------------


def test_metrics_port_without_prometheus_client_is_a_command_error_naming_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import fails

    def must_not_run(alias: str) -> None:
        raise AssertionError("the worker went on without prometheus_client")

    monkeypatch.setattr(runagents, "_ensure_database_ready", must_not_run)
    with pytest.raises(CommandError) as raised:
        call_command("runagents", "--metrics-port", "9810")
    assert 'pip install "django-durable-agents[prometheus]"' in str(raised.value)
    assert "--metrics-port" in str(raised.value)
    assert not prometheus.enabled()


def test_metrics_addr_without_a_port_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runagents, "_ensure_database_ready", lambda alias: None)
    with pytest.raises(CommandError, match="--metrics-addr needs --metrics-port"):
        call_command("runagents", "--metrics-addr", "127.0.0.1")


def test_a_taken_metrics_port_is_a_command_error() -> None:
    pytest.importorskip("prometheus_client")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        try:
            with pytest.raises(CommandError, match=f"cannot serve metrics on 127.0.0.1:{port}"):
                runagents._serve_metrics(Worker(handle_signals=False), port, "127.0.0.1")
        finally:
            prometheus.disable()


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_runagents_serves_metrics_and_logs_where(
    spawn_worker: Callable[..., WorkerProcess], tmp_path: Path
) -> None:
    pytest.importorskip("prometheus_client")
    worker = spawn_worker(
        "--metrics-port", "0", "--metrics-addr", "127.0.0.1", "--concurrency", "2"
    )
    pattern = re.compile(r"serves Prometheus metrics at (http://127\.0\.0\.1:\d+/metrics)")
    url = wait_for(lambda: pattern.search(worker.output()), timeout=60).group(1)
    for i in range(3):
        start_run("tester", f'Run {i}.\n@lookup {{"key": "k{i}"}}')
    wait_for(lambda: AgentRun.objects.filter(status="succeeded").count() == 3, timeout=60)
    wait_for(
        lambda: value(scrape(url), "durable_agents_claims_total", outcome="succeeded") == 3,
        timeout=30,
    )
    found = scrape(url)
    assert value(found, "durable_agents_runs", status="succeeded") == 3
    assert value(found, "durable_agents_worker_slots") == 2
    assert value(found, "durable_agents_runs_in_flight") == 0
    worker.terminate()
    assert worker.wait(30) == 0, worker.output()
