"""Committing steps on PostgreSQL: the fence, the lease and the step in one statement
(``PostgresStore``'s ``append_step``, ``count_unstored_turn`` and ``start_intent_execution``:
plain functions it calls).

    append_step  APPEND_STEP_SQL        fence, renewed lease and the step, one statement
                                        (its tool effects too: APPEND_STEP_WITH_EFFECTS_SQL;
                                        a model turn counted in the rollup: APPEND_TURN_SQL)
    finish       APPEND_LAST_STEP_SQL   the last step ends the run (and _WITH_EFFECTS_SQL,
                                        APPEND_LAST_TURN_SQL);
                 FINISH_AND_CLAIM_SQL   the same, and the claim of the worker's next run
                                        (FINISH_TURN_AND_CLAIM_SQL for a model turn)
    turn+results APPEND_TURN_AND_RESULTS_SQL  a model turn whose calls were all pure and
                                        their results, one statement (and
                                        _WITH_EFFECTS_SQL: the last call's ledger row)
    record       RECORD_EFFECT_SQL      one completed call recorded on its own (a call with a
                                        side effect, before the turn's results)
    unstored     UNSTORED_TURN_SQL      a paid turn whose commit failed still counts
    park         START_INTENT_SQL       an approved tool call starts under the fence
    last step    UNLESS_MESSAGES[...]   a last step that ends the run only while no
                                        message waits in its inbox (NO_MESSAGE_WAITING),
                                        sent right behind LOCK_RUN_SQL (``locked_first``)
    lock         LOCK_RUN_SQL           the run's row, as ``queue_message`` locks it
    inbox        HAS_WAITING_MESSAGE_SQL  does a message wait (the probe before a model call)

The statements are composed from the named fragments below: ``FENCE`` (what every write of a
claim carries), ``STEP_FENCE`` (and only as the next step of the log), ``FENCED_STEP`` and
``FENCED_LAST_STEP`` (what a step does to its run), ``RECORD_EFFECTS``, ``RECORD_USAGE`` (the
daily rollup of model turns) and ``STEP_INSERT``; a finish-and-claim adds the claim's
(``CLAIMABLE_RUNS_IF_FENCED``, ``ADMITTED``, ``TAKE_CLAIMABLE_RUNS``: store/postgres_claims.py).
The only formatting at run time is the VALUES list of the effects (``{rows}``: one
placeholder tuple per effect).
"""

from __future__ import annotations

import contextlib
import functools
import textwrap
from collections.abc import Iterator, Sequence
from typing import Any

from django.db import connection

from durable_agents._internal import encryption
from durable_agents._internal.text import storable_text
from durable_agents.flow.pricing import Usage
from durable_agents.models import (
    STEP_PAYLOAD,
    AgentRun,
    IntentStatus,
    ToolEffect,
    ToolIntent,
    step_part,
)
from durable_agents.store.base import Claim, NextClaim, RunId, StepWrite
from durable_agents.store.postgres_claims import (
    ADMITTED,
    CLAIMABLE_RUNS_IF_FENCED,
    TAKE_CLAIMABLE_RUNS,
    key_limits,
    read_claim,
)
from durable_agents.store.postgres_cursor import binding_cursor
from durable_agents.store.rows import usage_shard

# The run's row locked until the transaction ends, as ``queue_message`` locks it: a run's last
# commit takes it, then looks for messages in a statement of its own (whose snapshot, taken
# after the lock, sees every message queued before it).
LOCK_RUN_SQL = "SELECT 1 FROM agent_run WHERE id = %(run_id)s FOR NO KEY UPDATE"

