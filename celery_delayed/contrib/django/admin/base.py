"""What the three admins share: their URLs, pages, permissions, times in the user's zone, the Celery app.

A :class:`StoreAdmin` is a ``ModelAdmin`` whose objects live in the store,
not in a table: it serves its own changelist, change, add and delete views
(under the URL names Django's admin gives them, so that the admin's index,
breadcrumbs and "Recent actions" link to them) and never queries the model.
Each action goes through celery-delayed's API, the one the CLI and the
dashboard use, and is written to the admin's log (``LogEntry``).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

from celery import Celery
from django.contrib import admin, messages
from django.contrib.admin.utils import quote
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils import timezone

from ....describe import ago
from ....errors import DelayedError, InvalidWhen
from ....timeutil import from_ms


def celery_app() -> Celery:
    """The project's Celery app (``celery.current_app``: the one ``proj/__init__.py`` imports)."""
    from celery import current_app

    app: Celery = current_app._get_current_object()
    return app


def local(ms: int | None, now_ms: int | None = None) -> str:
    """An epoch-ms time in the user's time zone (Django's current one), with how far it is from now."""
    if ms is None:
        return "-"
    dt = timezone.localtime(from_ms(int(ms)), timezone.get_current_timezone())
    text = dt.strftime("%Y-%m-%d %H:%M:%S %Z")
    return text if now_ms is None else f"{text} ({ago(int(ms), now_ms)})"


def parse_when(text: str) -> float | datetime:
    """A form's "when": seconds from now, or a date and time (without a zone: the user's time zone).

    Raises:
        InvalidWhen: neither.
    """
    text = text.strip()
    if not text:
        raise InvalidWhen("give a date and time (or seconds from now) to reschedule to")
    try:
        return float(text)
    except ValueError:
        pass
    try:
        dt = datetime.fromisoformat(text)
    except ValueError as exc:
        raise InvalidWhen(f"when must be a date and time (2030-01-31 14:00) or seconds from now, got {text!r}") \
            from exc
    return timezone.make_aware(dt, timezone.get_current_timezone()) if timezone.is_naive(dt) else dt


class StoreAdmin(admin.ModelAdmin):  # type: ignore[misc]  # Django is not type-checked here
    """A ModelAdmin over objects of the store (see the module docstring)."""

    #: Rows per page of a list.
    list_per_page = 100

    def get_urls(self) -> list[Any]:
        info = self.opts.app_label, self.opts.model_name
        wrap = self.admin_site.admin_view
        return [
            path("", wrap(self.changelist_view), name="{}_{}_changelist".format(*info)),
            path("add/", wrap(self.add_view), name="{}_{}_add".format(*info)),
            path("<path:object_id>/change/", wrap(self.change_view), name="{}_{}_change".format(*info)),
            path("<path:object_id>/delete/", wrap(self.delete_view), name="{}_{}_delete".format(*info)),
            path("<path:object_id>/history/", wrap(self.change_view), name="{}_{}_history".format(*info)),
        ]

    def get_queryset(self, request: HttpRequest) -> Any:
        return self.model.objects.none()  # (never queried: the objects live in the store)

    # -- URLs, pages -------------------------------------------------------------------

    def url(self, view: str, object_id: str | None = None) -> str:
        """The URL of one of this admin's views (``object_id`` quoted as the admin quotes it)."""
        name = f"admin:{self.opts.app_label}_{self.opts.model_name}_{view}"
        return str(reverse(name, args=[] if object_id is None else [quote(object_id)],
                           current_app=self.admin_site.name))

    def render(self, request: HttpRequest, template: str, title: str, context: dict[str, Any]) -> TemplateResponse:
        """A page of the admin's look (``admin/base_site.html``) with this model's context."""
        ctx = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "app_label": self.opts.app_label,
            "title": title,
            "subtitle": None,
            "has_view_permission": self.has_view_permission(request),
            "has_add_permission": self.has_add_permission(request),
            "has_change_permission": self.has_change_permission(request),
            "has_delete_permission": self.has_delete_permission(request),
            "changelist_url": self.url("changelist"),
            "time_zone": timezone.get_current_timezone_name(),
            **context,
        }
        request.current_app = self.admin_site.name
        return TemplateResponse(request, template, ctx)

    # -- permissions -------------------------------------------------------------------

    def require(self, request: HttpRequest, permission: str) -> None:
        """Raise PermissionDenied (403) unless the user has ``permission`` (view, add, change, delete) here."""
        allowed = {"view": self.has_view_permission, "add": self.has_add_permission,
                   "change": self.has_change_permission, "delete": self.has_delete_permission}[permission]
        if not allowed(request):
            raise PermissionDenied

    # -- acting ------------------------------------------------------------------------

    def act(self, request: HttpRequest, object_id: str, what: str, call: Callable[[], str]) -> bool:
        """Run one action through the API: a message, and a ``LogEntry`` when it worked; False when it failed."""
        name = f"{str(self.opts.verbose_name).capitalize()} {object_id}"
        try:
            done = call()
        except DelayedError as exc:
            messages.error(request, f"{name}: {what} failed: {exc}")
            return False
        self.log(request, object_id, done)
        messages.success(request, f"{name}: {done}")
        return True

    def log(self, request: HttpRequest, object_id: str, message: str, flag: str = "change") -> None:
        """Write an action to the admin's log ("Recent actions", the object's history)."""
        from django.contrib.admin.models import ADDITION, CHANGE, DELETION, LogEntry
        from django.contrib.contenttypes.models import ContentType

        LogEntry.objects.create(
            user_id=request.user.pk, content_type_id=ContentType.objects.get_for_model(self.model).pk,
            object_id=object_id, object_repr=object_id[:200], change_message=message,
            action_flag={"add": ADDITION, "change": CHANGE, "delete": DELETION}[flag])

    def back(self, request: HttpRequest, fallback: str) -> HttpResponse:
        """Redirect to the page the form was on (its own path, same host), else ``fallback``."""
        here = request.POST.get("_back", "")
        return HttpResponseRedirect(here if here.startswith("/") and not here.startswith("//") else fallback)
