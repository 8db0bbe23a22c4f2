"""The fleet's rows through the ORM: a worker's registration, its beat and its goodbye, and the
routing of claims by agent version. The PostgreSQL store sends the beat inside its heartbeat
statement (``postgres_claims.RENEW_ALL_SQL``); registration and goodbye are these functions on
every database.

    register     ``register(presence, definitions)``: the worker's row, unless a live worker
                 holds its id (that row is returned: the caller refuses to start); the agent
                 versions it defines are recorded in agent_version (last defined now)
    beat         ``beat(presence)``: the row's heartbeat, re-made if housekeeping removed it
    goodbye      ``unregister(presence)``: the row is deleted, its versions recorded as defined
                 until now
    routing      ``routed(queryset, routing)``: the runs of the agent versions this process
                 defines, less the definitions of them it cannot serve
    park         ``park_unserved(served)``: pending runs of versions no live worker defines
                 wait for a worker (out of every claim's way); one run a worker could not
                 serve waits so too (``PortableStore.wait_for_worker``, fenced on its claim)
    wake         ``wake_served(can_serve)``: runs waiting for a worker that this process
                 serves are pending again (at a worker's start and every heartbeat interval)
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any

from django.db import IntegrityError, transaction
from django.db.models import Q, QuerySet
from django.db.models.functions import Now
from django.utils import timezone

from durable_agents._internal.text import storable_text
from durable_agents.declare.agents import ROUTE_SEPARATOR, Routing
from durable_agents.models import AgentRun, AgentVersion, AgentWorker, RunStatus, WaitKind
from durable_agents.store.base import MAX_REASON_CHARS, Presence

IN_FLIGHT = (RunStatus.PENDING, RunStatus.RUNNING, RunStatus.WAITING)


def routed(queryset: QuerySet[AgentRun], routing: Routing) -> QuerySet[AgentRun]:
    """``queryset`` less the runs this process's claims may not take (``ROUTED`` in SQL)."""
    served = Q(pk__in=[])
    for key in routing.serves:
        agent, version = key.split(ROUTE_SEPARATOR)
        served |= Q(agent=agent, prompt_version=version)
    queryset = queryset.filter(served)
    for key in routing.refuses:
        agent, version, fingerprint = key.split(ROUTE_SEPARATOR)
        queryset = queryset.exclude(agent=agent, prompt_version=version, fingerprint=fingerprint)
    return queryset


def in_flight_versions() -> list[tuple[str, str]]:
    """(agent, version) of every run in flight, each once (a DISTINCT; PostgreSQL reads them
    by a loose index scan instead: ``postgres_fleet``)."""
    return list(
        AgentRun.objects.filter(status__in=IN_FLIGHT)
        .order_by()
        .values_list("agent", "prompt_version")
        .distinct()
    )


def park_unserved(
    served: Collection[tuple[str, str]], pairs: Iterable[tuple[str, str]] | None = None
) -> int:
    """Runs no worker holds (pending, or running with an expired lease) of the agent versions
    not in ``served`` wait for a worker:
    one statement per such version of ``pairs`` (default: ``in_flight_versions()``), through
    agent_run_in_flight_version."""
    # Pending, and running with an expired lease (a killed worker's): no worker holds them.
    pending = AgentRun.objects.filter(
        Q(status=RunStatus.PENDING, lease_until__isnull=True)
        | Q(status__in=(RunStatus.PENDING, RunStatus.RUNNING), lease_until__lt=Now())
    )
    pairs = in_flight_versions() if pairs is None else pairs
    parked = 0
    for agent, version in pairs:
        if (agent, version) in served:
            continue
        parked += pending.filter(agent=agent, prompt_version=version).update(
            status=RunStatus.WAITING,
            waiting_for=WaitKind.WORKER,
            waiting_since=Now(),
            lease_owner=None,
            lease_until=None,
            error=storable_text(
                f"waiting for a worker that defines {agent}@{version}: no live worker does",
                MAX_REASON_CHARS,
            ),
            updated_at=Now(),
        )
    return parked


