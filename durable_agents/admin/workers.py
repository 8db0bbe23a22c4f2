"""The fleet in the admin: the workers (``agent_worker``), each as its last heartbeat described
it, and the agent versions workers define or defined (``agent_version``). Both are written by
the workers and housekeeping, never by a person: view only, for whoever has the view
permission of the model.

Worker ids and host names come from outside (``runagents --worker-id``, the host's name):
every value is escaped, its invisible characters drawn as markers, and an id from a URL that
no row can hold is a 404."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.contrib import admin
from django.contrib.admin.views.main import ChangeList
from django.http import Http404, HttpRequest
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString, mark_safe
from django.utils.translation import gettext
from django.utils.translation import gettext_lazy as _

from durable_agents._internal.text import has_unstorable, revealed
from durable_agents.admin.base import ReadOnlyAdmin, StrictChangeList
from durable_agents.admin.format import ago, badge, format_time
from durable_agents.models import (
    MAX_WORKER_ID,
    AgentRun,
    AgentVersion,
    AgentWorker,
    RunStatus,
    WaitKind,
)
from durable_agents.observe.fleet import defined_versions, serving, short

LIVE_COLORS = {"live": "#1a7f37", "gone": "#57606a", "draining": "#9a6700"}


def _time_and_age(value: Any) -> SafeString:
    """``2026-12-06 11:00:00`` and under it ``3m ago``."""
    if value is None:
        return format_html("{}", "—")
    return format_html('{}<br><span class="da-meta">{}</span>', format_time(value), ago(value))


class LiveFilter(admin.SimpleListFilter):
    title = _("state")
    parameter_name = "state"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, Any]]:
        return [("live", _("live")), ("gone", _("gone"))]

    def queryset(self, request: HttpRequest, queryset: Any) -> Any:
        if self.value() == "live":
            return queryset.live()
        if self.value() == "gone":
            return queryset.gone()
        return queryset


class WorkerAdmin(ReadOnlyAdmin[AgentWorker]):
    """Every worker row: live ones beat within a lease; a gone one (killed, or its host lost)
    stays, shown as gone, until housekeeping removes it an hour after its last beat."""

    list_display = (
        "worker_id",
        "host_shown",
        "pid",
        "started",
        "last_beat",
        "state",
        "concurrency",
        "runs_held",
        "draining",
        "versions_shown",
    )
    list_filter = (LiveFilter, "draining")
    search_fields = ("id", "host")
    fields = (
        "worker_id",
        "instance",
        "host_shown",
        "pid",
        "started",
        "last_beat",
        "alive_until_shown",
        "state",
        "concurrency",
        "runs_held",
        "draining",
        "versions_shown",
    )
    readonly_fields = fields
    list_per_page = 100
    ordering = ("id",)

    @admin.display(description=_("worker id"), ordering="id")
    def worker_id(self, obj: AgentWorker) -> SafeString:
        return revealed(obj.id)

    @admin.display(description=_("host"), ordering="host")
    def host_shown(self, obj: AgentWorker) -> SafeString:
        return revealed(obj.host)

    @admin.display(description=_("started"), ordering="started_at")
    def started(self, obj: AgentWorker) -> SafeString:
        return _time_and_age(obj.started_at)

    @admin.display(description=_("last heartbeat"), ordering="beat_at")
    def last_beat(self, obj: AgentWorker) -> SafeString:
        return _time_and_age(obj.beat_at)

    @admin.display(description=_("live until"), ordering="alive_until")
    def alive_until_shown(self, obj: AgentWorker) -> str:
        return format_time(obj.alive_until)

    @admin.display(description=_("state"), ordering="alive_until")
    def state(self, obj: AgentWorker) -> SafeString:
        if obj.alive_until <= timezone.now():
            return badge("gone", gettext("gone"), LIVE_COLORS, gettext("no heartbeat for a lease"))
        if obj.draining:
            return badge("draining", gettext("live, draining"), LIVE_COLORS)
        return badge("live", gettext("live"), LIVE_COLORS)

    @admin.display(description=_("agent versions it defines"))
    def versions_shown(self, obj: AgentWorker) -> SafeString | str:
        defined = defined_versions(obj.versions)
        if not defined:
            return self.get_empty_value_display()
        return format_html_join(
            mark_safe("<br>"),
            '<span title="{}">{}@{}</span> <code class="da-meta">{}</code>',
            (
                (
                    gettext("model %(model)s, fingerprint %(fingerprint)s")
                    % {"model": entry["model"], "fingerprint": entry["fingerprint"]},
                    revealed(entry["agent"]),
                    revealed(entry["version"]),
                    short(entry["fingerprint"]),
                )
                for entry in defined
            ),
        )

    def get_object(
        self, request: HttpRequest, object_id: str, from_field: Any = None
    ) -> AgentWorker | None:
        # The id is text from the URL: a NUL or a lone surrogate is a database error on
        # PostgreSQL (a 500), and names no worker anyway.
        if has_unstorable(object_id) or len(object_id) > MAX_WORKER_ID:
            raise Http404(gettext("No worker matches the given id."))
        return super().get_object(request, object_id, from_field)


class VersionChangeList(StrictChangeList):
    """The page's versions, each told whether a live worker defines it now (one query of the
    live worker rows, whatever the page holds)."""

    def get_results(self, request: HttpRequest) -> None:
        super().get_results(request)
        live: set[tuple[str, str, str]] = set()
        for versions in AgentWorker.objects.live().values_list("versions", flat=True):
            for entry in defined_versions(versions):
                live.add((entry["agent"], entry["version"], entry["fingerprint"]))
        for row in self.result_list:
            row.defined_now = (row.agent, row.version, row.fingerprint) in live


class AgentVersionAdmin(ReadOnlyAdmin[AgentVersion]):
    """Each agent version with one definition (fingerprint), when workers first and last
    defined it, and whether a live worker defines it now."""

    list_display = (
        "agent_shown",
        "version_shown",
        "fingerprint_short",
        "model",
        "first_defined",
        "last_defined",
        "live_now",
    )
    list_filter = ("agent",)
    search_fields = ("agent", "version", "=fingerprint")
    fields = (
        "agent_shown",
        "version_shown",
        "fingerprint",
        "model",
        "binding",
        "tools_shown",
        "first_defined",
        "last_defined",
    )
    readonly_fields = fields
    list_per_page = 100

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return VersionChangeList

    @admin.display(description=_("agent"), ordering="agent")
    def agent_shown(self, obj: AgentVersion) -> SafeString:
        return revealed(obj.agent)

    @admin.display(description=_("version"), ordering="version")
    def version_shown(self, obj: AgentVersion) -> SafeString:
        return revealed(obj.version)

    @admin.display(description=_("fingerprint"))
    def fingerprint_short(self, obj: AgentVersion) -> SafeString:
        return format_html('<code title="{}">{}</code>', obj.fingerprint, short(obj.fingerprint))

    @admin.display(description=_("first defined"), ordering="first_defined_at")
    def first_defined(self, obj: AgentVersion) -> SafeString:
        return _time_and_age(obj.first_defined_at)

    @admin.display(description=_("last defined"), ordering="last_defined_at")
    def last_defined(self, obj: AgentVersion) -> SafeString:
        return _time_and_age(obj.last_defined_at)

    @admin.display(description=_("defined by a live worker now"), boolean=True)
    def live_now(self, obj: AgentVersion) -> bool | None:
        return getattr(obj, "defined_now", None)

    @admin.display(description=_("tools"))
    def tools_shown(self, obj: AgentVersion) -> SafeString | str:
        tools = obj.tools if isinstance(obj.tools, dict) else {}
        if not tools:
            return self.get_empty_value_display()
        return format_html_join(
            mark_safe("<br>"),
            '{} <code class="da-meta">{}</code>',
            ((revealed(name), short(str(digest))) for name, digest in sorted(tools.items())),
        )


@dataclass(frozen=True)
class WorkerWait:
    """A run no live worker can serve, as its page says it: the version it needs,
    and, when live workers define that version with another definition, the fingerprint it
    needs and theirs."""

    label: str
    fingerprint: str = ""  # the run's, shown when live workers define the version otherwise
    theirs: tuple[str, ...] = ()
    live_workers: int = 0  # live workers that define the version (with any fingerprint)


def worker_wait(run: AgentRun) -> WorkerWait | None:
    """What the run page says about the worker a run waits for: a run waiting for one
    (``WaitKind.WORKER``), or a pending run whose version no live worker defines, or the live
    workers that do define it with another fingerprint (for the run's model). One query (the
    live worker rows), for those runs only."""
    waits_for_one = run.status == RunStatus.WAITING and run.waiting_for == WaitKind.WORKER
    if run.status != RunStatus.PENDING and not waits_for_one:
        return None
    found = serving(run.agent, run.prompt_version)
    theirs = found.other_fingerprints(run.model, run.fingerprint) if found.workers else ()
    if found.workers and not theirs and not waits_for_one:
        return None
    shown = tuple(short(f) for f in theirs)
    return WorkerWait(
        found.label, short(run.fingerprint) if theirs else "", shown, len(found.workers)
    )
