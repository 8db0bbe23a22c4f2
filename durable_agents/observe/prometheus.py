"""Prometheus metrics of a worker process: ``runagents --metrics-port PORT``.

Needs the ``prometheus`` extra (``prometheus_client``), imported only by ``enable()``: this
module itself imports nothing of it. The counters are an observer of the engine
(``durable_agents.observers``): ``enable()`` (called by ``runagents`` with ``--metrics-port``)
subscribes them and ``disable()`` unsubscribes them, so that until then the engine's reports
cost what a report to nobody costs.

What is measured, all named ``durable_agents_*``:

- in this process, as it happens: claims by outcome, steps committed by kind, model calls by
  outcome, tool calls by effect class and outcome, the latency of model calls, step commits
  and tool calls, what its model turns cost by agent and model (``durable_agents_cost_usd``,
  priced by the PRICES setting), and the runs this worker holds in flight (read at scrape
  time);
- in the database, at scrape time: runs by status, waiting runs by what they wait for, running
  runs whose lease expired, the age of the oldest pending run, intents waiting for a person,
  open questions. ``DatabaseCollector`` reads all of them with one grouped query and keeps the
  answer for ``DB_CACHE_SECONDS``, so that frequent scrapes, or several Prometheus servers,
  do not load the database. Every worker reports the same database figures: aggregate them
  with ``max`` across instances, never ``sum``.

Each figure counted in this process comes from one report: claims by outcome from the
worker's ``claim_ended`` (once for every claim, when its slot is done with it: a sweep or a
``cancel_run`` is no claim), model calls from the model client's ``model_attempt``, tool calls
and step commits from the runner's ``tool_call`` and ``step_committed``, costs from its
``turn_cost`` (every answered turn, committed or not: each was paid for).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from django.db import DEFAULT_DB_ALIAS, connections

from durable_agents import observers
from durable_agents.observers import ModelOutcome

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from durable_agents.observe.figures import Figures, Queue

logger = logging.getLogger("durable_agents.prometheus")

INSTALL_HINT = 'pip install "django-durable-agents[prometheus]"'

# Label values known in advance: their series exist (at 0) from the first scrape, so that
# rate() and increase() see the first event instead of a series appearing with it.
CLAIM_OUTCOMES = (
    "succeeded",
    "failed",
    "dead",
    "waiting",
    "released",
    "throttled",
    "cancelled",
    "lost",
    "error",
)
MODEL_OUTCOMES = ("ok", "retried", "transient_error", "permanent_error")
TOOL_OUTCOMES = ("ok", "error", "timeout", "retried")
EFFECTS = ("pure", "idempotent", "non_idempotent", "irreversible")
STEP_KINDS = ("model_turn", "tool_result", "message")

# Seconds. A model turn takes from under a second to minutes (long generations, thinking);
# a step commit about a millisecond; a tool anything up to TOOL_TIMEOUT (600 s).
MODEL_CALL_BUCKETS = (0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
STEP_COMMIT_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
)
TOOL_CALL_BUCKETS = (
    0.005,
    0.025,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
)

# How long one reading of the database figures is served to scrapes.
DB_CACHE_SECONDS = 5.0


def available() -> bool:
    """Whether ``prometheus_client`` can be imported (the ``prometheus`` extra)."""
    try:
        import prometheus_client  # noqa: F401 - only whether it is installed
    except ImportError:
        return False
    return True


# -- the metrics of this process -----------------------------------------------------------


@dataclass
class _Metrics:
    claims: Any
    steps_committed: Any
    model_calls: Any
    tool_calls: Any
    model_call_seconds: Any
    step_commit_seconds: Any
    tool_call_seconds: Any
    capacity_waits: Any
    capacity_wait_seconds: Any
    cost: Any
    collector: DatabaseCollector
    others: list[Any] = field(default_factory=list)


# Created once per process (prometheus_client's registry refuses a name twice); recording is
# on while ``_on`` is set (and subscribed).
_created: _Metrics | None = None
_on: Counting | None = None
_enable_lock = threading.Lock()
# The workers whose held runs are "in flight" (several only in tests).
_workers: weakref.WeakSet[observers.WorkerLoad] = weakref.WeakSet()


def _create(db_cache_seconds: float) -> _Metrics:
    from prometheus_client import REGISTRY, Counter, Gauge, Histogram

    claims = Counter(
        "durable_agents_claims",
        "Claims this worker ended, by outcome (what became of the run)",
        ["outcome"],
    )
    for outcome in CLAIM_OUTCOMES:
        claims.labels(outcome)
    steps = Counter(
        "durable_agents_steps_committed", "Steps this worker committed, by kind", ["kind"]
    )
    for kind in STEP_KINDS:
        steps.labels(kind)
    model_calls = Counter(
        "durable_agents_model_calls",
        "Model call attempts by outcome: ok; retried (a transient error, tried again); "
        "transient_error (retries over or not retryable now: the run is handed back); "
        "permanent_error (the run is dead-lettered)",
        ["outcome"],
    )
    for outcome in MODEL_OUTCOMES:
        model_calls.labels(outcome)
    tool_calls = Counter(
        "durable_agents_tool_calls",
        "Tool call attempts that returned, raised or timed out, by effect class and outcome "
        "(retried: an attempt whose failure the tool's Retry policy tries again)",
        ["effect", "outcome"],
    )
    tool_seconds = Histogram(
        "durable_agents_tool_call_duration_seconds",
        "Seconds a tool call took, by effect class",
        ["effect"],
        buckets=TOOL_CALL_BUCKETS,
    )
    for effect in EFFECTS:
        tool_seconds.labels(effect)
        for outcome in TOOL_OUTCOMES:
            tool_calls.labels(effect, outcome)
    in_flight = Gauge(
        "durable_agents_runs_in_flight", "Runs this worker holds right now (claimed, not ended)"
    )
    in_flight.set_function(_held_runs)
    slots = Gauge(
        "durable_agents_worker_slots", "Runs this worker may hold at once (--concurrency)"
    )
    slots.set_function(_slots)
    collector = DatabaseCollector(cache_seconds=db_cache_seconds)
    REGISTRY.register(collector)
    return _Metrics(
        **_quota_metrics(),
        claims=claims,
        steps_committed=steps,
        model_calls=model_calls,
        tool_calls=tool_calls,
        model_call_seconds=Histogram(
            "durable_agents_model_call_duration_seconds",
            "Seconds a successful model call took, request to whole answer",
            buckets=MODEL_CALL_BUCKETS,
        ),
        step_commit_seconds=Histogram(
            "durable_agents_step_commit_duration_seconds",
            "Seconds a step commit took (one fenced statement)",
            buckets=STEP_COMMIT_BUCKETS,
        ),
        tool_call_seconds=tool_seconds,
        collector=collector,
        others=[in_flight, slots],
    )


def _quota_metrics() -> dict[str, Any]:
    """The counters of the fleet's quota: waits for model capacity, and what turns cost."""
    from prometheus_client import Counter

    return {
        "capacity_waits": Counter(
            "durable_agents_capacity_waits",
            "Runs handed back to wait for model capacity, by model and reason: capacity (the "
            "fleet's buckets have no room now), rate_limited (a 429 paused the model for the "
            "fleet), overloaded (a 529 whose retries ran out), budget (the run's concurrency "
            "key spent its budget for the day)",
            ["model", "reason"],
        ),
        "capacity_wait_seconds": Counter(
            "durable_agents_capacity_wait_seconds",
            "Seconds runs were held back to wait for model capacity, by model and reason",
            ["model", "reason"],
        ),
        "cost": Counter(
            "durable_agents_cost_usd",
            "USD this worker paid for model turns, at the PRICES setting, by agent and model "
            "(turns of a model without a price are not counted)",
            ["agent", "model"],
        ),
    }


