"""Pending jobs in the admin: listed in due order, searched, filtered; cancel, run now, reschedule.

The list pages by due time with a cursor (:meth:`celery_delayed.store.Pending.window`):
each page reads at most a page of entries per sorted set, and the total is the
sets' sizes (``ZCARD``), so a page costs the same with a million pending jobs
as with ten. The filters come from the pending index (:meth:`~celery_delayed.store.Pending.routes`).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

from django.contrib import messages
from django.http import HttpRequest, HttpResponse, HttpResponseBadRequest, HttpResponseRedirect

from .... import controls, describe
from ....api import cancel, reschedule
from ....errors import JobNotFound
from ....producer.prepare import job_id_for_key
from ....store import Pending, get_store
from ....vocab import Field, JobState
from .base import StoreAdmin, celery_app, local, parse_when

#: The changelist's actions: name -> label.
ACTIONS = {"cancel": "Cancel selected jobs", "promote": "Run selected jobs now",
           "reschedule": "Reschedule selected jobs to…"}


def cursor_text(cursor: tuple[int, int, str]) -> str:
    """A page cursor as the list's ``after`` parameter: ``<due ms>|<shard>|<job id>``."""
    return f"{cursor[0]}|{cursor[1]}|{cursor[2]}"


def parse_cursor(text: str) -> tuple[int, int, str] | None:
    """The ``after`` parameter ('' : the first page); None for one that is not a cursor."""
    due, _, rest = text.partition("|")
    shard, _, jid = rest.partition("|")
    if not jid or not due.lstrip("-").isdigit() or not shard.isdigit():
        return None
    return int(due), int(shard), jid


def job_action(request: HttpRequest, action: str, job_id: str) -> tuple[str, Any]:
    """(what it is called, the call) of one job action through the API (the CLI's and the dashboard's)."""
    app = celery_app()
    if action == "cancel":
        return "cancel", lambda: f"cancelled (it was {cancel(app, job_id)})"
    if action == "promote":
        return "run now", lambda: f"due now, {local(controls.promote(app, job_id))}: the scheduler releases it at once"
    if action == "reschedule":
        when = request.POST.get("when", "")

        def move() -> str:
            return f"rescheduled to {local(reschedule(app, job_id, parse_when(when)))}"

        return "reschedule", move
    raise ValueError(action)


