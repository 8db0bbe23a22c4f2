"""The step log in partitions on PostgreSQL: ``agent_step`` is partitioned by RANGE (part), one
partition a day, so that retention drops a day of steps as one file instead of deleting its
rows one by one.

    part          the day (since 1970-01-01, UTC) the run's id was made (models/ids.py), 0 for
                  runs with random ids; a CHECK (PART_OF_RUN) holds every row to its run's id,
                  so that the primary key (run_id, seq, part) keeps (run_id, seq) unique
    partitions    agent_step_legacy   FOR VALUES FROM (0) TO (1): the table as it was before
                                      (runs with random ids), emptied row by row by retention
                  agent_step_pNNNNN   FOR VALUES FROM (N) TO (N + 1): the steps of the runs
                                      made on day N
                  agent_step_default  DEFAULT: a step whose day has no partition (a clock set
                                      far ahead or back, housekeeping stopped for weeks) is
                                      never refused; check W060 names those days
    convert       (migration 0025, once) the plain table becomes the legacy partition of a new
                  partitioned table, without rewriting it and without holding an exclusive lock
                  longer than the catalogue changes take (CONVERT_STEPS)
    ensure        days ahead created beside the table and attached (ATTACH takes SHARE UPDATE
                  EXCLUSIVE on agent_step: commits go on) by every worker at start and by
                  housekeeping's sweep (ensure_days)
    drop          retention, for a day older than RETENTION_DAYS whose runs have all been
                  deleted: DETACH (an exclusive lock of a few milliseconds, waited for at
                  most DETACH_LOCK_TIMEOUT at a time), then, if no run of that day appeared
                  meanwhile, DROP (drop_day); a day a killed retention left detached is
                  dropped or attached again by the next (settle_leftover)
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from django.db import OperationalError

from durable_agents.models.ids import LEGACY_PART, part_of_day

logger = logging.getLogger("durable_agents.housekeeping")
T = TypeVar("T")

TABLE = "agent_step"
LEGACY = "agent_step_legacy"
DEFAULT = "agent_step_default"
# Days created ahead of today (and one behind, for clocks a little slow).
DAYS_AHEAD = 7
# What a catalogue change waits for its lock before it is tried again (a long transaction that
# holds agent_step must never queue the workers' commits behind the change).
LOCK_TIMEOUT = "2s"
LOCK_ATTEMPTS = 30
# What retention's DETACH of a day waits for its exclusive lock on agent_step (commits queue
# behind it meanwhile), before stepping aside and trying again.
DETACH_LOCK_TIMEOUT = "300ms"
LOCK_NOT_AVAILABLE = "55P03"
# One creator of partitions at a time across the fleet (pg_advisory_xact_lock's key).
ADVISORY_KEY = 0x64615F70  # "da_p"


# The part a run id gives, in SQL (models.ids.step_part in Python): the first 48 bits of a
# version-7 id are milliseconds since 1970.
def part_of_run(column: str) -> str:
    """The part of the run whose id is ``column``, in SQL."""
    return (
        f"CASE WHEN substr({column}::text, 15, 1) = '7'"
        f" AND substr({column}::text, 20, 1) IN ('8', '9', 'a', 'b')"
        f" THEN (('x' || translate(left({column}::text, 13), '-', ''))::bit(48)::bigint"
        " / 86400000)::integer"
        f" ELSE {LEGACY_PART} END"
    )


PART_OF_RUN = part_of_run("run_id")
# Every partition checks that its rows are of their run's day: the days and the default from
# their creation; the legacy partition for the rows written after the conversion only (NOT
# VALID: the rows it had were all written with part 0, and some random ids written by other
# tools than this app look time-ordered). So (run_id, seq, part) unique keeps (run_id, seq)
# unique.
PART_CHECK = "agent_step_part_of_run"
PART_OF_RUN_CONSTRAINT = f"CONSTRAINT {PART_CHECK} CHECK (part = {PART_OF_RUN})"


def partition_name(part: int) -> str:
    return f"{TABLE}_p{part:05d}"


@dataclass(frozen=True)
class Partition:
    name: str
    lo: int | None  # None: the default partition
    hi: int | None
    detach_pending: bool


# -- reading the catalogue ---------------------------------------------------------------------


def is_partitioned(cursor: Any) -> bool:
    cursor.execute("SELECT relkind FROM pg_class WHERE oid = to_regclass(%s)", [TABLE])
    row = cursor.fetchone()
    return bool(row and row[0] == "p")


PARTITIONS_SQL = """
SELECT c.relname, pg_get_expr(c.relpartbound, c.oid), i.inhdetachpending
  FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
 WHERE i.inhparent = to_regclass(%s)
