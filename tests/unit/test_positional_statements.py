"""The claim and the step commits go out with PostgreSQL's own placeholders ($1, $2, ...),
converted once from the named ones they are written with (store/postgres_cursor.py).

Checked as text, without a database: the conversion itself, and that every statement the
claim and the step commit send converts, and converts back, to exactly what its golden file
pins (tests/unit/test_postgres_statements.py)."""

from __future__ import annotations

import re

import pytest

from durable_agents.store.postgres_cursor import positional
from tests.unit.test_postgres_statements import statements


def test_names_are_numbered_in_order_of_first_use_and_share_their_number() -> None:
    text, names = positional(
        "UPDATE t SET a = %(a)s, b = %(b)s WHERE a <> %(a)s AND c LIKE 'x%%' AND d = %(d)s"
    )
    assert text == "UPDATE t SET a = $1, b = $2 WHERE a <> $1 AND c LIKE 'x%' AND d = $3"
    assert names == ("a", "b", "d")


def test_a_statement_without_parameters_is_sent_as_written() -> None:
    assert positional("SELECT 1") == ("SELECT 1", ())


@pytest.mark.parametrize(
    "sql",
    [
        "SELECT %s",  # a positional psycopg placeholder: its order is the caller's, not a name's
        "SELECT %(a)s, %b",
        "SELECT $1",  # already positional: mixing would number two parameters $1
        "DO $$ BEGIN NULL; END $$",  # dollar quoting would be taken for parameters
        "SELECT 100%",
    ],
)
def test_anything_but_named_placeholders_is_refused(sql: str) -> None:
    with pytest.raises(ValueError, match="only %\\(name\\)s placeholders"):
        positional(sql)


# Every statement the binding cursor sends: the claim, the inbox's probe, and the step commits
# in every variant (with effects, with the inbox guard, finishing, finishing and claiming).
# The others (the heartbeat's, the fleet's, the schedules') go through Django's cursor as
# written.
BINDING_CURSOR_SENDS = {
    "CLAIM_SQL",
    "LOCK_RUN_SQL",
    "HAS_WAITING_MESSAGE_SQL",
    "APPEND_STEP_SQL",
    "APPEND_STEP_WITH_EFFECTS_SQL",
    "APPEND_TURN_SQL",
    "APPEND_TURN_AND_RESULTS_SQL",
    "APPEND_TURN_AND_RESULTS_WITH_EFFECTS_SQL",
    "APPEND_LAST_STEP_SQL",
    "APPEND_LAST_STEP_WITH_EFFECTS_SQL",
    "APPEND_LAST_TURN_SQL",
    "FINISH_AND_CLAIM_SQL",
    "FINISH_TURN_AND_CLAIM_SQL",
    "RECORD_EFFECT_SQL",
}
SENT_POSITIONAL = sorted(
    name for name in statements() if name.split(".")[0] in BINDING_CURSOR_SENDS
)


def test_every_statement_of_the_claim_and_the_commit_is_checked() -> None:
    assert {name.split(".")[0] for name in SENT_POSITIONAL} == BINDING_CURSOR_SENDS


@pytest.mark.parametrize("name", SENT_POSITIONAL)
def test_each_statement_converts_back_to_its_golden_text(name: str) -> None:
    sql = statements()[name]
    text, names = positional(sql)
    assert "%(" not in text
    assert sorted(set(re.findall(r"\$(\d+)", text)), key=int) == [
        str(n) for n in range(1, len(names) + 1)
    ]
    assert set(names) == set(re.findall(r"%\((\w+)\)s", sql))
    back = re.sub(r"\$(\d+)", lambda m: f"%({names[int(m.group(1)) - 1]})s", text)
    assert back == sql.replace("%%", "%")
