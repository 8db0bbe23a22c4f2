"""What the admin's screens share: the ModelAdmin base, the read-only base, the pages a
ModelAdmin holds besides its own, the confirmation page of an action, and ids read from a URL
or a form."""

from __future__ import annotations

import abc
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from django import forms
from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.options import IncorrectLookupParameters
from django.contrib.admin.views.main import SEARCH_VAR, ChangeList
from django.core.exceptions import ValidationError
from django.db.models import (
    Model,
    QuerySet,
)
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, reverse
from django.utils.translation import gettext
from django.views.decorators.http import require_http_methods, require_POST

from durable_agents._internal import encryption
from durable_agents._internal.counting import Count
from durable_agents._internal.text import plain_markers
from durable_agents.admin.format import Text
from durable_agents.admin.listing import EstimatingPaginator

if TYPE_CHECKING:
    from django.contrib.admin import ModelAdmin as _ModelAdmin
    from django_stubs_ext import StrOrPromise
else:

    class _ModelAdmin(admin.ModelAdmin):
        """ModelAdmin, subscriptable at run time as the type stubs declare it generic."""

        def __class_getitem__(cls, model: Any) -> Any:
            return cls


_M = TypeVar("_M", bound=Model)
SEND_EVENT_PERMISSION = "durable_agents.send_event"
# A list's search term longer than this is refused with a message: every term an operator has
# in hand (an id, a request id, a key, a few words) is far shorter, and a longer one would only
# make the database scan.
SEARCH_MAX_CHARS = 200


def clean_pk(model: Any, value: Any) -> Any:
    """``value`` as ``model``'s primary key, or ValueError: for any string from a URL or a
    form (non-numbers, NUL, out-of-range integers that PostgreSQL would refuse)."""
    field = model._meta.pk
    try:
        pk = field.to_python(value)
    except (ValidationError, TypeError) as exc:
        raise ValueError(str(value)) from exc
    if pk is None:
        raise ValueError("no id")
    if isinstance(pk, int) and not -(2**63) <= pk < 2**63:
        raise ValueError(str(value))
    return pk


def get_or_404(model: type[_M], object_id: Any, queryset: QuerySet[_M] | None = None) -> _M:
    """The object, or 404 for an unknown *or malformed* id (never a 500)."""
    try:
        pk = clean_pk(model, object_id)
    except ValueError:
        raise Http404(_no_match(model)) from None
    try:
        return (queryset if queryset is not None else model._default_manager.all()).get(pk=pk)
    except model.DoesNotExist:  # type: ignore[attr-defined]  # every concrete model has it
        raise Http404(_no_match(model)) from None


def _no_match(model: Any) -> str:
    return gettext("No %(name)s matches the given id.") % {"name": model._meta.verbose_name}


