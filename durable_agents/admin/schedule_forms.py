"""What the schedules' admin shares with the operations page: a schedule's state (active,
paused or broken, with the reason), its timing in words, and the change form that checks what
``durable_agents.schedule`` checks."""

from __future__ import annotations

import datetime
from typing import Any, ClassVar, cast

from django import forms
from django.core.exceptions import ValidationError
from django.db.models import Q, TextChoices
from django.utils.html import format_html
from django.utils.safestring import SafeString
from django.utils.translation import gettext, ngettext, pgettext, pgettext_lazy
from django.utils.translation import gettext_lazy as _

from durable_agents.admin.forms import MarkedTextarea, MarkedTextInput
from durable_agents.api import check_priority, check_task
from durable_agents.declare.agents import registry
from durable_agents.exceptions import CronExpressionError
from durable_agents.models import AgentSchedule
from durable_agents.schedules.defining import check_name, check_timing, five_fields, time_zone
from durable_agents.store.concurrency import check_concurrency_key

SCHEDULE_COLORS = {"active": "#1a7f37", "paused": "#57606a", "broken": "#c62828"}


class ScheduleState(TextChoices):
    # A context of their own: django.contrib.auth's catalogue has "active" too, and an app
    # listed before this one would translate it its way ("Aktiv" beside "pausiert").
    ACTIVE = "active", pgettext_lazy("schedule state", "active")
    PAUSED = "paused", pgettext_lazy("schedule state", "paused")
    BROKEN = "broken", pgettext_lazy("schedule state", "broken")


def registered_agents() -> set[str]:
    """The names of the agents this process has registered (no query)."""
    return {agent.name for agent in registry.all()}


def state_condition(state: str, registered: set[str]) -> Q:
    """The rows in ``state``: broken (a reason recorded by a worker, or an agent this process
    does not have) before paused, paused before active."""
    sound = Q(broken="", agent__in=registered)
    if state == ScheduleState.BROKEN:
        return ~sound
    if state == ScheduleState.PAUSED:
        return sound & Q(enabled=False)
    return sound & Q(enabled=True)


def state_of(schedule: AgentSchedule, registered: set[str]) -> tuple[ScheduleState, str]:
    """The schedule's state and, when broken, why (the recorded reason comes first: the
    worker that found it knew more)."""
    if schedule.broken:
        return ScheduleState.BROKEN, schedule.broken
    if schedule.agent not in registered:
        reason = gettext("no agent named “%(agent)s” is registered") % {"agent": schedule.agent}
        return ScheduleState.BROKEN, reason
    if not schedule.enabled:
        return ScheduleState.PAUSED, ""
    return ScheduleState.ACTIVE, ""


def state_badge(state: ScheduleState, reason: str = "") -> SafeString:
    return format_html(
        '<span class="da-badge" style="background-color:{}" title="{}">{}</span>',
        SCHEDULE_COLORS[state],
        reason,
        state.label,
    )


def every_text(every: datetime.timedelta) -> str:
    """``every 5 min``, ``every 1 h 30 min``, ``every 2 days``."""
    seconds = every.total_seconds()
    days, rest = divmod(int(seconds), 86_400)
    hours, rest = divmod(rest, 3_600)
    minutes, whole_seconds = divmod(rest, 60)
    fraction = seconds - int(seconds)
    parts = []
    if days:
        parts.append(ngettext("%(count)s day", "%(count)s days", days) % {"count": days})
    if hours:
        parts.append(pgettext("interval", "%(count)s h") % {"count": hours})
    if minutes:
        parts.append(pgettext("interval", "%(count)s min") % {"count": minutes})
    if whole_seconds or fraction:
        shown = f"{whole_seconds + fraction:g}"
        parts.append(pgettext("interval", "%(count)s s") % {"count": shown})
    return gettext("every %(interval)s") % {"interval": " ".join(parts)}


def timing_html(schedule: AgentSchedule) -> SafeString:
    """The cron expression with its time zone, or the interval."""
    if schedule.every is not None:
        return format_html("{}", every_text(schedule.every))
    return format_html("<code>{}</code> ({})", schedule.cron, schedule.timezone)


