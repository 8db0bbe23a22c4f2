"""``json_text``: a JSON value as storable text, refused past MAX_DEPTH levels whatever the
shape of its text (durable_agents/_internal/text.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from durable_agents._internal.text import MAX_DEPTH, Unstorable, json_text


def nested(depth: int, leaf: Any = 1) -> Any:
    value = leaf
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    return value


def test_a_value_at_the_limit_is_stored_and_decodes_to_itself() -> None:
    value = nested(MAX_DEPTH)
    assert json.loads(json_text(value)) == value


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 5_000], ids=["one-too-deep", "past-recursion"])
def test_a_value_deeper_than_the_limit_is_refused(depth: int) -> None:
    with pytest.raises(Unstorable, match="nests deeper than 100 levels"):
        json_text(nested(depth))


def test_a_long_text_is_measured_by_its_value() -> None:
    with pytest.raises(Unstorable, match="nests deeper"):
        json_text(nested(MAX_DEPTH + 1, leaf="x" * 100_000))
    assert json.loads(json_text(nested(MAX_DEPTH, leaf="x" * 100_000)))


def test_brackets_inside_strings_are_not_nesting() -> None:
    value = {"sql": "[" * 500 + "{" * 500, "list": ["]]]", "{{{"]}
    assert json.loads(json_text(value)) == value


def test_too_deep_is_the_reason_given_before_not_serialisable() -> None:
    with pytest.raises(Unstorable, match="nests deeper"):
        json_text(nested(MAX_DEPTH + 1, leaf=object()))
    with pytest.raises(Unstorable, match="not JSON-serialisable"):
        json_text({"a": object()})
