"""The errors durable_agents raises to its users, under one base: ``DurableAgentsError``.

``except DurableAgentsError`` catches every error that is ours. Each error also keeps the
builtin class it had before the base existed (``AgentNotFound`` is still a ``LookupError``,
``ToolInputError`` and ``Unstorable`` are still ``ValueError``), so code that catches the builtin
goes on working.

Where they live:

- here: ``AgentNotFound`` (no agent under that name or version), ``ToolInputError`` (a tool's
  input does not match its schema), ``Unstorable`` (a value that cannot be stored or sent as
  it is), ``StoredValueError`` (a stored value that cannot be read back), ``NotMigrated``
  (the database lacks durable_agents' migrations), ``DefinitionError`` (a tool declared
  wrongly), ``CronExpressionError`` (a cron expression schedules do not take); their old
  modules (``agents``, ``tools``, ``text``) re-export the first three;
- ``durable_agents.llm.errors``: ``ModelError`` and its ``PermanentModelError``,
  ``TransientModelError`` and ``ModelCallInterrupted`` (what a model call ends in);
- ``durable_agents.store.base``: ``WaitRefused`` (a wait or a spawn that cannot be done as
  asked).

Those two define their errors themselves so that this module imports nothing of the package
and, of Django, only ``DatabaseError`` and ``ImproperlyConfigured`` (which need no settings):
importing it never loads the SDK, the store or the app registry.

``durable_agents.Wait`` is deliberately *not* a ``DurableAgentsError``. It is not an error but
the way tool code parks its run, and it must reach the runtime: a tool that wraps its helpers
in ``except DurableAgentsError`` (to turn our errors into a message for the model) would
otherwise swallow the wait and never park. The runtime's own control-flow exceptions (the
runner's and the call threads') are private and never reach user code.
"""

from __future__ import annotations

from collections.abc import Sequence

from django.core.exceptions import ImproperlyConfigured
from django.db.utils import DatabaseError

__all__ = [
    "AgentNotFound",
    "CronExpressionError",
    "DefinitionError",
    "DurableAgentsError",
    "NotMigrated",
    "StoredValueError",
    "ToolInputError",
    "Unstorable",
]


class DurableAgentsError(Exception):
    """The base of every error durable_agents raises to its users."""


class AgentNotFound(DurableAgentsError, LookupError):
    """No agent is registered under the name (or name and version) asked for."""


class ToolInputError(DurableAgentsError, ValueError):
    """The model's input for a tool does not match the tool's schema (the model can retry)."""


class Unstorable(DurableAgentsError, ValueError):
    """A value from outside that cannot be stored or sent as it is. The message completes
    "the value ...": "nests deeper than 100 levels", "is not JSON-serialisable: ..."."""


class StoredValueError(DurableAgentsError, ValueError):
    """A value stored in the database cannot be read back: its column holds text that does not
    decode (invalid JSON written by hand or by a bug, a row encrypted under a key that is
    gone). ``column`` names it (``agent_run.woken_by``), ``problem`` says what is wrong.

    The engine treats a run it cannot read as poison: it is dead-lettered with this message
    rather than retried, so that one bad row never stops a worker or a sweep."""

    # The decoder's message is cut to this many characters: it may quote the stored text.
    MAX_PROBLEM = 300

    def __init__(self, column: str, problem: str) -> None:
        problem = " ".join(str(problem).split())
        if len(problem) > self.MAX_PROBLEM:
            problem = problem[: self.MAX_PROBLEM] + "..."
        self.column = column
        self.problem = problem
        super().__init__(f"{column} cannot be decoded: {problem}")


class NotMigrated(DurableAgentsError, DatabaseError):
    """The database lacks durable_agents' tables, or some of its migrations: ``manage.py
    migrate`` was not run (on a new project, or after an upgrade). The message says which and
    to run it; ``alias`` names the database, ``unapplied`` the migrations it lacks
    (``"durable_agents.0001_initial"``, ...), in the order ``migrate`` applies them.

    The public API raises it from the database's own error (its ``__cause__``: "relation
    agent_run does not exist", "no such table: agent_run"), and only once a statement failed:
    no call that works asks the database anything more. It is still a Django
    ``DatabaseError``, which is what code around those calls caught before."""

    def __init__(self, alias: str, unapplied: Sequence[str]) -> None:
        self.alias = alias
        self.unapplied = list(unapplied)
        ours = [name for name in self.unapplied if name.startswith("durable_agents.")]
        what = (
            "has no durable_agents tables"
            if "durable_agents.0001_initial" in ours
            else f"lacks the migration {(ours or self.unapplied or ['?'])[0]}"
        )
        super().__init__(
            f"the database {alias!r} {what} ({len(self.unapplied)} unapplied migration(s) that "
            "durable_agents needs): run `manage.py migrate` first."
        )

    def __reduce__(self) -> tuple[type[NotMigrated], tuple[str, list[str]]]:
        # Rebuilt from its fields, not from its message (a task queue, a process pool).
        return type(self), (self.alias, self.unapplied)


class DefinitionError(DurableAgentsError, ImproperlyConfigured, ValueError):
    """A tool declared wrongly (``@tool`` without its effect, an effect that does not exist, a
    name the API refuses, ...): raised when its module is imported, by the decorator. The
    message names the function, its module, the file and line of the declaration, and how to
    write it.

    Raised while Django imports the apps' ``agents.py`` (``manage.py``, a web server's
    start), it is printed as that one message rather than with the traceback of the apps
    loading, whose only useful line was its last. It is an ``ImproperlyConfigured``, like the
    errors of an ``Agent(...)`` declared wrongly, and still the ``ValueError`` it was."""


class CronExpressionError(DurableAgentsError, ValueError):
    """A cron expression that schedules do not take, from ``durable_agents.schedule`` and the
    schedules' admin form: not five fields (six are refused: schedules have no seconds), an
    unknown ``@`` macro, an expression that does not parse or fires on no day of the next five
    years. Still the ``ValueError`` that ``schedule()`` raised for a bad cron before.

    ``code`` says which, for a caller that words it its own way (the admin translates it):
    ``"six_fields"``, ``"field_count"``, ``"unknown_macro"``, ``"unreadable"``,
    ``"never_fires"``, ``"not_text"``."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code

    def __reduce__(self) -> tuple[type[CronExpressionError], tuple[str, str]]:
        return type(self), (str(self), self.code)
