"""Concurrency keys in the admin: a run's key and its state on the runs list and the run's page
(the key's limit, its runs holding a slot, whether this run holds one or waits for one), and
the runs list filtered by key (the index agent_run_key)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlencode

from django.contrib import admin
from django.db.models import Count, QuerySet
from django.db.models.functions import Now
from django.http import HttpRequest
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html
from django.utils.safestring import SafeString
from django.utils.text import Truncator
from django.utils.translation import gettext
from django.utils.translation import gettext_lazy as _

from durable_agents._internal.text import plain_markers, revealed, storable_text
from durable_agents.models import AgentRun, ConcurrencyKey, RunStatus
from durable_agents.store import concurrency, key_rows

# The filter lists this many keys (in key order); any other is reached from a run's page (its
# key links to the list filtered by it) or by the URL parameter.
FILTER_KEYS = 50
# How much of a key the runs list shows (the whole key is its title).
LIST_KEY_CHARS = 14


# Where a key's limit in force comes from, strongest first.
FROM_ROW = "row"  # staff set it on the key's page (ConcurrencyKey.concurrency_limit)
FROM_SETTING = "setting"  # CONCURRENCY_LIMITS
FROM_AGENT = "agent"  # the run's agent (its concurrency_limit, pinned on the run), or none


@dataclasses.dataclass(frozen=True)
class KeyState:
    """A run's concurrency key as a claim sees it now."""

    key: str
    limit: int | None  # None: no limit
    source: str  # FROM_ROW, FROM_SETTING or FROM_AGENT
    held: int  # the key's runs running with a live lease

    def holds(self, run: AgentRun) -> bool:
        """Running with a live lease (the database's clock decides for the claim; the web
        server's is close enough for a page)."""
        return (
            run.status == RunStatus.RUNNING
            and run.lease_until is not None
            and run.lease_until >= timezone.now()
        )

    def waits(self, run: AgentRun) -> bool:
        """A pending run that no claim may take while its key is full (or held at 0)."""
        return (
            run.status == RunStatus.PENDING and self.limit is not None and self.held >= self.limit
        )


def attach_key_states(runs: Sequence[AgentRun]) -> None:
    """``run.key_state`` for each keyed run of ``runs``: one query for all their keys."""
    keys = {run.concurrency_key for run in runs if run.concurrency_key is not None}
    if not keys:
        return
    counts = (
        AgentRun.objects.filter(
            concurrency_key__in=keys, status=RunStatus.RUNNING, lease_until__gte=Now()
        )
        .order_by()
        .values("concurrency_key")
        .annotate(n=Count("pk"))
        .values_list("concurrency_key", "n")
    )
    held = {key: n for key, n in counts if key is not None}
    setting, rows = concurrency.overrides(), key_rows.limit_overrides()
    limits = {**setting, **rows}  # as the claim reads them: the key's row first
    for run in runs:
        key = run.concurrency_key
        if key is not None:
            run.key_state = KeyState(  # type: ignore[attr-defined]
                key=key,
                limit=concurrency.limit_of(key, run.concurrency_limit, limits),
                source=FROM_ROW if key in rows else FROM_SETTING if key in setting else FROM_AGENT,
                held=held.get(key, 0),
            )


def key_limit(key: str, row_limit: int | None) -> tuple[int | None, str]:
    """The limit in force for every run of ``key`` whatever its agent, and where it comes
    from: the key's row (``row_limit``, set on its page), else CONCURRENCY_LIMITS, else none
    (FROM_AGENT: each run's agent decides, by the limit pinned on the run)."""
    if row_limit is not None:
        return row_limit, FROM_ROW
    setting = concurrency.overrides()
    if key in setting:
        return setting[key], FROM_SETTING
    return None, FROM_AGENT


def agent_limits() -> list[tuple[str, int]]:
    """The registered agents that limit their runs per key themselves, and their limits."""
    from durable_agents.declare.agents import registry

    return sorted(
        (agent.label, agent.concurrency_limit)
        for agent in registry.all()
        if agent.concurrency_limit is not None
    )


