"""What became of a run when a worker let go of it (``Disposition``), and ``Stop``, which
carries that out of the step loop from wherever the run stopped (``runner`` and ``dispatch``)."""

from __future__ import annotations

import enum


class Disposition(enum.StrEnum):
    """What became of a run when ``advance_run`` returned."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    DEAD = "dead"
    WAITING = "waiting"  # parked (a person, a timer, an event, child runs); no worker holds it
    RELEASED = "released"  # handed back, claimable again (shutdown, transient model errors)
    # Handed back to wait for model capacity (a rate limit, a 429's pause, a 529), uncounted.
    THROTTLED = "throttled"
    # Handed back uncounted: the API refused the worker's credentials (the worker pauses).
    REFUSED = "refused"
    CANCELLED = "cancelled"
    LOST = "lost"  # another worker holds it now
    ERROR = "error"  # an unexpected error in this app (the worker handed the run back)


SUCCEEDED = Disposition.SUCCEEDED
FAILED = Disposition.FAILED
DEAD = Disposition.DEAD
WAITING = Disposition.WAITING
RELEASED = Disposition.RELEASED
THROTTLED = Disposition.THROTTLED
REFUSED = Disposition.REFUSED
CANCELLED = Disposition.CANCELLED
LOST = Disposition.LOST

# The interrupt reason of a worker that stops for good (second signal, or its grace is over).
SHUTDOWN = "shutdown"


# Not a DurableAgentsError: control flow inside the runner (it unwinds the step loop, whose
# caller catches it); never raised to user code.
class Stop(Exception):
    """Unwinds the step loop with the run's disposition (the run is parked, over, handed
    back or no longer this claim's; the store already says so)."""

    def __init__(self, disposition: Disposition):
        self.disposition = disposition
