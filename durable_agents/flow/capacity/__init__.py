"""Model capacity shared by the fleet: rate limits counted in the tokens calls actually use.

- ``limits``: the ``RATE_LIMITS`` setting, read and checked;
- ``headers``: what the API's ``anthropic-ratelimit-*`` headers say about its buckets;
- ``buckets``: the arithmetic of a model's buckets (refill, grant, settle, learn, pause);
- ``gate``: ``CapacityGate``, the flow of a call (acquire, settle, rate_limited, handed_back,
  outlook), with one subclass per store: ``portable`` (the ORM) and ``memory``.

The runner asks the gate before every model call; a run refused capacity is handed back
pending and waits without a slot, a connection or an attempt; the worker's claimer takes no
more runs than the buckets have room for, highest priority first.
"""

from durable_agents.flow.capacity.buckets import Estimate
from durable_agents.flow.capacity.gate import CapacityGate, Grant, Outlook
from durable_agents.flow.capacity.headers import Observed, observed
from durable_agents.flow.capacity.limits import ModelLimits, configured_limits, limit_problems

__all__ = [
    "CapacityGate",
    "Estimate",
    "Grant",
    "ModelLimits",
    "Observed",
    "Outlook",
    "configured_limits",
    "limit_problems",
    "observed",
]
