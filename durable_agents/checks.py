"""System checks (``manage.py check``) for configuration mistakes that would otherwise show up
only when a worker meets them, hours later.

One id per problem; docs/ref/checks.md lists them all. Ids are never reused for another problem:
a silenced id (``SILENCED_SYSTEM_CHECKS``) must keep silencing the same thing.
"""

from __future__ import annotations

import difflib
import os
import re
import sys
import typing
import uuid
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from django.conf import settings
from django.core.checks import CheckMessage, Error, Tags, Warning, register
from django.core.checks.registry import CheckRegistry
from django.db import DatabaseError, connections
from django.urls import NoReverseMatch, reverse
from django.utils.module_loading import import_string

from durable_agents.conf import DEFAULTS, app_settings, declared_types
from durable_agents.flow.budgets import budget_problems
from durable_agents.flow.capacity.limits import ANY_MODEL, limit_problems
from durable_agents.store.concurrency import check_concurrency_key

# Referred to by runagents, whose --allow-offline lets this one check pass.
OFFLINE_WITHOUT_DEBUG = "durable_agents.E011"

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
    "RETENTION_DAYS": (0, False),
    "MAX_ATTEMPTS": (1, True),
    "MAX_RESULT_CHARS": (1, True),
    "RETENTION_BATCH": (1, True),
    "METRICS_KEEP_DAYS": (1, True),
    "MODEL_RETRIES": (0, True),
    # The heartbeat, the listener and a pool of at least one.
    "DB_POOL_SIZE": (3, True),
    "TOOL_THREADS": (1, True),
    "MAX_RUN_DEPTH": (0, True),
    "MAX_CHILD_RUNS": (0, True),
    "MAX_TREE_RUNS": (1, True),
    "MAX_EVENT_BYTES": (1, True),
}