# The inbox's probe before each model call (one lookup in the partial index of waiting
# messages), sent as the step commits are: numbered once, and prepared by a connection that
# prepares (written out in store/inbox.py for the other databases).
HAS_WAITING_MESSAGE_SQL = (
    "SELECT 1 FROM agent_message WHERE run_id = %(run_id)s AND folded_seq IS NULL LIMIT 1"
)

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
           output = %(output)s,
           error = '',
           lease_owner = NULL,
           lease_until = NULL,
           finished_at = now(),
           updated_at = now()
{STEP_FENCE}
 RETURNING id, agent, model, concurrency_key
)"""

# What a run's last step adds to its fence when ``append_last_step`` sends it: the run ends only
# while no message waits in its inbox. On its own this guard would race with ``queue_message``:
# an UPDATE that waited for the run's row lock checks its WHERE again on the new row, but its
# subquery keeps the snapshot taken before the wait and misses the message just queued. So the
# statement goes out right behind LOCK_RUN_SQL, in the same round trip and transaction
# (``locked_first``): its snapshot is taken once the lock is held.
NO_MESSAGE_WAITING = """\
       AND NOT EXISTS (SELECT 1 FROM agent_message
                        WHERE run_id = %(run_id)s AND folded_seq IS NULL)"""

FENCED_LAST_STEP_UNLESS_MESSAGES = FENCED_LAST_STEP.replace(
    STEP_FENCE, f"{STEP_FENCE}\n{NO_MESSAGE_WAITING}", 1
)

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
INSERT INTO agent_step (run_id, seq, part, kind, payload, content_start, content_end,
                        request_id, attempt, worker)
SELECT id, %(seq)s, %(part)s, %(kind)s, %(payload)s, %(content_start)s, %(content_end)s,
       %(request_id)s, %(attempt)s, %(owner)s
  FROM fence"""

# A model turn and the results of its calls, committed together (``append_turn_and_results``):
# the fence holds the turn's seq (``STEP_FENCE``), the run moves on to the results' seq.
FENCED_TURN_AND_RESULTS = FENCED_STEP.replace(
    "SET last_seq = %(seq)s,", "SET last_seq = %(results_seq)s,", 1
)

# The turn and its results, two rows if the fence held, none otherwise. A tool_result step has
# no content span and no request id (typed: a NULL parameter of the turn's would otherwise
# leave the column's type to the UNION, which takes text).
TURN_AND_RESULTS_INSERT = f"""\
{STEP_INSERT}
UNION ALL
SELECT id, %(results_seq)s, %(part)s, %(results_kind)s, %(results_payload)s, NULL::integer,
       NULL::integer, NULL::text, %(attempt)s, %(owner)s
  FROM fence"""

# The effects of a turn's results, recorded only if the fence held (unlike RECORD_EFFECTS: the
# calls were pure, and a turn never committed leaves no ledger behind for a later claim's own
# turn at that seq). ``{rows}``: typed tuples (``_FENCED_EFFECT_ROW``).
RECORD_FENCED_EFFECTS = """\
recorded AS (
    INSERT INTO tool_effect (key, run_id, seq, call_index, tool, result, is_error)
    SELECT effect.key, fence.id, effect.seq, effect.call_index, effect.tool, effect.result,
           effect.is_error
      FROM fence, (VALUES {rows}) AS effect (key, seq, call_index, tool, result, is_error)
    ON CONFLICT (key) DO NOTHING
)"""

# -- Statements ------------------------------------------------------------------------------

# A step that keeps the run going: fence, renewed lease and the step, in one statement.
APPEND_STEP_SQL = f"{FENCED_STEP}\n{STEP_INSERT}"

# The last step of a run: the same fence, and the run ends instead of renewing its lease.
APPEND_LAST_STEP_SQL = f"{FENCED_LAST_STEP}\n{STEP_INSERT}"

# The same two for a model turn, which is also counted in the day's rollup.
APPEND_TURN_SQL = f"{FENCED_STEP},\n{RECORD_USAGE}\n{STEP_INSERT}"
APPEND_LAST_TURN_SQL = f"{FENCED_LAST_STEP},\n{RECORD_USAGE}\n{STEP_INSERT}"

# The same two with the tool effects of the step (``{rows}`` filled in by ``append_statement``).
APPEND_STEP_WITH_EFFECTS_SQL = f"{FENCED_STEP},\n{RECORD_EFFECTS}\n{STEP_INSERT}"
APPEND_LAST_STEP_WITH_EFFECTS_SQL = f"{FENCED_LAST_STEP},\n{RECORD_EFFECTS}\n{STEP_INSERT}"

