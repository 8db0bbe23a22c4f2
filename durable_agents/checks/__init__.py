"""System checks (``manage.py check``) for configuration mistakes that would otherwise show up
only when a worker meets them, hours later.

One id per problem; docs/ref/checks.md lists them all. Ids are never reused for another problem:
a silenced id (``SILENCED_SYSTEM_CHECKS``) must keep silencing the same thing.

One module per job, each registering its own checks with Django when it is imported; importing
this package imports them all, once:

- ``values``: the ``DURABLE_AGENTS`` dict, key by key (``check_settings``);
- ``misspelt``: settings meant for durable_agents under a name it never reads;
- ``flow``: rate limits, budgets, prices and concurrency limits;
- ``encryption``: the encryption keys;
- ``links``: ``SITE_URL``, which the links of notification mails start with;
- ``webhooks``: the ``WEBHOOKS`` the events are posted to;
- ``offline``: ``OFFLINE`` and the API credentials;
- ``agents``: the registered agents and their tools;
- ``database``: the ``DATABASES`` setting;
- ``stored``: what the database holds, read only when a command asks;
- ``worker``: ``worker_checks``, which only ``runagents`` runs.
"""

from __future__ import annotations

from durable_agents.checks.agents import (
    EDIT_BETAS,
    IRREVERSIBLE_OUTLASTS_GRACE,
    check_agents,
    check_shutdown_grace,
)
from durable_agents.checks.database import (
    PRIMARY_ONLY,
    check_database,
    check_database_hosts,
    database_host_problems,
)
from durable_agents.checks.encryption import ENCRYPTION_CHECK_IDS, KEY_HINT
from durable_agents.checks.flow import PRICE_CHECK_IDS, PRICE_HINT
from durable_agents.checks.links import (
    NOTIFY_WITHOUT_SITE_URL,
    SITE_URL_EXAMPLE,
    check_notification_links,
)
from durable_agents.checks.misspelt import MISSPELT_SETTING, SETTING_NAME, check_misspelt_settings
from durable_agents.checks.offline import OFFLINE_WITHOUT_DEBUG
from durable_agents.checks.stored import (
    MAX_NAMED_SCHEDULES,
    PROMPT_DRIFT,
    SIX_FIELD_SCHEDULES,
    check_prompt_drift,
    check_six_field_schedules,
)
from durable_agents.checks.values import CLOSE_KEYS, NUMBER_BOUNDS, SETTINGS_DOC, check_settings
from durable_agents.checks.webhooks import WEBHOOK_CHECK_IDS
from durable_agents.checks.worker import (
    WORKER_WITHOUT_CREDENTIALS,
    check_worker_credentials,
    worker_checks,
)

__all__ = [
    "CLOSE_KEYS",
    "EDIT_BETAS",
    "ENCRYPTION_CHECK_IDS",
    "IRREVERSIBLE_OUTLASTS_GRACE",
    "KEY_HINT",
    "MAX_NAMED_SCHEDULES",
    "MISSPELT_SETTING",
    "NOTIFY_WITHOUT_SITE_URL",
    "NUMBER_BOUNDS",
    "OFFLINE_WITHOUT_DEBUG",
    "PRICE_CHECK_IDS",
    "PRICE_HINT",
    "PRIMARY_ONLY",
    "PROMPT_DRIFT",
    "SETTINGS_DOC",
    "SETTING_NAME",
    "SITE_URL_EXAMPLE",
    "SIX_FIELD_SCHEDULES",
    "WEBHOOK_CHECK_IDS",
    "WORKER_WITHOUT_CREDENTIALS",
    "check_agents",
    "check_database",
    "check_database_hosts",
    "check_misspelt_settings",
    "check_notification_links",
    "check_prompt_drift",
    "check_settings",
    "check_shutdown_grace",
    "check_six_field_schedules",
    "check_worker_credentials",
    "database_host_problems",
    "worker_checks",
]
