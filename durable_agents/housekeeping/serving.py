"""Which runs the live workers can serve: a pass every worker makes at start and once per
heartbeat interval, on a thread of its own.

    wake     runs waiting for a worker (``WaitKind.WORKER``) that this process serves (its
             registry defines their agent version, with their fingerprint for their model)
             are pending again: a deploy that brings a version back resumes its runs
    park     pending runs of agent versions that no live worker defines (agent_worker, this
             worker included) wait for a worker instead: they cost no attempt, and claims no
             longer read past them to find the runs they can take

A run parked by one worker's pass just as a worker that defines it registers is woken by that
worker's next pass: every pass does both. Housekeeping dead-letters what waits longer than
UNDEPLOYED_GRACE (``sweeps.dead_letter_undeployed``).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from django.db import DatabaseError

from durable_agents.declare.agents import AgentNotFound, registry
from durable_agents.engine import services as worker_services
from durable_agents.models.workers import versions_seen
from durable_agents.store import Store, current

logger = logging.getLogger("durable_agents.worker")


def can_serve(agent: str, version: str, model: str, fingerprint: str) -> bool:
    """Whether this process's code serves a run pinned so."""
    try:
        defined = registry.get(agent, version)
    except AgentNotFound:
        return False
    return defined.fingerprint(model) == fingerprint


def serve_pass(store: Store, worker_id: str = "") -> tuple[int, int]:
    """One pass: (runs woken, runs parked)."""
    woken = store.wake_served_runs(can_serve)
    served = {key for key, seen in versions_seen().items() if seen.live_workers}
    served |= {(agent.name, agent.version) for agent in registry.all()}
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

        def serve() -> None:
            try:
                wait = 0.0
                while not worker.stopping.wait(wait):
                    try:
                        serve_pass(store, worker.worker_id)
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
