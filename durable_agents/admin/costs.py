"""What runs cost, as the runs list and a run's page print it."""

from __future__ import annotations

import dataclasses
from decimal import Decimal

from django.contrib.humanize.templatetags.humanize import intcomma
from django.db import connection
from django.utils.html import format_html
from django.utils.safestring import SafeString
from django.utils.translation import gettext, ngettext

from durable_agents.flow.pricing import QUANTUM, add_cost, format_usd
from durable_agents.models import AgentRun

# A run page adds up at most this many descendants' costs; past it the family's figure says
# "at least".
FAMILY_LIMIT = 10_000
# Generations read at most: far past MAX_RUN_DEPTH, a guard against a cycle written by hand.
FAMILY_DEPTH = 64
# A run's descendants, generation by generation through the index on parent_id, read until
# FAMILY_LIMIT + 1 are found (the recursion stops there on PostgreSQL and SQLite alike):
# how many there are and what they cost together, in one query.
FAMILY_SQL = """
WITH RECURSIVE family(id, cost_usd, generation) AS (
    SELECT id, cost_usd, 1 FROM agent_run WHERE parent_id = %s
    UNION ALL
    SELECT run.id, run.cost_usd, family.generation + 1
      FROM agent_run AS run JOIN family ON run.parent_id = family.id
     WHERE family.generation < %s
)
SELECT count(*), sum(cost_usd) FROM (SELECT cost_usd FROM family LIMIT %s) AS found"""


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
    """The run's cost plus its descendants' (``FAMILY_SQL``: one query)."""
    pk = AgentRun._meta.pk
    assert pk is not None
    with connection.cursor() as cursor:
        cursor.execute(
            FAMILY_SQL,
            [pk.get_db_prep_value(run.pk, connection), FAMILY_DEPTH, FAMILY_LIMIT + 1],
        )
        row = cursor.fetchone()
    found, cost = (row[0], row[1]) if row is not None else (0, None)
    # SQLite sums decimals as floats: through their text, to the stored precision.
    cost = None if cost is None else Decimal(str(cost)).quantize(QUANTUM)
    complete = found <= FAMILY_LIMIT
    return FamilyCost(add_cost(run.cost_usd, cost), found, complete)


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
