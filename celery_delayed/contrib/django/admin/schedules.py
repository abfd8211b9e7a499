"""Recurring schedules in the admin: listed, added, edited, enabled and disabled, run now, deleted.

Edited as django-celery-beat's periodic tasks are (crontab or interval, time
zone, enabled, args and kwargs), but kept where every scheduler reads them:
the store, through :mod:`celery_delayed.schedules` (the API the CLI uses). A
change takes effect in the running schedulers without a restart: the
occurrences of the old definition are cancelled and the next one is stored
at once.
"""

from __future__ import annotations

import json
from functools import partial
from typing import Any

from django.contrib import messages
from django.contrib.admin.utils import unquote
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect

from .... import schedules
from ....errors import ScheduleNotFound
from ....store import get_store
from ..forms import CRON_FIELDS, ScheduleForm
from .base import StoreAdmin, celery_app, local

#: The changelist's actions: name -> (label, permission).
ACTIONS = {"enable": ("Enable selected schedules", "change"), "disable": ("Disable selected schedules", "change"),
           "run_now": ("Run selected schedules now (one extra occurrence)", "change"),
           "delete": ("Delete selected schedules", "delete")}


def _enable(app: Any, name: str, enabled: bool) -> str:
    if enabled:
        return "enabled" if schedules.resume(app, name) else "was enabled already"
    return "disabled (pending occurrences cancelled)" if schedules.pause(app, name) else "was disabled already"


def _run_now(app: Any, name: str) -> str:
    return f"run now as job {schedules.run_now(app, name).id}"


