"""A deduplicating receiver of side effects, standing in for a payment API or a database
that honours idempotency keys. It lives in files so that worker subprocesses and the test
process see the same ledger: every delivery attempt is logged, an effect is applied once."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any


def _directory() -> Path | None:
    value = os.environ.get("DA_RECEIVER_DIR")
    return Path(value) if value else None


def deliver(kind: str, key: str, payload: Any) -> dict[str, Any]:
    directory = _directory()
    if directory is None:
        return {"kind": kind, "key": key, "applied": True, "receiver": "none"}
    line = json.dumps({"kind": kind, "key": key, "payload": payload, "pid": os.getpid()})
    with open(directory / "attempts.log", "a", encoding="utf-8") as log:
        log.write(line + "\n")
    # Written aside, then linked into place: the link is the once-only apply (it fails if the
    # key was applied), and a reader never sees an applied file before its content.
    pending = directory / f"pending-{key}-{os.getpid()}-{time.monotonic_ns()}"
    pending.write_text(line, encoding="utf-8")
    try:
        os.link(pending, directory / f"applied-{key}")
    except FileExistsError:
        return {"kind": kind, "key": key, "applied": False, "duplicate": True}
    finally:
        pending.unlink()
    return {"kind": kind, "key": key, "applied": True}


def attempts(directory: Path) -> list[dict[str, Any]]:
    path = directory / "attempts.log"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def applied(directory: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text(encoding="utf-8")) for p in sorted(directory.glob("applied-*"))]


def touch(name: str) -> None:
    directory = _directory()
    if directory is not None:
        (directory / name).write_text(str(os.getpid()))


def pause(seconds: float, until: str) -> None:
    """Sleep ``seconds``, or less once the marker ``until`` exists: a test that is done with a
    long tool call lets it end instead of leaving a thread asleep."""
    directory = _directory()
    deadline = time.monotonic() + seconds
    while (remaining := deadline - time.monotonic()) > 0:
        if directory is not None and (directory / until).exists():
            return
        time.sleep(min(remaining, 0.05))


def env(name: str, default: str) -> str:
    return os.environ.get(name, default)


def log_call(tool: str, key: str | None, woken_by: Any) -> None:
    """Record one invocation of a waiting tool: its key and what woke it (None: the first)."""
    directory = _directory()
    if directory is None:
        return
    line = json.dumps({"tool": tool, "key": key, "woken_by": woken_by, "pid": os.getpid()})
    with open(directory / "calls.log", "a", encoding="utf-8") as log:
        log.write(line + "\n")


def calls(directory: Path, tool: str | None = None) -> list[dict[str, Any]]:
    path = directory / "calls.log"
    if not path.exists():
        return []
    lines = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    return [c for c in lines if tool is None or c["tool"] == tool]


def interval(key: str, seconds: float) -> None:
    """Work ``seconds`` for ``key``, logging when the work started and ended (wall clock, one
    line each, from any process) in busy.log: tests measure how many overlapped per key."""
    directory = _directory()
    call = f"{os.getpid()}-{time.monotonic_ns()}"

    def log(event: str) -> None:
        if directory is not None:
            line = json.dumps(
                {"key": key, "event": event, "at": time.time(), "call": call, "pid": os.getpid()}
            )
            with open(directory / "busy.log", "a", encoding="utf-8") as out:
                out.write(line + "\n")

    log("start")
    time.sleep(seconds)
    log("end")


def intervals(directory: Path) -> list[dict[str, Any]]:
    path = directory / "busy.log"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
