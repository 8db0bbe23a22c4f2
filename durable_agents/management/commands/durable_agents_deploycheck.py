"""Before a deploy, with the code about to be deployed: the runs in flight that this code does
not define, or defines with another fingerprint, by agent and version
(``observe.fleet.deploy_check``)."""

from __future__ import annotations

import datetime
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import DEFAULT_DB_ALIAS, DatabaseError, connections
from django.utils import timezone

from durable_agents.declare.agents import registry
from durable_agents.observe.fleet import DeployCheck, DeployFinding, deploy_check, short

# Live workers named in a block (the rest are counted).
WORKERS_SHOWN = 5


def _when(value: Any) -> str:
    if value is None:
        return "?"
    age = timezone.now() - value
    days, seconds = age.days, age.seconds
    if days:
        ago = f"{days}d"
    elif seconds >= 3600:
        ago = f"{seconds // 3600}h"
    else:
        ago = f"{max(seconds, 0) // 60}m"
    return f"{value.astimezone(datetime.UTC):%Y-%m-%d %H:%M:%S} UTC, {ago} ago"


def _statuses(finding: DeployFinding) -> str:
    parts = [
        f"{n} {status}"
        for status in ("pending", "running", "waiting")
        if (n := finding.count(status))
    ]
    return ", ".join(parts)


def describe(finding: DeployFinding) -> list[str]:
    """One block: the version, its runs, why this code does not serve them, what will."""
    runs = finding.runs
    lines = [
        f"{finding.label}: {runs} run{'s' if runs != 1 else ''} in flight "
        f"({_statuses(finding)}), the oldest started {_when(finding.oldest)}"
    ]
    if finding.defined:
        for group in finding.groups:
            lines.append(
                f"  defined by this code with another fingerprint: {group.runs} started with "
                f"{short(group.fingerprint)} (model {group.model}), this code has "
                f"{short(group.defined_with or '')}"
            )
    else:
        lines.append("  not defined by this code")
        for new in finding.upgraded_by:
            lines.append(
                "  an agent of this code upgrades them where their history allows: "
                f"{finding.agent}@{new}"
            )
    if finding.live_workers:
        named = ", ".join(finding.live_workers[:WORKERS_SHOWN])
        more = len(finding.live_workers) - WORKERS_SHOWN
        lines.append(
            f"  a live worker still defines it: {named}" + (f" and {more} more" if more > 0 else "")
        )
    else:
        lines.append("  no live worker defines it now")
    if finding.stranded:
        if finding.defined:
            advice = (
                "give the changed agent a new version (keeping this definition until these "
                "runs end), or restore the definition they started with"
            )
        else:
            advice = (
                f"keep {finding.label} defined until these runs end, or name it in the "
                "upgrades_from of a version of this code"
            )
        lines.append(f"  STRANDED: no worker of this code will take them: {advice}")
    return lines


def summary(check: DeployCheck) -> str:
    if not check.findings:
        return (
            f"OK: this code defines the version and fingerprint of every run in flight "
            f"({check.runs_in_flight})."
        )
    return (
        f"{check.runs_in_flight} runs in flight; {check.stranded + check.upgradable} pinned to "
        f"{len(check.findings)} agent version(s) this code does not serve as they started: "
        f"{check.stranded} stranded, {check.upgradable} upgradable."
    )


class Command(BaseCommand):
    help = (
        "With the code about to be deployed: list the runs in flight (pending, running, "
        "waiting) pinned to agent versions this code does not define, or defines with another "
        "fingerprint, by agent and version, saying whether an upgrades_from of this code "
        "covers them and whether a live worker still defines them. Exit status 0, or 1 with "
        "--fail-on-stranded when a run is stranded."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--fail-on-stranded",
            action="store_true",
            help="Exit with status 1 when a run in flight is stranded: pinned to a version "
            "this code does not define and no upgrades_from of it covers, or defined with "
            "another fingerprint.",
        )
        parser.add_argument(
            "--database",
            default=DEFAULT_DB_ALIAS,
            help="The database to read (default: 'default').",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        using = options["database"]
        if using not in connections:
            raise CommandError(f"no database {using!r} in DATABASES")
        try:
            check = deploy_check(registry, using=using)
        except DatabaseError as exc:
            raise CommandError(f"cannot read the runs in flight of {using!r}: {exc}") from None
        if not check.agents_defined:
            self.stderr.write(
                "This code defines no agent (no installed app's agents.py defined one): "
                "every run in flight is stranded by it."
            )
        for finding in check.findings:
            for line in describe(finding):
                self.stdout.write(line)
            self.stdout.write("")
        self.stdout.write(summary(check))
        if options["fail_on_stranded"] and check.stranded:
            raise CommandError(
                f"{check.stranded} run(s) in flight stranded by this code (--fail-on-stranded)",
                returncode=1,
            )
