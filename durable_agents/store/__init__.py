"""The store: one interface (``base.Store``) for every status transition of runs and intents,
with one implementation per database, chosen once.

    base.py       the flow (create -> claim -> renew -> append_step -> finish/release/park ->
                  wake) and the abstract ``Store``; ``Claim``, ``NextClaim``, ``StepWrite``
                  (a step to commit), ``Parked``, ...
    postgres.py   ``PostgresStore``: one statement per claim, step, finish-and-claim, heartbeat
    portable.py   ``PortableStore``: the Django ORM (SQLite; a caller's transaction)
    memory.py     ``InMemoryStore``: dicts under a lock, the test double without a database

Each is one class with ``Store`` as its only base, calling modules of plain functions, one per
concern (portable_runs, portable_batch, portable_logs, portable_trees, portable_debounce,
portable_schedules, postgres_claims, postgres_steps, postgres_debounce, postgres_schedules,
memory_waits). Firing schedules needs ``ScheduleStore`` besides (``schedule_store(store)``):
the database stores keep it.

``store_for(connection)`` picks the implementation: by the connection's vendor (one cached
instance per class), except inside a caller's open transaction (``in_atomic_block``), where
the portable store runs each operation in a savepoint of that transaction. ``current()`` is
``store_for`` of the default connection; the worker and the runner call its methods (or those
of a store they were given).
"""

from __future__ import annotations

import functools

from django.db import connection as default_connection
from django.db.backends.base.base import BaseDatabaseWrapper

from durable_agents.store.base import (
    MAX_REASON_CHARS,
    Claim,
    LeaseLoss,
    NextClaim,
    Parked,
    ScheduleStore,
    StepWrite,
    Store,
    schedule_store,
)
from durable_agents.store.memory import InMemoryStore
from durable_agents.store.portable import PortableStore
from durable_agents.store.postgres import PostgresStore

__all__ = [
    "DIALECTS",
    "MAX_REASON_CHARS",
    "Claim",
    "InMemoryStore",
    "LeaseLoss",
    "NextClaim",
    "Parked",
    "PortableStore",
    "PostgresStore",
    "ScheduleStore",
    "StepWrite",
    "Store",
    "current",
    "dialect_store",
    "schedule_store",
    "store_for",
]

# The store of each database vendor; any other vendor gets the portable one.
DIALECTS: dict[str, type[Store]] = {"postgresql": PostgresStore}


@functools.cache
def _instance(cls: type[Store]) -> Store:
    return cls()


def dialect_store(vendor: str) -> Store:
    """The store written for ``vendor`` (one instance per process)."""
    return _instance(DIALECTS.get(vendor, PortableStore))


def store_for(connection: BaseDatabaseWrapper) -> Store:
    """The store to use on ``connection`` (a Django ``DatabaseWrapper``) now: the portable
    one inside a caller's open transaction, the vendor's otherwise."""
    if connection.in_atomic_block:
        return _instance(PortableStore)
    return dialect_store(connection.vendor)


def current() -> Store:
    """The store of this thread's default connection."""
    return store_for(default_connection)
