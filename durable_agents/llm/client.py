"""The SDK client and the plain (non-streamed) call.

Every call goes through the official ``anthropic`` SDK: one client per process, built by the
``CLIENT_FACTORY`` setting, with the SDK's own retries switched off (``retries`` does them
instead). The first-party client is sent the request body as given and its answer is read raw,
so the provider's body is stored byte for byte.
"""

from __future__ import annotations

import itertools
import json
import threading
from collections.abc import Callable, Mapping

import anthropic
import httpx2
from django.utils.module_loading import import_string

from durable_agents.conf import app_settings

MESSAGES_PATH = "/v1/messages"


def default_client() -> anthropic.Anthropic:
    """An ``anthropic.Anthropic`` (ANTHROPIC_API_KEY, ANTHROPIC_BASE_URL), or the offline model."""
    if app_settings.OFFLINE:
        from durable_agents.offline import offline_client

        return offline_client()
    # The SDK's own pool keeps 100 idle connections (and opens at most 1,000): with more calls
    # in flight than that, each connection past the hundredth would be closed after its call
    # and opened again for the next one. The worker's concurrency already bounds how many
    # calls are in flight (and get_client spreads them over several clients), so the pool is
    # not bounded again. DefaultHttpxClient keeps the SDK's other defaults (timeouts, redirects, TCP
    # keep-alive, proxies from the environment).
    return anthropic.Anthropic(
        http_client=anthropic.DefaultHttpxClient(
            limits=httpx2.Limits(max_connections=None, max_keepalive_connections=1000)
        )
    )


_clients: dict[tuple[str, bool, float, int], anthropic.Anthropic] = {}
_clients_lock = threading.Lock()

# The connection pool under the SDK (httpcore) scans every connection it holds, and probes
# the socket of each idle one, on every request and every response. One client carrying a
# thousand calls in flight spends more CPU in that scan than in the calls. So the threads of
# a worker share clients by groups of THREADS_PER_CLIENT (at most MAX_CLIENTS of them): a
# worker with up to 64 calls in flight has one client, as before.
THREADS_PER_CLIENT = 64
MAX_CLIENTS = 16
_thread_order = itertools.count()
_local = threading.local()


def get_client() -> anthropic.Anthropic:
    """This thread's client: one per (factory, OFFLINE, timeout, group of threads) per
    process, with the SDK's own retries off (see ``create_turn``). SDK clients are
    thread-safe; the groups only keep each connection pool small."""
    group = getattr(_local, "group", None)
    if group is None:
        group = _local.group = next(_thread_order) // THREADS_PER_CLIENT % MAX_CLIENTS
    cache_key = (
        app_settings.CLIENT_FACTORY,
        bool(app_settings.OFFLINE),
        app_settings.MODEL_TIMEOUT,
        group,
    )
    with _clients_lock:
        client = _clients.get(cache_key)
        if client is None:
            factory: Callable[[], anthropic.Anthropic] = import_string(cache_key[0])
            client = configured(factory())
            _clients[cache_key] = client
        return client


def configured(client: anthropic.Anthropic) -> anthropic.Anthropic:
    """``client`` as every call uses it: the SDK's retries off, the ``MODEL_TIMEOUT``."""
    return client.with_options(max_retries=0, timeout=app_settings.MODEL_TIMEOUT)


def reset_clients() -> None:
    with _clients_lock:
        _clients.clear()


def sends_raw_bodies(client: anthropic.Anthropic) -> bool:
    # The first-party client posts a body as given. Other clients (Bedrock, Vertex) rewrite
    # the path and body from the parsed parameters, so they get them parsed.
    return isinstance(client, anthropic.Anthropic)


RATE_LIMIT_PREFIX = "anthropic-ratelimit-"

# What one call answered: the response body verbatim, the provider's request id, and the
# response's rate-limit headers.
Answer = tuple[str, str | None, dict[str, str]]


def rate_limit_headers(headers: Mapping[str, str] | None) -> dict[str, str]:
    """The ``anthropic-ratelimit-*`` headers of a response, lower-cased, and nothing else."""
    if not headers:
        return {}
    return {
        key.lower(): value
        for key, value in headers.items()
        if key.lower().startswith(RATE_LIMIT_PREFIX)
    }


def post_message(client: anthropic.Anthropic, body: bytes, extra_headers: dict[str, str]) -> Answer:
    """One non-streamed call; the response body verbatim, the provider's request id and the
    rate-limit headers."""
    if not sends_raw_bodies(client):
        raw = client.messages.with_raw_response.create(
            **json.loads(body), extra_headers=extra_headers or None
        )
        return (
            raw.http_response.content.decode("utf-8"),
            raw.request_id,
            rate_limit_headers(raw.http_response.headers),
        )
    # Errors raise the SDK's APIStatusError subclasses, as messages.create would.
    response = client.post(
        MESSAGES_PATH,
        cast_to=httpx2.Response,
        content=body,
        options={"headers": extra_headers} if extra_headers else {},
    )
    return (
        response.content.decode("utf-8"),
        response.headers.get("request-id"),
        rate_limit_headers(response.headers),
    )
