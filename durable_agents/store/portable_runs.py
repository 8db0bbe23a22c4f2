"""Creating a run through the ORM: the insert that a start key makes race-free (once per
(agent, start key)), and a keyed run's turn. ``PortableStore.create_run`` and
``PostgresStore.create_run`` are this; ``portable_debounce`` inserts its run with it.

    create_run   agent_run (pending) + agent_step seq 0 (the task), one transaction
    insert_run   the run alone, or the run of its agent and start key as stored
"""

from __future__ import annotations

from django.db import IntegrityError, transaction

from durable_agents.models import AgentRun, AgentStep, StepKind
from durable_agents.store import key_rows


def take_turn(run: AgentRun) -> None:
    """A keyed run's turn among the runs of its priority (``fair_at``), taken just before its
    insert; a run without a key has its creation as its turn (the database default)."""
    if run.concurrency_key is not None:
        run.fair_at = key_rows.take_turn(run.concurrency_key)


def create_run(run: AgentRun, task_payload: str) -> AgentRun:
    """``Store.create_run``: ``run`` and its task as step 0, together (``insert_run``)."""
    with transaction.atomic():
        started = insert_run(run)
        if started is not None:
            return started
        AgentStep.objects.create(run=run, seq=0, kind=StepKind.TASK, payload=task_payload)
    run.refresh_from_db()
    return run


def insert_run(run: AgentRun) -> AgentRun | None:
    """Insert ``run``; None. A run with a start key whose agent has a run with that key
    already is not inserted: that run is returned, as stored.

    Race-free through the unique index ``agent_run_start_key``: on PostgreSQL a
    concurrent caller's INSERT waits on the index entry until the first caller commits,
    then fails, here inside a savepoint, and the next statement sees the first caller's
    committed run (READ COMMITTED). On SQLite the IMMEDIATE transaction makes the read
    and the insert one exclusive step already. The read comes first because a retry,
    long after the first call, is the common case: it costs one indexed read, not a
    failed INSERT (and the error line that it leaves in PostgreSQL's log)."""
    if run.start_key is None:
        take_turn(run)
        run.save(force_insert=True)
        return None
    # Unordered: the pair is unique (an ORDER BY would only tempt the planner away from
    # agent_run_start_key).
    same_key = AgentRun.objects.filter(agent=run.agent, start_key=run.start_key).order_by()
    started = next(iter(same_key[:1]), None)
    if started is not None:
        return started
    take_turn(run)
    try:
        with transaction.atomic():  # a savepoint: the transaction goes on after a loss
            run.save(force_insert=True)
    except IntegrityError:
        started = next(iter(same_key[:1]), None)
        if started is None:  # another constraint refused the run
            raise
        return started
    return None
