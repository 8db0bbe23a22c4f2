"""``InMemoryCapacity``: the gate in a dict under a lock, on the in-memory store's clock."""

from __future__ import annotations

import contextlib
import copy
import datetime
import threading
from collections.abc import Callable, Iterator

from durable_agents.flow.capacity.gate import CapacityGate, new_row
from durable_agents.models import CapacityEvent, ModelCapacity


class InMemoryCapacity(CapacityGate):
    def __init__(self, now: Callable[[], datetime.datetime]) -> None:
        super().__init__()
        self.now = now
        self.lock = threading.RLock()
        self.rows: dict[str, ModelCapacity] = {}
        self.events: list[CapacityEvent] = []

    @contextlib.contextmanager
    def _locked(
        self, model: str, create: bool
    ) -> Iterator[tuple[ModelCapacity | None, datetime.datetime]]:
        with self.lock:
            row = self.rows.get(model)
            if row is None and create:
                row = self.rows[model] = new_row(model, self.now())
            # Changes reach the store only through _save, as they would a database.
            yield (None if row is None else copy.copy(row)), self.now()

    def _save(self, row: ModelCapacity) -> None:
        row.updated_at = row.refilled_at
        self.rows[row.model] = copy.copy(row)

    def _rows(self) -> tuple[list[ModelCapacity], datetime.datetime]:
        with self.lock:
            return [copy.copy(row) for row in self.rows.values()], self.now()

    def _record_event(self, model: str, kind: str, seconds: float | None) -> None:
        with self.lock:
            self.events.append(
                CapacityEvent(model=model, kind=kind, seconds=seconds, at=self.now())
            )
