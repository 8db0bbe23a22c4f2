"""``python manage.py demo_admin``: the demo's database made ready for a look at the admin
(``make admin``, which then starts ``runserver``).

1. A superuser ``admin`` with the password ``admin``, for the local demo only: the command
   refuses to run with DEBUG off. It has no e-mail address, so no notification is mailed to it.
2. Something to act on, each started only if the database holds none yet, so running the
   command again adds nothing (``make run`` already leaves a run waiting on a question):
   - a pending intent: a migrator run that asks to drop a table waits for Approve or Reject;
   - a dead run: a run pinned to a retired model, which the API answers with a 404, is in the
     dead letter with that reason (Requeue, or Cancel);
   - a waiting run: a coordinator run that asks a person a question (Answer on its page).

Runs are started with ``durable_agents.start_run`` and taken as far as they go by one
in-process worker in burst mode, on the offline scripted model (the demo settings turn it on
while DEBUG is on); no status is written directly.
"""

from __future__ import annotations

import logging
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db.models import QuerySet
from django.urls import reverse

import durable_agents
from durable_agents.engine.worker import Worker
from durable_agents.models import AgentRun, IntentStatus, RunStatus, ToolIntent, WaitKind
from project.demo.management.commands.demo import QUESTION

USERNAME = "admin"
PASSWORD = "admin"
# Where `make admin` starts runserver.
SERVER = "http://127.0.0.1:8000"

# A run that stops at an irreversible call: its intent waits for a person.
DROP_ARCHIVE = """Retire the orders_archive table: read its schema, then drop it.
@get_schema {"table": "orders_archive"}
@drop_table {"table": "orders_archive"}
@record_progress {"ticket": "MIG-44", "status": "archive dropped"}
"""
# A real model id the API no longer serves (the offline model answers it with the same 404).
RETIRED_MODEL = "claude-3-sonnet-20240229"
ON_RETIRED_MODEL = """Summarise the orders table for the wiki.
@get_schema {"table": "orders"}
"""


class Command(BaseCommand):
    help = (
        "The admin demo: a superuser admin/admin (local demo only), a pending intent, a dead "
        "run and a waiting run in the demo's database."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--server", default=SERVER, help=f"the address runserver serves (default {SERVER})"
        )

    def handle(self, *args: Any, **options: Any) -> None:
        if not settings.DEBUG:
            raise CommandError(
                f"demo_admin creates a superuser {USERNAME!r} with the password {PASSWORD!r}: it "
                "is for the local demo only and refuses to run with DEBUG off"
            )
        created = self._superuser()
        started = self._start_missing()
        if started:
            # Take the new runs as far as they go: to the intent, the dead letter, the question.
            logging.getLogger("durable_agents").setLevel(logging.WARNING)
            Worker(burst=True, handle_signals=False, poll_interval=0.05).run()
        self._report(created, started, options["server"].rstrip("/"))

    def _superuser(self) -> bool:
        user_model = get_user_model()
        user = user_model._default_manager.filter(**{user_model.USERNAME_FIELD: USERNAME}).first()
        if user is None:
            user_model._default_manager.create_superuser(USERNAME, "", PASSWORD)
            return True
        changed = not (user.is_active and user.is_staff and user.is_superuser)
        user.is_active = user.is_staff = user.is_superuser = True
        if not user.check_password(PASSWORD):
            user.set_password(PASSWORD)
            changed = True
        if changed:
            user.save()
        return False

    def _start_missing(self) -> list[AgentRun]:
        started = []
        if not _pending_intents().exists():
            started.append(durable_agents.start_run("migrator", DROP_ARCHIVE))
        if not AgentRun.objects.filter(status=RunStatus.DEAD).exists():
            started.append(
                durable_agents.start_run("migrator", ON_RETIRED_MODEL, model=RETIRED_MODEL)
            )
        if not _question_runs().exists():
            started.append(durable_agents.start_run("coordinator", QUESTION))
        return started

    def _report(self, created: bool, started: list[AgentRun], base: str) -> None:
        say = self.stdout.write
        say(
            self.style.SUCCESS(
                f"demo superuser: {USERNAME} / {PASSWORD} "
                f"({'created' if created else 'already there'}); for the local demo only, "
                "never on a shared or public host"
            )
        )
        if started:
            say(f"started {len(started)} run(s) for the admin to act on")
        missing = []
        intent = _pending_intents().order_by("created_at", "pk").first()
        if intent is None:
            missing.append("a pending intent")
        else:
            path = reverse("admin:durable_agents_toolintent_change", args=[intent.pk])
            say(
                f"  pending intent #{intent.pk} ({intent.tool}), approve or reject it: {base}{path}"
            )
        dead = AgentRun.objects.filter(status=RunStatus.DEAD).order_by("created_at").first()
        if dead is None:
            missing.append("a dead run")
        else:
            reason = _first_line(dead.error)
            say(f"  dead run ({reason}), requeue or cancel it: {_run_url(base, dead)}")
        waiting = _question_runs().order_by("created_at").first()
        if waiting is None:
            missing.append("a run waiting on a question")
        else:
            say(
                f"  waiting run (on {waiting.get_waiting_for_display()}): {_run_url(base, waiting)}"
            )
        if missing:
            self.stderr.write(
                f"missing: {', '.join(missing)}; is the offline model on "
                "(DURABLE_AGENTS_OFFLINE=1, the default with DEBUG on)?"
            )
        say(
            self.style.SUCCESS(
                f"the admin: {base}{reverse('admin:index')} (log in as {USERNAME} / {PASSWORD})"
            )
        )


def _pending_intents() -> QuerySet[ToolIntent]:
    return ToolIntent.objects.filter(status=IntentStatus.PENDING)


def _question_runs() -> QuerySet[AgentRun]:
    return AgentRun.objects.filter(status=RunStatus.WAITING, waiting_for=WaitKind.QUESTION)


def _run_url(base: str, run: AgentRun) -> str:
    return base + reverse("admin:durable_agents_agentrun_change", args=[run.pk])


def _first_line(text: str | None, limit: int = 120) -> str:
    line = (text or "").strip().split("\n", 1)[0]
    return line if len(line) <= limit else line[: limit - 1] + "…"