# A model turn whose calls were all pure and its tool_result step, in one statement: the turn
# counted in the rollup, the last call recorded in the ledger (``{rows}``), both steps appended,
# all only if the fence held.
APPEND_TURN_AND_RESULTS_SQL = (
    f"{FENCED_TURN_AND_RESULTS},\n{RECORD_USAGE}\n{TURN_AND_RESULTS_INSERT}"
)
APPEND_TURN_AND_RESULTS_WITH_EFFECTS_SQL = (
    f"{FENCED_TURN_AND_RESULTS},\n{RECORD_USAGE},\n{RECORD_FENCED_EFFECTS}\n"
    f"{TURN_AND_RESULTS_INSERT}"
)


# The last step of a run and the claim of the worker's next run, in one statement: a busy
# worker saves a round trip and a flushed commit per run. The claim happens only if the fence
# held (CLAIMABLE_RUNS_IF_FENCED); the finished run is not claimable in the statement's
# snapshot (its lease is still held there). One row: whether the step was appended, then the
# next run's columns, or NULLs when there was none.
def _finish_and_claim(also: str) -> str:
    """The finish-and-claim statement, with ``also`` (CTEs ending in ", ") run after the
    fence and before the step's insert."""
    return f"""\
{FENCED_LAST_STEP}, {also}appended AS (
{STEP_INSERT}
 RETURNING run_id
), {CLAIMABLE_RUNS_IF_FENCED},
{ADMITTED}, taken AS (
{TAKE_CLAIMABLE_RUNS}
)
SELECT (SELECT count(*) FROM appended) AS appended, taken.*
  FROM (SELECT 1) AS one LEFT JOIN taken ON true"""


FINISH_AND_CLAIM_SQL = _finish_and_claim("")

# The same for a run's last model turn, counted in the day's rollup too: what a busy worker
# sends at the end of every run.
FINISH_TURN_AND_CLAIM_SQL = _finish_and_claim(f"{RECORD_USAGE}, ")

# Every statement of a last step, and the same statement guarded by NO_MESSAGE_WAITING.
UNLESS_MESSAGES: dict[str, str] = {
    sql: sql.replace(FENCED_LAST_STEP, FENCED_LAST_STEP_UNLESS_MESSAGES, 1)
    for sql in (
        APPEND_LAST_STEP_SQL,
        APPEND_LAST_TURN_SQL,
        APPEND_LAST_STEP_WITH_EFFECTS_SQL,
        FINISH_AND_CLAIM_SQL,
        FINISH_TURN_AND_CLAIM_SQL,
    )
}

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
# How a run's validated final answer is written (JSON text), as the ORM writes it.
OUTPUT_FIELD = AgentRun._meta.get_field("output")


# One effect's placeholder tuple in RECORD_EFFECTS's VALUES list (``{i}``: its index), and in
# RECORD_FENCED_EFFECTS's, typed: a VALUES list outside an INSERT takes its columns' types from
# its values, and a parameter's would be text.
_EFFECT_ROW = "(%(k{i})s, %(run_id)s, %(s{i})s, %(c{i})s, %(t{i})s, %(r{i})s, %(e{i})s)"
_FENCED_EFFECT_ROW = (
    "(%(k{i})s::varchar, %(s{i})s::integer, %(c{i})s::integer, %(t{i})s::varchar,"
    " %(r{i})s::text, %(e{i})s::boolean)"
)


# One completed call recorded on its own, whatever the fence says (as RECORD_EFFECTS: it
# describes a call that happened), in one statement rather than the ORM's BEGIN, INSERT and
# COMMIT; a key already recorded is kept as it is.
RECORD_EFFECT_SQL = f"""\
INSERT INTO tool_effect (key, run_id, seq, call_index, tool, result, is_error)
VALUES {_EFFECT_ROW.format(i=0)}
    ON CONFLICT (key) DO NOTHING"""


def record_effect(effect: ToolEffect) -> None:
    """Send RECORD_EFFECT_SQL for ``effect``."""
    params: dict[str, Any] = {"run_id": effect.run_id}
    _effect_rows([effect], params)
    with binding_cursor() as cursor:
        cursor.execute(RECORD_EFFECT_SQL, params)