def limit_in_force_text(key: str, row_limit: int | None) -> str:
    """The key page's line on its limit: the number and where it comes from."""
    limit, source = key_limit(key, row_limit)
    if source == FROM_ROW:
        setting = concurrency.overrides().get(key)
        if setting is not None:
            return gettext(
                "%(limit)s, set on this page (it overrides CONCURRENCY_LIMITS, %(setting)s)"
            ) % {"limit": limit, "setting": setting}
        return gettext("%(limit)s, set on this page") % {"limit": limit}
    if source == FROM_SETTING:
        return gettext("%(limit)s, from the CONCURRENCY_LIMITS setting") % {"limit": limit}
    agents = agent_limits()
    if not agents:
        return gettext("none: no limit for this key")
    return gettext("none for the key: each run keeps its agent's own limit (%(agents)s)") % {
        "agents": ", ".join(f"{label}: {n}" for label, n in agents)
    }


def _keyed_list_url(key: str) -> str:
    return (
        reverse("admin:durable_agents_agentrun_changelist")
        + "?"
        + urlencode({KeyFilter.parameter_name: key})
    )


def list_summary(run: AgentRun) -> SafeString | None:
    """Under the status on the runs list: the key (cut), and that the run waits for it."""
    state: KeyState | None = getattr(run, "key_state", None)
    if state is None:
        return None
    key = storable_text(state.key)
    html = format_html(
        '<a class="da-meta da-key" href="{}" title="{}">{}</a>',
        _keyed_list_url(state.key),
        gettext("concurrency key %(key)s") % {"key": plain_markers(key)},
        revealed(Truncator(key).chars(LIST_KEY_CHARS)),
    )
    if state.waits(run):
        html = format_html(
            '{}<br><span class="da-meta da-key-wait">{}</span>', html, waits_text(state)
        )
    return html


def waits_text(state: KeyState) -> str:
    if state.limit == 0:
        return gettext("waits for its key (limit 0)")
    return gettext("waits for its key (%(held)s of %(limit)s running)") % {
        "held": state.held,
        "limit": state.limit,
    }


def detail(run: AgentRun) -> SafeString | str:
    """The run page's line on its key: the key (linking to its runs), its limit and where the
    limit comes from, and whether this run holds one of its slots or waits for one."""
    attach_key_states([run])
    state: KeyState | None = getattr(run, "key_state", None)
    if state is None:
        return gettext("none: no concurrency limit")
    if state.limit is None:
        limit = gettext("no limit")
    elif state.source == FROM_ROW:
        limit = gettext("limit %(limit)s (set on the key's page)") % {"limit": state.limit}
    elif state.source == FROM_SETTING:
        limit = gettext("limit %(limit)s (CONCURRENCY_LIMITS)") % {"limit": state.limit}
    else:
        limit = gettext("limit %(limit)s (the agent's)") % {"limit": state.limit}
    if state.holds(run):
        where = gettext("this run holds one of its slots; %(held)s running") % {"held": state.held}
    elif state.waits(run):
        where = waits_text(state)
    else:
        where = gettext("%(held)s running; this run holds no slot") % {"held": state.held}
    return format_html(
        '<a href="{}" id="concurrency-key">{}</a> · {} · <span id="key-slot">{}</span>',
        _keyed_list_url(state.key),
        revealed(state.key),
        limit,
        where,
    )


class KeyFilter(admin.SimpleListFilter):
    """Runs of one concurrency key (exactly; the index agent_run_key, newest first). Lists the
    first keys of agent_concurrency_key, one row per key: never a scan of the runs."""

    title = _("concurrency key")
    parameter_name = "concurrency_key"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        keys = ConcurrencyKey.objects.order_by("key").values_list("key", flat=True)
        found = [(key, plain_markers(Truncator(key).chars(30))) for key in keys[:FILTER_KEYS]]
        chosen = self.value()
        if chosen and chosen not in {key for key, _ in found}:
            found.append((chosen, plain_markers(Truncator(storable_text(chosen)).chars(30))))
        return found

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        if value:
            return queryset.filter(concurrency_key=value)
        return queryset
