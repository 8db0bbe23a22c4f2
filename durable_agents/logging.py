"""Every log record about a run carries its run id, and no record of the app can forge a line.

The worker binds the run id to a context variable while it advances a run; the record factory
(installed in ``AppConfig.ready``) copies it onto every record created in that thread, so
records from tool code and third-party libraries carry it too, whatever logger they use.
``RunIdFilter`` does the same for projects that configure logging with filters only.

The app's records (loggers named ``durable_agents...``) log text from outside: a tool's
exception, the model's text, event and tool names. The same factory escapes control
characters in their message and in their exception's text (``escape_controls``: a newline
becomes ``\n``), so such text can never start a log line of its own and pass for another
record ("INFO run ... succeeded"). ``EscapeControlsFilter`` does the same as a filter.

``RedactStreamTokens`` is for a server's access log: it replaces the stream token of a
``?token=`` URL with ``[redacted]``.
"""

from __future__ import annotations

import contextlib
import logging
import re
import traceback
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from typing import Any

current_run_id: ContextVar[str] = ContextVar("durable_agents_run_id", default="-")

_installed = False


@contextlib.contextmanager
def bind_run(run_id: Any) -> Iterator[None]:
    token = current_run_id.set(str(run_id))
    try:
        yield
    finally:
        current_run_id.reset(token)


class RunIdFilter(logging.Filter):
    """Adds ``record.run_id`` (``-`` outside a run); never drops a record."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "run_id"):
            record.run_id = current_run_id.get()
        return True


# Control characters but tab: C0 (CR and LF among them), DEL, C1, and the Unicode line and
# paragraph separators, which some log viewers also break lines at.
_CONTROLS = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029]")
_NAMED = {"\n": "\\n", "\r": "\\r"}
# The loggers whose records are escaped: the app's own.
APP_LOGGERS = "durable_agents"


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    return _NAMED.get(char) or (
        f"\\x{ord(char):02x}" if ord(char) < 0x100 else f"\\u{ord(char):04x}"
    )


def escape_controls(text: str) -> str:
    """``text`` on one line: control characters (but tab) as visible escapes, ``\\n``,
    ``\\r``, ``\\x1b``, ``\\u2028``."""
    return _CONTROLS.sub(_escape, text)


def escape_record(record: logging.LogRecord) -> logging.LogRecord:
    """Make ``record``'s message and exception text escape control characters (once)."""
    if getattr(record, "escaped", False):
        return record
    record.escaped = True
    # The template and each argument, not the formatted message: handlers that group by
    # ``record.msg`` (error trackers) or pickle the record (SocketHandler) work as before.
    if isinstance(record.msg, str):
        record.msg = escape_controls(record.msg)
    if isinstance(record.args, Mapping):
        record.args = {key: _escaped_arg(value) for key, value in record.args.items()}
    elif record.args:
        record.args = tuple(_escaped_arg(arg) for arg in record.args)
    if record.exc_info and record.exc_info[1] is not None and not record.exc_text:
        record.exc_text = _exception_text(record.exc_info)
    return record


def _escaped_arg(value: Any) -> Any:
    """A log argument from outside, escaped: text, and exceptions as their escaped text.
    Numbers, ids and other values format without control characters: left as they are."""
    if isinstance(value, str):
        return escape_controls(value)
    if isinstance(value, BaseException):
        try:
            return escape_controls(str(value))
        except Exception:  # noqa: BLE001 - a hostile __str__
            return f"<{type(value).__name__} that cannot be shown>"
    return value


def _exception_text(exc_info: Any) -> str:
    """The traceback as logging formats it, with the messages of the exception and of those
    it chains escaped: its other lines are the interpreter's, not from outside."""
    text = "".join(traceback.format_exception(*exc_info)).rstrip("\n")
    seen: set[int] = set()
    exc: BaseException | None = exc_info[1]
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        try:
            message = str(exc)
        except Exception:  # noqa: BLE001 - a hostile __str__: traceback shows its own note
            message = ""
        escaped = escape_controls(message)
        if escaped != message:
            text = text.replace(message, escaped)
        exc = exc.__cause__ or exc.__context__
    return text


class EscapeControlsFilter(logging.Filter):
    """Escapes control characters in the records it sees (``escape_record``); never drops
    one. For handlers that also take records of other loggers holding text from outside."""

    def filter(self, record: logging.LogRecord) -> bool:
        escape_record(record)
        return True


# ``token=`` in a query string, up to the next parameter, space or quote: a stream token in
# the request line of an access log (a bearer credential, valid LIVE_TOKEN_SECONDS).
_STREAM_TOKEN = re.compile(r"([?&]token=)[^&\s\"']+")
REDACTED = "[redacted]"


def redact_stream_tokens(text: str) -> str:
    """``text`` with the value of every ``?token=`` / ``&token=`` replaced by [redacted]."""
    return _STREAM_TOKEN.sub(rf"\g<1>{REDACTED}", text)


class RedactStreamTokens(logging.Filter):
    """Redacts ``token=`` in the URLs of the records it sees (their message and their string
    arguments: uvicorn's access log passes the path as one), never drops one. For the access
    log of a server that serves ``runs/<id>/events?token=...``: a stream token is a bearer
    credential for as long as it lasts, and log lines are kept and shared."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str):
            record.msg = redact_stream_tokens(record.msg)
        if isinstance(record.args, tuple):
            record.args = tuple(
                redact_stream_tokens(arg) if isinstance(arg, str) else arg for arg in record.args
            )
        elif isinstance(record.args, Mapping):
            record.args = {
                key: redact_stream_tokens(value) if isinstance(value, str) else value
                for key, value in record.args.items()
            }
        return True


def install_record_factory() -> None:
    """Wrap the global record factory once so that ``%(run_id)s`` always formats, and the
    app's records never hold a raw control character."""
    global _installed
    if _installed:
        return
    previous = logging.getLogRecordFactory()

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        record.run_id = current_run_id.get()
        if record.name == APP_LOGGERS or record.name.startswith(APP_LOGGERS + "."):
            escape_record(record)
        return record

    logging.setLogRecordFactory(factory)
    _installed = True
