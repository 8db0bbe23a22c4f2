"""Event ids as a client sends them back (``after=``, ``Last-Event-ID``): only what the stream
itself could have given is taken, ids tagged as before time-ordered run ids too; a negative or
out-of-range number is refused."""

from __future__ import annotations

import uuid

import pytest

from durable_agents.live.events import BadEventId, Cursor
from durable_agents.models import new_run_id, short_id

RUN = uuid.UUID("6f1c0d7e-0000-4000-8000-000000000000")  # a random (version 4) id
TAG = short_id(RUN)
ORDERED_RUN = new_run_id(now_ms=1_700_000_000_000)  # a time-ordered (version 7) id


@pytest.mark.parametrize(
    "cursor",
    [
        Cursor(),  # before the first step: seq -1
        Cursor(0, 0, "p", 0, 0),
        Cursor(12, 40, "r", 3, 17),
        Cursor(999_999_999, 999_999_999_999_999_999, "S", 999_999_999, 999_999_999),
    ],
)
@pytest.mark.parametrize("run_id", [RUN, ORDERED_RUN])
def test_an_id_the_stream_gives_names_its_cursor(cursor: Cursor, run_id: uuid.UUID) -> None:
    assert Cursor.parse(run_id, cursor.id_for(run_id)) == cursor


def test_an_id_is_tagged_with_the_runs_short_id() -> None:
    cursor = Cursor(3, 7, "r", 0, 0)
    assert cursor.id_for(RUN) == "6f1c0d7e:3.7.r.0.0"  # a random id: its first digits
    tail = ORDERED_RUN.hex[-8:]
    assert cursor.id_for(ORDERED_RUN) == f"{tail}:3.7.r.0.0"  # a time-ordered one: its last
    assert Cursor.parse(ORDERED_RUN, f"{tail}:3.7.r.0.0") == cursor


def test_an_id_tagged_before_short_ids_were_the_last_digits_still_resumes() -> None:
    """A page open across the upgrade reconnects with an id tagged with the first 8 digits of
    the run id (what every id was tagged with before)."""
    cursor = Cursor(3, 7, "r", 1, 2)
    assert Cursor.parse(RUN, f"{RUN.hex[:8]}:3.7.r.1.2") == cursor
    assert Cursor.parse(ORDERED_RUN, f"{ORDERED_RUN.hex[:8]}:3.7.r.1.2") == cursor


def test_an_id_of_another_runs_stream_is_refused() -> None:
    # A run of the same millisecond: the same first digits, another short id.
    neighbour = new_run_id(now_ms=1_700_000_000_000)
    assert neighbour.hex[:8] == ORDERED_RUN.hex[:8]
    with pytest.raises(BadEventId, match="another run"):
        Cursor.parse(ORDERED_RUN, Cursor(3).id_for(neighbour))
    # The last digits of a random id are not its short id.
    with pytest.raises(BadEventId, match="another run"):
        Cursor.parse(RUN, f"{RUN.hex[-8:]}:3.0.r.0.0")


@pytest.mark.parametrize(
    "number_out_of_range",
    [
        f"{TAG}:-999999.0..0.0",  # a seq far behind: the run's shared watch would never move
        f"{TAG}:-2.0.r.0.0",
        f"{TAG}:-0.0.r.0.0",
        f"{TAG}:1.-1.r.0.0",
        f"{TAG}:1.0.r.-1.0",
        f"{TAG}:1.0.r.0.-1",
        f"{TAG}:1234567890.0.r.0.0",  # past an integer column
        f"{TAG}:1.1234567890123456789.r.0.0",  # past a bigint one
        f"{TAG}:1.0.r.0.0\n",  # a trailing newline
        f"{TAG}:\u0661.0.r.0.0",  # a digit of another script (int() would take it)
    ],
)
def test_an_id_with_a_number_out_of_range_is_refused(number_out_of_range: str) -> None:
    with pytest.raises(BadEventId):
        Cursor.parse(RUN, number_out_of_range)
