"""durable_agents.declare.tools: schema derivation, validation, invocation. No database."""

from __future__ import annotations

import enum
import typing
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal, Optional, Union

import pytest
from django.core.exceptions import ImproperlyConfigured

from durable_agents import tool as exported_tool
from durable_agents.declare.tools import (
    EFFECTS,
    Tool,
    ToolInputError,
    schema_from_signature,
    tool,
)
from durable_agents.exceptions import DefinitionError


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


def _props(func: typing.Callable[..., Any]) -> dict[str, Any]:
    return schema_from_signature(func)["properties"]


# --------------------------------------------------------------------------- decorator


def test_package_exports_the_same_decorator() -> None:
    assert exported_tool is tool
    assert EFFECTS == ("pure", "idempotent", "non_idempotent", "irreversible")


def test_decorator_builds_a_tool_from_the_function() -> None:
    @tool(effect="pure")
    def get_schema(table: str) -> str:
        """Return the CREATE TABLE statement of one table."""
        return f"CREATE TABLE {table} ()"

    assert isinstance(get_schema, Tool)
    assert get_schema.name == "get_schema"
    assert get_schema.effect == "pure"
    assert get_schema.description == "Return the CREATE TABLE statement of one table."
    assert get_schema.takes_idempotency_key is False
    assert get_schema.input_schema == {
        "type": "object",
        "properties": {"table": {"type": "string"}},
        "required": ["table"],
        "additionalProperties": False,
    }
    # Still callable directly, so decorated functions stay testable.
    assert get_schema("users") == "CREATE TABLE users ()"
    assert get_schema(table="t") == "CREATE TABLE t ()"
    # functools.update_wrapper sets it at run time; Tool does not declare it.
    assert get_schema.__name__ == "get_schema"  # type: ignore[attr-defined]


def test_definition_is_exactly_name_description_schema_in_order() -> None:
    @tool(effect="idempotent")
    def set_status(status: str) -> None:
        """Set it.

        More text here.
        """

    definition = set_status.definition()
    assert list(definition) == ["name", "description", "input_schema"]
    assert definition == {
        "name": "set_status",
        "description": "Set it.\n\nMore text here.",
        "input_schema": {
            "type": "object",
            "properties": {"status": {"type": "string"}},
            "required": ["status"],
            "additionalProperties": False,
        },
    }
    # A copy: mutating it must not change the tool (the definition is fingerprinted).
    definition["input_schema"]["properties"].clear()
    assert set_status.definition()["input_schema"]["properties"] == {"status": {"type": "string"}}


def test_missing_docstring_gives_empty_description() -> None:
    @tool(effect="pure")
    def nodoc() -> int:
        return 1

    assert nodoc.description == ""
    assert nodoc.input_schema == {
        "type": "object",
        "properties": {},
        "required": [],
        "additionalProperties": False,
    }


EFFECT_CHOICES = (
    '"pure" (reads only), "idempotent" (writes, and twice is the same as once), '
    '"non_idempotent" (writes that must not happen twice; it receives an idempotency_key), '
    '"irreversible" (cannot be undone; a person approves each call first)'
)


def test_missing_effect_names_the_function_its_module_and_the_effects() -> None:
    with pytest.raises(DefinitionError, match="missing effect") as excinfo:

        @tool()  # type: ignore[call-overload]  # deliberately without its effect
        def no_effect() -> None: ...

    message = str(excinfo.value)
    assert message.startswith("tool test_missing_effect_")
    assert ".<locals>.no_effect in tests.unit.test_tools (" in message
    assert f"{__file__}, line " in message
    assert 'Write @tool(effect="pure") above it' in message
    assert EFFECT_CHOICES in message
    # Still what it was: a ValueError; and a configuration error, like an Agent's.
    assert isinstance(excinfo.value, ValueError)
    assert isinstance(excinfo.value, ImproperlyConfigured)


