"""What runs cost, as the runs list and a run's page print it."""

from __future__ import annotations

import dataclasses
from decimal import Decimal

from django.contrib.humanize.templatetags.humanize import intcomma
from django.utils.html import format_html
from django.utils.safestring import SafeString
from django.utils.translation import gettext, ngettext

from durable_agents.models import AgentRun
from durable_agents.pricing import add_cost, format_usd

# A run page adds up at most this many descendants' costs (each level one indexed query on
# parent_id); past it the family's figure says "at least".
FAMILY_LIMIT = 10_000
# Generations read at most: far past MAX_RUN_DEPTH, a guard against a cycle written by hand.
FAMILY_DEPTH = 64


def cost_text(run: AgentRun) -> str:
    """``$0.0123``; "no price" for a run whose turns had none; "" before its first turn."""
    if run.cost_usd is not None:
        return format_usd(run.cost_usd)
    return gettext("no price") if run.tokens_used else ""


def list_cost(run: AgentRun) -> SafeString | str:
    """The runs list's line under the steps: the cost, its tokens in the title."""
    text = cost_text(run)
    if not text:
        return ""
    tokens = ngettext("%(count)s token", "%(count)s tokens", run.tokens_used) % {
        "count": intcomma(run.tokens_used)
    }
    return format_html('<br><span class="da-meta da-cost" title="{}">{}</span>', tokens, text)


@dataclasses.dataclass(frozen=True)
class FamilyCost:
    """A run's cost with all its descendants' (child runs, their children, ...)."""

    cost: Decimal | None
    descendants: int
    complete: bool  # False: past FAMILY_LIMIT descendants, the figure is a lower bound


def family_cost(run: AgentRun) -> FamilyCost:
    """The run's cost plus its descendants', one generation per query through the index on
    ``parent_id`` (one query for a run without children)."""
    total, counted, parents = run.cost_usd, 0, [run.pk]
    for _ in range(FAMILY_DEPTH):
        room = FAMILY_LIMIT - counted
        rows = list(
            AgentRun.objects.filter(parent_id__in=parents)
            .order_by()
            .values_list("pk", "cost_usd")[: room + 1]
        )
        for _pk, cost in rows[:room]:
            total = add_cost(total, cost)
        counted += min(len(rows), room)
        if len(rows) > room:
            return FamilyCost(total, counted, complete=False)
        if not rows:
            break
        parents = [pk for pk, _cost in rows]
    return FamilyCost(total, counted, complete=True)


def run_page_cost(run: AgentRun) -> SafeString | str:
    """The run page's cost: its own and, for a run with child runs, the family's."""
    own = cost_text(run) or "—"
    family = family_cost(run)
    if not family.descendants:
        return own
    total = format_usd(family.cost) or gettext("no price")
    if family.complete:
        note = ngettext(
            "%(total)s with its %(count)s descendant run",
            "%(total)s with its %(count)s descendant runs",
            family.descendants,
        )
    else:
        note = gettext("at least %(total)s with its first %(count)s descendant runs")
    return format_html(
        '{} <span class="da-meta" id="family-cost">({})</span>',
        own,
        note % {"total": total, "count": intcomma(family.descendants)},
    )
