"""Dead letters in the admin: the jobs whose attempts ran out, listed; requeue, purge.

Listed most recent death first through :mod:`celery_delayed.dlq` (the
dead-letter queue is bounded by ``delayed_dlq_max_len``, so an offset page is
cheap). Requeue needs the change permission, purge the delete permission.
"""

from __future__ import annotations

from functools import partial
from typing import Any
from urllib.parse import urlencode

from django.contrib import messages
from django.contrib.admin.utils import unquote
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect

from .... import dlq
from ....errors import DelayedError
from .base import StoreAdmin, celery_app, local
from .jobs import job_page

#: The changelist's actions: name -> label.
ACTIONS = {"requeue": "Requeue selected dead letters"}


def _requeue(app: Any, job_id: str) -> str:
    return f"requeued, due {local(dlq.requeue(app, job_id))}"


class DeadLetterAdmin(StoreAdmin):
    """The dead-letter queue (see the module docstring)."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def changelist_view(self, request: HttpRequest, extra_context: Any = None) -> HttpResponse:
        self.require(request, "view")
        app = celery_app()
        if request.method == "POST":
            self.require(request, "change")
            ids = request.POST.getlist("_selected_action")
            if request.POST.get("action") not in ACTIONS or not ids:
                messages.warning(request, "Select the dead letters and the action to run on them.")
            for jid in ids:
                self.act(request, jid, "requeue", partial(_requeue, app, jid))
            return self.back(request, self.url("changelist"))
        task = request.GET.get("task") or None
        page = request.GET.get("p", "0")
        offset = int(page) * self.list_per_page if page.isdigit() else 0
        letters = dlq.list_dead(app, offset=offset, limit=self.list_per_page + 1, task=task)
        more, letters = len(letters) > self.list_per_page, letters[:self.list_per_page]
        base = {"task": task} if task else {}
        rows = [{"id": d.id, "url": self.url("change", d.id), "died": local(d.died_ms), "task": d.task,
                 "task_url": "?" + urlencode({"task": d.task}), "queue": d.queue, "error": d.error,
                 "attempts": d.attempts, "host": d.host} for d in letters]
        n = offset // self.list_per_page
        return self.render(request, "admin/celery_delayed/dead_letters.html", "Dead letters", {
            "rows": rows, "total": dlq.count(app), "task": task, "actions": ACTIONS,
            "next_url": "?" + urlencode({**base, "p": n + 1}) if more else None,
            "prev_url": "?" + urlencode({**base, "p": n - 1}) if n > 0 else None,
            "all_url": "?" if task else None, "back": request.get_full_path(),
            "purge_url": self.url("delete", "all"),
        })

    def change_view(self, request: HttpRequest, object_id: str, form_url: str = "",
                    extra_context: Any = None) -> HttpResponse:
        return job_page(self, request, object_id, "dead letter")

    def add_view(self, request: HttpRequest, form_url: str = "", extra_context: Any = None) -> HttpResponse:
        self.require(request, "add")
        raise AssertionError("unreachable")  # (no add permission)

    def delete_view(self, request: HttpRequest, object_id: str, extra_context: Any = None) -> HttpResponse:
        """Purge: ``all`` (with ``older_than`` seconds, optional), after a confirmation page."""
        self.require(request, "delete")
        app = celery_app()
        if unquote(object_id) != "all":
            messages.warning(request, "Dead letters are purged together (all, or those older than some time): "
                                      "requeue one to keep it.")
            return HttpResponseRedirect(self.url("changelist"))
        older_text = (request.POST.get("older_than") or request.GET.get("older_than") or "").strip()
        error = ""
        older: float | None = None
        if older_text:
            try:
                older = float(older_text)
            except ValueError:
                error = f"older than must be a number of seconds, got {older_text!r}"
        if request.method == "POST" and request.POST.get("confirm") == "yes" and not error:
            try:
                n = dlq.purge(app, older_than=older)
            except DelayedError as exc:
                messages.error(request, f"purge failed: {exc}")
                return HttpResponseRedirect(self.url("changelist"))
            what = f"older than {older_text} s" if older is not None else "all"
            self.log(request, "all", f"purged {n} dead letter(s) ({what})", "delete")
            messages.success(request, f"Purged {n} dead letter(s) ({what}).")
            return HttpResponseRedirect(self.url("changelist"))
        return self.render(request, "admin/celery_delayed/purge_confirm.html", "Purge dead letters?", {
            "total": dlq.count(app), "older_than": older_text, "error": error,
        })
