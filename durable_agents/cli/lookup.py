"""What an operator types, checked before anything is read or done: a bad value is a
``CommandError`` that says what is wrong and what would be right, and a command given several
runs acts on none of them unless every one names exactly one run."""

from __future__ import annotations

import datetime
import json
import re
import uuid
from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import CommandError
from django.utils import timezone

from durable_agents._internal.text import storable_text
from durable_agents.models import AgentRun, IntentStatus, RunStatus
from durable_agents.models.runs import run_id_prefix, short_id_match

# ``--since 90m``, ``2h``, ``3d``, ``1w``.
_DURATION = re.compile(r"^(?P<count>\d{1,6})(?P<unit>[smhdw])$")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3_600, "d": 86_400, "w": 604_800}
# The longest text of an argument quoted back in an error.
QUOTED_CHARS = 80


def quoted(value: str) -> str:
    """An argument quoted back in an error message, escaped and cut (it may be pasted junk)."""
    return repr(storable_text(value, QUOTED_CHARS))


def run_statuses(values: list[str] | None) -> list[str]:
    """``--status`` values, each a run status."""
    valid = [status.value for status in RunStatus]
    for value in values or []:
        if value not in valid:
            raise CommandError(
                f"unknown run status {quoted(value)}: the statuses are {', '.join(valid)}"
            )
    return list(dict.fromkeys(values or []))


def since(value: str | None, now: datetime.datetime | None = None) -> datetime.datetime | None:
    """``--since``: an ISO 8601 time (UTC when it names no zone) or a duration back from now
    (``90m``, ``2h``, ``3d``, ``1w``)."""
    if value is None:
        return None
    match = _DURATION.match(value.strip())
    if match:
        seconds = int(match["count"]) * _UNIT_SECONDS[match["unit"]]
        return (now or timezone.now()) - datetime.timedelta(seconds=seconds)
    try:
        moment = datetime.datetime.fromisoformat(value.strip())
    except ValueError:
        raise CommandError(
            f"--since {quoted(value)} is neither a time in ISO 8601 (2026-12-06T09:00:00Z) "
            "nor a duration back from now (90m, 2h, 3d, 1w)"
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.UTC)
    return moment


def metadata_pairs(values: list[str] | None) -> dict[str, Any]:
    """``--metadata key=value`` pairs: each value as JSON when it parses (``order=42`` is the
    number, ``vip=true`` the boolean), else as the string typed (``tenant=acme``)."""
    pairs: dict[str, Any] = {}
    for item in values or []:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise CommandError(f"--metadata takes key=value, not {quoted(item)}")
        if "\x00" in item:
            raise CommandError("--metadata cannot hold a NUL character")
        try:
            value: Any = json.loads(text)
        except ValueError:
            value = text
        pairs[key] = value
    return pairs


def positive(value: int, name: str) -> int:
    if value < 1:
        raise CommandError(f"{name} is a whole number of at least 1, not {value}")
    return value


def run_named(term: str) -> AgentRun:
    """The one run ``term`` names: a whole run id, or a short id as the admin shows it (the
    last 8 hex digits of a time-ordered id, or the first characters of any id). Anything else,
    no run, or several runs is a ``CommandError``."""
    text = term.strip()
    try:
        pk = uuid.UUID(text)
    except ValueError:
        pk = None
    if pk is not None:
        run = AgentRun.objects.filter(pk=pk).first()
        if run is None:
            raise CommandError(f"there is no run {pk}")
        return run
    condition = short_id_match(text) if run_id_prefix(text) is not None else None
    if condition is None:
        raise CommandError(
            f"{quoted(term)} is not a run id: give the whole id (a UUID) or its short id as "
            "the admin shows it (8 hex digits)"
        )
    found = list(AgentRun.objects.filter(condition).order_by("pk")[:3])
    if not found:
        raise CommandError(f"no run has the short id {quoted(text)}, nor an id that starts with it")
    if len(found) > 1:
        raise CommandError(
            f"several runs have the short id {quoted(text)} or an id that starts with it "
            f"({', '.join(str(run.pk) for run in found[:2])}, ...): give the whole id"
        )
    return found[0]


def runs_named(terms: list[str]) -> list[AgentRun]:
    """Every run ``terms`` name, in their order without repeats; the first term that names no
    run, or several, is a ``CommandError`` before anything is done to any of them."""
    runs: dict[uuid.UUID, AgentRun] = {}
    for term in terms:
        run = run_named(term)
        runs.setdefault(run.pk, run)
    return list(runs.values())


def intent_id(value: str) -> int:
    """An intent id as typed: a positive whole number."""
    text = value.strip().lstrip("#")
    if not text.isdigit() or not text.isascii() or len(text) > 19:
        raise CommandError(f"{quoted(value)} is not an intent id (a whole number, as listed)")
    return int(text)


def operator(username: str, permission: str, doing: str) -> Any:
    """The user named ``username``, who must exist, be active and hold ``permission`` to be
    ``doing`` something; refused with a ``CommandError`` that says which of these fails."""
    model = get_user_model()
    try:
        user = model._default_manager.get_by_natural_key(username)
    except model.DoesNotExist:
        raise CommandError(f"there is no user {quoted(username)}") from None
    if not user.is_active:
        raise CommandError(f"user {quoted(username)} is not active: {doing} is refused")
    if not user.has_perm(permission):
        raise CommandError(
            f"user {quoted(username)} does not hold the {permission} permission: {doing} is refused"
        )
    return user


def intent_statuses(values: list[str] | None) -> list[str]:
    """``--status`` values of the intents list, each an intent status."""
    valid = [status.value for status in IntentStatus]
    for value in values or []:
        if value not in valid:
            raise CommandError(
                f"unknown intent status {quoted(value)}: the statuses are {', '.join(valid)}"
            )
    return list(dict.fromkeys(values or []))
