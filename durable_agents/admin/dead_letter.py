"""The dead letter: dead runs grouped by cause, each group requeued or cancelled at once."""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

from django.contrib import messages
from django.core.exceptions import PermissionDenied
from django.db.models import (
    Count,
    Max,
    Q,
    TextField,
)
from django.db.models.functions import Substr
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path
from django.utils.http import urlencode
from django.utils.translation import gettext

from durable_agents._internal import counting
from durable_agents._internal.counting import bounded_count
from durable_agents._internal.text import storable_text
from durable_agents.admin.base import AdminPage, clean_pk
from durable_agents.admin.format import cut_at_word
from durable_agents.admin.run_actions import RUN_ACTION_LIMIT, RunActions
from durable_agents.causes import error_reason
from durable_agents.forks.upgrades import carries_over
from durable_agents.models import (
    AgentRun,
)

# Causes (groups) per page of the dead letter.
DEAD_GROUPS_PER_PAGE = 20
# Beyond this page the dead letter answers with its last one (an OFFSET stays an integer).
DEAD_LETTER_MAX_PAGE = 10_000
# Characters of an example error read: reasons are one line; the rest is detail.
DEAD_ERROR_HEAD_CHARS = 2_000
# The example reason of a group is cut here, at a word boundary.
EXAMPLE_REASON_CHARS = 300
EXAMPLE_MARGIN = datetime.timedelta(milliseconds=1)


@dataclass
class DeadGroup:
    cause: str  # agent_run.dead_cause: the normalised reason, the grouping key
    count: int
    newest: datetime.datetime | None
    example: str = ""  # the newest run's reason, cut at a word boundary
    example_cut: bool = False
    example_run_id: Any = None

    @property
    def cause_shown(self) -> str:
        return cut_at_word(self.cause, EXAMPLE_REASON_CHARS)[0]

    @property
    def query(self) -> str:
        """The group's cause as a query string: what its confirmation asks."""
        return urlencode({"cause": self.cause})

    @property
    def carries_over(self) -> bool:
        """Dead of an undeployed version or drift: carried over to another version, not
        requeued (which would only die again)."""
        return carries_over(self.cause)

    @property
    def runs_query(self) -> str:
        """The runs list's filter on the group's cause (through agent_run_dead_cause)."""
        return urlencode({"dead_cause": self.cause})


@dataclass
class DeadLetterPage:
    groups: list[DeadGroup]
    number: int  # 1-based
    has_next: bool
    total: counting.Count  # dead runs in all


def dead_letter_page(number: int = 1) -> DeadLetterPage:
    """A page of the dead letter: the causes with the most dead runs first, each with its
    count, its newest run and that run's reason as the example. Three queries whatever the
    number of dead runs: the groups come from the index agent_run_dead_cause (dead_cause,
    created_at) alone, the examples by (cause, newest) through the same index, and the total
    is a bounded count."""
    number = max(1, number)
    dead = AgentRun.objects.dead()
    offset = (number - 1) * DEAD_GROUPS_PER_PAGE
    rows = list(
        dead.order_by()
        .values_list("dead_cause")
        # COUNT(*), not COUNT(id): the index (dead_cause, created_at) answers alone.
        .annotate(n=Count("*"), newest=Max("created_at"))
        .order_by("-n", "dead_cause")[offset : offset + DEAD_GROUPS_PER_PAGE + 1]
    )
    groups = [
        DeadGroup(cause=cause, count=n, newest=newest)
        for cause, n, newest in rows[:DEAD_GROUPS_PER_PAGE]
    ]
    newest_of = Q()
    for group in groups:
        # A millisecond's margin: SQLite keeps times as text, whose MAX() need not compare
        # equal to the same time written back; the newest row of each cause is taken below.
        if group.newest is not None:
            newest_of |= Q(dead_cause=group.cause, created_at__gt=group.newest - EXAMPLE_MARGIN)
    if groups:
        examples = (
            dead.filter(newest_of)
            .order_by("-created_at", "pk")
            .annotate(
                error_head=Substr("error", 1, DEAD_ERROR_HEAD_CHARS, output_field=TextField())
            )
            .values_list("pk", "dead_cause", "error_head")
        )
        by_cause = {group.cause: group for group in groups}
        for pk, cause, error in examples:
            found = by_cause.get(cause)
            if found is not None and found.example_run_id is None:
                found.example, found.example_cut = cut_at_word(
                    storable_text(error_reason(error)), EXAMPLE_REASON_CHARS
                )
                found.example_run_id = pk
    return DeadLetterPage(
        groups=groups,
        number=number,
        has_next=len(rows) > DEAD_GROUPS_PER_PAGE,
        total=bounded_count(dead),
    )


