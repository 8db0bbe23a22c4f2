"""The errors durable_agents raises to its users, under one base: ``DurableAgentsError``.

``except DurableAgentsError`` catches every error that is ours. Each error also keeps the
builtin class it had before the base existed (``AgentNotFound`` is still a ``LookupError``,
``ToolInputError`` and ``Unstorable`` are still ``ValueError``), so code that catches the builtin
goes on working.

Every one of them is defined here and importable from here; the modules that raise them
import them from here, and some name them too (``durable_agents.llm.ModelError``,
``durable_agents.store.base.WaitRefused``, ...: the same classes). The tree::

    DurableAgentsError
    ├── DurableAgentsValueError (also ValueError): a value the call does not take
    │   ├── InvalidArgument: an argument of a public operation that it does not take
    │   ├── RunNotFound (also LookupError): no run with that id
    │   ├── SpawnRefused: a child run that cannot be started (limits, its parent is over)
    │   ├── ForkRefused: a fork that cannot be made as asked
    │   ├── RunFinished: a message sent to a run that has ended
    │   ├── RunBusy: a message refused (``policy="reject"``) by a run that is working
    │   └── BadEventId: an ``after=`` / ``Last-Event-ID`` that is not an event id of the run
    ├── AgentNotFound (also LookupError)
    ├── ToolInputError (also ValueError)
    ├── Unstorable (also ValueError)
    ├── StoredValueError (also ValueError)
    │   └── UndecryptableValue
    ├── InvalidKey (also ValueError)
    ├── CronExpressionError (also ValueError)
    ├── DefinitionError (also ImproperlyConfigured, ValueError)
    ├── NotMigrated (also django.db.DatabaseError)
    ├── WaitRefused: a wait or a spawn that cannot be done as asked (the message is the model's)
    ├── ReplayError: a run that cannot be replayed
    └── ModelError: a model call that did not produce a turn
        ├── PermanentModelError
        ├── TransientModelError
        │   └── CredentialsRefused
        └── ModelCallInterrupted

Each error also keeps the builtin class it had before (``except ValueError`` and ``except
LookupError`` still catch what they caught). Defining them all here keeps this module a leaf:
it imports nothing of the package and, of Django, only ``DatabaseError`` and
``ImproperlyConfigured`` (which need no settings), so importing it never loads the SDK, the
store or the app registry.

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
    "BadEventId",
    "CredentialsRefused",
    "CronExpressionError",
    "DefinitionError",
    "DurableAgentsError",
    "DurableAgentsValueError",
    "ForkRefused",
    "InvalidArgument",
    "InvalidKey",
    "ModelCallInterrupted",
    "ModelError",
    "NotMigrated",
    "PermanentModelError",
    "ReplayError",
    "ResultTimeout",
    "RunBusy",
    "RunFinished",
    "RunNotFound",
    "SpawnRefused",
    "StoredValueError",
    "ToolInputError",
    "TransientModelError",
    "UndecryptableValue",
    "Unstorable",
    "WaitRefused",
    "WorkerIdInUse",
]


class DurableAgentsError(Exception):
    """The base of every error durable_agents raises to its users."""


class DurableAgentsValueError(DurableAgentsError, ValueError):
    """A value that a call of ours does not take. Also a ``ValueError``: what these errors
    were before they had a base, so ``except ValueError`` still catches them."""


class InvalidArgument(DurableAgentsValueError):
    """An argument of a public operation that it does not take (a bad key, priority, task,
    model name, event, answer, ...): the message says which and why. Nothing was written."""


class WorkerIdInUse(DurableAgentsError):
    """A worker was started with the id of a live worker (``runagents --worker-id``): two
    processes under one id would renew each other's leases. The message names the live one."""


class RunNotFound(DurableAgentsValueError, LookupError):
    """No run has the id asked for (a ``LookupError``, and the ``ValueError`` it was)."""


class ResultTimeout(DurableAgentsError, TimeoutError):
    """``get_result(..., timeout=)`` passed before the run ended; the run was left alone. Also
    a ``TimeoutError``."""


class SpawnRefused(DurableAgentsValueError):
    """``spawn_run`` cannot start the child: it would pass ``MAX_RUN_DEPTH``,
    ``MAX_CHILD_RUNS`` or ``MAX_TREE_RUNS``, or its parent is over. Nothing was created."""


class ForkRefused(DurableAgentsValueError):
    """A fork that cannot be made as asked; the message says why. Nothing was created."""


class RunFinished(DurableAgentsValueError):
    """A message sent to a run that has ended (``send_message``): the message says how it
    ended; start a new run, or fork this one. Nothing was queued."""


class RunBusy(DurableAgentsValueError):
    """``send_message(..., policy="reject")`` to a run that is working (pending or running):
    the client sends one message at a time. Nothing was queued."""


class BadEventId(DurableAgentsValueError):
    """An ``after=`` / ``Last-Event-ID`` that is not an event id of this run."""


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


class InvalidKey(DurableAgentsError, ValueError):
    """A key of ENCRYPTION_KEYS is not the urlsafe base64 of 32 bytes. The message never
    holds the key."""


class UndecryptableValue(StoredValueError):
    """A stored value that cannot be decrypted: its key is not in ENCRYPTION_KEYS any more,
    or the text was altered. Names the column and the key id, never a key or the value.

    A ``StoredValueError``: the engine treats the run that holds it as poison, like any other
    value it cannot read back."""

    def __init__(self, column: str, key: str, why: str) -> None:
        problem = f"encrypted with key id {key}, {why}"
        super().__init__(column, problem)
        # The message reads as the sentence it always was (the problem is short: no cut).
        self.args = (f"{column} is {problem}",)
        self.key_id = key

    def __str__(self) -> str:
        return str(self.args[0])


class WaitRefused(DurableAgentsError):
    """A wait or a spawn that cannot be done as asked; the message is for the model."""


class ReplayError(DurableAgentsError):
    """The run cannot be replayed: it does not exist, or its agent version is not registered."""


class ModelError(DurableAgentsError):
    """A model call that did not produce a turn."""

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        request_id: str | None = None,
        retry_after: float | None = None,
        rate_headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.status = status
        self.request_id = request_id
        # What the server asked: seconds before asking again, and its rate-limit headers.
        self.retry_after = retry_after
        self.rate_headers = rate_headers or {}

    @property
    def rate_limited(self) -> bool:
        """A 429: this organisation is over a rate limit (not the run's fault)."""
        return self.status == 429

    @property
    def overloaded(self) -> bool:
        """A 529: the API is busy for everyone (not the run's fault either)."""
        return self.status == 529


class PermanentModelError(ModelError):
    """Retrying cannot help (400, 404 retired model, 413, 422): the run goes to the dead letter."""


class TransientModelError(ModelError):
    """Retries inside this claim ran out (rate limits, overload, outages, auth)."""


class CredentialsRefused(TransientModelError):
    """The API refused the credentials (401, 403), or the client had none to send: not the
    run's fault, and no retry of this claim can help. The run is handed back uncounted and the
    worker pauses its claims (``durable_agents.engine.credentials``)."""


class ModelCallInterrupted(ModelError):
    """The run was cancelled, its lease lost, or the worker is stopping. Raised while waiting
    to retry, its ``retry_after`` is what is left of the wait the server asked for."""
