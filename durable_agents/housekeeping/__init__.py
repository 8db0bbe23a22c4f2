"""Housekeeping: the periodic sweep, retention, the metrics snapshot, webhook retries, and
re-keying encrypted columns.

``sweep``, ``apply_retention``, ``snapshot_metrics`` and ``deliver_webhooks`` are importable
from here because django-q2 stores these paths in its ``Schedule`` rows
(``durable_agents.housekeeping.sweep``): they keep working whichever module holds the
functions.
"""

from durable_agents.housekeeping.sweeps import (
    apply_retention,
    deliver_webhooks,
    snapshot_metrics,
    sweep,
)

__all__ = ["apply_retention", "deliver_webhooks", "snapshot_metrics", "sweep"]
