"""The cursor a thread's connection keeps for the claim and the step commits
(store/postgres_cursor.py ``binding_cursor``): kept from one statement to the next on the
same driver connection, never shared by two blocks at once, dropped after an error."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import DatabaseError, connection

from durable_agents.store.postgres_cursor import StatementCursor, binding_cursor

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

ONE = "SELECT %(n)s::int"


def one(cursor: StatementCursor, n: int) -> int:
    cursor.execute(ONE, {"n": n})
    (value,) = cursor.fetchone()
    return int(value)


def test_the_next_statement_on_the_connection_reuses_the_cursor() -> None:
    with binding_cursor() as first:
        assert one(first, 1) == 1
    with binding_cursor() as second:
        assert one(second, 2) == 2
    assert second is first


def test_a_block_inside_another_gets_a_cursor_of_its_own() -> None:
    with binding_cursor() as outer:
        outer.execute(ONE, {"n": 1})
        with binding_cursor() as inner:
            assert inner is not outer
            assert one(inner, 2) == 2
        # The outer block's result is its own still.
        assert outer.fetchone() == (1,)


def test_after_an_error_or_a_new_connection_the_cursor_is_new() -> None:
    with binding_cursor() as before:
        one(before, 1)
    failing: list[StatementCursor] = []
    with pytest.raises(DatabaseError), binding_cursor() as cursor:  # noqa: PT012
        failing.append(cursor)
        cursor.execute("SELECT 1 / %(zero)s", {"zero": 0})
    assert failing == [before]
    with binding_cursor() as after_error:
        assert after_error is not before
        assert one(after_error, 3) == 3
    connection.close()
    with binding_cursor() as reconnected:
        assert reconnected is not after_error
        assert one(reconnected, 4) == 4


def test_execute_wrapper_hooks_see_every_statement_of_a_kept_cursor() -> None:
    seen: list[str] = []

    def spy(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        seen.append(sql)
        return execute(sql, params, many, context)

    with binding_cursor() as cursor:
        one(cursor, 1)
    with connection.execute_wrapper(spy):
        for n in range(3):
            with binding_cursor() as cursor:
                one(cursor, n)
    assert seen == ["SELECT $1::int"] * 3
