"""One rule for text that comes from outside: the model, tool code, a person's form.

Every decoded string that goes into a column of its own (a tool name, a result, a run's final
text, an error reason) or onto a page passes through here first:

* NUL becomes ``␀`` and a lone surrogate becomes ``�``: PostgreSQL's text refuses the first and
  UTF-8 (the database's, the SDK's, an HTTP response's) cannot encode the second. The markers
  are visible, so a person reading the transcript sees that something was replaced.
* JSON values are bounded in depth (``MAX_DEPTH``): deeper ones raise ``Unstorable`` with a
  reason a person can act on, never a ``RecursionError`` from deep inside a library.

The model's turn itself is not touched: it is stored byte for byte as received (its JSON text
is storable whenever it parses; only values decoded from it pass through here).
"""

from __future__ import annotations

import json
import re
from typing import Any

from durable_agents.exceptions import Unstorable as Unstorable  # re-exported: its old home

NUL_MARKER = "\u2400"  # ␀ SYMBOL FOR NULL
SURROGATE_MARKER = "\ufffd"  # � REPLACEMENT CHARACTER

# Nesting deeper than this in a tool's input or result is refused with a clear error. Real
# tool inputs are a few levels deep; the limit stays far below Python's recursion limit, so
# json, jsonschema and the database driver never meet a value they cannot walk.
MAX_DEPTH = 100

_UNSTORABLE_RE = re.compile("[\x00\ud800-\udfff]")


def has_unstorable(text: str) -> bool:
    """Whether ``text`` holds a NUL or a lone surrogate (cheap for ASCII without NUL)."""
    if text.isascii():
        return "\x00" in text
    return _UNSTORABLE_RE.search(text) is not None


def _marker(match: re.Match[str]) -> str:
    return NUL_MARKER if match.group() == "\x00" else SURROGATE_MARKER


def storable_text(text: Any, limit: int | None = None) -> str:
    """``text`` (anything, as ``str()``) with NUL and lone surrogates replaced by markers,
    and cut to ``limit`` characters with a note saying how long it was."""
    if isinstance(text, str):
        shown = text
    else:
        try:
            shown = str(text)
        except Exception as exc:  # noqa: BLE001 - a hostile __str__
            shown = f"<{type(text).__name__} that cannot be shown: {type(exc).__name__}>"
    if has_unstorable(shown):
        shown = _UNSTORABLE_RE.sub(_marker, shown)
    if limit is not None and len(shown) > limit:
        shown = f"{shown[:limit]} [cut: {len(shown)} characters in all]"
    return shown


def check_depth(value: Any, limit: int = MAX_DEPTH) -> None:
    """Raise ``Unstorable`` if the JSON value ``value`` nests deeper than ``limit``.
    Iterative, so any depth is measured without recursion."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        else:
            continue
        if depth > limit:
            raise Unstorable(f"nests deeper than {limit} levels")
        stack.extend((child, depth + 1) for child in children)


def storable_value(value: Any, limit: int = MAX_DEPTH) -> Any:
    """A copy of the JSON value ``value`` whose strings (keys too) are storable text.
    Raises ``Unstorable`` past ``limit`` levels or for a value JSON cannot hold."""
    check_depth(value, limit)
    return _clean(value)


def _clean(value: Any) -> Any:
    if isinstance(value, str):
        return storable_text(value)
    if isinstance(value, dict):
        return {storable_text(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if value is None or isinstance(value, (bool, int, float)):
        return value
    raise Unstorable(f"holds a {type(value).__name__}, which is not a JSON value")


def json_text(value: Any, limit: int = MAX_DEPTH) -> str:
    """``value`` as JSON text that any column can hold and that decodes back to ``value``
    exactly: NUL is escaped by JSON itself, and lone surrogates are written as ``\\udxxx``
    escapes. Raises ``Unstorable`` (too deep, not serialisable) with the reason."""
    check_depth(value, limit)
    try:
        text = json.dumps(value, ensure_ascii=False)
        if not text.isascii() and has_unstorable(text):
            text = json.dumps(value, ensure_ascii=True)
    except (TypeError, ValueError, RecursionError) as exc:
        raise Unstorable(f"is not JSON-serialisable: {storable_text(exc, 300)}") from exc
    return text
