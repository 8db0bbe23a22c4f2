"""Settings of durable_agents, read from ``settings.DURABLE_AGENTS`` with defaults.

Read on every access (not cached at import) so that ``override_settings`` in tests and
per-process configuration both work.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings as django_settings

DEFAULTS: dict[str, Any] = {
    "LEASE_SECONDS": 60,
    "HEARTBEAT_SECONDS": 20,
    "MAX_ATTEMPTS": 8,
    "POLL_INTERVAL": 1.0,
    # PostgreSQL: the most connections one worker process holds, all told: its heartbeat's,
    # its listener's and its pool's. A pooled connection is held only while the worker talks
    # to the database, never across a model or tool call, so this does not grow with the
    # runs in flight.
    "DB_POOL_SIZE": 8,
    # PostgreSQL: LISTEN for new runs, wake-ups and cancellations (polling stays the fallback).
    # True: on the database's own settings; False: poll only; a dict: overrides of the
    # DATABASES entry for this one connection, e.g. {"PORT": 5432} to go around a
    # transaction pooler, which cannot LISTEN.
    "LISTEN": True,
    # Plain ``def`` tools run on threads, each with its own database connection: at most this
    # many tool calls of one worker run at once (the others wait their turn).
    "TOOL_THREADS": 32,
    "CLIENT_FACTORY": "durable_agents.llm.default_client",
    "OFFLINE": False,
    "BETAS": [],
    # Retries of one model call inside one claim (429, 529, 5xx, connection errors).
    "MODEL_RETRIES": 8,
    # Longest pause between two retries when the server gives no retry-after.
    "MAX_BACKOFF_SECONDS": 60.0,
    # Tool results longer than this (in characters) are cut before the model sees them; the
    # tool_effect ledger keeps the whole result.
    "MAX_RESULT_CHARS": 1_000_000,
    # Commit the results of pure and idempotent calls while the next model call is already
    # on its way (one flushed commit per turn in the step's path instead of two). False: every
    # step is committed before the next call goes out, whatever its tools.
    "OVERLAP_SAFE_COMMITS": True,
    # Seconds one tool call may take at most: the ceiling for ``@tool(timeout=)`` and
    # ``Agent(tool_timeout=)``, and the timeout of tools that set neither. Past it the call's
    # result is an error for the model and the worker slot is free again.
    "TOOL_TIMEOUT": 600.0,
    # Dotted path of a callable ``(tool_name, exception) -> str`` that writes the error text the
    # model and the transcript see when a tool raises (to redact secrets from messages).
    # None: "<tool> raised <Type>: <message>".
    "TOOL_ERROR_FORMATTER": None,
    # HTTP timeout of one model call, in seconds.
    "MODEL_TIMEOUT": 600.0,
    # A worker that lacks a run's prompt version (a rolling deploy: the code that started the
    # run is newer than this worker) hands the run back for this long, for another worker.
    # MAX_ATTEMPTS such claims in a row send it to the dead letter.
    "UNDEPLOYED_RETRY_SECONDS": 30.0,
    # After SIGTERM, steps in flight get this long to finish and commit before they are
    # abandoned (uncommitted) and the worker exits. A second signal abandons them at once.
    "SHUTDOWN_GRACE_SECONDS": 10.0,
    # Housekeeping (see housekeeping.py): runs pinned to these models go to the dead letter.
    "RETIRED_MODELS": [],
    # Finished runs older than this many days are deleted (None: kept forever).
    "RETENTION_DAYS": None,
    "RETENTION_BATCH": 1000,
    # Dotted path of a callable that receives each batch (a QuerySet of runs) before deletion.
    "ARCHIVER": None,
    "METRICS_KEEP_DAYS": 30,
    # Child runs (spawn_run): how deep runs may nest (a run started by start_run is at depth 0)
    # and how many children one run may spawn.
    "MAX_RUN_DEPTH": 5,
    "MAX_CHILD_RUNS": 100,
    # E-mail staff when an intent waits or a run is dead-lettered (see notifications.py).
    "NOTIFY": True,
}


class DurableAgentsSettings:
    def __getattr__(self, name: str) -> Any:
        if name not in DEFAULTS:
            raise AttributeError(f"durable_agents has no setting {name!r}")
        user = getattr(django_settings, "DURABLE_AGENTS", None) or {}
        return user.get(name, DEFAULTS[name])


app_settings = DurableAgentsSettings()
