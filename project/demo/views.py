"""The demo's live page: start a run and watch it work, as an end user would.

``GET /demo/live/`` shows a button; its POST starts a run of the ``narrator`` agent (streamed
turns, progress messages) and redirects to ``?run=<id>``, which shows that run followed live
through ``runs/<id>/events`` with a ``stream_token`` in a cookie scoped to that URL
(``set_stream_cookie``: the token is in no URL, so in no access log): the page's visitor is
not staff. A token is only given for a run this browser session started (kept in the session),
as an end user's page would: knowing a run's id is not enough to read it.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import render
from django.urls import reverse
from django.views.decorators.http import require_http_methods

import durable_agents
from durable_agents.live.events import step_data
from durable_agents.models import AgentRun, steps_of
from durable_agents.offline.script import prose_of

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
        events = reverse("durable_agents:run_events", args=[run.pk])
        # What is committed already, rendered by the server (the page without JavaScript);
        # the script adds the rest.
        steps = [
            step_data(s.seq, s.kind, s.payload, s.content_start, s.content_end)
            for s in steps_of(run.pk).order_by("seq")[:200]
        ]
        for step in steps:
            step["line"] = describe(step)
        context.update(
            run=run,
            # What a person asked; the offline model's plan lines stay in the run's task.
            task=prose_of(run.task),
            events_url=events,
            steps=steps,
        )
    response = render(request, "demo/live.html", context)
    if "run" in context:
        durable_agents.set_stream_cookie(response, context["run"].pk, request=request)
    return response


def describe(step: dict[str, Any]) -> str:
    """A committed step as one line of the page, as live.js writes the steps that come later;
    the task as a person wrote it (without the offline model's plan lines)."""
    if step.get("truncated"):
        text = f"{step['content'][:2000]} [... {step['truncated']} characters]"
    else:
        text = text_of(step["content"])
    return prose_of(text) if step["kind"] == "task" else text


def text_of(blocks: Any) -> str:
    """live.js's textOf: the text of content blocks, tool calls and results in brackets."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        return json.dumps(blocks)
    parts = []
    for block in blocks:
        if not isinstance(block, dict):
            parts.append(str(block))
        elif block.get("type") == "text":
            parts.append(str(block.get("text") or ""))
        elif block.get("type") in ("thinking", "redacted_thinking"):
            continue
        elif block.get("type") == "tool_use":
            parts.append(f"[calls {block.get('name')} {json.dumps(block.get('input'))}]")
        elif block.get("type") == "tool_result":
            error = "[error] " if block.get("is_error") else ""
            parts.append(error + text_of(block.get("content")))
        else:
            parts.append(f"[{block.get('type')}]")
    return " ".join(part for part in parts if part)
