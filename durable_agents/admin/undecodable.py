"""A run's page when some of its stored values cannot be read back (``StoredValueError``):
the page still renders, and shows each such column as undecodable, with the reason.

Such a run is poison to the engine (dead-lettered at its next claim); a person must still be
able to open it, see what is wrong and cancel it."""

from __future__ import annotations

from typing import Any

from django.db.models import F, QuerySet, TextField
from django.db.models.functions import Cast

from durable_agents.exceptions import StoredValueError
from durable_agents.models import AgentRun, JSONTextField


class Undecodable:
    """What a page shows instead of a stored value that does not decode."""

    def __init__(self, error: StoredValueError) -> None:
        self.error = error

    def __str__(self) -> str:
        return f"undecodable: {self.error}"


def json_text_columns() -> list[JSONTextField]:
    return [f for f in AgentRun._meta.concrete_fields if isinstance(f, JSONTextField)]


def reading_raw(queryset: QuerySet[AgentRun], *names: str) -> QuerySet[AgentRun]:
    """``queryset`` with the JSON text columns ``names`` deferred and read as raw text instead
    (``decode_raw`` then sets each on its run): one undecodable row cannot fail a page."""
    raw = {f"raw_{name}": Cast(F(name), output_field=TextField()) for name in names}
    return queryset.defer(*names).annotate(**raw)


def decode_raw(run: AgentRun, *names: str) -> None:
    """Set each of the columns ``names`` that ``reading_raw`` read on ``run``: its value, or an
    ``Undecodable`` carrying the reason."""
    for name in names:
        field = AgentRun._meta.get_field(name)
        assert isinstance(field, JSONTextField)
        text = getattr(run, f"raw_{name}")
        try:
            # As the field reads it: decrypted first where the column is encrypted.
            value: Any = field.from_db_value(text, None, None)
        except StoredValueError as exc:
            value = Undecodable(exc)
        # Set on the instance: a deferred field that is set is never loaded (and failing) again.
        setattr(run, field.attname, value)


def run_reading_what_decodes(queryset: QuerySet[AgentRun], pk: Any) -> AgentRun | None:
    """The run ``pk`` of ``queryset`` with its JSON text columns read as raw text: each that
    decodes gets its value, each that does not an ``Undecodable`` carrying the reason."""
    names = [f.attname for f in json_text_columns()]
    run = reading_raw(queryset, *names).filter(pk=pk).first()
    if run is not None:
        decode_raw(run, *names)
    return run
