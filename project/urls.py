from django.contrib import admin
from django.urls import include, path

from project.demo import views as demo

urlpatterns = [
    path("admin/", admin.site.urls),
    # A run's live events: GET agents/runs/<id>/events (text/event-stream); the callback URLs
    # of tool calls that wait on a service: POST agents/callbacks/<token>.
    path("agents/", include("durable_agents.urls")),
    # The demo's page that starts a run and shows it live.
    path("demo/live/", demo.live, name="demo-live"),
]