def wake_served(can_serve: Callable[[str, str, str, str], bool]) -> int:
    """Runs waiting for a worker that this process serves are pending again, claimable at
    once (read through agent_run_waiting: only the runs that wait for a worker)."""
    waiting = AgentRun.objects.filter(status=RunStatus.WAITING, waiting_for=WaitKind.WORKER)
    ids = [
        pk
        for pk, agent, version, model, fingerprint in waiting.values_list(
            "pk", "agent", "prompt_version", "model", "fingerprint"
        )
        if can_serve(agent, version, model, fingerprint)
    ]
    woken = 0
    for start in range(0, len(ids), 500):
        woken += waiting.filter(pk__in=ids[start : start + 500]).update(
            status=RunStatus.PENDING, waiting_for="", wake_at=None, updated_at=Now()
        )
    return woken


def register(presence: Presence, definitions: Sequence[dict[str, Any]]) -> AgentWorker | None:
    """The worker's row, written unless a live worker of another process holds its id: then
    that worker's row is returned and nothing is written. Two workers starting at once with
    one id: one inserts, the other finds its row (the primary key decides)."""
    for _ in range(2):
        try:
            with transaction.atomic():
                holder = (
                    AgentWorker.objects.select_for_update().filter(pk=presence.worker_id).first()
                )
                now = timezone.now()
                if (
                    holder is not None
                    and holder.instance != presence.instance
                    and holder.alive_until > now
                ):
                    return holder
                row = {**_row(presence, now), "started_at": now}
                if holder is None:
                    # A second process inserting the same id at once fails here: it looks
                    # again and finds this one live.
                    AgentWorker.objects.create(pk=presence.worker_id, **row)
                else:
                    AgentWorker.objects.filter(pk=presence.worker_id).update(**row)
                record_versions(definitions, now)
            return None
        except IntegrityError:
            continue  # the other one inserted first: look again
    return AgentWorker.objects.filter(pk=presence.worker_id).first()


def beat(presence: Presence) -> None:
    """The row's heartbeat (its own process's row only), or the row again when it is gone."""
    now = timezone.now()
    updated = AgentWorker.objects.filter(pk=presence.worker_id, instance=presence.instance).update(
        **_beat(presence, now)
    )
    if not updated and not AgentWorker.objects.filter(pk=presence.worker_id).exists():
        try:
            with transaction.atomic():
                AgentWorker.objects.create(pk=presence.worker_id, **_row(presence, now))
        except IntegrityError:
            pass  # another process took the id meanwhile: its row stays


def unregister(presence: Presence, definitions: Sequence[dict[str, Any]]) -> None:
    """A clean stop: its versions were defined until now (one UPDATE of the rows recorded at
    its start); its row goes."""
    now = timezone.now()
    with transaction.atomic():
        AgentVersion.objects.filter(_definitions(definitions), last_defined_at__lt=now).update(
            last_defined_at=now
        )
        AgentWorker.objects.filter(pk=presence.worker_id, instance=presence.instance).delete()


def record_versions(definitions: Iterable[dict[str, Any]], at: datetime.datetime) -> None:
    """agent_version: each definition (``Agent.digests()`` with its agent and version) was
    defined by a live worker at ``at`` (never moved back). Two statements whatever the number
    of agents: the new definitions inserted, the known ones' last definition moved on."""
    definitions = list(definitions)
    if not definitions:
        return
    AgentVersion.objects.bulk_create(
        [
            AgentVersion(
                agent=d["agent"],
                version=d["version"],
                fingerprint=d["fingerprint"],
                model=d["model"],
                binding=d["binding"],
                tools=d["tools"],
                first_defined_at=at,
                last_defined_at=at,
            )
            for d in definitions
        ],
        ignore_conflicts=True,
    )
    AgentVersion.objects.filter(_definitions(definitions), last_defined_at__lt=at).update(
        last_defined_at=at
    )


def _definitions(definitions: Iterable[dict[str, Any]]) -> Q:
    """The agent_version rows of ``definitions``."""
    found = Q(pk__in=[])
    for d in definitions:
        found |= Q(agent=d["agent"], version=d["version"], fingerprint=d["fingerprint"])
    return found


def _beat(presence: Presence, now: datetime.datetime) -> dict[str, Any]:
    return {
        "beat_at": now,
        "alive_until": now + datetime.timedelta(seconds=presence.alive_seconds),
        "runs_held": presence.runs_held,
        "draining": presence.draining,
    }


def _row(presence: Presence, now: datetime.datetime) -> dict[str, Any]:
    return {
        **_beat(presence, now),
        "instance": presence.instance,
        "host": presence.host,
        "pid": presence.pid,
        "concurrency": presence.concurrency,
        "versions": list(presence.versions),
    }