"""


def partitions(cursor: Any) -> list[Partition]:
    """agent_step's partitions with their bounds (FROM (lo) TO (hi)), by lo."""
    cursor.execute(PARTITIONS_SQL, [TABLE])
    found = []
    for name, bound, pending in cursor.fetchall():
        if bound == "DEFAULT":
            found.append(Partition(name, None, None, pending))
            continue
        # "FOR VALUES FROM (20428) TO (20429)"
        lo_text = bound.split("FROM (", 1)[1].split(")", 1)[0]
        hi_text = bound.split("TO (", 1)[1].split(")", 1)[0]
        found.append(Partition(name, int(lo_text), int(hi_text), pending))
    return sorted(found, key=lambda p: (p.lo is None, p.lo or 0))


def default_days(cursor: Any) -> list[tuple[int, int]]:
    """(part, steps) of what the default partition holds: days that had no partition."""
    cursor.execute(f"SELECT part, count(*) FROM {DEFAULT} GROUP BY part ORDER BY part")
    return [(int(part), int(count)) for part, count in cursor.fetchall()]


# -- making days ------------------------------------------------------------------------------


def _briefly(
    cursor: Any,
    statement: str,
    params: list[Any] | None = None,
    lock_timeout: str = LOCK_TIMEOUT,
) -> None:
    """A catalogue change with a short lock_timeout, tried again until it gets its lock."""

    def once() -> None:
        cursor.execute(f"SET lock_timeout = '{lock_timeout}'")
        try:
            cursor.execute(statement, params)
        finally:
            cursor.execute("RESET lock_timeout")

    _until_locked(once)


def _until_locked(change: Callable[[], T]) -> T:
    """``change()``, again after half a second each time it gave up waiting for a lock
    (lock_timeout), LOCK_ATTEMPTS times at most."""
    for attempt in range(1, LOCK_ATTEMPTS + 1):
        try:
            return change()
        except OperationalError as exc:
            lost = getattr(exc.__cause__, "sqlstate", None) == LOCK_NOT_AVAILABLE
            if not lost or attempt == LOCK_ATTEMPTS:
                raise
            time.sleep(0.5)
    raise AssertionError("unreachable")


def ensure_days(connection: Any, first: int, last: int) -> list[str]:
    """Partitions for the days ``first`` to ``last`` (parts, inclusive) that do not exist yet,
    each created beside agent_step and attached; a day that the default partition already
    holds steps of is left to the default (check W060 names it). Returns the names made.
    Needs autocommit (each day is its own transaction)."""
    made: list[str] = []
    with connection.cursor() as cursor:
        if not is_partitioned(cursor):
            return made
        existing = partitions(cursor)
        covered = [(p.lo, p.hi) for p in existing if p.lo is not None and p.hi is not None]
        wanted = [
            part
            for part in range(first, last + 1)
            if not any(lo <= part < hi for lo, hi in covered)
        ]
        for part in wanted:
            if _make_day(cursor, part):
                made.append(partition_name(part))
    if made:
        logger.info("step log: made partitions %s", ", ".join(made))
    return made


def _make_day(cursor: Any, part: int) -> bool:
    """One day's partition, in a transaction of its own (tried again when its lock waits too
    long); False if another worker made it first or the default partition holds that day."""
    return _until_locked(lambda: _make_day_once(cursor, part))


