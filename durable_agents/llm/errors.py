"""What a model call ends in: a ``ModelTurn``, or a ``ModelError`` whose class tells the runner
what to do next (dead-letter the run, hand it back for a later claim, or stop at once)."""

from __future__ import annotations

import dataclasses
from typing import Any

from durable_agents.exceptions import DurableAgentsError


class ModelError(DurableAgentsError):
    """A model call that did not produce a turn."""

    def __init__(self, message: str, *, status: int | None = None, request_id: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.request_id = request_id


class PermanentModelError(ModelError):
    """Retrying cannot help (400, 404 retired model, 413, 422): the run goes to the dead letter."""


class TransientModelError(ModelError):
    """Retries inside this claim ran out (rate limits, overload, outages, auth)."""


class ModelCallInterrupted(ModelError):
    """The run was cancelled, its lease lost, or the worker is stopping."""


@dataclasses.dataclass(frozen=True)
class ModelTurn:
    body: str  # the response body, verbatim
    request_id: str | None
    message: dict[str, Any]  # json.loads(body)
    elapsed_ms: float
    content_span: tuple[int, int] | None = None  # of the message's content in body