def test_unknown_effect_names_the_function_and_the_effects() -> None:
    with pytest.raises(DefinitionError, match="'sideways' is not an effect") as excinfo:

        @tool(effect="sideways")  # type: ignore[call-overload]  # deliberately not an effect
        def weird() -> None: ...

    message = str(excinfo.value)
    assert "weird in tests.unit.test_tools" in message
    assert EFFECT_CHOICES in message


def test_bare_decorator_is_rejected_with_a_hint() -> None:
    with pytest.raises(DefinitionError, match=r'bare in .*missing effect\. Write @tool\(effect="'):

        @tool
        def bare() -> None: ...


def test_positional_effect_is_not_accepted() -> None:
    def f() -> None: ...

    with pytest.raises(TypeError, match=r"use @tool\(effect=\.\.\.\) with keyword arguments"):
        tool(f, effect="pure")


def test_args_and_kwargs_are_unsupported() -> None:
    with pytest.raises(TypeError, match=r"unsupported signature for tool .*star_args"):

        @tool(effect="pure")
        def star_args(*args: int) -> None: ...

    with pytest.raises(TypeError, match=r"unsupported signature for tool .*star_kwargs"):

        @tool(effect="pure")
        def star_kwargs(a: int, **kwargs: int) -> None: ...


def test_positional_only_parameters_are_unsupported() -> None:
    with pytest.raises(TypeError, match="positional-only parameter 'a'"):

        @tool(effect="pure")
        def pos_only(a: int, /) -> None: ...


def test_invalid_tool_name_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"name 'has space' must be 1 to 128 letters"):

        @tool(effect="pure", name="has space")
        def f() -> None: ...


def test_repr_names_tool_effect_and_function() -> None:
    @tool(effect="irreversible")
    def drop_table(table: str) -> None: ...

    assert repr(drop_table) == (
        "<Tool drop_table effect=irreversible func=tests.unit.test_tools."
        "test_repr_names_tool_effect_and_function.<locals>.drop_table>"
    )


# --------------------------------------------------------------------------- overrides


def test_name_and_description_overrides() -> None:
    @tool(effect="pure", name="lookup", description="Look something up.")
    def f(q: str) -> str:
        """Ignored docstring."""
        return q

    assert f.name == "lookup"
    assert f.description == "Look something up."
    assert f.definition()["name"] == "lookup"
    assert f.definition()["description"] == "Look something up."


def test_explicit_input_schema_overrides_derived_one() -> None:
    schema = {
        "type": "object",
        "properties": {"q": {"type": "string", "minLength": 2}},
        "required": ["q"],
    }

    @tool(effect="pure", input_schema=schema)
    def search(q):
        return q.upper()

    assert search.input_schema == schema
    assert search.input_schema is not schema
    schema["required"] = []  # The tool keeps its own copy.
    assert search.input_schema["required"] == ["q"]
    with pytest.raises(ToolInputError, match=r"input\.q: 'a' is too short"):
        search.invoke({"q": "a"})
    assert search.invoke({"q": "ab"}) == "AB"


def test_explicit_input_schema_must_be_a_valid_schema() -> None:
    with pytest.raises(DefinitionError, match=r"tool .*bad in .*: invalid input_schema: 12 is not"):

        @tool(effect="pure", input_schema={"type": 12})
        def bad() -> None: ...


# --------------------------------------------------------------------------- type hints


def test_scalar_types_bool_before_int() -> None:
    def f(s: str, i: int, x: float, b: bool) -> None: ...

    assert _props(f) == {
        "s": {"type": "string"},
        "i": {"type": "integer"},
        "x": {"type": "number"},
        "b": {"type": "boolean"},
    }


def test_list_tuple_set_types() -> None:
    def f(
        a: list[int],
        b: list,
        c: tuple,
        d: tuple[str, ...],
        e: tuple[int, str],
        g: set[str],
        h: list[Any],
    ) -> None: ...

    assert _props(f) == {
        "a": {"type": "array", "items": {"type": "integer"}},
        "b": {"type": "array"},
        "c": {"type": "array"},
        "d": {"type": "array", "items": {"type": "string"}},
        "e": {
            "type": "array",
            "prefixItems": [{"type": "integer"}, {"type": "string"}],
            "minItems": 2,
            "maxItems": 2,
        },
        "g": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
        "h": {"type": "array"},
    }


