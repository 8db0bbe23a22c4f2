"""The PostgreSQL statements of store/postgres.py, checked as text (no database).

Every statement is pinned byte for byte by its golden file in tests/sql/ (one file per
``*_SQL`` constant, named after it, and the statements the step commit builds with tool
effects): what runs is what the golden files say. After a deliberate change to a statement,
rewrite them with one command and review the diff:

    UPDATE_SQL_SNAPSHOTS=1 python -m pytest tests/unit/test_postgres_statements.py

The other checks say what a snapshot cannot: which clauses the statements must share."""

from __future__ import annotations

import contextlib
import difflib
import os
import re
import uuid
from pathlib import Path
from typing import Any

import pytest

from durable_agents.flow.pricing import Usage
from durable_agents.models import AgentRun, StepKind, ToolEffect
from durable_agents.store import Claim, StepWrite, postgres, postgres_steps

GOLDEN = Path(__file__).resolve().parent.parent / "sql"
UPDATE = os.environ.get("UPDATE_SQL_SNAPSHOTS") == "1"


def constants() -> dict[str, str]:
    """Every module-level statement of store/postgres.py: the ``*_SQL`` strings."""
    return {
        name: value
        for name, value in vars(postgres).items()
        if name.endswith("_SQL") and isinstance(value, str)
    }


class Capturing(postgres.PostgresStore):
    """``PostgresStore`` that keeps the step commits it would send instead of sending them."""

    def __init__(self) -> None:
        self.sent: list[str] = []
        self.locked: list[bool] = []  # whether each went right behind the run's lock

    def _execute_append(self, sql: str, params: dict[str, Any]) -> bool:  # type: ignore[override]
        # An instance method where the store's is static: it needs ``self.sent``.
        self.sent.append(sql)
        # Whether execute_append would send it right behind the run's lock.
        behind = postgres_steps.behind_lock_if_guarded(sql, uuid.uuid4())
        self.locked.append(not isinstance(behind, contextlib.nullcontext))
        return True


def built_with_effects() -> dict[str, str]:
    """The step commits with tool effects, as ``PostgresStore._append`` builds them (two
    effects: the VALUES list that ``_effect_rows`` writes into ``{rows}``)."""
    effects = [
        ToolEffect(key=f"k{i}", seq=3, call_index=i, tool="t", result="ok", is_error=False)
        for i in range(2)
    ]
    built = {}
    for name, finish, unless_messages in (
        ("APPEND_STEP_WITH_EFFECTS_SQL", None, False),
        ("APPEND_LAST_STEP_WITH_EFFECTS_SQL", ("succeeded", "done"), False),
        ("APPEND_LAST_STEP_WITH_EFFECTS_SQL.unless_messages", ("succeeded", "done"), True),
    ):
        store = Capturing()
        store._append({}, effects, finish, None, unless_messages)
        (built[f"{name}.two_effects"],) = store.sent
        assert store.locked == [unless_messages]
    # A turn and its results, as ``append_turn_and_results`` builds the statement.
    run = AgentRun(id=uuid.UUID(int=7))
    claim = Claim(run, "w", 1, 60)
    turn = StepWrite(3, StepKind.MODEL_TURN, "{}", usage=Usage(1, 1, 0, 0))
    results = StepWrite(4, StepKind.TOOL_RESULT, "[]", effects=effects)
    sql, params = postgres_steps.turn_and_results_params(claim, turn, results)
    built["APPEND_TURN_AND_RESULTS_WITH_EFFECTS_SQL.two_effects"] = sql
    assert {"results_seq", "results_kind", "results_payload", "k1", "shard"} <= set(params)
    return built


def unless_messages() -> dict[str, str]:
    """The last steps as ``append_last_step`` sends them (guarded by the inbox)."""
    return {
        f"{name}.unless_messages": postgres.UNLESS_MESSAGES[sql]
        for name, sql in constants().items()
        if sql in postgres.UNLESS_MESSAGES
    }


def statements() -> dict[str, str]:
    return {**constants(), **unless_messages(), **built_with_effects()}


