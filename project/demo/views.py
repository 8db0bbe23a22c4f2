"""The demo's live page: start a run and watch it work, as an end user would.

``GET /demo/live/`` shows a button; its POST starts a run of the ``narrator`` agent (streamed
turns, progress messages) and redirects to ``?run=<id>``, which shows that run followed live
through ``runs/<id>/events`` with a ``stream_token``: the page's visitor is not staff. A token
is only given for a run this browser session started (kept in the session), as an end user's
page would: knowing a run's id is not enough to read it.
"""

from __future__ import annotations

import uuid

from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import render
from django.urls import reverse
from django.views.decorators.http import require_http_methods

import durable_agents
from durable_agents.fork_models import steps_of
from durable_agents.live.events import step_data
from durable_agents.models import AgentRun

# The runs this session started (their ids), the newest MAX_KEPT.
SESSION_KEY = "demo_live_runs"
MAX_KEPT = 20

TASK = """Check the orders tables and record what you found.
@@chunk_latency 0.15
@check_table {"table": "orders"}
@check_table {"table": "orders_old"}
@record_progress {"ticket": "LIVE-1", "status": "tables checked"}
"""


@require_http_methods(["GET", "POST"])
def live(request: HttpRequest) -> HttpResponse:
    if request.method == "POST":
        run = durable_agents.start_run("narrator", TASK)
        started = request.session.get(SESSION_KEY, [])[-(MAX_KEPT - 1) :]
        request.session[SESSION_KEY] = [*started, str(run.pk)]
        return HttpResponseRedirect(f"{reverse('demo-live')}?run={run.pk}")
    run_id = request.GET.get("run")
    context: dict[str, object] = {}
    if run_id:
        if run_id not in request.session.get(SESSION_KEY, []):
            raise Http404("no run of yours")
        try:
            run = AgentRun.objects.get(pk=uuid.UUID(run_id))
        except (ValueError, AgentRun.DoesNotExist):
            raise Http404("no such run") from None
        token = durable_agents.stream_token(run.pk)
        events = reverse("durable_agents:run_events", args=[run.pk])
        # What is committed already, rendered by the server (the page without JavaScript);
        # the script adds the rest.
        steps = [
            step_data(s.seq, s.kind, s.payload, s.content_start, s.content_end)
            for s in steps_of(run.pk).order_by("seq")[:200]
        ]
        context.update(run=run, events_url=f"{events}?token={token}", steps=steps)
    return render(request, "demo/live.html", context)
