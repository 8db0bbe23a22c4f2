"""``python manage.py demo``: the migration story, end to end, with a real crash in the middle.

1. Start the migration agent on a migration task and on a few smaller ones.
2. Run a worker process; once the migration run has committed step 6, while the worker waits
   on the model for step 7, SIGKILL it (the pod was rescheduled).
3. Start a fresh worker: it claims the run once the dead worker's lease expires, rebuilds the
   conversation from the step log and goes on at step 8. Nothing committed is redone.
4. The agent asks to drop a table: the run waits until a person approves. The demo plays that
   person (a staff user ``demo-operator``); in production it is the admin's Approve button.
5. Print what happened: statuses, steps per second, and the transcript with the attempt that
   wrote each step.
6. Runs that wait without a worker (agent ``coordinator``): one parks on a 2-second durable
   timer and resumes when a worker's claim finds it due; one fans out to two child runs and
   resumes with their outcomes once both ended; one asks a person a question and is left
   waiting, for you to answer in the admin.
7. Time travel: a run stops at a failed call; a fork of it at that call's result, edited as a
   person would after fixing things by hand, goes on and finishes.
8. Agents on a clock: the schedule ``demo-every-3s``, declared when the demo starts, fires a
   small run every 3 seconds whenever a (non-burst) worker is up; a worker runs for a few
   slots, each slot starts exactly one run (its start key is the schedule's name and the slot
   time), and the schedule is paused at the end (resume it in the admin).

Uses the offline scripted model (the tasks carry the plan it plays): the demo settings turn
it on while DEBUG is on, as in ``make run``; ``DURABLE_AGENTS_OFFLINE=0`` sends the tasks to
the real API instead. The offline model is never tied to a missing API key.

``--rpm N``: the offline model limits requests per minute as the API does, one limit shared
by every worker of the demo (as the API's is by an organisation): it is served over HTTP on
127.0.0.1 and the workers' 429s, waits for ``retry-after`` and retries show in their logs.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import connection
from django.db.models import Count

import durable_agents
from durable_agents import llm
from durable_agents.batches import Submitter, poll_due
from durable_agents.checks import worker_checks
from durable_agents.conf import app_settings
from durable_agents.engine.worker import Worker
from durable_agents.models import (
    CLAIMABLE_STATUSES,
    ENDED_STATUSES,
    AgentBatch,
    AgentRun,
    AgentSchedule,
    AgentStep,
    IntentStatus,
    RunStatus,
    ToolEffect,
    ToolIntent,
    short_id,
    steps_of,
)
from durable_agents.offline import OfflineServer, RateLimits, ScriptedModel

MIGRATION = """Migrate the orders table: add a note column, backfill it, retire orders_old.
@@latency 0.15
@get_schema {"table": "orders"}
@apply_migration_step {"statement": "ALTER TABLE orders ADD COLUMN note text"}
@record_progress {"ticket": "MIG-42", "status": "column added"}
@apply_migration_step {"statement": "UPDATE orders SET note = '' WHERE note IS NULL"}
@get_schema {"table": "orders_old"}
@drop_table {"table": "orders_old"}
@record_progress {"ticket": "MIG-42", "status": "done"}
"""

SMALLER = [
    """Check that the orders table has what the report needs.
@get_schema {"table": "orders"} && get_schema {"table": "customers"}
@record_progress {"ticket": "REP-7", "status": "schema checked"}
""",
    """Backfill the note column in two batches.