def enable(db_cache_seconds: float = DB_CACHE_SECONDS) -> None:
    """Create the metrics in prometheus_client's default registry (once per process) and
    start recording. Raises ``ImportError`` without prometheus_client."""
    global _created, _on
    with _enable_lock:
        if _created is None:
            _created = _create(db_cache_seconds)
        _created.collector.cache_seconds = db_cache_seconds
        _created.collector.forget()
        if _on is None:
            _on = Counting(_created)
            observers.subscribe(_on)


def disable() -> None:
    """Stop recording (the metrics stay registered, at their values); for tests."""
    global _on
    with _enable_lock:
        if _on is not None:
            observers.unsubscribe(_on)
        _on = None
        _workers.clear()


def enabled() -> bool:
    return _on is not None


def track_worker(worker: observers.WorkerLoad) -> None:
    """Report ``worker``'s held runs as ``durable_agents_runs_in_flight`` (read at scrape)."""
    _workers.add(worker)


def _held_runs() -> float:
    return float(sum(worker.in_flight() for worker in list(_workers)))


def _slots() -> float:
    return float(sum(worker.concurrency for worker in list(_workers)))


# -- recording: subscribed by enable() ----------------------------------------------------


class Counting(observers.Observer):
    """The counters and histograms of this process, for the engine's reports."""

    def __init__(self, metrics: _Metrics) -> None:
        self.metrics = metrics

    def claim_ended(self, event: observers.ClaimEnd) -> None:
        self.metrics.claims.labels(event.disposition).inc()

    def step_committed(self, event: observers.StepCommit) -> None:
        self.metrics.steps_committed.labels(event.kind).inc()
        self.metrics.step_commit_seconds.observe(event.seconds)

    def turn_cost(self, event: observers.TurnCost) -> None:
        if event.cost is not None:
            self.metrics.cost.labels(event.agent, event.model).inc(float(event.cost))

    def model_attempt(self, event: observers.ModelAttempt) -> None:
        if event.outcome is ModelOutcome.INTERRUPTED:
            return  # no label of its own: the claim's outcome (cancelled, lost) counts it
        self.metrics.model_calls.labels(event.outcome.value).inc()
        if event.outcome is ModelOutcome.OK:
            self.metrics.model_call_seconds.observe(event.seconds)

    def capacity_wait(self, event: observers.CapacityWait) -> None:
        self.metrics.capacity_waits.labels(event.model, event.reason.value).inc()
        self.metrics.capacity_wait_seconds.labels(event.model, event.reason.value).inc(
            event.seconds
        )

    def tool_call(self, event: observers.ToolCallEnd) -> None:
        self.metrics.tool_calls.labels(event.effect, event.outcome.value).inc()
        self.metrics.tool_call_seconds.labels(event.effect).observe(event.seconds)


