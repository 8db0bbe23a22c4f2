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

Rate limits, 529s, latency and ``GET /stats``: the flags and endpoints of ``bench.gate``
(``--rpm``, ``--itpm``, ``--otpm``, ``--burst-seconds``, ``--latency``, ``--overloaded-rate``).
With ``--latency`` each answer waits in its handler thread (one per connection): for many
connections held open at once, use ``bench.slowapi``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import re
import socket
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from bench.gate import Gate, Response, add_arguments
from durable_agents.offline import Admission, Script, ScriptedModel, parse_script
from durable_agents.offline.limits import key_of

_MESSAGES = re.compile(rb'"messages"\s*:\s*\[\s*')
_MODEL = re.compile(rb'"model"\s*:\s*"([^"\\]*)"')
_MAX_TOKENS = re.compile(rb'"max_tokens"\s*:\s*(\d+)')
_decoder = json.JSONDecoder()
OUTPUT_TOKENS = 12  # of every answer (its usage says so)


@dataclasses.dataclass(slots=True)
class Call:
    """What the fake reads of a request (without parsing its history)."""

    script: Script
    key: str | None  # its concurrency key: the task's [key:NAME]
    model: str
    turn: int
    input_tokens: int  # len(body) // 4: a long transcript costs by its size
    max_tokens: int


class ZeroLatencyModel:
    """The offline model's answers at a cost that does not grow with the history: the body is
    searched as bytes, only the first message is decoded, one pattern is counted."""

    def __init__(self) -> None:
        self.scripts: dict[str, tuple[Script, str | None]] = {}
        self.ids = itertools.count(1)

    def respond(self, method: str, path: str, headers: Any, body: bytes) -> Response:
        return self.answer(self.read(body))

    def read(self, body: bytes) -> Call:
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
        parsed = self.scripts.get(task)
        if parsed is None:
            parsed = self.scripts[task] = (parse_script(task), key_of(task))
        model = _MODEL.search(body).group(1).decode()  # type: ignore[union-attr]
        # Every message is serialised alike: count the assistant roles in the first one's style.
        compact = body.startswith(b'{"role":"', start)
        turn = body.count(b'"role":"assistant"' if compact else b'"role": "assistant"')
        # The SDK and the app send max_tokens before the messages; else the last one wins.
        found = _MAX_TOKENS.search(body, 0, start) or _last(_MAX_TOKENS.finditer(body, start))
        max_tokens = int(found.group(1)) if found else 0
        return Call(*parsed, model, turn, max(1, len(body) // 4), max_tokens)

    def answer(self, request: Call) -> Response:
        script, turn = request.script, request.turn
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
            "model": request.model,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": None,
            "usage": {"input_tokens": request.input_tokens, "output_tokens": OUTPUT_TOKENS},
        }
        out = json.dumps(payload, ensure_ascii=False, separators=(", ", ": ")).encode()
        request_id = f"req_bench_{number:014d}"
        return 200, {"content-type": "application/json", "request-id": request_id}, out


def _last(matches: Any) -> Any:
    found = None
    for found in matches:  # noqa: B007 - the last one is what is wanted
        pass
    return found


def answer(model: ZeroLatencyModel, gate: Gate, body: bytes) -> Response:
    """One request through the gate: a 529 or 429 at once, else the answer after the latency,
    with the rate-limit headers once it is settled."""
    call = model.read(body)
    admitted = gate.enter(call.input_tokens, call.max_tokens, call.key)
    if not isinstance(admitted, Admission):
        return admitted
    status, headers, out = model.answer(call)
    delay = gate.latency()
    if delay:
        time.sleep(delay)
    headers.update(gate.leave(admitted, OUTPUT_TOKENS))
    return status, headers, out


def make_server(
    port: int = 0, validate: bool = False, gate: Gate | None = None
) -> ThreadingHTTPServer:
    gate = gate or Gate()
    # --validate: the offline model charges the same limits itself (its own usage figures).
    scripted = ScriptedModel(rate_limits=gate.limits) if validate else None
    model = ZeroLatencyModel()

    def respond(method: str, path: str, headers: Any, body: bytes) -> Response:
        own = gate.endpoint(method, path)
        if own is not None:
            return own
        if scripted is None:
            return answer(model, gate, body)
        return gate.overloaded() or scripted.respond(method, path, headers, body)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def setup(self) -> None:
            super().setup()
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def do_POST(self) -> None:
            length = int(self.headers.get("content-length") or 0)
            body = self.rfile.read(length) if length else b""
            status, headers, out = respond(self.command, self.path, self.headers, body)
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
    add_arguments(parser, latency="0")
    args = parser.parse_args(argv)
    if args.validate and args.latency != (0.0, 0.0):
        parser.error("--latency: not with --validate (the task's @@latency applies)")
    server = make_server(args.port, args.validate, Gate.from_args(args))
    print(f"PORT {server.server_address[1]}", flush=True)
    sys.stdout.close()
    with contextlib.suppress(KeyboardInterrupt):
        server.serve_forever()


if __name__ == "__main__":
    main()
