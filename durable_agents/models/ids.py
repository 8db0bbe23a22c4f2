"""Run ids: time-ordered UUIDs (version 7, RFC 9562), and what is read back from them.

A run id begins with the millisecond it was made, so ids sort by start time: the primary key
of ``agent_run`` grows at its right edge instead of splitting pages all over the index, and
the day a run started is known from its id alone. That day is the partition of the step log a
run's steps live in (``step_part``): every statement that writes a step can compute it without
reading the run, and PostgreSQL checks it (a CHECK constraint on ``agent_step``).

Layout (128 bits): 48 bits of Unix time in milliseconds, the version (7), 12 bits, the
variant (0b10), 62 bits. The 12 bits and the first 30 of the 62 are a counter that starts at
a random value below 2**41 each millisecond and is incremented for each further id made in the
same millisecond, so that ids of one process are strictly increasing; the last 32 bits are
random. Runs made before this scheme have random (version 4) ids: they keep them, and their
steps stay in the legacy partition (``LEGACY_PART``).

Python 3.11 has no ``uuid.uuid7`` (3.14 has), hence this module.
"""

from __future__ import annotations

import datetime
import os
import threading
import time
import uuid

MS_PER_DAY = 86_400_000
# The partition of the step log that holds the steps of runs whose id is not time-ordered.
LEGACY_PART = 0

# How many hex digits of a run id the admin and the live stream show to tell runs apart.
SHORT_ID_DIGITS = 8

_COUNTER_BITS = 42
_COUNTER_MAX = (1 << _COUNTER_BITS) - 1
# A new millisecond's counter starts below this, leaving 2**41 increments before it overflows.
_COUNTER_START = 1 << (_COUNTER_BITS - 1)
# A clock set back by more than this is followed (ids of the earlier time would otherwise be
# made for as long as it takes the clock to catch up); a smaller step back is absorbed.
_FOLLOW_BACKWARDS_MS = 10_000

_lock = threading.Lock()
_last_ms = -1
_last_counter = 0


def _random_bits(bits: int) -> int:
    return int.from_bytes(os.urandom((bits + 7) // 8), "big") >> (-bits % 8)


def _assemble(ms: int, counter: int, tail: int) -> uuid.UUID:
    rand_a = counter >> 30  # 12 bits
    rand_b = ((counter & ((1 << 30) - 1)) << 32) | tail  # 62 bits
    value = (ms << 80) | (0x7 << 76) | (rand_a << 64) | (0b10 << 62) | rand_b
    return uuid.UUID(int=value)


def new_run_id(now_ms: int | None = None) -> uuid.UUID:
    """A new time-ordered run id. Strictly greater than every id this process made before,
    unless the clock was set back by more than ten seconds (then it follows the clock)."""
    global _last_ms, _last_counter
    ms = time.time_ns() // 1_000_000 if now_ms is None else now_ms
    with _lock:
        if _last_ms - _FOLLOW_BACKWARDS_MS <= ms <= _last_ms:
            # The same millisecond, or a clock a little behind the last id: count on.
            ms = _last_ms
            counter = _last_counter + 1
            if counter > _COUNTER_MAX:  # 2**41 ids in one millisecond: borrow the next one
                ms += 1
                counter = _random_bits(_COUNTER_BITS - 1)
        else:
            counter = _random_bits(_COUNTER_BITS - 1)
        _last_ms, _last_counter = ms, counter
    return _assemble(ms, counter, _random_bits(32))


def is_time_ordered(run_id: uuid.UUID) -> bool:
    return run_id.version == 7 and run_id.variant == uuid.RFC_4122


def millis_of(run_id: uuid.UUID) -> int | None:
    """The Unix time in milliseconds a time-ordered id was made at; None for other ids."""
    if not is_time_ordered(run_id):
        return None
    return run_id.int >> 80


def time_of(run_id: uuid.UUID) -> datetime.datetime | None:
    """When a time-ordered id was made (UTC, to the millisecond); None for other ids."""
    ms = millis_of(run_id)
    if ms is None:
        return None
    return datetime.datetime.fromtimestamp(ms / 1000, tz=datetime.UTC)


def first_id_at(moment: datetime.datetime) -> uuid.UUID:
    """The smallest time-ordered id of ``moment``'s millisecond: ids made at or after
    ``moment`` are >= it, ids made before are < it (a range of ids is a range of time)."""
    ms = int(moment.timestamp() * 1000)
    return uuid.UUID(int=(ms << 80) | (0x7 << 76) | (0b10 << 62))


def as_uuid(run_id: uuid.UUID | str) -> uuid.UUID:
    """A run id as a UUID, whether given as one or as its text (hex, with or without dashes)."""
    return run_id if isinstance(run_id, uuid.UUID) else uuid.UUID(str(run_id))


def step_part(run_id: uuid.UUID | str) -> int:
    """The partition of the step log the steps of ``run_id`` live in: the day (since
    1970-01-01, UTC) its id was made for a time-ordered id, ``LEGACY_PART`` for any other.
    The CHECK constraint ``agent_step_part_of_run`` computes the same in SQL."""
    ms = millis_of(as_uuid(run_id))
    return LEGACY_PART if ms is None else ms // MS_PER_DAY


def day_of_part(part: int) -> datetime.date:
    return datetime.date(1970, 1, 1) + datetime.timedelta(days=part)


def part_of_day(day: datetime.date) -> int:
    return (day - datetime.date(1970, 1, 1)).days


def short_id(run_id: uuid.UUID | str) -> str:
    """Eight hex digits that tell a run from its neighbours in a list: the last eight of a
    time-ordered id (its first ones are the same for every run of the same minute), the first
    eight of any other (what was always shown for those)."""
    value = as_uuid(run_id)
    digits = value.hex
    if is_time_ordered(value):
        return digits[-SHORT_ID_DIGITS:]
    return digits[:SHORT_ID_DIGITS]
