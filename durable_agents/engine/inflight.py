"""What a worker says about runs in flight before it claims anything, and after a burst.

Prompt drift (``prompt_drift``): an agent whose definition changed without a new version while
runs started with the old definition are still in flight. A run pins its agent's name, version
and the fingerprint of what its requests send; a worker that finds another fingerprint under
the same name and version does not serve the run (resuming would change what the model was
shown): it hands it back, and the run waits for a worker with its definition. ``manage.py
check --database default`` reports it (W040) and ``runagents`` says it at start.

Leases of other workers (``runs_held_by_others``): after a burst that claimed nothing, the runs
a killed worker still holds until its lease expires.
"""

from __future__ import annotations

import dataclasses
import datetime

from django.db.models import Count, Max
from django.db.models.functions import Now

from durable_agents.declare.agents import AgentNotFound, registry
from durable_agents.models import AgentRun, RunStatus

IN_FLIGHT = (RunStatus.PENDING, RunStatus.RUNNING, RunStatus.WAITING)


@dataclasses.dataclass(frozen=True)
class Drift:
    """Runs in flight of ``agent``@``version`` that its registered definition would stop."""

    agent: str
    version: str
    runs: int
    registered: str  # the fingerprint of the registered definition (for the agent's model)
    pinned: tuple[str, ...]  # the fingerprints the drifted runs were started with

    def describe(self) -> str:
        pinned = ", ".join(f[:12] for f in self.pinned)
        return (
            f"agent {self.agent}@{self.version} changed without a new version: {self.runs} "
            f"run(s) in flight were started with fingerprint {pinned}, this code has "
            f"{self.registered[:12]}; workers of this code will not serve them (they wait, "
            "pending, for a worker with their definition)"
        )


def prompt_drift(using: str = "default") -> list[Drift]:
    """The registered agents whose fingerprint differs from that of runs in flight pinned to
    the same name and version (fingerprints are per model: a run may use another model than its
    agent's). Agents this process does not register are left out: a worker hands their runs
    back, it does not dead-letter them."""
    rows = (
        AgentRun.objects.using(using)
        .filter(status__in=IN_FLIGHT)
        .values_list("agent", "prompt_version", "model", "fingerprint")
        .annotate(runs=Count("id"))
        .order_by()
    )
    found: dict[tuple[str, str], tuple[int, str, set[str]]] = {}
    for name, version, model, fingerprint, runs in rows:
        try:
            agent = registry.get(name, version)
        except AgentNotFound:
            continue
        current = agent.fingerprint(model)
        if current == fingerprint:
            continue
        count, _registered, pinned = found.get((name, version), (0, current, set()))
        found[(name, version)] = (count + runs, current, pinned | {fingerprint})
    return [
        Drift(name, version, runs, registered, tuple(sorted(pinned)))
        for (name, version), (runs, registered, pinned) in sorted(found.items())
    ]


def runs_held_by_others(
    worker_id: str, using: str = "default"
) -> tuple[int, datetime.datetime] | None:
    """How many running runs a lease of another worker holds now, and when the last of those
    leases expires; None when there are none."""
    held = (
        AgentRun.objects.using(using)
        .filter(status=RunStatus.RUNNING, lease_until__gt=Now())
        .exclude(lease_owner=worker_id)
        .aggregate(count=Count("id"), last=Max("lease_until"))
    )
    if not held["count"]:
        return None
    return held["count"], held["last"]
