"""Tools: plain Python functions the model may call, declared with ``@tool(effect=...)``.

The effect tells the runtime how careful it must be when a step is replayed after a crash:

* ``pure``: reads only; safe to call again at any time.
* ``idempotent``: writes, but calling it twice with the same input is the same as once.
* ``non_idempotent``: writes that must not happen twice; the function receives an
  ``idempotency_key`` (declare a parameter of that name) that it passes to the remote system.
* ``irreversible``: cannot be undone or deduplicated; needs a human approval before it runs.

``retry=Retry(...)`` (``declare/retries.py``) tries a call's transient failures again before
the model is told; any class but ``irreversible`` may have one.

This module never imports Django models: it is imported by every ``agents.py`` at app loading.
"""

from __future__ import annotations

import copy
import enum
import functools
import inspect
import json
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jsonschema

from durable_agents.declare.context import RunContext
from durable_agents.declare.retries import Retry
from durable_agents.exceptions import DefinitionError, ToolInputError

__all__ = [
    "EFFECTS",
    "EffectClass",
    "Tool",
    "ToolInputError",
    "schema_from_signature",
    "tool",
]


class EffectClass(enum.StrEnum):
    """What running a tool again would do: nothing (pure), the same (idempotent, or
    non-idempotent given the same idempotency key), or something only a person may allow."""

    PURE = "pure"
    IDEMPOTENT = "idempotent"
    NON_IDEMPOTENT = "non_idempotent"
    IRREVERSIBLE = "irreversible"

    @property
    def rerun_is_free(self) -> bool:
        """Running the call again cannot repeat a side effect."""
        return self in (EffectClass.PURE, EffectClass.IDEMPOTENT)


EFFECTS: tuple[str, ...] = tuple(e.value for e in EffectClass)

# The parameter that receives the runtime's key; it is never part of the model-facing schema.
IDEMPOTENCY_KEY = "idempotency_key"
# The parameter that receives what ended a ``Wait`` the call raised (None on the first call);
# never part of the schema either.
WOKEN_BY = "woken_by"
# Parameters the runtime fills in, never the model.
RUNTIME_PARAMETERS = (IDEMPOTENCY_KEY, WOKEN_BY)


def run_context_parameter(
    func: Callable[..., Any], hints: Mapping[str, Any] | None = None
) -> str | None:
    """The name of ``func``'s parameter annotated ``RunContext`` (the runtime fills it in, never
    the model), or None. Found by its annotation, whatever its name: a parameter named ``run``
    of another type is an ordinary parameter. More than one is a definition error."""
    signature = inspect.signature(func)
    if hints is None:
        try:
            hints = typing.get_type_hints(func, include_extras=True)
        except Exception:  # noqa: BLE001 - unresolvable hints: read the raw annotations
            hints = {}
    found = []
    for name, param in signature.parameters.items():
        hint = hints.get(name, param.annotation)
        if typing.get_origin(hint) is typing.Annotated:
            hint = typing.get_args(hint)[0]
        if typing.get_origin(hint) in (typing.Union, types.UnionType):
            # ``RunContext | None`` (with a default of None: a direct call may leave it out)
            others = [arg for arg in typing.get_args(hint) if arg is not type(None)]
            hint = others[0] if len(others) == 1 else hint
        if hint is RunContext or hint == "RunContext":
            found.append(name)
    if len(found) > 1:
        raise _definition_error(
            func, f"only one parameter may be a RunContext; {', '.join(found)} are"
        )
    if found and found[0] in RUNTIME_PARAMETERS:
        raise _definition_error(func, f"{found[0]!r} is filled in by the runtime; not a RunContext")
    return found[0] if found else None


# What the Messages API accepts as a tool name.
_NAME_RE = re.compile(r"^[a-zA-Z0-9_-]{1,128}$")

# Caps on validation messages: they go back to the model, which needs the gist, not a dump.
_MAX_ERRORS = 20
_MAX_ERROR_CHARS = 300
_MAX_MESSAGE_CHARS = 4000

_ARGS_HEADERS = ("Args:", "Arguments:")
_ARG_LINE_RE = re.compile(r"^\*{0,2}(?P<name>\w+)\s*(?:\([^)]*\))?\s*:\s*(?P<text>.*)$")


# --------------------------------------------------------------------------- docstrings


