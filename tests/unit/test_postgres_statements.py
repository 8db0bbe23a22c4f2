"""The PostgreSQL statements are written out in full (store/postgres.py); these checks keep the
copies of the claim predicate and of the fence in step, so that none drifts or loses a clause.
Text only: no database."""

from __future__ import annotations

import re

import pytest

from durable_agents import leases
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


def test_the_claim_takes_exactly_the_claimable_runs() -> None:
    assert flat(postgres.CLAIMABLE_SQL) in flat(postgres.CLAIM_SQL)


def test_finish_and_claim_claims_like_the_claim_but_only_after_the_fence_held() -> None:
    fenced = flat(postgres.CLAIMABLE_SQL).replace(
        " ORDER BY", " AND EXISTS (SELECT 1 FROM fence) ORDER BY"
    )
    assert fenced in flat(postgres.FINISH_AND_CLAIM_SQL)
    take = flat(postgres.CLAIM_SQL).split(" WHERE run.id IN (")[0]
    assert take in flat(postgres.FINISH_AND_CLAIM_SQL)


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


def test_the_facade_keeps_the_former_names() -> None:
    assert leases._CLAIM_SQL is postgres.CLAIM_SQL
    assert leases._CLAIMABLE_SQL is postgres.CLAIMABLE_SQL
    assert leases._APPEND_SQL_PLAIN is postgres.APPEND_STEP_SQL
    assert leases._APPEND_SQL_FINISH is postgres.APPEND_LAST_STEP_SQL