def shown_view(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    """``view``, whose GET and HEAD pages show a value encrypted with a key no longer in
    ENCRYPTION_KEYS as "[cannot decrypt: ... key id ...]" rather than failing (the page is
    rendered inside ``encryption.shown()``). A POST reads strictly: it may write."""

    @functools.wraps(view)
    def shown_page(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        if request.method not in ("GET", "HEAD"):
            return view(request, *args, **kwargs)
        with encryption.shown():
            response = view(request, *args, **kwargs)
            render = getattr(response, "render", None)
            if render is not None and not getattr(response, "is_rendered", True):
                render()  # templates read fields too
            return response

    return shown_page


@dataclass
class ConfirmRow:
    """One object of a confirmation page: what it shows, and whether "Yes" acts on it."""

    pk: str
    url: str
    label: str
    input: Text | None = None
    fingerprint: str = ""
    included: bool = True
    note: str = ""


class StrictChangeList(ChangeList):
    """A change list that filters only as the admin ships it: by its list filters, its date
    hierarchy, and the parameters its own pages link to (``AgentsAdmin.list_lookups``).

    Django applies any other ``field__lookup=value`` of the query string as it comes, and
    ``?task__regex=[`` then fails in the database (a 500); here it is an invalid lookup, which
    Django answers by showing the list again with ``?e=1``."""

    def get_filters(self, request: HttpRequest) -> Any:
        filters = super().get_filters(request)
        remaining = filters[2]  # what no list filter took (Django's return value)
        allowed = set(getattr(self.model_admin, "list_lookups", ()))
        if self.date_hierarchy:
            allowed |= {f"{self.date_hierarchy}__gte", f"{self.date_hierarchy}__lt"}
        unknown = sorted(set(remaining) - allowed)
        if unknown:
            raise IncorrectLookupParameters(f"Filtering by {', '.join(unknown)} is not offered")
        return filters

    def get_results(self, request: HttpRequest) -> None:
        # A page number whose OFFSET no bigint holds (?p=9999...): an invalid page, as Django
        # calls a page past the end, not a database error.
        if not 0 < self.page_num < 2**62 // max(self.list_per_page, 1):
            raise IncorrectLookupParameters(f"No page {self.page_num}")
        super().get_results(request)


class AgentsAdmin(_ModelAdmin[_M]):
    """What the ModelAdmins share: object views and confirmation pages."""

    # Query parameters a list accepts besides its filters': those the app's own pages link to
    # (StrictChangeList refuses every other lookup).
    list_lookups: tuple[str, ...] = ()

    def get_changelist(self, request: HttpRequest, **kwargs: Any) -> type[ChangeList]:
        return StrictChangeList

    @property
    def urls(self) -> list[URLPattern]:
        """Every view of the admin (``get_urls``), each page read through ``shown_view``."""
        patterns = self.get_urls()
        for pattern in patterns:
            pattern.callback = shown_view(pattern.callback)
        return patterns

    def _object_url(self, name: str) -> str:
        return f"{self.opts.app_label}_{self.opts.model_name}_{name}"

    def _url(self, name: str, *args: Any) -> str:
        return reverse(f"{self.admin_site.name}:{self._object_url(name)}", args=args)

    def _post_view(self, view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
        # admin_view: staff login and CSRF protection; require_POST: no GET changes state.
        return self.admin_site.admin_view(require_POST(view))

    def _confirm_view(self, view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
        # GET shows a confirmation, POST (CSRF-checked by admin_view) decides; nothing else.
        return self.admin_site.admin_view(require_http_methods(["GET", "HEAD", "POST"])(view))

    def _redirect_to_object(self, obj: Any) -> HttpResponseRedirect:
        return HttpResponseRedirect(self._url("change", obj.pk))

    def render_change_form(
        self,
        request: HttpRequest,
        context: dict[str, Any],
        add: bool = False,
        change: bool = False,
        form_url: str = "",
        obj: Any = None,
    ) -> HttpResponse:
        # The page's <title> and heading name the object (a tool, an event): its invisible
        # and direction-changing characters read as markers there too.
        for name in ("title", "subtitle"):
            if context.get(name):
                context[name] = plain_markers(context[name])
        return super().render_change_form(request, context, add, change, form_url, obj)

    def history_view(
        self, request: HttpRequest, object_id: str, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        # "Change history: <the object>": the object's name reads with markers there too.
        response = super().history_view(request, object_id, extra_context)
        context = getattr(response, "context_data", None)
        if context is not None:
            for name in ("title", "subtitle"):
                if context.get(name):
                    context[name] = plain_markers(context[name])
        return response

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        # A NUL in a filter or search term reaches PostgreSQL as a query parameter, which it
        # refuses (a 500): the list is shown without them, and says why.
        if any("\x00" in value for _, values in request.GET.lists() for value in values):
            self.message_user(
                request,
                gettext(
                    "The search or a filter held a NUL character; showing the list without them."
                ),
                messages.ERROR,
            )
            return HttpResponseRedirect(request.path)
        if len(request.GET.get(SEARCH_VAR, "")) > SEARCH_MAX_CHARS:
            self.message_user(
                request,
                gettext(
                    "The search term is longer than %(limit)s characters; showing the list "
                    "without it."
                )
                % {"limit": SEARCH_MAX_CHARS},
                messages.ERROR,
            )
            kept = request.GET.copy()
            del kept[SEARCH_VAR]
            return HttpResponseRedirect(f"{request.path}?{kept.urlencode()}")
        return super().changelist_view(request, extra_context)

    def response_action(
        self, request: HttpRequest, queryset: QuerySet[Any], *args: Any, **kwargs: Any
    ) -> HttpResponse | None:
        # Django filters pk__in=<posted ids>: a malformed id would be a 500 there. (Django 6
        # passes action_location too: arguments are handed on as they come.)
        try:
            for value in request.POST.getlist(helpers.ACTION_CHECKBOX_NAME):
                clean_pk(self.model, value)
        except ValueError:
            self.message_user(
                request, gettext("Malformed ids were posted; nothing was changed."), messages.ERROR
            )
            return HttpResponseRedirect(request.get_full_path())
        return super().response_action(request, queryset, *args, **kwargs)

    @staticmethod
    def _confirmed(request: HttpRequest) -> bool:
        """Whether this POST is the "Yes" of a confirmation page.

        Confirmation pages post the exact ids they listed, never select_across: a "Yes" that
        carries select_across would act on whatever matches the filters *now*, including
        objects created after the page was shown. Such a POST gets the confirmation page.
        """
        return request.POST.get("post") == "yes" and request.POST.get("select_across") != "1"

    @staticmethod
    def _posted_ids(request: HttpRequest) -> set[str]:
        return set(request.POST.getlist(helpers.ACTION_CHECKBOX_NAME))

    def _render_confirmation(
        self,
        request: HttpRequest,
        *,
        title: StrOrPromise,
        question: StrOrPromise,
        rows: list[ConfirmRow],
        matched: int,
        skipped: int,
        button: StrOrPromise,
        action: str,
        form_url: str,
        reason_form: forms.Form | None = None,
        extra_form: forms.Form | None = None,
        extra_hidden: dict[str, str] | None = None,
        note: StrOrPromise = "",
        status: int = 200,
    ) -> TemplateResponse:
        """The intermediate page of an action: every object it will act on is listed, and
        "Yes" posts exactly those ids (and, for intents, what was shown of each; for an
        event, its name in ``extra_hidden``, and ``extra_form``'s fields)."""
        included = [row for row in rows if row.included]
        context = {
            **self.admin_site.each_context(request),
            "title": title,
            "question": question,
            "opts": self.opts,
            "rows": rows,
            "included": included,
            "affected_count": len(included),
            "excluded_count": len(rows) - len(included),
            # Matching objects beyond the page's limit: not listed, so not acted on.
            "more_count": max(matched - len(rows), 0),
            "skipped_count": skipped,
            "button": button,
            "action": action,
            "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
            "fingerprint_field": FINGERPRINT_FIELD,
            "select_across": request.POST.get("select_across") == "1",
            "form_url": form_url,
            "reason_form": reason_form,
            "extra_form": extra_form,
            "extra_hidden": sorted((extra_hidden or {}).items()),
            "note": note,
        }
        return TemplateResponse(
            request, "admin/durable_agents/action_confirmation.html", context, status=status
        )


class ReadOnlyAdmin(AgentsAdmin[_M]):
    """An admin whose rows runs and workers write: no person adds, changes or deletes one
    from a form (a saved change form would write a stale copy of a row that workers update).
    Every change of state is an action or a POST view of the screen, through the api."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


_A = TypeVar("_A", bound=AgentsAdmin[Any])


class AdminPage(abc.ABC, Generic[_A]):
    """Pages that live under a ModelAdmin without being its own views: the admin builds each
    with itself (``page = ForkPages(model_admin)``) and adds the page's ``urls()`` to its
    ``get_urls``, so their paths and URL names are the admin's. A page holds its views;
    whatever they need of the admin (its site and model, permissions, messages, the names
    of its URLs, its confirmation pages) they ask of ``self.admin``."""

    def __init__(self, model_admin: _A) -> None:
        self.admin = model_admin

    @abc.abstractmethod
    def urls(self) -> list[URLPattern]:
        """The page's URL patterns, each view wrapped by the admin site's ``admin_view``
        (staff login and CSRF protection), as the admin's own views are."""


class CountedChangeList(StrictChangeList):
    """A change list whose count a page prints as ``result_count_text``: "4 agent runs", or
    past EXACT_COUNT_LIMIT "about 1.2 million agent runs" (EstimatingPaginator;
    the app's pagination.html and search_form.html print it)."""

    @property
    def result_count_text(self) -> str:
        paginator = getattr(self, "paginator", None)
        if isinstance(paginator, EstimatingPaginator):
            count = paginator.bounded
        else:
            count = Count(self.result_count, exact=True)
        return count.describe(str(self.opts.verbose_name), str(self.opts.verbose_name_plural))


FINGERPRINT_FIELD = "fingerprint"
