"""A worker's side of live text: the deltas of streamed turns, sent with NOTIFY (PostgreSQL).

    the stream reader thread -> ``turn_callback(...)(text)``: put on a bounded queue, never
                                waiting (a full queue drops the rest of that turn's text)
    the publisher thread     -> every PUBLISH_SECONDS, each turn's new text as one chunk:
                                pg_notify('durable_agents_live', {"r", "s", "a", "n", "t"}),
                                on a connection of its own

Best effort by design: the committed step is what counts, and it reaches every reader whatever
happens here. Nothing here touches the step commit; a reader never slows a worker, since
NOTIFY does not wait for listeners. One publisher per worker process, started on first use.
"""

from __future__ import annotations

import collections
import json
import logging
import queue
import threading
import uuid
from collections.abc import Callable
from typing import Any

from durable_agents import observers
from durable_agents.live.hub import DELTA_CHANNEL

logger = logging.getLogger("durable_agents.live")

PUBLISH_SECONDS = 0.05
QUEUE_SIZE = 10_000
# NOTIFY payloads must stay under 8,000 bytes: a chunk's text is cut to this many characters
# (JSON-escaped, each may take 6 bytes), the rest going in the next chunk.
CHUNK_CHARS = 1000
# Turns whose chunk count the publisher remembers (the newest).
TURNS_KEPT = 10_000

# Seconds without text after which the publisher closes its connection.
IDLE_SECONDS = 30.0

_Turn = tuple[uuid.UUID, int, int]  # run, seq, attempt
_STOP: tuple[Any, str] = (object(), "")


class DeltaPublisher:
    def __init__(self, send: Callable[[str], None] | None = None) -> None:
        self.queue: queue.Queue[tuple[Any, str]] = queue.Queue(QUEUE_SIZE)
        self.counts: collections.OrderedDict[_Turn, int] = collections.OrderedDict()
        self.broken: set[_Turn] = set()
        self._send = send or self._notify
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._wrapper: Any = None

    def turn_callback(self, run_id: uuid.UUID, seq: int, attempt: int) -> Callable[[str], None]:
        """What the stream reader calls with each text delta of turn ``seq`` of ``attempt``."""
        self._start()
        key = (run_id, seq, attempt)

        def on_text(text: str) -> None:
            if key in self.broken:
                return
            try:
                self.queue.put_nowait((key, text))
            except queue.Full:
                self.broken.add(key)  # a gap would garble the text: the step will carry it

        return on_text

    def _start(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._serve, name="durable_agents-live-publish", daemon=True
                )
                self._thread.start()

    def stop(self) -> None:
        """End the publisher's thread once it has sent what is queued (it closes its
        connection); the next streamed turn starts it again."""
        thread = self._thread
        if thread is not None and thread.is_alive():
            self.queue.put(_STOP)
            thread.join(5)

    def _serve(self) -> None:
        while True:
            try:
                key, text = self.queue.get(timeout=IDLE_SECONDS)
            except queue.Empty:
                self._close()  # nothing streamed for a while: give the connection back
                continue
            if key is _STOP[0]:
                self._close()
                return
            pending: dict[_Turn, list[str]] = {key: [text]}
            try:
                while True:
                    key, text = self.queue.get(timeout=PUBLISH_SECONDS)
                    if key is _STOP[0]:
                        self.queue.put(_STOP)  # after what is pending
                        break
                    pending.setdefault(key, []).append(text)
                    if sum(map(len, pending.values())) > 50 * CHUNK_CHARS:
                        break
            except queue.Empty:
                pass
            for turn, texts in pending.items():
                self.publish(turn, "".join(texts))

    def publish(self, turn: _Turn, text: str) -> None:
        """Send ``text`` as the turn's next chunk(s)."""
        run_id, seq, attempt = turn
        for start in range(0, len(text), CHUNK_CHARS):
            n = self.counts.pop(turn, 0)
            self.counts[turn] = n + 1
            while len(self.counts) > TURNS_KEPT:
                self.counts.popitem(last=False)
            payload: dict[str, Any] = {"r": str(run_id), "s": seq, "a": attempt, "n": n}
            payload["t"] = text[start : start + CHUNK_CHARS]
            try:
                self._send(json.dumps(payload, ensure_ascii=True))
            except Exception as exc:  # noqa: BLE001 - live text is best effort
                logger.debug("live: sending a delta failed: %s", exc)
                self.broken.add(turn)
                self._close()
                return

    def _notify(self, payload: str) -> None:
        from durable_agents._internal.db import dedicated

        if self._wrapper is None:
            self._wrapper = dedicated()
        with self._wrapper.cursor() as cursor:
            cursor.execute("SELECT pg_notify(%s, %s)", [DELTA_CHANNEL, payload])

    def _close(self) -> None:
        wrapper, self._wrapper = self._wrapper, None
        if wrapper is not None:
            try:
                wrapper.close()
            except Exception:
                logger.debug("live: closing the publisher's connection failed", exc_info=True)


_publisher: DeltaPublisher | None = None
_publisher_lock = threading.Lock()


def publisher() -> DeltaPublisher:
    """The process's publisher."""
    global _publisher
    with _publisher_lock:
        if _publisher is None:
            _publisher = DeltaPublisher()
        return _publisher


def stop() -> None:
    """Stop the process's publisher, if it runs (tests; a process exits without it)."""
    with _publisher_lock:
        current = _publisher
    if current is not None:
        current.stop()


def _turn_callback(run_id: uuid.UUID, seq: int, attempt: int) -> Callable[[str], None]:
    return publisher().turn_callback(run_id, seq, attempt)


# The engine reaches the publisher through the observers seam, never by importing this module.
observers.publish_text(_turn_callback)
