"""A slow fake Messages API: ``python -m bench.slowapi --port 0 --latency 2-6``.

The answers of ``bench.fakeapi.ZeroLatencyModel`` (the offline script in the task), each sent
after a uniform random delay (``asyncio.sleep``), so that a client spends its time waiting on
the model as it does against the real API. One asyncio event loop, stdlib streams, HTTP/1.1
keep-alive with Content-Length bodies (no chunked encoding), TCP_NODELAY: thousands of
connections held open at once on one core. Prints ``PORT <n>`` on stdout once it listens.

For pickup latency it records, per task (keyed by the task's first line, e.g.
"Benchmark run 17."), the wall time (``time.time()``) at which the first request for it
arrived; ``GET /_log`` returns them as a JSON object. ``GET /_stats`` returns counters: requests
served, connections open now and at most, and how late the sleeps woke up (if the loop falls
behind, ``late_max_ms`` grows). ``GET /_turns`` returns ``[task, turn, answered]`` rows: how
many times each turn of each task was answered (a turn answered twice was paid for twice).

Rate limits, 529s and ``GET /stats``: the flags and endpoints of ``bench.gate`` (``--rpm``,
``--itpm``, ``--otpm``, ``--burst-seconds``, ``--overloaded-rate``; ``--latency MIN-MAX``, 2-6 s
by default). A 429 or 529 is answered at once; an admitted request is in flight (and holds its
``max_tokens`` of output) until its answer is sent, after its latency.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import resource
import socket
import sys
import time

from bench.fakeapi import OUTPUT_TOKENS, ZeroLatencyModel
from bench.gate import Gate, add_arguments
from durable_agents.offline import Admission

# The task is the first message: its text runs from the first string value of "content" (or
# of "text", when the content is a list of blocks) up to the first escape (the "\n" after the
# first line) or the closing quote.
_MESSAGES = re.compile(rb'"messages"\s*:\s*\[')
_FIRST_TEXT = re.compile(rb'"(?:content|text)"\s*:\s*"((?:[^"\\])*)')

REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    429: "Too Many Requests",
    500: "Internal Server Error",
    529: "Overloaded",
}


def raise_nofile() -> int:
    """Raise this process's RLIMIT_NOFILE soft limit to the hard one; returns the new soft."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def first_line(body: bytes) -> str | None:
    m = _MESSAGES.search(body)
    if not m:
        return None
    t = _FIRST_TEXT.search(body, m.end())
    return t.group(1).decode("utf-8", errors="replace") if t else None


class SlowAPI:
    def __init__(self, gate: Gate) -> None:
        self.model = ZeroLatencyModel()
        self.gate = gate
        self.first_seen: dict[str, float] = {}
        self.requests = 0
        self.open = 0
        self.open_max = 0
        self.late_max = 0.0
        self.late_sum = 0.0
        self.sleeps = 0
        # Answered (200, paid) requests per (task's first line, assistant turns already in the
        # history): a count above 1 is a turn asked again (GET /_turns; bench/failover.py).
        self.turns: dict[tuple[str, int], int] = {}

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.open += 1
        self.open_max = max(self.open_max, self.open)
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError):
                    return
                lines = head.decode("latin-1").split("\r\n")
                parts = lines[0].split(" ")
                if len(parts) != 3:
                    return
                method, path, version = parts
                headers: dict[str, str] = {}
                for line in lines[1:]:
                    if ":" in line:
                        k, v = line.split(":", 1)
                        headers[k.strip().lower()] = v.strip()
                length = int(headers.get("content-length") or 0)
                try:
                    body = await reader.readexactly(length) if length else b""
                except (asyncio.IncompleteReadError, OSError):
                    return
                arrived = time.time()
                status, out_headers, out = await self.answer(method, path, headers, body, arrived)
                close = headers.get("connection", "").lower() == "close" or version == "HTTP/1.0"
                head_out = [f"HTTP/1.1 {status} {REASONS.get(status, 'Unknown')}"]
                head_out += [f"{k}: {v}" for k, v in out_headers.items()]
                head_out.append(f"content-length: {len(out)}")
                if close:
                    head_out.append("connection: close")
                writer.write(("\r\n".join(head_out) + "\r\n\r\n").encode("latin-1") + out)
                try:
                    await writer.drain()
                except OSError:
                    return
                if close:
                    return
        finally:
            self.open -= 1
            with contextlib.suppress(Exception):
                writer.close()

    async def answer(
        self, method: str, path: str, headers: dict[str, str], body: bytes, arrived: float
    ) -> tuple[int, dict[str, str], bytes]:
        json_ct = {"content-type": "application/json"}
        own = self.gate.endpoint(method, path)
        if own is not None:
            return own
        if method == "GET" and path == "/_log":
            return 200, json_ct, json.dumps(self.first_seen).encode()
        if method == "GET" and path == "/_turns":
            rows = [[task, turn, n] for (task, turn), n in self.turns.items()]
            return 200, json_ct, json.dumps(rows).encode()
        if method == "GET" and path == "/_stats":
            stats = {
                "requests": self.requests,
                "open": self.open,
                "open_max": self.open_max,
                "sleeps": self.sleeps,
                "late_max_ms": self.late_max * 1000,
                "late_mean_ms": self.late_sum / self.sleeps * 1000 if self.sleeps else 0.0,
                "tasks": len(self.first_seen),
            }
            return 200, json_ct, json.dumps(stats).encode()
        if method != "POST" or not path.split("?")[0].endswith("/messages"):
            return 404, json_ct, b'{"type": "error", "error": {"type": "not_found_error"}}'
        self.requests += 1
        key = first_line(body)
        if key is not None and key not in self.first_seen:
            self.first_seen[key] = arrived
        try:
            call = self.model.read(body)
        except Exception as exc:  # noqa: BLE001 - a broken request is the client's bug: say so
            msg = json.dumps(
                {"type": "error", "error": {"type": "api_error", "message": repr(exc)}}
            )
            return 500, json_ct, msg.encode()
        admitted = self.gate.enter(call.input_tokens, call.max_tokens, call.key)
        if not isinstance(admitted, Admission):
            return admitted  # a 529 or a 429, at once
        status, out_headers, out = self.model.answer(call)
        delay = self.gate.latency()
        try:
            if delay > 0:
                due = time.monotonic() + delay
                await asyncio.sleep(delay)
                late = time.monotonic() - due
                self.sleeps += 1
                self.late_sum += late
                self.late_max = max(self.late_max, late)
        finally:  # cancelled (the server stops) or not, the request is no longer in flight
            out_headers.update(self.gate.leave(admitted, OUTPUT_TOKENS))
        if status == 200 and key is not None:
            self.turns[(key, call.turn)] = self.turns.get((key, call.turn), 0) + 1
        return status, out_headers, out


async def serve(args: argparse.Namespace) -> None:
    api = SlowAPI(Gate.from_args(args))
    server = await asyncio.start_server(
        api.handle, "127.0.0.1", args.port, backlog=args.backlog, limit=1 << 20
    )
    port = server.sockets[0].getsockname()[1]
    print(f"PORT {port}", flush=True)
    sys.stdout.close()
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--backlog", type=int, default=4096)
    add_arguments(parser, latency="2-6")
    args = parser.parse_args(argv)
    raise_nofile()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args))


if __name__ == "__main__":
    main()