def _split_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """Return the description without its Google-style ``Args:`` section, and that section.

    The parameter descriptions belong in the schema; keeping them in the tool description too
    would only spend tokens twice.
    """
    if not doc:
        return "", {}
    lines = inspect.cleandoc(doc).splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip() in _ARGS_HEADERS), None)
    if start is None:
        return "\n".join(lines).strip(), {}

    header_indent = _indent(lines[start])
    end = start + 1
    while end < len(lines) and (not lines[end].strip() or _indent(lines[end]) > header_indent):
        end += 1

    params: dict[str, str] = {}
    entry_indent: int | None = None
    current: str | None = None
    for line in lines[start + 1 : end]:
        if not line.strip():
            continue
        indent = _indent(line)
        if entry_indent is None:
            entry_indent = indent
        match = _ARG_LINE_RE.match(line.strip()) if indent <= entry_indent else None
        if match:
            current = match.group("name")
            params[current] = match.group("text").strip()
        elif current is not None:
            # A continuation line of the current entry.
            params[current] = f"{params[current]} {line.strip()}".strip()

    rest = lines[:start] + lines[end:]
    description = re.sub(r"\n{3,}", "\n\n", "\n".join(rest)).strip()
    return description, {name: text for name, text in params.items() if text}


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


# --------------------------------------------------------------------------- schemas


def _json_type(value: Any) -> str | None:
    # bool before int: True is an int in Python but a boolean in JSON.
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return None


def _enum_schema(values: list[Any]) -> dict[str, Any]:
    schema: dict[str, Any] = {}
    kinds = {_json_type(v) for v in values}
    if len(kinds) == 1 and None not in kinds:
        schema["type"] = kinds.pop()
    schema["enum"] = values
    return schema


def _is_union(origin: Any) -> bool:
    return origin is typing.Union or origin is types.UnionType


def _type_schema(hint: Any, where: str) -> dict[str, Any]:
    """JSON schema of one type hint; ``where`` names the parameter in error messages."""
    bare = _bare_schema(hint)
    if bare is not None:
        return bare
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is typing.Annotated:
        return _annotated_schema(args, where)
    if origin is typing.Literal:
        return _enum_schema([v.value if isinstance(v, enum.Enum) else v for v in args])
    if _is_union(origin):
        return _union_schema(args, where)
    if origin in (list, set, frozenset, Sequence):
        return _array_schema(origin, args, where)
    if origin is tuple:
        return _tuple_schema(args, where)
    if origin in (dict, Mapping):
        return _object_schema(args, where)
    raise TypeError(
        f"{where}: unsupported type hint {hint!r} for a tool parameter; use str, int, float, "
        "bool, list, tuple, dict, Literal, an Enum, a union of those, or pass input_schema="
    )


def _bare_schema(hint: Any) -> dict[str, Any] | None:
    """The schema of a hint that takes no arguments (``int``, ``list``, an Enum...), or None
    for one that does (``list[int]``, ``Literal[...]``...)."""
    if hint is inspect.Parameter.empty or hint is Any:
        return {}
    if hint is None or hint is type(None):
        return {"type": "null"}
    if hint is bool:
        return {"type": "boolean"}
    if hint is int:
        return {"type": "integer"}
    if hint is float:
        return {"type": "number"}
    if hint is str:
        return {"type": "string"}
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return _enum_schema([member.value for member in hint])
    if hint in (list, tuple):
        return {"type": "array"}
    if hint in (set, frozenset):
        return {"type": "array", "uniqueItems": True}
    if hint is dict:
        return {"type": "object"}
    return None


def _annotated_schema(args: tuple[Any, ...], where: str) -> dict[str, Any]:
    """``Annotated[X, "note", ...]``: X's schema, the string notes as its description."""
    schema = _type_schema(args[0], where)
    notes = [a for a in args[1:] if isinstance(a, str)]
    if notes:
        schema["description"] = " ".join(notes)
    return schema


def _union_schema(args: tuple[Any, ...], where: str) -> dict[str, Any]:
    # Optional[X] and X | None: null goes last, whatever order the union was written in.
    arms = [a for a in args if a is not type(None)]
    schemas = [_type_schema(a, where) for a in arms]
    if len(arms) < len(args):
        schemas.append({"type": "null"})
    return {"anyOf": schemas}


def _array_schema(origin: Any, args: tuple[Any, ...], where: str) -> dict[str, Any]:
    """``list[X]``, ``set[X]``, ``frozenset[X]``, ``Sequence[X]``."""
    schema: dict[str, Any] = {"type": "array"}
    if args and (items := _type_schema(args[0], where)):
        schema["items"] = items
    if origin in (set, frozenset):
        schema["uniqueItems"] = True
    return schema


