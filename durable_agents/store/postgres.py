"""``PostgresStore``: the hot paths of the store as single statements, on the database clock.

The life of a run, and what moves it along on PostgreSQL:

    claim        CLAIM_SQL              lock the claimable runs, admit them within their
                                        concurrency keys' limits, lease them, attempt + 1
    renew        RENEW_ALL_SQL          the heartbeat: every lease of a worker, one statement
    append_step  APPEND_STEP_SQL        fence, renewed lease and the step, one statement
                                        (its tool effects too: APPEND_STEP_WITH_EFFECTS_SQL;
                                        a model turn counted in the rollup: APPEND_TURN_SQL)
    finish       APPEND_LAST_STEP_SQL   the last step ends the run (and _WITH_EFFECTS_SQL,
                                        APPEND_LAST_TURN_SQL);
                 FINISH_AND_CLAIM_SQL   the same, and the claim of the worker's next run
                                        (FINISH_TURN_AND_CLAIM_SQL for a model turn)
    unstored     UNSTORED_TURN_SQL      a paid turn whose commit failed still counts
    debounce     DEBOUNCE_SQL           a later start of a debounced run: its quiet window
                                        starts again, with the call's task (the first
                                        start, or a late one: PortableStore)
    release      PortableStore          the claim given back, the run pending again
    park         PortableStore          the run waits: on an approval, a timer, an event, an
                                        answer or its children; START_INTENT_SQL starts an
                                        approved tool call under the fence
    wake         CLAIM_SQL (due)        a due timer or timeout, or the end of a debounced
                                        start's quiet window: the claim takes the run;
                 PortableStore          an event, an answer, a child's end: pending again

The statements are composed from named fragments: those of the claim are in
store/postgres_claims.py with its statements, ``CLAIMABLE_RUNS`` (the runs a claim may take),
``ADMITTED`` (those of them their concurrency keys leave room for, race-free:
store/concurrency.py) and ``TAKE_CLAIMABLE_RUNS`` (the lease a claim sets); those of a step
are below, ``FENCE`` (what every write of a claim carries), ``FENCED_STEP`` and ``FENCED_LAST_STEP``
(what a step does to its run), ``RECORD_EFFECTS``, ``RECORD_USAGE`` (the daily rollup of
model turns) and ``STEP_INSERT``. The full text of every statement, exactly as it is sent,
is in tests/sql/<NAME>.sql, one file per statement; tests/unit/test_postgres_statements.py
fails when what runs differs from those files by a byte (``UPDATE_SQL_SNAPSHOTS=1`` rewrites
them after a deliberate change). The only formatting at run time is the VALUES list of the
effects (``{rows}``: one placeholder tuple per effect).

The other operations (release, park, wake, decisions, a finish without a step) are the ORM
updates of ``PortableStore``, which this class inherits: one UPDATE each on PostgreSQL too.
"""

from __future__ import annotations

import datetime
import functools
import textwrap
from collections.abc import Mapping, Sequence
from decimal import Decimal
from typing import Any

from django.db import DataError, connection
from django.db.backends.base.base import BaseDatabaseWrapper

from durable_agents._internal import encryption
from durable_agents._internal.text import storable_text
from durable_agents.flow.pricing import Usage
from durable_agents.models import (
    STEP_PAYLOAD,
    AgentEvent,
    AgentQuestion,
    AgentRun,
    AgentSchedule,
    IntentStatus,
    ToolEffect,
    ToolIntent,
    WaitKind,
)
from durable_agents.store import (
    key_rows,
    portable_batch,
    portable_logs,
    portable_runs,
    postgres_claims,
    postgres_debounce,
    postgres_schedules,
)
from durable_agents.store.base import (
    AuthUser,
    Claim,
    ForkWrite,
    LeaseLoss,
    LogRow,
    NextClaim,
    Parked,
    RunId,
    StepTuple,
    StepWrite,
    Store,
    WaitSpec,
)
from durable_agents.store.portable import PortableStore

