"""Workers you can see: a worker's row in agent_worker from its start to its stop, its beat
(one statement with its leases on PostgreSQL, and when idle too), a worker id that is in use or
that no column can hold, and agent_version, which outlives the rows."""

from __future__ import annotations

import contextlib
import datetime
import io
import os
import threading
from collections.abc import Iterator

import pytest
from django.core.management import CommandError, call_command
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from durable_agents import store
from durable_agents.api import start_run
from durable_agents.declare.agents import registry
from durable_agents.engine.worker import Worker, _Held
from durable_agents.exceptions import InvalidArgument, WorkerIdInUse
from durable_agents.models import AgentVersion, AgentWorker
from tests.conftest import run_worker

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_worker_writes_its_row_beats_it_idle_and_deletes_it_when_it_stops() -> None:
    worker = Worker(worker_id="seen-1", concurrency=3, lease_seconds=30, handle_signals=False)
    worker.register()
    row = AgentWorker.objects.get(pk="seen-1")
    assert (row.concurrency, row.runs_held, row.draining, row.is_live) == (3, 0, False, True)
    assert ("tester", "v1") in {(v["agent"], v["version"]) for v in row.defined()}
    tester = registry.get("tester", "v1")
    assert {"agent": "tester", "version": "v1", "model": tester.model,
            "fingerprint": tester.fingerprint()} in row.defined()  # fmt: skip
    AgentWorker.objects.filter(pk="seen-1").update(
        alive_until=timezone.now() - datetime.timedelta(seconds=1)
    )
    with CaptureQueriesContext(connection) as queries:
        assert worker.beat() == {}  # an idle worker beats too
    if connection.vendor == "postgresql":
        assert len(queries) == 1, [q["sql"] for q in queries]
    assert AgentWorker.objects.get(pk="seen-1").is_live
    # The versions it defines are recorded where they outlive the row.
    record = AgentVersion.objects.get(agent="tester", version="v1")
    assert record.fingerprint == tester.fingerprint()
    assert record.tools == tester.digests()["tools"]
    worker.unregister()
    assert not AgentWorker.objects.filter(pk="seen-1").exists()
    assert AgentVersion.objects.get(pk=record.pk).last_defined_at >= record.last_defined_at


def test_the_beat_of_a_worker_holding_runs_is_one_statement_with_its_row() -> None:
    runs = [start_run("tester", f"Task {n}.") for n in range(3)]
    worker = Worker(worker_id="holder", concurrency=5, lease_seconds=60, handle_signals=False)
    worker.register()
    for run in runs:
        claim = store.current().claim_run(run.pk, "holder", 60)
        assert claim is not None
        worker._held[run.pk] = _Held(claim)
    with CaptureQueriesContext(connection) as queries:
        assert worker.beat() == {}
    if connection.vendor == "postgresql":
        assert len(queries) == 1, [q["sql"] for q in queries]
    assert AgentWorker.objects.get(pk="holder").runs_held == 3
    worker.stopping.set()
    worker.beat()
    assert AgentWorker.objects.get(pk="holder").draining


def test_a_row_removed_while_the_worker_lives_is_written_again_by_its_next_beat() -> None:
    worker = Worker(worker_id="comes-back", handle_signals=False)
    worker.register()
    AgentWorker.objects.filter(pk="comes-back").delete()
    worker.beat()
    assert AgentWorker.objects.get(pk="comes-back").instance == worker.instance


def beating(worker: Worker, every: float = 0.2) -> threading.Event:
    """Beat ``worker``'s row from a thread until the returned event is set (a live worker)."""
    done = threading.Event()

    def beat() -> None:
        try:
            while not done.wait(every):
                worker.beat()
        finally:
            connection.close()

    threading.Thread(target=beat, daemon=True).start()
    return done


def test_a_second_worker_with_the_id_of_a_live_one_refuses_to_start() -> None:
    first = Worker(worker_id="only-one", lease_seconds=3, handle_signals=False)
    first.register()
    stop_beating = beating(first)
    try:
        second = Worker(worker_id="only-one", handle_signals=False)
        with pytest.raises(WorkerIdInUse, match=r"worker id 'only-one' is in use by a live"):
            second.register()
    finally:
        stop_beating.set()
    # The first one's row is untouched, and a beat of the second would not touch it either.
    assert AgentWorker.objects.get(pk="only-one").instance == first.instance
    second._registered = True
    second.beat()
    assert AgentWorker.objects.get(pk="only-one").instance == first.instance


