"""The Message Batches endpoints, through the SDK's client: create, retrieve, cancel, and the
results read as the bytes the API sent.

The bodies of a batch's requests are the stored request bodies spliced into the create body as
they are (no parse, no re-encoding: a request carries a run's whole history). The results are
read line by line from ``results_url`` with the client's own headers, so each answer can be
committed as the exact text the API returned (its thinking signatures are bound to it); the
SDK's ``results()`` would decode them, and retrieve the batch a second time first.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any

import anthropic
import httpx2
from anthropic._types import RequestOptions

from durable_agents.conf import app_settings
from durable_agents.exceptions import ModelError
from durable_agents.llm.body import request_body
from durable_agents.llm.client import get_client, sends_raw_bodies
from durable_agents.llm.retries import beta_header, classify

BATCHES_PATH = "/v1/messages/batches"


class BatchCallFailed(Exception):
    """A call to a batch endpoint failed: ``error`` says how (a ``ModelError``: its class and
    ``retry_after`` tell the caller whether and when to try again), ``status`` the HTTP status
    (None without an answer)."""

    def __init__(self, error: ModelError, status: int | None) -> None:
        super().__init__(error.message)
        self.error = error
        self.status = status


def batch_request(params: dict[str, Any], messages: bytes) -> tuple[str, str]:
    """What a turn sends through a batch: the request body (JSON text, exactly what a direct
    call without streaming sends) and its ``anthropic-beta`` header ("" for none): the
    ``BETAS`` setting's values, then the agent's (carried in ``params`` under ``betas``)."""
    agent_betas = params.get("betas")
    if agent_betas is not None:
        params = {key: value for key, value in params.items() if key != "betas"}
    body = request_body(params, messages).decode("utf-8", "surrogatepass")
    return body, beta_header(app_settings.BETAS, agent_betas)


def _client() -> anthropic.Anthropic:
    client = get_client()
    if not sends_raw_bodies(client):
        raise BatchCallFailed(
            ModelError(
                f"Message Batches need the first-party client (anthropic.Anthropic), not "
                f"{type(client).__name__}"
            ),
            None,
        )
    return client


def _call(method: str, path: str, content: bytes | None = None, betas: str = "") -> dict[str, Any]:
    client = _client()
    options: RequestOptions = {"headers": {"anthropic-beta": betas}} if betas else {}
    try:
        if method == "POST":
            response = client.post(path, cast_to=httpx2.Response, content=content, options=options)
        else:
            response = client.get(path, cast_to=httpx2.Response, options=options)
        value = json.loads(response.content)
    except (anthropic.APIError, httpx2.HTTPError, ValueError) as exc:
        status = exc.status_code if isinstance(exc, anthropic.APIStatusError) else None
        raise BatchCallFailed(classify(exc, "batches"), status) from exc
    if not isinstance(value, dict) or not isinstance(value.get("id"), str):
        raise BatchCallFailed(ModelError(f"{path}: the answer is not a message batch"), None)
    return value


def create_batch(requests: Sequence[tuple[str, str]], betas: str) -> dict[str, Any]:
    """Create a batch of ``requests`` (custom_id, request body) sent with the header ``betas``;
    the API's ``MessageBatch`` as a dict."""
    parts = [
        b'{"custom_id":'
        + json.dumps(custom_id).encode()
        + b',"params":'
        + body.encode("utf-8", "surrogatepass")
        + b"}"
        for custom_id, body in requests
    ]
    content = b'{"requests":[' + b",".join(parts) + b"]}"
    return _call("POST", BATCHES_PATH, content, betas)


def retrieve_batch(provider_id: str) -> dict[str, Any]:
    return _call("GET", f"{BATCHES_PATH}/{provider_id}")


def cancel_batch(provider_id: str) -> dict[str, Any]:
    return _call("POST", f"{BATCHES_PATH}/{provider_id}/cancel", b"")


def result_lines(results_url: str) -> Iterator[bytes]:
    """The lines of a batch's results as the API sent them (bytes, without the newline),
    streamed: a batch of ten thousand long answers is never held whole. Raises
    ``BatchCallFailed`` when the download fails (a 404, a 500, a cut connection)."""
    client = _client()
    # The client's own headers (its key, the API version); an Omit value means "not sent".
    headers = {
        key: value for key, value in client.default_headers.items() if isinstance(value, str)
    }
    try:
        with client._client.stream("GET", results_url, headers=headers) as response:
            if response.status_code >= 400:
                response.read()
                raise anthropic.APIStatusError(
                    f"results of the batch: HTTP {response.status_code}",
                    response=response,
                    body=None,
                )
            # The pieces of the line not ended yet: a long line arrives in many chunks, and
            # is joined once, when its newline comes.
            pieces: list[bytes] = []
            for chunk in response.iter_bytes():
                *ended, rest = chunk.split(b"\n")
                for piece in ended:
                    line = b"".join((*pieces, piece))
                    pieces = []
                    if line.strip():
                        yield line
                if rest:
                    pieces.append(rest)
            last = b"".join(pieces)
            if last.strip():
                yield last
    except (anthropic.APIError, httpx2.HTTPError) as exc:
        status = exc.status_code if isinstance(exc, anthropic.APIStatusError) else None
        raise BatchCallFailed(classify(exc, "batches"), status) from exc
