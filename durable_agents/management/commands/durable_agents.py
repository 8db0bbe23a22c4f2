"""``manage.py durable_agents <subcommand>``: the operations of the admin from a shell. This
module only parses the arguments; ``durable_agents.cli`` does the work."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from durable_agents import api
from durable_agents._internal import encryption
from durable_agents.cli import decisions, listing, lookup
from durable_agents.cli.formatting import Output, json_document
from durable_agents.models import IntentStatus

DEFAULT_LIMIT = 50
DEFAULT_STEPS = 20
# The longest reason of a rejection, as the admin's form takes it.
MAX_REASON_CHARS = 5_000


class Command(BaseCommand):
    help = (
        "Operate durable_agents from a shell: list runs, show one with its transcript, cancel "
        "or requeue runs, list intents and approve or reject them as a named user (audited as "
        "in the admin), list workers. Every subcommand takes --json for scripts."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        subcommands = parser.add_subparsers(dest="subcommand", metavar="SUBCOMMAND")
        subcommands.required = True

        def add(name: str, help_text: str) -> CommandParser:
            sub: CommandParser = subcommands.add_parser(name, help=help_text, description=help_text)
            sub.add_argument(
                "--json", action="store_true", help="print one JSON document on stdout"
            )
            return sub

        runs = add("runs", "The newest runs, filtered.")
        runs.add_argument(
            "--status",
            action="append",
            metavar="STATUS",
            help="only runs in this status (repeatable)",
        )
        runs.add_argument("--agent", help="only runs of this agent")
        runs.add_argument("--key", help="only the run started with this start key")
        runs.add_argument(
            "--metadata",
            action="append",
            metavar="KEY=VALUE",
            help="only runs whose metadata holds this (repeatable; the value is JSON when it "
            "parses, else a string)",
        )
        runs.add_argument(
            "--since", help="only runs created since: an ISO 8601 time, or 90m, 2h, 3d, 1w"
        )
        runs.add_argument(
            "--limit", type=int, default=DEFAULT_LIMIT, help=f"at most N runs ({DEFAULT_LIMIT})"
        )

        show = add("show", "A run's header and its transcript.")
        show.add_argument("run", metavar="RUN", help="a run id, or its short id")
        how_many = show.add_mutually_exclusive_group()
        how_many.add_argument(
            "--steps",
            type=int,
            default=DEFAULT_STEPS,
            help=f"the last N steps ({DEFAULT_STEPS})",
        )
        how_many.add_argument("--all", action="store_true", help="every step")

        for name, what in (("cancel", "Cancel runs"), ("requeue", "Requeue dead runs")):
            sub = add(name, f"{what} (every id is checked before any run changes).")
            sub.add_argument("runs", nargs="+", metavar="RUN", help="run ids, or short ids")
            sub.add_argument(
                "--user",
                metavar="USERNAME",
                help="audit the change as this user's (who needs durable_agents.change_agentrun)",
            )

        intents = add("intents", "Tool intents: those waiting for a person first.")
        intents.add_argument(
            "--status",
            action="append",
            metavar="STATUS",
            help="only intents in this status (repeatable): "
            + ", ".join(status.value for status in IntentStatus),
        )
        intents.add_argument(
            "--limit",
            type=int,
            default=DEFAULT_LIMIT,
            help=f"at most N intents ({DEFAULT_LIMIT})",
        )

        approve = add("approve", "Approve a pending intent as a user who may.")
        approve.add_argument("intent", metavar="INTENT", help="the intent's id")
        approve.add_argument("--user", required=True, metavar="USERNAME", help="who decides")

        reject = add("reject", "Reject a pending intent as a user who may, saying why.")
        reject.add_argument("intent", metavar="INTENT", help="the intent's id")
        reject.add_argument("--user", required=True, metavar="USERNAME", help="who decides")
        reject.add_argument("--reason", required=True, help="why (the model reads it)")

        add("workers", "The worker rows: live and gone workers, what they hold and define.")

    def handle(self, *args: Any, **options: Any) -> None:
        output = self.run_subcommand(options["subcommand"], options)
        if options["json"]:
            self.stdout.write(json_document(output.document))
        else:
            for line in output.lines:
                self.stdout.write(line)
        if output.failure:
            raise CommandError(output.failure, returncode=1)

    def run_subcommand(self, name: str, options: dict[str, Any]) -> Output:
        if name in ("runs", "show", "intents", "workers"):
            # Read only: a value whose key is gone reads as "[cannot decrypt: ...]".
            with encryption.shown():
                return self.read(name, options)
        if name in ("cancel", "requeue"):
            runs = lookup.runs_named(options["runs"])
            user = None
            if options["user"] is not None:
                doing = "cancelling runs" if name == "cancel" else "requeueing runs"
                user = lookup.operator(options["user"], decisions.OPERATE_PERMISSION, doing)
            operate = decisions.cancel if name == "cancel" else decisions.requeue
            return operate(runs, user=user)
        intent_id = lookup.intent_id(options["intent"])
        approve = name == "approve"
        reason = "" if approve else _reason(options["reason"])
        user = lookup.operator(
            options["user"], api.APPROVE_PERMISSION, "approving" if approve else "rejecting"
        )
        return decisions.decide(intent_id, user, approve=approve, reason=reason)

    def read(self, name: str, options: dict[str, Any]) -> Output:
        if name == "runs":
            return listing.list_runs(
                statuses=lookup.run_statuses(options["status"]),
                agent=options["agent"],
                key=options["key"],
                metadata=lookup.metadata_pairs(options["metadata"]),
                since=lookup.since(options["since"]),
                limit=lookup.positive(options["limit"], "--limit"),
            )
        if name == "show":
            run = lookup.run_named(options["run"])
            steps = None if options["all"] else lookup.positive(options["steps"], "--steps")
            return listing.show_run(run, steps=steps)
        if name == "intents":
            return listing.list_intents(
                statuses=lookup.intent_statuses(options["status"]),
                limit=lookup.positive(options["limit"], "--limit"),
            )
        return listing.list_workers()


def _reason(text: str) -> str:
    if not text.strip():
        raise CommandError("--reason cannot be empty: the model reads it, and you are named")
    if "\x00" in text:
        raise CommandError("--reason cannot hold a NUL character")
    if len(text) > MAX_REASON_CHARS:
        raise CommandError(
            f"--reason has at most {MAX_REASON_CHARS} characters; this one has {len(text)}"
        )
    return text