# The claim's statements and fragments, importable from here as before (tests/sql/ pins
# every statement; the tests check the fragments, _FREED too; the benchmarks run the claim).
from durable_agents.store.postgres_claims import _FREED as _FREED
from durable_agents.store.postgres_claims import ADMITTED as ADMITTED
from durable_agents.store.postgres_claims import CLAIM_SQL as CLAIM_SQL
from durable_agents.store.postgres_claims import CLAIMABLE_RUNS as CLAIMABLE_RUNS
from durable_agents.store.postgres_claims import (
    CLAIMABLE_RUNS_IF_FENCED as CLAIMABLE_RUNS_IF_FENCED,
)
from durable_agents.store.postgres_claims import CLAIMABLE_SQL as CLAIMABLE_SQL
from durable_agents.store.postgres_claims import KEY_LIMIT as KEY_LIMIT
from durable_agents.store.postgres_claims import RENEW_ALL_SQL as RENEW_ALL_SQL
from durable_agents.store.postgres_claims import TAKE_CLAIMABLE_RUNS as TAKE_CLAIMABLE_RUNS
from durable_agents.store.postgres_claims import binding_cursor as binding_cursor
from durable_agents.store.postgres_claims import key_limits as key_limits
from durable_agents.store.postgres_debounce import (
    DEBOUNCE_SQL as DEBOUNCE_SQL,  # one of this store's statements, pinned in tests/sql/ too
)
from durable_agents.store.postgres_schedules import (  # pinned in tests/sql/ too
    FIRE_SQL as FIRE_SQL,
)
from durable_agents.store.postgres_schedules import (
    MOVE_ON_SQL as MOVE_ON_SQL,
)
from durable_agents.store.postgres_schedules import (
    TAKE_DUE_SQL as TAKE_DUE_SQL,
)
from durable_agents.store.rows import DueSchedules, SlotStart, usage_shard

# -- Fragments -------------------------------------------------------------------------------

# The fence: the run is still this claim's (owner and attempt) and still running. Every write a
# worker makes for a claim carries it, so a worker whose lease expired and was taken over (the
# claim that took it incremented attempt), or whose run was cancelled, changes nothing: its
# UPDATE finds no row, and the rest of the statement, which reads that row, does nothing.
FENCE = """\
     WHERE id = %(run_id)s
       AND lease_owner = %(owner)s
       AND attempt = %(attempt)s
       AND status = 'running'"""

# A step commits only as the next one in the log (seq = last_seq + 1): no gap, and a step
# committed twice (a retried commit whose first try landed) is refused the second time; the
# store then finds it in the log as the claim's own (``committed_by``) and reports it committed.
STEP_FENCE = f"""\
{FENCE}
       AND last_seq = %(seq)s - 1"""

# What a turn adds to its run's cost: NULL ("no price") stays NULL until a turn has a price.
# coalesce(total + cost, cost, total): both known, the sum; no total yet, the cost; no cost
# (an unpriced turn, or not a model turn), the total as it was.
ADD_COST = "coalesce(cost_usd + %(cost)s::numeric, %(cost)s::numeric, cost_usd)"

# A step that keeps the run going, on the run's row: the step's seq, tokens and cost, the
# claim counted as progress (stalled_claims = 0) and the lease renewed. ``fence`` holds the
# run's id (with the agent, model and concurrency key the rollup is keyed by) only if the
# step fence held.
FENCED_STEP = f"""\
WITH fence AS (
    UPDATE agent_run
       SET last_seq = %(seq)s,
           stalled_claims = 0,
           tokens_used = tokens_used + %(tokens)s,
           cost_usd = {ADD_COST},
           lease_until = now() + make_interval(secs => %(lease)s),
           updated_at = now()
{STEP_FENCE}
 RETURNING id, agent, model, concurrency_key
)"""

# The last step of a run, on the run's row: the run ends instead of renewing its lease, with
# the columns ``finish_run`` sets (error '', no lease, finished_at).
FENCED_LAST_STEP = f"""\
WITH fence AS (
    UPDATE agent_run
       SET last_seq = %(seq)s,
           stalled_claims = 0,
           tokens_used = tokens_used + %(tokens)s,
           cost_usd = {ADD_COST},
           status = %(status)s,
           result = %(result)s,
           error = '',
           lease_owner = NULL,
           lease_until = NULL,
           finished_at = now(),
           updated_at = now()
{STEP_FENCE}
 RETURNING id, agent, model, concurrency_key
)"""