@register(Tags.compatibility)
def check_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    user = getattr(settings, "DURABLE_AGENTS", None) or {}
    if not isinstance(user, dict):
        return [Error("DURABLE_AGENTS must be a dict.", id="durable_agents.E001")]
    messages = [
        *_unknown_keys(user),
        *_bad_numbers(),
        *_bad_booleans(),
        *_bad_listen(),
        *_bad_retired_models(),
        *_bad_archiver(),
        *_bad_tool_error_formatter(),
        *_bad_rate_limits(),
        *_bad_budgets(),
        *_bad_prices(),
        *_bad_concurrency_limits(),
        *_bad_encryption_keys(),
        *_bad_site_url(),
    ]
    if not messages:
        # Only once the numbers are known to be numbers (and nothing else is wrong).
        messages += _heartbeat_too_slow()
    return [
        *messages,
        *_bad_betas(),
        *_bad_client_factory(),
        *_offline_without_debug(),
        *_online_without_api_key(),
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


# W005: a top-level setting named like DURABLE_AGENTS that durable_agents never reads. Names
# are compared without case and without underscores, so "DURABLEAGENTS", "durable_agents" and
# "DURABLE__AGENTS" are all the same name to a reader.
MISSPELT_SETTING = "durable_agents.W005"
SETTING_NAME = "DURABLE_AGENTS"
_SETTING_NORMAL = "DURABLEAGENTS"
# How alike a name must be to DURABLEAGENTS to be taken for it: one letter dropped, added or
# swapped ("DURABEL_AGENTS", "DURABLE_AGNETS") passes; "DURABLE_QUEUES" does not.
_MISSPELT_RATIO = 0.85


def _normal(name: str) -> str:
    return re.sub(r"[^A-Z0-9]", "", name.upper())


@register(Tags.compatibility)
def check_misspelt_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Settings that look meant for durable_agents but are silently ignored: a dict under a
    misspelt name (``DURABLE_AGENT``, ``DURABLE_AGENTS_SETTINGS``, lower case), or one of
    its keys as a top-level setting (``DURABLE_AGENTS_LEASE_SECONDS``)."""
    ours = getattr(settings, SETTING_NAME, None)
    flat_keys = {_SETTING_NORMAL + _normal(key): key for key in DEFAULTS}
    messages: list[CheckMessage] = []
    for name, value in _settings_named_like_ours(set(flat_keys)):
        if value is ours and ours is not None:
            continue  # a lower-case name the setting was built from
        normal = _normal(name)
        if normal in flat_keys:
            key = flat_keys[normal]
            messages.append(
                Warning(
                    f"The setting {name!r} is not read: durable_agents takes its settings "
                    f"from one dict, {SETTING_NAME}.",
                    hint=f"Write {SETTING_NAME} = {{{key!r}: ...}} (next to its other keys) "
                    "instead; until then the default is in force.",
                    obj=name,
                    id=MISSPELT_SETTING,
                )
            )
        elif isinstance(value, dict):
            where = (
                f"move its keys into {SETTING_NAME}"
                if ours is not None
                else f"rename it to {SETTING_NAME}"
            )
            messages.append(
                Warning(
                    f"The setting {name!r} is not read: it looks like a misspelling of "
                    f"{SETTING_NAME}.",
                    hint=f"durable_agents reads only {SETTING_NAME} (upper case, plural, one "
                    f"underscore): {where}. Until then every key in it is ignored and the "
                    "defaults are in force.",
                    obj=name,
                    id=MISSPELT_SETTING,
                )
            )
    return messages


def _named_like_ours(normal: str) -> bool:
    """``DURABLE_AGENT...`` whatever follows (``_SETTINGS``, ``_CONFIG``), or a name one slip
    of the keyboard away from ``DURABLE_AGENTS``."""
    return (
        normal.startswith("DURABLEAGENT")
        or difflib.SequenceMatcher(None, normal, _SETTING_NORMAL).ratio() >= _MISSPELT_RATIO
    )


def _settings_named_like_ours(flat_keys: set[str]) -> list[tuple[str, Any]]:
    """The settings, other than ``DURABLE_AGENTS`` itself, whose name is like it or one of
    its keys, with their values, by name: Django's (upper case, overrides included) and the
    lower-case ones of the settings module, which Django skips. Only those values are read
    (reading a deprecated setting warns)."""
    names = {name for name in dir(settings) if name.isupper()}
    module_name = getattr(settings, "SETTINGS_MODULE", None)
    module = sys.modules.get(module_name) if module_name else None
    lower = (
        {n: v for n, v in vars(module).items() if not n.startswith("_") and not n.isupper()}
        if module is not None
        else {}
    )
    found = []
    for name in sorted(names | set(lower)):
        normal = _normal(name)
        if name != SETTING_NAME and (normal in flat_keys or _named_like_ours(normal)):
            found.append((name, lower[name] if name in lower else getattr(settings, name, None)))
    return found


def _bad_numbers() -> list[CheckMessage]:
    types = declared_types()
    messages: list[CheckMessage] = []
    for key, (minimum, inclusive) in NUMBER_BOUNDS.items():
        whole = types[key] is int
        nullable = type(None) in typing.get_args(types[key])
        value = getattr(app_settings, key)
        if (value is None and nullable) or _in_bounds(value, whole, minimum, inclusive):
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


def _in_bounds(value: Any, whole: bool, minimum: float, inclusive: bool) -> bool:
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


# ENCRYPTION_KEYS: not a list of strings; a key that is not urlsafe base64 of 32 bytes; one key
# twice (its second place would be dead weight, and likely a copy-paste slip).
ENCRYPTION_CHECK_IDS = {
    "list": "durable_agents.E060",
    "key": "durable_agents.E061",
    "twice": "durable_agents.E062",
}
KEY_HINT = (
    "Each key is 32 random bytes in urlsafe base64 (44 characters); "
    "`manage.py durable_agents_rotate_keys --new-key` prints one."
)


def _bad_encryption_keys() -> list[CheckMessage]:
    """Malformed keys, named by their position, never shown."""
    from durable_agents._internal.encryption import InvalidKey, key_id, parse_key

    keys = app_settings.ENCRYPTION_KEYS
    if not isinstance(keys, list | tuple):
        return [
            Error(
                "DURABLE_AGENTS['ENCRYPTION_KEYS'] must be a list of keys, not "
                f"{type(keys).__name__}.",
                hint=KEY_HINT,
                id=ENCRYPTION_CHECK_IDS["list"],
            )
        ]
    messages: list[CheckMessage] = []
    seen: dict[str, int] = {}
    for position, text in enumerate(keys):
        if position == 0 and text is None:
            continue  # write plain text; the keys after it decrypt
        try:
            kid = key_id(parse_key(text, position))
        except InvalidKey as exc:
            messages.append(
                Error(f"DURABLE_AGENTS: {exc}.", hint=KEY_HINT, id=ENCRYPTION_CHECK_IDS["key"])
            )
            continue
        if kid in seen:
            messages.append(
                Error(
                    f"DURABLE_AGENTS['ENCRYPTION_KEYS'][{position}] is the same key as "
                    f"[{seen[kid]}] (key id {kid}).",
                    id=ENCRYPTION_CHECK_IDS["twice"],
                )
            )
        seen.setdefault(kid, position)
    return messages


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


def _bad_rate_limits() -> list[CheckMessage]:
    """Each problem of ``RATE_LIMITS`` (a limit that is not a positive number, an unknown key):
    at start-up, rather than a model whose limit is silently not enforced."""
    return [
        Error(
            f"DURABLE_AGENTS['RATE_LIMITS']: {problem}.",
            hint='For example {"claude-fable-5-1": {"requests_per_minute": 4000, '
            '"input_tokens_per_minute": 2000000, "output_tokens_per_minute": 400000}}.',
            id="durable_agents.E030",
        )
        for problem in limit_problems(app_settings.RATE_LIMITS)
    ]


def _bad_budgets() -> list[CheckMessage]:
    """Each problem of ``BUDGETS`` (a budget that is not a number >= 0, a wrong shape)."""
    return [
        Error(
            f"DURABLE_AGENTS['BUDGETS']: {problem}.",
            hint='For example {"tenant:acme": {"usd_per_day": 50}, "*": {"usd_per_day": 5}}; '
            "a budget needs PRICES for the models its runs use.",
            id="durable_agents.E031",
        )
        for problem in budget_problems(app_settings.BUDGETS)
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


# One id per kind of problem in PRICES (see ``pricing.price_problems``).
PRICE_CHECK_IDS = {
    "entry": "durable_agents.E020",  # not a dict of model -> dict, or a key not a model name
    "missing": "durable_agents.E021",  # an entry without "input" or "output"
    "unknown": "durable_agents.E022",  # an entry with a key that is not a price
    "number": "durable_agents.E023",  # a price that is not a finite number >= 0
}
PRICE_HINT = (
    'USD per million tokens by model, e.g. {"claude-fable-5-1": {"input": 3.0, "output": 15.0, '
    '"cache_read": 0.3, "cache_write": 3.75}}; "*" prices any other model.'
)


def _bad_prices() -> list[CheckMessage]:
    from durable_agents.flow.pricing import price_problems

    prices = app_settings.PRICES
    if not isinstance(prices, dict):
        return [
            Error(
                f"DURABLE_AGENTS['PRICES'] must be a dict, not {prices!r}.",
                hint=PRICE_HINT,
                id=PRICE_CHECK_IDS["entry"],
            )
        ]
    return [
        Error(f"DURABLE_AGENTS['PRICES']{text}.", hint=PRICE_HINT, id=PRICE_CHECK_IDS[kind])
        for model, entry in prices.items()
        for kind, text in price_problems(model, entry)
    ]


def _bad_concurrency_limits() -> list[CheckMessage]:
    """CONCURRENCY_LIMITS: a dict of concurrency keys (as ``start_run`` takes them) to whole
    numbers >= 0. A claim leaves a bad entry out rather than fail on it."""
    limits = app_settings.CONCURRENCY_LIMITS
    if not isinstance(limits, dict):
        return [
            Error(
                "DURABLE_AGENTS['CONCURRENCY_LIMITS'] must be a dict of concurrency keys to "
                f"limits, not {limits!r}.",
                id="durable_agents.E014",
            )
        ]
    messages: list[CheckMessage] = []
    for key, limit in limits.items():
        try:
            check_concurrency_key(key)
        except ValueError as exc:
            messages.append(
                Error(
                    f"DURABLE_AGENTS['CONCURRENCY_LIMITS'] has the key {key!r}: {exc}.",
                    id="durable_agents.E015",
                )
            )
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            messages.append(
                Error(
                    f"DURABLE_AGENTS['CONCURRENCY_LIMITS'][{key!r}] must be a whole number "
                    f">= 0, not {limit!r}.",
                    hint="0 holds the key's runs pending (a pause); remove the entry for the "
                    "agent's own concurrency_limit.",
                    id="durable_agents.E016",
                )
            )
    return messages


SITE_URL_EXAMPLE = '"https://agents.example.com"'


def _site_url_problem(value: Any) -> str | None:
    """What is wrong with a SITE_URL value, or None: None or "" (not set, as from an unset
    environment variable), or an absolute http(s) URL without a query or fragment (a path is
    allowed: links are the URL followed by an admin path)."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if not isinstance(value, str):
        return f"must be None or a URL (a string), not {value!r}"
    try:
        parts = urlsplit(value.strip())
    except ValueError as exc:  # an invalid IPv6 host, for one
        return f"is not a URL ({exc}): {value!r}"
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return f"must start with http:// or https:// and name a host, not {value!r}"
    if parts.query or parts.fragment:
        return f"must have no query or fragment (links append a path to it), not {value!r}"
    return None


def _bad_site_url() -> list[CheckMessage]:
    problem = _site_url_problem(app_settings.SITE_URL)
    if problem is None:
        return []
    return [
        Error(
            f"DURABLE_AGENTS['SITE_URL'] {problem}.",
            hint=f"The address people reach this site at, e.g. {SITE_URL_EXAMPLE}: the links "
            "in notification mails are it followed by the admin page's path.",
            id="durable_agents.E017",
        )
    ]


NOTIFY_WITHOUT_SITE_URL = "durable_agents.W007"


@register()
def check_notification_links(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Notification mails on, and no SITE_URL: their links would be bare paths, which no mail
    reader can open. A worker serves no request, so the host cannot be guessed."""
    site_url = app_settings.SITE_URL
    if app_settings.NOTIFY is not True or not (site_url is None or str(site_url).strip() == ""):
        return []  # mails off, or a SITE_URL (E017 says when it is not a URL)
    try:
        reverse("admin:durable_agents_agentrun_change", args=[uuid.UUID(int=0)])
    except NoReverseMatch:
        return []  # the admin is not installed: the mails carry no links
    except Exception:  # noqa: BLE001 - a broken URLconf is Django's own checks' to report
        return []
    return [
        Warning(
            "Notification mails are on (NOTIFY) but DURABLE_AGENTS['SITE_URL'] is not set: "
            "their links to the admin are bare paths (/admin/...), which a mail reader "
            "cannot open.",
            hint=f'Set DURABLE_AGENTS["SITE_URL"] to the address of this site, e.g. '
            f"{SITE_URL_EXAMPLE} (links are it followed by the page's path), or turn the "
            'mails off with "NOTIFY": False.',
            id=NOTIFY_WITHOUT_SITE_URL,
        )
    ]


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


def _offline_without_debug() -> list[CheckMessage]:
    if app_settings.OFFLINE is not True or settings.DEBUG:
        return []
    return [
        Error(
            "DURABLE_AGENTS['OFFLINE'] is on while DEBUG is off: the offline scripted model "
            "plays the '@tool {...}' lines written in a run's task, so whoever writes a "
            "task decides which tools run, for real.",
            hint="In production, turn OFFLINE off and give the workers ANTHROPIC_API_KEY; "
            "never derive OFFLINE from a missing key. For a deliberate offline deployment "
            "(a staging copy, CI), start workers with `runagents --allow-offline`, or add "
            f"{OFFLINE_WITHOUT_DEBUG!r} to SILENCED_SYSTEM_CHECKS.",
            id=OFFLINE_WITHOUT_DEBUG,
        )
    ]


def _online_without_api_key() -> list[CheckMessage]:
    if (
        app_settings.OFFLINE
        or app_settings.CLIENT_FACTORY != DEFAULTS["CLIENT_FACTORY"]
        or os.environ.get("ANTHROPIC_API_KEY")
        or os.environ.get("ANTHROPIC_AUTH_TOKEN")
    ):
        return []
    return [
        Warning(
            "ANTHROPIC_API_KEY is not set and OFFLINE is off: every model call will fail "
            "to authenticate.",
            hint="Set ANTHROPIC_API_KEY (or CLIENT_FACTORY) for the workers; web servers "
            "do not need it. On a development machine without a key, turn OFFLINE on "
            "explicitly (with DEBUG on) for the offline scripted model.",
            id="durable_agents.W002",
        )
    ]


# Checks of a process that calls the model: ``runagents`` runs them at start, with Django's.
# They are not in Django's registry, whose checks every manage.py command runs (migrate, shell,
# a web server's start): none of those needs an API key, and refusing them would break them.
worker_checks = CheckRegistry()
WORKER_WITHOUT_CREDENTIALS = "durable_agents.E040"


@worker_checks.register("durable_agents_worker")
def check_worker_credentials(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """A worker that would call the API with no key: every run it claims would be refused."""
    if not _online_without_api_key():
        return []
    return [
        Error(
            "this worker has no API credentials: OFFLINE is off, CLIENT_FACTORY is the "
            "default and neither ANTHROPIC_API_KEY nor ANTHROPIC_AUTH_TOKEN is set, so every "
            "model call would be refused.",
            hint="Set ANTHROPIC_API_KEY in the worker's environment (or CLIENT_FACTORY for "
            "another client). On a development machine without a key, set "
            'DURABLE_AGENTS = {"OFFLINE": True} with DEBUG on: the offline scripted model '
            f"answers instead. To start anyway, add {WORKER_WITHOUT_CREDENTIALS!r} to "
            "SILENCED_SYSTEM_CHECKS.",
            id=WORKER_WITHOUT_CREDENTIALS,
        )
    ]


PROMPT_DRIFT = "durable_agents.W040"


@register(Tags.database)
def check_prompt_drift(
    app_configs: Any = None, databases: Any = None, **kwargs: Any
) -> list[CheckMessage]:
    """Runs in flight that the registered agents would dead-letter for prompt drift. Reads
    the database, so only when asked: ``manage.py check --database default``, and
    ``runagents`` at start."""
    if not databases or "default" not in databases:
        return []
    from durable_agents.engine.inflight import prompt_drift

    try:
        drifted = prompt_drift("default")
    except DatabaseError:  # not migrated yet: nothing is in flight
        return []
    return [
        Warning(
            drift.describe() + ".",
            hint="Give the changed agent a new version (Agent(version=...)) and keep the old "
            "definition registered until its runs end; or restore the old definition.",
            obj=f"{drift.agent}@{drift.version}",
            id=PROMPT_DRIFT,
        )
        for drift in drifted
    ]


SIX_FIELD_SCHEDULES = "durable_agents.W006"
# The schedules W006 names in its message; the rest are counted.
MAX_NAMED_SCHEDULES = 20


@register(Tags.database)
def check_six_field_schedules(
    app_configs: Any = None, databases: Any = None, **kwargs: Any
) -> list[CheckMessage]:
    """Schedules an earlier version stored with six cron fields (seconds first), which
    ``schedule()`` and the admin now refuse: they fire as before until saved again. Reads the
    database, so only when asked: ``manage.py check --database default``, and ``migrate``."""
    if not databases or "default" not in databases:
        return []
    from durable_agents.models import AgentSchedule
    from durable_agents.schedules.defining import five_fields

    try:
        stored = list(
            AgentSchedule.objects.using("default")
            .exclude(cron="")
            .order_by("name")
            .values_list("name", "cron")
        )
    except DatabaseError:  # not migrated yet: no schedule is stored
        return []
    names = [name for name, cron in stored if len(five_fields(cron).split()) == 6]
    if not names:
        return []
    listed = ", ".join(map(repr, names[:MAX_NAMED_SCHEDULES]))
    if len(names) > MAX_NAMED_SCHEDULES:
        listed += f" and {len(names) - MAX_NAMED_SCHEDULES} more"
    return [
        Warning(
            f"{len(names)} schedule(s) have a cron expression of six fields (seconds first), "
            f"which schedule() and the admin no longer take: {listed}.",
            hint="They fire as before. Save each again with five fields (minute hour "
            'day-of-month month day-of-week), such as "*/5 * * * *", or with every= for slots '
            "seconds apart: on its admin page or with durable_agents.schedule().",
            id=SIX_FIELD_SCHEDULES,
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


def _dotted_path(func: Any) -> str:
    """``module.qualname`` of a function: the check message names it where the default
    ``str()`` would print ``<function ... at 0x...>``."""
    module = getattr(func, "__module__", None)
    qualname = getattr(func, "__qualname__", None) or getattr(func, "__name__", None)
    if not qualname:
        return repr(func)
    return f"{module}.{qualname}" if module else qualname


@register(Tags.database)
def check_database(
    app_configs: Any = None, databases: Any = None, **kwargs: Any
) -> list[CheckMessage]:
    if settings.DEBUG or "default" not in settings.DATABASES:
        return []
    if connections["default"].vendor == "sqlite":
        return [
            Warning(
                "durable_agents runs on SQLite with DEBUG off.",
                hint="SQLite is for a single host and one worker process. Production "
                "deployments need PostgreSQL; on SQLite, run `runagents --concurrency 1`.",
                id="durable_agents.W003",
            )
        ]
    return []


# What libpq's target_session_attrs must say for a list of hosts to reach only the primary.
PRIMARY_ONLY = ("read-write", "primary")


@register()
def check_database_hosts(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """A PostgreSQL DATABASES entry naming several hosts (a primary and its standbys, tried in
    order by libpq): writes must reach the one that is primary now."""
    return database_host_problems(settings.DATABASES)


def database_host_problems(databases: dict[str, Any]) -> list[CheckMessage]:
    """``check_database_hosts`` of a DATABASES setting."""
    messages: list[CheckMessage] = []
    for alias, entry in databases.items():
        if not str(entry.get("ENGINE", "")).endswith("postgresql"):
            continue
        hosts = [h for h in str(entry.get("HOST") or "").split(",") if h.strip()]
        ports = [p for p in str(entry.get("PORT") or "").split(",") if p.strip()]
        if len(ports) > 1 and len(ports) != len(hosts):
            messages.append(
                Error(
                    f"DATABASES[{alias!r}] names {len(hosts)} host(s) and {len(ports)} ports.",
                    hint="Give one port for every host (in the same order), or a single port "
                    "for them all.",
                    id="durable_agents.E050",
                )
            )
        attrs = (entry.get("OPTIONS") or {}).get("target_session_attrs")
        if len(hosts) > 1 and attrs not in PRIMARY_ONLY:
            messages.append(
                Warning(
                    f"DATABASES[{alias!r}] names several hosts without "
                    "OPTIONS['target_session_attrs'] = 'read-write'.",
                    hint="libpq connects to the first host that answers, which after a "
                    "failover may be a read-only standby: every write of the workers and the "
                    'admin would fail there. Add "target_session_attrs": "read-write".',
                    id="durable_agents.W050",
                )
            )
    return messages


@register()
def check_agents(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    from durable_agents.declare.agents import registry

    messages: list[CheckMessage] = []
    for agent in registry.all():
        for tool in agent.tools:
            if tool.effect == "non_idempotent" and not tool.takes_idempotency_key:
                messages.append(
                    Error(
                        f"Tool {tool.name!r} of agent {agent.name}@{agent.version} is "
                        "non_idempotent but takes no idempotency_key parameter.",
                        hint="Add a keyword parameter `idempotency_key: str` and pass it to the "
                        "system the tool writes to, so that a retried call is deduplicated; "
                        "or classify the tool correctly.",
                        obj=_dotted_path(tool.func),
                        id="durable_agents.E010",
                    )
                )
        missing = _missing_betas(agent, app_settings.BETAS)
        if missing:
            messages.append(
                Warning(
                    f"Agent {agent.name}@{agent.version} configures context_management edits "
                    f"({', '.join(missing)}) without their beta.",
                    hint="Add "
                    + " and ".join(repr(EDIT_BETAS[edit]) for edit in missing)
                    + " to Agent(betas=[...]) (or to the BETAS setting): without it every "
                    "call is refused with a 400 and the run goes to the dead letter.",
                    obj=agent.label,
                    id="durable_agents.W004",
                )
            )
    return [
        *messages,
        *_rate_limits_for_unknown_models({a.model for a in registry.all()}),
        *_unused_prices(registry.all()),
    ]


IRREVERSIBLE_OUTLASTS_GRACE = "durable_agents.W008"


@register()
def check_shutdown_grace(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """An irreversible tool whose calls may outlast the shutdown grace: a worker stopped while
    one runs (Ctrl-C, a deploy's SIGTERM) abandons it when the grace ends, and its intent's
    outcome becomes unknown, for a person to find out and resolve. One warning per tool, at
    the longest timeout any agent gives it."""
    from durable_agents.declare.agents import registry
    from durable_agents.declare.tools import EffectClass

    grace, ceiling = app_settings.SHUTDOWN_GRACE_SECONDS, app_settings.TOOL_TIMEOUT
    if not all(_in_bounds(v, False, 0, True) for v in (grace, ceiling)):
        return []  # E003 says what is wrong with them
    # Tool function -> (its name, the longest timeout, the agents that give it one too long).
    longest: dict[Any, tuple[str, float, list[str]]] = {}
    for agent in registry.all():
        for tool in agent.tools:
            if tool.effect is not EffectClass.IRREVERSIBLE:
                continue
            timeout = agent.timeout_for(tool, float(ceiling))
            if timeout <= grace:
                continue
            _, known, agents = longest.get(tool.func, (tool.name, 0.0, []))
            longest[tool.func] = (tool.name, max(known, timeout), [*agents, agent.label])
    messages: list[CheckMessage] = []
    for func, (name, timeout, agents) in longest.items():
        messages.append(
            Warning(
                f"The irreversible tool {name!r} (of {', '.join(agents)}) may run for "
                f"{timeout:g}s, its timeout, longer than SHUTDOWN_GRACE_SECONDS ({grace:g}s): "
                "a worker stopped while it runs (Ctrl-C, a deploy's SIGTERM) abandons the call "
                "when the grace ends, and a person must then find out whether it took effect.",
                hint=f"If its calls are quicker than that, give the tool a timeout within the "
                f"grace: @tool(effect='irreversible', timeout={grace:g}). Else raise "
                f"SHUTDOWN_GRACE_SECONDS (or runagents --grace-seconds) to at least {timeout:g}, "
                "and the time your supervisor allows between SIGTERM and SIGKILL with it "
                "(Kubernetes terminationGracePeriodSeconds, systemd TimeoutStopSec).",
                obj=_dotted_path(func),
                id=IRREVERSIBLE_OUTLASTS_GRACE,
            )
        )
    return messages


def _rate_limits_for_unknown_models(models: set[str]) -> list[CheckMessage]:
    """A model in RATE_LIMITS that no agent uses: most likely a typo, and the model meant
    goes unlimited."""
    limits = app_settings.RATE_LIMITS
    if not isinstance(limits, dict) or not models:
        return []
    return [
        Warning(
            f"DURABLE_AGENTS['RATE_LIMITS'] names model {name!r}, which no registered agent uses.",
            hint=f"The agents use {', '.join(sorted(models))}. A misspelt model goes unlimited; "
            'use "*" for the limits of any model not named.',
            id="durable_agents.W030",
        )
        for name in sorted(set(limits) - models - {ANY_MODEL}, key=str)
        if isinstance(name, str)
    ]


def _unused_prices(agents: list[Any]) -> list[CheckMessage]:
    """A model in PRICES that no registered agent uses is most likely a typo: the runs of
    the model meant would go unpriced (runs started with another model than their agent's
    are possible, hence a warning)."""
    prices = app_settings.PRICES
    if not isinstance(prices, dict):
        return []
    used = {agent.model for agent in agents}
    return [
        Warning(
            f"DURABLE_AGENTS['PRICES'] prices {model!r}, which no registered agent uses.",
            hint=f"Agents use: {', '.join(sorted(used)) or 'none'}. A misspelt model name "
            'leaves its runs without a price ("no price" in the admin).',
            id="durable_agents.W010",
        )
        for model in prices
        if isinstance(model, str) and model != "*" and model not in used
    ]


# The anthropic-beta each server-side context edit needs: the API refuses the edit without it.
EDIT_BETAS = {
    "compact_20260112": "compact-2026-01-12",
    "clear_tool_uses_20250919": "context-management-2025-06-27",
    "clear_thinking_20251015": "context-management-2025-06-27",
}


def _missing_betas(agent: Any, global_betas: Any) -> list[str]:
    """The context_management edits of ``agent`` whose beta is in neither its betas nor
    ``global_betas``."""
    management = agent.params.get("context_management")
    edits = management.get("edits") if isinstance(management, dict) else None
    if not isinstance(edits, list):
        return []
    sent = set(agent.betas) | set(global_betas or ())
    missing = []
    for edit in edits:
        kind = edit.get("type") if isinstance(edit, dict) else None
        if kind in EDIT_BETAS and EDIT_BETAS[kind] not in sent and kind not in missing:
            missing.append(kind)
    return missing