@apply_migration_step {"statement": "UPDATE orders SET note = '' WHERE id < 1000"}
@apply_migration_step {"statement": "UPDATE orders SET note = '' WHERE id >= 1000"}
@record_progress {"ticket": "MIG-43", "status": "backfilled"}
""",
]

# Runs of the coordinator agent (project/demo/agents.py) that wait without a worker.
TIMER_SECONDS = 2
TIMER = f"""Let the read replica catch up before the next step, then record it.
@wait_for_replica {{"seconds": {TIMER_SECONDS}}}
@record_progress {{"ticket": "OPS-1", "status": "replica caught up"}}
"""
FAN_OUT = """Survey the orders tables in parallel, then record what they hold.
@survey_tables {"tables": ["orders", "orders_old"]}
@record_progress {"ticket": "OPS-2", "status": "tables surveyed"}
"""
QUESTION_TEXT = "Which maintenance window may the orders migration use?"
QUESTION = f"""Agree on a maintenance window for the orders migration with a person.
@ask_person {{"question": "{QUESTION_TEXT}"}}
@record_progress {{"ticket": "OPS-3", "status": "window agreed"}}
"""

# A run that stops at a failed call (the offline model's @@stop_on_error), then a fork of it
# at that call's result, edited as if a person had run the statement by hand.
ARCHIVE_STATEMENT = "INSERT INTO orders_archive SELECT * FROM orders_old"
ARCHIVE = f"""Copy the old orders into the archive table, then record it on the ticket.
@@stop_on_error
@apply_migration_step {{"statement": "{ARCHIVE_STATEMENT}"}}
@record_progress {{"ticket": "MIG-44", "status": "archived"}}
"""

KILL_AFTER_SEQ = 6
LEASE_SECONDS = "3"
# The demo's schedule: a small run every few seconds while a worker is up.
SCHEDULE_NAME = "demo-every-3s"
SCHEDULE_EVERY = datetime.timedelta(seconds=3)
SCHEDULE_TASK = """Check that the orders table has what the nightly report needs.
@get_schema {"table": "orders"}
"""


class Command(BaseCommand):
    help = "The durable_agents demo: a migration agent killed at step 7 and resumed."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--extra-runs", type=int, default=4, help="smaller runs to add")
        parser.add_argument(
            "--speed-runs", type=int, default=30, help="runs for the closing throughput figure"
        )
        parser.add_argument(
            "--rpm",
            type=int,
            default=None,
            help="the offline model allows this many requests per minute (429s beyond)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        # The story, not the workers' step-by-step log: -v 2 (or DURABLE_AGENTS_LOG_LEVEL)
        # shows every claim, step and tool call of every worker as well.
        self.workers_log_level = os.environ.get(
            "DURABLE_AGENTS_LOG_LEVEL", "INFO" if options["verbosity"] >= 2 else "WARNING"
        )
        for name in ("durable_agents", "project"):
            logging.getLogger(name).setLevel(self.workers_log_level)
        # What the story claims, checked as it goes: a claim that did not hold fails the demo
        # (exit status 1) after the story is told, so that `make run` cannot pass on a broken
        # demo.
        self.broken: list[str] = []
        # The demo's workers would refuse to start without credentials: say so once, here.
        refused = [m for m in worker_checks.run_checks() if m.is_serious()]
        if refused:
            raise CommandError(
                f"{refused[0].msg}\nThe demo runs on the offline scripted model with "
                "DURABLE_AGENTS_OFFLINE=1 (the default of `make run`), or on the API with "
                "ANTHROPIC_API_KEY set."
            )
        self.workers: list[subprocess.Popen] = []
        limits = self._limited_model(options["rpm"]) if options["rpm"] is not None else None
        try:
            self._say(
                f"durable_agents demo on {connection.vendor}, with the "
                + ("offline scripted model (no API key)" if app_settings.OFFLINE else "real API")
            )
            self._story(options)
        finally:
            # An interrupted demo (Ctrl-C, an error) leaves no worker behind on its database.
            for worker in self.workers:
                if worker.poll() is None:
                    worker.kill()
                    worker.wait()
            if limits is not None:
                self._limits_report(limits)
        if self.broken:
            raise CommandError(
                "the demo did not end as it says:\n" + "\n".join(f"- {b}" for b in self.broken)
            )
        self._say(
            "Read every transcript in the admin: make admin (a demo superuser admin / admin, "
            "then http://127.0.0.1:8000/admin/)"
        )

    def _story(self, options: dict[str, Any]) -> None:
        durable_agents.schedule(
            SCHEDULE_NAME, agent="migrator", task=SCHEDULE_TASK, every=SCHEDULE_EVERY
        )
        self._chapter("A migration agent, killed at step 7 and resumed")
        migration = durable_agents.start_run("migrator", MIGRATION)
        extra = [
            durable_agents.start_run("migrator", SMALLER[i % len(SMALLER)])
            for i in range(options["extra_runs"])
        ]
        runs = [migration, *extra]
        self._line(
            f"started {len(runs)} runs of migrator@{migration.prompt_version}; the migration "
            f"run is {migration.pk}"
        )
        started = time.monotonic()

        self._line(
            f"worker 1 starts; it will be SIGKILLed while it waits on the model for step "
            f"{KILL_AFTER_SEQ + 1} of the migration"
        )
        first = self._worker("demo-worker-1")
        while (run := AgentRun.objects.get(pk=migration.pk)).last_seq < KILL_AFTER_SEQ:
            if first.poll() is not None or run.status not in CLAIMABLE_STATUSES:
                break
            time.sleep(0.02)
        if first.poll() is None and run.last_seq >= KILL_AFTER_SEQ:
            first.send_signal(signal.SIGKILL)
            first.wait()
            run = AgentRun.objects.get(pk=migration.pk)
            self._line(
                f"worker 1 killed (SIGKILL) with the migration at step {run.last_seq}: status "
                f"{run.status}, its lease held by a dead worker for up to {LEASE_SECONDS}s more"
            )
        else:
            first.send_signal(signal.SIGKILL)
            first.wait()
            self._expect(False, f"worker 1 was killed at step {KILL_AFTER_SEQ} ({run.status})")

        while not AgentRun.objects.claimable().filter(pk=migration.pk).exists():
            if AgentRun.objects.get(pk=migration.pk).status not in CLAIMABLE_STATUSES:
                break
            time.sleep(0.1)
        self._line(
            "the lease expired (on the database clock; no supervisor noticed anything): worker "
            "2 claims the run, rebuilds the conversation from the step log and goes on at the "
            "first uncommitted step"
        )
        self._worker("demo-worker-2", "--burst").wait()

        pending = list(ToolIntent.objects.filter(status=IntentStatus.PENDING))
        self._expect(len(pending) == 1, f"one intent waits for a person, not {len(pending)}")
        if pending:
            operator = self._operator()
            for intent in pending:
                self._line(
                    f"the agent asks for an irreversible call, {intent.tool}({intent.input}): "
                    f"{operator.get_username()} approves intent #{intent.pk} (in production, "
                    "the admin's Approve button); worker 3 goes on"
                )
                durable_agents.approve_intent(intent.pk, user=operator)
            self._worker("demo-worker-3", "--burst").wait()

        elapsed = time.monotonic() - started
        self._report(runs, migration, elapsed)
        self._long_running()
        self._batched()
        self._time_travel()
        self._on_a_clock()
        self._speed(options["speed_runs"])

    # -- helpers ---------------------------------------------------------------------------

    def _limited_model(self, rpm: int) -> RateLimits:
        """Serve the offline model, limited to ``rpm``, on 127.0.0.1 for every worker of the
        demo (subprocesses included: they inherit the environment) through the real SDK."""
        if not app_settings.OFFLINE:
            raise CommandError("--rpm limits the offline model, which is off")
        try:
            limits = RateLimits(requests_per_minute=rpm)
        except ValueError as e:
            raise CommandError(f"--rpm: {e}") from e
        server = OfflineServer(ScriptedModel(rate_limits=limits)).start()
        os.environ.update(
            ANTHROPIC_BASE_URL=server.base_url,
            ANTHROPIC_API_KEY="offline-demo",
            DURABLE_AGENTS_OFFLINE="0",
        )
        settings.DURABLE_AGENTS = {**settings.DURABLE_AGENTS, "OFFLINE": False}
        llm.reset_clients()
        self._say(
            f"the offline model allows {rpm} requests per minute (a bucket of {rpm} that "
            f"refills continuously) to all workers together, at {server.base_url}"
        )
        return limits

    def _limits_report(self, limits: RateLimits) -> None:
        stats = limits.stats()
        self._say(
            f"rate limits: {stats['answered']} requests answered, {stats['rejected_429']} "
            f"refused with a 429 (each retried after its retry-after), at most "
            f"{stats['peak_in_flight']} in flight at once"
        )

    def _worker(self, name: str, *flags: str) -> subprocess.Popen:
        command = [
            sys.executable,
            str(Path(settings.BASE_DIR) / "manage.py"),
            "runagents",
            "--worker-id",
            name,
            "--lease-seconds",
            LEASE_SECONDS,
            "--poll-interval",
            "0.2",
            *flags,
        ]
        env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": os.environ["DJANGO_SETTINGS_MODULE"],
            "DURABLE_AGENTS_LOG_LEVEL": self.workers_log_level,
        }
        worker = subprocess.Popen(command, env=env)
        self.workers.append(worker)
        return worker

    def _operator(self) -> Any:
        user_model = get_user_model()
        user, _ = user_model.objects.get_or_create(
            username="demo-operator", defaults={"is_staff": True}
        )
        user.user_permissions.add(Permission.objects.get(codename="approve_toolintent"))
        return user_model.objects.get(pk=user.pk)  # a fresh permission cache

    def _chapter(self, title: str) -> None:
        self.chapters = getattr(self, "chapters", 0) + 1
        self.stdout.write(self.style.SUCCESS(f"\n{self.chapters}. {title}"))

    def _line(self, text: str) -> None:
        self.stdout.write(f"   {text}")

    def _say(self, text: str) -> None:
        self.stdout.write(self.style.SUCCESS(f"==> {text}"))

    def _expect(self, holds: bool, claim: str) -> None:
        """One claim of the story; the demo fails at its end if any did not hold."""
        if not holds:
            self.broken.append(claim)
            self.stdout.write(self.style.ERROR(f"   NOT AS EXPECTED: {claim}"))

    def _burst(self) -> None:
        Worker(burst=True, handle_signals=False, poll_interval=0.05).run()

    def _long_running(self) -> None:
        """A timer, a fan-out and a question: runs that wait holding no worker."""
        timer = durable_agents.start_run("coordinator", TIMER)
        fan_out = durable_agents.start_run("coordinator", FAN_OUT)
        question = durable_agents.start_run("coordinator", QUESTION)
        self._chapter(
            f"Runs that wait without a worker (coordinator@{timer.prompt_version}): a "
            f"{TIMER_SECONDS}s timer, a fan-out to two child runs, a question for a person"
        )
        self._burst()

        fan_out.refresh_from_db()
        children = list(AgentRun.objects.filter(parent=fan_out).order_by("spawn_key"))
        self._line(
            f"fan-out: run {fan_out.pk} spawned {len(children)} child runs "
            f"({', '.join(f'{short_id(c.pk)} {c.status}' for c in children)}), waited for them "
            f"without a worker, and resumed with their outcomes: {fan_out.status}"
        )
        self._expect(
            fan_out.status == RunStatus.SUCCEEDED
            and len(children) == 2
            and all(c.status == RunStatus.SUCCEEDED for c in children),
            "the fan-out and its two child runs succeeded",
        )

        timer.refresh_from_db()
        if timer.status == RunStatus.WAITING and timer.wake_at is not None:
            self._line(
                f"timer: run {timer.pk} waits on {timer.get_waiting_for_display()} due at "
                f"{timer.wake_at:%H:%M:%S} (database clock); no worker holds it"
            )
            deadline = time.monotonic() + TIMER_SECONDS + 30
            while not AgentRun.objects.due().filter(pk=timer.pk).exists():
                if time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            # A worker's claim takes due timers first (every POLL_INTERVAL when idle).
            self._burst()
            timer.refresh_from_db()
        self._line(
            f"timer: when it was due, a worker's claim took the run and called the tool again "
            f"with woken_by {json.dumps(timer.woken_by)}: {timer.status}"
        )
        self._expect(timer.status == RunStatus.SUCCEEDED, "the timer run succeeded")

        question.refresh_from_db()
        self._line(
            f"question: run {question.pk} is {question.status}, asking {QUESTION_TEXT!r}; it "
            "is left for you to answer on its admin page, then `python manage.py runagents "
            "--burst`"
        )
        self._expect(question.status == RunStatus.WAITING, "the question run waits")

    def _batched(self) -> None:
        """Three runs in batches: each model turn waits in a Message Batch, answered at half
        the price, and the run goes on when the poller commits the answer."""
        if not app_settings.OFFLINE:
            self._chapter("Runs in batches: skipped (a real batch may take up to a day)")
            return
        runs = [
            durable_agents.start_run("migrator", SMALLER[i % len(SMALLER)], batch=True)
            for i in range(3)
        ]
        self._chapter("Half-price turns: three runs whose model turns go through Message Batches")
        submitter = Submitter("demo-batches")
        deadline = time.monotonic() + 60
        while (
            AgentRun.objects.filter(pk__in=[r.pk for r in runs])
            .exclude(status__in=ENDED_STATUSES)
            .exists()
            and time.monotonic() < deadline
        ):
            # Each run goes on until it needs the model, and parks on its request...
            self._burst()
            # ... the waiting requests of all three go out as one batch, and its answers are
            # committed as the runs' next steps (the offline model ends a batch at once).
            submitter.submit_due(force=True)
            poll_due("demo-batches", force=True)
        batches = list(AgentBatch.objects.order_by("pk"))
        sizes = [b.requests for b in batches]
        for run in runs:
            run.refresh_from_db()
        self._line(
            f"{len(runs)} runs, {sum(sizes)} turns in {len(batches)} batches "
            f"(requests per batch: {', '.join(map(str, sizes))}); no worker held a run while "
            "its turn waited in a batch"
        )
        self._expect(
            all(run.status == RunStatus.SUCCEEDED for run in runs),
            "the three runs in batches succeeded",
        )

    def _time_travel(self) -> None:
        """A run stopped by a failed call, forked at that call's result with the result edited,
        and the fork finished."""
        self._chapter("Time travel: a run stopped at a failed call, forked and finished")
        stopped = durable_agents.start_run("migrator", ARCHIVE)
        # The tool's failure is the point here, not news: its warning line is not shown.
        runner_log = logging.getLogger("durable_agents")
        level = runner_log.level
        runner_log.setLevel(max(level, logging.ERROR))
        try:
            self._burst()
        finally:
            runner_log.setLevel(level)
        stopped.refresh_from_db()
        failed = AgentStep.objects.filter(run_id=stopped.pk, seq=2, kind="tool_result").first()
        if failed is None or not failed.data()[0].get("is_error"):
            self._expect(False, f"run {stopped.pk} stopped at a failed call ({stopped.status})")
            return
        self._line(
            f"run {stopped.pk} stopped at a failed call (step 2: {_summary(failed)}); the "
            f"model said {stopped.result!r}"
        )
        blocks = failed.data()
        edited = [
            {
                "type": "tool_result",
                "tool_use_id": blocks[0]["tool_use_id"],
                "content": json.dumps({"applied": ARCHIVE_STATEMENT, "by": "a person, by hand"}),
            }
        ]
        fork = durable_agents.fork_run(stopped.pk, at_seq=2, edit=edited)
        self._line(
            f"a person ran the statement by hand; fork {fork.pk} of the run at step 2 carries "
            "that result instead of the error (steps 0-1 are shared with the run, byte for "
            "byte: the model's signed thinking is accepted as it was)"
        )
        self._burst()
        fork.refresh_from_db()
        for step in steps_of(fork.pk).order_by("seq"):
            whose = "shared" if step.run_id == stopped.pk else "fork's own"
            self._line(f"  seq {step.seq:>2} {step.kind:<11} {whose:<10} {_summary(step)}")
        self._line(f"the fork {fork.status}: {fork.result!r}; the run it came from is unchanged")
        self._expect(fork.status == RunStatus.SUCCEEDED, "the fork succeeded")

    def _on_a_clock(self) -> None:
        """A worker up for a few of the schedule's slots; each slot's run, then the pause."""
        self._chapter(
            f"Agents on a clock: {SCHEDULE_NAME}, declared at the start, fires a run every "
            f"{SCHEDULE_EVERY.seconds}s while a worker is up (burst workers fire none)"
        )
        worker = self._worker("demo-worker-clock")
        time.sleep(8)
        worker.send_signal(signal.SIGTERM)  # a deploy: it finishes its current steps
        worker.wait()
        # A slot fired just before the SIGTERM may not have been claimed yet: the next worker
        # runs it (a burst worker fires no schedule of its own).
        self._burst()
        fired = list(
            AgentRun.objects.filter(
                agent="migrator", start_key__startswith=f"{SCHEDULE_NAME}@"
            ).order_by("start_key")
        )
        for run in fired:
            slot = datetime.datetime.fromisoformat(run.start_key.split("@", 1)[1])
            late = (run.created_at - slot).total_seconds()
            self._line(
                f"slot {slot:%H:%M:%S} UTC: run {short_id(run.pk)} {run.status}, started "
                f"{late:.2f}s after its slot"
            )
        schedule = AgentSchedule.objects.get(name=SCHEDULE_NAME)
        schedule.enabled = False
        schedule.save(update_fields=["enabled"])
        self._line(
            f"a worker up for 8s, then stopped by SIGTERM, and a burst worker for what it left: "
            f"{len(fired)} slots, one run each; "
            f"{SCHEDULE_NAME} is paused now (resume it on the admin's Agent schedules page)"
        )
        self._expect(len(fired) >= 1, "the schedule fired at least one slot")
        self._expect(
            all(run.status == RunStatus.SUCCEEDED for run in fired),
            "every run of the schedule succeeded",
        )

    def _speed(self, count: int) -> None:
        """Throughput without the story's pauses: short runs, one in-process worker."""
        if count < 1:
            return
        self._chapter("Throughput without the story's pauses")
        quick = [durable_agents.start_run("migrator", SMALLER[1]) for _ in range(count)]
        ids = [r.pk for r in quick]
        before = AgentStep.objects.filter(run_id__in=ids).count()
        started = time.monotonic()
        self._burst()
        elapsed = time.monotonic() - started
        steps = AgentStep.objects.filter(run_id__in=ids).count() - before
        self._line(
            f"{count} runs, {steps} durable steps in {elapsed:.2f}s = {steps / elapsed:.0f} "
            f"steps/s (one worker, {connection.vendor}, offline model)"
        )
        done = AgentRun.objects.filter(pk__in=ids, status=RunStatus.SUCCEEDED).count()
        self._expect(done == count, f"all {count} quick runs succeeded ({done} did)")

    def _report(self, runs: list[AgentRun], migration: AgentRun, elapsed: float) -> None:
        ids = [r.pk for r in runs]
        counts = dict(
            AgentRun.objects.filter(pk__in=ids)
            .order_by()
            .values_list("status")
            .annotate(n=Count("pk"))
            .values_list("status", "n")
        )
        steps = AgentStep.objects.filter(run_id__in=ids).count()
        self._line(
            f"runs by status: {counts}; {steps} steps committed in {elapsed:.1f}s, crash and "
            "approval included"
        )
        self._expect(counts == {RunStatus.SUCCEEDED: len(runs)}, f"all {len(runs)} runs succeeded")
        effects = ToolEffect.objects.filter(run_id__in=ids)
        applied = effects.filter(tool="apply_migration_step").count()
        self._line(
            f"{effects.count()} tool calls recorded, each once (one row per idempotency key); "
            f"{applied} migration statements applied, none twice"
        )
        planned = MIGRATION.count("@apply_migration_step")
        in_migration = effects.filter(run_id=migration.pk, tool="apply_migration_step").count()
        self._expect(
            in_migration == planned,
            f"the migration run applied its {planned} statements once each ({in_migration})",
        )
        self._line(f"the migration run {migration.pk}, step by step:")
        transcript = list(AgentStep.objects.filter(run_id=migration.pk).order_by("seq"))
        for step in transcript:
            who = f"attempt {step.attempt} {step.worker or '(start_run)'}"
            self._line(f"  seq {step.seq:>2} {step.kind:<11} {who:<28} {_summary(step)}")
        resumed = [s for s in transcript if s.seq > KILL_AFTER_SEQ]
        self._expect(
            bool(resumed) and all(s.attempt > 1 for s in resumed),
            "the steps after the kill were written by a later attempt",
        )
        self._expect(
            [s.seq for s in transcript] == list(range(len(transcript))),
            "the transcript has no gap and no step twice",
        )


def _summary(step: AgentStep) -> str:
    data = step.data()
    if step.kind == "task":
        return data.splitlines()[0][:60]
    if step.kind == "model_turn":
        calls = [b["name"] for b in data.get("content", []) if b.get("type") == "tool_use"]
        return f"[{data.get('stop_reason')}] " + (
            f"calls {', '.join(calls)}" if calls else repr(_text(data)[:50])
        )
    return "; ".join(
        ("ERROR " if b.get("is_error") else "") + str(b.get("content"))[:60] for b in data
    )


def _text(message: dict[str, Any]) -> str:
    return " ".join(
        b.get("text", "") for b in message.get("content", []) if b.get("type") == "text"
    )
