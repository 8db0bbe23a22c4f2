"""Upgrades from the admin: "Upgrade to version…" on the runs list, and "Carry over to
version…" for dead runs whose version is not deployed or drifted (on the run's page, instead of
"Requeue", which would only die again, and on the dead letter's group of them).

Each is an intermediate page that lists the runs (of one agent and one version: otherwise a
message says so and nothing is shown) and offers the other registered versions of that agent;
its "Yes" posts exactly the ids listed and the version chosen. Runs in flight go through
``api.upgrade_runs``, dead ones through ``api.carry_over_runs``, both with
``user=request.user`` (which checks the permission again). Each run moved gets a LogEntry; the
message says how many moved, and why each of the others did not (grouped by reason).
Everything needs Django's change permission on runs, as the other run actions do.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from django import forms
from django.contrib import messages
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet, TextField
from django.db.models.functions import Substr
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.urls import URLPattern, path
from django.utils.translation import gettext, ngettext
from django.utils.translation import gettext_lazy as _

from durable_agents import api
from durable_agents._internal.text import plain_markers, storable_text
from durable_agents.admin.base import AdminPage, ConfirmRow, clean_pk, get_or_404
from durable_agents.admin.dead_letter import DEAD_ERROR_HEAD_CHARS, dead_group_run_ids
from durable_agents.admin.format import cut_at_word
from durable_agents.admin.run_actions import RUN_ACTION_LIMIT, RunActions
from durable_agents.declare.agents import registry
from durable_agents.exceptions import InvalidArgument
from durable_agents.forks.upgrades import UpgradeReport, carries_over, compared
from durable_agents.models import AgentRun, RunStatus, short_id

if TYPE_CHECKING:
    from django_stubs_ext import StrOrPromise

# The runs a message names per reason they were refused for; the rest are counted.
REFUSED_RUNS_NAMED = 10
IN_FLIGHT = (RunStatus.PENDING, RunStatus.WAITING, RunStatus.RUNNING)


class VersionForm(forms.Form):
    """The version the listed runs move to: one of the other registered versions of their
    agent, each said to keep or change what signed thinking binds."""

    version = forms.ChoiceField(label=_("Version"))

    def __init__(self, *args: Any, agent: str, from_version: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        versions = [v for v in registry.versions(agent) if v != from_version]
        choices = []
        for version in versions:
            choices.append((version, f"{version} ({_difference(agent, from_version, version)})"))
        field = cast(forms.ChoiceField, self.fields["version"])
        field.choices = choices
        # The newest version that declares it upgrades from this one, else the newest.
        declared = [v for v in versions if from_version in registry.get(agent, v).upgrades_from]
        if versions and not self.is_bound:
            self.initial["version"] = (declared or versions)[-1]


def _difference(agent: str, from_version: str, to_version: str) -> str:
    """What moving runs from ``from_version`` to ``to_version`` changes, in a few words."""
    sent = compared(agent, from_version, to_version)
    if sent is None:
        return gettext("what version %(old)s sent is not known here") % {"old": from_version}
    if sent.changed:
        note = gettext("another system prompt or other tools: runs with signed thinking stay")
    else:
        note = gettext("the same system prompt and tools: runs with thinking move too")
    if sent.differing:
        names = ", ".join(sorted(sent.differing))
        note += "; " + gettext(
            "declared otherwise: %(tools)s (runs whose pending calls use them stay)"
        ) % {"tools": plain_markers(storable_text(names, 200))}
    return note


@dataclass(frozen=True)
class Selection:
    """The runs an upgrade page acts on, all of one agent and one version."""

    agent: str
    version: str
    runs: QuerySet[AgentRun]


class UpgradePages(AdminPage[RunActions]):
    """The upgrade and carry-over pages. The list's action is the runs admin's
    ``upgrade_runs``, which hands its queryset to ``upgrade_action``."""

    def urls(self) -> list[URLPattern]:
        name = self.admin._object_url
        confirm = self.admin._confirm_view
        # The group's path first: "<path:object_id>/carry-over/" would take it too.
        return [
            path(
                "dead-letter/carry-over/",
                confirm(self.group_carry_over_view),
                name=name("dead_letter_carry_over"),
            ),
            path(
                "<path:object_id>/carry-over/",
                confirm(self.carry_over_view),
                name=name("carry_over"),
            ),
        ]

    # -- the list's action ---------------------------------------------------------------

    def upgrade_action(self, request: HttpRequest, queryset: QuerySet[Any]) -> HttpResponse | None:
        """The action "Upgrade to version…": its page, or (its "Yes") the upgrade."""
        selection = self._selection(request, queryset)
        if selection is None:
            return None
        return self._page(
            request,
            selection,
            action="upgrade_runs",
            form_url=request.get_full_path(),
            title=gettext("Upgrade runs of %(agent)s @ %(version)s")
            % {
                "agent": plain_markers(selection.agent),
                "version": plain_markers(selection.version),
            },
        )

    # -- a dead run's page, and a group of the dead letter ---------------------------------

    def carry_over_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """A dead run whose version is not deployed or drifted: GET its page, POST its "Yes";
        back on the run's page."""
        if not self.admin.has_operate_permission(request):
            raise PermissionDenied
        run = get_or_404(AgentRun, object_id, AgentRun.objects.only("pk"))
        selection = self._selection(request, AgentRun.objects.filter(pk=run.pk))
        back = self.admin._redirect_to_object(run)
        if selection is None:
            return back
        response = self._page(
            request,
            selection,
            action="carry_over",
            form_url=request.get_full_path(),
            title=gettext("Carry run %(run)s over to another version") % {"run": short_id(run.pk)},
        )
        return response or back

    def group_carry_over_view(self, request: HttpRequest) -> HttpResponse:
        """The dead letter's group of a cause (in the query string): GET lists its newest runs
        (at most RUN_ACTION_LIMIT); its "Yes" carries over the posted runs that are still dead
        of that cause. Back on the dead letter."""
        if not self.admin.has_operate_permission(request):
            raise PermissionDenied
        back = HttpResponseRedirect(self.admin._url("dead_letter"))
        cause = request.GET.get("cause", "")
        if request.method == "POST":
            try:
                ids = [clean_pk(AgentRun, value) for value in self.admin._posted_ids(request)]
            except ValueError:
                ids = []
            runs = AgentRun.objects.dead().filter(dead_cause=cause, pk__in=ids[:RUN_ACTION_LIMIT])
        else:
            ids = dead_group_run_ids(cause, RUN_ACTION_LIMIT) if "cause" in request.GET else []
            runs = AgentRun.objects.filter(pk__in=ids)
        if not ids:
            self.admin.message_user(
                request,
                gettext("That group is gone: its runs are no longer dead."),
                messages.WARNING,
            )
            return back
        selection = self._selection(request, runs)
        if selection is None:
            return back
        response = self._page(
            request,
            selection,
            action="carry_over",
            form_url=request.get_full_path(),
            title=gettext("Carry over: “%(example)s”")
            % {"example": plain_markers(cut_at_word(cause, 60)[0])},
        )
        return response or back

    # -- what they share -------------------------------------------------------------------

    def _selection(self, request: HttpRequest, runs: QuerySet[Any]) -> Selection | None:
        """The runs, if they are all of one agent and one version with another version of that
        agent registered; None (and a message saying why) otherwise."""
        pairs = sorted(
            runs.order_by().values_list("agent", "prompt_version").distinct()[:11], key=str
        )
        if not pairs:
            self.admin.message_user(
                request, gettext("None of the selected runs exists any more."), messages.WARNING
            )
            return None
        if len(pairs) > 1:
            shown = ", ".join(
                f"{plain_markers(storable_text(a, 60))} @ {plain_markers(storable_text(v, 60))}"
                for a, v in pairs[:10]
            )
            self.admin.message_user(
                request,
                gettext(
                    "Nothing was upgraded: the selected runs are of several agent versions "
                    "(%(versions)s%(more)s). Select runs of one agent and one version."
                )
                % {"versions": shown, "more": ", …" if len(pairs) > 10 else ""},
                messages.ERROR,
            )
            return None
        agent, version = pairs[0]
        if not [v for v in registry.versions(agent) if v != version]:
            self.admin.message_user(
                request,
                gettext(
                    "Nothing was upgraded: no other version of agent %(agent)s is registered "
                    "in this process (runs move to a version the code serving this admin "
                    "defines)."
                )
                % {"agent": plain_markers(storable_text(agent, 200))},
                messages.ERROR,
            )
            return None
        return Selection(agent, version, runs)

    def _page(
        self,
        request: HttpRequest,
        selection: Selection,
        *,
        action: str,
        form_url: str,
        title: StrOrPromise,
    ) -> HttpResponse | None:
        """The page (GET, or a "Yes" whose version is not valid), or the upgrade (None)."""
        confirmed = self.admin._confirmed(request)
        form = VersionForm(
            request.POST if confirmed else None,
            agent=selection.agent,
            from_version=selection.version,
        )
        if confirmed and form.is_valid():
            self._upgrade(request, selection, form.cleaned_data["version"])
            return None
        listed = (
            selection.runs.order_by("-created_at")
            .annotate(
                error_head=Substr("error", 1, DEAD_ERROR_HEAD_CHARS, output_field=TextField())
            )
            .only("id", "agent", "prompt_version", "status", "created_at")[:RUN_ACTION_LIMIT]
        )
        rows = [self._row(run) for run in listed]
        matched = selection.runs.count()
        return self.admin._render_confirmation(
            request,
            title=title,
            question=gettext(
                "These runs move, in place, to the version chosen below: each keeps its id, "
                "log and model, and goes on from where it stopped (a dead run goes back to "
                "pending). A run stays where it is when the version would change what signed "
                "thinking in its log is bound to, when one of its intents waits for a person, "
                "when its pending calls use a tool that version declares otherwise, or when a "
                "worker holds it; the message afterwards says why for each."
            ),
            rows=rows,
            matched=matched,
            skipped=0,
            button=gettext("Yes, move them"),
            action=action,
            form_url=form_url,
            extra_form=form,
        )

    def _row(self, run: Any) -> ConfirmRow:
        row = ConfirmRow(
            pk=str(run.pk),
            url=self.admin._url("change", run.pk),
            label=storable_text(str(run)),
        )
        if run.status == RunStatus.DEAD and not carries_over(run.error_head):
            row.included = False
            row.note = gettext(
                "dead of another cause than an undeployed version or drift: requeue it"
            )
        elif run.status not in (*IN_FLIGHT, RunStatus.DEAD):
            row.included = False
            row.note = gettext("%(status)s: only runs in flight or dead move") % {
                "status": run.get_status_display().lower()
            }
        return row

    def _upgrade(self, request: HttpRequest, selection: Selection, to_version: str) -> None:
        """The "Yes": the listed runs through the api, a LogEntry per run moved, the message."""
        dead = list(selection.runs.filter(status=RunStatus.DEAD).values_list("pk", flat=True))
        others = list(selection.runs.exclude(status=RunStatus.DEAD).values_list("pk", flat=True))
        report = UpgradeReport([], {})
        try:
            for function, ids in ((api.upgrade_runs, others), (api.carry_over_runs, dead)):
                if ids:
                    done = function(
                        selection.agent,
                        selection.version,
                        to_version,
                        run_ids=ids,
                        user=request.user,
                    )
                    report.upgraded.extend(done.upgraded)
                    report.refused.update(done.refused)
        except InvalidArgument as exc:
            # The version was unregistered between the page and its "Yes" (a reload of code).
            self.admin.message_user(
                request,
                gettext("Nothing more was upgraded: %(error)s") % {"error": storable_text(exc)},
                messages.ERROR,
            )
        carried = set(dead)
        for run in AgentRun.objects.filter(pk__in=report.upgraded).only(
            "pk", "agent", "prompt_version", "status"
        ):
            how = "Carried over from the dead letter" if run.pk in carried else "Upgraded"
            self.admin.log_change(
                request,
                run,
                storable_text(
                    f"{how} from the admin: version {selection.version!r} -> {to_version!r}."
                ),
            )
        self._say(request, report, to_version)

    def _say(self, request: HttpRequest, report: UpgradeReport, to_version: str) -> None:
        moved = len(report.upgraded)
        self.admin.message_user(
            request,
            ngettext(
                "Moved %(count)s run to version %(version)s.",
                "Moved %(count)s runs to version %(version)s.",
                moved,
            )
            % {"count": moved, "version": plain_markers(storable_text(to_version, 200))},
            messages.SUCCESS if moved else messages.WARNING,
        )
        for reason, run_ids in _by_reason(report.refused.items()):
            named = ", ".join(short_id(pk) for pk in run_ids[:REFUSED_RUNS_NAMED])
            if len(run_ids) > REFUSED_RUNS_NAMED:
                named += " " + gettext("and %(count)s more") % {
                    "count": len(run_ids) - REFUSED_RUNS_NAMED
                }
            self.admin.message_user(
                request,
                ngettext(
                    "Not moved: run %(runs)s: %(reason)s",
                    "Not moved: %(count)s runs (%(runs)s): %(reason)s",
                    len(run_ids),
                )
                % {
                    "count": len(run_ids),
                    "runs": named,
                    "reason": plain_markers(storable_text(reason)),
                },
                messages.WARNING,
            )


def _by_reason(refused: Iterable[tuple[Any, str]]) -> list[tuple[str, list[Any]]]:
    """The refused runs grouped by their reason, in the order the reasons first came."""
    groups: dict[str, list[Any]] = {}
    for run_id, reason in refused:
        groups.setdefault(reason, []).append(run_id)
    return list(groups.items())
