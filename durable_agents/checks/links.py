"""The links of notification mails: ``SITE_URL`` is an address they can start with (E017), and
is set whenever the mails are on (W007)."""

from __future__ import annotations

import uuid
from typing import Any
from urllib.parse import urlsplit

from django.core.checks import CheckMessage, Error, Warning, register
from django.urls import NoReverseMatch, reverse

from durable_agents.conf import app_settings

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


def bad_site_url() -> list[CheckMessage]:
    """A ``SITE_URL`` that the links of notification mails cannot start with."""
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
