"""Options that became keyword-only: old positional calls still work, with a DeprecationWarning
that names the call and the keywords to pass."""

# The old positional calls are made on purpose: the type checker rightly refuses them.
# mypy: disable-error-code="call-arg, arg-type, misc"

from __future__ import annotations

import asyncio
import inspect
import warnings
from typing import Any

import pytest
from django.core.exceptions import PermissionDenied

from durable_agents import api
from durable_agents._internal.deprecation import keyword_options
from durable_agents.exceptions import InvalidArgument


@keyword_options("run_id", "user", "text")
def answer(run_id: str, text: str, *, user: Any, question_id: int | None = None) -> tuple[Any, ...]:
    return run_id, text, user, question_id


@keyword_options("run_id", "at_seq", "edit", "user")
def fork(run_id: str, at_seq: int, *, edit: Any = None, user: Any = None) -> tuple[Any, ...]:
    return run_id, at_seq, edit, user


@keyword_options("run_id", "user", "text")
async def aanswer(run_id: str, text: str, *, user: Any) -> tuple[Any, ...]:
    return run_id, text, user


def test_a_call_of_the_current_signature_does_not_warn() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert answer("r", "yes", user="ann") == ("r", "yes", "ann", None)
        assert answer(run_id="r", text="yes", user="ann", question_id=3) == ("r", "yes", "ann", 3)
        assert fork("r", 2, edit="e") == ("r", 2, "e", None)


def test_an_old_positional_call_warns_and_is_passed_on_as_keywords() -> None:
    with pytest.warns(DeprecationWarning, match="answer") as caught:
        assert answer("r", "ann", "yes") == ("r", "yes", "ann", None)
    message = str(caught[0].message)
    assert message.startswith("answer(): pass user= by keyword; passing it positionally is")
    assert caught[0].filename == __file__  # the caller's line, not the decorator's
    with pytest.warns(DeprecationWarning, match=r"fork\(\): pass edit=, user= by keyword"):
        assert fork("r", 2, "e", "ann") == ("r", 2, "e", "ann")
    # The old order with the later arguments by keyword.
    with pytest.warns(DeprecationWarning, match=r"pass user= by keyword"):
        assert answer("r", "ann", text="yes", question_id=4) == ("r", "yes", "ann", 4)


def test_a_call_that_fits_neither_raises_the_current_type_error() -> None:
    with pytest.raises(TypeError, match="user"):
        answer("r", "yes")
    with pytest.raises(TypeError):
        fork("r", 2, "e", "ann", "extra")


def test_async_operations_keep_their_kind_and_warn_too() -> None:
    assert inspect.iscoroutinefunction(aanswer)
    with pytest.warns(DeprecationWarning, match=r"aanswer\(\): pass user= by keyword"):
        assert asyncio.run(aanswer("r", "ann", "yes")) == ("r", "yes", "ann")


def test_the_signature_shown_is_the_current_one() -> None:
    assert list(inspect.signature(answer).parameters) == ["run_id", "text", "user", "question_id"]
    assert inspect.signature(answer).parameters["user"].kind is inspect.Parameter.KEYWORD_ONLY


def test_an_unknown_old_name_is_refused_when_declared() -> None:
    with pytest.raises(TypeError, match="no parameter 'who'"):
        keyword_options("run_id", "who")(answer.__wrapped__)  # type: ignore[attr-defined]


# The operations of the API: their old positional calls warn and do what they did (these fail
# before the database: no permission, a bad model name).


@pytest.mark.parametrize(
    ("call", "keywords"),
    [
        (lambda: api.approve_intent(1, None), "user="),
        (lambda: api.reject_intent(1, None, "no"), "user=, reason="),
        (lambda: api.resolve_intent(1, None, happened=True), "user="),
        (lambda: api.answer_question("r", None, "yes"), "user="),
    ],
    ids=["approve_intent", "reject_intent", "resolve_intent", "answer_question"],
)
def test_old_positional_calls_of_the_api_warn(call: Any, keywords: str) -> None:
    with (
        pytest.warns(DeprecationWarning, match=f"pass {keywords} by keyword"),
        pytest.raises(PermissionDenied),
    ):
        call()


def test_an_old_positional_fork_run_warns() -> None:
    with (
        pytest.warns(DeprecationWarning, match=r"fork_run\(\): pass edit=, version=, model="),
        pytest.raises(InvalidArgument, match="a model name cannot be empty"),
    ):
        api.fork_run("r", 0, None, None, "")