def _effect_rows(
    effects: Sequence[ToolEffect], params: dict[str, Any], row: str = _EFFECT_ROW
) -> str:
    """The VALUES list for ``{rows}``: one placeholder tuple per effect (``row``), its values
    added to ``params``."""
    rows = []
    for i, effect in enumerate(effects):
        rows.append(row.format(i=i))
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


def step_params(claim: Claim, step: StepWrite) -> dict[str, Any]:
    """The parameters of the statement that commits ``step`` for ``claim``: the fence's, the
    step's row, its tokens and cost; a model turn's rollup (``RECORD_USAGE``); the run's end
    (``FENCED_LAST_STEP``) when it is the last step."""
    params: dict[str, Any] = {
        "run_id": claim.run_id,
        "owner": claim.owner,
        "attempt": claim.attempt,
        "lease": float(claim.lease_seconds),
        "seq": step.seq,
        "part": step_part(claim.run_id),
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
        params["output"] = OUTPUT_FIELD.get_prep_value(step.output)
    return params


def append_statement(
    params: dict[str, Any],
    effects: Sequence[ToolEffect],
    finish: tuple[str, str | None] | None,
    unless_messages: bool = False,
) -> str:
    """The APPEND_* statement of a step whose parameters are ``params`` (``step_params``),
    the last step's when ``finish`` (guarded by NO_MESSAGE_WAITING with ``unless_messages``):
    with the step's tool effects (their VALUES list written into ``{rows}``, their values
    added to ``params``), else a model turn's (counted in the rollup) or a plain step's."""
    if effects:
        if finish is None:
            return APPEND_STEP_WITH_EFFECTS_SQL.format(rows=_effect_rows(effects, params))
        template = _last(APPEND_LAST_STEP_WITH_EFFECTS_SQL, unless_messages)
        return template.format(rows=_effect_rows(effects, params))
    if finish is not None:
        return last_step_statement(params, unless_messages)
    return APPEND_TURN_SQL if "shard" in params else APPEND_STEP_SQL


def turn_and_results_params(
    claim: Claim, turn: StepWrite, results: StepWrite
) -> tuple[str, dict[str, Any]]:
    """The statement and parameters that commit the model turn ``turn`` and its tool_result
    step ``results`` (the next seq) together."""
    params = step_params(claim, turn)
    params["results_seq"] = results.seq
    params["results_kind"] = results.kind
    params["results_payload"] = encryption.seal(results.payload, STEP_PAYLOAD)
    if results.effects:
        rows = _effect_rows(results.effects, params, _FENCED_EFFECT_ROW)
        return APPEND_TURN_AND_RESULTS_WITH_EFFECTS_SQL.format(rows=rows), params
    return APPEND_TURN_AND_RESULTS_SQL, params


def execute_turn_and_results(sql: str, params: dict[str, Any]) -> bool:
    """Send the statement of a turn and its results: whether both were appended."""
    with binding_cursor() as cursor:
        cursor.execute(sql, params)
        return bool(cursor.rowcount == 2)


def _last(sql: str, unless_messages: bool) -> str:
    return UNLESS_MESSAGES[sql] if unless_messages else sql


def execute_append(sql: str, params: dict[str, Any]) -> bool:
    """Send a step's statement (``behind_lock_if_guarded``): whether its step was appended
    (the fence held)."""
    with binding_cursor() as cursor:
        with behind_lock_if_guarded(sql, params["run_id"]):
            cursor.execute(sql, params)
        return bool(cursor.rowcount == 1)


def behind_lock_if_guarded(sql: str, run_id: RunId) -> contextlib.AbstractContextManager[None]:
    """``locked_first`` for a statement guarded by NO_MESSAGE_WAITING, which is only right
    behind the run's lock; nothing for any other. Decided by the statement itself, so that a
    guarded one never goes out alone."""
    return locked_first(run_id) if NO_MESSAGE_WAITING in sql else contextlib.nullcontext()


def has_waiting_message(run_id: RunId) -> bool:
    """Whether a message waits in the run's inbox (HAS_WAITING_MESSAGE_SQL)."""
    with binding_cursor() as cursor:
        cursor.execute(HAS_WAITING_MESSAGE_SQL, {"run_id": run_id})
        return cursor.fetchone() is not None


@functools.cache
def pipelines() -> bool:
    """Whether psycopg can send a pipeline here (libpq 14 or later)."""
    import psycopg  # only on PostgreSQL: SQLite installs need not have it

    return bool(psycopg.Pipeline.is_supported())


@contextlib.contextmanager
def locked_first(run_id: RunId) -> Iterator[None]:
    """LOCK_RUN_SQL, then the statements the block sends, in one round trip (psycopg's
    pipeline): one transaction, the caller's or the implicit one that ends at the pipeline's
    Sync, in which each statement after the lock takes its snapshot once the lock is held.
    Their results (and errors, as Django's errors) come when the block ends."""
    # Left to right: binding_cursor() connects before connection.connection is read.
    with (
        binding_cursor() as lock,
        connection.wrap_database_errors,
        connection.connection.pipeline(),
    ):
        lock.execute(LOCK_RUN_SQL, {"run_id": run_id})
        yield


@contextlib.contextmanager
def sent_together() -> Iterator[None]:
    """The statements the block sends, in one round trip (psycopg's pipeline) where libpq can
    (14 or later), one by one otherwise. Their results, and errors as Django's error classes,
    come when the block ends. For reads: outside a transaction they share the pipeline's
    implicit one, and an error in one fails the others."""
    if not pipelines():
        yield
        return
    connection.ensure_connection()
    with connection.wrap_database_errors, connection.connection.pipeline():
        yield


def last_step_statement(params: dict[str, Any], unless_messages: bool = False) -> str:
    """The statement of a run's last step that claims nothing next (a model turn's counts it;
    guarded by NO_MESSAGE_WAITING with ``unless_messages``)."""
    return _last(
        APPEND_LAST_TURN_SQL if "shard" in params else APPEND_LAST_STEP_SQL, unless_messages
    )


def finish_and_claim(
    params: dict[str, Any], then_claim: NextClaim, unless_messages: bool = False
) -> tuple[bool, RunId | None]:
    """The last step of a run that also claims the next run, once the slot took its place
    (``then_claim.take()``, asked by the caller; the claim, if any, is set on it); a model
    turn (its rollup parameters) is counted too. With ``unless_messages`` the step is guarded
    by NO_MESSAGE_WAITING, and so sent right behind the run's lock. Returns
    whether the step was appended, and the parent of the next run if its row could not be
    decoded and it was dead-lettered as poison instead: the caller tells it
    (``child_ended``)."""
    turn = "shard" in params
    sql = _last(FINISH_TURN_AND_CLAIM_SQL if turn else FINISH_AND_CLAIM_SQL, unless_messages)
    params = {**params, **key_limits(), "lease": float(then_claim.lease_seconds), "limit": 1}
    with binding_cursor() as cursor:
        try:
            with behind_lock_if_guarded(sql, params["run_id"]):
                cursor.execute(sql, params)
            row = cursor.fetchone()
        except BaseException:
            then_claim.give_back()
            raise
        names = cursor.column_names()
    assert row is not None
    appended = bool(row[0])
    taken: dict[str | None, Any] = dict(zip(names[1:], row[1:], strict=True))
    if taken["id"] is None:
        then_claim.give_back()
        return appended, None
    claim, parent_id = read_claim(taken, then_claim.owner, then_claim.lease_seconds)
    if claim is None:
        then_claim.give_back()
        return appended, parent_id
    then_claim.claim = claim
    return appended, None


def count_unstored_turn(claim: Claim, step: StepWrite) -> None:
    """UNSTORED_TURN_SQL, for a model turn (nothing else is counted)."""
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


def start_intent_execution(claim: Claim, intent: ToolIntent) -> bool:
    """START_INTENT_SQL: whether the intent is executing now (and ``intent`` says so)."""
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
