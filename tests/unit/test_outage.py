"""A write cut by a lost connection: which errors are retried, and for how long."""

from __future__ import annotations

import time

import pytest
from django.db import DatabaseError, DataError, IntegrityError, InterfaceError, OperationalError

from durable_agents._internal.interrupt import Interrupt
from durable_agents.engine.outage import LeaseClock, connection_lost, retry_while_leased


class _ReadOnly(Exception):
    sqlstate = "25006"


def _caused_by(cause: BaseException) -> DatabaseError:
    error = DatabaseError("cannot execute INSERT in a read-only transaction")
    error.__cause__ = cause
    return error


def test_lost_connections_are_told_from_refused_statements() -> None:
    assert connection_lost(OperationalError("server closed the connection unexpectedly"))
    assert connection_lost(InterfaceError("connection already closed"))
    # A host that is a standby now: the connection is of no use for writes.
    assert connection_lost(_caused_by(_ReadOnly()))
    # The database refused what was sent: it would refuse it again.
    assert not connection_lost(DataError("invalid byte sequence"))
    assert not connection_lost(IntegrityError("duplicate key"))
    assert not connection_lost(_caused_by(ValueError()))


def test_a_lost_connection_is_retried_until_the_write_goes_through() -> None:
    tries: list[float] = []

    def write() -> str:
        tries.append(time.monotonic())
        if len(tries) < 4:
            raise OperationalError("server closed the connection unexpectedly")
        return "committed"

    lease = LeaseClock(60)
    assert retry_while_leased(write, lease=lease, what="test") == "committed"
    assert len(tries) == 4


def test_retries_end_before_the_lease_does() -> None:
    """A database that stays away longer than the lease: the worker gives up (the run is
    handed back) a margin before the lease ends, never after."""
    lease = LeaseClock(2.0)  # margin: 0.5 s
    tries = 0

    def write() -> None:
        nonlocal tries
        tries += 1
        raise OperationalError("connection refused")

    with pytest.raises(OperationalError, match="refused"):
        retry_while_leased(write, lease=lease, what="test")
    assert tries > 2
    left = lease.seconds_left()
    assert left + lease.margin > 0  # given up while the lease still held
    assert left < 1.0  # after trying for most of it


def test_a_refused_statement_or_an_interrupt_is_not_retried() -> None:
    tries = 0

    def refused() -> None:
        nonlocal tries
        tries += 1
        raise DataError("value too long")

    with pytest.raises(DataError):
        retry_while_leased(refused, lease=LeaseClock(60), what="test")
    assert tries == 1

    interrupt = Interrupt()
    interrupt.trigger("shutdown")

    def lost() -> None:
        raise OperationalError("server closed the connection unexpectedly")

    with pytest.raises(OperationalError):
        retry_while_leased(lost, lease=LeaseClock(60), what="test", interrupt=interrupt)
