"""The ``DURABLE_AGENTS`` dict, key by key (``check_settings``): a dict at all, unknown keys,
numbers within their bounds, booleans, the shapes of ``LISTEN``, ``RETIRED_MODELS`` and
``BETAS``, the dotted paths (``ARCHIVER``, ``TOOL_ERROR_FORMATTER``, ``CLIENT_FACTORY``), and
the heartbeat against the lease. The values with a module of their own (flow control, the
encryption keys, ``SITE_URL``, ``OFFLINE``) are checked there; ``check_settings`` gathers their
messages with these, so that the heartbeat is compared only when nothing else is wrong."""

from __future__ import annotations

import difflib
import typing
from collections.abc import Callable
from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, Tags, Warning, register
from django.utils.module_loading import import_string

from durable_agents.checks.encryption import bad_encryption_keys
from durable_agents.checks.flow import (
    bad_budgets,
    bad_concurrency_limits,
    bad_prices,
    bad_rate_limits,
)
from durable_agents.checks.links import bad_site_url
from durable_agents.checks.offline import offline_without_debug, online_without_api_key
from durable_agents.checks.webhooks import bad_webhooks
from durable_agents.conf import DEFAULTS, app_settings, declared_types

# The bounds of each number setting: (minimum, whether the minimum itself is allowed). Whether
# it must be a whole number, and whether None is allowed, come from its declared type.
NUMBER_BOUNDS: dict[str, tuple[float, bool]] = {
    "LEASE_SECONDS": (0, False),
    "HEARTBEAT_SECONDS": (0, False),
    "POLL_INTERVAL": (0, False),
    "MAX_BACKOFF_SECONDS": (0, False),
    "MODEL_TIMEOUT": (0, False),
    "TOOL_TIMEOUT": (0, False),
    "SHUTDOWN_GRACE_SECONDS": (0, True),
    "UNDEPLOYED_RETRY_SECONDS": (0, True),
    "UNDEPLOYED_GRACE": (0, True),
    "RETENTION_DAYS": (0, False),
    "MAX_ATTEMPTS": (1, True),
    "MAX_RESULT_CHARS": (1, True),
    "RETENTION_BATCH": (1, True),
    "METRICS_KEEP_DAYS": (1, True),
    "MODEL_RETRIES": (0, True),
    # The heartbeat, the listener and a pool of at least one.
    "DB_POOL_SIZE": (3, True),
    "TOOL_THREADS": (1, True),
    "WORKER_GC_THRESHOLD": (0, True),
    "MAX_RUN_DEPTH": (0, True),
    "MAX_CHILD_RUNS": (0, True),
    "MAX_TREE_RUNS": (1, True),
    "MAX_EVENT_BYTES": (1, True),
    "MAX_MESSAGE_BYTES": (1, True),
    "LINK_MAX_AGE": (0, False),
    "WEBHOOK_MAX_ATTEMPTS": (1, True),
    "WEBHOOK_RETRY_SECONDS": (0, False),
    "WEBHOOK_KEEP_DAYS": (1, True),
    "CALLBACK_MAX_BYTES": (1, True),
    "BATCH_WINDOW_SECONDS": (0, True),
    "BATCH_MAX_REQUESTS": (1, True),
    "BATCH_FALLBACK_SECONDS": (0, True),
    "BATCH_POLL_SECONDS": (0, False),
    "BATCH_POLL_MAX_SECONDS": (0, False),
}


@register(Tags.compatibility)
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """``DURABLE_AGENTS``, key by key, with the messages of the settings that have a module
    of their own; the heartbeat against the lease only once nothing else is wrong."""
    user = getattr(settings, "DURABLE_AGENTS", None) or {}
    if not isinstance(user, dict):
        return [Error("DURABLE_AGENTS must be a dict.", id="durable_agents.E001")]
    messages = [
        *_unknown_keys(user),
        *_bad_numbers(),
        *_batch_too_large(),
        *_bad_booleans(),
        *_bad_listen(),
        *_bad_retired_models(),
        *_bad_archiver(),
        *_bad_tool_error_formatter(),
        *bad_rate_limits(),
        *bad_budgets(),
        *bad_prices(),
        *bad_concurrency_limits(),
        *bad_encryption_keys(),
        *bad_site_url(),
        *bad_webhooks(),
    ]
    if not messages:
        # Only once the numbers are known to be numbers (and nothing else is wrong).
        messages += _heartbeat_too_slow()
    return [
        *messages,
        *_bad_betas(),
        *_bad_client_factory(),
        *offline_without_debug(),
        *online_without_api_key(),
    ]


def _unknown_keys(user: dict[str, Any]) -> list[CheckMessage]:
    return [
        Error(
            f"DURABLE_AGENTS has an unknown key {key!r}.",
            hint=_known_keys_hint(key),
            id="durable_agents.E002",
        )
        for key in sorted(set(user) - set(DEFAULTS), key=str)
    ]


# Where the hint of an unknown key sends the reader for the whole table: naming three close
# keys helps, naming all forty buries the one meant.
SETTINGS_DOC = "docs/ref/settings.md"
CLOSE_KEYS = 3


def _known_keys_hint(key: Any) -> str:
    """ "Did you mean 'LEASE_SECONDS', 'LEASE_...', '...'? All settings: docs/ref/settings.md":
    the three known keys closest to ``key``, whatever it is (a cutoff of 0 always finds
    some), then where the others are."""
    close = difflib.get_close_matches(str(key).upper(), sorted(DEFAULTS), n=CLOSE_KEYS, cutoff=0)
    return f"Did you mean {', '.join(map(repr, close))}? All settings: {SETTINGS_DOC}"


