"""JSON at any depth, without recursion.

``json.loads`` and ``json.dumps`` recurse once per level and raise ``RecursionError`` near
Python's recursion limit (about a thousand levels). A model's answer, or a tool's return value,
can nest deeper than that. These functions give the same results as the json module at any
depth: they try it first and fall back to an explicit stack only when it gives up, so ordinary
values cost nothing more.
"""

from __future__ import annotations

import json
import re
from json.decoder import scanstring  # type: ignore[attr-defined]  # not in typeshed
from json.scanner import NUMBER_RE
from typing import Any

__all__ = ["dumps_deep", "loads_deep", "raw_decode_deep", "value_end"]

_WS = re.compile(r"[ \t\n\r]*")


def _skip_ws(s: str, i: int) -> int:
    """The index of the first character at or after ``i`` that is not JSON whitespace."""
    match = _WS.match(s, i)  # always matches, if only the empty string
    return match.end() if match is not None else i


_CONSTANTS: tuple[tuple[str, Any], ...] = (
    ("null", None),
    ("true", True),
    ("false", False),
    ("NaN", float("nan")),
    ("Infinity", float("inf")),
    ("-Infinity", float("-inf")),
)


class _Raw:
    """Already-encoded JSON text on the encoder's stack."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text


def _key_text(key: Any) -> str:
    if isinstance(key, str):
        return json.dumps(key)
    if key is None or isinstance(key, (bool, int, float)):
        return json.dumps(json.dumps(key))  # as json does: the key's JSON text, as a string
    raise TypeError(f"keys must be str, int, float, bool or None, not {type(key).__name__}")


def dumps_deep(
    value: Any, *, separators: tuple[str, str] = (", ", ": "), sort_keys: bool = False
) -> str:
    """``value`` (a tree of JSON values, no cycles) as ASCII JSON text, at any depth: what
    ``json.dumps(value, ensure_ascii=True, ...)`` gives when it does not hit the recursion
    limit. Lone surrogates come out as ``\\udxxx`` escapes, so the text is always valid UTF-8."""
    try:
        return json.dumps(value, separators=separators, sort_keys=sort_keys)
    except RecursionError:
        pass
    item_sep, key_sep = separators
    out: list[str] = []
    stack: list[Any] = [value]
    while stack:
        item = stack.pop()
        if type(item) is _Raw:
            out.append(item.text)
        elif isinstance(item, dict):
            if not item:
                out.append("{}")
                continue
            pairs = sorted(item.items()) if sort_keys else list(item.items())
            out.append("{")
            stack.append(_Raw("}"))
            for index in range(len(pairs) - 1, -1, -1):
                key, child = pairs[index]
                stack.append(child)
                stack.append(_Raw(_key_text(key) + key_sep))
                if index:
                    stack.append(_Raw(item_sep))
        elif isinstance(item, (list, tuple)):
            if not item:
                out.append("[]")
                continue
            out.append("[")
            stack.append(_Raw("]"))
            for index in range(len(item) - 1, -1, -1):
                stack.append(item[index])
                if index:
                    stack.append(_Raw(item_sep))
        else:
            out.append(json.dumps(item))
    return "".join(out)


def _fail(s: str, message: str, pos: int) -> json.JSONDecodeError:
    return json.JSONDecodeError(message, s, pos)


def _key_at(s: str, i: int) -> tuple[str, int]:
    """An object's key and its ':' from ``i`` on: the key and the index past the ':'."""
    i = _skip_ws(s, i)
    if s[i : i + 1] != '"':
        raise _fail(s, "Expecting property name enclosed in double quotes", i)
    key, i = scanstring(s, i + 1)
    i = _skip_ws(s, i)
    if s[i : i + 1] != ":":
        raise _fail(s, "Expecting ':' delimiter", i)
    return key, i + 1


def _scalar_at(s: str, i: int) -> tuple[Any, int]:
    """The number or constant (null, true, false, NaN, Infinity) at ``i``, and the index past
    it."""
    number = NUMBER_RE.match(s, i)
    if number is not None:
        integer, frac, exp = number.groups()
        value = float(integer + (frac or "") + (exp or "")) if frac or exp else int(integer)
        return value, number.end()
    for word, constant in _CONSTANTS:
        if s.startswith(word, i):
            return constant, i + len(word)
    raise _fail(s, "Expecting value", i)


def _raw_decode_deep(s: str, idx: int = 0) -> tuple[Any, int]:
    """``json.JSONDecoder().raw_decode(s, idx)`` without recursion. One loop (it is the whole
    cost of decoding a deep document): read a value; a container with values is opened and
    its first value read next; a complete value goes in its container, closing every
    container that ends with it, until the outermost one is complete."""
    # Open containers, innermost last: [the container, the key its next value goes under].
    stack: list[list[Any]] = []
    i = idx
    while True:
        i = _skip_ws(s, i)
        ch = s[i : i + 1]
        value: Any
        if ch == '"':
            value, i = scanstring(s, i + 1)
        elif ch == "{":
            i = _skip_ws(s, i + 1)
            if s[i : i + 1] == "}":
                value, i = {}, i + 1
            else:
                key, i = _key_at(s, i)
                stack.append([{}, key])
                continue
        elif ch == "[":
            i = _skip_ws(s, i + 1)
            if s[i : i + 1] == "]":
                value, i = [], i + 1
            else:
                stack.append([[], None])
                continue
        else:
            value, i = _scalar_at(s, i)
        # A value is complete: put it in its container, closing every container that ends.
        while True:
            if not stack:
                return value, i
            top = stack[-1]
            container = top[0]
            if isinstance(container, list):
                container.append(value)
            else:
                container[top[1]] = value
            i = _skip_ws(s, i)
            ch = s[i : i + 1]
            if ch == ",":
                if isinstance(container, dict):
                    top[1], i = _key_at(s, i + 1)
                else:
                    i += 1
                break
            if ch == ("]" if isinstance(container, list) else "}"):
                stack.pop()
                value, i = container, i + 1
                continue
            raise _fail(s, "Expecting ',' delimiter", i)


def loads_deep(text: str | bytes) -> Any:
    """``json.loads(text)`` at any depth (bytes are UTF-8)."""
    try:
        return json.loads(text)
    except RecursionError:
        pass
    if isinstance(text, bytes):
        text = text.decode("utf-8")
    value, end = _raw_decode_deep(text, _skip_ws(text, 0))
    end = _skip_ws(text, end)
    if end != len(text):
        raise json.JSONDecodeError("Extra data", text, end)
    return value


def raw_decode_deep(s: str, idx: int = 0) -> tuple[Any, int]:
    """``json.JSONDecoder().raw_decode(s, idx)`` at any depth: the value that starts at
    ``idx`` and the index just past it."""
    try:
        return _DECODER.raw_decode(s, idx)
    except RecursionError:
        return _raw_decode_deep(s, idx)


def value_end(s: str, idx: int) -> int:
    """The index just past the JSON value that starts at ``idx`` of ``s``."""
    return raw_decode_deep(s, idx)[1]


_DECODER = json.JSONDecoder()
