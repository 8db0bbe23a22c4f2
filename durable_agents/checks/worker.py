"""``worker_checks``: the checks of a process that calls the model, which only ``runagents``
runs (E040: no API credentials)."""

from __future__ import annotations

from typing import Any

from django.core.checks import CheckMessage, Error
from django.core.checks.registry import CheckRegistry

from durable_agents.checks.offline import online_without_api_key

# Checks of a process that calls the model: ``runagents`` runs them at start, with Django's.
# They are not in Django's registry, whose checks every manage.py command runs (migrate, shell,
# a web server's start): none of those needs an API key, and refusing them would break them.
worker_checks = CheckRegistry()
WORKER_WITHOUT_CREDENTIALS = "durable_agents.E040"


@worker_checks.register("durable_agents_worker")
def check_worker_credentials(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """A worker that would call the API with no key: every run it claims would be refused."""
    if not online_without_api_key():
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
