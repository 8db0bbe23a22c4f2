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

import functools
import json
import re
import unicodedata
from collections.abc import Iterator
from typing import Any

from django.utils.html import escape
from django.utils.safestring import SafeString
from django.utils.translation import ngettext

from durable_agents.exceptions import Unstorable as Unstorable  # re-exported: its old home

NUL_MARKER = "\u2400"  # ␀ SYMBOL FOR NULL
SURROGATE_MARKER = "\ufffd"  # � REPLACEMENT CHARACTER

# Nesting deeper than this in a tool's input or result is refused with a clear error. Real
# tool inputs are a few levels deep; the limit stays far below Python's recursion limit, so
# json, jsonschema and the database driver never meet a value they cannot walk.
MAX_DEPTH = 100
# Texts up to this many characters have their brackets counted rather than their value walked
# (``json_text``).
_SCAN_LIMIT = 65_536

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
    try:
        text = json.dumps(value, ensure_ascii=False)
        if not text.isascii() and has_unstorable(text):
            text = json.dumps(value, ensure_ascii=True)
    except (TypeError, ValueError, RecursionError) as exc:
        check_depth(value, limit)  # too deep is the reason given first
        raise Unstorable(f"is not JSON-serialisable: {storable_text(exc, 300)}") from exc
    # A value nests no deeper than its text has brackets (those inside strings count too, so
    # never fewer): most texts are measured by two scans, not a walk of the value. A long
    # text is walked (its few containers cost less than scanning it).
    if len(text) > _SCAN_LIMIT or text.count("[") + text.count("{") > limit:
        check_depth(value, limit)
    return text


# ---------------------------------------------------------------------------------------------
# Characters a page must show, not obey
#
# A direction override (U+202E), an isolate (U+2066..U+2069) or a zero-width character makes a
# browser draw a text in another order than it is stored, or hides part of it: a person would
# approve ``DELETE FROM users /* keep admins */ WHERE id = 42`` while the stored text deletes
# every row. Every page that shows a value a person decides on draws each such character as a
# visible marker instead, and says how many there are.

MARKER_FORMAT = "\u27e8U+{:04X}\u27e9"  # ⟨U+202E⟩

# Beyond Unicode's format characters (Cf) and the controls: the tag characters (an invisible
# copy of ASCII), whose unassigned code points Unicode does not call Cf.
_TAG_CHARACTERS = range(0xE0000, 0xE0080)


@functools.cache
def _invisible_re() -> re.Pattern[str]:
    """Every format character (Cf), control (Cc) but newline and tab, lone surrogate and tag
    character, as one character class. Built once, on first use (it reads the Unicode table
    of this Python)."""
    points = [
        cp
        for cp in range(0x20000)  # planes 0 and 1 hold every Cf and Cc outside the tags
        if unicodedata.category(chr(cp)) in ("Cf", "Cc", "Cs") and chr(cp) not in "\n\t"
    ]
    points.extend(_TAG_CHARACTERS)
    ranges: list[tuple[int, int]] = []
    for cp in sorted(set(points)):
        if ranges and ranges[-1][1] == cp - 1:
            ranges[-1] = (ranges[-1][0], cp)
        else:
            ranges.append((cp, cp))
    body = "".join(f"\\U{lo:08x}" if lo == hi else f"\\U{lo:08x}-\\U{hi:08x}" for lo, hi in ranges)
    # A carriage return before a newline is a line end (every form posts CRLF), not a trick.
    return re.compile(f"(?!\\r\\n)[{body}]")


def invisible_name(char: str) -> str:
    """``U+202E RIGHT-TO-LEFT OVERRIDE``: what a marker's title says of its character."""
    name = unicodedata.name(char, "")
    if not name:
        category = unicodedata.category(char)
        name = {"Cc": "CONTROL", "Cs": "SURROGATE"}.get(category, "FORMAT CHARACTER")
    return f"U+{ord(char):04X} {name}"


def invisible_characters(text: str) -> Iterator[re.Match[str]]:
    """Each character of ``text`` a page shows as a marker, as a match (its place in
    ``match.start()``): for a place that cannot hold markers (a textarea) and lists them."""
    return _invisible_re().finditer(text)


def count_invisible(text: str) -> int:
    """How many characters of ``text`` a page shows as markers (0 for plain ASCII text)."""
    if text.isascii() and text.isprintable():
        return 0
    return sum(1 for _ in _invisible_re().finditer(text))


def plain_markers(text: Any) -> str:
    """``text`` with each invisible or direction-changing character written as the plain text
    ``⟨U+202E⟩``: for places that hold no markup (a title attribute, a page's <title>, a
    message)."""
    shown = storable_text(text)
    if shown.isascii() and shown.isprintable():
        return shown
    return _invisible_re().sub(lambda m: MARKER_FORMAT.format(ord(m.group())), shown)


def reveal_invisible(text: Any) -> tuple[SafeString, int]:
    """``text`` as HTML: escaped, with each invisible or direction-changing character drawn as
    ``<span class="da-invisible" title="U+202E RIGHT-TO-LEFT OVERRIDE">⟨U+202E⟩</span>``
    (the character itself is never in the HTML); and how many there were."""
    shown = storable_text(text)
    if shown.isascii() and shown.isprintable():
        return SafeString(escape(shown)), 0
    parts: list[str] = []
    count = 0
    last = 0
    for match in _invisible_re().finditer(shown):
        char = match.group()
        parts.append(escape(shown[last : match.start()]))
        parts.append(
            f'<span class="da-invisible" title="{escape(invisible_name(char))}">'
            f"{MARKER_FORMAT.format(ord(char))}</span>"
        )
        count += 1
        last = match.end()
    parts.append(escape(shown[last:]))
    return SafeString("".join(parts)), count


def invisible_warning(count: int) -> SafeString:
    """The warning above a value holding ``count`` such characters ("" for none)."""
    if not count:
        return SafeString("")
    message = ngettext(
        "This value contains %(count)s invisible or direction-changing character, shown as "
        "⟨U+....⟩ markers. Read it marker by marker before deciding.",
        "This value contains %(count)s invisible or direction-changing characters, shown as "
        "⟨U+....⟩ markers. Read it marker by marker before deciding.",
        count,
    ) % {"count": count}
    return SafeString(f'<span class="da-invisible-warning" role="alert">{escape(message)}</span>')


def revealed(text: Any) -> SafeString:
    """``reveal_invisible``'s HTML, after the warning when there is anything to warn of."""
    html, count = reveal_invisible(text)
    return SafeString(invisible_warning(count) + html) if count else html


def character_references(text: Any) -> SafeString:
    """``text`` escaped for HTML, with each invisible or direction-changing character as a
    numeric character reference (``&#x202E;``): for a hidden input that must post the value
    back exactly while the page's HTML holds none of them."""
    shown = storable_text(text)
    escaped = escape(shown)
    if shown.isascii() and shown.isprintable():
        return SafeString(escaped)
    return SafeString(_invisible_re().sub(lambda m: f"&#x{ord(m.group()):X};", escaped))
