"""Signed links to the approve and reject confirmation pages of an intent.

A notification (a mail, a webhook) takes a person straight to the page where they confirm a
decision: ``.../toolintent/<id>/approve/?link=<token>``. The token grants nothing: the page
still needs an admin login and the ``approve_toolintent`` permission, shows exactly what will
run, and decides only on a POST carrying its CSRF token. What the signature adds is that a link
is refused (403) when it was not made by this site (forged or altered), when it is older than
``LINK_MAX_AGE``, when it is used for another intent or another action than the one it was made
for, or when what the intent would run (its tool and input) is no longer what it was when the
link was made: a person who follows it then sees the intent's page, not a confirmation of
something the notification never described.

The token is ``django.core.signing``'s ``TimestampSigner`` (keyed by ``SECRET_KEY``, with a salt
of its own) over the intent id, the action and a digest of the call. The digest is an HMAC keyed
by ``SECRET_KEY`` too, not a bare hash: a token travels in plain text (mail, chat), and a bare
hash of a short input could be checked against guesses; a keyed one cannot without the key.
"""

from __future__ import annotations

import enum
import json
from typing import Any

from django.core import signing
from django.utils.crypto import constant_time_compare, salted_hmac
from django.utils.translation import gettext_noop

from durable_agents.conf import app_settings

# The query parameter that carries the token on a confirmation page's URL.
LINK_PARAMETER = "link"
SIGNING_SALT = "durable_agents.intent-link"
DIGEST_SALT = "durable_agents.intent-link.call"
ACTIONS = ("approve", "reject")


class LinkProblem(enum.Enum):
    """Why a link is refused; the value is what the 403 page says."""

    FORGED = gettext_noop("it was not made by this site, or it was altered")
    EXPIRED = gettext_noop("it has expired")
    OTHER_INTENT = gettext_noop("it was made for another intent or another decision")
    CHANGED = gettext_noop("what the intent would run has changed since the link was made")


def call_digest(intent_id: Any, run_id: Any, tool: str, arguments: Any) -> str:
    """A keyed digest of exactly what the intent would run: its id, run, tool and arguments
    (ASCII JSON, so that any value has one text)."""
    canonical = json.dumps(
        [str(intent_id), str(run_id), tool, arguments],
        ensure_ascii=True,
        separators=(",", ":"),
        sort_keys=True,
        default=str,
    )
    return salted_hmac(DIGEST_SALT, canonical, algorithm="sha256").hexdigest()


def _digest_of(intent: Any) -> str:
    return call_digest(intent.pk, intent.run_id, intent.tool, intent.input)


def _signer() -> signing.TimestampSigner:
    return signing.TimestampSigner(salt=SIGNING_SALT)


def sign(intent: Any, action: str) -> str:
    """The token of a link to ``action`` ("approve" or "reject") on ``intent`` as it is now."""
    if action not in ACTIONS:
        raise ValueError(f"an intent link is for one of {ACTIONS}, not {action!r}")
    return _signer().sign_object(
        {"i": str(intent.pk), "a": action, "d": _digest_of(intent)}, compress=False
    )


def problem(token: str, intent: Any, action: str) -> LinkProblem | None:
    """What is wrong with ``token`` as a link to ``action`` on ``intent``, or None when it is
    good: signed here, younger than LINK_MAX_AGE, for this intent and action, and for the call
    the intent would make now."""
    try:
        signed = _signer().unsign_object(token, max_age=float(app_settings.LINK_MAX_AGE))
    except signing.SignatureExpired:
        return LinkProblem.EXPIRED
    except (signing.BadSignature, ValueError, UnicodeError):
        return LinkProblem.FORGED
    if not isinstance(signed, dict):
        return LinkProblem.FORGED
    if signed.get("i") != str(intent.pk) or signed.get("a") != action:
        return LinkProblem.OTHER_INTENT
    if not constant_time_compare(str(signed.get("d", "")), _digest_of(intent)):
        return LinkProblem.CHANGED
    return None
