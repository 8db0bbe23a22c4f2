"""A fake Messages API over real HTTP for tests: the offline scripted model behind a
ThreadingHTTPServer, recording every request body and able to inject faults.

Worker subprocesses reach it through ANTHROPIC_BASE_URL, so the SDK's whole HTTP path is
exercised, and the test process sees every body the workers sent.

``FakeAnthropic(rate_limits=RateLimits(...))`` limits requests as the API does (the offline
model's limiter): 429s with ``retry-after`` and the ``anthropic-ratelimit-*`` headers.

The Message Batches endpoints (``/v1/messages/batches``, GET and POST) are answered by the
model's ``BatchDesk`` (``fake.batches``; a new one per fake unless ``batches=`` is given); their
calls are recorded in ``batch_calls``, not in ``requests`` (the Messages calls), and never take a
``fail_next`` fault: those are for Messages calls.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from durable_agents._internal.deepjson import loads_deep
from durable_agents.offline import BatchDesk, RateLimits, ScriptedModel
from durable_agents.offline.batches import is_batch_path
from durable_agents.offline.transport import SHUTDOWN_POLL

Fault = tuple[int, dict[str, str], bytes]


@dataclass
class Recorded:
    body: bytes
    headers: dict[str, str]
    status: int
    at: float = field(default_factory=time.monotonic)
    answer_headers: dict[str, str] = field(default_factory=dict)
    events_sent: int = 0
    cut: bool = False
    client_closed: bool = False
    method: str = "POST"
    path: str = "/v1/messages"

    def json(self) -> dict[str, Any]:
        return json.loads(self.body)

    @property
    def turn(self) -> int:
        """How many assistant turns the request already carries."""
        return sum(1 for m in self.json()["messages"] if m["role"] == "assistant")


def api_error(status: int, error_type: str, message: str, **headers: str) -> Fault:
    body = json.dumps({"type": "error", "error": {"type": error_type, "message": message}})
    return (
        status,
        {"content-type": "application/json", "request-id": "req_fault", **headers},
        (body.encode()),
    )


class FakeAnthropic:
    def __init__(
        self, rate_limits: RateLimits | None = None, batches: BatchDesk | None = None
    ) -> None:
        desk = batches if batches is not None else BatchDesk()
        self.model = ScriptedModel(rate_limits=rate_limits, batches=desk)
        self.requests: list[Recorded] = []
        self.batch_calls: list[Recorded] = []
        self._faults: list[Fault] = []
        self._cuts: list[int] = []
        self._lock = threading.Lock()
        # Called with the request body before answering; may block (to hold a worker mid-call).
        self.before_answer: Callable[[dict[str, Any]], None] | None = None
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self) -> None:
                super().setup()
                self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

            def do_POST(self) -> None:  # http.server's naming
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length)
                headers = {k.lower(): v for k, v in self.headers.items()}
                if is_batch_path(self.path):
                    status, out_headers, out = fake._batch(self.command, self.path, headers, body)
                elif self.command != "POST":  # no Messages call: the model's 404, no fault
                    status, out_headers, out = fake.model.respond(
                        self.command, self.path, headers, body
                    )
                elif fake._is_stream(body):
                    fake._stream(self, headers, body)
                    return
                else:
                    status, out_headers, out = fake._answer(self.command, self.path, headers, body)
                self.send_response(status)
                for key, value in out_headers.items():
                    self.send_header(key, value)
                self.send_header("content-length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            do_GET = do_DELETE = do_POST

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": SHUTDOWN_POLL}, daemon=True
        )
        self._thread.start()

    @property
    def batches(self) -> BatchDesk:
        """The model's Message Batches: its knobs, faults and statistics."""
        return self.model.batches

    @property
    def base_url(self) -> str:
        host, port = self._server.server_address[:2]
        assert isinstance(host, str)  # an AF_INET address
        return f"http://{host}:{port}"

    def cut_next_stream(self, after_events: int, times: int = 1) -> None:
        """The next streamed answer stops after that many events and the connection drops."""
        with self._lock:
            self._cuts.extend([after_events] * times)

    @staticmethod
    def _is_stream(body: bytes) -> bool:
        try:
            return loads_deep(body).get("stream") is True
        except (ValueError, AttributeError):
            return False

    def _stream(
        self, handler: BaseHTTPRequestHandler, headers: dict[str, str], body: bytes
    ) -> None:
        with self._lock:
            cut = self._cuts.pop(0) if self._cuts else None
        status, out_headers, chunks = self.model.respond_stream("POST", handler.path, headers, body)
        record = Recorded(body, headers, status, answer_headers=out_headers)
        with self._lock:
            self.requests.append(record)
        handler.send_response(status)
        for key, value in out_headers.items():
            handler.send_header(key, value)
        if status != 200:
            out = b"".join(chunks)
            handler.send_header("content-length", str(len(out)))
            handler.end_headers()
            handler.wfile.write(out)
            return
        handler.send_header("connection", "close")
        handler.end_headers()
        handler.close_connection = True
        try:
            for number, chunk in enumerate(chunks):
                if cut is not None and number >= cut:
                    record.events_sent = number
                    record.cut = True
                    handler.connection.shutdown(socket.SHUT_RDWR)
                    return
                handler.wfile.write(chunk)
                handler.wfile.flush()
                record.events_sent = number + 1
        except OSError:
            record.client_closed = True  # the worker hung up: the stream was aborted

    def fail_next(self, fault: Fault, times: int = 1) -> None:
        with self._lock:
            self._faults.extend([fault] * times)

    def _answer(self, method: str, path: str, headers: dict[str, str], body: bytes) -> Fault:
        with self._lock:
            fault = self._faults.pop(0) if self._faults else None
        if fault is None and self.before_answer is not None:
            with contextlib.suppress(ValueError):
                self.before_answer(loads_deep(body))
        status, out_headers, out = fault or self.model.respond(method, path, headers, body)
        with self._lock:
            self.requests.append(Recorded(body, headers, status, answer_headers=out_headers))
        return status, out_headers, out

    def _batch(self, method: str, path: str, headers: dict[str, str], body: bytes) -> Fault:
        """A Message Batches call: answered by the model's desk, recorded in ``batch_calls``."""
        status, out_headers, out = self.model.respond(method, path, headers, body)
        record = Recorded(
            body, headers, status, answer_headers=out_headers, method=method, path=path
        )
        with self._lock:
            self.batch_calls.append(record)
        return status, out_headers, out

    def ok_requests(self) -> list[Recorded]:
        with self._lock:
            return [r for r in self.requests if r.status == 200]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
