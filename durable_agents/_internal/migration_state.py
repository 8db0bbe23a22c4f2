"""Whether a database has the migrations durable_agents needs: one answer, in one sentence, for
``runagents`` (which asks before it starts) and for the public API (which asks only after the
database refused a statement: "relation agent_run does not exist", "no such table").

    unapplied_migrations(connection)   the migrations it needs that the database lacks
    NotMigrated(alias, unapplied)      the error, whose message says to run manage.py migrate
    not_migrated_after(error, alias)   after a database error: NotMigrated, or None
    explains_missing_tables(func)      a public operation whose missing-table errors say so

The API asks nothing before each call (no query is added to any call that works): the question
is asked once a statement has failed, when the answer decides what the user reads.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from django.db import DEFAULT_DB_ALIAS, DatabaseError, OperationalError, ProgrammingError
from django.db import connections as all_connections
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.migrations.executor import MigrationExecutor

from durable_agents.exceptions import NotMigrated

__all__ = ["NotMigrated", "explains_missing_tables", "not_migrated_after", "unapplied_migrations"]

P = ParamSpec("P")
R = TypeVar("R")


def unapplied_migrations(connection: BaseDatabaseWrapper) -> list[str]:
    """The migrations durable_agents needs (its own and those they depend on) that are not
    applied on ``connection``, as ``app_label.name``, in the order ``migrate`` would apply
    them. Reads ``django_migrations``: a ``DatabaseError`` when the database cannot answer."""
    executor = MigrationExecutor(connection)
    targets = executor.loader.graph.leaf_nodes("durable_agents")
    plan = executor.migration_plan(targets)
    return [f"{migration.app_label}.{migration.name}" for migration, _backwards in plan]


def not_migrated_after(error: DatabaseError, alias: str = DEFAULT_DB_ALIAS) -> NotMigrated | None:
    """After ``error`` (a statement the database refused): ``NotMigrated`` when the database
    lacks migrations of durable_agents, else None (the error is something else, or the
    database cannot say, and the caller re-raises it as it is)."""
    if not isinstance(error, ProgrammingError | OperationalError):
        return None  # an IntegrityError, a DataError: the tables are there
    try:
        unapplied = _unapplied_after_error(alias)
    except DatabaseError:
        return None
    # Only a migration of ours explains the error: an unapplied one of another app (after a
    # Django upgrade, say) says nothing about a lock timeout on our tables.
    if not any(name.startswith("durable_agents.") for name in unapplied):
        return None
    return NotMigrated(alias, unapplied)


def _unapplied_after_error(alias: str) -> list[str]:
    connection = all_connections[alias]
    try:
        return unapplied_migrations(connection)
    except DatabaseError:
        if not connection.in_atomic_block:
            raise
    # PostgreSQL refuses every statement of a transaction after a failed one, until the
    # caller's transaction ends: ask on a connection of our own, outside it.
    own = all_connections.create_connection(alias)
    try:
        return unapplied_migrations(own)
    finally:
        own.close()


def explains_missing_tables(func: Callable[P, R]) -> Callable[P, R]:
    """``func``, whose database errors become ``NotMigrated`` (chained from them) when the
    database lacks durable_agents' migrations; every other error is raised as it is."""

    @functools.wraps(func)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return func(*args, **kwargs)
        except DatabaseError as exc:
            not_migrated = not_migrated_after(exc)
            if not_migrated is None:
                raise
            raise not_migrated from exc

    return call
