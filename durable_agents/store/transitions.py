"""Whether a store call made the transition it was asked for, or found it made already.

Two people (or one person's two tabs) deciding the same intent at once both get the decided
intent back from the store: the intent's lock orders them, and the second finds nothing left
to do. Only the call that made the transition may audit it, so the store marks what it returns
when this call changed it (approve, reject, resolve, answer, send an event); ``api`` reads the
mark with ``made_transition``. The mark is an attribute of the returned object only, never
stored.
"""

from __future__ import annotations

from typing import TypeVar

_T = TypeVar("_T")

_MARK = "_durable_agents_transitioned"


def mark_transitioned(obj: _T) -> _T:
    """``obj``, marked as changed by the call that returns it."""
    vars(obj)[_MARK] = True
    return obj


def made_transition(obj: object) -> bool:
    """Whether the store call that returned ``obj`` made its transition."""
    return bool(getattr(obj, "__dict__", {}).get(_MARK, False))
