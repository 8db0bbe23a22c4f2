"""``runagents`` tunes Python's garbage collector for a long-lived worker process
(``WORKER_GC_THRESHOLD``): the start-up objects frozen, young collections less often."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from durable_agents.management.commands.runagents import _tune_garbage_collector


@pytest.fixture
def collector_restored() -> Iterator[None]:
    thresholds = gc.get_threshold()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)


@pytest.mark.usefixtures("collector_restored")
def test_the_start_up_is_frozen_and_young_collections_come_at_the_threshold() -> None:
    _, middle, oldest = gc.get_threshold()
    _tune_garbage_collector(12_345)
    assert gc.get_threshold() == (12_345, middle, oldest)
    assert gc.get_freeze_count() > 1000  # this process's modules, at least


@pytest.mark.usefixtures("collector_restored")
def test_zero_leaves_the_collector_as_it_is() -> None:
    before = gc.get_threshold()
    frozen = gc.get_freeze_count()
    _tune_garbage_collector(0)
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == frozen
