"""``Agent(output_schema=...)``: the run's final answer as JSON valid against a schema.

The schema is sent on every request of the agent's runs as the Messages API's structured
outputs (``output_config.format``: ``{"type": "json_schema", "schema": ...}``), so a model that
supports them writes its final text as JSON matching it; tool calls go on as before (the format
constrains the answer's text, not tool use). The runtime still parses and validates the final
text itself, against the whole schema: a keyword the API does not enforce, an answer cut
short, a model or a server that ignores the format. An answer that does not pass is told to
the model, with the validation error, as a user message, and it answers again while the
agent's ``max_turns`` allow.

This module never touches the database: agents are built at import.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import jsonschema
from django.core.exceptions import ImproperlyConfigured

from durable_agents.declare.tools import _cap, _leaf_errors

__all__ = ["InvalidOutput", "OutputSchema", "correction_text"]

# How much of the validation errors the model and the run's error are told.
_MAX_ERRORS = 20
_MAX_ERROR_CHARS = 300
_MAX_MESSAGE_CHARS = 4000


class InvalidOutput(ValueError):
    """The final answer is not JSON, or not valid against the agent's output schema; the
    message says why, in words the model can act on."""


class OutputSchema:
    """A JSON Schema (draft 2020-12) the final answer must match, checked at definition."""

    def __init__(self, where: str, schema: Any) -> None:
        if isinstance(schema, bool) or not isinstance(schema, dict):
            raise ImproperlyConfigured(
                f"{where}: output_schema must be a JSON Schema object (a dict), got {schema!r}"
            )
        try:
            jsonschema.Draft202012Validator.check_schema(schema)
        except jsonschema.SchemaError as exc:
            raise ImproperlyConfigured(
                f"{where}: output_schema is not a valid JSON Schema: {exc.message}"
            ) from exc
        try:
            json.dumps(schema, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ImproperlyConfigured(
                f"{where}: output_schema is not JSON-serialisable: {exc}"
            ) from exc
        # A private copy: the schema is fingerprinted and must not change under us.
        self.schema: dict[str, Any] = copy.deepcopy(schema)
        self._validator = jsonschema.Draft202012Validator(self.schema)

    def request_format(self) -> dict[str, Any]:
        """``output_config.format`` as every request of the agent sends it (a fresh copy)."""
        return {"type": "json_schema", "schema": copy.deepcopy(self.schema)}

    def parse(self, text: str) -> Any:
        """The final answer's text as a JSON value valid against the schema, or
        ``InvalidOutput`` saying what is wrong."""
        try:
            value = json.loads(text)
        except (ValueError, RecursionError) as exc:
            message = _cap(f"the answer is not valid JSON: {exc}", _MAX_ERROR_CHARS)
            raise InvalidOutput(message) from None
        try:
            errors = sorted(
                leaf
                for error in self._validator.iter_errors(value)
                for leaf in _leaf_errors(error, root="answer")
            )
        except RecursionError:
            # The validator recurses per level: an answer nested this deep is no answer.
            raise InvalidOutput("the answer is nested too deeply to be validated") from None
        if not errors:
            return value
        lines = [_cap(f"{path}: {msg}", _MAX_ERROR_CHARS) for path, msg in errors[:_MAX_ERRORS]]
        if len(errors) > _MAX_ERRORS:
            lines.append(f"... and {len(errors) - _MAX_ERRORS} more errors")
        message = "the answer does not match the output schema:\n" + "\n".join(
            f"- {line}" for line in lines
        )
        raise InvalidOutput(_cap(message, _MAX_MESSAGE_CHARS))


def correction_text(error: InvalidOutput) -> str:
    """The user message that tells the model its final answer was refused, and why."""
    return (
        f"Your final answer was not accepted: {error}\n"
        "Answer again with only a JSON document that matches the output schema."
    )