def rewrite_golden_files() -> None:
    """UPDATE_SQL_SNAPSHOTS=1: the golden files become what runs now (and the files of
    statements that are gone are removed)."""
    GOLDEN.mkdir(exist_ok=True)
    current = statements()
    for stale in set(GOLDEN.glob("*.sql")) - {GOLDEN / f"{name}.sql" for name in current}:
        stale.unlink()
    for name, sql in current.items():
        (GOLDEN / f"{name}.sql").write_bytes(sql.encode())


def test_every_statement_has_a_golden_file_and_every_golden_file_a_statement() -> None:
    if UPDATE:
        rewrite_golden_files()
    on_disk = sorted(path.name.removesuffix(".sql") for path in GOLDEN.glob("*.sql"))
    assert on_disk == sorted(statements()), "run with UPDATE_SQL_SNAPSHOTS=1 to rewrite"


@pytest.mark.parametrize("name", sorted(statements()))
def test_the_statement_is_byte_identical_to_its_golden_file(name: str) -> None:
    sql = statements()[name]
    path = GOLDEN / f"{name}.sql"
    if UPDATE:
        rewrite_golden_files()
    golden = path.read_bytes().decode() if path.exists() else ""
    if sql != golden:
        diff = difflib.unified_diff(
            golden.splitlines(keepends=True),
            sql.splitlines(keepends=True),
            f"tests/sql/{name}.sql (golden)",
            f"store/postgres.py {name} (what runs)",
        )
        # A difference in whitespace alone is hard to see in a diff: then the exact texts too.
        exact = f"\n{golden!r}\n!=\n{sql!r}" if golden.split() == sql.split() else ""
        pytest.fail(
            f"{name} differs from its golden file (UPDATE_SQL_SNAPSHOTS=1 rewrites it after a "
            "deliberate change):\n" + "".join(diff) + exact,
            pytrace=False,
        )


# -- What the statements must share (a snapshot says "unchanged", these say "still right") ------

WRITES_OF_A_STEP = [
    postgres.APPEND_STEP_SQL,
    postgres.APPEND_LAST_STEP_SQL,
    postgres.APPEND_STEP_WITH_EFFECTS_SQL,
    postgres.APPEND_LAST_STEP_WITH_EFFECTS_SQL,
    postgres.FINISH_AND_CLAIM_SQL,
    postgres.APPEND_TURN_SQL,
    postgres.APPEND_LAST_TURN_SQL,
    postgres.FINISH_TURN_AND_CLAIM_SQL,
]


@pytest.mark.parametrize("sql", [*WRITES_OF_A_STEP, postgres.START_INTENT_SQL])
def test_every_write_of_a_claim_carries_the_whole_fence(sql: str) -> None:
    fence = " ".join(postgres.FENCE.split())
    assert fence.startswith("WHERE id = %(run_id)s AND lease_owner = %(owner)s")
    assert "AND attempt = %(attempt)s AND status = 'running'" in fence
    assert " ".join(sql.split()).count(fence) == 1


@pytest.mark.parametrize("sql", WRITES_OF_A_STEP)
def test_every_step_commits_only_as_the_next_one_in_the_log(sql: str) -> None:
    assert sql.count(postgres.STEP_FENCE) == 1
    assert postgres.STEP_FENCE.endswith("AND last_seq = %(seq)s - 1")
    assert sql.count(postgres.STEP_INSERT) == 1
    assert postgres.STEP_INSERT.endswith("FROM fence")  # no step when the fence failed


def test_the_claim_takes_exactly_the_claimable_runs() -> None:
    assert postgres.CLAIMABLE_SQL.startswith("\nWITH " + postgres.CLAIMABLE_RUNS + "\n")
    assert postgres.CLAIM_SQL.startswith(
        f"\nWITH {postgres.CLAIMABLE_RUNS},\n{postgres.ADMITTED}, taken AS (\n"
        f"{postgres.TAKE_CLAIMABLE_RUNS}\n)"
    )
    # At most the limit in all, and a constant LIMIT the planner can use (a nested loop on the
    # primary key, not a hash join over the table).
    admitted = " ".join(postgres.ADMITTED.split())
    assert "FROM (SELECT * FROM due UNION ALL SELECT * FROM ready) AS locked" in admitted
    assert "held + nth <= key_limit LIMIT %(limit)s )" in admitted
    take = " ".join(postgres.TAKE_CLAIMABLE_RUNS.split())
    assert (
        "WHERE run.id IN (SELECT id FROM claimable WHERE concurrency_key IS NULL"
        " OR concurrency_key IN (SELECT key FROM admitted))" in take
    )


