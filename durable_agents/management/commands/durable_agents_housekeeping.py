"""Run durable_agents' housekeeping once: the cron alternative to the django-q2 schedules."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from durable_agents.housekeeping import sweeps as housekeeping


class Command(BaseCommand):
    help = "Sweep runs pinned to retired models or undeployed prompts, apply retention, "
    help += "store a metrics snapshot, and send the webhook deliveries that are due. With no "
    help += "flag, all four."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--sweep", action="store_true")
        parser.add_argument("--retention", action="store_true")
        parser.add_argument("--metrics", action="store_true")
        parser.add_argument("--webhooks", action="store_true")

    def handle(self, *args: Any, **options: Any) -> None:
        chosen = ("sweep", "retention", "metrics", "webhooks")
        everything = not any(options[name] for name in chosen)
        if everything or options["sweep"]:
            self.stdout.write(f"sweep: {housekeeping.sweep()}")
        if everything or options["retention"]:
            self.stdout.write(f"retention: {housekeeping.apply_retention()} runs deleted")
        if everything or options["metrics"]:
            self.stdout.write(f"metrics: snapshot {housekeeping.snapshot_metrics()} stored")
        if everything or options["webhooks"]:
            self.stdout.write(f"webhooks: {housekeeping.deliver_webhooks()}")
