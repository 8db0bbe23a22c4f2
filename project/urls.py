from django.contrib import admin
from django.urls import include, path

urlpatterns = [
    path("admin/", admin.site.urls),
    # A run's live events: GET agents/runs/<id>/events (text/event-stream).
    path("agents/", include("durable_agents.urls")),
]
