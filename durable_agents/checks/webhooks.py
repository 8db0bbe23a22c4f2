"""``WEBHOOKS`` (E070 to E075, W070): each entry a dict of known keys, an http(s) URL that is
not this site, known events, a long enough secret, and a template that renders."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from django.conf import settings
from django.core.checks import CheckMessage, Error, Warning
from django.http.request import split_domain_port, validate_host

from durable_agents import webhooks
from durable_agents.conf import app_settings

WEBHOOK_CHECK_IDS = {
    "entry": "durable_agents.E070",
    "url": "durable_agents.E071",
    "this_site": "durable_agents.E072",
    "events": "durable_agents.E073",
    "secret": "durable_agents.E074",
    "template": "durable_agents.E075",
    "allowed_host": "durable_agents.W070",
}
WEBHOOK_HINT = (
    'Each webhook is {"url": "https://...", "events": ["intent.waiting", ...], "secret": '
    '"<at least 32 characters>", "template": optional}; see docs/howto/webhooks.md.'
)


def _default_port(scheme: str) -> int:
    return 443 if scheme == "https" else 80


def _host_port(url: str) -> tuple[str, int] | None:
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError:
        return None
    if not parts.hostname:
        return None
    return parts.hostname.lower(), port or _default_port(parts.scheme)


def bad_webhooks() -> list[CheckMessage]:
    hooks = app_settings.WEBHOOKS
    if not isinstance(hooks, list | tuple):
        return [
            Error(
                "DURABLE_AGENTS['WEBHOOKS'] must be a list of webhooks, not "
                f"{type(hooks).__name__}.",
                hint=WEBHOOK_HINT,
                id=WEBHOOK_CHECK_IDS["entry"],
            )
        ]
    messages: list[CheckMessage] = []
    for position, hook in enumerate(hooks):
        messages += _bad_hook(position, hook)
    return messages


def _bad_hook(position: int, hook: Any) -> list[CheckMessage]:
    name = f"DURABLE_AGENTS['WEBHOOKS'][{position}]"
    if not isinstance(hook, Mapping):
        return [
            Error(
                f"{name} must be a dict, not {type(hook).__name__}.",
                hint=WEBHOOK_HINT,
                id=WEBHOOK_CHECK_IDS["entry"],
            )
        ]
    messages: list[CheckMessage] = []
    unknown = sorted(set(map(str, hook)) - set(webhooks.HOOK_KEYS))
    if unknown:
        messages.append(
            Error(
                f"{name} has unknown key(s) {', '.join(map(repr, unknown))}.",
                hint=WEBHOOK_HINT,
                id=WEBHOOK_CHECK_IDS["entry"],
            )
        )
    messages += _bad_url(name, hook.get("url"))
    events = hook.get("events")
    if (
        not isinstance(events, list | tuple)
        or not events
        or not all(isinstance(event, str) for event in events)
    ):
        messages.append(
            Error(
                f"{name}['events'] must be a non-empty list of event names, not {events!r}.",
                hint=f"The events: {', '.join(webhooks.EVENTS)}.",
                id=WEBHOOK_CHECK_IDS["events"],
            )
        )
        events = []
    else:
        unknown_events = [event for event in events if event not in webhooks.EVENTS]
        if unknown_events:
            messages.append(
                Error(
                    f"{name}['events'] names unknown event(s) "
                    f"{', '.join(map(repr, unknown_events))}.",
                    hint=f"The events: {', '.join(webhooks.EVENTS)}.",
                    id=WEBHOOK_CHECK_IDS["events"],
                )
            )
    secret = hook.get("secret")
    if not isinstance(secret, str) or len(secret) < webhooks.MIN_SECRET_CHARS:
        # Never shown: only what is wrong with it.
        what = f"is shorter than {webhooks.MIN_SECRET_CHARS} characters"
        if secret is None:
            what = "is missing"
        if secret is not None and not isinstance(secret, str):
            what = "is not a string"
        messages.append(
            Error(
                f"{name}['secret'] {what}: every delivery is signed with it.",
                hint="A random secret of at least 32 characters, shared with the receiver only, "
                'e.g. python -c "import secrets; print(secrets.token_urlsafe(32))".',
                id=WEBHOOK_CHECK_IDS["secret"],
            )
        )
    messages += _bad_template(name, hook.get("template"), events)
    return messages


def _bad_url(name: str, url: Any) -> list[CheckMessage]:
    if not isinstance(url, str):
        return [
            Error(
                f"{name}['url'] must be an http:// or https:// URL, not {url!r}.",
                hint=WEBHOOK_HINT,
                id=WEBHOOK_CHECK_IDS["url"],
            )
        ]
    try:
        parts = urlsplit(url.strip())
        parts.port  # noqa: B018 - raises on a port that is not a number
    except ValueError as exc:
        return [
            Error(
                f"{name}['url'] is not a URL ({exc}): {url!r}.",
                hint=WEBHOOK_HINT,
                id=WEBHOOK_CHECK_IDS["url"],
            )
        ]
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return [
            Error(
                f"{name}['url'] must start with http:// or https:// and name a host, not {url!r}.",
                hint=WEBHOOK_HINT,
                id=WEBHOOK_CHECK_IDS["url"],
            )
        ]
    target = _host_port(url)
    site = app_settings.SITE_URL
    site_target = _host_port(site) if isinstance(site, str) and site.strip() else None
    if target is not None and target == site_target:
        return [
            Error(
                f"{name}['url'] points at this site ({target[0]}:{target[1]}, the host and port "
                f"of SITE_URL): {url!r}.",
                hint="A webhook goes to another service (a chat, a pager, your own receiver); "
                "posting events to this site would let a setting make it call itself.",
                id=WEBHOOK_CHECK_IDS["this_site"],
            )
        ]
    allowed = [host for host in settings.ALLOWED_HOSTS if host != "*"]
    host = split_domain_port(parts.netloc.rpartition("@")[2])[0]
    if target is not None and validate_host(host, allowed):
        return [
            Warning(
                f"{name}['url'] names a host this site answers to (in ALLOWED_HOSTS): {url!r}.",
                hint="If the receiver is another service on that host (another port), silence "
                "this id; if it is this site, use another receiver.",
                id=WEBHOOK_CHECK_IDS["allowed_host"],
            )
        ]
    return []


def _bad_template(name: str, template: Any, events: Any) -> list[CheckMessage]:
    if template is None:
        return []
    if not isinstance(template, str):
        return [
            Error(
                f"{name}['template'] must be a string, not {type(template).__name__}.",
                id=WEBHOOK_CHECK_IDS["template"],
            )
        ]
    for event in [e for e in events if e in webhooks.EVENTS] or [webhooks.EVENTS[0]]:
        payload = webhooks.sample_payload(event)
        try:
            webhooks.render_template(template, webhooks.template_fields(payload))
        except webhooks.TemplateProblem as exc:
            return [
                Error(
                    f"{name}['template'] does not render: {exc}.",
                    hint="A str.format string of plain field names, e.g. "
                    '"{tool} waits for run {run_id}: {approve_url}" (write {{ and }} for '
                    "braces).",
                    id=WEBHOOK_CHECK_IDS["template"],
                )
            ]
    return []