def test_a_keyed_claim_counts_afresh_under_the_keys_row_lock() -> None:
    """The race-free part of a keyed claim (store/concurrency.py): the keys' rows locked in
    key order, waiting (no SKIP LOCKED), the holders counted by the VOLATILE function in the
    lock's condition (evaluated again after a wait), and the rows updated, which is what makes
    a waiting claim evaluate it again."""
    admitted = " ".join(postgres.ADMITTED.split())
    assert (
        "OR agent_concurrency_held(k.key) + wanted.runs <= wanted.key_limit"
        " ORDER BY k.key FOR NO KEY UPDATE OF k )" in admitted
    )
    assert (
        "UPDATE agent_concurrency_key SET claimed_at = now()"
        " WHERE key IN (SELECT key FROM admitted)" in admitted
    )
    assert postgres.CLAIMABLE_RUNS.count(postgres.KEY_LIMIT) == 6  # selected, and the filter's
    assert postgres.CLAIMABLE_RUNS.count("agent_concurrency_holders(run.concurrency_key)") == 4


def test_due_waits_come_first_and_the_limit_is_shared() -> None:
    ctes = postgres.CLAIMABLE_RUNS
    assert ctes.index("due AS (") < ctes.index("ready AS (")
    assert "LIMIT greatest(%(limit)s - (SELECT count(*) FROM due), 0)" in ctes
    assert ctes.count("FOR NO KEY UPDATE SKIP LOCKED") == 2


def test_finish_and_claim_claims_like_the_claim_but_only_after_the_fence_held() -> None:
    fenced = postgres.CLAIMABLE_RUNS_IF_FENCED
    assert fenced.count("AND EXISTS (SELECT 1 FROM fence)") == 2
    freed = "\n   AND EXISTS (SELECT 1 FROM fence)", postgres._FREED
    assert fenced.count(freed[1]) == 4  # the run it ends frees its slot (filter and count)
    assert fenced.replace(freed[0], "").replace(freed[1], "") == postgres.CLAIMABLE_RUNS
    assert fenced in postgres.FINISH_AND_CLAIM_SQL
    assert postgres.ADMITTED in postgres.FINISH_AND_CLAIM_SQL
    assert postgres.TAKE_CLAIMABLE_RUNS in postgres.FINISH_AND_CLAIM_SQL


def test_the_claim_tells_a_due_wait_what_ended_it() -> None:
    take = postgres.TAKE_CLAIMABLE_RUNS
    assert "WHEN run.status <> 'waiting' THEN run.woken_by" in take
    assert "WHEN run.waiting_for = 'timer' THEN '{\"timer\": true}'" in take
    assert "ELSE '{\"timeout\": true}' END" in take
    assert "wake_at = NULL" in take


def test_the_effects_variants_only_add_the_ledger() -> None:
    ledger = re.compile(r",\s*recorded AS \(.*?DO NOTHING\s*\)", re.S)
    assert ledger.sub("", postgres.APPEND_STEP_WITH_EFFECTS_SQL) == postgres.APPEND_STEP_SQL
    assert (
        ledger.sub("", postgres.APPEND_LAST_STEP_WITH_EFFECTS_SQL) == postgres.APPEND_LAST_STEP_SQL
    )
    # ``{rows}`` is filled in with str.format: no other brace may appear in these two.
    for sql in (postgres.APPEND_STEP_WITH_EFFECTS_SQL, postgres.APPEND_LAST_STEP_WITH_EFFECTS_SQL):
        assert sql.count("{") == sql.count("}") == sql.count("{rows}") == 1


