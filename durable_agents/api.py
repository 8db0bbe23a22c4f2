"""The operations on runs and intents. The admin, the demo and user code all go through
these functions; none of them re-implements a transition. The transitions themselves are
the store's (``durable_agents.store``); signals and permission checks are here.

Each public operation that reads or writes the tables raises ``NotMigrated`` ("run
`manage.py migrate` first") when the database refuses it for lack of durable_agents'
migrations (``migration_state.explains_missing_tables``).

Each operation a view or other async code calls has an async twin, ``a<name>``, the same
operation run in Django's thread for database work (``astart_run``, ``afork_run``,
``aapprove_intent``, ...). Those without one, and why:

- ``spawn_run``: called only from tool code, which runs in a worker's thread, never in an
  event loop;
- ``made_transition``: reads the object it is given, no database;
- ``check_priority``, ``check_task``: check a value, no database.

Options are keyword-only: only the arguments that say what the call is about are positional
(``fork_run(run_id, at_seq, *, edit=..., user=...)``), and ``user`` is a keyword everywhere.
A positional call of the old kind still works, with a ``DeprecationWarning``
(``durable_agents._internal.deprecation``).

Errors: a bad argument is an ``InvalidArgument``, a run that does not exist a ``RunNotFound``,
a child run that cannot be started a ``SpawnRefused``, a fork that cannot be made a
``ForkRefused``: all ``DurableAgentsValueError`` (``durable_agents.exceptions``), so still the
``ValueError`` they were."""

from __future__ import annotations

import dataclasses
import json
import math
import uuid
from collections.abc import Iterable
from decimal import Decimal
from typing import Any, Protocol, TypeAlias

from asgiref.sync import sync_to_async
from django.core.exceptions import PermissionDenied, ValidationError
from django.db import IntegrityError
from django.db.models import Model

from durable_agents import observers, signals
from durable_agents._internal.deprecation import keyword_options
from durable_agents._internal.migration_state import explains_missing_tables
from durable_agents._internal.text import Unstorable, check_depth, has_unstorable, storable_text
from durable_agents.conf import app_settings
from durable_agents.declare import waits
from durable_agents.declare.agents import registry
from durable_agents.engine import effects
from durable_agents.engine.history import rebuild_messages
from durable_agents.exceptions import InvalidArgument, RunNotFound, SpawnRefused
from durable_agents.flow import budgets
from durable_agents.forks import planning as forks
from durable_agents.forks import upgrades
from durable_agents.forks.upgrades import UpgradeReport
from durable_agents.models import (
    MAX_START_KEY,
    AgentEvent,
    AgentMessage,
    AgentQuestion,
    AgentRun,
    IntentStatus,
    QuestionStatus,
    RunStatus,
    ToolIntent,
    new_run_id,
)
from durable_agents.models.trees import FamilyCost, family_cost
from durable_agents.results import aget_result, get_result
from durable_agents.store import current
from durable_agents.store.base import RunId, WaitRefused
from durable_agents.store.concurrency import check_concurrency_key
from durable_agents.store.transitions import made_transition as _made_transition

__all__ = [
    "ADD_RUN_PERMISSION",
    "ANSWER_PERMISSION",
    "APPROVE_PERMISSION",
    "BUDGET_PERMISSION",
    "FORK_PERMISSION",
    "MAX_DEBOUNCE_SECONDS",
    "MAX_PRIORITY",
    "MIN_PRIORITY",
    "UPGRADE_PERMISSION",
    "VIEW_RUN_PERMISSION",
    "JSONValue",
    "Person",
    "UpgradeReport",
    "aanswer_question",
    "aapprove_intent",
    "acancel_run",
    "acarry_over_runs",
    "afork_run",
    "aget_result",
    "amessages_for",
    "answer_question",
    "approve_intent",
    "areject_intent",
    "arequeue_run",
    "aresolve_intent",
    "asend_event",
    "asend_message",
    "aset_key_budget",
    "aset_key_limit",
    "astart_run",
    "atree_cost",
    "aupgrade_runs",
    "cancel_run",
    "carry_over_runs",
    "fork_run",
    "get_result",
    "made_transition",
    "messages_for",
    "reject_intent",
    "requeue_run",
    "resolve_intent",
    "send_event",
    "send_message",
    "set_key_budget",
    "set_key_limit",
    "spawn_run",
    "start_run",
    "tree_cost",
    "upgrade_runs",
]

APPROVE_PERMISSION = "durable_agents.approve_toolintent"
FORK_PERMISSION = "durable_agents.fork_agentrun"
# A fork reads the run it is made from; a fork with an edited task starts a run of one's own.
VIEW_RUN_PERMISSION = "durable_agents.view_agentrun"
ADD_RUN_PERMISSION = "durable_agents.add_agentrun"
# The longest model name (the column agent_run.model).
MAX_MODEL_NAME = 200
ANSWER_PERMISSION = "durable_agents.answer_question"


class Person(Protocol):
    """Who decides an intent, answers a question or sends an event: ``request.user`` (a user
    of ``AUTH_USER_MODEL``, or ``AnonymousUser``, which holds no permission) or any user object
    with Django's permission check."""

    def has_perm(self, perm: str, obj: Model | None = ...) -> bool: ...


# The JSON a payload or a result may be: what ``json.dumps`` accepts.
JSONValue: TypeAlias = Any


# A run's priority: a small number of levels, like a queue's (not a timestamp).
MIN_PRIORITY, MAX_PRIORITY = 0, 100