# The most requests the Message Batches API takes in one batch.
API_MAX_BATCH_REQUESTS = 100_000


def _batch_too_large() -> list[CheckMessage]:
    value = app_settings.BATCH_MAX_REQUESTS
    if isinstance(value, int) and not isinstance(value, bool) and value > API_MAX_BATCH_REQUESTS:
        return [
            Error(
                f"DURABLE_AGENTS['BATCH_MAX_REQUESTS'] is {value}: the Message Batches API "
                f"takes at most {API_MAX_BATCH_REQUESTS:,} requests in one batch.",
                hint=f"Set it to {API_MAX_BATCH_REQUESTS} or less.",
                id="durable_agents.E080",
            )
        ]
    return []


def _bad_numbers() -> list[CheckMessage]:
    types = declared_types()
    messages: list[CheckMessage] = []
    for key, (minimum, inclusive) in NUMBER_BOUNDS.items():
        whole = types[key] is int
        nullable = type(None) in typing.get_args(types[key])
        value = getattr(app_settings, key)
        if (value is None and nullable) or in_bounds(value, whole, minimum, inclusive):
            continue
        bound = f">= {minimum}" if inclusive else f"> {minimum}"
        messages.append(
            Error(
                f"DURABLE_AGENTS[{key!r}] must be {'None or ' if nullable else ''}a "
                f"{'whole ' if whole else ''}number {bound}, not {value!r}.",
                id="durable_agents.E004" if whole else "durable_agents.E003",
            )
        )
    return messages


def in_bounds(value: Any, whole: bool, minimum: float, inclusive: bool) -> bool:
    """Whether ``value`` is a number (a whole one if ``whole``, never a bool) not under
    ``minimum``, nor equal to it unless ``inclusive``."""
    if isinstance(value, bool) or not isinstance(value, int if whole else (int, float)):
        return False
    # Written as the refusal so that NaN, which compares false to everything, stays allowed.
    return not (value < minimum or (value == minimum and not inclusive))


def _bad_booleans() -> list[CheckMessage]:
    return [
        Error(f"DURABLE_AGENTS[{key!r}] must be True or False.", id="durable_agents.E007")
        for key, kind in declared_types().items()
        if kind is bool and not isinstance(getattr(app_settings, key), bool)
    ]


def _bad_listen() -> list[CheckMessage]:
    listen = app_settings.LISTEN
    if isinstance(listen, bool) or (
        isinstance(listen, dict) and all(isinstance(k, str) and k.isupper() for k in listen)
    ):
        return []
    return [
        Error(
            "DURABLE_AGENTS['LISTEN'] must be True, False, or a dict of DATABASES keys.",
            hint='For example {"HOST": "db.internal", "PORT": 5432}: the listener '
            "connects there instead (around a transaction pooler, which cannot LISTEN).",
            id="durable_agents.E013",
        )
    ]


def _bad_retired_models() -> list[CheckMessage]:
    retired = app_settings.RETIRED_MODELS
    if isinstance(retired, (list, tuple, set, frozenset)) and all(
        isinstance(m, str) for m in retired
    ):
        return []
    return [
        Error(
            "DURABLE_AGENTS['RETIRED_MODELS'] must be a list of model ids.",
            id="durable_agents.E008",
        )
    ]


def _bad_archiver() -> list[CheckMessage]:
    if not app_settings.ARCHIVER:
        return []
    try:
        import_string(app_settings.ARCHIVER)
    except ImportError as exc:
        return [
            Error(
                f"DURABLE_AGENTS['ARCHIVER'] cannot be imported: {exc}",
                id="durable_agents.E009",
            )
        ]
    return []


def _bad_tool_error_formatter() -> list[CheckMessage]:
    problem = _formatter_problem(app_settings.TOOL_ERROR_FORMATTER)
    if not problem:
        return []
    return [
        Error(
            f"DURABLE_AGENTS['TOOL_ERROR_FORMATTER'] {problem}.",
            hint="Give the dotted path of a callable (tool_name, exception) -> str, or "
            "None for the default text.",
            id="durable_agents.E012",
        )
    ]


def _formatter_problem(path: Any) -> str | None:
    """What is wrong with a TOOL_ERROR_FORMATTER value, or None when it is usable."""
    if path is None:
        return None
    if not isinstance(path, str):
        return f"must be None or a dotted path (a string), not {path!r}"
    try:
        formatter: Callable[..., Any] = import_string(path)
    except ImportError as exc:
        return f"cannot be imported: {exc}"
    if not callable(formatter):
        return f"{path!r} is not callable"
    return None


def _heartbeat_too_slow() -> list[CheckMessage]:
    lease, beat = app_settings.LEASE_SECONDS, app_settings.HEARTBEAT_SECONDS
    if beat * 2 <= lease:
        return []
    return [
        Warning(
            f"HEARTBEAT_SECONDS ({beat}) is more than half of LEASE_SECONDS ({lease}).",
            hint="Workers renew at most every third of the lease; keep the heartbeat "
            "well below it so that one slow renewal does not lose the run.",
            id="durable_agents.W001",
        )
    ]


def _bad_betas() -> list[CheckMessage]:
    betas = app_settings.BETAS
    if isinstance(betas, (list, tuple)) and all(isinstance(b, str) for b in betas):
        return []
    return [Error("DURABLE_AGENTS['BETAS'] must be a list of strings.", id="durable_agents.E005")]


def _bad_client_factory() -> list[CheckMessage]:
    try:
        import_string(app_settings.CLIENT_FACTORY)
    except ImportError as exc:
        return [
            Error(
                f"DURABLE_AGENTS['CLIENT_FACTORY'] cannot be imported: {exc}",
                id="durable_agents.E006",
            )
        ]
    return []