class ScheduleAdmin(StoreAdmin):
    """Recurring schedules (see the module docstring)."""

    def changelist_view(self, request: HttpRequest, extra_context: Any = None) -> HttpResponse:
        self.require(request, "view")
        app = celery_app()
        if request.method == "POST":
            return self._bulk(request, app)
        now = get_store(app).redis.now_ms()
        rows = [{"name": s.name, "url": self.url("change", s.name), "task": s.task, "schedule": s.schedule,
                 "timezone": s.timezone, "enabled": not s.paused, "next": local(s.next_fire_ms, now),
                 "source": "settings" if s.source == "config" else "admin / API", "misfire": s.misfire}
                for s in schedules.list(app)]
        may = {"change": self.has_change_permission(request), "delete": self.has_delete_permission(request)}
        actions = {k: label for k, (label, perm) in ACTIONS.items() if may[perm]}
        return self.render(request, "admin/celery_delayed/schedules.html", "Recurring schedules", {
            "rows": rows, "actions": actions, "back": request.get_full_path(), "add_url": self.url("add")})

    def _bulk(self, request: HttpRequest, app: Any) -> HttpResponse:
        action = request.POST.get("action", "")
        names = request.POST.getlist("_selected_action")
        if action not in ACTIONS or not names:
            messages.warning(request, "Select the schedules and the action to run on them.")
            return self.back(request, self.url("changelist"))
        self.require(request, ACTIONS[action][1])
        for name in names:
            if action in ("enable", "disable"):
                self.act(request, name, action, partial(_enable, app, name, action == "enable"))
            elif action == "run_now":
                self.act(request, name, "run now", partial(_run_now, app, name))
            else:
                self.act(request, name, "delete", partial(self._remove, request, app, name))
        return self.back(request, self.url("changelist"))

    def _remove(self, request: HttpRequest, app: Any, name: str) -> str:
        source = schedules.get(app, name).source
        n = schedules.remove(app, name)
        if source == "config":
            messages.warning(request, f"{name} is declared in the settings (CELERY_DELAYED_SCHEDULE): it comes back "
                                      "when a scheduler syncs them, unless it is removed there too.")
        return f"deleted ({n} pending occurrence(s) cancelled)"

    # -- one schedule ------------------------------------------------------------------

    def add_view(self, request: HttpRequest, form_url: str = "", extra_context: Any = None) -> HttpResponse:
        self.require(request, "add")
        return self._form(request, None)

    def change_view(self, request: HttpRequest, object_id: str, form_url: str = "",
                    extra_context: Any = None) -> HttpResponse:
        self.require(request, "view")
        return self._form(request, unquote(object_id))

    def _form(self, request: HttpRequest, name: str | None) -> HttpResponse:
        app = celery_app()
        current = None
        if name is not None:
            try:
                current = schedules.get(app, name)
            except ScheduleNotFound:
                messages.warning(request, f"There is no recurring schedule named {name!r}.")
                return HttpResponseRedirect(self.url("changelist"))
        initial = self._initial(app, current) if current is not None else {}
        options = current.options if current is not None else {}
        if request.method == "POST":
            self.require(request, "change" if current is not None else "add")
            if current is not None and request.POST.get("action") == "run_now":
                self.act(request, current.name, "run now", partial(_run_now, app, current.name))
                return HttpResponseRedirect(request.path)
            form = ScheduleForm(request.POST, app=app, editing=current is not None, options=options,
                                initial=initial)
            if form.is_valid():
                saved = self._save(request, app, form, current)
                if saved:
                    if "_continue" in request.POST:
                        return HttpResponseRedirect(self.url("change", form.cleaned_data["name"]))
                    return HttpResponseRedirect(self.url("changelist"))
        else:
            form = ScheduleForm(app=app, editing=current is not None, options=options, initial=initial)
        can_edit = self.has_change_permission(request) if current is not None else True
        if not can_edit:
            for field in form.fields.values():
                field.disabled = True
        title = f"Change recurring schedule {name}" if current is not None and can_edit else \
            f"Recurring schedule {name}" if current is not None else "Add recurring schedule"
        now = get_store(app).redis.now_ms()
        return self.render(request, "admin/celery_delayed/schedule_form.html", title, {
            "form": form, "schedule": current, "can_edit": can_edit, "tasks": sorted(
                t for t in app.tasks if not t.startswith("celery.")), "zones": ScheduleForm.zones(),
            "next": local(current.next_fire_ms, now) if current is not None else "",
            "occurrences": [(jid, local(fire, now), self._job_url(jid)) for jid, fire in current.occurrences[-10:]]
            if current is not None else [],
            "delete_url": self.url("delete", name) if current is not None else "", "original": current,
            "app_zone": str(app.conf.timezone or "UTC"), "cron_fields": CRON_FIELDS,
            "fieldsets": [("Task", ("name", "task", "enabled", "args", "kwargs", "queue")),
                          ("When", ("kind", "every", "minute", "hour", "day_of_month", "month_of_year",
                                    "day_of_week", "timezone")),
                          ("Options", ("misfire", "skip_if_running"))],
        })

    def _job_url(self, job_id: str) -> str:
        from django.contrib.admin.utils import quote
        from django.urls import reverse

        return str(reverse(f"admin:{self.opts.app_label}_pendingjob_change", args=[quote(job_id)],
                           current_app=self.admin_site.name))

    @staticmethod
    def _initial(app: Any, s: schedules.Schedule) -> dict[str, Any]:
        stored = get_store(app).schedules.get(s.name)
        spec = stored.definition["spec"] if stored is not None else {}
        out: dict[str, Any] = {"name": s.name, "task": s.task, "enabled": not s.paused, "args": json.dumps(s.args),
                               "kwargs": json.dumps(s.kwargs), "queue": s.options.get("queue", ""),
                               "misfire": s.misfire, "skip_if_running": s.skip_if_running,
                               "timezone": stored.definition.get("timezone", "") if stored is not None else ""}
        if "every_ms" in spec:
            out |= {"kind": "interval", "every": spec["every_ms"] / 1000}
        else:
            out |= {"kind": "crontab", **{f: spec.get("cron", {}).get(f, "*") for f in CRON_FIELDS}}
        return out

    def _save(self, request: HttpRequest, app: Any, form: ScheduleForm, current: schedules.Schedule | None) -> bool:
        """Write the schedule through the API (only what changed); False when the API refused it."""
        name = form.cleaned_data["name"]
        enabled = bool(form.cleaned_data.get("enabled"))
        stored = get_store(app).schedules.get(name) if current is not None else None
        if current is None and get_store(app).schedules.get(name) is not None:
            form.add_error("name", f"a recurring schedule named {name!r} exists already: edit it")
            return False
        changed = stored is None or stored.definition != form.definition
        e = form.entry
        notes = []
        if changed:
            if not self.act(request, name, "save", lambda: "saved: " + schedules.add(
                    app, name, e["task"], e["schedule"], e["args"], e["kwargs"], e["options"],
                    timezone=e["timezone"], misfire=e["misfire"], skip_if_running=e["skip_if_running"],
                    strict=True).schedule):
                return False
            if current is None:
                self.log(request, name, "added", "add")
            if current is not None and current.source == "config":
                notes.append("it is declared in the settings too: this change wins until that entry itself changes")
        if (current is None and not enabled) or (current is not None and current.paused == enabled):
            self.act(request, name, "enable" if enabled else "disable", lambda: _enable(app, name, enabled))
        elif not changed:
            messages.info(request, f"{name}: nothing changed")
        for note in notes:
            messages.warning(request, f"{name}: {note}")
        return True

    def delete_view(self, request: HttpRequest, object_id: str, extra_context: Any = None) -> HttpResponse:
        self.require(request, "delete")
        app = celery_app()
        name = unquote(object_id)
        try:
            current = schedules.get(app, name)
        except ScheduleNotFound:
            messages.warning(request, f"There is no recurring schedule named {name!r}.")
            return HttpResponseRedirect(self.url("changelist"))
        if request.method == "POST":
            self.act(request, name, "delete", lambda: self._remove(request, app, name))
            return HttpResponseRedirect(self.url("changelist"))
        return self.render(request, "admin/celery_delayed/schedule_delete.html", "Are you sure?", {
            "schedule": current, "original": current, "change_url": self.url("change", name)})