def _tuple_schema(args: tuple[Any, ...], where: str) -> dict[str, Any]:
    """``tuple[()]``, ``tuple[X, ...]`` or ``tuple[X, Y, ...]`` of a fixed length."""
    if not args or args == ((),):
        return {"type": "array"} if not args else {"type": "array", "maxItems": 0}
    if len(args) == 2 and args[1] is Ellipsis:
        items = _type_schema(args[0], where)
        return {"type": "array", "items": items} if items else {"type": "array"}
    return {
        "type": "array",
        "prefixItems": [_type_schema(a, where) for a in args],
        "minItems": len(args),
        "maxItems": len(args),
    }


def _object_schema(args: tuple[Any, ...], where: str) -> dict[str, Any]:
    """``dict[str, X]`` and ``Mapping[str, X]``."""
    schema: dict[str, Any] = {"type": "object"}
    if args:
        if args[0] not in (str, Any):
            # JSON object keys are always strings: the function would not get what it says.
            raise TypeError(f"{where}: dict keys must be str in a tool signature, not {args[0]!r}")
        if values := _type_schema(args[1], where):
            schema["additionalProperties"] = values
    return schema


def _qualname(func: Callable[..., Any]) -> str:
    return str(getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func)))


# What each effect says about calling the tool again, as the error of a missing or unknown
# effect explains them.
EFFECT_MEANINGS = {
    "pure": "reads only",
    "idempotent": "writes, and twice is the same as once",
    "non_idempotent": "writes that must not happen twice; it receives an idempotency_key",
    "irreversible": "cannot be undone; a person approves each call first",
}


def _how_to_declare() -> str:
    meanings = ", ".join(f'"{effect}" ({EFFECT_MEANINGS[effect]})' for effect in EFFECTS)
    return (
        'Write @tool(effect="pure") above it, with the effect that says what calling it '
        f"again would do: {meanings}."
    )


def _definition_error(func: Callable[..., Any], problem: str) -> DefinitionError:
    """``tool lookup in shop.agents (/srv/shop/agents.py, line 12): <problem>``: the
    function, its module and the line of its declaration, so that the message alone (with no
    traceback) says where to look."""
    where = _qualname(func)
    module = getattr(func, "__module__", None)
    if module:
        where += f" in {module}"
    code = getattr(func, "__code__", None)
    if code is not None:
        # The first line of a decorated function's code is its first decorator's.
        where += f" ({code.co_filename}, line {code.co_firstlineno})"
    return DefinitionError(f"tool {where}: {problem}")


def _check_signature(func: Callable[..., Any]) -> inspect.Signature:
    signature = inspect.signature(func)
    for param in signature.parameters.values():
        if param.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            raise TypeError(
                f"unsupported signature for tool {_qualname(func)}: *args and **kwargs cannot "
                "be described to the model; declare each parameter by name"
            )
        if param.kind is inspect.Parameter.POSITIONAL_ONLY:
            raise TypeError(
                f"unsupported signature for tool {_qualname(func)}: positional-only parameter "
                f"{param.name!r}; the model passes arguments by name"
            )
    return signature


def _hints(func: Callable[..., Any]) -> dict[str, Any]:
    try:
        return typing.get_type_hints(func, include_extras=True)
    except Exception as exc:  # NameError from an unresolved forward reference, mostly.
        raise TypeError(f"cannot resolve the type hints of tool {_qualname(func)}: {exc}") from exc


def _json_default(value: Any) -> tuple[bool, Any]:
    if isinstance(value, enum.Enum):
        value = value.value
    try:
        # Round trip so that tuples become lists, exactly as the schema will be serialised.
        return True, json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError):
        return False, None


def schema_from_signature(func: Callable[..., Any]) -> dict[str, Any]:
    """Derive the tool input JSON schema from ``func``'s parameters and type hints."""
    signature = _check_signature(func)
    hints = _hints(func)
    _, arg_docs = _split_docstring(func.__doc__)
    context_name = run_context_parameter(func, hints)

    properties: dict[str, Any] = {}
    required: list[str] = []
    for name, param in signature.parameters.items():
        if name in RUNTIME_PARAMETERS or name == context_name:
            continue
        where = f"tool {_qualname(func)}, parameter {name!r}"
        schema = _type_schema(hints.get(name, inspect.Parameter.empty), where)
        if name in arg_docs and "description" not in schema:
            schema["description"] = arg_docs[name]
        if param.default is inspect.Parameter.empty:
            required.append(name)
        else:
            ok, default = _json_default(param.default)
            if ok:
                schema["default"] = default
        properties[name] = schema
    return {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }


# --------------------------------------------------------------------------- input coercion


def _coerce(hint: Any, value: Any) -> Any:
    """Turn JSON values back into the Python types the hint promises (Enum members, tuples)."""
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return value if isinstance(value, hint) else hint(value)
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is typing.Annotated:
        return _coerce(args[0], value)
    if _is_union(origin):
        if value is None:
            return None
        enums = [a for a in args if isinstance(a, type) and issubclass(a, enum.Enum)]
        for cls in enums:
            try:
                return cls(value)
            except ValueError:
                continue
        return value
    if origin is list and args and isinstance(value, list):
        return [_coerce(args[0], v) for v in value]
    if origin in (set, frozenset) and isinstance(value, list):
        return origin(_coerce(args[0], v) for v in value) if args else origin(value)
    if hint in (set, frozenset) and isinstance(value, list):
        return hint(value)
    if (origin is tuple or hint is tuple) and isinstance(value, list):
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(args[0], v) for v in value)
        if args and len(args) == len(value):
            return tuple(_coerce(a, v) for a, v in zip(args, value, strict=True))
        return tuple(value)
    if origin is dict and len(args) == 2 and isinstance(value, dict):
        return {k: _coerce(args[1], v) for k, v in value.items()}
    return value


def _needs_coercion(hint: Any) -> bool:
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return True
    if hint in (tuple, set, frozenset):
        return True
    origin = typing.get_origin(hint)
    if origin in (tuple, set, frozenset):
        return True
    return any(_needs_coercion(a) for a in typing.get_args(hint) if a is not Ellipsis)


# --------------------------------------------------------------------------- Tool


def _path(error: jsonschema.ValidationError, root: str = "input") -> str:
    out = root
    for part in error.absolute_path:
        if isinstance(part, int):
            out += f"[{part}]"
        elif re.fullmatch(r"[A-Za-z_]\w*", part):
            out += f".{part}"
        else:
            out += f"[{json.dumps(part)}]"
    return out


def _leaf_errors(error: jsonschema.ValidationError, root: str = "input") -> list[tuple[str, str]]:
    """(path, message) pairs for one error, paths from ``root``. "Not valid under any of the
    given schemas" tells the model nothing: use the errors of the one arm whose type matches
    the value, or list the types when no arm's type matches."""
    if error.validator not in ("anyOf", "oneOf") or not error.context:
        return [(_path(error, root), error.message)]
    arms: dict[Any, list[jsonschema.ValidationError]] = {}
    for sub in error.context:
        arms.setdefault(sub.schema_path[0], []).append(sub)
    same_path = list(error.absolute_path)

    def type_mismatch(e: jsonschema.ValidationError) -> bool:
        return e.validator == "type" and list(e.absolute_path) == same_path

    candidates = [errs for errs in arms.values() if not any(map(type_mismatch, errs))]
    if len(candidates) == 1:
        return [leaf for sub in candidates[0] for leaf in _leaf_errors(sub, root)]
    if not candidates and len(arms) == len(error.validator_value):
        expected: list[str] = []
        for errs in arms.values():
            for e in errs:
                if type_mismatch(e):
                    kinds = (
                        e.validator_value
                        if isinstance(e.validator_value, list)
                        else [e.validator_value]
                    )
                    expected.extend(k for k in kinds if k not in expected)
        listed = ", ".join(repr(k) for k in expected)
        return [(_path(error, root), f"{error.instance!r} is not of type {listed}")]
    return [(_path(error, root), error.message)]


