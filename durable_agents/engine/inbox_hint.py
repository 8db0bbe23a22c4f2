"""Whether a message may wait in a held run's inbox, as far as one worker knows.

Before each model call the runner folds the messages waiting in the run's inbox; looking for
them is a statement of its own, one a turn. On PostgreSQL every message queued notifies the
workers' channel when it commits (``inbox:<run id>``, a trigger on agent_message), so a worker
whose listener has heard every notification since a look knows whether anything came since:

    unknown (a claim's start)  the next model call looks (a statement), or the claim did
                               (on PostgreSQL the claim statement says whether a message
                               waited; elsewhere the batch's ``Store.read_ahead``)
    -> none since the look     the look found none: the calls after it send no statement
    -> unknown again           a message for the run was heard (a notification, or queued by
                               this process: ``_internal.inbox_bell``), the listener lost its
                               connection (it may have missed one), or the claim ended

A look is marked (``mark``) before its statement is sent: a message committed after the
statement's snapshot is heard after the mark, and so is never taken as seen. Nothing here can
lose a message: the last commit of a run looks again under the run's lock, whatever this says,
and a run whose answer a message followed goes on with it. What the hint saves is the look of
every turn in between. Without a listener that hears every notification (SQLite, LISTEN off,
the connection down) every model call looks.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

# Runs whose messages are remembered until the next look; past this, all are forgotten at once
# (every held run then looks once more). A worker's listener hears the messages of every run
# of the fleet, not only those it holds.
MAX_HEARD = 10_000


@dataclasses.dataclass(frozen=True)
class Mark:
    """Where the hint stood when a look began: what it had heard, and the listener's
    connection (None: not listening, the look stands for nothing after it)."""

    heard: int
    generation: int | None


class InboxHint:
    def __init__(self, listening: Callable[[], int | None]) -> None:
        # The generation of the listener's connection while it listens, else None: a new
        # connection may have missed what was sent before it listened.
        self._listening = listening
        self._lock = threading.Lock()
        self._heard = 0  # messages heard so far (each gets the next number)
        self._heard_at: dict[Any, int] = {}  # run id -> the number of its last message heard
        self._forgotten = 0  # marks before this number may have missed a message
        self._looked: dict[Any, Mark] = {}  # run id -> the mark of its last look that found none

    def mark(self) -> Mark:
        """Taken before a look at the inbox is sent."""
        generation = self._listening()
        with self._lock:
            return Mark(self._heard, generation)

    def heard(self, run_id: Any) -> None:
        """A message was queued for ``run_id`` (a notification, or this process queued it)."""
        key = str(run_id)
        with self._lock:
            self._heard += 1
            if len(self._heard_at) >= MAX_HEARD:
                self._heard_at.clear()
                self._forgotten = self._heard
            self._heard_at[key] = self._heard

    def looked(self, run_id: Any, mark: Mark, *, found: bool | None) -> None:
        """A look begun at ``mark`` found messages (``found``; they are folded next) or none;
        ``found=None``: nothing was looked at (a claim that did not look), nothing changes."""
        if found is None:
            return
        key = str(run_id)
        with self._lock:
            if found or mark.generation is None:
                self._looked.pop(key, None)
            else:
                self._looked[key] = mark

    def forget(self, run_id: Any) -> None:
        """The claim of ``run_id`` ended: its next claim looks for itself."""
        with self._lock:
            self._looked.pop(str(run_id), None)

    def may_wait(self, run_id: Any) -> bool:
        """Whether a message may wait now: True unless a look found none and nothing for the
        run was heard since, on the same listening connection."""
        generation = self._listening()
        if generation is None:
            return True
        key = str(run_id)
        with self._lock:
            mark = self._looked.get(key)
            return (
                mark is None
                or mark.generation != generation
                or mark.heard < self._forgotten
                or self._heard_at.get(key, 0) > mark.heard
            )
