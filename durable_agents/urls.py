"""``include("durable_agents.urls")``: a run's live events for the pages that show it, and the
callback URLs of calls that wait on a service.

GET  runs/<id>/events     text/event-stream (``live.views.run_events``)
POST callbacks/<token>    completes a ``Wait(callback=True)`` (``callbacks.views.receive``)
"""

from django.urls import path

from durable_agents.callbacks import views as callbacks
from durable_agents.live import views

app_name = "durable_agents"

urlpatterns = [
    path("runs/<uuid:run_id>/events", views.run_events, name="run_events"),
    path("callbacks/<str:token>", callbacks.receive, name="callback"),
]