def _cap(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _check_options(func: Callable[..., Any], effect: str, timeout: object, retry: object) -> None:
    """``@tool``'s timeout and retry policy, checked at definition."""
    if timeout is not None and (
        isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0
    ):
        raise _definition_error(func, "timeout must be a positive number of seconds")
    if retry is not None and not isinstance(retry, Retry):
        raise _definition_error(
            func, f"retry takes a Retry(attempts=..., backoff=..., on=...), not {retry!r}"
        )
    if retry is not None and effect == EffectClass.IRREVERSIBLE:
        raise _definition_error(
            func,
            "an irreversible tool is never retried: a person approves each execution, and a "
            "failed one is the model's to handle; remove retry=",
        )


def _input_schema(func: Callable[..., Any], given: object) -> dict[str, Any]:
    """The tool's input schema: the one given (checked, a private copy: the definition is
    fingerprinted and must not change under us), else derived from the signature."""
    if given is None:
        return schema_from_signature(func)
    if not isinstance(given, dict):
        raise TypeError(f"tool {_qualname(func)}: input_schema must be a dict")
    try:
        jsonschema.Draft202012Validator.check_schema(given)
    except jsonschema.SchemaError as exc:
        raise _definition_error(func, f"invalid input_schema: {exc.message}") from exc
    return copy.deepcopy(given)


class Tool:
    """A function the model may call, with its effect and the JSON schema of its input."""

    def __init__(
        self,
        func: Callable[..., Any],
        *,
        effect: str,
        name: str | None = None,
        description: str | None = None,
        input_schema: dict[str, Any] | None = None,
        timeout: float | None = None,
        retry: Retry | None = None,
    ) -> None:
        if not callable(func):
            raise TypeError(f"@tool decorates a function, not {func!r}")
        if effect not in EFFECTS:
            raise _definition_error(func, f"{effect!r} is not an effect. {_how_to_declare()}")
        signature = _check_signature(func)
        _check_options(func, effect, timeout, retry)

        self.func = func
        # Seconds one call may take (None: the agent's tool_timeout, else TOOL_TIMEOUT).
        self.timeout = timeout
        # How its failures are tried again before the model is told (None: never). Not part
        # of what the model is shown, so neither of the agent's fingerprint nor of its digests.
        self.retry = retry
        self.effect = EffectClass(effect)
        # ``async def`` tools are awaited on the worker's event loop, not run on a thread.
        self.is_async = inspect.iscoroutinefunction(func)
        self.name = name if name is not None else func.__name__
        if not isinstance(self.name, str) or not _NAME_RE.match(self.name):
            raise _definition_error(
                func,
                f"name {self.name!r} must be 1 to 128 letters, digits, '_' or '-' (the "
                "Messages API rejects anything else)",
            )
        doc_description, _ = _split_docstring(func.__doc__)
        self.description = doc_description if description is None else description

        self.input_schema = _input_schema(func, input_schema)

        self.takes_idempotency_key = IDEMPOTENCY_KEY in signature.parameters
        self._key_has_default = (
            self.takes_idempotency_key
            and signature.parameters[IDEMPOTENCY_KEY].default is not inspect.Parameter.empty
        )
        self.takes_woken_by = WOKEN_BY in signature.parameters
        # The parameter annotated RunContext, if any: it gets the run the call belongs to.
        self.run_context_parameter = run_context_parameter(func)
        self._context_has_default = (
            self.run_context_parameter is not None
            and signature.parameters[self.run_context_parameter].default
            is not inspect.Parameter.empty
        )
        self._validator = jsonschema.Draft202012Validator(self.input_schema)

        # Hints only matter for turning JSON back into Enum members and tuples. With an explicit
        # schema, unresolvable hints are tolerated: the user took over the schema on purpose.
        try:
            hints = _hints(func)
        except TypeError:
            if input_schema is None:
                raise
            hints = {}
        self._coercions: dict[str, Any] = {
            n: h for n, h in hints.items() if n in signature.parameters and _needs_coercion(h)
        }
        # No __dict__ merge: a function attribute must not shadow name, effect or schema.
        functools.update_wrapper(self, func, updated=())

    def definition(self) -> dict[str, Any]:
        """The tool as sent to the Messages API (a fresh copy: callers may mutate it)."""
        return {
            "name": self.name,
            "description": self.description,
            "input_schema": copy.deepcopy(self.input_schema),
        }

    def validate(self, tool_input: Any) -> None:
        """Raise ``ToolInputError`` with a model-readable message if the input is invalid."""
        prefix = f"Invalid input for tool {self.name!r}"
        if not isinstance(tool_input, dict):
            raise ToolInputError(
                f"{prefix}: input must be a JSON object, got {type(tool_input).__name__}"
            )
        errors = sorted(
            leaf for e in self._validator.iter_errors(tool_input) for leaf in _leaf_errors(e)
        )
        if not errors:
            return
        lines = [_cap(f"{path}: {msg}", _MAX_ERROR_CHARS) for path, msg in errors[:_MAX_ERRORS]]
        if len(errors) > _MAX_ERRORS:
            lines.append(f"... and {len(errors) - _MAX_ERRORS} more errors")
        message = f"{prefix}:\n" + "\n".join(f"- {line}" for line in lines)
        raise ToolInputError(_cap(message, _MAX_MESSAGE_CHARS))

    def invoke(
        self,
        tool_input: dict[str, Any],
        *,
        idempotency_key: str | None = None,
        woken_by: dict[str, Any] | None = None,
        run_context: RunContext | None = None,
        validated: bool = False,
    ) -> Any:
        """Validate the model's input, then call the function with it (and with the runtime's
        ``idempotency_key``, ``woken_by`` and ``RunContext``, for a function that declares
        them). ``validated=True``: ``validate`` accepted this input already (the worker checks
        it before it decides how to call the tool, and not twice)."""
        if not validated:
            self.validate(tool_input)
        kwargs = dict(tool_input)
        if self.run_context_parameter is not None:
            if self.run_context_parameter in kwargs:
                raise ToolInputError(
                    f"Invalid input for tool {self.name!r}: {self.run_context_parameter!r} is "
                    "set by the runtime, not by the model"
                )
            if run_context is not None:
                kwargs[self.run_context_parameter] = run_context
            elif not self._context_has_default:
                raise TypeError(f"tool {self.name!r} needs a RunContext")
        if self.takes_woken_by:
            if WOKEN_BY in kwargs:
                raise ToolInputError(
                    f"Invalid input for tool {self.name!r}: {WOKEN_BY!r} is set by the "
                    "runtime, not by the model"
                )
            kwargs[WOKEN_BY] = woken_by
        for name, hint in self._coercions.items():
            if name in kwargs:
                try:
                    kwargs[name] = _coerce(hint, kwargs[name])
                except ValueError as exc:  # An explicit schema let a bad enum value through.
                    raise ToolInputError(
                        f"Invalid input for tool {self.name!r}: input.{name}: {exc}"
                    ) from exc
        if self.takes_idempotency_key:
            if IDEMPOTENCY_KEY in kwargs:
                raise ToolInputError(
                    f"Invalid input for tool {self.name!r}: {IDEMPOTENCY_KEY!r} is set by the "
                    "runtime, not by the model"
                )
            if idempotency_key is not None:
                kwargs[IDEMPOTENCY_KEY] = idempotency_key
            elif not self._key_has_default:
                # Calling a non-idempotent tool without a key would make duplicates undetectable.
                raise TypeError(f"tool {self.name!r} needs an idempotency_key")
        return self.func(**kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.func(*args, **kwargs)

    def __repr__(self) -> str:
        return (
            f"<Tool {self.name} effect={self.effect} "
            f"func={getattr(self.func, '__module__', '?')}.{_qualname(self.func)}>"
        )


# What ``@tool(effect=...)`` takes, spelled out so that a type checker catches a misspelt effect.
EffectName = typing.Literal["pure", "idempotent", "non_idempotent", "irreversible"]


@typing.overload
def tool(
    func: None = None,
    /,
    *,
    effect: EffectName | EffectClass,
    name: str | None = None,
    description: str | None = None,
    input_schema: dict[str, Any] | None = None,
    timeout: float | None = None,
    retry: Retry | None = None,
) -> Callable[[Callable[..., Any]], Tool]: ...


@typing.overload
def tool(
    func: Callable[..., Any],
    /,
    *,
    effect: EffectName | EffectClass | None = None,
    name: str | None = None,
    description: str | None = None,
    input_schema: dict[str, Any] | None = None,
    timeout: float | None = None,
    retry: Retry | None = None,
) -> typing.NoReturn: ...


def tool(
    func: Callable[..., Any] | None = None,
    /,
    *,
    effect: str | None = None,
    name: str | None = None,
    description: str | None = None,
    input_schema: dict[str, Any] | None = None,
    timeout: float | None = None,
    retry: Retry | None = None,
) -> Callable[[Callable[..., Any]], Tool]:
    """Declare a tool: ``@tool(effect="pure")`` above a function with type hints."""

    def decorate(f: Callable[..., Any]) -> Tool:
        if effect is None:
            raise _definition_error(f, f"missing effect. {_how_to_declare()}")
        return Tool(
            f,
            effect=effect,
            name=name,
            description=description,
            input_schema=input_schema,
            timeout=timeout,
            retry=retry,
        )

    if func is not None:
        # Bare ``@tool``: the effect is never optional, so say how to fix it.
        if effect is None:
            decorate(func)
        raise TypeError("use @tool(effect=...) with keyword arguments, not @tool or tool(func)")
    return decorate
