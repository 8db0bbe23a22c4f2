"""Ways to put the offline model behind the real SDK: in-process (``offline_client``, through
``httpx2.MockTransport``) or behind a real HTTP server on 127.0.0.1 (``OfflineServer``)."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import anthropic
import httpx2

from durable_agents.offline.limits import RateLimits
from durable_agents.offline.model import ScriptedModel

# How often the server's loop looks whether it was asked to stop: close() waits up to this long
# (http.server's default, half a second, made every stop half a second).
SHUTDOWN_POLL = 0.02


def offline_client(
    *,
    scripted: ScriptedModel | None = None,
    rate_limits: RateLimits | None = None,
    **kwargs: Any,
) -> anthropic.Anthropic:
    """A real ``anthropic.Anthropic`` whose HTTP goes to a ``ScriptedModel`` in-process.

    ``rate_limits``: the model limits requests as the API does (429s the SDK raises as
    ``anthropic.RateLimitError``, ``anthropic-ratelimit-*`` headers); share one ``RateLimits``
    between clients to share the limits. ``kwargs`` go to ``anthropic.Anthropic`` and may
    override the defaults below."""
    if scripted is not None and rate_limits is not None:
        raise ValueError("give rate_limits to the ScriptedModel or to offline_client, not both")
    model = scripted or ScriptedModel(rate_limits=rate_limits)
    options: dict[str, Any] = {
        "api_key": "offline",
        "base_url": "http://offline.invalid",
        "http_client": httpx2.Client(transport=httpx2.MockTransport(model.handle)),
    }
    options.update(kwargs)
    return anthropic.Anthropic(**options)


class OfflineServer:
    """The scripted model behind a real HTTP server on 127.0.0.1 (a daemon thread).

    ``with OfflineServer() as server: anthropic.Anthropic(api_key="x", base_url=server.base_url)``
    """

    def __init__(self, scripted: ScriptedModel | None = None, port: int = 0) -> None:
        self.scripted = scripted or ScriptedModel()
        scripted_model = self.scripted

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _serve(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length) if length else b""
                headers = {k.lower(): v for k, v in self.headers.items()}
                status, out_headers, out = scripted_model.respond(
                    self.command, self.path, headers, body
                )
                self.send_response(status)
                for k, v in out_headers.items():
                    self.send_header(k, v)
                self.send_header("content-length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _serve

            def log_message(self, format: str, *args: Any) -> None:  # the base class's names
                pass  # keep test output quiet

        self._server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": SHUTDOWN_POLL}, daemon=True
        )

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_port}"  # where it is bound

    def start(self) -> OfflineServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> OfflineServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
