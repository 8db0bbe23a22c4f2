"""SentPayloads: a sent event's payload read once per process for the runs it wakes, never a
stale or shared one."""

from __future__ import annotations

import datetime
from typing import Any

from durable_agents.models import AgentEvent
from durable_agents.store.event_payloads import KEPT, MAX_KEPT_CHARS, SentPayloads

SENT = datetime.datetime(2026, 12, 6, 12, 0, tzinfo=datetime.UTC)


class Events:
    """The events table as ``read`` sees it, counting reads."""

    def __init__(self) -> None:
        self.rows: dict[str, AgentEvent] = {}
        self.reads = 0

    def send(self, name: str, payload: Any, at: datetime.datetime = SENT) -> str:
        self.rows[name] = AgentEvent(name=name, payload=payload, sent_at=at)
        return at.isoformat()

    def read(self, name: str) -> AgentEvent | None:
        self.reads += 1
        return self.rows.get(name)


def test_one_read_for_every_run_the_event_woke() -> None:
    events, kept = Events(), SentPayloads()
    at = events.send("deploy-done", {"build": 42, "notes": ["a", "b"]})
    payloads = [kept.payload(events.read, "deploy-done", at) for _ in range(1000)]
    assert payloads == [{"build": 42, "notes": ["a", "b"]}] * 1000
    assert events.reads == 1


def test_each_caller_gets_its_own_copy() -> None:
    events, kept = Events(), SentPayloads()
    at = events.send("e", {"items": [1]})
    first = kept.payload(events.read, "e", at)
    first["items"].append(2)  # a tool that changes what it was given
    assert kept.payload(events.read, "e", at) == {"items": [1]}
    again = kept.payload(events.read, "e", at)
    again["items"].clear()
    assert kept.payload(events.read, "e", at) == {"items": [1]}


def test_an_event_sent_again_under_its_name_is_read_afresh() -> None:
    events, kept = Events(), SentPayloads()
    old_at = events.send("nightly", {"day": 1})
    assert kept.payload(events.read, "nightly", old_at) == {"day": 1}
    # Retention deleted it; it was sent again later, with another payload.
    new_at = events.send("nightly", {"day": 2}, SENT + datetime.timedelta(days=1))
    assert kept.payload(events.read, "nightly", new_at) == {"day": 2}
    assert kept.payload(events.read, "nightly", new_at) == {"day": 2}
    assert events.reads == 2


def test_a_run_that_waited_on_a_deleted_event_keeps_nothing_stale() -> None:
    events, kept = Events(), SentPayloads()
    at = events.send("gone", {"x": 1})
    del events.rows["gone"]
    assert kept.payload(events.read, "gone", at) is None
    events.send("gone", {"x": 2}, SENT + datetime.timedelta(hours=1))
    # The run's reference names the first send: the row now is another send, read each time.
    assert kept.payload(events.read, "gone", at) == {"x": 2}
    assert kept.payload(events.read, "gone", at) == {"x": 2}
    assert events.reads == 3


def test_large_payloads_are_not_kept_and_few_are() -> None:
    events, kept = Events(), SentPayloads()
    big_at = events.send("big", {"blob": "x" * (MAX_KEPT_CHARS + 1)})
    for _ in range(3):
        assert kept.payload(events.read, "big", big_at)["blob"].startswith("xxx")
    assert events.reads == 3
    events.reads = 0
    ats = [events.send(f"e{i}", i) for i in range(KEPT + 1)]
    for i, at in enumerate(ats):
        assert kept.payload(events.read, f"e{i}", at) == i
    assert kept.payload(events.read, f"e{KEPT}", ats[-1]) == KEPT  # kept
    assert kept.payload(events.read, "e0", ats[0]) == 0  # the oldest went
    assert events.reads == KEPT + 2
