"""A worker slot's pooled connection around a call it can walk away from (``run_abortable``) on
PostgreSQL: handed back to the pool before the call goes out, or, when a commit runs meanwhile,
kept for that commit and handed back as soon as it is done, before the slot waits."""

from __future__ import annotations

import threading
import time

import pytest
from django.db import connection, connections

from durable_agents._internal import calls, db
from durable_agents._internal.interrupt import Interrupt
from tests.integration.test_pool_checks import saved_settings, select_one

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


def _checkouts() -> int:
    """How many times this process's pool handed out a connection so far."""
    return int(connection.pool.get_stats().get("requests_num", 0))  # type: ignore[attr-defined]


def _released_within(slot: object, seconds: float) -> bool:
    """Whether the slot's connection wrapper holds no connection, now or within ``seconds``
    (read from another thread: the call's)."""
    deadline = time.monotonic() + seconds
    while getattr(slot, "connection", True) is not None:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_a_call_hands_the_slots_connection_back_before_it_goes_out() -> None:
    with saved_settings():
        assert db.use_pool(2)
        select_one()
        slot = connections["default"]

        def call(abort: threading.Event) -> bool:
            return slot.connection is None  # read once, as the call starts

        assert calls.run_abortable(call, Interrupt()) is True


def test_a_commit_meanwhile_keeps_the_connection_and_hands_it_back_before_the_wait() -> None:
    with saved_settings():
        assert db.use_pool(2)
        select_one()  # the slot holds a connection, as after the inbox's probe
        slot = connections["default"]
        held = slot.connection
        checkouts = _checkouts()
        committed_on: list[object] = []

        def meanwhile() -> None:
            select_one()
            committed_on.append(connection.connection)

        def call(abort: threading.Event) -> bool:
            return _released_within(slot, 10.0)

        assert calls.run_abortable(call, Interrupt(), meanwhile=meanwhile) is True
        # The commit ran on the connection the slot held: no second checkout from the pool.
        assert committed_on == [held]
        assert _checkouts() == checkouts
        assert connection.connection is None  # and nothing is held once the call is over