def test_dict_types() -> None:
    def f(
        a: dict,
        b: dict[str, int],
        c: dict[str, Any],
        d: dict[str, list[str]],
    ) -> None: ...

    assert _props(f) == {
        "a": {"type": "object"},
        "b": {"type": "object", "additionalProperties": {"type": "integer"}},
        "c": {"type": "object"},
        "d": {
            "type": "object",
            "additionalProperties": {"type": "array", "items": {"type": "string"}},
        },
    }


def test_abstract_sequence_and_mapping() -> None:
    def f(a: Sequence[int], b: Mapping[str, bool]) -> None: ...

    assert _props(f) == {
        "a": {"type": "array", "items": {"type": "integer"}},
        "b": {"type": "object", "additionalProperties": {"type": "boolean"}},
    }


def test_function_attributes_do_not_shadow_tool_attributes() -> None:
    def f() -> None: ...

    f.name = "shadow"  # type: ignore[attr-defined]
    assert tool(effect="pure")(f).name == "f"


def test_dict_with_non_string_keys_is_rejected() -> None:
    def f(a: dict[int, str]) -> None: ...

    with pytest.raises(TypeError, match=r"parameter 'a': dict keys must be str"):
        schema_from_signature(f)


def test_optional_and_unions() -> None:
    def f(
        a: Optional[int],  # noqa: UP045 - the old spelling must work too
        b: str | None,
        c: int | str,
        d: Union[int, str, None],  # noqa: UP007
        e: None | float,  # noqa: RUF036 - None first must work too
    ) -> None: ...

    assert _props(f) == {
        "a": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
        "b": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        "c": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
        "d": {"anyOf": [{"type": "integer"}, {"type": "string"}, {"type": "null"}]},
        "e": {"anyOf": [{"type": "number"}, {"type": "null"}]},
    }


def test_literals() -> None:
    def f(
        a: Literal["asc", "desc"],
        b: Literal[1, 2, 3],
        c: Literal[1, "x"],
        d: Literal[True, 1],
    ) -> None: ...

    assert _props(f) == {
        "a": {"type": "string", "enum": ["asc", "desc"]},
        "b": {"type": "integer", "enum": [1, 2, 3]},
        "c": {"enum": [1, "x"]},
        # True and 1 are different JSON types, so no shared "type".
        "d": {"enum": [True, 1]},
    }


def test_enums() -> None:
    def f(color: Color, level: Level, maybe: Color | None = None) -> None: ...

    assert schema_from_signature(f) == {
        "type": "object",
        "properties": {
            "color": {"type": "string", "enum": ["red", "blue"]},
            "level": {"type": "integer", "enum": [1, 2]},
            "maybe": {
                "anyOf": [{"type": "string", "enum": ["red", "blue"]}, {"type": "null"}],
                "default": None,
            },
        },
        "required": ["color", "level"],
        "additionalProperties": False,
    }


def test_any_and_missing_hints_are_unconstrained() -> None:
    def f(a: Any, b) -> None: ...

    assert _props(f) == {"a": {}, "b": {}}


def test_annotated_string_becomes_description() -> None:
    def f(a: Annotated[int, "How many rows."]) -> None: ...

    assert _props(f) == {"a": {"type": "integer", "description": "How many rows."}}


def test_unsupported_hint_is_a_type_error_naming_the_parameter() -> None:
    class Custom:
        pass

    def f(a: Custom) -> None: ...

    f.__annotations__["a"] = Custom  # Resolved, so the error is about the type, not the name.
    with pytest.raises(TypeError, match=r"parameter 'a': unsupported type hint .*Custom"):
        schema_from_signature(f)


