"""The custom columns of the app's tables: ``JSONTextField`` (any JSON value as JSON text, key
order and all), ``EncryptedTextField`` (text encrypted at rest under ENCRYPTION_KEYS) and
``StepPartField`` (a step's partition, from its run's id).

Migrations name them ``durable_agents.models.<field>``: the package hands them on under those
paths, and ``JSONTextField`` deconstructs to its path there, not to this module's."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from django.db import models

from durable_agents._internal.encryption import Unreadable, seal, unseal_field
from durable_agents._internal.text import json_text
from durable_agents.exceptions import StoredValueError
from durable_agents.models.ids import step_part

if TYPE_CHECKING:
    # The stubs' TextField is generic (set and get types); Django's class takes no subscript.
    _TextField = models.TextField[Any, Any]
    _IntegerField = models.IntegerField[Any, Any]
else:
    _TextField = models.TextField
    _IntegerField = models.IntegerField


def _column_of(field: Any) -> str:
    """``table.column``: what an encrypted value is bound to (its associated data)."""
    return f"{field.model._meta.db_table}.{field.column}"


class JSONTextField(_TextField):
    """Any JSON value, stored as JSON text in a text column.

    Unlike ``jsonb`` it keeps key order and accepts ``\u0000`` (escaped, so PostgreSQL's text
    never sees a NUL byte); unlike a plain text column it round-trips any string exactly.

    ``encrypted=True``: the text is encrypted at rest under ENCRYPTION_KEYS (encryption.py);
    plain rows still read. Encryption is not part of the schema: ``deconstruct`` leaves it out,
    so turning it on for a column needs no migration (and migrations' historical models read
    the stored text as it is)."""

    def __init__(self, *args: Any, encrypted: bool = False, **kwargs: Any) -> None:
        self.encrypted = encrypted
        super().__init__(*args, **kwargs)

    def deconstruct(self) -> Any:
        # The path migrations have always stored (0001 on), not the module that defines it.
        name, _, args, kwargs = super().deconstruct()
        return name, "durable_agents.models.JSONTextField", args, kwargs

    def from_db_value(self, value: Any, expression: Any, connection: Any) -> Any:
        if value is None:
            return None
        if self.encrypted:
            value = unseal_field(value, self.column_label())
            if value is None or isinstance(value, Unreadable):
                # Undecryptable, inside encryption.lenient() or encryption.shown().
                return value
        return self.decode(value)

    def decode(self, value: str) -> Any:
        """The stored JSON text (decrypted already) as a value; ``StoredValueError`` (naming
        the column) when it does not decode, so that callers can tell a poisoned row from a
        bug of theirs."""
        try:
            return json.loads(value)
        except (TypeError, ValueError, RecursionError) as exc:
            raise StoredValueError(self.column_label(), f"{type(exc).__name__}: {exc}") from exc

    def column_label(self) -> str:
        """``table.column`` of this field, as an error names it."""
        model = getattr(self, "model", None)
        table = model._meta.db_table if model is not None else "?"
        return f"{table}.{self.column}"

    def to_python(self, value: Any) -> Any:
        return value

    def get_prep_value(self, value: Any) -> Any:
        # Lone surrogates are written as escapes, so the value round-trips exactly (a person
        # approves the input the tool will get) and the database can encode the text.
        if value is None:
            return None
        text = json_text(value)
        return seal(text, _column_of(self)) if self.encrypted else text


class EncryptedTextField(_TextField):
    """A text column encrypted at rest under ENCRYPTION_KEYS (encryption.py): the text reads
    back exactly as written; plain rows still read. Deconstructed as a plain ``TextField``:
    encryption is not part of the schema (no migration turns it on)."""

    def deconstruct(self) -> Any:
        name, _, args, kwargs = super().deconstruct()
        return name, "django.db.models.TextField", args, kwargs

    def from_db_value(self, value: Any, expression: Any, connection: Any) -> Any:
        return None if value is None else unseal_field(value, _column_of(self))

    def get_prep_value(self, value: Any) -> Any:
        value = super().get_prep_value(value)
        return None if value is None else seal(value, _column_of(self))


class StepPartField(_IntegerField):
    """The partition of the step log a step lives in, computed from its run's id when the row
    is written (``models.ids.step_part``), by ``save`` and ``bulk_create`` alike: no caller
    sets it. Statements written by hand pass ``step_part(run_id)`` themselves."""

    def deconstruct(self) -> Any:
        name, _path, args, kwargs = super().deconstruct()
        return name, "durable_agents.models.StepPartField", args, kwargs

    def pre_save(self, model_instance: models.Model, add: bool) -> int:
        part = step_part(model_instance.run_id)  # type: ignore[attr-defined]
        setattr(model_instance, self.attname, part)
        return part