# -- the database figures ------------------------------------------------------------------


class DatabaseCollector:
    """The database gauges, read at scrape time: one query per ``cache_seconds`` however
    often (and however many at once) Prometheus scrapes."""

    def __init__(
        self,
        cache_seconds: float = DB_CACHE_SECONDS,
        using: str = DEFAULT_DB_ALIAS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cache_seconds = cache_seconds
        self.using = using
        self.clock = clock
        self._lock = threading.Lock()
        self._read_at: float | None = None
        self._figures: Figures | None = None
        self._failures = 0

    def forget(self) -> None:
        with self._lock:
            self._read_at = None

    def describe(self) -> Iterable[Any]:
        # Names for the registry's duplicate check, without querying at registration.
        return self._families(None)

    def collect(self) -> Iterable[Any]:
        with self._lock:
            now = self.clock()
            if self._read_at is None or now - self._read_at >= self.cache_seconds:
                self._figures = self._read()
                self._read_at = now
            figures = self._figures
        return self._families(figures, up=figures is not None)

    def _read(self) -> Figures | None:
        connection = connections[self.using]
        try:
            # Imported here: this module is imported before the models are (by the llm client).
            from durable_agents.observe import figures as database

            figures = database.read_figures(database.PROMETHEUS, using=self.using)
        except Exception as exc:  # noqa: BLE001 - a scrape must still return this worker's own figures
            self._failures += 1
            log = logger.warning if self._failures == 1 else logger.debug
            log("metrics: reading the database figures failed (%s: %s)", type(exc).__name__, exc)
            return None
        finally:
            # Scrapes are served by short-lived threads: give the connection back (to the
            # worker's pool, or closed) instead of leaving one open per scrape thread.
            if not connection.in_atomic_block:
                connection.close()
        if self._failures:
            logger.info("metrics: the database figures are readable again")
            self._failures = 0
        return figures

    @staticmethod
    def _families(figures: Figures | None, *, up: bool = True) -> list[Any]:
        """The families with their samples; without figures, only ``database_up`` has one
        (0) after a failed reading, and none has any for ``describe``."""
        from prometheus_client.core import GaugeMetricFamily

        def gauge(name: str, documentation: str, labels: list[str] | None = None) -> Any:
            return GaugeMetricFamily(f"durable_agents_{name}", documentation, labels=labels)

        database_up = gauge("database_up", "1 if the last reading of the database figures worked")
        by_status = gauge("runs", "Runs in the database, by status", ["status"])
        waiting = gauge(
            "runs_waiting", "Waiting runs in the database, by what they wait for", ["waiting_for"]
        )
        singles = {
            "runs_lease_expired": "Running runs whose lease expired: no live worker advances them",
            "oldest_pending_age_seconds": "Age of the oldest pending run (0 when none is pending)",
            "intents_waiting": "Irreversible calls waiting for a person (pending or unknown)",
            "oldest_intent_age_seconds": "Age of the oldest intent waiting for a person (0: none)",
            "questions_open": "Questions asked of a person and not answered yet",
            "oldest_question_age_seconds": "Age of the oldest open question (0 when none)",
        }
        families = {name: gauge(name, documentation) for name, documentation in singles.items()}
        if figures is None:
            if not up:
                database_up.add_metric([], 0)
                return [database_up]
            return [database_up, by_status, waiting, *families.values()]
        database_up.add_metric([], 1)
        for status, count in figures.runs_by_status.items():
            by_status.add_metric([status], count)
        for kind, count in _runs_waiting(figures).items():
            waiting.add_metric([kind], count)
        intents, questions = figures.intents, figures.questions
        values = {
            "runs_lease_expired": figures.lease_expired or 0,
            "oldest_pending_age_seconds": _age(figures, figures.pending),
            "intents_waiting": (intents.count or 0) if intents else 0,
            "oldest_intent_age_seconds": _age(figures, intents),
            "questions_open": (questions.count or 0) if questions else 0,
            "oldest_question_age_seconds": _age(figures, questions),
        }
        for name, value in values.items():
            families[name].add_metric([], value)
        return [database_up, by_status, waiting, *families.values()]


def _runs_waiting(figures: Figures) -> dict[str, int]:
    """Waiting runs by kind: every kind's series exists (at 0); runs parked before waits had
    kinds are "unknown"."""
    from durable_agents.models import WaitKind

    counts = dict.fromkeys(WaitKind.values, 0)
    for wait in figures.waits:
        kind = wait.kind or "unknown"
        counts[kind] = counts.get(kind, 0) + wait.runs
    return counts


def _age(figures: Figures, queue: Queue | None) -> float:
    """Seconds the oldest of ``queue`` has waited; 0 when none waits. Never negative: the
    database's clock may run a little ahead of this process's."""
    seconds = figures.age_seconds(queue.oldest_at) if queue is not None else None
    return max(0.0, seconds) if seconds is not None else 0.0


# -- the HTTP endpoint ---------------------------------------------------------------------


def serve(port: int, addr: str) -> tuple[WSGIServer, threading.Thread]:
    """Serve prometheus_client's default registry at ``http://addr:port/metrics`` on a
    daemon thread (port 0: any free port). Raises ``OSError`` when the address is taken."""
    from prometheus_client import start_http_server

    server, thread = start_http_server(port, addr)
    thread.name = "da-metrics"
    return server, thread


def metrics_url(server: WSGIServer) -> str:
    host, port = server.server_address[:2]
    host = str(host)
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}/metrics"
