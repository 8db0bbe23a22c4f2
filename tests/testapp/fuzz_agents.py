"""The agent of the fuzz suite (tests/integration/test_fuzz.py): one echo tool per effect
class, plus tools whose hostile return value (or exception) is chosen by their input, so that a
generated model turn also decides what the tools give back."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, Literal

from durable_agents import Agent, tool

# Any JSON value under "value", nothing else: the schema never walks the value, so a
# 3,000-deep input reaches the runtime's own checks rather than failing in jsonschema.
VALUE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"value": {}},
    "required": ["value"],
    "additionalProperties": False,
}

# The most a build() call produces: a few MB keeps an example well under a second.
MAX_SIZE = 5_000_000


@tool(effect="pure", input_schema=VALUE_SCHEMA)
def echo(value: Any) -> Any:
    """Return the value it was given."""
    return value


@tool(effect="idempotent", input_schema=VALUE_SCHEMA)
def store(value: Any) -> Any:
    """Store a value (idempotent); returns it."""
    return value


@tool(
    effect="non_idempotent",
    input_schema=VALUE_SCHEMA,
)
def send(value: Any, *, idempotency_key: str) -> Any:
    """Send a value once (non-idempotent); returns it."""
    return value


@tool(effect="irreversible", input_schema=VALUE_SCHEMA)
def launch(value: Any, *, idempotency_key: str) -> Any:
    """Launch with a value (irreversible: needs a person's approval); returns it."""
    return value


class FuzzAbort(BaseException):
    """A BaseException that is neither SystemExit nor KeyboardInterrupt, like the ones some
    libraries raise to unwind (gevent's GreenletExit, trio's Cancelled)."""


class UnprintableError(Exception):
    """An exception whose message cannot be rendered."""

    def __str__(self) -> str:
        raise RuntimeError("__str__ of UnprintableError failed")

    def __repr__(self) -> str:
        raise RuntimeError("__repr__ of UnprintableError failed")


class Unprintable:
    """A return value whose str() and repr() raise."""

    def __str__(self) -> str:
        raise RuntimeError("__str__ of Unprintable failed")

    def __repr__(self) -> str:
        raise RuntimeError("__repr__ of Unprintable failed")


def _deep(depth: int, container: str, leaf: Any) -> Any:
    # Built iteratively: a recursive builder would itself hit the recursion limit.
    value = leaf
    for _ in range(depth):
        value = [value] if container == "list" else {"k": value}
    return value


BuildKind = Literal[
    "text",
    "huge",
    "huge_hostile",
    "deep_list",
    "deep_dict",
    "not_json",
    "set",
    "bytes",
    "circular",
    "unprintable",
    "nan",
    "big_int",
    "tuple_keys",
    "hostile_keys",
    "none",
]
BUILD_KINDS: tuple[str, ...] = BuildKind.__args__  # type: ignore[attr-defined]


def _circular(size: int, text: str) -> Any:
    loop: list[Any] = [text]
    loop.append(loop)
    return loop


def _big_int(size: int, text: str) -> Any:
    # More digits than int -> str allows by default (4,300): json.dumps raises ValueError.
    return 10 ** min(size, 20_000)


# One builder per kind, each given the call's size and text.
_BUILDERS: dict[str, Callable[[int, str], Any]] = {
    "text": lambda size, text: text,
    "huge": lambda size, text: "x" * size,
    "huge_hostile": lambda size, text: ("a\x00\ud800" * (size // 3 + 1))[:size],
    "deep_list": lambda size, text: _deep(size, "list", text),
    "deep_dict": lambda size, text: _deep(size, "dict", text),
    "not_json": lambda size, text: object(),
    "set": lambda size, text: {1, 2, text},
    "bytes": lambda size, text: b"\x00\xff" + text.encode("utf-8", "surrogatepass"),
    "circular": _circular,
    "unprintable": lambda size, text: Unprintable(),
    "nan": lambda size, text: {"nan": float("nan"), "inf": float("inf")},
    "big_int": _big_int,
    "tuple_keys": lambda size, text: {(1, 2): text},
    "hostile_keys": lambda size, text: {f"k\x00{text}": "v\ud800", "\udfff": text},
    "none": lambda size, text: None,
}


@tool(effect="pure")
def build(kind: BuildKind, size: int = 0, text: str = "") -> Any:
    """Return a value of the given kind and size (a hostile tool result)."""
    if not 0 <= size <= MAX_SIZE:
        raise ValueError(f"size must be between 0 and {MAX_SIZE}")
    return _BUILDERS.get(kind, _BUILDERS["none"])(size, text)


EXCEPTIONS: dict[str, type[BaseException]] = {
    "ValueError": ValueError,
    "RuntimeError": RuntimeError,
    "KeyError": KeyError,
    "RecursionError": RecursionError,
    "MemoryError": MemoryError,
    "TimeoutError": TimeoutError,
    "UnicodeError": UnicodeError,
    "UnprintableError": UnprintableError,
    "SystemExit": SystemExit,
    "KeyboardInterrupt": KeyboardInterrupt,
    "GeneratorExit": GeneratorExit,
    "FuzzAbort": FuzzAbort,
    "BaseException": BaseException,
}
EXCEPTION_NAMES: tuple[str, ...] = (*EXCEPTIONS, "sys.exit", "encode")


@tool(effect="pure")
def fail(exc: str, message: str = "") -> str:
    """Raise the named exception with the message."""
    if exc == "sys.exit":
        sys.exit(message)
    if exc == "encode":
        # A UnicodeEncodeError from the tool's own code, its message holding the surrogate.
        return (message + "\ud800").encode("utf-8").decode("utf-8")
    raise EXCEPTIONS.get(exc, ValueError)(message)


FUZZ_TOOLS = [echo, store, send, launch, build, fail]
FUZZ_TOOL_NAMES: tuple[str, ...] = tuple(t.name for t in FUZZ_TOOLS)

fuzzer = Agent(
    name="fuzzer",
    version="v1",
    model="claude-fuzz-1",
    system="You are the fuzz agent: every turn you take is generated to be hostile.",
    tools=FUZZ_TOOLS,
    max_tokens=1024,
    max_turns=8,
)

# The same with thinking: the offline model signs every turn, so the history it is sent back
# (hostile names and inputs included) must be replayed byte-identical.
fuzz_thinker = Agent(
    name="fuzz_thinker",
    version="v1",
    model="claude-fuzz-1",
    system="You are the fuzz agent that thinks first.",
    tools=FUZZ_TOOLS,
    max_tokens=2048,
    thinking={"type": "enabled", "budget_tokens": 1024},
    max_turns=8,
)