# The tool effects of a step, recorded whatever the fence says (the CTE does not read it): they
# describe calls that happened. ``{rows}`` is the VALUES list, one placeholder tuple per effect
# (``_effect_rows``); a key already recorded is kept as it is.
RECORD_EFFECTS = """\
recorded AS (
    INSERT INTO tool_effect (key, run_id, seq, call_index, tool, result, is_error)
    VALUES {rows}
    ON CONFLICT (key) DO NOTHING
)"""

# A model turn counted in the day's rollup (UTC, on the database clock), one row per (day,
# concurrency key, agent, model, shard) of the runs in ``{source}`` (none: nothing counted).
# The shard (``usage_shard``: fixed per run) spreads one agent's turns over USAGE_SHARDS rows,
# so that concurrent commits of different runs rarely wait for the same row lock; readers
# sum the shards. A run without a concurrency key (NULL) is counted under ''.
_RECORD_USAGE = """\
INSERT INTO agent_usage_day AS used (day, concurrency_key, agent, model, shard, turns,
                                     input_tokens, output_tokens, cache_read_tokens,
                                     cache_write_tokens, cost_usd)
SELECT (now() AT TIME ZONE 'UTC')::date, coalesce(concurrency_key, ''), agent, model,
       %(shard)s, 1,
       %(input_tokens)s, %(output_tokens)s, %(cache_read_tokens)s, %(cache_write_tokens)s,
       %(cost)s::numeric
  FROM {source}
    ON CONFLICT (day, concurrency_key, agent, model, shard) DO UPDATE
   SET turns = used.turns + 1,
       input_tokens = used.input_tokens + EXCLUDED.input_tokens,
       output_tokens = used.output_tokens + EXCLUDED.output_tokens,
       cache_read_tokens = used.cache_read_tokens + EXCLUDED.cache_read_tokens,
       cache_write_tokens = used.cache_write_tokens + EXCLUDED.cache_write_tokens,
       cost_usd = coalesce(used.cost_usd + EXCLUDED.cost_usd, EXCLUDED.cost_usd, used.cost_usd)"""

# The rollup of a committed turn: counted only if the fence held (it selects from ``fence``),
# in the step's own statement, so a turn is counted exactly once with its commit.
RECORD_USAGE = f"""\
usage AS (
{textwrap.indent(_RECORD_USAGE.format(source="fence"), "    ")}
)"""

# The step itself, one row if the fence held (it selects from ``fence``), none otherwise.
STEP_INSERT = """\
INSERT INTO agent_step (run_id, seq, kind, payload, content_start, content_end, request_id,
                        attempt, worker)
SELECT id, %(seq)s, %(kind)s, %(payload)s, %(content_start)s, %(content_end)s, %(request_id)s,
       %(attempt)s, %(owner)s
  FROM fence"""

# -- Statements ------------------------------------------------------------------------------

# A step that keeps the run going: fence, renewed lease and the step, in one statement.
APPEND_STEP_SQL = f"{FENCED_STEP}\n{STEP_INSERT}"

# The last step of a run: the same fence, and the run ends instead of renewing its lease.
APPEND_LAST_STEP_SQL = f"{FENCED_LAST_STEP}\n{STEP_INSERT}"

# The same two for a model turn, which is also counted in the day's rollup.
APPEND_TURN_SQL = f"{FENCED_STEP},\n{RECORD_USAGE}\n{STEP_INSERT}"
APPEND_LAST_TURN_SQL = f"{FENCED_LAST_STEP},\n{RECORD_USAGE}\n{STEP_INSERT}"

# The same two with the tool effects of the step (``{rows}`` filled in by ``_append``).
APPEND_STEP_WITH_EFFECTS_SQL = f"{FENCED_STEP},\n{RECORD_EFFECTS}\n{STEP_INSERT}"
APPEND_LAST_STEP_WITH_EFFECTS_SQL = f"{FENCED_LAST_STEP},\n{RECORD_EFFECTS}\n{STEP_INSERT}"

