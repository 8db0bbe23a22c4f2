"""durable_agents._internal.calls: the slot's caller thread, walked away from on a timeout or
interrupt."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from durable_agents._internal import calls
from durable_agents._internal.interrupt import Interrupt
from durable_agents.logging import bind_run, current_run_id


@pytest.fixture(autouse=True)
def _fresh_caller() -> Any:
    yield
    calls.close_caller()


def test_returns_the_value_on_the_same_reused_thread() -> None:
    names = [calls.run_abortable(lambda abort: threading.current_thread(), Interrupt())]
    names.append(calls.run_abortable(lambda abort: threading.current_thread(), Interrupt()))
    assert names[0] is names[1]
    assert names[0] is not threading.current_thread()


def test_any_base_exception_is_handed_to_the_slot() -> None:
    def exits(abort: threading.Event) -> None:
        raise SystemExit(3)

    with pytest.raises(SystemExit):
        calls.run_abortable(exits, Interrupt())
    # The caller thread survived it and serves the next call.
    assert calls.run_abortable(lambda abort: "next", Interrupt()) == "next"


def test_a_call_past_its_timeout_is_walked_away_from() -> None:
    release = threading.Event()
    seen: list[bool] = []

    def hangs(abort: threading.Event) -> str:
        release.wait(30)
        seen.append(abort.is_set())
        return "late"

    first = calls.run_abortable(lambda abort: threading.current_thread(), Interrupt())
    with pytest.raises(calls.CallTimedOut) as raised:
        calls.run_abortable(hangs, Interrupt(), timeout=0.2)
    assert raised.value.seconds == 0.2
    # A fresh caller thread serves the slot at once; the abandoned call learns it was.
    second = calls.run_abortable(lambda abort: threading.current_thread(), Interrupt())
    assert second is not first
    release.set()
    first.join(10)
    assert seen == [True]


def test_an_interrupt_walks_away_from_a_call_in_flight() -> None:
    interrupt = Interrupt()
    started = threading.Event()

    def hangs(abort: threading.Event) -> None:
        started.set()
        abort.wait(30)

    def cancel_once_started() -> None:
        started.wait(10)
        interrupt.trigger("cancelled")

    threading.Thread(target=cancel_once_started, daemon=True).start()
    with pytest.raises(calls.CallInterrupted, match="cancelled"):
        calls.run_abortable(hangs, interrupt, timeout=30)


def test_an_interrupted_run_starts_no_call() -> None:
    interrupt = Interrupt()
    interrupt.trigger("cancelled")
    ran: list[int] = []
    with pytest.raises(calls.CallInterrupted, match="not started"):
        calls.run_abortable(lambda abort: ran.append(1), interrupt)
    assert ran == []


def test_the_call_sees_the_slots_run_id() -> None:
    with bind_run("run-42"):
        assert calls.run_abortable(lambda abort: current_run_id.get(), Interrupt()) == "run-42"


def test_meanwhile_after_a_delay_does_not_run_for_a_call_that_ended_first() -> None:
    ran: list[str] = []
    value = calls.run_abortable(
        lambda abort: "quick",
        Interrupt(),
        meanwhile=lambda: ran.append("meanwhile"),
        meanwhile_after=30.0,
    )
    assert (value, ran) == ("quick", [])


def test_meanwhile_after_a_delay_runs_while_the_call_is_still_in_flight() -> None:
    order: list[str] = []
    release = threading.Event()

    def lasts(abort: threading.Event) -> str:
        # Ends only once ``meanwhile`` has run: it must run while this call is in flight.
        assert release.wait(30)
        order.append("call ended")
        return "done"

    def meanwhile() -> None:
        order.append("meanwhile")
        release.set()

    value = calls.run_abortable(lasts, Interrupt(), meanwhile=meanwhile, meanwhile_after=0.01)
    assert (value, order) == ("done", ["meanwhile", "call ended"])


def test_meanwhile_after_a_delay_runs_before_waiting_for_a_permit() -> None:
    order: list[str] = []
    permits = threading.BoundedSemaphore(1)
    permits.acquire()  # another call holds the only permit

    def meanwhile() -> None:
        order.append("meanwhile")
        permits.release()  # that other call ends

    def call(abort: threading.Event) -> str:
        order.append("call")
        return "done"

    # Were ``meanwhile`` not run before the wait, the other call would end only after 10 s.
    def fallback_release() -> None:
        order.append("fallback")
        permits.release()

    fallback = threading.Timer(10.0, fallback_release)
    fallback.start()
    try:
        value = calls.run_abortable(
            call, Interrupt(), meanwhile=meanwhile, meanwhile_after=30.0, permits=permits
        )
    finally:
        fallback.cancel()
    # It ran once, before the wait for the permit, not again while the call ran.
    assert (value, order) == ("done", ["meanwhile", "call"])
    assert permits.acquire(blocking=False)  # the call gave its permit back