class ScheduleForm(forms.ModelForm):  # type: ignore[type-arg]
    """The change form: what ``durable_agents.schedule`` refuses is a form error here, on
    the field it is about, and nothing is saved."""

    agent = forms.ChoiceField(label=_("Agent"), help_text=_("A registered agent."))

    class Meta:
        model = AgentSchedule
        fields = (
            "name",
            "agent",
            "task",
            "cron",
            "every",
            "timezone",
            "catch_up",
            "enabled",
            "priority",
            "concurrency_key",
        )
        # Both are shown with their invisible characters marked (an input cannot draw them).
        widgets: ClassVar[dict[str, Any]] = {
            "task": MarkedTextarea(attrs={"rows": 6, "cols": 80}),
            "concurrency_key": MarkedTextInput,
        }
        help_texts: ClassVar[dict[str, Any]] = {
            "cron": _(
                "A cron expression of five fields read in the time zone below, such as "
                "“0 6 * * *” (at 06:00 every day), or one of @hourly, @daily, @weekly, "
                "@monthly, @yearly. Leave empty for an interval."
            ),
            "every": _(
                "An interval instead of a cron expression: “00:05:00” is every five minutes, "
                "“1 00:00:00” every day. Slots are multiples of it since 1970-01-01 UTC."
            ),
            "timezone": _("An IANA time zone name, such as Europe/Berlin (for cron)."),
            "catch_up": _(
                "After an outage: start a run for each missed slot, not only for the newest."
            ),
            "enabled": _("Unticked: the schedule is paused and starts nothing."),
        }

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        registered = registered_agents()
        choices = [(name, name) for name in sorted(registered)]
        current = self.instance.agent if self.instance.pk else ""
        if current and current not in registered:
            # Listed (and refused on saving) rather than silently replaced by the first agent.
            label = gettext("%(agent)s (not registered)") % {"agent": current}
            choices.insert(0, (current, label))
        cast(forms.ChoiceField, self.fields["agent"]).choices = choices

    def clean_name(self) -> str:
        name = self.cleaned_data["name"]
        _check(check_name, name)
        return cast(str, name)

    def clean_agent(self) -> str:
        agent = self.cleaned_data["agent"]
        if agent not in registered_agents():
            raise ValidationError(
                gettext("No agent named “%(agent)s” is registered.") % {"agent": agent}
            )
        return cast(str, agent)

    def clean_task(self) -> str:
        task = self.cleaned_data["task"]
        _check(check_task, task)
        return cast(str, task)

    def clean_timezone(self) -> str:
        zone = self.cleaned_data["timezone"]
        _check(time_zone, zone)
        return cast(str, zone)

    def clean_priority(self) -> int:
        priority = self.cleaned_data["priority"]
        _check(check_priority, priority)
        return cast(int, priority)

    def clean_concurrency_key(self) -> str | None:
        key = self.cleaned_data["concurrency_key"] or None
        if key is not None:
            _check(check_concurrency_key, key)
        return key

    def clean(self) -> dict[str, Any]:
        super().clean()
        data = self.cleaned_data
        if any(name in self.errors for name in ("cron", "every", "timezone")):
            return data
        cron = data.get("cron") or ""
        every = data.get("every")
        if bool(cron) == (every is not None):
            message = (
                gettext("Give a cron expression or an interval, not both.")
                if cron
                else gettext("Give a cron expression or an interval.")
            )
            # On both fields: the table's check constraint is not reported a second time.
            self.add_error("cron", message)
            self.add_error("every", message)
            return data
        try:
            check_timing(cron or None, every, data.get("timezone", "UTC"))
        except CronExpressionError as exc:
            self.add_error("cron", cron_error_text(exc, cron))
        except ValueError as exc:
            self.add_error("cron" if cron else "every", str(exc))
        return data


def cron_error_text(error: CronExpressionError, cron: str) -> str:
    """What the form says of a cron expression ``schedule()`` refuses, in the admin's
    language for the field counts and macros (the parser's own words otherwise)."""
    if error.code == "six_fields":
        return gettext(
            "“%(cron)s” has six fields: schedules take five (minute, hour, day of the month, "
            "month, day of the week), without seconds. “*/5 * * * *” is every five minutes; "
            "for slots seconds apart, give an interval instead."
        ) % {"cron": cron}
    if error.code == "field_count":
        count = len(five_fields(cron).split())
        return ngettext(
            "“%(cron)s” has %(count)s field: a cron expression has five (minute, hour, day of "
            "the month, month, day of the week), such as “0 6 * * *”.",
            "“%(cron)s” has %(count)s fields: a cron expression has five (minute, hour, day of "
            "the month, month, day of the week), such as “0 6 * * *”.",
            count,
        ) % {"cron": cron, "count": count}
    if error.code == "unknown_macro":
        return gettext(
            "“%(cron)s” is not a macro schedules know: use @hourly, @daily, @midnight, @weekly, "
            "@monthly, @yearly or @annually, or five fields."
        ) % {"cron": cron}
    return str(error)


def _check(check: Any, value: Any) -> None:
    """``check(value)``, its ValueError as the field's error."""
    try:
        check(value)
    except ValueError as exc:
        raise ValidationError(str(exc)) from exc
