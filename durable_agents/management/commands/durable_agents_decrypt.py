"""Read encrypted columns in plain text, for incidents: values pasted from SQL, or a run's log."""

from __future__ import annotations

import sys
import uuid
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from durable_agents._internal import encryption
from durable_agents.housekeeping.rekey import encrypted_columns
from durable_agents.logging import escape_controls
from durable_agents.models import steps_of


class Command(BaseCommand):
    help = (
        "Decrypt values of an encrypted column read with SQL (--column agent_step.payload "
        "VALUE..., or one value a line on stdin), or print a run's steps in plain text (--run "
        "ID). Needs the key in ENCRYPTION_KEYS; prints customers' data: mind where it goes."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("values", nargs="*", help="stored values (default: stdin)")
        parser.add_argument("--column", help="the column the values come from, as table.column")
        parser.add_argument("--run", help="print this run's steps: seq, kind, payload")

    def handle(self, *args: Any, **options: Any) -> None:
        if options["run"]:
            self._run(options["run"])
            return
        labels = [column.label for column in encrypted_columns()]
        if options["column"] not in labels:
            raise CommandError(f"--column must be one of: {', '.join(labels)}.")
        values = options["values"] or [line.rstrip("\n") for line in sys.stdin]
        for value in values:
            try:
                # Escaped as the log lines are: a model's or a customer's text may hold
                # terminal escapes (retitle the window, clear the screen, fake a prompt), and
                # a newline would make one value read as two.
                self.stdout.write(escape_controls(encryption.unseal(value, options["column"])))
            except encryption.UndecryptableValue as exc:
                raise CommandError(str(exc)) from None

    def _run(self, run_id: str) -> None:
        try:
            pk = uuid.UUID(run_id)
        except ValueError:
            raise CommandError(f"{run_id!r} is not a run id") from None
        steps = steps_of(pk).order_by("seq")
        try:
            rows = list(steps.values_list("seq", "kind", "payload"))
        except encryption.UndecryptableValue as exc:
            raise CommandError(str(exc)) from None
        if not rows:
            raise CommandError(f"no steps for run {run_id!r}")
        for seq, kind, payload in rows:
            self.stdout.write(escape_controls(f"{seq}\t{kind}\t{payload}"))
