"""``agent_worker`` and ``agent_version``: the fleet as the database sees it.

A worker writes its row when it starts (``runagents``), keeps it current with every heartbeat
(in the statement that renews its leases; an idle worker beats too) and deletes it when it
stops cleanly. A killed worker's row stops beating: it is *live* while ``alive_until`` (its last
beat plus a lease) is in the future, and housekeeping removes it an hour later. Each row names
the agent versions its process defines, with their fingerprints.

``agent_version`` outlives the workers: when each agent version (with one definition) was
first and last defined by a live worker, and what it sent (digests of the parameters a signed
thinking block is bound to, and of each tool), so that runs of a version no deployed code
defines any more can still be judged: housekeeping gives them ``UNDEPLOYED_GRACE`` before the
dead letter, and ``upgrade_runs`` compares their tools with the version they move to.

Writes go through the store (``Store.register_worker``, ``renew_leases``,
``unregister_worker``); this module only says what the rows are.
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any, ClassVar

from django.db import models
from django.db.models.functions import Now
from django.utils import timezone
from django.utils.translation import gettext_lazy as _

# The longest worker id (``runagents --worker-id``): a host name, a pid and a suffix fit.
MAX_WORKER_ID = 200
# How long a worker's row stays after its last beat (shown as gone) before housekeeping
# removes it, having recorded its versions' last definition in agent_version.
WORKER_ROWS_KEPT = datetime.timedelta(hours=1)


class WorkerQuerySet(models.QuerySet["AgentWorker"]):
    def live(self) -> WorkerQuerySet:
        """Workers whose last heartbeat is within a lease of now."""
        return self.filter(alive_until__gt=Now())

    def gone(self) -> WorkerQuerySet:
        return self.filter(alive_until__lte=Now())


class AgentWorker(models.Model):
    """One worker process (``runagents``), as its last heartbeat described it."""

    id = models.CharField(max_length=MAX_WORKER_ID, primary_key=True)
    # A random id per process: a second process started with the same worker id never
    # updates this row while the first one is live.
    instance = models.UUIDField()
    host = models.CharField(max_length=255)
    pid = models.IntegerField()
    started_at = models.DateTimeField(db_default=Now())
    beat_at = models.DateTimeField(db_default=Now())
    # The last beat plus one lease: after this the worker counts as gone.
    alive_until = models.DateTimeField(db_index=True)
    concurrency = models.IntegerField()
    runs_held = models.IntegerField(default=0)
    # SIGTERM received: claiming nothing new, finishing what it holds.
    draining = models.BooleanField(default=False)
    # [{"agent", "version", "model", "fingerprint"}, ...]: the agent versions its code defines.
    versions = models.JSONField(default=list)

    objects = WorkerQuerySet.as_manager()

    class Meta:
        db_table = "agent_worker"
        ordering: ClassVar[list[str]] = ["id"]
        verbose_name = _("worker")
        verbose_name_plural = _("workers")

    def __str__(self) -> str:
        return self.id

    @property
    def is_live(self) -> bool:
        return self.alive_until > timezone.now()

    def labels(self) -> list[str]:
        """``agent@version`` of every version it defines, in its order."""
        return [f"{v.get('agent')}@{v.get('version')}" for v in self.defined()]

    def defined(self) -> list[dict[str, Any]]:
        """Its versions, each a dict; anything else in the column is skipped."""
        return [v for v in self.versions or [] if isinstance(v, dict)]


class AgentVersion(models.Model):
    """An agent version with one definition (fingerprint), and when live workers defined it."""

    agent = models.CharField(max_length=200)
    version = models.CharField(max_length=200)
    # The fingerprint and model of the definition (for the agent's own model).
    fingerprint = models.CharField(max_length=64)
    model = models.CharField(max_length=200)
    # sha256 of the system prompt and tools (what signed thinking binds besides the model).
    binding = models.CharField(max_length=64)
    # {tool name: sha256 of its effect class and input schema}.
    tools = models.JSONField(default=dict)
    first_defined_at = models.DateTimeField(db_default=Now())
    # The last moment a live worker was known to define it (a live worker defines it now).
    last_defined_at = models.DateTimeField(db_default=Now())

    class Meta:
        db_table = "agent_version"
        ordering: ClassVar[list[str]] = ["agent", "version", "-last_defined_at"]
        constraints: ClassVar[list[models.BaseConstraint]] = [
            models.UniqueConstraint(
                fields=["agent", "version", "fingerprint"], name="agent_version_definition"
            )
        ]
        verbose_name = _("agent version")
        verbose_name_plural = _("agent versions")

    def __str__(self) -> str:
        return f"{self.agent}@{self.version} ({self.fingerprint[:12]})"


@dataclasses.dataclass(frozen=True)
class VersionSeen:
    """An agent version as the fleet knows it: the live workers that define it (and with
    which fingerprints, for their agent's own model), and the last time one did."""

    agent: str
    version: str
    live_workers: tuple[str, ...]
    fingerprints: tuple[str, ...]
    last_defined_at: datetime.datetime | None

    @property
    def label(self) -> str:
        return f"{self.agent}@{self.version}"


def versions_seen(now: datetime.datetime | None = None) -> dict[tuple[str, str], VersionSeen]:
    """Every agent version a worker defines or defined, by (agent, version): from the worker
    rows (a live worker defines it now; a gone one until its last beat) and agent_version."""
    now = now or timezone.now()
    live: dict[tuple[str, str], list[str]] = {}
    prints: dict[tuple[str, str], set[str]] = {}
    last: dict[tuple[str, str], datetime.datetime] = {}

    def saw(key: tuple[str, str], at: datetime.datetime) -> None:
        if key not in last or last[key] < at:
            last[key] = at

    for worker in AgentWorker.objects.only("id", "alive_until", "beat_at", "versions"):
        is_live = worker.alive_until > now
        for defined in worker.defined():
            key = (str(defined.get("agent")), str(defined.get("version")))
            if is_live:
                live.setdefault(key, []).append(worker.id)
                prints.setdefault(key, set()).add(str(defined.get("fingerprint")))
            saw(key, now if is_live else worker.beat_at)
    rows = AgentVersion.objects.values_list("agent", "version", "last_defined_at")
    for agent, version, at in rows:
        saw((agent, version), at)
    return {
        key: VersionSeen(
            key[0],
            key[1],
            tuple(sorted(live.get(key, ()))),
            tuple(sorted(prints.get(key, ()))),
            at,
        )
        for key, at in last.items()
    }


def waiting_for_a_worker(
    pairs: list[tuple[str, str]], seen: dict[tuple[str, str], VersionSeen] | None = None
) -> list[tuple[str, str]]:
    """Of ``pairs`` (agent, version), those no live worker defines."""
    seen = versions_seen() if seen is None else seen
    return [pair for pair in pairs if pair not in seen or not seen[pair].live_workers]
