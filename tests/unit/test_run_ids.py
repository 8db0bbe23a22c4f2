"""Time-ordered run ids (durable_agents.models.ids)."""

from __future__ import annotations

import datetime
import threading
import uuid

import pytest
from django.template import Context, Template

from durable_agents.models import ids

pytestmark = pytest.mark.unit


def test_an_id_is_a_version_7_uuid_that_carries_its_millisecond() -> None:
    at = datetime.datetime(2026, 12, 6, 9, 30, 1, 234000, tzinfo=datetime.UTC)
    run_id = ids.new_run_id(int(at.timestamp() * 1000))
    assert run_id.version == 7
    assert run_id.variant == uuid.RFC_4122
    assert ids.time_of(run_id) == at
    assert str(run_id).startswith(f"{int(at.timestamp() * 1000):012x}"[:8])


def test_ids_of_one_process_strictly_increase_within_a_millisecond() -> None:
    made = [ids.new_run_id(1_800_000_000_000) for _ in range(5000)]
    assert made == sorted(made)
    assert len(set(made)) == len(made)
    assert {ids.millis_of(i) for i in made} == {1_800_000_000_000}


def test_ids_from_many_threads_are_all_distinct() -> None:
    made: list[uuid.UUID] = []
    lock = threading.Lock()

    def make() -> None:
        mine = [ids.new_run_id() for _ in range(2000)]
        with lock:
            made.extend(mine)

    threads = [threading.Thread(target=make) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(made)) == 16000


def test_a_clock_a_little_behind_counts_on_and_a_clock_set_far_back_is_followed() -> None:
    ahead = ids.new_run_id(1_900_000_000_000)
    behind = ids.new_run_id(1_900_000_000_000 - 5_000)  # 5 s back: absorbed
    assert behind > ahead
    assert ids.millis_of(behind) == 1_900_000_000_000
    far = ids.new_run_id(1_900_000_000_000 - 3_600_000)  # an hour back: followed
    assert ids.millis_of(far) == 1_900_000_000_000 - 3_600_000
    assert ids.step_part(far) == (1_900_000_000_000 - 3_600_000) // ids.MS_PER_DAY


def test_a_counter_that_overflows_borrows_the_next_millisecond(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    first = ids.new_run_id(2_000_000_000_000)
    monkeypatch.setattr(ids, "_last_counter", ids._COUNTER_MAX)
    after = ids.new_run_id(2_000_000_000_000)
    assert after > first
    assert ids.millis_of(after) == 2_000_000_000_001


def test_random_ids_are_legacy_and_have_no_time() -> None:
    old = uuid.UUID("9f3c2a10-1111-4222-8333-444455556666")
    assert not ids.is_time_ordered(old)
    assert ids.time_of(old) is None
    assert ids.step_part(old) == ids.LEGACY_PART
    assert ids.short_id(old) == "9f3c2a10"


def test_the_part_is_the_day_the_id_was_made() -> None:
    at = datetime.datetime(2026, 12, 6, 23, 59, 59, 999000, tzinfo=datetime.UTC)
    run_id = ids.new_run_id(int(at.timestamp() * 1000))
    assert ids.day_of_part(ids.step_part(run_id)) == datetime.date(2026, 12, 6)
    assert ids.part_of_day(datetime.date(2026, 12, 6)) == ids.step_part(run_id)
    next_day = ids.new_run_id(int(at.timestamp() * 1000) + 1)
    assert ids.step_part(next_day) == ids.step_part(run_id) + 1


def test_first_id_at_bounds_the_ids_of_a_time() -> None:
    at = datetime.datetime(2026, 12, 6, tzinfo=datetime.UTC)
    ms = int(at.timestamp() * 1000)
    assert ids.new_run_id(ms - 20_000) < ids.first_id_at(at) <= ids.new_run_id(ms)


def test_the_short_id_of_a_time_ordered_id_is_its_random_tail() -> None:
    a, b = ids.new_run_id(2_100_000_000_000), ids.new_run_id(2_100_000_000_000)
    assert a.hex[:8] == b.hex[:8]  # the same minute: the head tells them not apart
    assert ids.short_id(a) == a.hex[-8:] != ids.short_id(b)
    assert ids.short_id(str(a)) == ids.short_id(a)


def test_templates_show_the_short_id_through_their_filter() -> None:
    ordered = ids.new_run_id(2_100_000_000_000)
    old = uuid.UUID("9f3c2a10-1111-4222-8333-444455556666")
    page = Template(
        "{% load durable_agents_text %}"
        "{{ ordered|short_id }} {{ ordered_text|short_id }} {{ old|short_id }}"
        " [{{ none|short_id }}]"
    ).render(Context({"ordered": ordered, "ordered_text": str(ordered), "old": old, "none": None}))
    tail = ordered.hex[-8:]
    assert page == f"{tail} {tail} 9f3c2a10 []"
