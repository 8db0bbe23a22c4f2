"""The worker's knowledge of messages queued since a run's last inbox look
(engine/inbox_hint.py): when a model call skips the look, and when it looks again."""

from __future__ import annotations

from durable_agents.engine import inbox_hint
from durable_agents.engine.inbox_hint import InboxHint

RUN = "01a25050-7871-7477-bb48-983a951d76b3"
OTHER = "01a25050-7889-70b2-9b06-4647aa80b054"


class Listener:
    """The generation of the listener's connection, or None while it does not listen."""

    def __init__(self) -> None:
        self.generation: int | None = 1

    def __call__(self) -> int | None:
        return self.generation


def looked_and_found_none(h: InboxHint, run_id: str = RUN) -> None:
    h.looked(run_id, h.mark(), found=False)


def test_a_run_looks_until_a_look_found_none_then_not_until_a_message_is_heard() -> None:
    h = InboxHint(Listener())
    assert h.may_wait(RUN)  # never looked
    looked_and_found_none(h)
    assert not h.may_wait(RUN)
    h.heard(OTHER)  # another run's message changes nothing here
    assert not h.may_wait(RUN)
    h.heard(RUN)
    assert h.may_wait(RUN)


def test_a_message_heard_while_the_look_ran_is_not_taken_as_seen() -> None:
    h = InboxHint(Listener())
    mark = h.mark()
    h.heard(RUN)  # committed after the look's snapshot, heard before the look came back
    h.looked(RUN, mark, found=False)
    assert h.may_wait(RUN)


def test_a_message_heard_before_the_look_began_was_seen_by_it() -> None:
    h = InboxHint(Listener())
    h.heard(RUN)
    looked_and_found_none(h)  # it was folded before, or the look would have found it
    assert not h.may_wait(RUN)


def test_a_look_that_found_messages_leaves_the_next_call_to_look() -> None:
    h = InboxHint(Listener())
    looked_and_found_none(h)
    h.looked(RUN, h.mark(), found=True)
    assert h.may_wait(RUN)


def test_the_ids_compare_as_text() -> None:
    import uuid

    h = InboxHint(Listener())
    looked_and_found_none(h, RUN)
    assert not h.may_wait(uuid.UUID(RUN))
    h.heard(uuid.UUID(RUN))
    assert h.may_wait(RUN)


def test_a_listener_down_or_reconnected_since_the_look_means_looking_again() -> None:
    listener = Listener()
    h = InboxHint(listener)
    looked_and_found_none(h)
    listener.generation = None  # the connection is down: notifications may be missed
    assert h.may_wait(RUN)
    listener.generation = 2  # back, on a new connection: what came in between is unknown
    assert h.may_wait(RUN)
    looked_and_found_none(h)
    assert not h.may_wait(RUN)


def test_a_look_while_the_listener_was_down_stands_for_nothing() -> None:
    listener = Listener()
    listener.generation = None
    h = InboxHint(listener)
    mark = h.mark()
    listener.generation = 1
    h.looked(RUN, mark, found=False)
    assert h.may_wait(RUN)


def test_a_claim_that_ended_forgets_its_look() -> None:
    h = InboxHint(Listener())
    looked_and_found_none(h)
    h.forget(RUN)
    assert h.may_wait(RUN)


def test_too_many_runs_heard_forgets_them_all_and_every_run_looks_again(monkeypatch) -> None:
    monkeypatch.setattr(inbox_hint, "MAX_HEARD", 3)
    h = InboxHint(Listener())
    looked_and_found_none(h)
    for i in range(3):
        h.heard(f"other-{i}")
    assert not h.may_wait(RUN)
    h.heard("one-too-many")  # the list is cleared: RUN's message may have been among them
    assert h.may_wait(RUN)
    looked_and_found_none(h)
    assert not h.may_wait(RUN)


def test_a_claim_that_did_not_look_changes_nothing() -> None:
    h = InboxHint(Listener())
    h.looked(RUN, h.mark(), found=None)
    assert h.may_wait(RUN)  # still unknown: the next model call looks
    looked_and_found_none(h)
    h.looked(RUN, h.mark(), found=None)
    assert not h.may_wait(RUN)  # the look that found none still stands
