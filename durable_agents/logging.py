"""Every log record about a run carries its run id.

The worker binds the run id to a context variable while it advances a run; the record factory
(installed in ``AppConfig.ready``) copies it onto every record created in that thread, so
records from tool code and third-party libraries carry it too, whatever logger they use.
``RunIdFilter`` does the same for projects that configure logging with filters only.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
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


def install_record_factory() -> None:
    """Wrap the global record factory once so that ``%(run_id)s`` always formats."""
    global _installed
    if _installed:
        return
    previous = logging.getLogRecordFactory()

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        record.run_id = current_run_id.get()
        return record

    logging.setLogRecordFactory(factory)
    _installed = True
