"""What the offline model shares with the real API: its constants, its error answers, its ids,
its JSON bytes and the reading of a request's headers and content blocks."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from durable_agents._internal.deepjson import dumps_deep

DEFAULT_SECRET = b"durable-agents-offline"

# Real ids the API no longer serves; requests for them get the same 404 the real API gives.
RETIRED_MODELS = frozenset(
    {"claude-2.0", "claude-2.1", "claude-instant-1.2", "claude-3-sonnet-20240229"}
)

MESSAGES_PATH = "/v1/messages"

Response = tuple[int, dict[str, str], bytes]


# Not a DurableAgentsError: the offline model's server turns it into an HTTP error answer; the
# client of the model sees that answer (as a ModelError), never this exception.
class RequestError(Exception):
    """An error answer; carries what the real API would send."""

    def __init__(self, status: int, error_type: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.error_type = error_type
        self.message = message


def invalid(message: str) -> RequestError:
    """The API's answer to a malformed request: a 400 ``invalid_request_error``."""
    return RequestError(400, "invalid_request_error", message)


def hex24(*parts: object) -> str:
    """24 hex digits derived from ``parts``: the ids (message, request, tool use) of an answer
    are a function of the request, like the answer itself."""
    h = hashlib.sha256()
    for part in parts:
        # Length-prefix every part so that ("ab", "c") and ("a", "bc") hash differently.
        # surrogatepass: a hostile name or text may hold a lone surrogate; still hashable.
        data = part if isinstance(part, bytes) else str(part).encode("utf-8", "surrogatepass")
        h.update(len(data).to_bytes(8, "big"))
        h.update(data)
    return h.hexdigest()[:24]


def json_bytes(value: Any, separators: tuple[str, str] = (", ", ": ")) -> bytes:
    """JSON text as UTF-8 bytes; when a value holds a lone surrogate (which UTF-8 cannot
    encode) or nests too deep for the json module, the text is all ASCII, escapes included."""
    try:
        return json.dumps(value, ensure_ascii=False, separators=separators).encode("utf-8")
    except (RecursionError, UnicodeEncodeError):
        return dumps_deep(value, separators=separators).encode("ascii")


def text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "\n".join(
        b["text"]
        for b in content
        if isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str)
    )


def blocks_of(content: Any) -> list[Any]:
    return content if isinstance(content, list) else []


def compaction_only(content: Any) -> bool:
    """A turn that holds compaction blocks and nothing else (paused after a compaction)."""
    return (
        isinstance(content, list)
        and bool(content)
        and all(isinstance(b, dict) and b.get("type") == "compaction" for b in content)
    )


def header(headers: Mapping[str, str], name: str) -> str:
    value = headers.get(name)
    if value is None and isinstance(headers, dict):
        value = next((v for k, v in headers.items() if k.lower() == name), None)
    return value or ""


def betas_of(headers: Mapping[str, str]) -> frozenset[str]:
    return frozenset(b.strip() for b in header(headers, "anthropic-beta").split(",") if b.strip())
