"""The cursor of the claim and of the step commit on PostgreSQL (``binding_cursor``), and the
form in which it sends their statements.

    binding_cursor   a server-side-binding psycopg cursor wrapped as Django wraps its own:
                     ``connection.execute_wrapper`` hooks, ``connection.queries`` under DEBUG
                     and Django's error classes all see the claim and every commit
    positional       a statement's named placeholders, ``%(name)s``, as PostgreSQL's own
                     ``$1, $2, ...``: once per statement and process

Why positional: the statements are written with named placeholders (readable, and pinned as
written by tests/sql/), and psycopg turns them into ``$n`` on every execution. It keeps that
work for a statement of at most 4,096 bytes and 50 parameters only; the claim (CLAIM_SQL) and
the last step that claims the next run (FINISH_AND_CLAIM_SQL, FINISH_TURN_AND_CLAIM_SQL) are 5
to 8 KB, and were split by a regular expression again at every execution: 0.14 ms of CPU each
on a shared 2-CPU VM, against 4 microseconds for the ready text. Here the conversion is done
once and the text goes out on psycopg's ``RawCursor``, which sends it as it is.

Under DEBUG (``connection.queries_logged``: DEBUG, or a test capturing queries) the named
statement goes out on psycopg's ``Cursor`` as written: with ``server_side_binding`` on, Django
records a query by composing its text with its parameters, which only the named form allows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
from collections.abc import Iterator, Mapping
from typing import Any

from django.db import connection

# A named placeholder, the escaped percent sign, or a character that has no place in a
# statement made positional: a bare % (psycopg's %s, %b, %t) or $ (a $n already, or dollar
# quoting, which the conversion would confuse with its own).
_TOKEN = re.compile(r"%\((\w+)\)s|%%|%|\$")


@functools.lru_cache(maxsize=256)
def positional(sql: str) -> tuple[str, tuple[str, ...]]:
    """``sql`` with its ``%(name)s`` placeholders numbered ``$1, $2, ...`` in the order each
    name first appears (a name used twice is one parameter), ``%%`` as ``%``; and the names in
    parameter order. Cached per statement text (the effects' VALUES lists make a few texts per
    statement; a cache of 256 holds every one a worker sends)."""
    numbers: dict[str, int] = {}

    def replace(match: re.Match[str]) -> str:
        token, name = match.group(0), match.group(1)
        if token == "%%":
            return "%"
        if name is None:
            raise ValueError(
                f"only %(name)s placeholders can be made positional, not {token!r}: {sql[:80]!r}..."
            )
        number = numbers.setdefault(name, len(numbers) + 1)
        return f"${number}"

    text = _TOKEN.sub(replace, sql)
    return text, tuple(numbers)


class StatementCursor:
    """What ``binding_cursor`` yields: Django's wrapper of a psycopg cursor whose ``execute``
    takes a statement with named placeholders and its parameters as a mapping, and sends it
    positional (or as written, under DEBUG)."""

    __slots__ = ("_cursor", "_positional")

    def __init__(self, cursor: Any, send_positional: bool) -> None:
        self._cursor = cursor
        self._positional = send_positional

    def execute(self, sql: str, params: Mapping[str, Any]) -> None:
        if self._positional:
            text, names = positional(sql)
            self._cursor.execute(text, [params[name] for name in names])
        else:
            self._cursor.execute(sql, params)

    def fetchone(self) -> Any:
        return self._cursor.fetchone()

    def fetchall(self) -> list[Any]:
        rows: list[Any] = self._cursor.fetchall()
        return rows

    @property
    def closed(self) -> bool:
        return bool(self._cursor.closed)

    def close(self) -> None:
        self._cursor.close()

    @property
    def rowcount(self) -> int:
        return int(self._cursor.rowcount)

    def column_names(self) -> list[str]:
        """The names of the result's columns, read from the result itself: ``description``
        builds an object per column first (0.13 ms for the claim's 60, against 0.01)."""
        result = self._cursor.pgresult
        if result is None:
            return []
        return [(result.fname(i) or b"").decode() for i in range(result.nfields)]


@dataclasses.dataclass
class _Kept:
    """The cursor a thread's connection keeps between statements (``binding_cursor``)."""

    driver_connection: Any  # the psycopg connection it belongs to
    statement: StatementCursor  # what the blocks get
    busy: bool = False


# Where a thread's Django connection keeps its cursor (an attribute of the DatabaseWrapper,
# which is the thread's own).
_KEPT = "_durable_agents_binding_cursor"


@contextlib.contextmanager
def binding_cursor() -> Iterator[StatementCursor]:
    """The cursor of the claim and of the step commit (store/postgres_steps.py): a
    server-side-binding psycopg cursor (Django's own binds on the client), so that psycopg can
    prepare the statement once the database OPTIONS set a ``prepare_threshold`` (that saves the
    parse and plan of every step; Django leaves it off by default for poolers that cannot keep
    prepared statements), wrapped as Django wraps its own cursors:
    ``connection.execute_wrapper`` hooks (Sentry, OpenTelemetry's Django instrumentation),
    ``connection.queries`` under DEBUG and Django's error classes all see the commit. The
    wrapper costs about a microsecond (docs/howto/database.md).

    The thread's connection keeps its cursor from one statement to the next (a new psycopg
    cursor and its wrapper cost about 25 microseconds a statement): while the driver's
    connection is the same one, unused by an enclosing block (the lock sent before a step is
    a cursor of its own), and nothing went wrong on it; under DEBUG every block has a new one."""
    import psycopg  # only on PostgreSQL: SQLite installs need not have it

    connection.ensure_connection()
    logged = connection.queries_logged
    driver_connection = connection.connection
    if logged:
        # The stubs type these as taking Django's own wrapper; at run time they take the
        # driver's cursor, which is what Django passes them (BaseDatabaseWrapper._prepare_cursor).
        logging_cursor: Any = psycopg.Cursor(driver_connection)
        with connection.make_debug_cursor(logging_cursor) as cursor:
            yield StatementCursor(cursor, send_positional=False)
        return
    kept: _Kept | None = getattr(connection, _KEPT, None)
    if kept is None or kept.driver_connection is not driver_connection or kept.statement.closed:
        if kept is not None and not kept.busy:
            _drop(kept)
        raw: Any = psycopg.RawCursor(driver_connection)
        kept = _Kept(driver_connection, StatementCursor(connection.make_cursor(raw), True))
        setattr(connection, _KEPT, kept)
    elif kept.busy:  # an enclosing block holds it: a cursor of this block's own
        own: Any = psycopg.RawCursor(driver_connection)
        with connection.make_cursor(own) as cursor:
            yield StatementCursor(cursor, send_positional=True)
        return
    held: _Kept = kept
    held.busy = True
    try:
        yield held.statement
    except BaseException:
        # Whatever state an error left it in, the next statement gets a new cursor.
        if getattr(connection, _KEPT, None) is held:
            delattr(connection, _KEPT)
        _drop(held)
        raise
    finally:
        held.busy = False


def _drop(kept: _Kept) -> None:
    with contextlib.suppress(Exception):  # a cursor of a connection already gone
        kept.statement.close()
