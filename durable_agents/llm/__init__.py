"""Model calls, one module per job:

- ``errors``: what a call ends in, a ``ModelTurn`` or a ``ModelError`` subclass;
- ``client``: the SDK client (one per process, the SDK's retries off) and the plain call;
- ``body``: the request body, sent as JSON text, and the answer checked and read back;
- ``retries``: ``create_turn``, the call retried without ever letting the lease go;
- ``sse``: a streamed turn assembled from the server-sent events.

Nothing here knows about Django models, the engine (``runner``, ``worker``) or who observes
it: each attempt of a call is reported to ``durable_agents.observers``, once. Tests that
monkeypatch a name must patch the module that looks it up (``llm.retries._backoff``, not
``llm._backoff``).
"""

from durable_agents.llm import batches
from durable_agents.llm.body import content_span, request_body
from durable_agents.llm.client import MESSAGES_PATH, default_client, get_client, reset_clients
from durable_agents.llm.errors import (
    CredentialsRefused,
    ModelCallInterrupted,
    ModelError,
    ModelTurn,
    PermanentModelError,
    TransientModelError,
)
from durable_agents.llm.retries import RETRYABLE_STATUSES, classify, create_turn

__all__ = [
    "MESSAGES_PATH",
    "RETRYABLE_STATUSES",
    "CredentialsRefused",
    "ModelCallInterrupted",
    "ModelError",
    "ModelTurn",
    "PermanentModelError",
    "TransientModelError",
    "batches",
    "classify",
    "content_span",
    "create_turn",
    "default_client",
    "get_client",
    "request_body",
    "reset_clients",
]
