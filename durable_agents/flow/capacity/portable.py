"""``PortableCapacity``: the gate on any database Django supports, through the ORM.

Each operation is one short transaction: the model's row read ``SELECT ... FOR UPDATE``
(with the database's clock, so that hosts whose clocks differ refill alike), changed in
Python, written back. On PostgreSQL the row lock serializes the grants of one model across
the fleet; a grant holds it for two round trips. SQLite ignores ``FOR UPDATE`` but takes its
database-wide write lock at the UPDATE: a fleet on SQLite is one host, and two workers that
read the same levels at once may let one call more through than the buckets hold.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator

from django.db import IntegrityError, transaction
from django.db.models.functions import Now
from django.utils import timezone

from durable_agents.flow.capacity.gate import CapacityGate, new_row
from durable_agents.models import CapacityEvent, ModelCapacity

_SAVED_FIELDS = [
    field.name for field in ModelCapacity._meta.concrete_fields if field.name != "model"
]


class PortableCapacity(CapacityGate):
    def __init__(self, using: str | None = None) -> None:
        super().__init__()
        self.using = using

    @contextlib.contextmanager
    def _locked(
        self, model: str, create: bool
    ) -> Iterator[tuple[ModelCapacity | None, datetime.datetime]]:
        with transaction.atomic(using=self.using):
            row = self._select(model)
            if row is None and create:
                self._create(model)
                row = self._select(model)
            yield row, _clock(row)

    def _select(self, model: str) -> ModelCapacity | None:
        return (
            ModelCapacity.objects.using(self.using)
            .select_for_update()
            .annotate(db_now=Now())
            .filter(model=model)
            .first()
        )

    def _create(self, model: str) -> None:
        # Two workers may create the same row at once: the loser keeps the winner's.
        try:
            with transaction.atomic(using=self.using):
                new_row(model, timezone.now()).save(using=self.using, force_insert=True)
        except IntegrityError:
            pass

    def _save(self, row: ModelCapacity) -> None:
        row.updated_at = row.refilled_at
        row.save(using=self.using, update_fields=_SAVED_FIELDS)

    def _rows(self) -> tuple[list[ModelCapacity], datetime.datetime]:
        rows: list[ModelCapacity] = list(
            ModelCapacity.objects.using(self.using).annotate(db_now=Now())
        )
        return rows, _clock(rows[0] if rows else None)

    def _record_event(self, model: str, kind: str, seconds: float | None) -> None:
        CapacityEvent.objects.using(self.using).create(model=model, kind=kind, seconds=seconds)


def _clock(row: ModelCapacity | None) -> datetime.datetime:
    """The database's time, read with the row (``db_now``); this host's without a row."""
    now: datetime.datetime | None = getattr(row, "db_now", None)
    return now if now is not None else timezone.now()