@explains_missing_tables
def start_run(
    agent: str,
    task: str,
    *,
    version: str | None = None,
    model: str | None = None,
    key: str | None = None,
    priority: int = 0,
    concurrency_key: str | None = None,
    debounce: float | None = None,
    metadata: dict[str, Any] | None = None,
    batch: bool | None = None,
) -> AgentRun:
    """Create a pending run pinned to the agent's version, model and fingerprint, with its
    task as step 0. Raises ``AgentNotFound`` for an unknown agent or version.

    ``key`` makes the start idempotent: while a run of this agent started with this key exists,
    whatever its status (pending, running, waiting, succeeded, failed, dead, cancelled), calling
    again with the key returns that run and starts nothing, however many callers race on any
    number of workers. A web view that starts a run per request passes a key the client sends
    again when it retries (a ticket's id, an order number), so a retry gets the run the first
    attempt started. The first call's task wins (unless the run is debounced, below): a later
    call with the same key returns the first run unchanged, even if its task (or version, model
    or priority) differs. Keys are per agent: the same key under two agents starts two runs. A
    key is free again only once its run is deleted (``RETENTION_DAYS`` after it ended). A key is
    a non-empty string of at most 200 characters without NUL or lone surrogates. Called inside a
    transaction of yours, that transaction must be READ COMMITTED (the default): under
    REPEATABLE READ or SERIALIZABLE a caller that loses the race cannot see the winner's run,
    and gets the ``IntegrityError`` instead.

    ``priority``: 0 (the default) to 100; workers claim the highest first, then the oldest.

    ``concurrency_key`` (e.g. ``"tenant:acme"``): at most the key's limit of runs with this key
    run at once, across every worker: ``CONCURRENCY_LIMITS[key]`` if set, else the agent's
    ``concurrency_limit``, else no limit. A pending or waiting run holds no slot; the others
    wait pending for one. Within a priority, claims go fairly across keys: a key with a
    thousand runs queued does not hold back one that starts ten a little later. The run's
    child runs have its key. A concurrency key is a non-empty string of at most 200
    characters without NUL.

    ``debounce`` (seconds, with ``key``): starts with the same agent and key within the window
    collapse into one run, started once the key has been quiet for ``debounce`` seconds, with
    the last call's task. The first call returns the new run, ``waiting`` for its quiet window
    (``waiting_for == "debounce"``, ``wake_at`` ``debounce`` seconds from now on the database
    clock; no worker takes it before). A later call while it still waits returns the same run
    (same id) and starts its window again, ``debounce`` seconds from now (the later call's
    ``debounce``), with the later call's task, version, model, priority and concurrency key:
    until the run starts, the last call wins, and no model has seen the task before. Once a
    worker has claimed the run (or it was cancelled, or ended), a call with the key behaves
    as ``key=`` alone: it returns that run and changes nothing. A call without ``debounce``
    whose key belongs to a run still in its window returns that run unchanged too. A debounced
    run is cancelled like any other run (``cancel_run``). ``debounce`` is a number of seconds
    greater than 0 and at most ``MAX_DEBOUNCE_SECONDS`` (one day); it needs a ``key``.

    ``metadata``: a JSON object the product attaches to the run (``{"tenant": "acme",
    "order": 42}``), stored on it as given (``run.metadata``), passed to its tools
    (``RunContext.metadata``) and searchable: ``AgentRun.objects.with_metadata(tenant="acme")``
    and the admin's runs list. It is stored in the clear, even under ``ENCRYPTION_KEYS``: no
    secrets in it. Its child runs and its forks have it too. At most 64 kB as JSON, 100 levels
    deep, without NUL or lone surrogates. A debounced call replaces it, as it does the task.

    ``batch``: send the run's model turns through Message Batches (True), or directly
    (False); None (the default) does as its agent says (``Agent(batch=...)``). A turn in a
    batch costs half and arrives within hours (at most a day); the run waits for it without a
    worker (``waiting_for == "batch"``), and does not stream, even when its agent does.

    A bad key, priority, concurrency key, debounce or metadata is an ``InvalidArgument`` (a
    ``ValueError``), and nothing is created."""
    options = _start_options(key, priority, concurrency_key, debounce, metadata, batch)
    run = _new_run(agent, task, version, model)
    for field, value in options.items():
        setattr(run, field, value)
    task_payload = json.dumps(task, ensure_ascii=False)
    if debounce is not None:
        return current().debounce_run(run, task_payload, float(debounce))
    return current().create_run(run, task_payload)


def _start_options(
    key: str | None,
    priority: int,
    concurrency_key: str | None,
    debounce: float | None,
    metadata: dict[str, Any] | None,
    batch: bool | None,
) -> dict[str, Any]:
    """The run's fields ``start_run``'s options set, each checked (``InvalidArgument``) before
    anything is created."""
    options: dict[str, Any] = {
        "metadata": {} if metadata is None else check_metadata(metadata),
        "start_key": key,
        "priority": priority,
        "concurrency_key": concurrency_key,
    }
    if key is not None:
        _check_start_key(key)
    if debounce is not None:
        _check_debounce(debounce, key)
    check_priority(priority)
    if concurrency_key is not None:
        check_concurrency_key(concurrency_key)
    if batch is not None:
        options["batch"] = _checked_batch(batch)
    return options


# The longest quiet window ``start_run(..., debounce=)`` takes: one day. A longer one is more
# likely a unit mistake (milliseconds for seconds) than a wish, and would leave the run waiting
# that long unseen.
MAX_DEBOUNCE_SECONDS = 86_400


def _checked_batch(batch: object) -> bool:
    if not isinstance(batch, bool):
        raise InvalidArgument(f"batch= is True, False or None, not {type(batch).__name__}")
    return batch


