"""Calls from services: a tool call's signed, single-use callback URL.

A tool that asks a service for something slow (a payment, a signature, a build) hands it the
URL ``callback_url()`` gives, then raises ``Wait(callback=True)``; the run parks. The
service's POST of a JSON body to the URL (``views.receive``) completes the wait: the same call
is invoked again with ``woken_by={"callback": body, "at": iso}``.

    callback_url()          in tool code: the current call's URL (SITE_URL + its path)
    callback_token(r, k)    the signed token of the call ``k`` of run ``r`` (the URL's tail)
    callback_target(token)  (run id, call key) of a token; None for a forged or altered one
    parse_body(raw)         the POSTed JSON value, or ``BadBody`` (400/413)

The token is django.core.signing over (run id, the call's idempotency key) with a salt of its
own, signed with SECRET_KEY (tokens signed with a key in SECRET_KEY_FALLBACKS are accepted
too, so rotate by moving the old key there until the outstanding waits are over; removing it
invalidates them). It has no age limit: the wait's timeout bounds how long it is useful. The
call's key is derived from the run and the call's place in it, so a crash and a re-invocation
of the call, in any process, give the same URL: the service may hold the first one already.

A URL is single-use by the store's transition (``Store.receive_callback``): the body is kept
once per call, under the run's lock, and only a run still waiting on that very call's callback
moves. A POST that comes before the call parked is kept, and the park goes on at once with it.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from django.core import signing
from django.urls import NoReverseMatch, reverse

from durable_agents._internal.text import MAX_DEPTH
from durable_agents.conf import app_settings
from durable_agents.declare import waits

__all__ = ["BadBody", "callback_target", "callback_token", "callback_url", "parse_body"]

_SALT = "durable_agents.callbacks"
# The separator of run id and key in the signed value (neither contains it).
_SEP = "."
_KEY = re.compile(r"[0-9a-f]{1,64}")
# NUL (which no text column stores) and lone surrogates (which no UTF-8 column stores).
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


def callback_token(run_id: Any, key: str) -> str:
    """The signed token of the call with idempotency key ``key`` in run ``run_id``."""
    return signing.Signer(salt=_SALT).sign(f"{uuid.UUID(str(run_id))}{_SEP}{key}")


def callback_target(token: str) -> tuple[uuid.UUID, str] | None:
    """The (run id, call key) a token names; None for a forged, altered or malformed one."""
    try:
        value = signing.Signer(salt=_SALT).unsign(token)
        run, key = value.split(_SEP)
        if _KEY.fullmatch(key) is None:
            return None
        return uuid.UUID(run), key
    except (signing.BadSignature, ValueError):
        return None


def callback_url() -> str:
    """The signed URL that completes the current tool call's ``Wait(callback=True)``: give it
    to the service before raising the wait. Deterministic for the call (its run and its
    place in the run): every invocation of the call, after a crash too, gets the same URL.
    ``SITE_URL`` followed by the path, or the path alone when SITE_URL is not set. Raises
    ``RuntimeError`` outside tool code, and when ``durable_agents.urls`` is not in the
    project's URLs."""
    call = waits.current_call()
    if call is None:
        raise RuntimeError(
            "callback_url gives the URL of the tool call that is running; call it in tool code"
        )
    try:
        path = reverse("durable_agents:callback", args=[callback_token(call.run_id, call.key)])
    except NoReverseMatch:
        raise RuntimeError(
            "callback_url needs the app's URLs: add path('agents/', "
            "include('durable_agents.urls')) to the project's urlpatterns"
        ) from None
    base = app_settings.SITE_URL
    if not isinstance(base, str) or not base.strip():
        return path
    return base.strip().rstrip("/") + path


class BadBody(Exception):
    """A POSTed body the wait does not take: ``status`` (400 or 413) and why."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


def parse_body(raw: bytes, limit: int) -> Any:
    """The JSON value of a POSTed body: at most ``limit`` bytes (413 otherwise), UTF-8 JSON
    without NaN or infinities, nested at most MAX_DEPTH levels, whose strings (keys too) hold
    no NUL and no lone surrogate (400 otherwise)."""
    if len(raw) > limit:
        raise BadBody(413, f"the body is at most {limit} bytes (CALLBACK_MAX_BYTES)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise BadBody(400, "the body is not UTF-8 text") from None

    def refuse_constant(name: str) -> Any:
        raise ValueError(f"{name} is not a JSON value")

    try:
        value = json.loads(text, parse_constant=refuse_constant)
    except RecursionError:
        raise BadBody(400, f"the body nests deeper than {MAX_DEPTH} levels") from None
    except ValueError as exc:
        raise BadBody(400, f"the body is not JSON: {str(exc)[:200]}") from None
    problem = _unstorable(value)
    if problem is not None:
        raise BadBody(400, problem)
    return value


def _unstorable(value: Any) -> str | None:
    """What in the JSON value cannot be stored (too deep, NUL, lone surrogates), or None."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            bad = _UNSTORABLE.search(item)
            if bad is not None:
                return (
                    f"the body's strings cannot hold NUL or lone surrogates ({bad.group()!a} found)"
                )
            continue
        if isinstance(item, dict):
            children: list[Any] = [*item.keys(), *item.values()]
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > MAX_DEPTH:
            return f"the body nests deeper than {MAX_DEPTH} levels"
        stack.extend((child, depth + 1) for child in children)
    return None
