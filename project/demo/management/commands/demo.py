"""``python manage.py demo``: start the migration agent on a few tasks and run them to the end.

Uses whatever model the settings give: the offline scripted model when no API key is set.
The irreversible ``drop_table`` call parks its run until a person approves; the demo plays
that person (a staff user ``demo-operator`` with the approve permission) so that every run
finishes, then prints what happened.
"""

from __future__ import annotations

import time
from typing import Any

from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.core.management.base import BaseCommand, CommandParser
from django.db.models import Count

import durable_agents
from durable_agents.models import AgentRun, AgentStep, IntentStatus, ToolIntent
from durable_agents.worker import Worker

MIGRATION = """Migrate the orders table: add a note column, then retire orders_old.
@get_schema {"table": "orders"}
@apply_migration_step {"statement": "ALTER TABLE orders ADD COLUMN note text"}
@record_progress {"ticket": "MIG-42", "status": "column added"}
@get_schema {"table": "orders_old"}
@drop_table {"table": "orders_old"}
@record_progress {"ticket": "MIG-42", "status": "done"}
"""

INSPECTION = """Check that the orders table has what the report needs.
@get_schema {"table": "orders"} && get_schema {"table": "customers"}
@record_progress {"ticket": "REP-7", "status": "schema checked"}
"""

BACKFILL = """Backfill the note column in two batches.
@apply_migration_step {"statement": "UPDATE orders SET note = '' WHERE id < 1000"}
@apply_migration_step {"statement": "UPDATE orders SET note = '' WHERE id >= 1000"}
@record_progress {"ticket": "MIG-43", "status": "backfilled"}
"""


class Command(BaseCommand):
    help = "Run the durable_agents demo: a migration agent, offline unless an API key is set."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--runs", type=int, default=6, help="how many demo runs to start")

    def handle(self, *args: Any, **options: Any) -> None:
        tasks = [MIGRATION, INSPECTION, BACKFILL]
        runs = [
            durable_agents.start_run("migrator", tasks[i % len(tasks)])
            for i in range(options["runs"])
        ]
        self.stdout.write(f"started {len(runs)} runs of migrator; running a worker\n")

        started = time.monotonic()
        steps_before = AgentStep.objects.count()
        Worker(burst=True).run()

        pending = list(ToolIntent.objects.filter(status=IntentStatus.PENDING))
        if pending:
            operator = self._operator()
            self.stdout.write(
                f"\n{len(pending)} irreversible call(s) wait for approval; "
                f"approving as {operator.get_username()} (in production: the admin)\n"
            )
            for intent in pending:
                self.stdout.write(f"  approve #{intent.pk}: {intent.tool}({intent.input})\n")
                durable_agents.approve_intent(intent.pk, operator)
            Worker(burst=True).run()
        elapsed = time.monotonic() - started
        steps = AgentStep.objects.count() - steps_before

        counts = dict(
            AgentRun.objects.filter(pk__in=[r.pk for r in runs])
            .values_list("status")
            .annotate(n=Count("pk"))
            .values_list("status", "n")
        )
        self.stdout.write(f"\nruns by status: {counts}")
        self.stdout.write(
            f"{steps} steps committed in {elapsed:.2f}s ({steps / elapsed:.0f} steps/s, "
            "approval pause included)"
        )
        sample = runs[0]
        self.stdout.write(f"\ntranscript of run {sample.pk}:")
        for step in AgentStep.objects.filter(run_id=sample.pk).order_by("seq"):
            self.stdout.write(f"  seq {step.seq:>2} {step.kind:<11} {_summary(step)}")
        self.stdout.write(
            "\nOpen the admin (python manage.py createsuperuser; python manage.py runserver) "
            "to read every transcript."
        )

    def _operator(self) -> Any:
        user_model = get_user_model()
        user, _ = user_model.objects.get_or_create(
            username="demo-operator", defaults={"is_staff": True}
        )
        user.user_permissions.add(Permission.objects.get(codename="approve_toolintent"))
        return user_model.objects.get(pk=user.pk)  # fresh permission cache


def _summary(step: AgentStep) -> str:
    data = step.data()
    if step.kind == "task":
        return data.splitlines()[0]
    if step.kind == "model_turn":
        parts = []
        for block in data.get("content", []):
            if block.get("type") == "tool_use":
                parts.append(f"calls {block['name']}")
            elif block.get("type") == "text":
                parts.append(repr(block["text"][:60]))
        return f"[{data.get('stop_reason')}] " + ", ".join(parts)
    return "; ".join(
        ("ERROR " if b.get("is_error") else "") + str(b.get("content"))[:70] for b in data
    )