def _check_debounce(debounce: object, key: str | None) -> None:
    if key is None:
        raise InvalidArgument("debounce= collapses the starts of one key: it needs key= too")
    # bool is an int to Python, but True is no number of seconds.
    if isinstance(debounce, bool) or not isinstance(debounce, int | float):
        raise InvalidArgument(f"debounce= is a number of seconds, not {type(debounce).__name__}")
    if not math.isfinite(debounce) or debounce <= 0:
        raise InvalidArgument(
            f"debounce= is a positive, finite number of seconds, not {debounce!r}"
        )
    if debounce > MAX_DEBOUNCE_SECONDS:
        raise InvalidArgument(
            f"debounce= is at most {MAX_DEBOUNCE_SECONDS} seconds (one day), not {debounce!r}"
        )


def _check_start_key(key: object) -> None:
    if not isinstance(key, str) or not key.strip():
        raise InvalidArgument("a start key must be a non-empty string")
    if len(key) > MAX_START_KEY:
        raise InvalidArgument(
            f"a start key has at most {MAX_START_KEY} characters; this one has {len(key)}"
        )
    if has_unstorable(key):
        raise InvalidArgument("a start key cannot contain NUL characters or lone surrogates")


def check_priority(priority: object) -> None:
    # bool is an int to Python, but True is no priority level.
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise InvalidArgument(f"a priority is an int, not {type(priority).__name__}")
    if not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        raise InvalidArgument(
            f"a priority is between {MIN_PRIORITY} and {MAX_PRIORITY} inclusive, not {priority}"
        )


def _check_model(model: object) -> None:
    """A model name given to ``start_run``: it is sent to the API, shown in the admin and
    used as a metric label, so it is a short printable string."""
    if not isinstance(model, str):
        raise InvalidArgument(f"a model name is a string, not {type(model).__name__}")
    if not model.strip():
        raise InvalidArgument("a model name cannot be empty")
    if len(model) > MAX_MODEL_NAME:
        raise InvalidArgument(
            f"a model name has at most {MAX_MODEL_NAME} characters; this one has {len(model)}"
        )
    if has_unstorable(model) or not model.isprintable():
        raise InvalidArgument("a model name cannot contain control characters or lone surrogates")


# The largest metadata a run takes, as compact UTF-8 JSON: it is read with every run the admin
# lists and every claim, so it holds identifiers (a tenant, a user, an order), not documents.
MAX_METADATA_BYTES = 64 * 1024


