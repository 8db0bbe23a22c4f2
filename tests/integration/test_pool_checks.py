"""The health check of a worker's pool (CONN_HEALTH_CHECKS) on PostgreSQL: a connection that
``db.release()`` handed back a moment ago goes out again without it; any other goes out
checked, as psycopg's pool checks it."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from django.db import OperationalError, connection, connections

from durable_agents._internal import db
from tests.conftest import database_url

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


def _drop_pool() -> None:
    connection.close()
    if connection.settings_dict.get("OPTIONS", {}).get("pool"):
        connection.close_pool()  # type: ignore[attr-defined]


@contextlib.contextmanager
def saved_settings() -> Iterator[dict[str, Any]]:
    """The default database's settings, restored (and the pool dropped) on the way out."""
    settings = connections.settings["default"]
    saved = copy.deepcopy(
        {k: settings.get(k) for k in ("OPTIONS", "CONN_MAX_AGE", "CONN_HEALTH_CHECKS")}
    )
    try:
        _drop_pool()
        yield settings
    finally:
        _drop_pool()
        settings.update(saved)


@pytest.fixture
def checks() -> Iterator[list[Any]]:
    """A worker's pool of one with CONN_HEALTH_CHECKS on; the connections the pool's own
    check was asked about, in order."""
    asked: list[Any] = []
    with saved_settings() as settings:
        settings["CONN_HEALTH_CHECKS"] = True
        assert db.use_pool(1)  # one connection: each checkout takes the one handed back last
        wrapper = connection.pool._check  # type: ignore[attr-defined]
        assert isinstance(wrapper, db._CheckUnlessJustReleased)
        check = wrapper.check

        def spy(conn: Any) -> None:
            asked.append(conn)
            check(conn)

        wrapper.check = spy
        yield asked


def test_the_projects_pool_options_are_kept_but_the_size() -> None:
    with saved_settings() as settings:
        settings.setdefault("OPTIONS", {})["pool"] = {"min_size": 4, "max_idle": 30.0}
        assert db.use_pool(2)
        assert settings["OPTIONS"]["pool"] == {
            "min_size": 2,  # at most the pool's size, which psycopg requires
            "max_size": 2,
            "max_idle": 30.0,
            "timeout": 60.0,
        }
        select_one()  # the pool opens with them


def select_one() -> None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")


def test_a_connection_released_a_moment_ago_goes_out_unchecked(checks: list[Any]) -> None:
    select_one()
    assert len(checks) == 1  # the first checkout: checked
    db.release()
    select_one()
    assert len(checks) == 1  # handed back by release() just now: no round trip
    db.release()
    wrapper = connection.pool._check  # type: ignore[attr-defined]
    for conn_id in wrapper.released:  # as if the release were older than the window
        wrapper.released[conn_id] -= db.JUST_RELEASED_SECONDS
    select_one()
    assert len(checks) == 2
    connection.close()  # handed back by another way than release(): checked next time
    select_one()
    assert len(checks) == 3
    db.release()
    select_one()
    assert len(checks) == 3


def test_a_connection_that_died_after_its_release_fails_one_statement_and_is_dropped(
    checks: list[Any],
) -> None:
    select_one()
    pid = connection.connection.info.backend_pid
    db.release()
    with psycopg.connect(database_url(), autocommit=True) as k:
        k.execute("SELECT pg_terminate_backend(%s)", [pid])
    # Unchecked, as it was released a moment ago: its next statement finds it dead, with the
    # error any lost connection raises (which the worker's commits and claims retry).
    with pytest.raises(OperationalError):
        select_one()
    connection.close()  # what the worker does with a connection that failed
    select_one()  # a fresh or checked connection: the pool dropped the dead one
    assert connection.connection.info.backend_pid != pid
