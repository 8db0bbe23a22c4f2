"""The payloads of sent events, kept by each store for the runs they wake.

A run woken by an event stores a reference to it (its name and when it was sent), not its
payload: the woken call reads the payload from the event. When one event wakes a thousand runs,
a worker resumes them one after another; each would read the same row and decrypt the same
payload. ``SentPayloads`` keeps the latest few, so that the process reads each once.

Why a kept payload is never stale: an event is sent once (a second send of its name is a no-op),
so its payload does not change; and the key holds the time it was sent, so an event that
retention deleted and that was sent again under its name is read afresh. Each caller gets its
own copy (kept as JSON text and decoded per call): a tool that changes what it was given changes
nothing for the next run.
"""

from __future__ import annotations

import collections
import json
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from durable_agents._internal.text import Unstorable, json_text

if TYPE_CHECKING:
    from durable_agents.models import AgentEvent

# How many payloads a store keeps, and the largest it keeps (in characters of JSON text): a
# large payload is read per run, as before, rather than held in every worker's memory.
KEPT = 64
MAX_KEPT_CHARS = 64 * 1024


class SentPayloads:
    """The payloads of the last ``KEPT`` events read, by (name, time sent)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._texts: collections.OrderedDict[tuple[str, str | None], str] = (
            collections.OrderedDict()
        )

    def payload(self, read: Callable[[str], AgentEvent | None], name: str, at: str | None) -> Any:
        """The payload of the event ``name`` sent at ``at`` (ISO time, as the woken run stores
        it); ``read(name)`` reads the sent event when it is not kept. None if it was not sent
        (or has been deleted since)."""
        key = (name, at)
        with self._lock:
            text = self._texts.get(key)
            if text is not None:
                self._texts.move_to_end(key)
        if text is not None:
            return json.loads(text)
        event = read(name)
        if event is None:
            return None
        sent_at = event.sent_at.isoformat() if event.sent_at is not None else None
        if sent_at == at:
            self._keep(key, event.payload)
        return event.payload

    def _keep(self, key: tuple[str, str | None], payload: Any) -> None:
        try:
            text = json_text(payload)
        except Unstorable:
            return
        if len(text) > MAX_KEPT_CHARS:
            return
        with self._lock:
            self._texts[key] = text
            self._texts.move_to_end(key)
            while len(self._texts) > KEPT:
                self._texts.popitem(last=False)
