"""Rows of ``tool_effect`` read as ``ToolEffect`` instances, without a query set-up per read.

A resumed run reads the calls its last turn recorded before it runs any
(``Store.recorded_effects``), and a claim batch reads them for all its runs at once
(read_ahead.py). Django's ``raw()`` works out its query's columns and converters at every
execution; for a read that usually finds nothing, that set-up was most of its cost (about
0.4 ms of CPU a read on a shared 2-CPU VM, against 0.25 ms now). Here the columns are named
once (``EFFECT_COLUMNS``, in the model's field order), and every value goes through the
converters the ORM applies: the backend's (SQLite's booleans and datetimes) and then the
field's own (the result decrypted).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from django.db.backends.base.base import BaseDatabaseWrapper

from durable_agents.models import ToolEffect

_FIELDS = tuple(ToolEffect._meta.concrete_fields)
_ATTNAMES = [field.attname for field in _FIELDS]

# What a statement that reads effects selects, in this order.
EFFECT_COLUMNS = ", ".join(str(field.column) for field in _FIELDS)

_Converters = list[tuple[Any, list[Callable[..., Any]]]]
# Per database backend (its operations class): each field's column expression and converters.
_converters_by_backend: dict[type, _Converters] = {}


def _converters(connection: BaseDatabaseWrapper) -> _Converters:
    backend = type(connection.ops)
    found = _converters_by_backend.get(backend)
    if found is None:
        table = ToolEffect._meta.db_table
        found = []
        for field in _FIELDS:
            column = field.get_col(table)
            found.append(
                (
                    column,
                    connection.ops.get_db_converters(column) + column.get_db_converters(connection),
                )
            )
        _converters_by_backend[backend] = found
    return found


def effects_from(
    rows: Iterable[Sequence[Any]], connection: BaseDatabaseWrapper
) -> list[ToolEffect]:
    """The effects of ``rows`` (of ``EFFECT_COLUMNS``), as the ORM would load them."""
    converters = _converters(connection)
    effects = []
    for row in rows:
        values = []
        for value, (column, functions) in zip(row, converters, strict=True):
            for convert in functions:
                value = convert(value, column, connection)
            values.append(value)
        effects.append(ToolEffect.from_db(connection.alias, _ATTNAMES, values))
    return effects