def test_unresolvable_forward_reference_is_a_type_error() -> None:
    def f(a: NoSuchType) -> None: ...  # type: ignore[name-defined]  # noqa: F821

    with pytest.raises(TypeError, match=r"cannot resolve the type hints of tool .*NoSuchType"):
        schema_from_signature(f)


def test_defaults_make_parameters_optional_and_are_included_when_json() -> None:
    sentinel = object()

    def f(
        a: int,
        b: int = 3,
        c: str | None = None,
        d: tuple[int, ...] = (1, 2),
        e: Color = Color.BLUE,
        g: Any = sentinel,
        h: float = float("nan"),
    ) -> None: ...

    schema = schema_from_signature(f)
    assert schema["required"] == ["a"]
    assert schema["properties"] == {
        "a": {"type": "integer"},
        "b": {"type": "integer", "default": 3},
        "c": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None},
        "d": {"type": "array", "items": {"type": "integer"}, "default": [1, 2]},
        "e": {"type": "string", "enum": ["red", "blue"], "default": "blue"},
        "g": {},  # Not JSON-serialisable: no default shown.
        "h": {"type": "number"},  # NaN is not valid JSON.
    }


def test_properties_follow_parameter_order_and_keyword_only_work() -> None:
    def f(z: int, a: int, *, m: str, b: bool = False) -> None: ...

    schema = schema_from_signature(f)
    assert list(schema["properties"]) == ["z", "a", "m", "b"]
    assert schema["required"] == ["z", "a", "m"]
    assert list(schema) == ["type", "properties", "required", "additionalProperties"]


def test_google_style_args_section_describes_parameters_and_is_stripped() -> None:
    @tool(effect="pure")
    def run_query(sql: str, limit: int = 10, dry: bool = False) -> list[Any]:
        """Run one read-only query.

        The query runs in a read-only transaction.

        Args:
            sql: The SELECT statement.
            limit (int): Most rows to return;
                more are cut.
            dry:

        Returns:
            The rows.
        """
        return []

    assert run_query.description == (
        "Run one read-only query.\n\nThe query runs in a read-only transaction.\n\n"
        "Returns:\n    The rows."
    )
    assert run_query.input_schema["properties"] == {
        "sql": {"type": "string", "description": "The SELECT statement."},
        "limit": {
            "type": "integer",
            "description": "Most rows to return; more are cut.",
            "default": 10,
        },
        "dry": {"type": "boolean", "default": False},
    }


def test_description_override_keeps_parameter_descriptions() -> None:
    @tool(effect="pure", description="Custom.")
    def f(a: int) -> None:
        """Doc.

        Args:
            a: The a.
        """

    assert f.description == "Custom."
    assert f.input_schema["properties"] == {"a": {"type": "integer", "description": "The a."}}


# --------------------------------------------------------------------------- idempotency key


def test_idempotency_key_is_hidden_from_schema_and_passed_by_invoke() -> None:
    calls: list[tuple[str, int, str]] = []

    @tool(effect="non_idempotent")
    def charge_card(customer: str, cents: int, *, idempotency_key: str) -> dict[str, Any]:
        """Charge a card."""
        calls.append((customer, cents, idempotency_key))
        return {"ok": True}

    assert charge_card.takes_idempotency_key is True
    assert charge_card.input_schema == {
        "type": "object",
        "properties": {"customer": {"type": "string"}, "cents": {"type": "integer"}},
        "required": ["customer", "cents"],
        "additionalProperties": False,
    }
    assert charge_card.invoke({"customer": "c1", "cents": 500}, idempotency_key="k-1") == {
        "ok": True
    }
    assert calls == [("c1", 500, "k-1")]


def test_idempotency_key_from_the_model_is_refused() -> None:
    @tool(effect="non_idempotent", input_schema={"type": "object"})
    def f(*, idempotency_key: str) -> str:
        return idempotency_key

    with pytest.raises(ToolInputError, match="'idempotency_key' is set by the runtime"):
        f.invoke({"idempotency_key": "forged"}, idempotency_key="real")
    assert f.invoke({}, idempotency_key="real") == "real"


