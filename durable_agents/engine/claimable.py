"""Whether runs may be waiting to be claimed, as far as one worker knows.

A slot that commits a run's last step may claim its next run in the same statement. When
nothing is claimable that claim is pure cost: the claim statement is the longest the worker
sends, and a thousand runs ending together would each send it for nothing. So the worker
keeps a hint, and a slot claims with its last step only while the hint says runs may wait:

    may wait (the start)   every last step sends the claim along
    -> nothing waits       a claim (the claimer's batch, or a slot's) found fewer runs than it
                           asked for (or failed), and no notification came since it was sent
    -> may wait again      a notification that a run became claimable (LISTEN), a batch that
                           came back full, or FORGET_SECONDS after the claim that found none

The hint never holds a run back: the claimer still claims on every notification and every
poll. Some runs become claimable without a notification (a timer comes due, a crashed
worker's lease expires): the hint forgets itself after FORGET_SECONDS so that a slot ending a
run finds them about as soon as before. Without a listener that hears every notification
(SQLite, LISTEN off, the connection down) the hint always says runs may wait.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

# How long a claim that found nothing is believed without a notification.
FORGET_SECONDS = 1.0


class ClaimableHint:
    def __init__(
        self, hears_notifications: Callable[[], bool], forget_seconds: float = FORGET_SECONDS
    ) -> None:
        self._hears_notifications = hears_notifications
        self._forget_seconds = forget_seconds
        self._lock = threading.Lock()
        # Counts the notifications heard: a claim that found nothing is believed only if
        # none came while it ran (the run it announced may have been past the claim's look).
        self._epoch = 0
        # When a claim last found nothing (monotonic), or None: runs may wait.
        self._none_since: float | None = None

    def epoch(self) -> int:
        """Taken before a claim, handed back to ``found_none`` if it finds too few runs."""
        with self._lock:
            return self._epoch

    def notified(self) -> None:
        """A run may have become claimable (a notification, or the listener back after a gap)."""
        with self._lock:
            self._epoch += 1
            self._none_since = None

    def found_some(self) -> None:
        """A claim got every run it asked for: more may wait."""
        with self._lock:
            self._none_since = None

    def found_none(self, epoch: int) -> None:
        """A claim begun at ``epoch`` found fewer runs than it asked for."""
        with self._lock:
            if epoch == self._epoch:
                self._none_since = time.monotonic()

    def claimed(self, epoch: int, *, asked: int, got: int) -> None:
        """A claim begun at ``epoch`` asked for ``asked`` runs and got ``got``."""
        if got >= asked:
            self.found_some()
        else:
            self.found_none(epoch)

    def may_wait(self) -> bool:
        """Whether a claim may find a run now."""
        if not self._hears_notifications():
            return True
        with self._lock:
            none_since = self._none_since
        return none_since is None or time.monotonic() - none_since >= self._forget_seconds
