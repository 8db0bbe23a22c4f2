"""Every error raised to users is a DurableAgentsError and still the builtin class it was, and
the old import paths keep giving the same class."""

from __future__ import annotations

import pickle

import pytest
from django.db import DatabaseError

from durable_agents import llm
from durable_agents._internal import text
from durable_agents.declare import agents, tools
from durable_agents.declare.waits import Wait
from durable_agents.exceptions import (
    AgentNotFound,
    DurableAgentsError,
    NotMigrated,
    ToolInputError,
    Unstorable,
)
from durable_agents.llm import errors as llm_errors
from durable_agents.store import base as store_base

PUBLIC_ERRORS = [
    (AgentNotFound, LookupError),
    (ToolInputError, ValueError),
    (Unstorable, ValueError),
    (llm.ModelError, Exception),
    (llm.PermanentModelError, llm.ModelError),
    (llm.TransientModelError, llm.ModelError),
    (llm.ModelCallInterrupted, llm.ModelError),
    (store_base.WaitRefused, Exception),
]


@pytest.mark.parametrize(("error", "builtin"), PUBLIC_ERRORS, ids=lambda e: e.__name__)
def test_public_errors_share_the_base_and_keep_their_builtin(
    error: type[Exception], builtin: type[Exception]
) -> None:
    assert issubclass(error, DurableAgentsError)
    assert issubclass(error, builtin)
    raised = error("message") if error is not llm.ModelError else error("message", status=400)
    with pytest.raises(builtin):
        raise raised
    with pytest.raises(DurableAgentsError):
        raise raised


def test_old_import_paths_give_the_same_classes() -> None:
    assert agents.AgentNotFound is AgentNotFound
    assert tools.ToolInputError is ToolInputError
    assert text.Unstorable is Unstorable
    assert llm.ModelError is llm_errors.ModelError


def test_the_registry_raises_agent_not_found_as_both() -> None:
    with pytest.raises(DurableAgentsError):
        agents.AgentRegistry().get("nobody")
    with pytest.raises(LookupError):
        agents.AgentRegistry().get("nobody")


def test_wait_is_not_an_error_of_ours() -> None:
    # Tool code that catches our errors must never swallow the wait that parks its run.
    assert not issubclass(Wait, DurableAgentsError)
    assert issubclass(Wait, Exception)


def test_not_migrated_is_ours_and_still_a_database_error() -> None:
    error = NotMigrated("default", ["durable_agents.0001_initial", "durable_agents.0002_x"])
    assert isinstance(error, DurableAgentsError)
    assert isinstance(error, DatabaseError)
    assert str(error) == (
        "the database 'default' has no durable_agents tables (2 unapplied migration(s) that "
        "durable_agents needs): run `manage.py migrate` first."
    )
    later = NotMigrated("default", ["durable_agents.0018_schedule"])
    assert "lacks the migration durable_agents.0018_schedule" in str(later)
    # Rebuilt whole when it crosses a process (a task queue).
    copy = pickle.loads(pickle.dumps(later))
    assert (type(copy), copy.alias, copy.unapplied, str(copy)) == (
        NotMigrated,
        "default",
        ["durable_agents.0018_schedule"],
        str(later),
    )