def dead_group_run_ids(cause: str, limit: int) -> list[Any]:
    """The newest ``limit`` dead runs of a cause (agent_run_dead_cause), newest first."""
    return list(
        AgentRun.objects.dead()
        .filter(dead_cause=cause)
        .order_by("-created_at")
        .values_list("pk", flat=True)[:limit]
    )


class DeadLetterPages(AdminPage[RunActions]):
    """The dead letter's pages. They live under the runs' admin (their URLs and names are the
    runs'), and a group's requeue or cancel is the runs' action, confirmed the same way: the
    admin they serve has the run actions."""

    def urls(self) -> list[URLPattern]:
        name = self.admin._object_url
        view = self.admin.admin_site.admin_view
        return [
            path("dead-letter/", view(self.dead_letter_view), name=name("dead_letter")),
            path(
                "dead-letter/<str:action>/",
                view(self.dead_letter_confirm_view),
                name=name("dead_letter_confirm"),
            ),
        ]

    def dead_letter_view(self, request: HttpRequest) -> HttpResponse:
        if not self.admin.has_view_permission(request):
            raise PermissionDenied
        try:
            number = int(request.GET.get("page", "1"))
        except ValueError:
            number = 1
        page = dead_letter_page(min(max(number, 1), DEAD_LETTER_MAX_PAGE))
        context = {
            **self.admin.admin_site.each_context(request),
            "title": gettext("Dead letter"),
            "opts": self.admin.opts,
            "page": page,
            "groups": page.groups,
            "total": page.total,
            "can_operate": self.admin.has_operate_permission(request),
            "action_limit": RUN_ACTION_LIMIT,
        }
        return TemplateResponse(request, "admin/durable_agents/agentrun/dead_letter.html", context)

    def dead_letter_confirm_view(self, request: HttpRequest, action: str) -> HttpResponse:
        """The confirmation page of a group's requeue or cancel (the group's cause in the query
        string): GET lists the group's newest runs (at most RUN_ACTION_LIMIT) and its "Yes"
        posts exactly their ids back here. A POST acts only on the posted runs that are still
        dead of that cause (never on the rest of the group: runs that died since were not
        shown), then answers with the dead letter and a message."""
        if action not in self.admin.RUN_OPERATIONS:
            raise Http404(gettext("No such operation."))
        if not self.admin.has_operate_permission(request):
            raise PermissionDenied
        cause = request.GET.get("cause", "")
        if request.method == "POST":
            return self._dead_group_posted(request, action, cause)
        run_ids = dead_group_run_ids(cause, RUN_ACTION_LIMIT) if "cause" in request.GET else []
        if not run_ids:
            self.admin.message_user(
                request,
                gettext("That group is gone: its runs are no longer dead."),
                messages.WARNING,
            )
            return HttpResponseRedirect(self.admin._url("dead_letter"))
        queryset = AgentRun.objects.filter(pk__in=run_ids)
        example = cut_at_word(cause, 60)[0]
        response = self.admin._run_operation(
            request, queryset, action, form_url=request.get_full_path(), example=example
        )
        assert response is not None  # a GET is never confirmed: it shows the page
        return response

    def _dead_group_posted(self, request: HttpRequest, action: str, cause: str) -> HttpResponse:
        """The "Yes" of a group's confirmation: the posted ids, re-checked to be dead runs of
        the group still. Anything else posted here (no "Yes", malformed or no ids) changes
        nothing and says so."""
        back = HttpResponseRedirect(self.admin._url("dead_letter"))
        try:
            ids = [clean_pk(AgentRun, value) for value in self.admin._posted_ids(request)]
        except ValueError:
            ids = []
        if not self.admin._confirmed(request) or not ids or len(ids) > RUN_ACTION_LIMIT:
            self.admin.message_user(
                request,
                gettext(
                    "Nothing was changed: confirm the runs of a group from its confirmation page."
                ),
                messages.ERROR,
            )
            return back
        listed = AgentRun.objects.dead().filter(dead_cause=cause, pk__in=ids)
        self.admin._run_operation(request, listed, action)
        return back
