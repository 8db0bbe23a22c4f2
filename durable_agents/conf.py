"""Settings of durable_agents, read from ``settings.DURABLE_AGENTS`` with defaults.

``app_settings`` has one typed, documented attribute per setting (``DurableAgentsSettings``).
Each is read on every access (not cached at import) so that ``override_settings`` in tests and
per-process configuration both work; a name that is not a setting is an ``AttributeError``.
The declarations below are the only copy of the defaults: the system checks take the known
names, the defaults and the expected types from them.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Mapping
from typing import Any, Generic, TypeVar, overload

from django.conf import settings as django_settings

__all__ = ["DEFAULTS", "DurableAgentsSettings", "Setting", "app_settings", "declared_types"]

T = TypeVar("T")


class Setting(Generic[T]):
    """One setting: its default and what it does. Read on an instance, it is the value of
    ``settings.DURABLE_AGENTS[name]`` at that moment, or the default."""

    name: str

    def __init__(self, default: T, doc: str) -> None:
        self.default = default
        self.__doc__ = doc

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, instance: None, owner: type) -> Setting[T]: ...

    @overload
    def __get__(self, instance: object, owner: type) -> T: ...

    def __get__(self, instance: object | None, owner: type) -> Setting[T] | T:
        if instance is None:
            return self
        user = getattr(django_settings, "DURABLE_AGENTS", None) or {}
        # What the user wrote is checked by the system checks, not here: this is read often
        # (a try costs nothing until it catches).
        try:
            return typing.cast(T, user.get(self.name, self.default))
        except AttributeError:
            # Not a dict at all (E001 says so): every setting reads as its default meanwhile,
            # so that the other checks and the commands report instead of crashing.
            return self.default


class DurableAgentsSettings:
    """The settings of durable_agents (``settings.DURABLE_AGENTS``), all optional."""

    LEASE_SECONDS: Setting[float] = Setting(
        60, "Seconds a worker's claim on a run lasts unless its heartbeat renews it."
    )
    HEARTBEAT_SECONDS: Setting[float] = Setting(
        20, "Seconds between two renewals of a worker's leases; well below LEASE_SECONDS."
    )
    MAX_ATTEMPTS: Setting[int] = Setting(
        8, "Claims in a row without a new committed step before the run goes to the dead letter."
    )
    POLL_INTERVAL: Setting[float] = Setting(
        1.0, "Seconds between two looks for claimable runs when nothing wakes the worker."
    )
    DB_POOL_SIZE: Setting[int] = Setting(
        8,
        "PostgreSQL: the most connections one worker process holds, all told: its heartbeat's, "
        "its listener's and its pool's. A pooled connection is held only while the worker talks "
        "to the database, never across a model or tool call, so this does not grow with the "
        "runs in flight.",
    )
    LISTEN: Setting[bool | dict[str, Any]] = Setting(
        True,
        "PostgreSQL: LISTEN for new runs, wake-ups and cancellations (polling stays the "
        "fallback). True: on the database's own settings; False: poll only; a dict: overrides "
        "of the DATABASES entry for this one connection, e.g. {'PORT': 5432} to go around a "
        "transaction pooler, which cannot LISTEN.",
    )
    TOOL_THREADS: Setting[int] = Setting(
        32,
        "Plain ``def`` tools run on threads, each with its own database connection: at most "
        "this many tool calls of one worker run at once (the others wait their turn).",
    )
    WORKER_GC_THRESHOLD: Setting[int] = Setting(
        10_000,
        "runagents: objects allocated and not yet freed between two young collections of "
        "Python's garbage collector (the interpreter's default is 700); the objects loaded "
        "at start-up are frozen out of its collections. 0 leaves the collector as it is.",
    )
    CLIENT_FACTORY: Setting[str] = Setting(
        "durable_agents.llm.default_client",
        "Dotted path of a callable that returns the ``anthropic.Anthropic`` client.",
    )
    OFFLINE: Setting[bool] = Setting(
        False, "True: the built-in offline scripted model answers instead of the API."
    )
    BETAS: Setting[list[str]] = Setting(
        [], "anthropic-beta values sent on every model call (before each agent's own)."
    )
    MODEL_RETRIES: Setting[int] = Setting(
        8, "Retries of one model call inside one claim (429, 529, 5xx, connection errors)."
    )
    MAX_BACKOFF_SECONDS: Setting[float] = Setting(
        60.0, "Longest pause between two retries when the server gives no retry-after."
    )
    MAX_RESULT_CHARS: Setting[int] = Setting(
        1_000_000,
        "Tool results longer than this (in characters) are cut before the model sees them; "
        "the tool_effect ledger keeps the whole result.",
    )
    OVERLAP_SAFE_COMMITS: Setting[bool] = Setting(
        True,
        "Commit the results of pure and idempotent calls while the next model call is already "
        "on its way (one flushed commit per turn in the step's path instead of two). False: "
        "every step is committed before the next call goes out, whatever its tools.",
    )
    TOOL_TIMEOUT: Setting[float] = Setting(
        600.0,
        "Seconds one tool call may take at most: the ceiling for ``@tool(timeout=)`` and "
        "``Agent(tool_timeout=)``, and the timeout of tools that set neither. Past it the "
        "call's result is an error for the model and the worker slot is free again.",
    )
    TOOL_ERROR_FORMATTER: Setting[str | None] = Setting(
        None,
        "Dotted path of a callable ``(tool_name, exception) -> str`` that writes the error text "
        "the model and the transcript see when a tool raises (to redact secrets from messages). "
        'None: "<tool> raised <Type>: <message>".',
    )
    MODEL_TIMEOUT: Setting[float] = Setting(600.0, "HTTP timeout of one model call, in seconds.")
    UNDEPLOYED_RETRY_SECONDS: Setting[float] = Setting(
        30.0,
        "No longer used: a run no worker of this code can serve waits for a worker that can "
        "(waiting_for 'worker') instead of being handed back for a while. Accepted so that "
        "existing settings stay valid.",
    )
    UNDEPLOYED_GRACE: Setting[float] = Setting(
        7 * 24 * 3600.0,
        "Seconds a run in flight whose agent version no live worker defines waits for one "
        "(a rolling deploy, an old worker brought back) before housekeeping dead-letters it. "
        "Counted from the last time a live worker defined the version, or from the run's "
        "creation when none ever did.",
    )
    SHUTDOWN_GRACE_SECONDS: Setting[float] = Setting(
        10.0,
        "After SIGTERM, steps in flight get this long to finish and commit before they are "
        "abandoned (uncommitted) and the worker exits. A second signal abandons them at once.",
    )
    RETIRED_MODELS: Setting[list[str]] = Setting(
        [], "Housekeeping: runs pinned to these models go to the dead letter."
    )
    RETENTION_DAYS: Setting[float | None] = Setting(
        None, "Housekeeping: finished runs older than this many days are deleted (None: kept)."
    )
    RETENTION_BATCH: Setting[int] = Setting(
        1000, "Housekeeping: runs deleted per batch by the retention job."
    )
    ARCHIVER: Setting[str | None] = Setting(
        None,
        "Dotted path of a callable that receives each batch (a QuerySet of runs) before deletion.",
    )
    METRICS_KEEP_DAYS: Setting[int] = Setting(30, "Housekeeping: days of metric snapshots kept.")
    MAX_RUN_DEPTH: Setting[int] = Setting(
        5,
        "Child runs (spawn_run): how deep runs may nest (a run started by start_run is at "
        "depth 0).",
    )
    MAX_CHILD_RUNS: Setting[int] = Setting(100, "How many children one run may spawn.")
    MAX_TREE_RUNS: Setting[int] = Setting(
        1000,
        "Child runs: how many runs one tree may hold in all, its root (a run started by "
        "start_run) and every descendant, whatever their status; a spawn_run past it is "
        "refused. MAX_CHILD_RUNS and MAX_RUN_DEPTH alone allow exponentially many.",
    )
    MAX_EVENT_BYTES: Setting[int] = Setting(
        1024 * 1024,
        "The largest payload send_event takes, in bytes of its JSON text (UTF-8).",
    )
    MAX_MESSAGE_BYTES: Setting[int] = Setting(
        256 * 1024,
        "The largest message send_message takes, in bytes of its text (UTF-8): what a person "
        "types while the agent works, sent again with every later model call of the run.",
    )
    CALLBACK_MAX_BYTES: Setting[int] = Setting(
        1024 * 1024,
        "The largest body a service may POST to a callback URL (Wait(callback=True)), in "
        "bytes; a larger one is refused with 413. The callback view reads its body itself, so "
        "Django's DATA_UPLOAD_MAX_MEMORY_SIZE does not bound it: this does.",
    )
    RATE_LIMITS: Setting[dict[str, Any]] = Setting(
        {},
        'Fleet-wide limits per model ("*" for any other): requests_per_minute, '
        "input_tokens_per_minute, output_tokens_per_minute, burst_seconds. Without them the "
        "fleet learns each model's limits from the API's rate-limit headers.",
    )
    CONCURRENCY_LIMITS: Setting[dict[str, int]] = Setting(
        {},
        "Per concurrency key, whatever the agent: at most this many runs with the key running "
        "at once, fleet-wide; overrides the agent's concurrency_limit. 0 holds the key's runs "
        "pending (a pause).",
    )
    BUDGETS: Setting[dict[str, dict[str, float]]] = Setting(
        {},
        'Per concurrency key ("*" for any other key): {"usd_per_day": N}. A key that spent its '
        "budget (at PRICES) in the UTC day waits, its runs pending, until the next day or "
        "until its budget is raised in the admin.",
    )
    NOTIFY: Setting[bool] = Setting(
        True, "E-mail staff when an intent waits or a run is dead-lettered."
    )
    SITE_URL: Setting[str | None] = Setting(
        None,
        "The site's base URL, e.g. 'https://agents.example.com': every link in a notification "
        "mail is this followed by the admin page's path, and so is every callback_url(). None: "
        "mails and callback URLs give paths only (check W007 warns while NOTIFY is on).",
    )
    LINK_MAX_AGE: Setting[float] = Setting(
        7 * 24 * 3600.0,
        "Seconds a signed link to an intent's approve or reject confirmation page (in "
        "notification mails and webhooks) stays valid; an older link is refused (403) and the "
        "person opens the intent's page instead.",
    )
    WEBHOOKS: Setting[list[dict[str, Any]]] = Setting(
        [],
        'Where to POST events as signed JSON: a list of {"url": ..., "events": [...], '
        '"secret": ..., "template": optional}; events among "intent.waiting", '
        '"question.asked", "run.dead", "run.finished". Each delivery is recorded in '
        "agent_webhook_delivery and retried by housekeeping.",
    )
    WEBHOOK_MAX_ATTEMPTS: Setting[int] = Setting(
        8, "Attempts of one webhook delivery before it is marked failed."
    )
    WEBHOOK_RETRY_SECONDS: Setting[float] = Setting(
        30.0,
        "Seconds before a failed webhook delivery is tried again; the wait doubles after each "
        "failed attempt (at most a day).",
    )
    WEBHOOK_KEEP_DAYS: Setting[int] = Setting(
        30, "Housekeeping: days that delivered and failed webhook deliveries are kept."
    )
    PRICES: Setting[dict[str, dict[str, float]]] = Setting(
        {},
        'USD per million tokens, by model name ("*": any other model): {"input": ..., '
        '"output": ...} and optionally "cache_read", "cache_write" (5-minute writes) '
        'and "cache_write_1h" (else 0.1x, 1.25x and 2x the input price, as the Messages API '
        "bills them). Each run's cost_usd and the daily rollup agent_usage_day are priced with "
        "it when a turn is committed; turns of a model without a price cost nothing and the "
        'run shows "no price".',
    )

    BATCH_WINDOW_SECONDS: Setting[float] = Setting(
        10.0,
        "Runs in batches (start_run(..., batch=True)): the longest a waiting model turn stays "
        "out of a Message Batch. The fleet submits the turns waiting together once the oldest "
        "has waited this long, or at once when BATCH_MAX_REQUESTS wait.",
    )
    BATCH_MAX_REQUESTS: Setting[int] = Setting(
        10_000,
        "The most model turns one Message Batch carries (the API takes up to 100,000 and "
        "256 MB); this many waiting turns are submitted without waiting for the window.",
    )
    BATCH_FALLBACK_SECONDS: Setting[float | None] = Setting(
        None,
        "A batched turn that came back expired, cancelled by someone else or with an overload "
        "or server error is sent in a later batch; with this set, once it has waited this many "
        "seconds it is sent directly instead (at the direct price). None: always in batches.",
    )
    BATCH_POLL_SECONDS: Setting[float] = Setting(
        5.0,
        "Seconds between the first retrieves of a Message Batch; the wait grows by half after "
        "each retrieve that finds it in progress, up to BATCH_POLL_MAX_SECONDS.",
    )
    BATCH_POLL_MAX_SECONDS: Setting[float] = Setting(
        120.0, "The longest wait between two retrieves of one Message Batch."
    )

    ENCRYPTION_KEYS: Setting[list[str | None]] = Setting(
        [],
        "Keys that encrypt customers' data at rest (step payloads, tool results and inputs, "
        "event payloads, answers, progress messages, woken_by), each the urlsafe base64 of 32 "
        "random bytes: the first encrypts, every one decrypts; a first entry of None writes "
        "plain text while the others still decrypt. Empty: stored as plain text. New key: "
        "manage.py durable_agents_rotate_keys --new-key; re-encrypt under the first key: manage.py "
        "durable_agents_rotate_keys.",
    )
    LIVE_TOKEN_SECONDS: Setting[int] = Setting(
        3600, "Seconds a stream_token lets its holder read a run's events."
    )
    LIVE_DELTAS: Setting[bool] = Setting(
        True,
        "PostgreSQL: workers send the text of streamed turns (Agent(stream=True)) to the "
        "processes serving runs/<id>/events while it comes (NOTIFY, a few per second per "
        "turn). False: readers get each turn when it is committed.",
    )
    LIVE_MAX_READERS: Setting[int] = Setting(
        1000,
        "Readers of runs/<id>/events one process serves at a time, all runs together; one more "
        "is answered 503 with Retry-After (a socket and a task each under ASGI, a thread and "
        "a database connection each under WSGI).",
    )
    LIVE_MAX_READERS_PER_RUN: Setting[int] = Setting(
        100,
        "Readers of one run's events one process serves at a time; one more is answered 503 "
        "with Retry-After, so that one token cannot take the process's readers for itself.",
    )
    LIVE_WSGI_POLL_SECONDS: Setting[float] = Setting(
        1.0,
        "Under WSGI, runs/<id>/events reads the run every this many seconds, on the request's "
        "own connection (ASGI needs no setting: one hub per process follows every reader).",
    )
    LIVE_WSGI_MAX_SECONDS: Setting[float] = Setting(
        300.0,
        "Under WSGI, runs/<id>/events ends after this many seconds (the browser reconnects "
        "with Last-Event-ID and misses nothing), so a stream does not hold a thread for ever.",
    )

    if not typing.TYPE_CHECKING:
        # Only for names that are not settings (the declared ones are found first); hidden
        # from the type checker, which would otherwise accept any attribute.
        def __getattr__(self, name: str) -> Any:
            raise AttributeError(f"durable_agents has no setting {name!r}")


def _declared() -> dict[str, Setting[Any]]:
    return {
        name: value
        for name, value in vars(DurableAgentsSettings).items()
        if isinstance(value, Setting)
    }


# Each setting's default, by name (read-only).
DEFAULTS: Mapping[str, Any] = types.MappingProxyType(
    {name: setting.default for name, setting in _declared().items()}
)


def declared_types() -> dict[str, Any]:
    """Each setting's declared type (``float``, ``int | None``, ...), by name."""
    hints = typing.get_type_hints(DurableAgentsSettings)
    return {name: typing.get_args(hints[name])[0] for name in DEFAULTS}


app_settings = DurableAgentsSettings()
