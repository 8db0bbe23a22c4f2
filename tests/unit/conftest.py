"""Unit tests: no database. Nothing here is marked ``django_db``, so pytest-django refuses any
query: a test that reached the database would fail, which is what proves it does not."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from durable_agents import llm
from durable_agents.store import InMemoryStore
from durable_agents.store.memory import ManualClock


@pytest.fixture(autouse=True)
def offline_and_quiet(settings: Any) -> Iterator[None]:
    """The offline scripted model, and no notifications (their recipients are in the
    database)."""
    settings.DURABLE_AGENTS = {**settings.DURABLE_AGENTS, "OFFLINE": True, "NOTIFY": False}
    llm.reset_clients()
    yield
    llm.reset_clients()


@pytest.fixture
def clock() -> ManualClock:
    """The in-memory store's clock: leases and timers move only when a test advances it."""
    return ManualClock()


@pytest.fixture
def store(clock: ManualClock) -> InMemoryStore:
    """The store of a unit test: every transition, no database."""
    return InMemoryStore(now=clock)
