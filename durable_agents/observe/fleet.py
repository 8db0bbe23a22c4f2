"""The fleet as the runs in flight need it: which agent versions the live workers define, and
which versions runs in flight are pinned to that none of them does.

Three readers:

    read_fleet        the operations page: live workers, and the agent versions of runs in
                      flight no live worker defines, in one statement whatever the number of
                      runs (``FLEET_SQL`` below says what it reads)
    serving           the run page: the live workers that define one agent version, and with
                      which fingerprints
    deploy_check      ``manage.py durable_agents_deploycheck``: the runs in flight that the
                      code of this process (its registry) does not define, or defines with
                      another fingerprint, by agent and version

The worker rows (``agent_worker``) and ``agent_version`` are written by the workers and
housekeeping; this module only reads them.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from django.db import DEFAULT_DB_ALIAS
from django.db.models import (
    Count,
    DateTimeField,
    IntegerField,
    Max,
    Min,
    Q,
    QuerySet,
    TextField,
    Value,
)
from django.db.models.functions import Cast
from django.utils import timezone

from durable_agents.declare.agents import AgentNotFound, AgentRegistry
from durable_agents.models import AgentRun, AgentVersion, AgentWorker, RunStatus

# The statuses of a run in flight: each still needs a worker that defines its version.
IN_FLIGHT = (RunStatus.PENDING, RunStatus.RUNNING, RunStatus.WAITING)
# Characters of a fingerprint shown (as everywhere in the app).
SHORT_FINGERPRINT = 12


def short(fingerprint: str) -> str:
    return fingerprint[:SHORT_FINGERPRINT]


def defined_versions(versions: Any) -> list[dict[str, str]]:
    """A worker row's ``versions`` (a list, or its JSON text), each entry a dict of strings;
    anything else in it is skipped (the row is written by another process, maybe of another
    release)."""
    if isinstance(versions, str):
        try:
            versions = json.loads(versions)
        except ValueError:
            return []
    if not isinstance(versions, list):
        return []
    return [
        {key: str(entry.get(key, "")) for key in ("agent", "version", "model", "fingerprint")}
        for entry in versions
        if isinstance(entry, dict)
    ]


# -- the operations page -----------------------------------------------------------------------


@dataclass(frozen=True)
class VersionNeed:
    """Runs in flight of one agent version that no live worker defines."""

    agent: str
    version: str
    pending: int = 0
    running: int = 0
    waiting: int = 0
    oldest: datetime.datetime | None = None  # the created_at of the oldest of them
    # The last time a worker was known to define it (agent_version, or a gone worker's last
    # beat); None: no worker on record ever did.
    last_defined_at: datetime.datetime | None = None

    @property
    def label(self) -> str:
        return f"{self.agent}@{self.version}"

    @property
    def runs(self) -> int:
        return self.pending + self.running + self.waiting


@dataclass(frozen=True)
class Fleet:
    """The fleet as of ``taken_at``: how many workers are live, how many runs are in flight,
    and the versions those runs need that no live worker defines (the most runs first)."""

    taken_at: datetime.datetime
    live_workers: int = 0
    runs_in_flight: int = 0
    needs: tuple[VersionNeed, ...] = ()

    @property
    def no_live_worker(self) -> bool:
        """Runs are in flight and no worker is live: nothing advances."""
        return self.runs_in_flight > 0 and self.live_workers == 0


def _fleet_query(using: str) -> QuerySet[Any]:
    """``FLEET_SQL``: one statement, three kinds of rows, each row's first column its kind:

    ``r``  the runs in flight by agent, version and status: how many, the oldest. An aggregate
           over the runs in flight only (the index ``agent_run_status`` finds them), never the
           finished history
    ``w``  every worker row (few): its last beat, when it stops counting as live, its versions
    ``v``  agent_version by agent and version (few): the last time a worker defined it
    """
    text = TextField()
    no_time = Value(None, output_field=DateTimeField())
    runs = (
        AgentRun.objects.using(using)
        .filter(status__in=IN_FLIGHT)
        .order_by()
        .values_list(Value("r", output_field=text), "agent", "prompt_version", "status")
        .annotate(n=Count("*"), at=Min("created_at"), until=no_time, j=Value(None, text))
    )
    workers = (
        AgentWorker.objects.using(using)
        .order_by()
        .values_list(
            Value("w", output_field=text),
            "id",
            Value("", output_field=text),
            Value("", output_field=text),
            Value(0, output_field=IntegerField()),
            "beat_at",
            "alive_until",
            Cast("versions", text),
        )
    )
    versions = (
        AgentVersion.objects.using(using)
        .order_by()
        .values_list(Value("v", output_field=text), "agent", "version", Value("", text))
        .annotate(
            n=Value(0, output_field=IntegerField()),
            at=Max("last_defined_at"),
            until=no_time,
            j=Value(None, text),
        )
    )
    return runs.union(workers, versions, all=True).order_by()


def read_fleet(now: datetime.datetime | None = None, *, using: str = DEFAULT_DB_ALIAS) -> Fleet:
    """The fleet and the versions runs in flight need that no live worker defines: one
    statement (``_fleet_query``). A worker is live while its ``alive_until`` is after ``now``."""
    now = now or timezone.now()
    counts: dict[tuple[str, str], dict[str, int]] = {}
    oldest: dict[tuple[str, str], datetime.datetime] = {}
    live: set[tuple[str, str]] = set()
    last: dict[tuple[str, str], datetime.datetime] = {}
    live_workers = 0

    def saw(key: tuple[str, str], at: datetime.datetime | None) -> None:
        if at is not None and (key not in last or last[key] < at):
            last[key] = at

    for kind, first, second, status, n, at, until, versions in _fleet_query(using):
        if kind == "r":
            key = (first, second)
            by_status = counts.setdefault(key, {})
            by_status[status] = by_status.get(status, 0) + n
            if at is not None and (key not in oldest or at < oldest[key]):
                oldest[key] = at
        elif kind == "w":
            is_live = until is not None and until > now
            live_workers += is_live
            for defined in defined_versions(versions):
                key = (defined["agent"], defined["version"])
                if is_live:
                    live.add(key)
                else:
                    saw(key, at)
        elif kind == "v":
            saw((first, second), at)
    needs = [
        VersionNeed(
            agent,
            version,
            pending=by_status.get(RunStatus.PENDING, 0),
            running=by_status.get(RunStatus.RUNNING, 0),
            waiting=by_status.get(RunStatus.WAITING, 0),
            oldest=oldest.get((agent, version)),
            last_defined_at=last.get((agent, version)),
        )
        for (agent, version), by_status in counts.items()
        if (agent, version) not in live
    ]
    needs.sort(key=lambda need: (-need.runs, need.agent, need.version))
    return Fleet(
        taken_at=now,
        live_workers=live_workers,
        runs_in_flight=sum(sum(by_status.values()) for by_status in counts.values()),
        needs=tuple(needs),
    )


# -- the run page ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Serving:
    """The live workers that define one agent version, and the fingerprints they define it
    with for each model (a fingerprint is per model: the agent's own, as each worker sent it)."""

    agent: str
    version: str
    workers: tuple[str, ...] = ()
    fingerprints: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # model -> prints

    @property
    def label(self) -> str:
        return f"{self.agent}@{self.version}"

    def other_fingerprints(self, model: str, fingerprint: str) -> tuple[str, ...]:
        """The fingerprints live workers define the version with for ``model``, when none of
        them is ``fingerprint`` (a run started with another definition); () otherwise, and
        when no live worker defines it for that model (its fingerprint there is unknown)."""
        prints = self.fingerprints.get(model, ())
        return () if fingerprint in prints else prints


def serving(agent: str, version: str, *, using: str = DEFAULT_DB_ALIAS) -> Serving:
    """Who serves ``agent``@``version`` now: one query of the live worker rows (few)."""
    workers: list[str] = []
    prints: dict[str, set[str]] = {}
    for worker_id, versions in (
        AgentWorker.objects.using(using).live().order_by("id").values_list("id", "versions")
    ):
        for defined in defined_versions(versions):
            if (defined["agent"], defined["version"]) == (agent, version):
                if worker_id not in workers:
                    workers.append(worker_id)
                prints.setdefault(defined["model"], set()).add(defined["fingerprint"])
    return Serving(
        agent,
        version,
        tuple(workers),
        {model: tuple(sorted(found)) for model, found in prints.items()},
    )


# -- the deploy check --------------------------------------------------------------------------


@dataclass(frozen=True)
class PinnedGroup:
    """Runs in flight with one agent, version, model and fingerprint."""

    model: str
    fingerprint: str
    runs: int
    pending: int
    running: int
    waiting: int
    oldest: datetime.datetime | None
    # This code's fingerprint of the version for the group's model: None when this code
    # does not define the version.
    defined_with: str | None = None


@dataclass(frozen=True)
class DeployFinding:
    """An agent version that runs in flight are pinned to, which the code checked does not
    define (``groups`` hold all its runs in flight), or defines with another fingerprint
    (``groups`` hold only the runs started with another one)."""

    agent: str
    version: str
    groups: tuple[PinnedGroup, ...]
    defined: bool  # this code defines the version (with another fingerprint for ``groups``)
    # This code's versions of the agent whose ``upgrades_from`` names this one.
    upgraded_by: tuple[str, ...] = ()
    live_workers: tuple[str, ...] = ()  # live workers that define the version now

    @property
    def label(self) -> str:
        return f"{self.agent}@{self.version}"

    @property
    def runs(self) -> int:
        return sum(group.runs for group in self.groups)

    @property
    def oldest(self) -> datetime.datetime | None:
        return min((g.oldest for g in self.groups if g.oldest is not None), default=None)

    @property
    def stranded(self) -> bool:
        """No worker of this code will take these runs: a version it does not define and no
        ``upgrades_from`` of it covers, or defined with another fingerprint (a run keeps the
        definition it started with)."""
        return self.defined or not self.upgraded_by

    def count(self, status: str) -> int:
        return sum(getattr(group, status) for group in self.groups)


@dataclass(frozen=True)
class DeployCheck:
    """What ``deploy_check`` found: the runs in flight it looked at, and the findings."""

    runs_in_flight: int
    findings: tuple[DeployFinding, ...]
    agents_defined: int  # agent versions the code checked defines

    @property
    def stranded(self) -> int:
        return sum(f.runs for f in self.findings if f.stranded)

    @property
    def upgradable(self) -> int:
        return sum(f.runs for f in self.findings if not f.stranded)


def pinned_groups(using: str = DEFAULT_DB_ALIAS) -> QuerySet[Any]:
    """The runs in flight by agent, version, model and fingerprint: how many (and of each
    status) and the oldest. One aggregate over the runs in flight (a few rows per version)."""
    return (
        AgentRun.objects.using(using)
        .filter(status__in=IN_FLIGHT)
        .order_by()
        .values_list("agent", "prompt_version", "model", "fingerprint")
        .annotate(
            runs=Count("*"),
            pending=Count("pk", filter=Q(status=RunStatus.PENDING)),
            running=Count("pk", filter=Q(status=RunStatus.RUNNING)),
            waiting=Count("pk", filter=Q(status=RunStatus.WAITING)),
            oldest=Min("created_at"),
        )
        .order_by("agent", "prompt_version", "model", "fingerprint")
    )


def live_definers(using: str = DEFAULT_DB_ALIAS) -> dict[tuple[str, str], tuple[str, ...]]:
    """(agent, version) -> the live workers that define it: one query of the worker rows."""
    found: dict[tuple[str, str], list[str]] = {}
    rows = AgentWorker.objects.using(using).live().order_by("id").values_list("id", "versions")
    for worker_id, versions in rows:
        for defined in defined_versions(versions):
            workers = found.setdefault((defined["agent"], defined["version"]), [])
            if worker_id not in workers:
                workers.append(worker_id)
    return {key: tuple(workers) for key, workers in found.items()}


def deploy_check(registry: AgentRegistry, *, using: str = DEFAULT_DB_ALIAS) -> DeployCheck:
    """The runs in flight that the code of ``registry`` does not define, or defines with
    another fingerprint (for the run's model: ``Agent.fingerprint(run.model)``), by agent and
    version: two queries (the aggregate ``pinned_groups``, the live workers)."""
    by_version: dict[tuple[str, str], list[PinnedGroup]] = {}
    defined: dict[tuple[str, str], bool] = {}
    total = 0
    for name, version, model, fingerprint, runs, pending, running, waiting, oldest in pinned_groups(
        using
    ):
        total += runs
        try:
            current: str | None = registry.get(name, version).fingerprint(model)
        except AgentNotFound:
            current = None
        if current == fingerprint:
            continue
        defined[(name, version)] = current is not None
        by_version.setdefault((name, version), []).append(
            PinnedGroup(model, fingerprint, runs, pending, running, waiting, oldest, current)
        )
    definers = live_definers(using) if by_version else {}
    findings = [
        DeployFinding(
            agent=name,
            version=version,
            groups=tuple(groups),
            defined=defined[(name, version)],
            upgraded_by=()
            if defined[(name, version)]
            else _upgraded_by(registry.all(), name, version),
            live_workers=definers.get((name, version), ()),
        )
        for (name, version), groups in sorted(by_version.items())
    ]
    return DeployCheck(total, tuple(findings), len(registry.all()))


def _upgraded_by(agents: Iterable[Any], name: str, version: str) -> tuple[str, ...]:
    return tuple(
        agent.version
        for agent in agents
        if agent.name == name and version in getattr(agent, "upgrades_from", ())
    )
