"""The PostgreSQL statements are written out in full (store/postgres.py); these checks keep the
copies of the claim predicate and of the fence in step, so that none drifts or loses a clause.
Text only: no database."""

from __future__ import annotations

import re

import pytest

from durable_agents.store import postgres


def flat(sql: str) -> str:
    return " ".join(sql.split())


FENCE = flat(
    """WHERE id = %(run_id)s
       AND lease_owner = %(owner)s
       AND attempt = %(attempt)s
       AND status = 'running'
       AND last_seq = %(seq)s - 1"""
)
APPENDS = [
    postgres.APPEND_STEP_SQL,
    postgres.APPEND_LAST_STEP_SQL,
    postgres.APPEND_STEP_WITH_EFFECTS_SQL,
    postgres.APPEND_LAST_STEP_WITH_EFFECTS_SQL,
    postgres.FINISH_AND_CLAIM_SQL,
]


TAKE_CLAIMABLE = "SELECT id FROM due UNION ALL SELECT id FROM ready"


def claimable_ctes() -> str:
    """The CTEs ``due`` and ``ready`` of CLAIMABLE_SQL, without the leading WITH."""
    ctes, take = flat(postgres.CLAIMABLE_SQL).split(") " + TAKE_CLAIMABLE)
    assert take == ""
    assert ctes.startswith("WITH due AS (")
    return ctes.removeprefix("WITH ") + ")"


def test_the_claim_takes_exactly_the_claimable_runs() -> None:
    assert flat(postgres.CLAIM_SQL).startswith("WITH " + claimable_ctes() + " UPDATE agent_run")
    # At most the limit in all, and a constant LIMIT the planner can use (a nested loop on the
    # primary key, not a hash join over the table).
    take = f"WHERE run.id IN (SELECT id FROM ({TAKE_CLAIMABLE}) AS claimable LIMIT %(limit)s)"
    assert take in flat(postgres.CLAIM_SQL)


def test_due_waits_come_first_and_the_limit_is_shared() -> None:
    ctes = claimable_ctes()
    assert ctes.index("due AS (") < ctes.index("ready AS (")
    assert "LIMIT greatest(%(limit)s - (SELECT count(*) FROM due), 0)" in ctes
    assert ctes.count("FOR NO KEY UPDATE SKIP LOCKED") == 2


def test_finish_and_claim_claims_like_the_claim_but_only_after_the_fence_held() -> None:
    fenced = claimable_ctes().replace(" ORDER BY", " AND EXISTS (SELECT 1 FROM fence) ORDER BY")
    assert fenced.count("EXISTS (SELECT 1 FROM fence)") == 2
    assert fenced in flat(postgres.FINISH_AND_CLAIM_SQL)
    take = flat(postgres.CLAIM_SQL).split(" UPDATE agent_run AS run", 1)[1]
    take = take.split(" RETURNING run.*")[0]
    assert take in flat(postgres.FINISH_AND_CLAIM_SQL)


def test_the_claim_tells_a_due_wait_what_ended_it() -> None:
    for sql in (postgres.CLAIM_SQL, postgres.FINISH_AND_CLAIM_SQL):
        assert "WHEN run.status <> 'waiting' THEN run.woken_by" in sql
        assert "WHEN run.waiting_for = 'timer' THEN '{\"timer\": true}'" in sql
        assert "ELSE '{\"timeout\": true}' END" in sql
        assert "wake_at = NULL" in sql


@pytest.mark.parametrize("sql", APPENDS)
def test_every_step_commit_carries_the_whole_fence(sql: str) -> None:
    assert flat(sql).count(FENCE) == 1


def test_the_effects_variants_only_add_the_ledger() -> None:
    ledger = re.compile(r",\s*recorded AS \(.*?DO NOTHING\s*\)", re.S)
    assert ledger.sub("", postgres.APPEND_STEP_WITH_EFFECTS_SQL) == postgres.APPEND_STEP_SQL
    assert (
        ledger.sub("", postgres.APPEND_LAST_STEP_WITH_EFFECTS_SQL) == postgres.APPEND_LAST_STEP_SQL
    )
    for sql in (postgres.APPEND_STEP_WITH_EFFECTS_SQL, postgres.APPEND_LAST_STEP_WITH_EFFECTS_SQL):
        assert sql.count("{") == sql.count("{rows}") == 1


def test_the_last_step_ends_the_run_as_finish_run_does() -> None:
    for sql in (postgres.APPEND_LAST_STEP_SQL, postgres.FINISH_AND_CLAIM_SQL):
        for column in ("status = %(status)s", "result = %(result)s", "error = ''"):
            assert column in sql
        for column in ("lease_owner = NULL", "lease_until = NULL", "finished_at = now()"):
            assert column in sql