def check_metadata(metadata: object) -> dict[str, Any]:
    """The run metadata ``metadata`` as it will be stored (a copy), or ``InvalidArgument``
    saying what is wrong: not a dict of JSON values (str keys; str, int, float, bool, None,
    list and dict values), a number JSON cannot hold (NaN, infinity), deeper than
    ``MAX_DEPTH`` levels, larger than ``MAX_METADATA_BYTES`` as JSON, or a NUL or lone
    surrogate in a key or a string."""
    if not isinstance(metadata, dict):
        raise InvalidArgument(f"metadata is a dict, not {type(metadata).__name__}")
    try:
        check_depth(metadata)
    except Unstorable as exc:
        raise InvalidArgument(f"metadata {exc}") from None
    stack: list[tuple[str, Any]] = [("metadata", metadata)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, dict):
            for key, item in value.items():
                if not isinstance(key, str):
                    raise InvalidArgument(
                        f"{where} has a key of type {type(key).__name__}: keys are strings"
                    )
                if has_unstorable(key):
                    raise InvalidArgument(
                        f"{where} has a key with a NUL character or a lone surrogate"
                    )
                stack.append((f"{where}[{key!r}]", item))
        elif isinstance(value, list):
            stack.extend((f"{where}[{i}]", item) for i, item in enumerate(value))
        elif isinstance(value, str):
            if has_unstorable(value):
                raise InvalidArgument(f"{where} has a NUL character or a lone surrogate")
        elif isinstance(value, float):
            if not math.isfinite(value):
                raise InvalidArgument(f"{where} is {value!r}, which JSON cannot hold")
        elif value is not None and not isinstance(value, (bool, int)):
            raise InvalidArgument(
                f"{where} is a {type(value).__name__}, not a JSON value (str, int, float, "
                "bool, None, list or dict)"
            )
    text = json.dumps(metadata, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    size = len(text.encode("utf-8"))
    if size > MAX_METADATA_BYTES:
        raise InvalidArgument(
            f"metadata is at most {MAX_METADATA_BYTES} bytes as JSON; this is {size}"
        )
    copied: dict[str, Any] = json.loads(text)
    return copied


def check_task(task: object) -> None:
    if not isinstance(task, str) or not task.strip():
        raise InvalidArgument("a run needs a non-empty task")
    if has_unstorable(task):
        # The database cannot store NUL, nor UTF-8 encode a lone surrogate: say so now rather
        # than fail inside the INSERT.
        raise InvalidArgument("a task cannot contain NUL characters or lone surrogates")


def _new_run(agent: str, task: str, version: str | None, model: str | None) -> AgentRun:
    check_task(task)
    if model is not None:
        _check_model(model)
    definition = registry.get(agent, version)
    pinned_model = model or definition.model
    return AgentRun(
        id=new_run_id(),
        agent=definition.name,
        prompt_version=definition.version,
        model=pinned_model,
        fingerprint=definition.fingerprint(pinned_model),
        task=task,
        # Every claim of the run joins the caller's trace (a child run: its parent's tool call).
        trace_context=observers.trace_context(),
        concurrency_limit=definition.concurrency_limit,
        batch=definition.batch,
    )


@explains_missing_tables
def spawn_run(
    agent: str,
    task: str,
    *,
    key: str,
    version: str | None = None,
    model: str | None = None,
    metadata: dict[str, Any] | None = None,
) -> AgentRun:
    """Start a child run of the run whose tool calls this, once per ``key``: calling it again
    with the same key (after a crash, or on the call's wake) returns the same run. The child
    is an ordinary run (pending), linked to its parent; ``raise Wait(runs=[...])`` waits for
    children to end. Cancelling the parent cancels its unfinished children. The child has its
    parent's priority and concurrency key: a child of an urgent run is urgent too, and a
    tenant's children count toward the tenant's limit. It has its parent's metadata too, unless
    given its own (``metadata=``, checked as ``start_run`` checks it).

    Raises ``RuntimeError`` outside tool code, ``InvalidArgument`` for a bad key or metadata, and
    ``SpawnRefused`` past ``MAX_RUN_DEPTH``, ``MAX_CHILD_RUNS`` or ``MAX_TREE_RUNS`` (the runs
    of the whole tree, its root included), or when the parent is over (both ``ValueError``)."""
    call = waits.current_call()
    if call is None:
        raise RuntimeError(
            "spawn_run starts a child of the run whose tool is running; outside tool code, "
            "use start_run"
        )
    if not isinstance(key, str) or not key or len(key) > 200:
        raise InvalidArgument("spawn_run needs a key: a non-empty string of at most 200 characters")
    depth = call.depth + 1
    if depth > app_settings.MAX_RUN_DEPTH:
        raise SpawnRefused(
            f"a child run would be at depth {depth}; MAX_RUN_DEPTH is {app_settings.MAX_RUN_DEPTH}"
        )
    if metadata is not None:
        child_metadata = check_metadata(metadata)
    else:
        child_metadata = json.loads(json.dumps(call.metadata or {}))
    child = _new_run(agent, task, version, model)
    child.metadata = child_metadata
    child.parent_id = call.run_id
    child.spawn_key = key
    child.depth = depth
    try:
        run, _ = current().spawn_run(
            child,
            json.dumps(task, ensure_ascii=False),
            app_settings.MAX_CHILD_RUNS,
            app_settings.MAX_TREE_RUNS,
        )
    except WaitRefused as exc:
        raise SpawnRefused(str(exc)) from None
    return run


@explains_missing_tables
def send_event(name: str, payload: JSONValue = None, *, user: Person | None = None) -> AgentEvent:
    """Store the event ``name`` with its JSON ``payload`` and wake every run waiting on it
    (``Wait(event=name)``). Stored once: a second send of the same name changes nothing and
    returns the first. A run that starts waiting on it later does not wait at all."""
    _check_event(name, payload)
    event, woken = current().send_event(name, payload, user)
    if woken:
        signals.event_sent.send(sender=AgentEvent, event=event, woken=woken)
    return event


def _check_event(name: object, payload: object) -> None:
    """``send_event``'s arguments, checked before anything is written: each problem is an
    ``InvalidArgument`` that says what is wrong (never the database's or the encoder's error)."""
    problem = waits.event_name_problem(name)
    if problem is not None:
        raise InvalidArgument(f"an event needs a valid name: {problem}")
    try:
        check_depth(payload)
        # As the column stores it: lone surrogates escaped, NaN and infinities refused.
        text = json.dumps(payload, allow_nan=False)
    except Unstorable as exc:
        raise InvalidArgument(f"an event's payload must be JSON: the value {exc}") from None
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidArgument(
            f"an event's payload must be JSON: {storable_text(exc, 300)}"
        ) from None
    size = len(text.encode("utf-8"))  # ASCII: json.dumps escapes everything else
    limit = app_settings.MAX_EVENT_BYTES
    if size > limit:
        raise InvalidArgument(
            f"an event's payload is at most {limit} bytes of JSON (MAX_EVENT_BYTES); "
            f"this one is {size}"
        )


@keyword_options("run_id", "user", "text")
@explains_missing_tables
def answer_question(
    run_id: RunId | str, text: str, *, user: Person | None, question_id: int | None = None
) -> AgentQuestion:
    """Answer the open question of a run (asked with the built-in ``ask_person`` tool): the
    answer, who gave it and when become the tool's result and the run goes on. Needs the
    permission ``durable_agents.answer_question``. ``question_id``: answer that question only
    (the one a person was shown), not whatever the run asks newest. An answered question is
    returned as it is; no such question raises ``AgentQuestion.DoesNotExist``."""
    if user is None or not user.has_perm(ANSWER_PERMISSION):
        raise PermissionDenied(f"answering questions needs the {ANSWER_PERMISSION} permission")
    if not isinstance(text, str) or not text.strip():
        raise InvalidArgument("an answer cannot be empty")
    question = current().answer_question(run_id, user, storable_text(text), question_id)
    if question is None:
        raise AgentQuestion.DoesNotExist(
            f"run {run_id} asked no question"
            + (f" with id {question_id}" if question_id is not None else "")
        )
    if question.status == QuestionStatus.ANSWERED:
        signals.question_answered.send(sender=AgentQuestion, question=question)
    return question


@explains_missing_tables
def cancel_run(run_id: RunId | str) -> bool:
    """Cancel a pending, running or waiting run, with its unfinished descendants (after the
    run itself, in batches of a thousand runs per transaction). Their intents that wait for
    approval are rejected ("run cancelled") and their open questions cancelled, with each
    run's cancel. A worker holding one hears of it at once (PostgreSQL NOTIFY) or at its next
    heartbeat, and its fence refuses any further step. False if the run was already over."""
    cancelled = current().cancel_run(run_id)
    if cancelled:
        signals.run_finished.send(sender=AgentRun, run_id=run_id, status=RunStatus.CANCELLED)
    return cancelled


@explains_missing_tables
def requeue_run(run_id: RunId | str) -> bool:
    """Send a dead run back to pending with a fresh no-progress count; its error stays as
    history until the run progresses."""
    return current().requeue_run(run_id)


# Who may set a concurrency key's budget (the admin's change form of the key asks the same).
BUDGET_PERMISSION = "durable_agents.change_concurrencykey"


@explains_missing_tables
def set_key_budget(
    key: str, usd_per_day: Decimal | float | int | None, *, user: Person | None = None
) -> int:
    """Set concurrency key ``key``'s budget in USD per UTC day, replacing ``BUDGETS``' for it
    (None: ``BUDGETS`` decides again). Budgets hold only keys that ``BUDGETS`` names (or
    covers with ``"*"``): give the key an entry there first. The key's runs waiting for their
    budget go back to the queue at once (a budget still spent parks them again at their next
    call). Returns how many. ``user``, when given, must have the ``change_concurrencykey``
    permission."""
    if user is not None and not user.has_perm(BUDGET_PERMISSION):
        raise PermissionDenied(f"setting a key's budget needs the {BUDGET_PERMISSION} permission")
    check_concurrency_key(key)
    amount = None if usd_per_day is None else budgets.check_amount(usd_per_day)
    return current().set_key_budget(key, amount)


@explains_missing_tables
def set_key_limit(key: str, limit: int | None, *, user: Person | None = None) -> None:
    """Set concurrency key ``key``'s limit (runs of it running at once, fleet-wide), replacing
    ``CONCURRENCY_LIMITS``' and the agents' for it; 0 holds its runs pending; None: they decide
    again. Workers' claims follow within a few seconds. ``user``, when given, must have the
    ``change_concurrencykey`` permission."""
    if user is not None and not user.has_perm(BUDGET_PERMISSION):
        raise PermissionDenied(f"setting a key's limit needs the {BUDGET_PERMISSION} permission")
    check_concurrency_key(key)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise InvalidArgument(f"a concurrency limit is a whole number >= 0 or None, not {limit!r}")
    current().set_key_limit(key, limit)


@keyword_options("run_id", "at_seq", "edit", "version", "model", "user")
@explains_missing_tables
def fork_run(
    run_id: RunId | str,
    at_seq: int,
    *,
    edit: JSONValue = None,
    version: str | None = None,
    model: str | None = None,
    user: Person | None = None,
) -> AgentRun:
    """A new pending run whose log up to step ``at_seq`` is the run's, byte for byte; a worker
    takes it from there. It works on a run in any status (a dead run forked before the step
    that killed it is the everyday use). The fork records its parent (``forked_from``) and
    its fork point (``fork_seq``); its log's shared steps stay the parent's rows.

    ``edit`` replaces the step at ``at_seq``: a string when it is the task, the list of
    tool_result blocks (as Python values) when it is a batch of tool results. A model turn
    cannot be edited: its bytes are signed.

    Calls recorded before the fork point are not run again in the fork; calls after it are
    the fork's own (new idempotency keys, new intents needing new approvals). Calls of the
    fork-point turn that the run did not record keep the run's idempotency keys, so a receiver
    deduplicates a call that may have happened; an irreversible call whose outcome is unknown
    (or that is executing) refuses the fork until a person resolved it. A fork of a child run
    stays in its tree (its limits count it; cancelling the root cancels it).

    ``version`` / ``model``: fork onto another registered version of the agent, or another
    model, when the shared log allows it (signed thinking binds the model, system prompt and
    tools); otherwise ``ForkRefused`` naming the block that binds it.

    ``user``: when given, the fork needs the permissions ``durable_agents.fork_agentrun`` and
    ``durable_agents.view_agentrun`` (a fork reads the run: its task, its tool results), and a
    fork with an edited task ``durable_agents.add_agentrun`` too (it starts a run with a task
    of the user's); ``PermissionDenied`` otherwise. Anything refused raises before anything is
    created: ``RunNotFound`` for a run that does not exist, ``InvalidArgument`` for a bad
    model or version, ``ForkRefused`` for a fork that cannot be made as asked (all three are
    ``ValueError``)."""
    if user is not None:
        _check_fork_permissions(user, edits_task=edit is not None and at_seq == 0)
    if model is not None:
        _check_model(model)
    if version is not None and (not isinstance(version, str) or not version):
        raise InvalidArgument("version= names a registered version of the run's agent")
    try:
        parent = AgentRun.objects.get(pk=run_id)
    except (AgentRun.DoesNotExist, ValidationError, ValueError):
        raise RunNotFound(f"there is no run {storable_text(run_id, 100)!r} to fork") from None
    plan = forks.plan_fork(parent, at_seq, edit, version, model)
    plan.run.trace_context = observers.trace_context()
    write = plan.write
    if plan.run.parent_id is not None:
        write = dataclasses.replace(
            write,
            max_children=app_settings.MAX_CHILD_RUNS,
            max_tree_runs=app_settings.MAX_TREE_RUNS,
        )
    try:
        return current().create_fork(plan.run, write)
    except WaitRefused as exc:
        # A fork of a child run that its tree cannot take (limits, a cancelled tree).
        raise forks.ForkRefused(f"cannot fork run {parent.pk}: {exc}") from None
    except IntegrityError:
        # agent_step_share's foreign key: a run it reads was deleted as the fork was made.
        raise forks.ForkRefused(
            f"run {parent.pk} (or a run it was forked from) was deleted while it was forked"
        ) from None


# Who may move runs to another version of their agent: Django's change permission on runs (the
# admin's run actions ask the same).
UPGRADE_PERMISSION = "durable_agents.change_agentrun"


@explains_missing_tables
def upgrade_runs(
    agent: str,
    from_version: str,
    to_version: str,
    *,
    run_ids: Iterable[RunId | str] | None = None,
    user: Person | None = None,
) -> UpgradeReport:
    """Move runs of ``agent`` in flight from ``from_version`` to ``to_version``, in place, where
    their history allows it: every such run (pending, waiting, or running with an expired
    lease), or those of ``run_ids``. Each keeps its id, log and model; its version and
    fingerprint become the target's, a run waiting for a worker that defines its version is
    claimable at once, and a running run whose lease expired goes back to pending (the worker
    that held it can commit nothing more).

    Refused, each with its reason in ``report.refused`` (the others move): a run whose log
    holds signed thinking (thinking, redacted_thinking) when the target sends another system
    prompt or other tools than the run's version did, or when what that version sent is not
    known here (the reason names the step and content block); a run with an intent pending,
    unknown or executing; a run whose last model turn asks for a tool that the target lacks
    or declares with another effect class or input schema (or when the tools of the run's
    version are not known here); a run a live worker holds (the reason names the worker) or
    is claiming right now ("busy"); and ids of runs that do not exist, are of another agent
    or version, or are over. What the run's version sent is its definition in this process
    when this process defines it with the run's fingerprint, else the ``agent_version``
    record a worker left of it.

    Runs move in batches of 500, each locked and moved in one short transaction fenced as a
    worker's writes are (a run a worker claims meanwhile is refused, never moved under it);
    two upgrades at once move each run once. Every run moved is audited: the
    ``run_upgraded`` signal and a log line (``durable_agents.upgrades``), naming ``user``.

    ``to_version`` must be registered in this process; ``user``, when given, needs the
    ``durable_agents.change_agentrun`` permission (``PermissionDenied`` otherwise). A bad
    argument (an agent or version that is not a non-empty string, the same version twice,
    ``run_ids`` that are not run ids) is an ``InvalidArgument``, raised before anything
    moves."""
    ids = _check_upgrade(agent, from_version, to_version, run_ids, user)
    return upgrades.upgrade(agent, from_version, to_version, ids, user=user)


@explains_missing_tables
def carry_over_runs(
    agent: str,
    from_version: str,
    to_version: str,
    *,
    run_ids: Iterable[RunId | str] | None = None,
    user: Person | None = None,
) -> UpgradeReport:
    """Move dead runs of ``agent`` from ``from_version`` to ``to_version`` and back to pending,
    in one fenced transaction per batch: the runs the dead letter holds because their version
    is not deployed any more (the housekeeping sweep's reason, or the worker's after
    ``MAX_ATTEMPTS`` claims) or drifted (prompt drift), for which a requeue would only die
    again. Every such dead run, or those of ``run_ids``; the history is judged as by
    ``upgrade_runs``, and a dead run that died of anything else is refused (requeue it).
    Audited and checked as ``upgrade_runs`` is."""
    ids = _check_upgrade(agent, from_version, to_version, run_ids, user)
    return upgrades.upgrade(agent, from_version, to_version, ids, carry_over=True, user=user)


def _check_upgrade(
    agent: str, from_version: str, to_version: str, run_ids: object, user: Person | None
) -> list[uuid.UUID] | None:
    """The arguments of ``upgrade_runs``: the run ids as UUIDs (None: every run that can move)."""
    if user is not None and not user.has_perm(UPGRADE_PERMISSION):
        raise PermissionDenied(f"upgrading runs needs the {UPGRADE_PERMISSION} permission")
    labels: dict[str, object] = {
        "agent": agent,
        "from_version": from_version,
        "to_version": to_version,
    }
    for name, value in labels.items():
        if not isinstance(value, str):
            raise InvalidArgument(f"{name} is a string, not {type(value).__name__}")
        if not value.strip():
            raise InvalidArgument(f"{name} cannot be empty")
    if from_version == to_version:
        raise InvalidArgument(
            f"from_version and to_version are both {storable_text(to_version, 100)!r}: an "
            "upgrade moves runs to another version"
        )
    if (agent, to_version) not in registry:
        known = ", ".join(repr(v) for v in registry.versions(agent)) or "none"
        raise InvalidArgument(
            f"agent {storable_text(agent, 100)!r} has no version "
            f"{storable_text(to_version, 100)!r} registered in this process (registered: "
            f"{known}): runs are upgraded to a version the code calling this defines"
        )
    return None if run_ids is None else _run_ids(run_ids)


def _run_ids(run_ids: object) -> list[uuid.UUID]:
    """``run_ids`` as a list of UUIDs without repeats, in their order; ``InvalidArgument``
    for anything that is not an iterable of UUIDs or of their text."""
    if isinstance(run_ids, str | bytes) or not isinstance(run_ids, Iterable):
        raise InvalidArgument(
            f"run_ids is a list of run ids (UUIDs, or their text), not {type(run_ids).__name__}"
        )
    ids: list[uuid.UUID] = []
    for value in run_ids:
        if isinstance(value, uuid.UUID):
            ids.append(value)
            continue
        if isinstance(value, str):
            try:
                ids.append(uuid.UUID(value))
                continue
            except ValueError:
                pass
        raise InvalidArgument(
            f"run_ids holds {storable_text(repr(value), 80)}, which is not a run id (a UUID)"
        )
    return list(dict.fromkeys(ids))


def _check_fork_permissions(user: Person, *, edits_task: bool) -> None:
    """What ``fork_run(..., user=)`` needs (the admin's fork pages ask the same): to fork, to
    see the run it reads, and to start a run when the task is the user's own."""
    needed = [FORK_PERMISSION, VIEW_RUN_PERMISSION]
    if edits_task:
        needed.append(ADD_RUN_PERMISSION)
    missing = [perm for perm in needed if not user.has_perm(perm)]
    if missing:
        what = "forking a run with an edited task" if edits_task else "forking a run"
        raise PermissionDenied(f"{what} needs the {' and '.join(missing)} permission")


# What ``send_message`` does with a run that is working: queue the message (folded at the
# next turn boundary), cut the model call in flight short for it, or refuse it.
MESSAGE_POLICIES = ("queue", "interrupt", "reject")


@explains_missing_tables
def send_message(
    run_id: RunId | str,
    text: str,
    *,
    policy: str = "queue",
    key: str | None = None,
    user: Person | None = None,
) -> AgentMessage:
    """Send a user's message to a run in flight (a second message while the agent works).

    The message waits in the run's inbox (``agent_message``) until the worker holding the run
    reaches its next turn boundary: before its next model call it commits the waiting messages,
    in the order they were sent, as a step of the log (kind ``message``), text blocks after the
    tool results of the same user turn. From then on it is history like any other step: sent
    again byte for byte on every later call, in forks, replays and live streams. Only the
    worker holding the run folds, in the transaction of that step: a worker killed before it
    leaves the message for the next one, after it the message is folded once.

    A pending run gets it before its first model call. A run that waits (a timer, an event, a
    person, an approval, child runs) is not woken by it: the message is folded when the run
    next advances. A run whose model gives its final answer while a message waits goes on
    and answers the message instead of ending. A run that is over (succeeded, failed,
    cancelled, dead) refuses it: ``RunFinished``.

    ``policy``: ``"queue"`` (the default) as above. ``"reject"`` refuses (``RunBusy``) a run
    that is working, pending or running, and queues for a run that waits: for a client that
    sends one message at a time. ``"interrupt"`` queues the message and, when a model call of
    the run is in flight, the worker abandons that call (its turn is never committed: an
    abandoned call returns no usage to record) and calls again with the message; a tool that
    runs is never interrupted (the message follows its result). With no model call in flight
    it is ``"queue"``. The worker hears of it by a PostgreSQL notification; on SQLite, which
    has none, it is ``"queue"``.

    ``key``: a client's idempotency key (a non-empty string of at most 200 characters): a
    retry with it returns the message the first call queued and queues nothing, whatever the
    run's status since. ``text``: a non-empty string of at most ``MAX_MESSAGE_BYTES`` bytes
    as UTF-8, without NUL or lone surrogates; stored encrypted under ``ENCRYPTION_KEYS``.
    ``user``, when given, needs the ``durable_agents.view_agentrun`` permission and is stored
    as the sender.

    Raises ``InvalidArgument`` (a bad run id, text, policy or key), ``RunNotFound``,
    ``RunFinished``, ``RunBusy``, ``PermissionDenied``; nothing is queued then."""
    if user is not None and not user.has_perm(VIEW_RUN_PERMISSION):
        raise PermissionDenied(f"sending a message needs the {VIEW_RUN_PERMISSION} permission")
    if policy not in MESSAGE_POLICIES:
        raise InvalidArgument(
            f"policy is one of {', '.join(repr(p) for p in MESSAGE_POLICIES)}, "
            f"not {storable_text(repr(policy), 80)}"
        )
    _check_message(text)
    if key is not None:
        _check_start_key(key)
    run_pk = _run_id(run_id)
    message, created = current().queue_message(
        run_pk, text, key, user, busy_refused=policy == "reject"
    )
    if created and policy == "interrupt":
        current().interrupt_model_call(run_pk)
    return message


def _check_message(text: object) -> None:
    if not isinstance(text, str) or not text.strip():
        raise InvalidArgument("a message is a non-empty string")
    if has_unstorable(text):
        raise InvalidArgument("a message cannot contain NUL characters or lone surrogates")
    size = len(text.encode("utf-8"))
    limit = app_settings.MAX_MESSAGE_BYTES
    if size > limit:
        raise InvalidArgument(
            f"a message is at most {limit} bytes as UTF-8 (MAX_MESSAGE_BYTES); this one is {size}"
        )


def _run_id(run_id: object) -> uuid.UUID:
    if isinstance(run_id, uuid.UUID):
        return run_id
    if isinstance(run_id, str):
        try:
            return uuid.UUID(run_id)
        except ValueError:
            pass
    raise InvalidArgument(f"{storable_text(repr(run_id), 80)} is not a run id (a UUID)")


@explains_missing_tables
def messages_for(run_id: RunId | str) -> list[dict[str, Any]]:
    """The message list of a run, rebuilt from its step log exactly as the model was sent it."""
    return rebuild_messages(run_id)


@explains_missing_tables
def tree_cost(run_id: RunId | str) -> FamilyCost:
    """What a run cost together with all its descendants (its child runs, theirs, ...), in
    one query: ``.cost`` (USD as a ``Decimal``, or None when no turn of the tree had a price),
    ``.descendants`` (how many runs under it) and ``.complete`` (False past 10,000
    descendants: the figures are then lower bounds). The run's own cost is ``run.cost_usd``.
    ``InvalidArgument`` for an id that is not a UUID, ``RunNotFound`` for no such run."""
    [wanted] = _run_ids([run_id])
    run = AgentRun.objects.filter(pk=wanted).only("id", "cost_usd").first()
    if run is None:
        raise RunNotFound(f"there is no run {wanted}")
    return family_cost(run)


def _check_permission(user: Person | None) -> None:
    if user is None or not user.has_perm(APPROVE_PERMISSION):
        raise PermissionDenied(f"deciding tool intents needs the {APPROVE_PERMISSION} permission")


def _decide(
    intent_id: int, user: Person | None, from_status: str, to_status: str, reason: str
) -> ToolIntent:
    _check_permission(user)
    return current().decide_intent(intent_id, user, from_status, to_status, reason)


@keyword_options("intent_id", "user")
@explains_missing_tables
def approve_intent(intent_id: int, *, user: Person | None) -> ToolIntent:
    """Allow a pending irreversible call to run; the run becomes claimable. Deciding an
    intent that was already decided changes nothing."""
    return _decide(intent_id, user, IntentStatus.PENDING, IntentStatus.APPROVED, "")


@keyword_options("intent_id", "user", "reason")
@explains_missing_tables
def reject_intent(intent_id: int, *, user: Person | None, reason: str = "") -> ToolIntent:
    """Refuse a pending call; the model receives an error result naming who and why."""
    return _decide(intent_id, user, IntentStatus.PENDING, IntentStatus.REJECTED, reason)


@keyword_options("intent_id", "user")
@explains_missing_tables
def resolve_intent(
    intent_id: int,
    *,
    user: Person | None,
    happened: bool,
    result: JSONValue = None,
    reason: str = "",
) -> ToolIntent:
    """Settle an intent whose outcome is unknown (its worker died while the tool ran).

    ``happened=True``: the call took place; ``result`` becomes its recorded result and the
    run goes on with it. ``happened=False``: it did not; the call runs again.
    """
    _check_permission(user)
    outcome = effects.format_result("" if result is None else result) if happened else None
    return current().resolve_intent(intent_id, user, outcome=outcome, reason=reason)


def made_transition(decided: ToolIntent | AgentQuestion | AgentEvent) -> bool:
    """Whether the call that returned ``decided`` (``approve_intent``, ``reject_intent``,
    ``resolve_intent``, ``answer_question``, ``send_event``) made its change, rather than
    finding it made already: by another person, or by the same person from another tab at the
    same moment. What an audit trail records: only the call that made the change."""
    return _made_transition(decided)


# -- for async views (ASGI): the same operations, run in Django's thread for database work ----


async def astart_run(
    agent: str,
    task: str,
    *,
    version: str | None = None,
    model: str | None = None,
    key: str | None = None,
    priority: int = 0,
    concurrency_key: str | None = None,
    debounce: float | None = None,
    metadata: dict[str, Any] | None = None,
    batch: bool | None = None,
) -> AgentRun:
    """``start_run`` for async code."""
    return await sync_to_async(start_run)(
        agent,
        task,
        version=version,
        model=model,
        key=key,
        priority=priority,
        concurrency_key=concurrency_key,
        debounce=debounce,
        metadata=metadata,
        batch=batch,
    )


async def acancel_run(run_id: RunId | str) -> bool:
    """``cancel_run`` for async code."""
    return await sync_to_async(cancel_run)(run_id)


async def asend_event(
    name: str, payload: JSONValue = None, *, user: Person | None = None
) -> AgentEvent:
    """``send_event`` for async code."""
    return await sync_to_async(send_event)(name, payload, user=user)


@keyword_options("run_id", "user", "text")
async def aanswer_question(
    run_id: RunId | str, text: str, *, user: Person | None, question_id: int | None = None
) -> AgentQuestion:
    """``answer_question`` for async code."""
    return await sync_to_async(answer_question)(run_id, text, user=user, question_id=question_id)


async def asend_message(
    run_id: RunId | str,
    text: str,
    *,
    policy: str = "queue",
    key: str | None = None,
    user: Person | None = None,
) -> AgentMessage:
    """``send_message`` for async code."""
    return await sync_to_async(send_message)(run_id, text, policy=policy, key=key, user=user)


async def amessages_for(run_id: RunId | str) -> list[dict[str, Any]]:
    """``messages_for`` for async code."""
    return await sync_to_async(messages_for)(run_id)


async def atree_cost(run_id: RunId | str) -> FamilyCost:
    return await sync_to_async(tree_cost)(run_id)


async def arequeue_run(run_id: RunId | str) -> bool:
    """``requeue_run`` for async code."""
    return await sync_to_async(requeue_run)(run_id)


async def afork_run(
    run_id: RunId | str,
    at_seq: int,
    *,
    edit: JSONValue = None,
    version: str | None = None,
    model: str | None = None,
    user: Person | None = None,
) -> AgentRun:
    """``fork_run`` for async code."""
    return await sync_to_async(fork_run)(
        run_id, at_seq, edit=edit, version=version, model=model, user=user
    )


async def aapprove_intent(intent_id: int, *, user: Person | None) -> ToolIntent:
    """``approve_intent`` for async code."""
    return await sync_to_async(approve_intent)(intent_id, user=user)


async def areject_intent(intent_id: int, *, user: Person | None, reason: str = "") -> ToolIntent:
    """``reject_intent`` for async code."""
    return await sync_to_async(reject_intent)(intent_id, user=user, reason=reason)


async def aresolve_intent(
    intent_id: int,
    *,
    user: Person | None,
    happened: bool,
    result: JSONValue = None,
    reason: str = "",
) -> ToolIntent:
    """``resolve_intent`` for async code."""
    return await sync_to_async(resolve_intent)(
        intent_id, user=user, happened=happened, result=result, reason=reason
    )


async def aset_key_budget(
    key: str, usd_per_day: Decimal | float | int | None, *, user: Person | None = None
) -> int:
    """``set_key_budget`` for async code."""
    return await sync_to_async(set_key_budget)(key, usd_per_day, user=user)


async def aset_key_limit(key: str, limit: int | None, *, user: Person | None = None) -> None:
    """``set_key_limit`` for async code."""
    await sync_to_async(set_key_limit)(key, limit, user=user)


async def aupgrade_runs(
    agent: str,
    from_version: str,
    to_version: str,
    *,
    run_ids: Iterable[RunId | str] | None = None,
    user: Person | None = None,
) -> UpgradeReport:
    """``upgrade_runs`` for async code."""
    return await sync_to_async(upgrade_runs)(
        agent, from_version, to_version, run_ids=run_ids, user=user
    )


async def acarry_over_runs(
    agent: str,
    from_version: str,
    to_version: str,
    *,
    run_ids: Iterable[RunId | str] | None = None,
    user: Person | None = None,
) -> UpgradeReport:
    """``carry_over_runs`` for async code."""
    return await sync_to_async(carry_over_runs)(
        agent, from_version, to_version, run_ids=run_ids, user=user
    )
