"""How a page shows text from outside: every invisible or direction-changing character is a
visible marker, the rest is escaped, and the character itself is never in the HTML."""

from __future__ import annotations

import pytest
from django.template import Context, Template

from durable_agents._internal.text import (
    character_references,
    count_invisible,
    plain_markers,
    reveal_invisible,
    revealed,
)

# One of each kind the pages must mark, and what each marker reads.
HIDDEN = {
    "\u202e": "U+202E RIGHT-TO-LEFT OVERRIDE",
    "\u2066": "U+2066 LEFT-TO-RIGHT ISOLATE",
    "\u200b": "U+200B ZERO WIDTH SPACE",
    "\u200d": "U+200D ZERO WIDTH JOINER",
    "\u2060": "U+2060 WORD JOINER",
    "\ufeff": "U+FEFF ZERO WIDTH NO-BREAK SPACE",
    "\u00ad": "U+00AD SOFT HYPHEN",
    "\u180e": "U+180E MONGOLIAN VOWEL SEPARATOR",
    "\U000e0041": "U+E0041 TAG LATIN CAPITAL LETTER A",
    "\U000e0000": "U+E0000 FORMAT CHARACTER",  # a tag code point Unicode leaves unassigned
    "\x07": "U+0007 CONTROL",
    "\x85": "U+0085 CONTROL",
    "\r": "U+000D CONTROL",  # a carriage return alone; before a newline it is a line end
}


@pytest.mark.parametrize(("char", "title"), HIDDEN.items())
def test_each_hidden_character_is_a_titled_marker(char: str, title: str) -> None:
    html, count = reveal_invisible(f"a{char}b")
    marker = f"\u27e8U+{ord(char):04X}\u27e9"
    assert str(html) == f'a<span class="da-invisible" title="{title}">{marker}</span>b'
    assert count == 1
    assert plain_markers(f"a{char}b") == f"a{marker}b"
    assert str(character_references(f"a{char}b")) == f"a&#x{ord(char):X};b"


def test_markup_is_escaped_and_plain_text_is_left_alone() -> None:
    html, count = reveal_invisible('<b title="x">\u202e</b> & done\r\n\tnext')
    assert str(html) == (
        "&lt;b title=&quot;x&quot;&gt;"
        '<span class="da-invisible" title="U+202E RIGHT-TO-LEFT OVERRIDE">⟨U+202E⟩</span>'
        "&lt;/b&gt; &amp; done\r\n\tnext"
    )
    assert count == 1
    assert reveal_invisible("plain, é and 漢字\n") == ("plain, é and 漢字\n", 0)
    assert count_invisible("plain\r\n") == 0


def test_a_lone_surrogate_is_marked_as_the_page_can_encode_it() -> None:
    html, count = reveal_invisible("half \ud800")
    assert (str(html), count) == ("half \ufffd", 0)  # storable_text's marker, then shown


def test_the_warning_counts_them_and_the_filter_applies_it() -> None:
    html = str(revealed("DELETE /*\u202e \u2066x\u2069 */"))
    assert html.startswith('<span class="da-invisible-warning" role="alert">')
    assert "This value contains 3 invisible or direction-changing characters" in html
    assert str(revealed("plain")) == "plain"
    template = Template("{% load durable_agents_text %}{{ v|reveal }}|{{ v|plain_markers }}")
    rendered = template.render(Context({"v": "<i>\u200b</i>"}))
    assert "\u200b" not in rendered
    assert rendered.endswith("|&lt;i&gt;⟨U+200B⟩&lt;/i&gt;")