# The last step of a run and the claim of the worker's next run, in one statement: a busy
# worker saves a round trip and a flushed commit per run. The claim happens only if the fence
# held (CLAIMABLE_RUNS_IF_FENCED); the finished run is not claimable in the statement's
# snapshot (its lease is still held there). One row: whether the step was appended, then the
# next run's columns, or NULLs when there was none.
FINISH_AND_CLAIM_SQL = f"""\
{FENCED_LAST_STEP}, appended AS (
{STEP_INSERT}
 RETURNING run_id
), {CLAIMABLE_RUNS_IF_FENCED},
{ADMITTED}, taken AS (
{TAKE_CLAIMABLE_RUNS}
)
SELECT (SELECT count(*) FROM appended) AS appended, taken.*
  FROM (SELECT 1) AS one LEFT JOIN taken ON true"""

# The same for a run's last model turn, counted in the day's rollup too: what a busy worker
# sends at the end of every run.
FINISH_TURN_AND_CLAIM_SQL = f"""\
{FENCED_LAST_STEP}, {RECORD_USAGE}, appended AS (
{STEP_INSERT}
 RETURNING run_id
), {CLAIMABLE_RUNS_IF_FENCED},
{ADMITTED}, taken AS (
{TAKE_CLAIMABLE_RUNS}
)
SELECT (SELECT count(*) FROM appended) AS appended, taken.*
  FROM (SELECT 1) AS one LEFT JOIN taken ON true"""

# A model turn that was paid for but not committed (its fence failed: the run was taken over
# or cancelled meanwhile; or the step was refused): its tokens and cost still count, on the
# run and in the rollup. Unfenced, and counters only: no status, lease, seq or log changes.
UNSTORED_TURN_SQL = f"""
WITH run AS (
    UPDATE agent_run
       SET tokens_used = tokens_used + %(tokens)s,
           cost_usd = {ADD_COST}
     WHERE id = %(run_id)s
 RETURNING id, agent, model, concurrency_key
)
{_RECORD_USAGE.format(source="run")}"""

# approved -> executing and a renewed lease, only while the run is still this claim's and
# running: a cancel that committed first makes the fence fail and the call never starts. The
# run row stays locked until the intent row is updated.
START_INTENT_SQL = f"""
WITH fence AS (
    UPDATE agent_run
       SET lease_until = now() + make_interval(secs => %(lease)s),
           updated_at = now()
{FENCE}
 RETURNING id
)
UPDATE tool_intent
   SET status = 'executing', updated_at = now()
 WHERE id = %(intent_id)s
   AND status = 'approved'
   AND EXISTS (SELECT 1 FROM fence)
RETURNING id"""

# How a tool result is written (JSON text, encrypted under ENCRYPTION_KEYS), as the ORM
# writes it.
RESULT_FIELD = ToolEffect._meta.get_field("result")


def _effect_rows(effects: Sequence[ToolEffect], params: dict[str, Any]) -> str:
    """The VALUES list for ``{rows}``: one placeholder tuple per effect, its values added to
    ``params``."""
    rows = []
    for i, effect in enumerate(effects):
        rows.append(f"(%(k{i})s, %(run_id)s, %(s{i})s, %(c{i})s, %(t{i})s, %(r{i})s, %(e{i})s)")
        params.update(
            {
                f"k{i}": effect.key,
                f"s{i}": effect.seq,
                f"c{i}": effect.call_index,
                f"t{i}": effect.tool,
                f"r{i}": RESULT_FIELD.get_prep_value(effect.result),
                f"e{i}": effect.is_error,
            }
        )
    return ", ".join(rows)


def _usage_params(claim: Claim, usage: Usage) -> dict[str, Any]:
    """The parameters of the rollup's upsert (``RECORD_USAGE``) for one model turn."""
    return {
        "shard": usage_shard(claim.run_id),
        "input_tokens": usage.input_tokens,
        "output_tokens": usage.output_tokens,
        "cache_read_tokens": usage.cache_read_tokens,
        "cache_write_tokens": usage.cache_write_tokens,
    }


