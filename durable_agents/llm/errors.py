"""What a model call ends in: a ``ModelTurn``, or a ``ModelError`` whose class tells the runner
what to do next (dead-letter the run, hand it back for a later claim, or stop at once)."""

from __future__ import annotations

import dataclasses
from typing import Any

from durable_agents.exceptions import DurableAgentsError


class ModelError(DurableAgentsError):
    """A model call that did not produce a turn."""

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        request_id: str | None = None,
        retry_after: float | None = None,
        rate_headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.status = status
        self.request_id = request_id
        # What the server asked: seconds before asking again, and its rate-limit headers.
        self.retry_after = retry_after
        self.rate_headers = rate_headers or {}

    @property
    def rate_limited(self) -> bool:
        """A 429: this organisation is over a rate limit (not the run's fault)."""
        return self.status == 429

    @property
    def overloaded(self) -> bool:
        """A 529: the API is busy for everyone (not the run's fault either)."""
        return self.status == 529


class PermanentModelError(ModelError):
    """Retrying cannot help (400, 404 retired model, 413, 422): the run goes to the dead letter."""


class TransientModelError(ModelError):
    """Retries inside this claim ran out (rate limits, overload, outages, auth)."""


class CredentialsRefused(TransientModelError):
    """The API refused the credentials (401, 403), or the client had none to send: not the
    run's fault, and no retry of this claim can help. The run is handed back uncounted and the
    worker pauses its claims (``durable_agents.credentials``)."""


class ModelCallInterrupted(ModelError):
    """The run was cancelled, its lease lost, or the worker is stopping. Raised while waiting
    to retry, its ``retry_after`` is what is left of the wait the server asked for."""


@dataclasses.dataclass(frozen=True)
class ModelTurn:
    body: str  # the response body, verbatim
    request_id: str | None
    message: dict[str, Any]  # json.loads(body)
    elapsed_ms: float
    content_span: tuple[int, int] | None = None  # of the message's content in body
    # The answer's anthropic-ratelimit-* headers: what remains of the API's buckets.
    rate_headers: dict[str, str] = dataclasses.field(default_factory=dict)