def test_a_killed_workers_id_is_taken_over_once_its_row_stops_beating() -> None:
    """A pod restarted under its name: the old row beats no more; the new worker waits for it
    to age out (at most one of its leases) and takes the id."""
    killed = Worker(worker_id="pod-0", lease_seconds=1.5, handle_signals=False)
    killed.register()
    AgentWorker.objects.filter(pk="pod-0").update(pid=killed_pid())  # another process's row
    restarted = Worker(worker_id="pod-0", handle_signals=False)
    restarted.register()
    assert AgentWorker.objects.get(pk="pod-0").instance == restarted.instance


def test_an_earlier_worker_of_this_process_that_ended_without_its_goodbye_frees_its_id() -> None:
    ended = Worker(worker_id="reused", handle_signals=False)
    ended.register()
    with ended_without_goodbye(ended):
        pass
    again = Worker(worker_id="reused", handle_signals=False)
    again.register()  # at once: nothing of this process runs the earlier one any more
    assert AgentWorker.objects.get(pk="reused").instance == again.instance


def killed_pid() -> int:
    return os.getpid() + 1


@contextlib.contextmanager
def ended_without_goodbye(worker: Worker) -> Iterator[None]:
    """As when an exception left ``run`` before the worker removed its row."""
    yield
    from durable_agents.engine import worker as worker_module

    with worker_module._RUNNING_LOCK:
        worker_module._RUNNING.discard(worker.instance)


def test_two_workers_starting_at_once_with_one_id_one_of_them_refuses() -> None:
    workers = [Worker(worker_id="racing", lease_seconds=3, handle_signals=False) for _ in range(2)]
    outcomes: list[str] = []
    beats: list[threading.Event] = []
    gate = threading.Barrier(2)

    def start(worker: Worker) -> None:
        gate.wait()
        try:
            worker.register()
            beats.append(beating(worker))  # the one that started is live
            outcomes.append("started")
        except WorkerIdInUse:
            outcomes.append("refused")
        finally:
            connection.close()

    threads = [threading.Thread(target=start, args=(w,)) for w in workers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    for beat in beats:
        beat.set()
    assert sorted(outcomes) == ["refused", "started"]


def test_runagents_refuses_a_worker_id_in_use_with_a_clear_message() -> None:
    live = Worker(worker_id="busy-id", lease_seconds=3, handle_signals=False)
    live.register()
    stop_beating = beating(live)
    try:
        with pytest.raises(CommandError, match="refusing to start: worker id 'busy-id' is in use"):
            call_command(
                "runagents", "--burst", "--allow-offline", "--worker-id", "busy-id",
                stdout=io.StringIO(),
            )  # fmt: skip
    finally:
        stop_beating.set()


@pytest.mark.parametrize(
    ("worker_id", "message"),
    [
        ("w" * 10_000, "at most 200 characters; this one has 10000"),
        ("bad\x00id", "cannot contain control characters"),
        ("", "non-empty"),
    ],
    ids=["10-kB", "NUL", "empty"],
)
def test_a_worker_id_no_column_can_hold_is_refused(worker_id: str, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        Worker(worker_id=worker_id, handle_signals=False)
    with pytest.raises(CommandError, match=message):
        call_command(
            "runagents",
            "--burst",
            "--allow-offline",
            "--worker-id",
            worker_id,
            stdout=io.StringIO(),
        )
    assert not AgentWorker.objects.exists()


def test_a_worker_that_ran_leaves_no_row_and_its_versions_recorded() -> None:
    run = start_run("tester", "Say hello.")
    worker = run_worker(worker_id="burst-1")
    assert worker.stats.claims == 1
    assert not AgentWorker.objects.filter(pk="burst-1").exists()
    assert AgentVersion.objects.filter(agent="tester", version="v1").exists()
    assert run.pk is not None


def test_a_killed_workers_row_stays_and_stops_counting_as_live() -> None:
    worker = Worker(worker_id="killed", lease_seconds=30, handle_signals=False)
    worker.register()  # and never unregisters: as after SIGKILL
    AgentWorker.objects.filter(pk="killed").update(
        alive_until=timezone.now() - datetime.timedelta(seconds=1)
    )
    assert list(AgentWorker.objects.live().values_list("id", flat=True)) == []
    assert list(AgentWorker.objects.gone().values_list("id", flat=True)) == ["killed"]