class PostgresStore(Store):
    """PostgreSQL outside a caller's transaction: one statement (one round trip) per claim,
    per step commit, per finish-and-claim, per heartbeat and per debounced start's push.

    What it does not write in SQL of its own it delegates, never inherits: to the concern
    modules (``portable_runs``, ``portable_logs``, ``portable_batch``, ``portable_trees``,
    ``postgres_debounce``, ``postgres_schedules``, ``key_rows``) and, for release, park,
    wake, decisions, waits and the operations on any run, to ``orm`` (a ``PortableStore``:
    the same ORM updates, one UPDATE each on PostgreSQL too)."""

    sends_live_text = True

    @functools.cached_property
    def orm(self) -> PortableStore:
        """The ORM's store, which does the operations this one has no statement of its own
        for (each is one transaction, as on SQLite)."""
        return PortableStore()

    def claim_runs(self, owner: str, lease_seconds: float, limit: int = 1) -> list[Claim]:
        """CLAIM_SQL (``postgres_claims.claim_runs``); then the parents of the runs it
        dead-lettered as poison are told."""
        claims, poisoned = postgres_claims.claim_runs(owner, lease_seconds, limit)
        for parent_id in poisoned:
            self.child_ended(parent_id)
        return claims

    def renew_leases(
        self,
        owner: str,
        claims: Sequence[Claim],
        lease_seconds: float,
        using: BaseDatabaseWrapper | None = None,
    ) -> dict[RunId, LeaseLoss]:
        """One statement, on ``using`` (the heartbeat's own connection) if given."""
        return postgres_claims.renew_leases(owner, claims, lease_seconds, using)

    def append_step(
        self, claim: Claim, step: StepWrite, then_claim: NextClaim | None = None
    ) -> bool:
        """This is where a step gets committed on PostgreSQL: one statement that checks the
        fence, renews the lease (or ends the run), inserts the step and records its effects."""
        params: dict[str, Any] = {
            "run_id": claim.run_id,
            "owner": claim.owner,
            "attempt": claim.attempt,
            "lease": float(claim.lease_seconds),
            "seq": step.seq,
            "kind": step.kind,
            "payload": encryption.seal(step.payload, STEP_PAYLOAD),
            "content_start": step.content_span[0] if step.content_span else None,
            "content_end": step.content_span[1] if step.content_span else None,
            "request_id": step.request_id,
            "tokens": step.tokens,
            "cost": step.cost,
        }
        if step.usage is not None:
            params.update(_usage_params(claim, step.usage))
        finish = step.finish
        if finish is not None:
            params["status"] = finish[0]
            params["result"] = None if finish[1] is None else storable_text(finish[1])
        try:
            appended = self._append(params, step.effects, finish, then_claim)
        except DataError:
            if step.usage is not None:
                self.count_unstored_turn(claim, step)
            raise
        if not appended and self.committed_by(claim, step.seq):
            # A retry whose first try landed (outage.py): this claim's own step, committed.
            appended = True
        elif not appended and step.usage is not None:
            self.count_unstored_turn(claim, step)
        if appended and finish is not None:
            self.child_ended(claim.run.parent_id)
        return appended

    def count_unstored_turn(self, claim: Claim, step: StepWrite) -> None:
        if step.usage is None:
            return
        params: dict[str, Any] = {
            "run_id": claim.run_id,
            "tokens": step.tokens,
            "cost": step.cost,
            **_usage_params(claim, step.usage),
        }
        with connection.cursor() as cursor:
            cursor.execute(UNSTORED_TURN_SQL, params)

    def _append(
        self,
        params: dict[str, Any],
        effects: Sequence[ToolEffect],
        finish: tuple[str, str | None] | None,
        then_claim: NextClaim | None,
    ) -> bool:
        turn = "shard" in params  # a model turn: counted in the rollup too
        if finish is not None and then_claim is not None and not effects:
            return self._finish_and_claim(params, then_claim)
        if effects:
            if finish is None:
                template = APPEND_STEP_WITH_EFFECTS_SQL
            else:
                template = APPEND_LAST_STEP_WITH_EFFECTS_SQL
            sql = template.format(rows=_effect_rows(effects, params))
        elif turn:
            sql = APPEND_TURN_SQL if finish is None else APPEND_LAST_TURN_SQL
        else:
            sql = APPEND_STEP_SQL if finish is None else APPEND_LAST_STEP_SQL
        return self._execute_append(sql, params)

    @staticmethod
    def _execute_append(sql: str, params: dict[str, Any]) -> bool:
        with binding_cursor() as cursor:
            cursor.execute(sql, params)
            return bool(cursor.rowcount == 1)

    def _finish_and_claim(self, params: dict[str, Any], then_claim: NextClaim) -> bool:
        """``append_step`` of a run's last step that also claims the next run, if the slot
        may (``then_claim.take()``); a model turn (its rollup parameters) is counted too."""
        turn = "shard" in params
        if not then_claim.take():
            return self._execute_append(
                APPEND_LAST_TURN_SQL if turn else APPEND_LAST_STEP_SQL, params
            )
        params = {**params, **key_limits(), "lease": float(then_claim.lease_seconds), "limit": 1}
        with binding_cursor() as cursor:
            try:
                cursor.execute(FINISH_TURN_AND_CLAIM_SQL if turn else FINISH_AND_CLAIM_SQL, params)
                row = cursor.fetchone()
            except BaseException:
                then_claim.give_back()
                raise
            names = [column.name for column in cursor.description or ()]
        assert row is not None
        appended, taken = bool(row[0]), dict(zip(names[1:], row[1:], strict=True))
        if taken["id"] is None:
            then_claim.give_back()
            return appended
        claim, parent_id = postgres_claims.read_claim(
            taken, then_claim.owner, then_claim.lease_seconds
        )
        if claim is None:
            self.child_ended(parent_id)
            then_claim.give_back()
            return appended
        then_claim.claim = claim
        return appended

    def start_intent_execution(self, claim: Claim, intent: ToolIntent) -> bool:
        """One statement; the run row stays locked until the intent row is updated."""
        params: dict[str, Any] = {
            "run_id": claim.run_id,
            "owner": claim.owner,
            "attempt": claim.attempt,
            "lease": float(claim.lease_seconds),
            "intent_id": intent.pk,
        }
        with connection.cursor() as cursor:
            cursor.execute(START_INTENT_SQL, params)
            started = bool(cursor.rowcount == 1)
        if started:
            intent.status = IntentStatus.EXECUTING
        return started

    # -- what this store has no statement of its own for: the concern modules and the ORM's

    def create_runs(self, runs: Sequence[tuple[AgentRun, str]]) -> list[AgentRun]:
        return portable_batch.create_runs(runs)

    def take_due_schedules(self, now: datetime.datetime | None, limit: int) -> DueSchedules:
        return postgres_schedules.take_due_schedules(now, limit)

    def fire_slots(
        self,
        starts: Sequence[SlotStart],
        rows: Sequence[AgentSchedule],
        last_keys: Mapping[int, str],
    ) -> dict[str, RunId]:
        return postgres_schedules.fire_slots(starts, rows, last_keys)

    def move_schedules(self, rows: Sequence[AgentSchedule]) -> None:
        postgres_schedules.move_schedules(rows)

    def create_run(self, run: AgentRun, task_payload: str) -> AgentRun:
        return portable_runs.create_run(run, task_payload)

    def create_fork(self, run: AgentRun, write: ForkWrite) -> AgentRun:
        return portable_logs.create_fork(run, write)

    def debounce_run(self, run: AgentRun, task_payload: str, seconds: float) -> AgentRun:
        return postgres_debounce.debounce_run(run, task_payload, seconds)

    def claim_run(self, run_id: RunId, owner: str, lease_seconds: float) -> Claim | None:
        return self.orm.claim_run(run_id, owner, lease_seconds)

    def renew_lease(self, claim: Claim) -> bool:
        return self.orm.renew_lease(claim)

    def finish_run(
        self, claim: Claim, status: str, *, result: str | None = None, error: str = ""
    ) -> bool:
        return self.orm.finish_run(claim, status, result=result, error=error)

    def release_lease(
        self,
        claim: Claim,
        *,
        error: str | None = None,
        count_claim: bool = True,
        hold_seconds: float | None = None,
        waiting_for: WaitKind | None = None,
    ) -> bool:
        return self.orm.release_lease(
            claim,
            error=error,
            count_claim=count_claim,
            hold_seconds=hold_seconds,
            waiting_for=waiting_for,
        )

    def park_on_intent(
        self,
        claim: Claim,
        intent: ToolIntent,
        *,
        new: bool = False,
        unknown_because: str | None = None,
    ) -> Parked:
        return self.orm.park_on_intent(claim, intent, new=new, unknown_because=unknown_because)

    def complete_intent(self, intent: ToolIntent, effect: ToolEffect) -> None:
        self.orm.complete_intent(intent, effect)

    def wake_run(self, run_id: RunId) -> bool:
        return self.orm.wake_run(run_id)

    def decide_intent(
        self, intent_id: int, user: AuthUser, from_status: str, to_status: str, reason: str
    ) -> ToolIntent:
        return self.orm.decide_intent(intent_id, user, from_status, to_status, reason)

    def resolve_intent(
        self, intent_id: int, user: AuthUser, *, outcome: tuple[str, bool] | None, reason: str
    ) -> ToolIntent:
        return self.orm.resolve_intent(intent_id, user, outcome=outcome, reason=reason)

    def park_on_wait(self, claim: Claim, spec: WaitSpec) -> tuple[Parked, dict[str, Any] | None]:
        return self.orm.park_on_wait(claim, spec)

    def send_event(self, name: str, payload: Any, user: AuthUser = None) -> tuple[AgentEvent, int]:
        return self.orm.send_event(name, payload, user)

    def answer_question(
        self, run_id: RunId | str, user: AuthUser, text: str, question_id: int | None = None
    ) -> AgentQuestion | None:
        return self.orm.answer_question(run_id, user, text, question_id)

    def spawn_run(
        self,
        child: AgentRun,
        task_payload: str,
        max_children: int,
        max_tree_runs: int | None = None,
    ) -> tuple[AgentRun, bool]:
        return self.orm.spawn_run(child, task_payload, max_children, max_tree_runs)

    def wake_parent(self, parent_id: RunId) -> bool:
        return self.orm.wake_parent(parent_id)

    def stranded_parents(self, limit: int) -> list[RunId]:
        return self.orm.stranded_parents(limit)

    def sent_event(self, name: str) -> AgentEvent | None:
        return self.orm.sent_event(name)

    def question_for_key(self, key: str) -> AgentQuestion | None:
        return self.orm.question_for_key(key)

    def run_outcomes(self, run_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
        return self.orm.run_outcomes(run_ids)

    def cancel_run(self, run_id: RunId | str) -> bool:
        return self.orm.cancel_run(run_id)

    def requeue_run(self, run_id: RunId | str) -> bool:
        return self.orm.requeue_run(run_id)

    def dead_letter(self, run_id: RunId, reason: str) -> bool:
        return self.orm.dead_letter(run_id, reason)

    def current_status(self, run_id: RunId) -> str | None:
        return self.orm.current_status(run_id)

    def spent_today(self, key: str) -> tuple[Decimal, Decimal | None]:
        return key_rows.spent_today(key)

    def set_key_limit(self, key: str, limit: int | None) -> None:
        key_rows.set_limit(key, limit)

    def set_key_budget(self, key: str, usd_per_day: Decimal | None) -> int:
        return key_rows.set_budget(key, usd_per_day)

    def first_claimable(self) -> tuple[str, int] | None:
        return self.orm.first_claimable()

    def load_log_rows(self, run_id: RunId | str) -> list[LogRow]:
        return portable_logs.load_log_rows(run_id)

    def load_steps(self, run_id: RunId, after_seq: int = -1) -> list[StepTuple]:
        return portable_logs.load_steps(run_id, after_seq)

    def recorded_effects(self, run_id: RunId, seq: int) -> dict[str, ToolEffect]:
        return self.orm.recorded_effects(run_id, seq)

    def record_effect(self, effect: ToolEffect) -> None:
        self.orm.record_effect(effect)

    def intent_for_key(self, key: str) -> ToolIntent | None:
        return self.orm.intent_for_key(key)

    def reload_intent(self, intent: ToolIntent) -> None:
        self.orm.reload_intent(intent)
