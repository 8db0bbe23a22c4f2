"""Replay recorded runs to today's tool code: a regression test against real transcripts."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from durable_agents.forks.replay import ReplayError, replay


class Command(BaseCommand):
    help = (
        "Play each run's recorded tool calls to the agent's current tool code (no model call, "
        "nothing written) and print what now differs or raises. Exit status 1 if any call "
        "differs or raises. non_idempotent and irreversible tools are skipped unless named "
        "with --allow-effects."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("run_ids", nargs="+", metavar="RUN_ID")
        parser.add_argument(
            "--allow-effects",
            nargs="+",
            default=[],
            metavar="TOOL",
            help="non_idempotent or irreversible tools that may be called again",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        reports = []
        for run_id in options["run_ids"]:
            try:
                reports.append(replay(run_id, allow_effects=options["allow_effects"]))
            except ReplayError as exc:
                raise CommandError(str(exc)) from None
        for report in reports:
            self.stdout.write(str(report))
        if not all(report.ok for report in reports):
            raise SystemExit(1)
