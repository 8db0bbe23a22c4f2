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
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Sequence
from typing import Any

from django.db import IntegrityError, transaction
from django.db.models import Q, QuerySet
from django.utils import timezone

from durable_agents.declare.agents import ROUTE_SEPARATOR, Routing
from durable_agents.models import AgentRun, AgentVersion, AgentWorker
from durable_agents.store.base import Presence


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
    """A clean stop: its versions were defined until now; its row goes."""
    with transaction.atomic():
        record_versions(definitions, timezone.now())
        AgentWorker.objects.filter(pk=presence.worker_id, instance=presence.instance).delete()


def record_versions(definitions: Iterable[dict[str, Any]], at: datetime.datetime) -> None:
    """agent_version: each definition (``Agent.digests()`` with its agent and version) was
    defined by a live worker at ``at`` (never moved back)."""
    for definition in definitions:
        row, created = AgentVersion.objects.get_or_create(
            agent=definition["agent"],
            version=definition["version"],
            fingerprint=definition["fingerprint"],
            defaults={
                "model": definition["model"],
                "binding": definition["binding"],
                "tools": definition["tools"],
                "first_defined_at": at,
                "last_defined_at": at,
            },
        )
        if not created:
            AgentVersion.objects.filter(pk=row.pk, last_defined_at__lt=at).update(
                last_defined_at=at
            )


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
