"""Template filters for text from outside (``{% load durable_agents_text %}``).

``{{ value|reveal }}``: the value escaped, each invisible or direction-changing character drawn
as a visible ``⟨U+202E⟩`` marker, after a warning that says how many there are.
``{{ value|plain_markers }}``: the same markers as plain text, for attributes and titles.
``{{ value|input_markers }}``: above a form input (which cannot hold markup), the warning and
the value drawn with its markers, when the value holds any such character; else nothing.
``{{ run_id|short_id }}``: the 8 hex digits that stand for a run in lists and titles.
"""

from __future__ import annotations

from typing import Any

from django import template
from django.utils.safestring import SafeString

from durable_agents._internal import text
from durable_agents.models.ids import short_id as run_short_id

register = template.Library()


@register.filter(is_safe=True)
def reveal(value: Any) -> SafeString:
    if value is None:
        return SafeString("")
    return text.revealed(value)


@register.filter(is_safe=False)
def plain_markers(value: Any) -> str:
    if value is None:
        return ""
    return text.plain_markers(value)


@register.filter(is_safe=True)
def hidden_value(value: Any) -> SafeString:
    """A hidden input's value, posted back exactly: escaped, and each invisible or
    direction-changing character written as a numeric character reference (the browser posts
    the character; the page never holds it)."""
    if value is None:
        return SafeString("")
    return text.character_references(value)


@register.filter(is_safe=True)
def short_id(run_id: Any) -> str:
    """The short id of a run id (a UUID or its text) as every page shows it: the last 8 hex
    digits of a time-ordered id, the first 8 of any other (``ids.short_id``); '' for none.
    Hex digits only, so safe as they are."""
    if run_id is None or run_id == "":
        return ""
    return run_short_id(run_id)


@register.filter(is_safe=True)
def input_markers(value: Any) -> SafeString:
    if value is None:
        return SafeString("")
    shown, count = text.reveal_invisible(value)
    if not count:
        return SafeString("")
    return SafeString(
        f'<div class="da-input-markers">{text.invisible_warning(count)}'
        f'<div class="da-input-marked">{shown}</div></div>'
    )
