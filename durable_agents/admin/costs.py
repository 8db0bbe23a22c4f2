"""What runs cost, as the runs list and a run's page print it."""

from __future__ import annotations

from django.contrib.humanize.templatetags.humanize import intcomma
from django.utils.html import format_html
from django.utils.safestring import SafeString
from django.utils.translation import gettext, ngettext

from durable_agents.flow.pricing import format_usd
from durable_agents.models import AgentRun
from durable_agents.models.trees import FamilyCost, family_cost

__all__ = ["FamilyCost", "cost_text", "family_cost", "list_cost", "run_page_cost"]


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
        note = gettext("at least %(total)s with the first %(count)s of its descendant runs")
    return format_html(
        '{} <span class="da-meta" id="family-cost">({})</span>',
        own,
        note % {"total": total, "count": intcomma(family.descendants)},
    )
