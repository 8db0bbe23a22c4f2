"""What a model call ends in: a ``ModelTurn``, or a ``ModelError`` whose class tells the runner
what to do next (dead-letter the run, hand it back for a later claim, or stop at once)."""

from __future__ import annotations

import dataclasses
from typing import Any

# The errors are defined in durable_agents.exceptions (the one error tree) and keep their names
# here, where the model clients and the runner have always imported them.
from durable_agents.exceptions import (
    CredentialsRefused,
    ModelCallInterrupted,
    ModelError,
    PermanentModelError,
    TransientModelError,
)

__all__ = [
    "CredentialsRefused",
    "ModelCallInterrupted",
    "ModelError",
    "ModelTurn",
    "PermanentModelError",
    "TransientModelError",
]


@dataclasses.dataclass(frozen=True)
class ModelTurn:
    body: str  # the response body, verbatim
    request_id: str | None
    message: dict[str, Any]  # json.loads(body)
    elapsed_ms: float
    content_span: tuple[int, int] | None = None  # of the message's content in body
    # The answer's anthropic-ratelimit-* headers: what remains of the API's buckets.
    rate_headers: dict[str, str] = dataclasses.field(default_factory=dict)
