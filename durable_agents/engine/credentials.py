"""Whether the API accepts this process's credentials, and how long claims pause when it does not.

A 401 or 403 (a missing, wrong or revoked key, a key without access) is the worker's fault, not
the run's: every run it claimed would fail the same way. So the runner hands such a run back
uncounted (``refused``) and the claimer stops claiming for a while (``pause_remaining``): 30
seconds, doubling up to 5 minutes while the refusals go on. One ERROR line says why when the
API starts refusing, one INFO line when a model call is answered again (``accepted``); nothing
in between, whatever the number of runs or slots.

The state is the process's: the SDK client, and the key it reads from the environment, are too.
"""

from __future__ import annotations

import logging
import threading
import time

logger = logging.getLogger("durable_agents.worker")

# The first pause of the claims after a refusal, and the longest (each refusal after a pause
# doubles it). Module attributes so that a test can make them short.
FIRST_PAUSE_SECONDS = 30.0
MAX_PAUSE_SECONDS = 300.0

_lock = threading.Lock()
# None while the credentials are not known to be refused; else when the pause of claims ends
# (monotonic) and how long it was.
_until: float | None = None
_pause = 0.0


def refused(status: int | None, message: str) -> None:
    """The API refused the credentials (``status`` 401 or 403; None when the client had none
    to send). The first refusal logs why and pauses claims; a refusal of a run claimed after
    the pause ended doubles the pause; refusals of runs already in flight change nothing."""
    global _until, _pause
    now = time.monotonic()
    with _lock:
        if _until is not None and now < _until:
            return
        first = _until is None
        _pause = FIRST_PAUSE_SECONDS if first else min(_pause * 2, MAX_PAUSE_SECONDS)
        _until = now + _pause
        pause = _pause
    if first:
        what = (
            f"the API refused this worker's credentials ({status})"
            if status
            else "this worker has no credentials for the API"
        )
        # One line, no traceback: the message says all there is to know.
        logger.error(
            "%s: %s. No run is charged for it: claims pause for %.0fs, then resume with a "
            "pause doubling up to %.0fs while the API refuses. Set ANTHROPIC_API_KEY (or "
            "ANTHROPIC_AUTH_TOKEN, or CLIENT_FACTORY) for the workers.",
            what,
            message,
            pause,
            MAX_PAUSE_SECONDS,
        )
    else:
        logger.debug("the API still refuses the credentials; claims pause for %.0fs", pause)


def accepted() -> None:
    """A model call was answered: if the credentials were refused, say that they work again."""
    global _until, _pause
    if _until is None:  # the usual case, read without the lock
        return
    with _lock:
        if _until is None:
            return
        _until, _pause = None, 0.0
    logger.info("the API accepts this worker's credentials again: claims resume")


def pause_remaining() -> float:
    """Seconds until claims may resume; 0 when they need not pause."""
    until = _until
    return 0.0 if until is None else max(0.0, until - time.monotonic())


def is_refused() -> bool:
    """The last word of the API on the credentials was a refusal."""
    return _until is not None


def reset() -> None:
    """Forget any refusal (tests)."""
    global _until, _pause
    with _lock:
        _until, _pause = None, 0.0
