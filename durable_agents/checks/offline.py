"""``OFFLINE`` and the API credentials: the offline scripted model with ``DEBUG`` off (E011),
and the real API without a key (W002, and E040 in a worker)."""

from __future__ import annotations

import os

from django.conf import settings
from django.core.checks import CheckMessage, Error, Warning

from durable_agents.conf import DEFAULTS, app_settings

# Referred to by runagents, whose --allow-offline lets this one check pass.
OFFLINE_WITHOUT_DEBUG = "durable_agents.E011"


def offline_without_debug() -> list[CheckMessage]:
    """The offline scripted model with DEBUG off: in production, whoever writes a task
    would decide which tools run."""
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


def online_without_api_key() -> list[CheckMessage]:
    """The real API and no key to call it with: every model call would fail. A warning
    among the settings (a web server needs no key); ``worker_checks`` makes it an error
    for a worker."""
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
