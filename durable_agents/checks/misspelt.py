"""Settings that look meant for durable_agents but are never read (W005): a dict under a name
like ``DURABLE_AGENTS``, or one of its keys as a top-level setting."""

from __future__ import annotations

import difflib
import re
import sys
from typing import Any

from django.conf import settings
from django.core.checks import CheckMessage, Tags, Warning, register

from durable_agents.conf import DEFAULTS

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
