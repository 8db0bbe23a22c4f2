"""A zero-latency fake Messages API in its own process: ``python -m bench.fakeapi --port N``.

The offline scripted model (``durable_agents.offline.ScriptedModel.respond``) behind a
ThreadingHTTPServer, HTTP/1.1 keep-alive, TCP_NODELAY on every accepted socket (without it each
call would pay a 40 ms delayed ACK). Prints ``PORT <n>`` on stdout once it listens.
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from durable_agents.offline import ScriptedModel


def make_server(port: int = 0) -> ThreadingHTTPServer:
    model = ScriptedModel()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def setup(self) -> None:
            super().setup()
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def do_POST(self) -> None:  # noqa: N802
            length = int(self.headers.get("content-length") or 0)
            body = self.rfile.read(length) if length else b""
            status, headers, out = model.respond(self.command, self.path, self.headers, body)
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("content-length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        do_GET = do_POST

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            pass

    class Server(ThreadingHTTPServer):
        daemon_threads = True
        request_queue_size = 128

    return Server(("127.0.0.1", port), Handler)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    server = make_server(args.port)
    print(f"PORT {server.server_address[1]}", flush=True)
    sys.stdout.close()
    with contextlib.suppress(KeyboardInterrupt):
        server.serve_forever()


if __name__ == "__main__":
    main()
