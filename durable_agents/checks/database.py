"""The ``DATABASES`` setting: SQLite with ``DEBUG`` off (W003), and a PostgreSQL entry naming
several hosts whose ports do not match them (E050) or that may reach a standby (W050)."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Error, Tags, Warning, register
from django.db import connections


@register(Tags.database)
def check_database(
    app_configs: Any = None, databases: Any = None, **kwargs: Any
) -> list[CheckMessage]:
    """SQLite with DEBUG off: it serves one host and one worker process, not a production
    deployment."""
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
