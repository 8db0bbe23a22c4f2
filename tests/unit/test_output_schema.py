"""``Agent(output_schema=...)``: the schema checked at definition, sent as ``output_config.format``
(so part of the fingerprint), and the final answer parsed and validated against it."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured

from durable_agents.declare.agents import Agent
from durable_agents.declare.output import InvalidOutput, correction_text
from durable_agents.offline import ScriptedModel, answer_directive, parse_script

SCHEMA = {
    "type": "object",
    "properties": {
        "total": {"type": "integer", "minimum": 0},
        "kind": {"anyOf": [{"type": "string"}, {"type": "null"}]},
    },
    "required": ["total"],
    "additionalProperties": False,
}

# The fingerprint of ``make()`` without an output schema, as it was before output schemas
# existed: the request of an agent without one must not change.
FINGERPRINT_WITHOUT_SCHEMA = "88fac7aa360d09735cfd72229639b3478ace3f8ddac264bc7ea85344710e516b"


def make(**overrides: Any) -> Agent:
    kwargs: dict[str, Any] = {
        "name": "n",
        "version": "1",
        "model": "claude-fable-5-1",
        "system": "Count.",
        "max_tokens": 1000,
        "params": {"output_config": {"effort": "high"}},
        "register": False,
    }
    kwargs.update(overrides)
    return Agent(**kwargs)


# --------------------------------------------------------------------------- definition


@pytest.mark.parametrize(
    ("schema", "says"),
    [
        ({"type": "nope"}, "output_schema is not a valid JSON Schema"),
        ({"properties": {"a": {"minimum": "zero"}}}, "output_schema is not a valid JSON Schema"),
        ({"required": "total"}, "output_schema is not a valid JSON Schema"),
        (True, "output_schema must be a JSON Schema object"),
        ('{"type": "object"}', "output_schema must be a JSON Schema object"),
        ({"type": "number", "maximum": float("nan")}, "not JSON-serialisable"),
    ],
)
def test_a_schema_that_is_not_a_json_schema_is_a_definition_error(schema: Any, says: str) -> None:
    with pytest.raises(ImproperlyConfigured, match=says) as raised:
        make(output_schema=schema)
    assert str(raised.value).startswith("agent n@1: ")


def test_a_format_in_params_next_to_an_output_schema_is_refused() -> None:
    params = {"output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}}
    with pytest.raises(ImproperlyConfigured, match="give the final answer's JSON Schema once"):
        make(params=params, output_schema=SCHEMA)
    # Without an output schema, params are sent as they always were.
    assert make(params=params).request_params()["output_config"] == params["output_config"]


def test_the_schema_is_a_private_copy() -> None:
    schema = copy.deepcopy(SCHEMA)
    agent = make(output_schema=schema)
    before = agent.fingerprint()
    schema["required"] = ["total", "kind"]
    assert agent.output_schema == SCHEMA
    assert make(output_schema=SCHEMA).fingerprint() == before


# --------------------------------------------------------------------------- the request


def test_without_a_schema_the_request_and_fingerprint_are_unchanged() -> None:
    agent = make()
    assert agent.output_schema is None
    assert agent.request_params()["output_config"] == {"effort": "high"}
    assert agent.fingerprint() == FINGERPRINT_WITHOUT_SCHEMA


def test_the_schema_is_sent_as_output_config_format_and_enters_the_fingerprint() -> None:
    agent = make(output_schema=SCHEMA)
    assert agent.request_params()["output_config"] == {
        "effort": "high",
        "format": {"type": "json_schema", "schema": SCHEMA},
    }
    assert make(params={}, output_schema=SCHEMA).request_params()["output_config"] == {
        "format": {"type": "json_schema", "schema": SCHEMA}
    }
    assert agent.fingerprint() != FINGERPRINT_WITHOUT_SCHEMA
    other = {**SCHEMA, "required": ["total", "kind"]}
    assert make(output_schema=other).fingerprint() != agent.fingerprint()
    # The thinking binding (system and tools) does not cover it: the API allows the change.
    assert make(output_schema=SCHEMA).digests()["binding"] == make().digests()["binding"]


# --------------------------------------------------------------------------- the answer


def test_a_valid_answer_is_parsed() -> None:
    output = make(output_schema=SCHEMA).output
    assert output is not None
    assert output.parse('{"total": 3, "kind": null}') == {"total": 3, "kind": None}


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("three", "the answer is not valid JSON: Expecting value"),
        ('{"total": 3', "the answer is not valid JSON"),
        ('{"kind": "box"}', "- answer: 'total' is a required property"),
        ('{"total": -1}', "- answer.total: -1 is less than the minimum of 0"),
        ('{"total": 1, "kind": 4}', "- answer.kind: 4 is not of type 'string', 'null'"),
        ('{"total": 1, "extra": true}', "Additional properties are not allowed ('extra'"),
        ("[1]", "- answer: [1] is not of type 'object'"),
    ],
)
def test_an_invalid_answer_says_what_is_wrong(text: str, says: str) -> None:
    output = make(output_schema=SCHEMA).output
    assert output is not None
    with pytest.raises(InvalidOutput) as raised:
        output.parse(text)
    assert says in str(raised.value)
    told = correction_text(raised.value)
    assert says in told
    assert told.startswith("Your final answer was not accepted: ")


def test_many_errors_are_capped() -> None:
    schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(40)}}
    output = make(output_schema=schema).output
    assert output is not None
    with pytest.raises(InvalidOutput) as raised:
        output.parse("{" + ", ".join(f'"p{i}": "x"' for i in range(40)) + "}")
    assert "... and 20 more errors" in str(raised.value)
    assert len(str(raised.value)) <= 4000


# --------------------------------------------------------------------------- the offline script


def test_answer_lines_are_final_turns_in_order_with_the_plan() -> None:
    script = parse_script(
        "Count.\n"
        + answer_directive('{"total": "x"}')
        + '\n@count {"box": "a"}\n'
        + answer_directive('{"total": 1}')
    )
    assert len(script.plan) == 3
    assert script.answers == {0: '{"total": "x"}', 2: '{"total": 1}'}
    assert script.plan[0] == script.plan[2] == []


def test_an_answer_line_needs_a_json_string() -> None:
    with pytest.raises(ValueError, match="@@answer needs a JSON string"):
        parse_script("Count.\n@@answer {}")


@pytest.mark.parametrize(
    ("output_config", "status"),
    [
        ({"format": {"type": "json_schema", "schema": SCHEMA}}, 200),
        ({"effort": "high"}, 200),
        ({"format": {"type": "json_object"}}, 400),
        ({"format": {"type": "json_schema", "schema": "object"}}, 400),
        ("json", 400),
    ],
)
def test_the_offline_model_checks_the_shape_of_output_config(
    output_config: Any, status: int
) -> None:
    body = {
        "model": "claude-test-1",
        "max_tokens": 100,
        "messages": [{"role": "user", "content": "Count.\n" + answer_directive("{}")}],
        "output_config": output_config,
    }
    answered, _, out = ScriptedModel().respond(
        "POST", "/v1/messages", {}, json.dumps(body).encode()
    )
    assert answered == status
    if status == 200:
        assert json.loads(out)["content"][0] == {"type": "text", "text": "{}"}
    else:
        assert b"output_config" in out


def test_an_answer_nested_deeper_than_the_validator_recurses_is_refused() -> None:
    schema = {
        "$defs": {"n": {"type": "array", "items": {"$ref": "#/$defs/n"}}},
        "$ref": "#/$defs/n",
    }
    output = make(output_schema=schema).output
    assert output is not None
    depth = 900  # json.loads reads it; the validator recurses several frames per level
    with pytest.raises(InvalidOutput, match="nested too deeply"):
        output.parse("[" * depth + "]" * depth)
    assert output.parse("[[[]]]") == [[[]]]
