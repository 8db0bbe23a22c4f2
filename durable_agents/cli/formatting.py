"""Text for an operator's terminal, and the JSON document of ``--json``.

Whatever a model, a tool, a customer or a worker's host wrote is hostile to a terminal: an
escape sequence can clear the screen, retitle the window, move the cursor or fake a prompt, and
a direction override makes a text read in another order than it runs. Every such value is
printed through ``one_line`` or ``lines_of``: control characters as visible escapes (``\\x1b``,
as the log lines write them: ``durable_agents.logging.escape_controls``) and invisible or
direction-changing characters as the admin's markers (``⟨U+202E⟩``). The JSON document is
ASCII (``\\u001b``): a script gets each value exactly, and a terminal that shows it obeys none.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from collections.abc import Sequence
from decimal import Decimal
from typing import Any

from durable_agents._internal.text import plain_markers, storable_text
from durable_agents.logging import escape_controls

# How much of a task the runs list shows, and of an intent's input the intents list.
HEAD_CHARS = 60


@dataclasses.dataclass
class Output:
    """What a subcommand prints: ``document`` with ``--json`` (one JSON object), ``lines``
    without; ``failure``, when set, goes to stderr and makes the exit status 1."""

    document: dict[str, Any]
    lines: list[str] = dataclasses.field(default_factory=list)
    failure: str | None = None


def one_line(text: Any, limit: int | None = None) -> str:
    """``text`` on one line, safe for a terminal: newlines, tabs and every control character
    escaped, invisible characters marked; cut to ``limit`` characters with "…"."""
    shown = escape_controls(storable_text(text)).replace("\t", "\\t")
    if limit is not None and len(shown) > limit:
        shown = shown[: limit - 1] + "…"
    return plain_markers(shown)


def lines_of(text: Any, indent: str = "  ") -> list[str]:
    """``text`` as lines, each safe for a terminal as ``one_line`` makes it (tabs kept),
    indented."""
    shown = storable_text(text)
    return [indent + plain_markers(escape_controls(line)) for line in shown.split("\n")]


def iso(value: datetime.datetime | None) -> str:
    """``2026-12-06T14:03:11Z``: a time in ISO 8601, in UTC, to the second ("" for None)."""
    if value is None:
        return ""
    return value.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def iso_exact(value: datetime.datetime | None) -> str | None:
    """A time for the JSON document: ISO 8601 in UTC, to the microsecond; None for None."""
    if value is None:
        return None
    return value.astimezone(datetime.UTC).isoformat().replace("+00:00", "Z")


def usd(cost: Decimal | None) -> str:
    """``$0.0123`` (``<$0.0001`` for a cost that rounds to nothing); "" for None."""
    if cost is None:
        return ""
    quantum = Decimal("0.0001")
    if 0 < cost < quantum:
        return f"<${quantum}"
    return f"${cost.quantize(quantum, rounding='ROUND_HALF_UP'):,}"


def decimal_text(value: Decimal | None) -> str | None:
    """A cost for the JSON document: its exact decimal text (a float would round it)."""
    return None if value is None else str(value)


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Aligned columns (each as wide as its widest cell), the last one left ragged. Cells
    must be safe already (``one_line``)."""
    if not rows:
        return []
    widths = [max(len(headers[i]), *(len(row[i]) for row in rows)) for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        padded = [cell.ljust(width) for cell, width in zip(cells[:-1], widths[:-1], strict=True)]
        return "  ".join([*padded, cells[-1]]).rstrip()

    return [line(headers), *(line(row) for row in rows)]


def json_document(document: dict[str, Any]) -> str:
    """The ``--json`` output: ASCII, indented, keys in the order the subcommand gave them."""
    return json.dumps(document, ensure_ascii=True, indent=2, allow_nan=False)
