"""``agent_metrics``: snapshots of the operations page's figures."""

from __future__ import annotations

from typing import ClassVar

from django.db import models
from django.db.models.functions import Now


class MetricsSnapshot(models.Model):
    """The figures of the operations page at one moment (``housekeeping.snapshot_metrics``)."""

    taken_at = models.DateTimeField(db_default=Now(), db_index=True)
    data = models.JSONField()

    class Meta:
        db_table = "agent_metrics"
        ordering: ClassVar[list[str]] = ["-taken_at"]
        get_latest_by = "taken_at"

    def __str__(self) -> str:
        return f"metrics at {self.taken_at:%Y-%m-%d %H:%M}"
