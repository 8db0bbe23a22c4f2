"""The run page, live: what an active run's page needs to follow the run as it advances.

The page itself is rendered as before (and is all a browser without JavaScript shows); a box
at its top, followed by ``static/durable_agents/live.js``, adds each step committed after the
page was rendered, the status as it changes, progress messages and the text of a streamed turn
while it comes, from ``runs/<id>/events``. Only where the project includes
``durable_agents.urls`` (otherwise there is nothing to follow), and only for runs that can still
move.
"""

from __future__ import annotations

from typing import Any

from django.db.models import Max
from django.urls import NoReverseMatch, reverse

from durable_agents.live.events import STATUS_CODES, Cursor
from durable_agents.models import ENDED_STATUSES, AgentProgress, AgentRun


def live_context(run: AgentRun) -> dict[str, Any]:
    """``live_events_url``: the run's events after what the page shows, or nothing."""
    if run.status in ENDED_STATUSES:
        return {}
    try:
        events = reverse("durable_agents:run_events", args=[run.pk])
    except NoReverseMatch:
        return {}
    newest = AgentProgress.objects.filter(run_id=run.pk).aggregate(n=Max("id"))["n"] or 0
    # The page shows the log up to last_seq and the status: the box starts after them.
    shown = Cursor(seq=run.last_seq, progress=newest, status=STATUS_CODES.get(run.status, ""))
    return {"live_events_url": f"{events}?after={shown.id_for(run.pk)}"}
