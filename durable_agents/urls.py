"""``include("durable_agents.urls")``: a run's live events for the pages that show it.

GET runs/<id>/events    text/event-stream (``views.run_events``)
"""

from django.urls import path

from durable_agents.live import views

app_name = "durable_agents"

urlpatterns = [
    path("runs/<uuid:run_id>/events", views.run_events, name="run_events"),
]
