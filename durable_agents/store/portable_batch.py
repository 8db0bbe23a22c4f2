"""Many keyed runs created in a few statements (the slots of a firing of schedules). A mixin of
``PortableStore``; ``PostgresStore`` inherits it."""

from __future__ import annotations

from collections.abc import Sequence

from django.db import transaction

from durable_agents.models import AgentRun, AgentStep, StepKind
from durable_agents.store.key_rows import take_turn


class PortableBatch:
    def create_runs(self, runs: Sequence[tuple[AgentRun, str]]) -> list[AgentRun]:
        """``create_run`` of each ``(run, task payload)``, every run with a start key: one
        INSERT of the runs that skips those whose key their agent has used already (ON
        CONFLICT DO NOTHING on ``agent_run_start_key``: race-free as ``create_run``), one read
        of the runs of those keys, one INSERT of the new runs' task steps. Returns the run of
        each key as stored, in order: the new one, or the one that had the key."""
        if not runs:
            return []
        if any(run.start_key is None for run, _ in runs):
            raise ValueError("create_runs creates keyed runs only")
        with transaction.atomic():
            for run, _ in runs:
                if run.concurrency_key is not None:
                    run.fair_at = take_turn(run.concurrency_key)
            AgentRun.objects.bulk_create([run for run, _ in runs], ignore_conflicts=True)
            stored = {
                (row.agent, row.start_key): row
                for row in AgentRun.objects.filter(
                    start_key__in={run.start_key for run, _ in runs},
                    agent__in={run.agent for run, _ in runs},
                ).order_by()
            }
            AgentStep.objects.bulk_create(
                AgentStep(run_id=run.pk, seq=0, kind=StepKind.TASK, payload=payload)
                for run, payload in runs
                if stored[(run.agent, run.start_key)].pk == run.pk
            )
        return [stored[(run.agent, run.start_key)] for run, _ in runs]
