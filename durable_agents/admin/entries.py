"""The operations and dead-letter pages as lines of the admin's list of models (on /admin/ and
/admin/durable_agents/). That list shows registered models only, so each page has a proxy model
without a table (``OperationsEntry``, ``DeadLetterEntry``) whose "list" is a redirect to the
page. Whoever may view runs sees both lines; the pages check the same permission."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.urls import URLPattern, path, reverse


class PageEntry(admin.ModelAdmin):  # type: ignore[type-arg]
    """A line in the list of models that leads to one of the runs' pages."""

    page: str  # the URL name of the page, under the runs' admin

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return request.user.has_perm("durable_agents.view_agentrun")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def get_urls(self) -> list[URLPattern]:
        info = self.opts.app_label, self.opts.model_name
        view = self.admin_site.admin_view(self.go_to_page)
        return [path("", view, name="{}_{}_changelist".format(*info))]

    def go_to_page(self, request: HttpRequest) -> HttpResponse:
        # The page itself checks the permission (a redirect reveals nothing).
        return HttpResponseRedirect(reverse(f"{self.admin_site.name}:{self.page}"))


class OperationsEntryAdmin(PageEntry):
    page = "durable_agents_agentrun_operations"


class DeadLetterEntryAdmin(PageEntry):
    page = "durable_agents_agentrun_dead_letter"