def test_missing_idempotency_key_is_an_error_unless_defaulted() -> None:
    @tool(effect="non_idempotent")
    def needs(*, idempotency_key: str) -> str:
        return idempotency_key

    @tool(effect="non_idempotent")
    def defaulted(*, idempotency_key: str = "none") -> str:
        return idempotency_key

    with pytest.raises(TypeError, match="tool 'needs' needs an idempotency_key"):
        needs.invoke({})
    assert defaulted.invoke({}) == "none"
    assert defaulted.invoke({}, idempotency_key="k") == "k"


def test_key_is_not_passed_to_functions_that_do_not_take_it() -> None:
    @tool(effect="pure")
    def f(a: int) -> int:
        return a * 2

    assert f.invoke({"a": 4}, idempotency_key="ignored") == 8


# --------------------------------------------------------------------------- validation


@tool(effect="non_idempotent")
def charge(customer: str, cents: int, tags: list[str] | None = None) -> str:
    return f"{customer}:{cents}"


def test_validate_accepts_valid_input() -> None:
    # validate raises on invalid input.
    charge.validate({"customer": "c", "cents": 1})
    charge.validate({"customer": "c", "cents": 1, "tags": None})


def test_wrong_type_reports_path_and_value() -> None:
    with pytest.raises(ToolInputError) as excinfo:
        charge.validate({"customer": "c", "cents": "abc"})
    assert str(excinfo.value) == (
        "Invalid input for tool 'charge':\n- input.cents: 'abc' is not of type 'integer'"
    )
    assert isinstance(excinfo.value, ValueError)


def test_bool_is_not_an_integer() -> None:
    with pytest.raises(ToolInputError, match=r"input\.cents: True is not of type 'integer'"):
        charge.validate({"customer": "c", "cents": True})


def test_missing_field() -> None:
    with pytest.raises(ToolInputError, match=r"- input: 'cents' is a required property"):
        charge.validate({"customer": "c"})


def test_extra_field() -> None:
    with pytest.raises(
        ToolInputError,
        match=r"- input: Additional properties are not allowed \('amount' was unexpected\)",
    ):
        charge.validate({"customer": "c", "cents": 1, "amount": 2})


def test_nested_path_uses_index() -> None:
    with pytest.raises(ToolInputError, match=r"- input\.tags\[1\]: 2 is not of type 'string'"):
        charge.validate({"customer": "c", "cents": 1, "tags": ["a", 2]})


def test_union_errors_name_what_was_expected() -> None:
    @tool(effect="pure")
    def f(a: int | str, b: int | None = None, c: Color | None = None) -> None: ...

    with pytest.raises(ToolInputError) as excinfo:
        f.validate({"a": 1.5, "b": "x", "c": "green"})
    assert str(excinfo.value).splitlines()[1:] == [
        "- input.a: 1.5 is not of type 'integer', 'string'",
        "- input.b: 'x' is not of type 'integer', 'null'",
        "- input.c: 'green' is not one of ['red', 'blue']",
    ]


def test_every_error_is_reported_sorted_by_path() -> None:
    with pytest.raises(ToolInputError) as excinfo:
        charge.validate({"customer": 5, "cents": "x", "zzz": 1})
    assert str(excinfo.value).splitlines() == [
        "Invalid input for tool 'charge':",
        "- input: Additional properties are not allowed ('zzz' was unexpected)",
        "- input.cents: 'x' is not of type 'integer'",
        "- input.customer: 5 is not of type 'string'",
    ]


@pytest.mark.parametrize(
    ("value", "kind"), [([1, 2], "list"), ("text", "str"), (None, "NoneType"), (3, "int")]
)
def test_non_dict_input(value: Any, kind: str) -> None:
    with pytest.raises(ToolInputError) as excinfo:
        charge.validate(value)
    assert str(excinfo.value) == (
        f"Invalid input for tool 'charge': input must be a JSON object, got {kind}"
    )


