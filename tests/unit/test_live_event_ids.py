"""Event ids as a client sends them back (``after=``, ``Last-Event-ID``): only what the stream
itself could have given is taken; a negative or out-of-range number is refused."""

from __future__ import annotations

import uuid

import pytest

from durable_agents.live.events import BadEventId, Cursor

RUN = uuid.UUID("6f1c0d7e-0000-4000-8000-000000000000")
TAG = RUN.hex[:8]


@pytest.mark.parametrize(
    "cursor",
    [
        Cursor(),  # before the first step: seq -1
        Cursor(0, 0, "p", 0, 0),
        Cursor(12, 40, "r", 3, 17),
        Cursor(999_999_999, 999_999_999_999_999_999, "S", 999_999_999, 999_999_999),
    ],
)
def test_an_id_the_stream_gives_names_its_cursor(cursor: Cursor) -> None:
    assert Cursor.parse(RUN, cursor.id_for(RUN)) == cursor


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
