"""Schedules (agents on a clock) in the admin: the list with each schedule's state, next and
last slot and the run its last slot started; the change form (saved through
``durable_agents.schedule``, so a retimed or re-enabled schedule's next slot is the first after
now, and a broken one is sound again); pause, resume and "run now" as list actions and as the
page's buttons, each a POST that checks its permission and writes a LogEntry.

A schedule's name is what code declares it by (``schedule("nightly-report", ...)`` in a data
migration or an ``AppConfig.ready``): it is set when the schedule is added here and read-only
afterwards, so that the next deploy updates this row rather than creating a second one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.contrib import admin, messages
from django.contrib.admin.views.main import ChangeList
from django.core.exceptions import PermissionDenied
from django.db import transaction
from django.db.models import F, OuterRef, Q, QuerySet, Subquery
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils import timezone
from django.utils.html import format_html
from django.utils.safestring import SafeString
from django.utils.translation import gettext, ngettext
from django.utils.translation import gettext_lazy as _

from durable_agents._internal.text import plain_markers, revealed, storable_text
from durable_agents.admin.base import AgentsAdmin, ConfirmRow, StrictChangeList, get_or_404
from durable_agents.admin.format import RUN_COLORS, RUN_SHORT_LABELS, badge, format_time, time_field
from durable_agents.admin.schedule_forms import (
    ScheduleForm,
    ScheduleState,
    registered_agents,
    state_badge,
    state_condition,
    state_of,
    timing_html,
)
from durable_agents.exceptions import AgentNotFound
from durable_agents.models import AgentRun, AgentSchedule, RunStatus, short_id
from durable_agents.schedules import defining as schedules

RUN_PERMISSION = "durable_agents.run_agentschedule"
# "Run now" from the list lists, and posts back, at most this many schedules.
RUN_NOW_LIMIT = 100
# The operations page: the next slots it lists, and the schedules in trouble.
UPCOMING_SLOTS = 10
TROUBLED_SCHEDULES = 20
TROUBLED_RUN_STATUSES = (RunStatus.FAILED, RunStatus.DEAD)


class ScheduleStateFilter(admin.SimpleListFilter):
    title = _("state")
    parameter_name = "state"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, Any]]:
        return [(state.value, state.label) for state in ScheduleState]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        if self.value() in ScheduleState.values:
            return queryset.filter(state_condition(str(self.value()), registered_agents()))
        return queryset


class AgentValuesFilter(admin.AllValuesFieldListFilter):
    """The schedules' agents (a table of a few rows per agent: SELECT DISTINCT is cheap), their
    invisible and direction-changing characters as markers."""

    def choices(self, changelist: Any) -> Any:
        for choice in super().choices(changelist):
            yield {**choice, "display": plain_markers(choice["display"])}


class ScheduleChangeList(StrictChangeList):
    """The list reads the status of each row's last run in its own query (a subquery on the
    run's primary key, which the count and the agent filter's values leave out), and not the
    tasks (they can be long, and the list does not show them)."""

    def get_queryset(self, request: HttpRequest, exclude_parameters: Any = None) -> QuerySet[Any]:
        queryset: QuerySet[Any] = super().get_queryset(request, exclude_parameters)
        annotated: QuerySet[Any] = queryset.annotate(last_run_status=last_run_status())
        return annotated.defer("task")


def last_run_status() -> Subquery:
    return Subquery(AgentRun.objects.filter(pk=OuterRef("last_run_id")).values("status")[:1])


def set_enabled(schedule_id: int, enabled: bool) -> bool:
    """Pause or resume the schedule; True when this call changed it. Resuming moves its next
    slot to the first one after now (the slots missed while paused are not run)."""
    with transaction.atomic():
        row = AgentSchedule.objects.select_for_update().filter(pk=schedule_id).first()
        if row is None or row.enabled == enabled:
            return False
        now = timezone.now()
        row.enabled = enabled
        fields = ["enabled", "updated_at"]
        if enabled:
            row.next_slot = schedules.next_slot(row, now)
            fields.append("next_slot")
        row.updated_at = now
        row.save(update_fields=fields)
        return True


class AgentScheduleAdmin(AgentsAdmin[AgentSchedule]):
    form = ScheduleForm
    list_display = (
        "name_shown",
        "agent_shown",
        "timing",
        "state",
        "next_slot_shown",
        "last_slot_display",
        "last_run_link",
    )
    list_display_links = ("name_shown",)
    list_filter = (ScheduleStateFilter, ("agent", AgentValuesFilter))
    search_fields = ("name",)
    search_help_text = _("Words of the schedule's name.")
    ordering = ("name",)
    list_per_page = 100
    show_facets = admin.ShowFacets.NEVER
    actions = ("pause_schedules", "resume_schedules", "run_schedules_now")
    readonly_fields = (
        "name_shown",
        "state_shown",
        "next_slot_shown",
        "last_slot_display",
        "last_run_link",
        "created_at_display",
        "updated_at_display",
    )

    last_slot_display = time_field("last_slot", _("last slot"))
    created_at_display = time_field("created_at", _("created at"))
    updated_at_display = time_field("updated_at", _("updated at"))

    def get_fieldsets(self, request: HttpRequest, obj: Any = None) -> Any:
        timing = (_("Timing"), {"fields": ("cron", "every", "timezone", "catch_up", "enabled")})
        runs = (_("Runs"), {"fields": ("priority", "concurrency_key")})
        if obj is None:
            return ((None, {"fields": ("name", "agent", "task")}), timing, runs)
        return (
            (None, {"fields": ("name_shown", "state_shown", "agent", "task")}),
            timing,
            runs,
            (
                _("Slots"),
                {"fields": ("next_slot_shown", "last_slot_display", "last_run_link")},
            ),
            (_("Timestamps"), {"fields": ("created_at_display", "updated_at_display")}),
        )

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return ScheduleChangeList

    def _state(self, obj: AgentSchedule) -> tuple[ScheduleState, str]:
        # The registry is this process's memory: asked per row, no query.
        return state_of(obj, registered_agents())

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[Any], search_term: str
    ) -> tuple[QuerySet[Any], bool]:
        return super().get_search_results(request, queryset, storable_text(search_term))

    # -- columns and fields ----------------------------------------------------------------

    @admin.display(description=_("name"), ordering="name")
    def name_shown(self, obj: AgentSchedule) -> SafeString:
        return revealed(obj.name)

    @admin.display(description=_("agent"), ordering="agent")
    def agent_shown(self, obj: AgentSchedule) -> SafeString:
        return revealed(obj.agent)

    @admin.display(description=_("timing"))
    def timing(self, obj: AgentSchedule) -> SafeString:
        return timing_html(obj)

    @admin.display(description=_("state"))
    def state(self, obj: AgentSchedule) -> SafeString:
        """The badge, and under a broken schedule's the reason."""
        state, reason = self._state(obj)
        if not reason:
            return state_badge(state)
        return format_html(
            '{}<br><span class="da-meta da-broken-reason">{}</span>',
            state_badge(state, plain_markers(reason)),
            revealed(reason),
        )

    @admin.display(description=_("state"))
    def state_shown(self, obj: AgentSchedule) -> SafeString:
        return self.state(obj)

    @admin.display(description=_("next slot"), ordering="next_slot")
    def next_slot_shown(self, obj: AgentSchedule) -> str:
        """A paused or broken schedule fires nothing: its stored next slot is not shown."""
        state, _reason = self._state(obj)
        if state != ScheduleState.ACTIVE or obj.next_slot is None:
            return self.get_empty_value_display()
        return format_time(obj.next_slot)

    @admin.display(description=_("last run"))
    def last_run_link(self, obj: AgentSchedule) -> SafeString | str:
        if obj.last_run_id is None:
            return self.get_empty_value_display()
        url = reverse(
            f"{self.admin_site.name}:durable_agents_agentrun_change", args=[obj.last_run_id]
        )
        if hasattr(obj, "last_run_status"):  # the list's rows: read with them
            status = obj.last_run_status
        else:  # the schedule's page
            runs = AgentRun.objects.filter(pk=obj.last_run_id)
            status = runs.values_list("status", flat=True).first()
        shown = (
            badge(status, RUN_SHORT_LABELS.get(status, status), RUN_COLORS)
            if status
            else gettext("deleted")
        )
        return format_html('<a href="{}">{}</a> {}', url, short_id(obj.last_run_id), shown)

    # -- saving: through durable_agents.schedule -------------------------------------------

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        return self.readonly_fields if obj is not None else ()

    def save_model(self, request: HttpRequest, obj: AgentSchedule, form: Any, change: bool) -> None:
        # As code declares a schedule: its row locked, the next slot moved when the timing
        # changed or it is enabled again, ``broken`` cleared.
        saved = schedules.schedule(
            obj.name,
            obj.agent,
            obj.task,
            cron=obj.cron or None,
            every=obj.every,
            timezone=obj.timezone,
            priority=obj.priority,
            concurrency_key=obj.concurrency_key,
            catch_up=obj.catch_up,
            enabled=obj.enabled,
        )
        for field in AgentSchedule._meta.concrete_fields:
            setattr(obj, field.attname, getattr(saved, field.attname))
        obj._state.adding = False

    # -- permissions -----------------------------------------------------------------------

    def has_run_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm(RUN_PERMISSION)

    # -- the page's buttons ----------------------------------------------------------------

    def render_change_form(
        self,
        request: HttpRequest,
        context: dict[str, Any],
        add: bool = False,
        change: bool = False,
        form_url: str = "",
        obj: AgentSchedule | None = None,
    ) -> HttpResponse:
        if obj is not None:
            state, reason = self._state(obj)
            can_change = self.has_change_permission(request, obj)
            context.update(
                schedule_state=state.value,
                broken_reason=reason,
                can_pause=can_change and obj.enabled,
                can_resume=can_change and not obj.enabled,
                can_run_now=self.has_run_permission(request),
            )
        return super().render_change_form(request, context, add, change, form_url, obj)

    def get_urls(self) -> list[URLPattern]:
        name = self._object_url
        return [
            path("<path:object_id>/pause/", self._post_view(self.pause_view), name=name("pause")),
            path(
                "<path:object_id>/resume/", self._post_view(self.resume_view), name=name("resume")
            ),
            path(
                "<path:object_id>/run-now/",
                self._post_view(self.run_now_view),
                name=name("run_now"),
            ),
            *super().get_urls(),
        ]

    def _changed_message(self, obj: AgentSchedule, enabled: bool) -> str:
        names = {"name": plain_markers(obj.name)}
        if enabled:
            return gettext("Resumed schedule “%(name)s”.") % names
        return gettext("Paused schedule “%(name)s”.") % names

    def _set_enabled_view(
        self, request: HttpRequest, object_id: str, enabled: bool
    ) -> HttpResponse:
        # Permission first: a forged POST learns nothing and changes nothing.
        if not self.has_change_permission(request):
            raise PermissionDenied
        obj = get_or_404(AgentSchedule, object_id)
        try:
            changed = self._set_enabled(request, obj, enabled)
        except ValueError as exc:
            self._not_resumed(request, obj, exc)
            return self._redirect_to_object(obj)
        if changed:
            self.message_user(request, self._changed_message(obj, enabled), messages.SUCCESS)
            self._warn_if_broken(request, obj)
        else:
            self.message_user(
                request,
                (
                    gettext("Nothing changed: schedule “%(name)s” is already running.")
                    if enabled
                    else gettext("Nothing changed: schedule “%(name)s” is already paused.")
                )
                % {"name": plain_markers(obj.name)},
                messages.WARNING,
            )
        return self._redirect_to_object(obj)

    def _not_resumed(self, request: HttpRequest, obj: AgentSchedule, error: ValueError) -> None:
        self.message_user(
            request,
            gettext(
                "Schedule “%(name)s” was not resumed: its timing cannot be read (%(error)s). "
                "Correct it on its page."
            )
            % {"name": plain_markers(obj.name), "error": plain_markers(str(error))},
            messages.ERROR,
        )

    def _set_enabled(self, request: HttpRequest, obj: AgentSchedule, enabled: bool) -> bool:
        """Pause or resume, and the LogEntry; True when this request changed it. ValueError
        (nothing changed) for a schedule whose time zone or cron expression no longer reads
        (a row written by hand, or a time zone gone from the tz database)."""
        if not set_enabled(obj.pk, enabled):
            return False
        obj.refresh_from_db()
        if enabled:
            logged = f"Resumed from the admin; next slot {format_time(obj.next_slot) or 'none'}."
        else:
            logged = "Paused from the admin."
        self.log_change(request, obj, logged)
        return True

    def _warn_if_broken(self, request: HttpRequest, obj: AgentSchedule) -> None:
        state, reason = self._state(obj)
        if state == ScheduleState.BROKEN and obj.enabled:
            self.message_user(
                request,
                gettext(
                    "Schedule “%(name)s” is still broken (%(reason)s): it fires once it is "
                    "saved with a registered agent."
                )
                % {"name": plain_markers(obj.name), "reason": plain_markers(reason)},
                messages.WARNING,
            )

    def pause_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        return self._set_enabled_view(request, object_id, enabled=False)

    def resume_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        return self._set_enabled_view(request, object_id, enabled=True)

    def run_now_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        if not self.has_run_permission(request):
            raise PermissionDenied
        obj = get_or_404(AgentSchedule, object_id)
        self._run_now(request, obj)
        return self._redirect_to_object(obj)

    def _run_now(self, request: HttpRequest, obj: AgentSchedule) -> AgentRun | None:
        """Start the schedule's run, log it and say so with a link to the run; None (and an
        error message) when its agent is not registered or its fields are refused."""
        try:
            run = schedules.run_now(obj)
        except (ValueError, AgentNotFound) as exc:
            self.message_user(
                request,
                gettext("No run was started for schedule “%(name)s”: %(error)s")
                % {"name": plain_markers(obj.name), "error": plain_markers(str(exc))},
                messages.ERROR,
            )
            return None
        self.log_change(request, obj, f"Run now from the admin: started run {run.pk}.")
        url = reverse(f"{self.admin_site.name}:durable_agents_agentrun_change", args=[run.pk])
        self.message_user(
            request,
            format_html(
                gettext("Started run {run} of schedule “{name}”."),
                run=format_html('<a href="{}" class="da-started-run">{}</a>', url, run.pk),
                name=plain_markers(obj.name),
            ),
            messages.SUCCESS,
        )
        return run

    # -- list actions ----------------------------------------------------------------------

    @admin.action(description=_("Pause selected schedules"), permissions=["change"])
    def pause_schedules(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        self._set_enabled_many(request, queryset, enabled=False)

    @admin.action(description=_("Resume selected schedules"), permissions=["change"])
    def resume_schedules(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        self._set_enabled_many(request, queryset, enabled=True)

    def _set_enabled_many(
        self, request: HttpRequest, queryset: QuerySet[Any], *, enabled: bool
    ) -> None:
        changed = 0
        broken = 0
        registered = registered_agents()
        for obj in queryset.filter(enabled=not enabled).only("pk", "name"):
            try:
                done = self._set_enabled(request, obj, enabled)
            except ValueError as exc:
                self._not_resumed(request, obj, exc)
                continue
            if done:
                changed += 1
                broken += state_of(obj, registered)[0] == ScheduleState.BROKEN
        if enabled:
            message = ngettext(
                "Resumed %(count)s schedule(s).", "Resumed %(count)s schedule(s).", changed
            )
        else:
            message = ngettext(
                "Paused %(count)s schedule(s).", "Paused %(count)s schedule(s).", changed
            )
        message %= {"count": changed}
        if enabled and broken:
            message += " " + ngettext(
                "%(count)s of them is broken and fires nothing until it is fixed.",
                "%(count)s of them are broken and fire nothing until they are fixed.",
                broken,
            ) % {"count": broken}
        self.message_user(request, message, messages.SUCCESS if changed else messages.WARNING)

    @admin.action(description=_("Run selected schedules now"), permissions=["run"])
    def run_schedules_now(
        self, request: HttpRequest, queryset: QuerySet[Any]
    ) -> TemplateResponse | None:
        """A confirmation page lists the schedules (each "Yes" starts a run, which costs
        model calls); its "Yes" starts one run for each schedule it listed."""
        if not self._confirmed(request):
            listed = list(queryset.order_by("name")[:RUN_NOW_LIMIT])
            rows = [
                ConfirmRow(pk=str(obj.pk), url=self._url("change", obj.pk), label=obj.name)
                for obj in listed
            ]
            return self._render_confirmation(
                request,
                title=gettext("Run schedules now"),
                question=gettext(
                    "Each of these schedules starts one run now, with its agent and task, "
                    "outside its slots (which do not change)."
                ),
                rows=rows,
                matched=queryset.count(),
                skipped=0,
                button=gettext("Yes, start the runs"),
                action="run_schedules_now",
                form_url=request.get_full_path(),
            )
        started = sum(self._run_now(request, obj) is not None for obj in queryset.order_by("name"))
        if started > 1:
            self.message_user(
                request,
                ngettext("Started %(count)s run(s).", "Started %(count)s run(s).", started)
                % {"count": started},
                messages.SUCCESS,
            )
        return None


# -- the operations page's panel ------------------------------------------------------------


@dataclass
class SchedulePanel:
    """The next slots of the schedules that fire, and the schedules in trouble (broken, or
    whose last run failed or died), each with why."""

    upcoming: list[tuple[AgentSchedule, SafeString]]  # each with its timing in words
    troubled: list[tuple[AgentSchedule, str]]
    more_troubled: bool


def schedule_panel() -> SchedulePanel:
    """Two queries whatever the number of schedules: the next UPCOMING_SLOTS slots (through
    the workers' own index) and at most TROUBLED_SCHEDULES in trouble."""
    registered = registered_agents()
    upcoming_rows = list(
        AgentSchedule.objects.firing()
        .filter(next_slot__isnull=False, agent__in=registered)
        .order_by("next_slot")
        .only("pk", "name", "agent", "cron", "every", "timezone", "next_slot")[:UPCOMING_SLOTS]
    )
    troubled_rows = list(
        AgentSchedule.objects.filter(
            state_condition(ScheduleState.BROKEN, registered)
            | Q(last_run__status__in=TROUBLED_RUN_STATUSES)
        )
        .annotate(last_run_status=F("last_run__status"))  # joined for the filter anyway
        .order_by("name")
        .only("pk", "name", "agent", "enabled", "broken", "last_slot", "last_run")[
            : TROUBLED_SCHEDULES + 1
        ]
    )
    troubled = []
    for row in troubled_rows[:TROUBLED_SCHEDULES]:
        state, reason = state_of(row, registered)
        if state != ScheduleState.BROKEN:
            run_status = getattr(row, "last_run_status", "")
            status = str(RUN_SHORT_LABELS.get(run_status, run_status)).lower()
            reason = gettext("its last run is %(status)s") % {"status": status}
        troubled.append((row, reason))
    upcoming = [(row, timing_html(row)) for row in upcoming_rows]
    return SchedulePanel(upcoming, troubled, len(troubled_rows) > TROUBLED_SCHEDULES)
