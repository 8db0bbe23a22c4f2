"""Which runs the live workers can serve: a pass every worker makes at start and once per
heartbeat interval, on a thread of its own.

    wake     runs waiting for a worker (``WaitKind.WORKER``) that this process serves (its
             registry defines their agent version, with their fingerprint for their model)
             are pending again: a deploy that brings a version back resumes its runs
    carry    for each agent of this code with ``upgrades_from``: the runs in flight of an old
             version that no live worker defines (nor this process) are moved to the agent's
             version with ``upgrade_runs``, where their history allows; a refused run stays,
             waiting for a worker of its version, and is not offered again for a while
    park     pending runs of agent versions that no live worker defines (agent_worker, this
             worker included) wait for a worker instead: they cost no attempt, and claims no
             longer read past them to find the runs they can take

While a worker of the old code is live, nothing is carried over: it serves its runs itself, so
a rolling deploy upgrades only what the last old worker leaves behind.

A run parked by one worker's pass just as a worker that defines it registers is woken by that
worker's next pass: every pass does both. Housekeeping dead-letters what waits longer than
UNDEPLOYED_GRACE (``sweeps.dead_letter_undeployed``).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from django.db import DatabaseError

from durable_agents.api import upgrade_runs
from durable_agents.declare.agents import AgentNotFound, registry
from durable_agents.engine import services as worker_services
from durable_agents.logging import bind_run
from durable_agents.models import AgentRun, RunStatus
from durable_agents.models.workers import versions_seen
from durable_agents.store import Store, current
from durable_agents.store.base import RunId

IN_FLIGHT = (RunStatus.PENDING, RunStatus.RUNNING, RunStatus.WAITING)

logger = logging.getLogger("durable_agents.worker")


def can_serve(agent: str, version: str, model: str, fingerprint: str) -> bool:
    """Whether this process's code serves a run pinned so."""
    try:
        defined = registry.get(agent, version)
    except AgentNotFound:
        return False
    return defined.fingerprint(model) == fingerprint


# Runs one pass offers ``upgrade_runs`` per old version (the next pass offers the rest), and
# how many passes a run it refused is left alone.
CARRY_PER_PASS = 1000
REFUSED_FOR_PASSES = 10
# The refusals of ``upgrade_runs`` that say a run was held or locked at that moment (a killed
# worker's lease runs out within seconds): not remembered.
MOMENTARY = ("held by worker", "busy:")


class CarryOver:
    """The runs of old versions that this process's agents upgrade from
    (``Agent.upgrades_from``), moved when no live worker serves them."""

    def __init__(self) -> None:
        self.passes = 0
        # Run id -> the pass that refused it.
        self.refused: dict[RunId, int] = {}

    def __call__(self, live: set[tuple[str, str]], worker_id: str) -> int:
        self.passes += 1
        self.refused = {
            run_id: at
            for run_id, at in self.refused.items()
            if self.passes - at < REFUSED_FOR_PASSES
        }
        moved = 0
        for agent in registry.all():
            for old in agent.upgrades_from:
                if (agent.name, old) in live or (agent.name, old) in registry:
                    continue  # a live worker (or this one) serves them
                moved += self._carry(agent.name, old, agent.version, worker_id)
        return moved

    def _carry(self, name: str, old: str, new: str, worker_id: str) -> int:
        candidates = [
            run_id
            for run_id in AgentRun.objects.filter(
                agent=name, prompt_version=old, status__in=IN_FLIGHT
            ).values_list("pk", flat=True)[: CARRY_PER_PASS + len(self.refused)]
            if run_id not in self.refused
        ][:CARRY_PER_PASS]
        if not candidates:
            return 0
        report = upgrade_runs(name, old, new, run_ids=candidates)
        for run_id, why in report.refused.items():
            if why.startswith(MOMENTARY):
                continue  # held or locked at that moment: the next pass offers it again
            self.refused[run_id] = self.passes
            with bind_run(run_id):
                logger.info(
                    "run %s stays on %s@%s, waiting for a worker that defines it: %s",
                    run_id,
                    name,
                    old,
                    why,
                )
        if report.upgraded:
            logger.info(
                "worker %s carried %d run(s) of %s@%s over to version %s",
                worker_id,
                len(report.upgraded),
                name,
                old,
                new,
            )
        return len(report.upgraded)


def serve_pass(
    store: Store, worker_id: str = "", carry_over: CarryOver | None = None
) -> tuple[int, int]:
    """One pass: (runs woken, runs parked); with ``carry_over``, the upgrades in between."""
    woken = store.wake_served_runs(can_serve)
    live = {key for key, seen in versions_seen().items() if seen.live_workers}
    if carry_over is not None:
        carry_over(live, worker_id)
    served = live | {(agent.name, agent.version) for agent in registry.all()}
    parked = store.park_unserved_runs(served)
    if woken:
        logger.info("worker %s: %d run(s) waiting for a worker are its own again", worker_id, woken)
    if parked:
        logger.warning(
            "worker %s: %d pending run(s) of agent versions no live worker defines wait for one",
            worker_id,
            parked,
        )
    return woken, parked


class Serving(worker_services.WorkerService):
    def start(self, worker: Any) -> threading.Thread | None:
        store = worker.store or current()
        if not store.holds_connections:
            return None  # an in-memory store: the fleet's rows are in the database

        carry_over = CarryOver()

        def serve() -> None:
            try:
                wait = 0.0
                while not worker.stopping.wait(wait):
                    try:
                        serve_pass(store, worker.worker_id, carry_over)
                    except DatabaseError as exc:
                        logger.warning(
                            "worker %s: waking and parking runs failed (%s)", worker.worker_id, exc
                        )
                    finally:
                        worker.connections.release()
                    wait = worker.heartbeat_seconds
            finally:
                worker.connections.close()

        thread = threading.Thread(target=serve, name="da-serving", daemon=True)
        thread.start()
        return thread


worker_services.register("durable_agents.housekeeping.serving", Serving())