class PendingJobAdmin(StoreAdmin):
    """The jobs waiting for their due time (see the module docstring)."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def changelist_view(self, request: HttpRequest, extra_context: Any = None) -> HttpResponse:
        self.require(request, "view")
        if request.method == "POST":
            return self._bulk(request)
        app = celery_app()
        store = get_store(app)
        pending = Pending(store)
        get = request.GET
        q, task, queue = get.get("q", "").strip(), get.get("task") or None, get.get("queue") or None
        held = get.get("state") == "held"
        routes = pending.routes()
        note = ""
        if q:
            for candidate in (q, job_id_for_key(q)):
                try:
                    store.lookup.locate(candidate)
                except JobNotFound:
                    continue
                return HttpResponseRedirect(self.url("change", candidate))
            tasks = sorted({t for t, _ in routes if q.lower() in t.lower()})
            if len(tasks) == 1 or q in tasks:
                task = q if q in tasks else tasks[0]
            elif tasks:
                note = f"{len(tasks)} tasks match {q!r}: pick one in the filter"
            else:
                note = f"no pending job has id, idempotency key or task {q!r}"
        after_text = get.get("after", "")
        after = parse_cursor(after_text) if after_text else None
        if after_text and after is None:
            return HttpResponseBadRequest("bad cursor: 'after' is '<due ms>|<shard>|<job id>' as the next-page link "
                                          "gives it")
        rows, nxt = pending.window(after, self.list_per_page, task=task, queue=queue, held=held)
        now = store.redis.now_ms()
        for row in rows:
            row["url"] = self.url("change", row["id"])
            row["due_local"] = local(row["due"])
            row["due_ago"] = describe.ago(row["due"], now)
        base = {k: v for k, v in (("task", task), ("queue", queue), ("state", "held" if held else None)) if v}
        filters = self._filters(routes, base)
        return self.render(request, "admin/celery_delayed/pending_list.html", "Pending jobs", {
            "rows": rows, "total": pending.count(task, queue, held), "q": q, "note": note, "filters": filters,
            "task": task, "queue": queue, "held": held, "filtered": bool(base),
            "next_url": "?" + urlencode({**base, "after": cursor_text(nxt)}) if nxt else None,
            "first_url": "?" + urlencode(base) if after else None,
            "actions": ACTIONS, "back": request.get_full_path(),
        })

    def _filters(self, routes: dict[tuple[str, str], int], base: dict[str, str]) -> list[dict[str, Any]]:
        """The sidebar: by task, by queue and by state, each choice with its count and link."""
        by_task: dict[str, int] = {}
        by_queue: dict[str, int] = {}
        for (t, qu), n in routes.items():
            by_task[t] = by_task.get(t, 0) + n
            by_queue[qu] = by_queue.get(qu, 0) + n

        def link(key: str, value: str | None) -> str:
            params = {k: v for k, v in base.items() if k != key}
            if value:
                params[key] = value
            return "?" + urlencode(params)

        def choices(key: str, counts: dict[str, int]) -> list[dict[str, Any]]:
            out = [{"label": "All", "url": link(key, None), "selected": key not in base}]
            out += [{"label": f"{v or '(default)'} ({n})", "url": link(key, v), "selected": base.get(key) == v}
                    for v, n in sorted(counts.items())]
            return out

        states = [{"label": "Scheduled (all pending)", "url": link("state", None), "selected": "state" not in base},
                  {"label": "Held by a pause", "url": link("state", "held"), "selected": base.get("state") == "held"}]
        return [{"title": "task", "choices": choices("task", by_task)},
                {"title": "queue", "choices": choices("queue", by_queue)},
                {"title": "state", "choices": states}]

    def _bulk(self, request: HttpRequest) -> HttpResponse:
        self.require(request, "change")
        action = request.POST.get("action", "")
        ids = request.POST.getlist("_selected_action")
        if action not in ACTIONS:
            messages.warning(request, "Pick an action to run on the selected jobs.")
        elif not ids:
            messages.warning(request, "Select the jobs to act on: none was selected.")
        else:
            ok = 0
            for jid in ids:
                what, call = job_action(request, action, jid)
                ok += self.act(request, jid, what, call)
            if len(ids) > 1:
                messages.info(request, f"{ACTIONS[action].rstrip('…').replace('selected ', '')}: {ok} of "
                                       f"{len(ids)} done")
        return self.back(request, self.url("changelist"))

    def change_view(self, request: HttpRequest, object_id: str, form_url: str = "",
                    extra_context: Any = None) -> HttpResponse:
        return job_page(self, request, object_id, "pending job")

    def add_view(self, request: HttpRequest, form_url: str = "", extra_context: Any = None) -> HttpResponse:
        self.require(request, "add")
        raise AssertionError("unreachable")  # (no add permission)

    def delete_view(self, request: HttpRequest, object_id: str, extra_context: Any = None) -> HttpResponse:
        self.require(request, "delete")
        raise AssertionError("unreachable")  # (no delete permission: cancel is a change)


def job_page(admin: StoreAdmin, request: HttpRequest, object_id: str, kind: str) -> HttpResponse:
    """One job (any state): what an operator reads first, the rest of its record; its actions (POST)."""
    from django.contrib.admin.utils import unquote

    from ....dlq import requeue

    admin.require(request, "view")
    job_id = unquote(object_id)
    app = celery_app()
    store = get_store(app)
    if request.method == "POST":
        admin.require(request, "change")
        action = request.POST.get("action", "")
        if action == "requeue":
            admin.act(request, job_id, "requeue",
                      lambda: f"requeued, due {local(requeue(app, job_id))}")
        elif action in ACTIONS:
            what, call = job_action(request, action, job_id)
            admin.act(request, job_id, what, call)
        else:
            return HttpResponseBadRequest(f"unknown action {action!r}")
        return HttpResponseRedirect(request.path)
    try:
        rec = store.lookup.get(job_id)
    except JobNotFound:
        messages.warning(request, f"There is no job with id {job_id!r}: it never existed, or it ended and its "
                                  "record expired.")
        return HttpResponseRedirect(admin.url("changelist"))
    msg = store.lookup.message(job_id, int(rec["shard"]))
    now = store.redis.now_ms()
    args, kwargs = describe.arguments(rec, msg)
    if not args and not kwargs:
        args = "not kept: a job's message is dropped when it starts, is cancelled or ends"
    due = rec.get(Field.DUE)
    summary = [
        ("job id", rec.get("id", job_id)), ("state", rec.get(Field.STATE, "")), ("task", rec.get(Field.TASK, "")),
        ("arguments", args), ("keyword arguments", kwargs or "-"), ("queue", rec.get(Field.QUEUE, "")),
        ("due", local(int(float(due)), now) if due else "-"), ("attempts", describe.attempts(rec)),
    ]
    for field in (Field.IDEMPOTENCY_KEY, Field.SHARD_KEY):
        if rec.get(field):
            summary.append((describe.label(field), rec[field]))
    if describe.error(rec):
        summary.append(("last error" if rec.get(Field.ERROR_TYPE) else "reason", describe.error(rec)))
    state = rec.get(Field.STATE, "")
    return admin.render(request, "admin/celery_delayed/job.html", f"{kind.capitalize()} {job_id}", {
        "job_id": job_id, "summary": summary, "traceback": rec.get(Field.TRACEBACK, ""),
        "details": describe.details(rec), "state": state, "kind": kind,
        "scheduled": state == JobState.SCHEDULED, "dead": state == JobState.DEAD,
        "original": admin.model(id=job_id),
    })
