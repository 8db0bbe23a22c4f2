"""Old positional calls of the public operations, kept working with a ``DeprecationWarning``.

``@keyword_options("run_id", "user", "text")`` on ``answer_question(run_id, text, *, user, ...)``
names the positional parameters the function took before its options became keyword-only.
A call that binds to the current signature goes straight through; a call that binds only to
the old one (``answer_question(run_id, user, "yes")``) warns, naming the call and the
keywords to pass, and is passed on with those arguments as keywords. A call that fits
neither raises the ``TypeError`` of the current signature.

Works on ``async def`` operations too (the warning is raised when the coroutine runs).
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")

# When a deprecated call stops working (docs/upgrading.md: two minor releases after the one
# that deprecated it).
REMOVED_IN = "0.3"


def keyword_options(*old_positional: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Keep positional calls in the order ``old_positional`` working, with a warning."""

    def decorate(func: Callable[P, R]) -> Callable[P, R]:
        signature = inspect.signature(func)
        params = list(signature.parameters.values())
        for name in old_positional:
            if name not in signature.parameters:
                raise TypeError(f"{func.__name__} has no parameter {name!r}")
        old = signature.replace(
            parameters=[
                *(
                    signature.parameters[name].replace(kind=inspect.Parameter.POSITIONAL_OR_KEYWORD)
                    for name in old_positional
                ),
                *(
                    p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
                    for p in params
                    if p.name not in old_positional
                ),
            ]
        )

        def modern(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
            try:
                signature.bind(*args, **kwargs)
            except TypeError:
                pass
            else:
                return args, kwargs
            try:
                bound = old.bind(*args, **kwargs)
            except TypeError:
                return args, kwargs  # fits neither: the call raises the current TypeError
            # What the call passed by position that the function now takes by keyword only.
            moved = [
                name
                for name in old_positional[: len(args)]
                if signature.parameters[name].kind is inspect.Parameter.KEYWORD_ONLY
            ]
            keywords = ", ".join(f"{name}=" for name in moved)
            warnings.warn(
                f"{func.__name__}(): pass {keywords} by keyword; passing "
                f"{'it' if len(moved) == 1 else 'them'} positionally is deprecated and stops "
                f"working in durable_agents {REMOVED_IN}",
                DeprecationWarning,
                stacklevel=3,  # warn, modern, the wrapper: the caller's line
            )
            return (), dict(bound.arguments)

        if inspect.iscoroutinefunction(func):

            @functools.wraps(func)
            async def awrapper(*args: Any, **kwargs: Any) -> Any:
                args, kwargs = modern(args, kwargs)
                return await func(*args, **kwargs)

            return awrapper  # type: ignore[return-value]

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            args, kwargs = modern(args, kwargs)
            return func(*args, **kwargs)

        return wrapper

    return decorate