def _make_day_once(cursor: Any, part: int) -> bool:
    name = partition_name(part)
    cursor.execute("BEGIN")
    try:
        cursor.execute(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'")
        cursor.execute("SELECT pg_advisory_xact_lock(%s)", [ADVISORY_KEY])
        cursor.execute("SELECT to_regclass(%s) IS NOT NULL", [name])
        exists = cursor.fetchone()[0]
        cursor.execute(f"SELECT EXISTS (SELECT 1 FROM {DEFAULT} WHERE part = %s)", [part])
        in_default = cursor.fetchone()[0]
        if exists or in_default:
            cursor.execute("COMMIT")
            return False
        cursor.execute(
            f'CREATE TABLE "{name}" (LIKE {TABLE} INCLUDING DEFAULTS INCLUDING CONSTRAINTS'
            f" INCLUDING COMPRESSION, CONSTRAINT {name}_day CHECK (part >= {part}"
            f" AND part < {part + 1}))"
        )
        _check_part_of_run(cursor, name)
        # SHARE UPDATE EXCLUSIVE on agent_step (commits go on); the new table is empty and
        # its CHECK proves the range, so nothing is scanned but the default partition.
        cursor.execute(
            f'ALTER TABLE {TABLE} ATTACH PARTITION "{name}"'
            f" FOR VALUES FROM ({part}) TO ({part + 1})"
        )
        cursor.execute("COMMIT")
    except BaseException:
        cursor.execute("ROLLBACK")
        raise
    return True


def adopt_default_days(connection: Any) -> list[str]:
    """Each day the default partition holds steps of gets its own partition, its steps moved
    there. The default partition is detached for the move (an exclusive lock on agent_step
    for as long as moving those few rows takes: it only ever holds the steps of days that had
    no partition). Needs autocommit."""
    made: list[str] = []
    with connection.cursor() as cursor:
        if not is_partitioned(cursor):
            return made
        for part, _count in default_days(cursor):
            name = partition_name(part)
            cursor.execute("BEGIN")
            try:
                cursor.execute(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'")
                cursor.execute("SELECT pg_advisory_xact_lock(%s)", [ADVISORY_KEY])
                cursor.execute(f"ALTER TABLE {TABLE} DETACH PARTITION {DEFAULT}")
                cursor.execute(
                    f'CREATE TABLE IF NOT EXISTS "{name}" (LIKE {TABLE} INCLUDING DEFAULTS'
                    " INCLUDING CONSTRAINTS INCLUDING COMPRESSION)"
                )
                _check_part_of_run(cursor, name)
                cursor.execute(
                    f'INSERT INTO "{name}" SELECT * FROM {DEFAULT} WHERE part = %s',
                    [part],
                )
                cursor.execute(f"DELETE FROM {DEFAULT} WHERE part = %s", [part])
                cursor.execute(
                    f'ALTER TABLE {TABLE} ATTACH PARTITION "{name}"'
                    f" FOR VALUES FROM ({part}) TO ({part + 1})"
                )
                cursor.execute(f"ALTER TABLE {TABLE} ATTACH PARTITION {DEFAULT} DEFAULT")
                cursor.execute("COMMIT")
            except BaseException:
                cursor.execute("ROLLBACK")
                raise
            made.append(name)
    if made:
        logger.warning("step log: steps kept in the default partition moved to %s", made)
    return made


def _check_part_of_run(cursor: Any, name: str) -> None:
    """PART_OF_RUN_CONSTRAINT on a new partition's table (empty: nothing to scan), unless it
    has it already (copied from agent_step, which had it in a first form of migration 0025)."""
    if PART_CHECK not in _constraint_names(cursor, name, "c"):
        cursor.execute(f'ALTER TABLE "{name}" ADD {PART_OF_RUN_CONSTRAINT}')


def ensure_ahead(connection: Any, today: datetime.date | None = None) -> list[str]:
    """Yesterday to DAYS_AHEAD days from now (UTC)."""
    today = today or datetime.datetime.now(datetime.UTC).date()
    first = part_of_day(today) - 1
    return ensure_days(connection, first, first + 1 + DAYS_AHEAD)


def days_of_active_runs_without_partition(cursor: Any) -> list[tuple[int, int]]:
    """(part, runs) of runs not ended whose day has no partition, and whose steps the default
    partition does not hold either: a partition dropped by hand took their steps."""
    cursor.execute(
        f"SELECT {part_of_run('id')} AS part, count(*) FROM agent_run"
        " WHERE status IN ('pending', 'running', 'waiting') GROUP BY 1"
    )
    active = [(int(part), int(count)) for part, count in cursor.fetchall()]
    covered = [(p.lo, p.hi) for p in partitions(cursor)]
    in_default = {part for part, _ in default_days(cursor)}
    return [
        (part, count)
        for part, count in active
        if part not in in_default
        and not any(lo is not None and hi is not None and lo <= part < hi for lo, hi in covered)
    ]


def missing_days_ahead(cursor: Any, today: datetime.date | None = None) -> list[int]:
    """Today and tomorrow, if either has no partition (check W060)."""
    today = today or datetime.datetime.now(datetime.UTC).date()
    covered = [(p.lo, p.hi) for p in partitions(cursor) if p.lo is not None and p.hi is not None]
    wanted = [part_of_day(today), part_of_day(today) + 1]
    return [part for part in wanted if not any(lo <= part < hi for lo, hi in covered)]


# -- dropping days ----------------------------------------------------------------------------


def finish_pending_detaches(connection: Any) -> list[str]:
    """Detaches a killed retention left half done: finished, then the tables dropped by the
    retention that comes next (they hold only steps of deleted runs)."""
    finished: list[str] = []
    with connection.cursor() as cursor:
        if not is_partitioned(cursor):
            return finished
        for partition in partitions(cursor):
            if partition.detach_pending:
                _briefly(
                    cursor, f'ALTER TABLE {TABLE} DETACH PARTITION "{partition.name}" FINALIZE'
                )
                finished.append(partition.name)
    return finished


def detached_leftovers(cursor: Any) -> list[str]:
    """Tables named like a day of the step log that are no partition of it any more: what a
    retention killed between its DETACH and its DROP left behind."""
    cursor.execute(
        """
        SELECT c.relname FROM pg_class c
         WHERE c.relkind = 'r' AND c.relname ~ %s AND NOT c.relispartition
           AND c.relnamespace = (SELECT relnamespace FROM pg_class WHERE oid = to_regclass(%s))
        """,
        [rf"^{TABLE}_p[0-9]+$", TABLE],
    )
    return [row[0] for row in cursor.fetchall()]


RUNS_OF_DAY_SQL = """
SELECT EXISTS (SELECT 1 FROM agent_run WHERE id >= %s AND id < %s)
"""


def drop_day(connection: Any, partition: Partition, id_range: tuple[Any, Any]) -> bool:
    """Detach a day's partition and drop it, unless a run of that day exists once it is
    detached (a clock set back made one meanwhile): then it is attached again. ``id_range``:
    the run ids of that day. Needs autocommit.

    PostgreSQL refuses DETACH ... CONCURRENTLY beside a default partition, so the DETACH
    takes an exclusive lock on agent_step: a change of the catalogue only, but commits queue
    behind it while it waits for its lock. It waits at most DETACH_LOCK_TIMEOUT, then steps
    aside for a moment and tries again."""
    with connection.cursor() as cursor:
        _briefly(
            cursor,
            f'ALTER TABLE {TABLE} DETACH PARTITION "{partition.name}"',
            lock_timeout=DETACH_LOCK_TIMEOUT,
        )
    return settle_leftover(connection, partition.name, id_range)


def settle_leftover(connection: Any, name: str, id_range: tuple[Any, Any]) -> bool:
    """A day's table found detached (``detached_leftovers``): dropped if no run of its day
    exists (it holds steps of deleted runs only), else attached again (a retention was killed
    between its DETACH and putting the table back). Returns whether it was dropped."""
    part = int(name.rsplit("_p", 1)[1])
    with connection.cursor() as cursor:
        cursor.execute(RUNS_OF_DAY_SQL, list(id_range))
        if cursor.fetchone()[0]:
            _briefly(
                cursor,
                f'ALTER TABLE {TABLE} ATTACH PARTITION "{name}"'
                f" FOR VALUES FROM ({part}) TO ({part + 1})",
            )
            return False
        cursor.execute(f'DROP TABLE "{name}"')
    return True


# -- converting the plain table (migration 0025) ------------------------------------------------

# The flow of ``convert``, each step re-runnable (a migration killed half way is run again):
CONVERT_STEPS = """
1. ADD COLUMN part integer NOT NULL DEFAULT 0       catalogue only: every row reads 0
2. DROP the foreign key to agent_run                a day's steps outlive their runs briefly
3. CREATE UNIQUE INDEX CONCURRENTLY (run_id, seq, part)   built while commits go on
4. ADD CHECK part in [0, 1) NOT VALID; VALIDATE     scanned while commits go on
   ADD CHECK part_of_run NOT VALID                   for the rows written from now on
5. one transaction, catalogue only (lock_timeout, tried again):
     agent_step -> agent_step_legacy (its primary key becomes the index of 3, its other
     indexes renamed *_legacy); a new partitioned agent_step LIKE it; the legacy attached
     FOR VALUES FROM (0) TO (1) (no scan: the CHECKs of 4 prove it); the other indexes made
     on agent_step (each attaches the legacy's own, no build); the default partition and
     the days from yesterday to DAYS_AHEAD ahead
"""

_LEGACY_KEY = "agent_step_legacy_pkey"
_LEGACY_DAY = "agent_step_legacy_day"


def _constraint_names(cursor: Any, table: str, kind: str) -> list[str]:
    cursor.execute(
        "SELECT conname FROM pg_constraint WHERE conrelid = to_regclass(%s) AND contype = %s",
        [table, kind],
    )
    return [row[0] for row in cursor.fetchall()]


def _index_definitions(cursor: Any, table: str, keep_out: list[str]) -> list[tuple[str, str]]:
    """(name, CREATE INDEX statement) of ``table``'s indexes but those in ``keep_out``."""
    cursor.execute(
        "SELECT indexname, indexdef FROM pg_indexes"
        " WHERE tablename = %s AND schemaname = current_schema()",
        [table],
    )
    return [(name, ddl) for name, ddl in cursor.fetchall() if name not in keep_out]


def _add_checked(cursor: Any, name: str, condition: str) -> None:
    if name not in _constraint_names(cursor, TABLE, "c"):
        _briefly(cursor, f"ALTER TABLE {TABLE} ADD CONSTRAINT {name} CHECK ({condition}) NOT VALID")
    # VALIDATE takes SHARE UPDATE EXCLUSIVE: it scans while commits go on.
    _briefly(cursor, f"ALTER TABLE {TABLE} VALIDATE CONSTRAINT {name}")


def convert(connection: Any, today: datetime.date | None = None) -> None:
    """The plain agent_step becomes the legacy partition of a partitioned agent_step
    (CONVERT_STEPS). Needs autocommit (CREATE INDEX CONCURRENTLY)."""
    with connection.cursor() as cursor:
        if is_partitioned(cursor):
            ensure_ahead(connection, today)
            return
        _briefly(
            cursor,
            f"ALTER TABLE {TABLE} ADD COLUMN IF NOT EXISTS part integer NOT NULL"
            f" DEFAULT {LEGACY_PART}",
        )
        for name in _constraint_names(cursor, TABLE, "f"):
            _briefly(cursor, f'ALTER TABLE {TABLE} DROP CONSTRAINT "{name}"')
        cursor.execute(
            "SELECT i.indisvalid FROM pg_index i WHERE i.indexrelid = to_regclass(%s)",
            [_LEGACY_KEY],
        )
        row = cursor.fetchone()
        if row is not None and not row[0]:  # a CONCURRENTLY build that was killed
            cursor.execute(f"DROP INDEX CONCURRENTLY {_LEGACY_KEY}")
        cursor.execute(
            f"CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS {_LEGACY_KEY}"
            f" ON {TABLE} (run_id, seq, part)"
        )
        if PART_CHECK not in _constraint_names(cursor, TABLE, "c"):
            _briefly(cursor, f"ALTER TABLE {TABLE} ADD {PART_OF_RUN_CONSTRAINT} NOT VALID")
        _add_checked(cursor, _LEGACY_DAY, f"part >= {LEGACY_PART} AND part < {LEGACY_PART + 1}")
        _until_locked(lambda: _swap_in_partitioned(cursor, today))


def _swap_in_partitioned(cursor: Any, today: datetime.date | None) -> None:
    today = today or datetime.datetime.now(datetime.UTC).date()
    cursor.execute("BEGIN")
    try:
        cursor.execute(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'")
        (old_key,) = _constraint_names(cursor, TABLE, "p")
        indexes = _index_definitions(cursor, TABLE, keep_out=[old_key, _LEGACY_KEY])
        cursor.execute(f"ALTER TABLE {TABLE} RENAME TO {LEGACY}")
        cursor.execute(
            f'ALTER TABLE {LEGACY} DROP CONSTRAINT "{old_key}",'
            f" ADD CONSTRAINT {_LEGACY_KEY} PRIMARY KEY USING INDEX {_LEGACY_KEY}"
        )
        for name, _ddl in indexes:
            cursor.execute(f'ALTER INDEX "{name}" RENAME TO "{name}_legacy"')
        cursor.execute(
            f"CREATE TABLE {TABLE} (LIKE {LEGACY} INCLUDING DEFAULTS INCLUDING CONSTRAINTS"
            f" INCLUDING COMPRESSION, CONSTRAINT {TABLE}_pkey PRIMARY KEY (run_id, seq, part))"
            " PARTITION BY RANGE (part)"
        )
        # The partitions check themselves (PART_OF_RUN_CONSTRAINT), the legacy one its range.
        cursor.execute(
            f"ALTER TABLE {TABLE} DROP CONSTRAINT IF EXISTS {_LEGACY_DAY},"
            f" DROP CONSTRAINT IF EXISTS {PART_CHECK}"
        )
        cursor.execute(
            f"ALTER TABLE {TABLE} ATTACH PARTITION {LEGACY}"
            f" FOR VALUES FROM ({LEGACY_PART}) TO ({LEGACY_PART + 1})"
        )
        for _name, ddl in indexes:  # "CREATE INDEX name ON public.agent_step ...": the parent now
            cursor.execute(ddl)
        cursor.execute(
            f"CREATE TABLE {DEFAULT} PARTITION OF {TABLE} ({PART_OF_RUN_CONSTRAINT}) DEFAULT"
        )
        first = part_of_day(today) - 1
        for part in range(first, first + 2 + DAYS_AHEAD):
            cursor.execute(
                f"CREATE TABLE {partition_name(part)} PARTITION OF {TABLE}"
                f" ({PART_OF_RUN_CONSTRAINT}) FOR VALUES FROM ({part}) TO ({part + 1})"
            )
        cursor.execute("COMMIT")
    except BaseException:
        cursor.execute("ROLLBACK")
        raise


def unconvert(connection: Any) -> None:
    """Back to one plain table (rewrites every step: for going back on a small database)."""
    with connection.cursor() as cursor:
        if not is_partitioned(cursor):
            return
        cursor.execute("BEGIN")
        try:
            indexes = _index_definitions(cursor, TABLE, keep_out=[f"{TABLE}_pkey"])
            cursor.execute(
                f"CREATE TABLE {TABLE}_plain"
                f" (LIKE {TABLE} INCLUDING DEFAULTS INCLUDING COMPRESSION)"
            )
            cursor.execute(f"INSERT INTO {TABLE}_plain SELECT * FROM {TABLE}")
            cursor.execute(f"DROP TABLE {TABLE} CASCADE")
            cursor.execute(f"ALTER TABLE {TABLE}_plain RENAME TO {TABLE}")
            cursor.execute(f"ALTER TABLE {TABLE} DROP COLUMN part")
            cursor.execute(
                f"ALTER TABLE {TABLE} ADD CONSTRAINT {TABLE}_pkey PRIMARY KEY (run_id, seq),"
                f" ADD CONSTRAINT {TABLE}_attempt_check CHECK (attempt >= 0),"
                f" ADD CONSTRAINT {TABLE}_run_id_d7576eb8_fk_agent_run_id FOREIGN KEY (run_id)"
                " REFERENCES agent_run (id) DEFERRABLE INITIALLY DEFERRED"
            )
            for _name, ddl in indexes:
                cursor.execute(ddl)
            cursor.execute("COMMIT")
        except BaseException:
            cursor.execute("ROLLBACK")
            raise