def test_the_last_step_ends_the_run_as_finish_run_does() -> None:
    for sql in (postgres.APPEND_LAST_STEP_SQL, postgres.FINISH_AND_CLAIM_SQL):
        assert postgres.FENCED_LAST_STEP in sql
    for column in ("status = %(status)s", "result = %(result)s", "error = ''"):
        assert column in postgres.FENCED_LAST_STEP
    for column in ("lease_owner = NULL", "lease_until = NULL", "finished_at = now()"):
        assert column in postgres.FENCED_LAST_STEP
    assert "lease_until = now()" not in postgres.FENCED_LAST_STEP


USAGE_CTE = re.compile(r",\s*usage AS \(.*?used\.cost_usd\)\s*\)", re.S)


def test_the_turn_variants_only_add_the_rollup_of_a_fenced_turn() -> None:
    assert USAGE_CTE.sub("", postgres.APPEND_TURN_SQL) == postgres.APPEND_STEP_SQL
    assert USAGE_CTE.sub("", postgres.APPEND_LAST_TURN_SQL) == postgres.APPEND_LAST_STEP_SQL
    assert USAGE_CTE.sub("", postgres.FINISH_TURN_AND_CLAIM_SQL) == postgres.FINISH_AND_CLAIM_SQL
    # Counted only if the fence held: the upsert reads the fence's row, nothing else.
    usage = " ".join(postgres.RECORD_USAGE.split())
    assert " FROM fence ON CONFLICT (day, concurrency_key, agent, model, shard) DO UPDATE" in usage
    assert usage.count(" FROM ") == 1


def test_every_step_adds_its_cost_as_it_adds_its_tokens() -> None:
    for fragment in (postgres.FENCED_STEP, postgres.FENCED_LAST_STEP):
        assert f"cost_usd = {postgres.ADD_COST}," in fragment
        assert fragment.index("tokens_used = ") < fragment.index("cost_usd = ")
    # NULL ("no price") stays NULL until a turn has a price; then the sum.
    assert postgres.ADD_COST == (
        "coalesce(cost_usd + %(cost)s::numeric, %(cost)s::numeric, cost_usd)"
    )


def test_an_unstored_turn_changes_counters_only() -> None:
    sql = postgres.UNSTORED_TURN_SQL
    assert "SET tokens_used = tokens_used + %(tokens)s," in sql
    for never in ("status", "lease_", "last_seq", "attempt", "agent_step"):
        assert never not in sql.split("RETURNING")[0]


def test_a_last_step_sent_by_append_last_step_only_adds_the_inbox_guard() -> None:
    guard = postgres.NO_MESSAGE_WAITING
    assert " ".join(guard.split()) == (
        "AND NOT EXISTS (SELECT 1 FROM agent_message"
        " WHERE run_id = %(run_id)s AND folded_seq IS NULL)"
    )
    assert len(postgres.UNLESS_MESSAGES) == 5  # every statement that contains a last step
    for sql in WRITES_OF_A_STEP:
        if postgres.FENCED_LAST_STEP not in sql:
            assert sql not in postgres.UNLESS_MESSAGES
            continue
        guarded = postgres.UNLESS_MESSAGES[sql]
        # Right after the step's fence, inside the run's UPDATE, and nothing else changed.
        assert guarded.count(f"{postgres.STEP_FENCE}\n{guard}\n RETURNING") == 1
        assert guarded.replace(f"\n{guard}", "", 1) == sql
    # The lock the guard needs in front of it (locked_first) is the one queue_message takes.
    assert postgres.LOCK_RUN_SQL == (
        "SELECT 1 FROM agent_run WHERE id = %(run_id)s FOR NO KEY UPDATE"
    )


@pytest.mark.parametrize("finish", [None, ("succeeded", "done")])
@pytest.mark.parametrize("unless_messages", [False, True])
def test_only_a_guarded_last_step_goes_out_behind_the_runs_lock(
    finish: tuple[str, str] | None, unless_messages: bool
) -> None:
    store = Capturing()
    store._append({"shard": 3}, [], finish, None, unless_messages)
    guarded = finish is not None and unless_messages
    assert store.locked == [guarded]
    if finish is None:
        assert store.sent == [postgres.APPEND_TURN_SQL]
    elif guarded:
        assert store.sent == [postgres.UNLESS_MESSAGES[postgres.APPEND_LAST_TURN_SQL]]
    else:
        assert store.sent == [postgres.APPEND_LAST_TURN_SQL]
