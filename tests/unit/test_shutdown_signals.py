"""A worker's SIGTERM and SIGINT go through a pipe to a thread of their own
(engine/shutdown_signals.py): the handler, which Python runs on the main thread between two
bytecodes, takes no lock that thread may hold."""

from __future__ import annotations

import os
import signal
import threading

from durable_agents.engine.shutdown_signals import SignalRelay


def test_a_signal_handled_while_its_thread_holds_the_wake_events_lock_still_wakes_it() -> None:
    """What hung a worker on shutdown: the signal arrived while the claim loop was inside
    ``Event.wait`` (which holds the event's lock around each check), and the handler set that
    same event, waiting for a lock its own thread held."""
    wake = threading.Event()
    signals: list[int] = []

    def on_signal(signum: int) -> None:
        signals.append(signum)
        wake.set()

    relay = SignalRelay(on_signal)
    relay._thread.start()  # the relay without the process's handlers: the test calls handle()

    def handled_while_holding_the_lock() -> None:
        with wake._cond:  # type: ignore[attr-defined]  # as Event.wait holds it
            relay.handle(signal.SIGTERM)

    thread = threading.Thread(target=handled_while_holding_the_lock, daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "the handler waited for a lock its own thread held"
    assert wake.wait(10)
    assert signals == [signal.SIGTERM]
    relay.uninstall()
    relay._thread.join(10)
    assert not relay._thread.is_alive()  # the closed pipe ended it


def test_real_signals_reach_the_relay_and_the_previous_handlers_come_back() -> None:
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    got = threading.Event()
    signals: list[int] = []

    def on_signal(signum: int) -> None:
        signals.append(signum)
        if len(signals) == 2:
            got.set()

    relay = SignalRelay(on_signal)
    relay.install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
        assert got.wait(10)
    finally:
        relay.uninstall()
    assert signals == [signal.SIGTERM, signal.SIGINT]
    assert {sig: signal.getsignal(sig) for sig in before} == before
