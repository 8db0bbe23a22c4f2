"""The worker's hint of whether runs may wait to be claimed (engine/claimable.py): when a
slot's last step sends the claim of its next run along, and when it leaves it out."""

from __future__ import annotations

from durable_agents.engine.claimable import ClaimableHint


def hint(*, hears: bool = True, forget_seconds: float = 3600.0) -> ClaimableHint:
    return ClaimableHint(lambda: hears, forget_seconds)


def test_runs_may_wait_until_a_claim_finds_none() -> None:
    h = hint()
    assert h.may_wait()
    h.found_none(h.epoch())
    assert not h.may_wait()


def test_a_notification_or_a_full_batch_says_runs_may_wait_again() -> None:
    h = hint()
    h.found_none(h.epoch())
    h.notified()
    assert h.may_wait()
    h.found_none(h.epoch())
    h.found_some()
    assert h.may_wait()


def test_a_claim_that_found_none_is_not_believed_if_a_notification_came_while_it_ran() -> None:
    h = hint()
    epoch = h.epoch()
    h.notified()  # a run became claimable after the claim had looked
    h.found_none(epoch)
    assert h.may_wait()


def test_a_claim_that_found_none_is_forgotten_after_a_while() -> None:
    # Timers coming due and expired leases notify nobody: the hint does not outlive them.
    h = hint(forget_seconds=0.0)
    h.found_none(h.epoch())
    assert h.may_wait()


def test_without_notifications_runs_always_may_wait() -> None:
    h = hint(hears=False)
    h.found_none(h.epoch())
    assert h.may_wait()
