"""Re-encrypt every encrypted column under the first key of ENCRYPTION_KEYS
(housekeeping/rekey.py)."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from durable_agents._internal import encryption
from durable_agents.housekeeping.rekey import (
    DEFAULT_BATCH,
    Column,
    Tally,
    count_stale,
    encrypted_columns,
    rotate_column,
)


class Command(BaseCommand):
    help = (
        "Encrypt every row of the encrypted columns that is not under the first key of "
        "ENCRYPTION_KEYS (older keys, plain text), in batches; safe while workers run, and "
        "resumable. --new-key prints a fresh key; --dry-run only counts."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--new-key",
            action="store_true",
            help="Print a new key (32 random bytes, urlsafe base64) and exit.",
        )
        parser.add_argument(
            "--dry-run", action="store_true", help="Count the rows to rewrite; change nothing."
        )
        parser.add_argument(
            "--batch-size",
            type=int,
            default=DEFAULT_BATCH,
            help=f"Rows per transaction (default {DEFAULT_BATCH}).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        if options["new_key"]:
            self.stdout.write(encryption.new_key())
            return
        if options["batch_size"] < 1:
            raise CommandError("--batch-size must be at least 1.")
        try:
            ring = encryption.keyring()
        except encryption.InvalidKey as exc:
            raise CommandError(f"{exc} (manage.py check says more).") from None
        if ring is None:
            raise CommandError(
                "DURABLE_AGENTS['ENCRYPTION_KEYS'] is empty: there is no key to encrypt under."
            )
        if ring.first is None:
            self.stdout.write("first entry None: encrypted rows are written back as plain text")
        else:
            self.stdout.write(f"first key: id {ring.first.id}")
        columns = encrypted_columns()
        if options["dry_run"]:
            self._count(columns, ring)
            return
        unreadable = 0
        for column in columns:
            tally = rotate_column(column, ring, options["batch_size"], self._progress)
            self.stdout.write(
                f"{column.label}: done, {tally.rewritten} rewritten, {tally.changed} changed "
                "meanwhile (left as written)"
            )
            for reason, rows in tally.unreadable.items():
                self.stderr.write(f"{column.label}: {rows} rows not rewritten: {reason}")
                unreadable += rows
        if unreadable:
            raise CommandError(
                f"{unreadable} rows could not be decrypted: add the key they name to "
                "ENCRYPTION_KEYS and run this again."
            )

    def _count(self, columns: list[Column], ring: encryption.Keyring) -> None:
        total = 0
        for column in columns:
            stale = count_stale(column, ring)
            total += stale
            self.stdout.write(f"{column.label}: {stale} rows to rewrite")
        self.stdout.write(f"{total} rows to rewrite in all (dry run: nothing changed)")

    def _progress(self, column: Column, tally: Tally) -> None:
        self.stdout.write(f"{column.label}: {tally.rewritten} rewritten so far", ending="\n")
        self.stdout.flush()
