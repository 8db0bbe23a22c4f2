"""Cancel, requeue and send an event: the actions on runs and their confirmations."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.db.models import (
    QuerySet,
)
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import URLPattern, path
from django.utils.translation import gettext, ngettext, ngettext_lazy
from django.utils.translation import gettext_lazy as _

from durable_agents import api
from durable_agents._internal.text import plain_markers, storable_text
from durable_agents.admin.base import SEND_EVENT_PERMISSION, AgentsAdmin, ConfirmRow, get_or_404
from durable_agents.admin.events import already_sent_message, send_event_as
from durable_agents.admin.format import cut_at_word
from durable_agents.admin.forms import EventPayloadForm
from durable_agents.models import (
    CANCELLABLE_STATUSES,
    AgentRun,
    RunStatus,
    WaitKind,
)

if TYPE_CHECKING:
    from django_stubs_ext import StrOrPromise


# A confirmation page lists, and posts back, at most this many objects: every one it lists,
# and nothing else. Kept under Django's DATA_UPLOAD_MAX_NUMBER_FIELDS (1000) with room for
# the fingerprints of intents.
RUN_ACTION_LIMIT = 500


@dataclass(frozen=True)
class RunOperation:
    """A bulk operation on runs: what it applies to, and the words of its pages."""

    statuses: tuple[str, ...]
    function: Callable[[Any], bool]  # of durable_agents.api: True when the run changed
    logged: str  # the LogEntry's verb (English: the audit record)
    title: StrOrPromise
    question: StrOrPromise
    button: StrOrPromise
    done: StrOrPromise  # the message: %(count)s changed, %(skipped)s skipped


class RunActions(AgentsAdmin[AgentRun]):
    """The operations on runs: the list's actions (with their confirmation pages) and the
    run page's cancel and requeue buttons. Every change goes through ``durable_agents.api``."""

    def get_urls(self) -> list[URLPattern]:
        name = self._object_url
        return [
            path(
                "<path:object_id>/cancel/", self._post_view(self.cancel_view), name=name("cancel")
            ),
            path(
                "<path:object_id>/requeue/",
                self._post_view(self.requeue_view),
                name=name("requeue"),
            ),
            *super().get_urls(),
        ]

    def has_operate_permission(self, request: HttpRequest) -> bool:
        """Cancel and requeue: Django's change permission on runs."""
        return request.user.has_perm(f"{self.opts.app_label}.change_{self.opts.model_name}")

    def has_send_event_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm(SEND_EVENT_PERMISSION)

    @admin.action(description=_("Cancel selected runs"), permissions=["operate"])
    def cancel_runs(self, request: HttpRequest, queryset: QuerySet[Any]) -> HttpResponse | None:
        return self._run_operation(request, queryset, "cancel_runs")

    @admin.action(description=_("Requeue selected dead runs"), permissions=["operate"])
    def requeue_runs(self, request: HttpRequest, queryset: QuerySet[Any]) -> HttpResponse | None:
        return self._run_operation(request, queryset, "requeue_runs")

    RUN_OPERATIONS: ClassVar[dict[str, RunOperation]] = {
        "cancel_runs": RunOperation(
            statuses=tuple(CANCELLABLE_STATUSES),
            function=api.cancel_run,
            logged="Cancelled",
            title=_("Cancel runs"),
            question=_(
                "These runs will be cancelled. A worker holding one stops at its next step; "
                "nothing it committed is undone."
            ),
            button=_("Yes, cancel them"),
            # The English keeps "run(s)"; a catalogue gives each plural form its own words.
            done=ngettext_lazy(
                "Cancelled %(count)s run(s); %(skipped)s skipped (not in a status that allows it).",
                "Cancelled %(count)s run(s); %(skipped)s skipped (not in a status that allows it).",
                "count",
            ),
        ),
        "requeue_runs": RunOperation(
            statuses=(RunStatus.DEAD,),
            function=api.requeue_run,
            logged="Requeued",
            title=_("Requeue runs"),
            question=_(
                "These dead runs go back to pending and resume at their first uncommitted step."
            ),
            button=_("Yes, requeue them"),
            done=ngettext_lazy(
                "Requeued %(count)s run(s); %(skipped)s skipped (not in a status that allows it).",
                "Requeued %(count)s run(s); %(skipped)s skipped (not in a status that allows it).",
                "count",
            ),
        ),
    }

    def _run_rows(self, runs: Iterable[AgentRun]) -> list[ConfirmRow]:
        """The rows of a confirmation page that lists runs."""
        return [
            ConfirmRow(
                pk=str(run.pk), url=self._url("change", run.pk), label=storable_text(str(run))
            )
            for run in runs
        ]

    def _run_operation(
        self,
        request: HttpRequest,
        queryset: QuerySet[Any],
        action: str,
        *,
        form_url: str | None = None,
        example: str | None = None,
    ) -> HttpResponse | None:
        operation = self.RUN_OPERATIONS[action]
        eligible = queryset.filter(status__in=operation.statuses)
        if not self._confirmed(request):
            matched = eligible.count()
            runs = eligible.order_by("-created_at").only(
                "id", "agent", "prompt_version", "status", "created_at"
            )[:RUN_ACTION_LIMIT]
            rows = self._run_rows(runs)
            title: StrOrPromise = operation.title
            if example is not None:  # a group of the dead letter: its example reason
                title = gettext("%(title)s: “%(example)s”") % {
                    "title": operation.title,
                    "example": plain_markers(example),
                }
            return self._render_confirmation(
                request,
                title=title,
                question=operation.question,
                rows=rows,
                matched=matched,
                skipped=queryset.count() - matched,
                button=operation.button,
                action=action,
                form_url=form_url or request.get_full_path(),
            )
        # The "Yes" of a confirmation page: Django filtered the queryset to the posted ids.
        function = operation.function
        total = len(self._posted_ids(request))
        changed = 0
        for run in eligible.only("pk", "status"):
            # Per run through the api: the status it checks may have moved since the page.
            if function(run.pk):
                changed += 1
                self.log_change(
                    request, run, f"{operation.logged} from the admin (was {run.status})."
                )
        skipped = total - changed
        level = messages.SUCCESS if changed else messages.WARNING
        self.message_user(request, operation.done % {"count": changed, "skipped": skipped}, level)
        return None

    @admin.action(description=_("Send the event these runs wait for"), permissions=["send_event"])
    def send_events(self, request: HttpRequest, queryset: QuerySet[Any]) -> HttpResponse | None:
        """An intermediate page lists the selected runs that wait on an event (all on one
        event) and takes the payload; its "Yes" posts exactly those run ids and the event's
        name, and sends that event only if the runs still wait on it."""
        eligible = queryset.filter(
            status=RunStatus.WAITING, waiting_for=WaitKind.EVENT, wait_event__isnull=False
        )
        confirmed = self._confirmed(request)
        name = self._awaited_event(request, eligible, confirmed=confirmed)
        if name is None:
            return None
        form = EventPayloadForm(request.POST if confirmed else None)
        if not confirmed or not form.is_valid():
            return self._confirm_send(
                request,
                queryset,
                eligible,
                name,
                form=form if confirmed else EventPayloadForm(),
            )
        self._send_to_listed(request, eligible, name, form.cleaned_data["payload"])
        return None

    def _awaited_event(
        self, request: HttpRequest, eligible: QuerySet[Any], *, confirmed: bool
    ) -> str | None:
        """The one event the selected runs wait on; None (and a message saying why) when
        they wait on none, on several, or, for a "Yes", no longer all on the posted one."""
        names = sorted(
            eligible.order_by().values_list("wait_event", flat=True).distinct()[:11],
            key=str,
        )
        if confirmed:
            posted = request.POST.get("event", "")
            if names == [posted]:
                return posted
            self.message_user(
                request,
                gettext("Nothing was sent: the runs listed no longer all wait on event “%(name)s”.")
                % {"name": plain_markers(storable_text(posted, 200))},
                messages.ERROR,
            )
            return None
        if len(names) == 1:
            return str(names[0])
        if not names:
            self.message_user(
                request, gettext("None of the selected runs waits on an event."), messages.WARNING
            )
            return None
        shown = ", ".join(f"“{plain_markers(storable_text(n, 60))}”" for n in names[:10])
        if len(names) > 10:
            message = gettext(
                "The selected runs wait on more than ten different events (%(events)s): "
                "select runs that wait on one of them."
            )
        else:
            message = gettext(
                "The selected runs wait on %(count)s different events (%(events)s): "
                "select runs that wait on one of them."
            )
        self.message_user(request, message % {"count": len(names), "events": shown}, messages.ERROR)
        return None

    def _confirm_send(
        self,
        request: HttpRequest,
        queryset: QuerySet[Any],
        eligible: QuerySet[Any],
        name: str,
        *,
        form: EventPayloadForm,
    ) -> TemplateResponse:
        """The confirmation page of ``send_events``: the runs it lists, the payload's form."""
        matched = eligible.count()
        runs = eligible.order_by("waiting_since", "pk").only(
            "id", "agent", "prompt_version", "status", "created_at", "waiting_since"
        )[:RUN_ACTION_LIMIT]
        rows = [
            ConfirmRow(
                pk=str(run.pk), url=self._url("change", run.pk), label=storable_text(str(run))
            )
            for run in runs
        ]
        everyone = AgentRun.objects.filter(
            status=RunStatus.WAITING, waiting_for=WaitKind.EVENT, wait_event=name
        ).count()
        note = ""
        if everyone > len(rows):
            note = ngettext(
                "%(count)s run(s) wait on this event in all; the ones not listed here "
                "wake too (an event is sent by name, not per run).",
                "%(count)s run(s) wait on this event in all; the ones not listed here "
                "wake too (an event is sent by name, not per run).",
                everyone,
            ) % {"count": everyone}
        return self._render_confirmation(
            request,
            title=gettext("Send event “%(name)s”")
            % {"name": plain_markers(cut_at_word(storable_text(name), 60)[0])},
            question=gettext(
                "Event “%(name)s” will be sent with the payload below, once: every run "
                "waiting on it wakes and receives it."
            )
            % {"name": plain_markers(name)},
            note=note,
            rows=rows,
            matched=matched,
            skipped=queryset.count() - matched,
            button=gettext("Yes, send it"),
            action="send_events",
            form_url=request.get_full_path(),
            extra_form=form,
            extra_hidden={"event": name},
        )

    def _send_to_listed(
        self, request: HttpRequest, eligible: QuerySet[Any], name: str, payload: Any
    ) -> None:
        """Send the event, then log each listed run it woke and say how many woke."""
        listed = list(eligible.values_list("pk", flat=True))
        event, sent = send_event_as(self, request, name, payload)
        if not sent:
            self.message_user(request, already_sent_message(event), messages.WARNING)
            return
        still = set(
            AgentRun.objects.filter(
                pk__in=listed, status=RunStatus.WAITING, waiting_for=WaitKind.EVENT
            ).values_list("pk", flat=True)
        )
        woken = [pk for pk in listed if pk not in still]
        for run in AgentRun.objects.filter(pk__in=woken).only(
            "pk", "agent", "prompt_version", "status"
        ):
            self.log_change(
                request, run, storable_text(f"Woken by event “{name}”, sent from the admin.")
            )
        self.message_user(
            request,
            ngettext(
                "Sent event “%(name)s”: %(woken)s of the %(count)s listed run(s) woke.",
                "Sent event “%(name)s”: %(woken)s of the %(count)s listed run(s) woke.",
                len(listed),
            )
            % {
                "name": plain_markers(storable_text(name, 200)),
                "woken": len(woken),
                "count": len(listed),
            },
            messages.SUCCESS,
        )

    def _single_run_operation(
        self,
        request: HttpRequest,
        object_id: str,
        operation: Callable[[Any], bool],
        logged: str,
        done: StrOrPromise,
    ) -> HttpResponse:
        """``logged``: the LogEntry's verb (English); ``done``: the message, with %(run)s."""
        if not self.has_operate_permission(request):
            raise PermissionDenied
        run = get_or_404(AgentRun, object_id, AgentRun.objects.only("pk", "status"))
        before = run.status
        if operation(run.pk):
            self.log_change(request, run, f"{logged} from the admin (was {before}).")
            self.message_user(request, done % {"run": run.pk}, messages.SUCCESS)
        else:
            run.refresh_from_db(fields=["status"])
            self.message_user(
                request,
                gettext("Nothing changed: run %(run)s is %(status)s.")
                % {"run": run.pk, "status": run.get_status_display().lower()},
                messages.WARNING,
            )
        return self._redirect_to_object(run)

    def cancel_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        return self._single_run_operation(
            request, object_id, api.cancel_run, "Cancelled", _("Cancelled run %(run)s.")
        )

    def requeue_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        return self._single_run_operation(
            request, object_id, api.requeue_run, "Requeued", _("Requeued run %(run)s.")
        )
