"""Re-encryption of the encrypted columns under the first key of ENCRYPTION_KEYS
(``manage.py durable_agents_rotate_keys``), or their decryption when the first entry is None.

Every row of an encrypted column that is not under the first key (under an older key, or
plain text written before encryption was on) is read, decrypted and written back encrypted
under the first key, in batches ordered by primary key, each batch its own short
transaction. Safe while workers run: a row is rewritten only if it still holds the text that
was read (``WHERE ... AND column = <what was read>``), so a value a worker wrote meanwhile is
never overwritten with an older one; such a row is counted as changed and left alone (what the
worker wrote is under the first key already). Resumable: a second run finds only the rows the
first did not reach.

The one exception to "agent_step rows are never updated": the payload of a step is rewritten
here, with the very same plaintext under the new key. Nothing reads a step differently after.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from django.apps import apps
from django.db import connection, models, transaction

from durable_agents._internal import encryption
from durable_agents._internal.encryption import Keyring, UndecryptableValue
from durable_agents.models import EncryptedTextField, JSONTextField

DEFAULT_BATCH = 500


@dataclass(frozen=True)
class Column:
    """An encrypted column: its table, its name and its table's primary key columns."""

    table: str
    name: str
    pk: tuple[str, ...]

    @property
    def label(self) -> str:
        """What its values are bound to (their associated data): ``table.column``."""
        return f"{self.table}.{self.name}"


def _is_encrypted(column: models.Field[Any, Any]) -> bool:
    return isinstance(column, EncryptedTextField) or (
        isinstance(column, JSONTextField) and column.encrypted
    )


def encrypted_columns() -> list[Column]:
    """Every column of the app's models that a field encrypts."""
    found = []
    for model in apps.get_app_config("durable_agents").get_models():
        meta = model._meta
        if meta.proxy:
            # A proxy shares its concrete model's table: listing its fields again would
            # rotate (and count, and report) the same column once per proxy.
            continue
        for column in meta.concrete_fields:
            if _is_encrypted(column):
                pk = tuple(str(f.column) for f in meta.pk_fields)
                found.append(Column(meta.db_table, str(column.column), pk))
    return found


@dataclass
class Tally:
    """What a pass did to one column."""

    rewritten: int = 0
    changed: int = 0  # written by someone else between the read and the rewrite: left alone
    unreadable: dict[str, int] = field(default_factory=dict)  # by reason


def _q(name: str) -> str:
    return connection.ops.quote_name(name)


def _stale(column: Column, ring: Keyring) -> tuple[str, list[Any]]:
    """The condition of a row not under the first key (with None first: of an encrypted
    row, to be written plain), and its parameters."""
    if ring.first_prefix is None:
        return f"{_q(column.name)} LIKE %s", [encryption.PREFIX + "%"]
    return (
        f"{_q(column.name)} IS NOT NULL AND {_q(column.name)} NOT LIKE %s",
        [ring.first_prefix + "%"],
    )


def count_stale(column: Column, ring: Keyring) -> int:
    where, params = _stale(column, ring)
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT count(*) FROM {_q(column.table)} WHERE {where}", params)
        row = cursor.fetchone()
    return int(row[0]) if row else 0


def _batch(
    column: Column, ring: Keyring, after: tuple[Any, ...] | None, size: int
) -> list[tuple[Any, ...]]:
    """The next ``size`` stale rows after the key ``after``, by primary key: (pk..., text)."""
    where, params = _stale(column, ring)
    keys = ", ".join(_q(name) for name in column.pk)
    if after is not None:
        marks = ", ".join(["%s"] * len(after))
        where += f" AND ({keys}) > ({marks})"
        params += list(after)
    sql = (
        f"SELECT {keys}, {_q(column.name)} FROM {_q(column.table)} WHERE {where}"
        f" ORDER BY {keys} LIMIT %s"
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, [*params, size])
        return [tuple(row) for row in cursor.fetchall()]


def _rewrite(column: Column, ring: Keyring, rows: list[tuple[Any, ...]], tally: Tally) -> None:
    """Each row under the first key, only if it still holds what was read; one transaction."""
    keyed = " AND ".join(f"{_q(name)} = %s" for name in column.pk)
    sql = (
        f"UPDATE {_q(column.table)} SET {_q(column.name)} = %s"
        f" WHERE {keyed} AND {_q(column.name)} = %s"
    )
    with transaction.atomic(), connection.cursor() as cursor:
        for *pk, stored in rows:
            try:
                plain = encryption.unseal(stored, column.label)
            except UndecryptableValue as exc:
                tally.unreadable[str(exc)] = tally.unreadable.get(str(exc), 0) + 1
                continue
            cursor.execute(sql, [ring.seal(plain, column.label), *pk, stored])
            if cursor.rowcount == 1:
                tally.rewritten += 1
            else:
                tally.changed += 1


def rotate_column(
    column: Column,
    ring: Keyring,
    batch_size: int = DEFAULT_BATCH,
    progress: Callable[[Column, Tally], None] | None = None,
) -> Tally:
    """Every stale row of ``column`` under the first key, batch after batch."""
    tally = Tally()
    for rows in _batches(column, ring, batch_size):
        _rewrite(column, ring, rows, tally)
        if progress is not None:
            progress(column, tally)
    return tally


def _batches(column: Column, ring: Keyring, size: int) -> Iterator[list[tuple[Any, ...]]]:
    after: tuple[Any, ...] | None = None
    while True:
        rows = _batch(column, ring, after, size)
        if not rows:
            return
        yield rows
        after = rows[-1][: len(column.pk)]
