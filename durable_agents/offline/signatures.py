"""Thinking signatures, the point of the offline model: like the real API, a thinking block is
only accepted back if everything it was produced from (model, system, tools, earlier messages,
its text) is sent back byte-identical in value and key order. This is what lets tests prove that
a durable store replays history verbatim."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from typing import Any

from durable_agents._internal.deepjson import dumps_deep

SIGNATURE_ERROR = "Invalid `signature` in `thinking` block"


def canonical_bytes(obj: Any) -> bytes:
    """Canonical bytes for signing: compact JSON that keeps key order (no sort_keys), so a
    reordered dict anywhere in the history counts as a change, as it does for the real API."""
    try:
        text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    except RecursionError:
        # Deeper than the json module can walk (a hostile input): same value, same bytes.
        text = dumps_deep(obj, separators=(",", ":"))
    # surrogatepass: a lone surrogate still signs (deterministically) instead of crashing.
    return text.encode("utf-8", "surrogatepass")


def sign(
    secret: bytes,
    model: str,
    system: Any,
    tools: Any,
    earlier_messages: list[Any],
    thinking_text: Any,
) -> str:
    """Signature of a thinking block: base64(HMAC-SHA256(secret, canonical([model, system,
    tools, earlier_messages, thinking_text]))), each element (and each earlier message)
    encoded on its own by ``canonical_bytes``. ``system`` and ``tools`` are as sent (``None``
    when absent); ``earlier_messages`` are what the model read before the block's turn."""
    signer = Signer(secret, model, system, tools)
    for message in earlier_messages:
        signer.add(canonical_bytes(message))
    return signer.sign(thinking_text)


class Signer:
    """``sign`` over a growing list of earlier messages: each message is encoded and hashed
    once, so checking every thinking block of a request costs one pass over it."""

    def __init__(self, secret: bytes, model: str, system: Any, tools: Any) -> None:
        self._mac = hmac.new(secret, digestmod=hashlib.sha256)
        for part in (
            b"[",
            canonical_bytes(model),
            b",",
            canonical_bytes(system),
            b",",
            canonical_bytes(tools),
            b",[",
        ):
            self._mac.update(part)
        self._first = True

    def add(self, message_bytes: bytes) -> None:
        if not self._first:
            self._mac.update(b",")
        self._first = False
        self._mac.update(message_bytes)

    def sign(self, thinking_text: Any) -> str:
        mac = self._mac.copy()
        mac.update(b"],")
        mac.update(canonical_bytes(thinking_text))
        mac.update(b"]")
        return base64.b64encode(mac.digest()).decode("ascii")