def test_invoke_validates_before_calling() -> None:
    called: list[int] = []

    @tool(effect="idempotent")
    def f(a: int) -> None:
        called.append(a)

    with pytest.raises(ToolInputError):
        f.invoke({"a": "1"})
    assert called == []


def test_long_messages_are_capped() -> None:
    def f(a: str) -> None: ...

    big = tool(effect="pure")(f)
    with pytest.raises(ToolInputError) as excinfo:
        big.validate({"a": 1, **{f"extra_{i}": "x" * 1000 for i in range(50)}})
    message = str(excinfo.value)
    assert len(message) <= 4000
    # Each line is cut at 300 characters, so the huge extra-properties line ends with "...".
    lines = message.splitlines()
    assert all(len(line) <= 302 for line in lines[1:])
    assert lines[1].endswith("...")


def test_more_than_twenty_errors_are_summarised() -> None:
    names = [f"p{i:02d}" for i in range(25)]
    schema = {"type": "object", "properties": {n: {"type": "integer"} for n in names}}

    @tool(effect="pure", input_schema=schema)
    def f() -> None: ...

    with pytest.raises(ToolInputError) as excinfo:
        f.validate({n: "x" for n in names})
    lines = str(excinfo.value).splitlines()
    assert len(lines) == 1 + 20 + 1
    assert lines[-1] == "- ... and 5 more errors"


def test_function_exceptions_propagate() -> None:
    @tool(effect="pure")
    def boom(a: int) -> None:
        raise RuntimeError(f"boom {a}")

    with pytest.raises(RuntimeError, match="boom 7"):
        boom.invoke({"a": 7})


# --------------------------------------------------------------------------- enum round trip


def test_enum_values_are_converted_back_to_members() -> None:
    seen: list[Any] = []

    @tool(effect="idempotent")
    def paint(color: Color, level: Level, maybe: Color | None = None) -> str:
        seen.extend([color, level, maybe])
        return color.name

    assert paint.invoke({"color": "blue", "level": 2, "maybe": "red"}) == "BLUE"
    assert seen == [Color.BLUE, Level.HIGH, Color.RED]
    assert type(seen[0]) is Color
    assert type(seen[1]) is Level

    seen.clear()
    paint.invoke({"color": "red", "level": 1, "maybe": None})
    assert seen == [Color.RED, Level.LOW, None]

    with pytest.raises(
        ToolInputError, match=r"input\.color: 'green' is not one of \['red', 'blue'\]"
    ):
        paint.invoke({"color": "green", "level": 1})


def test_enum_inside_list_and_tuple_is_converted() -> None:
    @tool(effect="pure")
    def f(colors: list[Color], pair: tuple[int, Color]) -> tuple[list[Color], tuple[int, Color]]:
        return colors, pair

    assert f.invoke({"colors": ["red", "blue"], "pair": [1, "red"]}) == (
        [Color.RED, Color.BLUE],
        (1, Color.RED),
    )


def test_enum_conversion_with_explicit_schema_reports_bad_values() -> None:
    @tool(effect="pure", input_schema={"type": "object"})
    def f(color: Color) -> Color:
        return color

    assert f.invoke({"color": "red"}) is Color.RED
    with pytest.raises(ToolInputError, match=r"input\.color: 'green' is not a valid Color"):
        f.invoke({"color": "green"})


def test_invoke_checks_the_input_unless_told_it_was_checked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    @tool(effect="pure")
    def double(n: int) -> int:
        """Double n."""
        return n * 2

    with pytest.raises(ToolInputError, match="Invalid input for tool 'double'"):
        double.invoke({"n": "two"})
    checks: list[Any] = []
    real = double.validate

    def counted(value: Any) -> None:
        checks.append(value)
        real(value)

    monkeypatch.setattr(double, "validate", counted)
    assert double.invoke({"n": 2}) == 4
    assert checks == [{"n": 2}]
    # The worker validated the input before it chose how to call the tool: not again.
    assert double.invoke({"n": 3}, validated=True) == 6
    assert checks == [{"n": 2}]
