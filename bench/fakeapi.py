"""A zero-latency fake Messages API in its own process: ``python -m bench.fakeapi --port N``.

It answers as the offline scripted model does (same script in the task, same turns), behind a
ThreadingHTTPServer, HTTP/1.1 keep-alive, TCP_NODELAY on every accepted socket (without it each
call would pay a 40 ms delayed ACK). Prints ``PORT <n>`` on stdout once it listens.

Zero latency means the fake does next to nothing per call whatever the history's length: it
reads the body, parses only the first message (the task, whose script is cached) and counts
the assistant turns in the raw bytes. Unlike the suite's offline model it does not validate
the history (structure, tool_use ids, thinking signatures): that is the test suite's job, and
doing it here would put a cost that grows with the run inside every measurement.
``--validate`` serves the full offline model instead.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import re
import socket
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from durable_agents.offline import Script, ScriptedModel, parse_script

_MESSAGES = re.compile(rb'"messages"\s*:\s*\[\s*')
_MODEL = re.compile(rb'"model"\s*:\s*"([^"\\]*)"')
_decoder = json.JSONDecoder()


class ZeroLatencyModel:
    """The offline model's answers at a cost that does not grow with the history: the body is
    searched as bytes, only the first message is decoded, one pattern is counted."""

    def __init__(self) -> None:
        self.scripts: dict[str, Script] = {}
        self.ids = itertools.count(1)

    def respond(
        self, method: str, path: str, headers: Any, body: bytes
    ) -> tuple[int, dict[str, str], bytes]:
        start = _MESSAGES.search(body).end()  # type: ignore[union-attr]
        window = 1 << 16
        while True:
            # Decode just enough of the body for the first message (the task).
            text = body[start : start + window].decode("utf-8", errors="ignore")
            try:
                first, _ = _decoder.raw_decode(text)
                break
            except ValueError:
                if start + window >= len(body):
                    raise
                window *= 4
        task = first["content"]
        if not isinstance(task, str):
            task = task[0]["text"]
        script = self.scripts.get(task)
        if script is None:
            script = self.scripts[task] = parse_script(task)
        model = _MODEL.search(body).group(1).decode()  # type: ignore[union-attr]
        # Every message is serialised alike: count the assistant roles in the first one's style.
        compact = body.startswith(b'{"role":"', start)
        turn = body.count(b'"role":"assistant"' if compact else b'"role": "assistant"')
        number = next(self.ids)
        content: list[dict[str, Any]] = []
        if turn < len(script.plan):
            calls = script.plan[turn]
            text_out = f"Step {turn + 1}: calling {', '.join(c.name for c in calls)}."
            stop_reason = "tool_use"
        else:
            calls = []
            text_out = f"Done. {len(script.plan)} planned turns completed."
            stop_reason = "end_turn"
        content.append({"type": "text", "text": text_out})
        for index, call in enumerate(calls):
            content.append(
                {
                    "type": "tool_use",
                    "id": f"toolu_{number:012d}{index:06d}",
                    "name": call.name,
                    "input": call.input,
                }
            )
        payload = {
            "id": f"msg_bench_{number:014d}",
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": None,
            "usage": {"input_tokens": max(1, len(body) // 4), "output_tokens": 12},
        }
        out = json.dumps(payload, ensure_ascii=False, separators=(", ", ": ")).encode()
        request_id = f"req_bench_{number:014d}"
        return 200, {"content-type": "application/json", "request-id": request_id}, out


def make_server(port: int = 0, validate: bool = False) -> ThreadingHTTPServer:
    model = ScriptedModel() if validate else ZeroLatencyModel()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def setup(self) -> None:
            super().setup()
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def do_POST(self) -> None:
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

        def log_message(self, format: str, *args: Any) -> None:
            pass

    class Server(ThreadingHTTPServer):
        daemon_threads = True
        request_queue_size = 128

    return Server(("127.0.0.1", port), Handler)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--validate", action="store_true", help="serve the full offline model")
    args = parser.parse_args(argv)
    server = make_server(args.port, args.validate)
    print(f"PORT {server.server_address[1]}", flush=True)
    sys.stdout.close()
    with contextlib.suppress(KeyboardInterrupt):
        server.serve_forever()


if __name__ == "__main__":
    main()
