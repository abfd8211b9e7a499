"""The dashboard's pages, rendered on the server as HTML (no JavaScript, no CDN).

Each function takes what it shows and returns the page's body; the layout is
``templates/base.html``. Every value is escaped (:func:`e`). Forms post to
the actions of :mod:`.server`, each with the CSRF token.
"""

from __future__ import annotations

import html
import json
from collections.abc import Iterable, Sequence
from typing import Any
from urllib.parse import quote, urlencode

from ..store.dead_letters import DeadLetter
from ..store.stats import LATENESS_BOUNDS_MS, Histogram, Snapshot
from ..timeutil import from_ms
from ..vocab import TIME_FIELDS, Field, JobState


def e(value: Any) -> str:
    """HTML-escaped text of any value."""
    return html.escape("" if value is None else str(value), quote=True)


def when(ms: Any) -> str:
    """An epoch-ms time as a short UTC date, or '-'."""
    if ms in (None, "", -1):
        return "-"
    return from_ms(int(float(ms))).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + "Z"


def ago(ms: int, now_ms: int) -> str:
    """How far ``ms`` is from now, in words ("in 5m 3s", "12s ago")."""
    d = (ms - now_ms) / 1000.0
    a = abs(d)
    if a < 1:
        text = f"{a * 1000:.0f}ms"
    elif a < 120:
        text = f"{a:.0f}s"
    elif a < 7200:
        text = f"{a // 60:.0f}m {a % 60:.0f}s"
    elif a < 172_800:
        text = f"{a // 3600:.0f}h {a % 3600 // 60:.0f}m"
    else:
        text = f"{a // 86400:.0f}d {a % 86400 // 3600:.0f}h"
    return f"in {text}" if d >= 0 else f"{text} ago"


def secs(x: float | None) -> str:
    """Seconds as a short duration."""
    if x is None:
        return "-"
    if x == float("inf"):
        return f"> {LATENESS_BOUNDS_MS[-1] / 1000:g}s"
    return f"{x * 1000:.0f} ms" if x < 1 else f"{x:.2f} s"


def jpath(job_id: str, action: str = "") -> str:
    """The dashboard path of a job (its id quoted: ids may hold any printable character)."""
    return f"/jobs/{quote(job_id, safe='')}" + (f"/{action}" if action else "")


def state(st: str) -> str:
    return f'<span class="state {e(st)}">{e(st)}</span>'


def form(action: str, csrf: str, label: str, *, cls: str = "", fields: str = "", ident: str = "",
         confirm: bool = False) -> str:
    """A POST button (with the CSRF token and optional extra fields)."""
    bid = f' id="{e(ident)}"' if ident else ""
    klass = f' class="{e(cls)}"' if cls else ""
    return (f'<form class="inline" method="post" action="{e(action)}">'
            f'<input type="hidden" name="csrf" value="{e(csrf)}">{fields}'
            f'<button type="submit"{bid}{klass}>{e(label)}</button></form>')


def hidden(name: str, value: Any) -> str:
    return f'<input type="hidden" name="{e(name)}" value="{e(value)}">'


def _card(n: Any, label: str, level: str = "") -> str:
    cls = f"card {level}" if level else "card"
    return f'<div class="{cls}"><div class="n">{e(n)}</div><div class="l">{e(label)}</div></div>'


def bars(values: Sequence[int], labels: Sequence[str], *, width: int = 640, height: int = 140,
         late: Sequence[bool] = ()) -> str:
    """An SVG bar chart (no script): one bar per value, a label under every few bars."""
    n = max(1, len(values))
    top = max(values) if values and max(values) > 0 else 1
    bw = width / n
    parts = [f'<svg class="chart" viewBox="0 0 {width} {height + 30}" width="100%" role="img">',
             f'<line x1="0" y1="{height}" x2="{width}" y2="{height}"/>',
             f'<text x="2" y="10">{e(top)}</text>']
    step = max(1, n // 8)
    for i, v in enumerate(values):
        h = 0 if v <= 0 else max(1.0, v / top * (height - 14))
        cls = "bar late" if i < len(late) and late[i] else "bar"
        parts.append(f'<rect class="{cls}" x="{i * bw + 1:.1f}" y="{height - h:.1f}" width="{max(1.0, bw - 2):.1f}" '
                     f'height="{h:.1f}"><title>{e(labels[i])}: {v}</title></rect>')
        if i % step == 0:
            parts.append(f'<text x="{i * bw + 1:.1f}" y="{height + 14}">{e(labels[i])}</text>')
    parts.append("</svg>")
    return "".join(parts)


def lateness(h: Histogram, title: str) -> str:
    labels = [f"≤{b / 1000:g}s" for b in LATENESS_BOUNDS_MS] + ["more"]
    stats = (f'<p class="muted">{h.count} job(s); p50 {secs(h.quantile(0.5))}, p90 {secs(h.quantile(0.9))}, '
             f'p99 {secs(h.quantile(0.99))} (bucket bounds); mean '
             f'{secs(h.sum_ms / h.count / 1000) if h.count else "-"}</p>')
    return f'<div class="panel"><h2>{e(title)}</h2>{stats}{bars(list(h.counts), labels, height=100)}</div>'


def overview(snap: Snapshot, due: list[int], due_labels: list[str], span: str, csrf: str, read_only: bool) -> str:
    """The overview page: counts by state, jobs coming due, lateness, schedulers, pauses, pending by task."""
    c = snap.counters
    out = ['<div class="cards" id="counts">',
           _card(snap.pending, "pending (scheduled)"),
           _card(snap.overdue, "overdue", "warn" if snap.overdue else ""),
           _card(f"{snap.oldest_overdue_ms / 1000:.1f}s", "oldest overdue", "warn" if snap.oldest_overdue_ms else ""),
           _card(snap.held, "held by a pause", "warn" if snap.held else ""),
           _card(snap.claimed, "claimed (publish path)"),
           _card(snap.queued, "released, not started"),
           _card(snap.running, "running"),
           _card(snap.dead_letters, "dead letters", "bad" if snap.dead_letters else ""),
           "</div>",
           '<h2>Since the store was created</h2><div class="cards" id="totals">']
    for name in ("scheduled", "released", "started", "succeeded", "failed", "retried", "dead", "cancelled",
                 "expired", "skipped", "duplicates", "promoted", "requeued"):
        out.append(_card(c.get(name, 0), name))
    out.append("</div>")
    other = "day" if span == "hour" else "hour"
    out.append(f'<h2>Coming due, next {e(span)} <a class="muted" href="/?span={other}">(next {other})</a></h2>'
               f'<div class="panel" id="coming-due">{bars(due, due_labels)}</div>')
    out.append('<div class="grid2">' + lateness(snap.release_lateness, "Release lateness (release - due)")
               + lateness(snap.start_lateness, "Start lateness (worker start - due)") + "</div>")
    # schedulers and shards
    rows = "".join(f"<tr><td class=mono>{e(m)}</td><td class=num>{len(s)}</td><td class=mono>"
                   f"{e(', '.join(map(str, s)))}</td></tr>" for m, s in snap.shards_of().items())
    warn = ""
    if not snap.schedulers:
        warn = '<p class="badline">No scheduler is running: nothing is released.</p>'
    elif snap.unowned_shards:
        warn = f'<p class="badline">Shards held by no live scheduler: {e(snap.unowned_shards)}</p>'
    out.append(f'<div class="grid2"><div class="panel" id="schedulers"><h2>Schedulers ({len(snap.schedulers)}) '
               f'and their shards (of {snap.shards})</h2>{warn}<table><tr><th>scheduler</th><th class=num>shards'
               f'</th><th>which</th></tr>{rows}</table></div>')
    # pauses
    prow = "".join(
        f"<tr><td>{e(flag)}</td><td>{e(when(since))}</td><td>"
        + ("" if read_only else form("/resume", csrf, "Resume", fields=hidden("flag", flag)))
        + "</td></tr>" for flag, since in sorted(snap.paused.items()))
    pause_all = "" if read_only or "all" in snap.paused else form("/pause", csrf, "Pause all release",
                                                                   cls="danger", ident="pause-all")
    out.append('<div class="panel" id="pauses"><h2>Pauses</h2>'
               + (f"<table><tr><th>paused</th><th>since</th><th></th></tr>{prow}</table>" if prow
                  else '<p class="muted">Nothing is paused.</p>')
               + f'<div class="actions">{pause_all}</div><p class="muted">Dead letters: {snap.dead_letters} '
               '(<a href="/dlq">show</a>)</p></div></div>')
    # pending by task and queue
    trs = []
    for (task, queue), n in sorted(snap.pending_by.items(), key=lambda kv: -kv[1]):
        link = "/jobs?" + urlencode({"task": task, "queue": queue})
        acts = "" if read_only else (
            form("/pause", csrf, "Pause task", fields=hidden("task", task)) + " "
            + form("/pause", csrf, "Pause queue", fields=hidden("queue", queue)))
        trs.append(f'<tr><td><a href="{e(link)}">{e(task)}</a></td><td>{e(queue)}</td>'
                   f"<td class=num>{n}</td><td>{acts}</td></tr>")
    out.append('<h2>Pending by task and queue</h2><table id="by-task"><tr><th>task</th><th>queue</th>'
               '<th class=num>pending</th><th></th></tr>' + "".join(trs) + "</table>")
    return "".join(out)


def pending(rows: list[dict[str, Any]], now_ms: int, task: str | None, queue: str | None, next_link: str | None,
            first_link: str | None, note: str = "") -> str:
    """One page of pending jobs in due order."""
    filt = " ".join(x for x in (f"task {e(task)}" if task else "", f"queue {e(queue)}" if queue else "") if x)
    head = (f'<form class="actions" method="get" action="/jobs">'
            f'<input type="text" name="task" placeholder="task name" value="{e(task or "")}">'
            f'<input type="text" name="queue" placeholder="queue" value="{e(queue or "")}">'
            '<button type="submit">Filter</button>'
            + (f'<a href="/jobs">clear ({filt})</a>' if filt else "") + "</form>")
    if note:
        head += f'<p class="flash error">{e(note)}</p>'
    trs = "".join(
        f'<tr><td class=mono><a href="{e(jpath(r["id"]))}">{e(r["id"])}</a></td><td class=mono>{e(when(r["due"]))}'
        f'</td><td>{e(ago(r["due"], now_ms))}</td><td>{e(r["task"])}</td><td>{e(r["queue"])}</td>'
        f'<td>{state(r[Field.STATE])}</td><td class=mono>{e(r["ik"])}</td><td class=num>{r["shard"]}</td></tr>'
        for r in rows)
    pager = '<div class="pager">' + (f'<a href="{e(first_link)}">first page</a>' if first_link else "") \
        + (f'<a id="next-page" href="{e(next_link)}">next page</a>' if next_link else "") + "</div>"
    return (head + '<table id="pending"><tr><th>job id</th><th>due (UTC)</th><th></th><th>task</th><th>queue</th>'
            f'<th>state</th><th>idempotency key</th><th class=num>shard</th></tr>{trs}</table>'
            + ("" if rows else '<p class="muted">No pending job.</p>') + pager)


def _args(rec: dict[str, str], message: str | None) -> tuple[str, str]:
    """The job's arguments as Celery's argsrepr / kwargsrepr (what the app chose to show: apply_later's
    ``argsrepr=`` / ``kwargsrepr=`` redact them), never the message body itself."""
    if message:
        try:
            headers = json.loads(message).get("headers") or {}
            return str(headers.get("argsrepr", "")), str(headers.get("kwargsrepr", ""))
        except (ValueError, AttributeError):
            return "", ""
    return rec.get(Field.ARGS, ""), rec.get(Field.KWARGS, "")


_HISTORY = (
    (Field.CREATED, "scheduled"), (Field.REQUEUED_AT, "requeued from the dead-letter queue"),
    (Field.RELEASED, "released to its queue"), (Field.FIRST_AT, "first failed attempt began"),
    (Field.LAST_AT, "last failed attempt began"), (Field.STARTED, "started (latest execution)"),
    (Field.CANCELLED, "cancelled"), (Field.FINISHED, "finished"), (Field.DIED, "dead-lettered"),
)


def job(rec: dict[str, str], message: str | None, now_ms: int, csrf: str, read_only: bool) -> str:
    """One job: actions, arguments, history, the record."""
    jid, st = rec["id"], rec.get(Field.STATE, "")
    due = int(float(rec.get(Field.DUE, 0) or 0))
    out = [f'<p><span id="job-state" class="state {e(st)}">{e(st)}</span> · task <b>{e(rec.get(Field.TASK))}'
           f'</b> · queue {e(rec.get(Field.QUEUE))} · due {e(when(due))} ({e(ago(due, now_ms))}) · shard '
           f'{e(rec.get("shard"))}</p>']
    if not read_only:
        acts = []
        if st in (JobState.SCHEDULED, JobState.CLAIMED, JobState.QUEUED):
            acts.append(form(jpath(jid, "cancel"), csrf, "Cancel", cls="danger", ident="cancel"))
        if st == JobState.SCHEDULED:
            acts.append(form(jpath(jid, "promote"), csrf, "Run now", cls="primary", ident="run-now"))
            acts.append(form(jpath(jid, "reschedule"), csrf, "Reschedule", ident="reschedule",
                             fields='<input type="text" id="reschedule-when" name="when" '
                                    'placeholder="seconds from now, or ISO date" size="24">'))
        if st == JobState.DEAD:
            acts.append(form(f"/dlq/{quote(jid, safe='')}/requeue", csrf, "Requeue", cls="primary", ident="requeue"))
        out.append('<div class="actions">' + "".join(acts) + "</div>")
    args, kwargs = _args(rec, message)
    out.append(f'<h2>Arguments</h2><dl class="kv" id="arguments"><dt>args</dt><dd class=mono>{e(args) or "-"}</dd>'
               f'<dt>kwargs</dt><dd class=mono>{e(kwargs) or "-"}</dd></dl>')
    events = sorted((int(float(rec[f])), label) for f, label in _HISTORY if rec.get(f))
    if st == JobState.SCHEDULED and due:
        events.append((due, "due (the scheduler releases it then)"))
    if rec.get(Field.ERROR_TYPE) or rec.get(Field.REASON):
        err = f"{rec.get(Field.ERROR_TYPE, '')}: {rec.get(Field.ERROR_MESSAGE, '')}" if rec.get(Field.ERROR_TYPE) \
            else rec.get(Field.REASON, "")
        events.append((int(float(rec.get(Field.DIED) or rec.get(Field.FINISHED) or now_ms)), f"error: {err}"))
    out.append('<h2>History</h2><table id="history"><tr><th>when (UTC)</th><th>what</th></tr>'
               + "".join(f"<tr><td class=mono>{e(when(t))}</td><td>{e(what)}</td></tr>" for t, what in events)
               + "</table>")
    if rec.get(Field.TRACEBACK):
        out.append(f"<h2>Traceback</h2><pre>{e(rec[Field.TRACEBACK])}</pre>")
    hidden_fields = {Field.TRACEBACK, Field.ARGS, Field.KWARGS}
    items = []
    for k in sorted(rec):
        if k in hidden_fields:
            continue
        v = rec[k]
        shown = f"{v} ({when(v)})" if k in TIME_FIELDS and v else v
        items.append(f"<dt>{e(k)}</dt><dd class=mono>{e(shown)}</dd>")
    out.append('<h2>Record</h2><dl class="kv" id="record">' + "".join(items) + "</dl>")
    return "".join(out)


def dead_letters(letters: Iterable[DeadLetter], total: int, offset: int, limit: int, csrf: str,
                 read_only: bool) -> str:
    """The dead-letter queue, most recent first, with requeue and purge."""
    letters = list(letters)
    trs = "".join(
        f'<tr><td class=mono><a href="{e(jpath(d.id))}">{e(d.id)}</a></td><td class=mono>{e(when(d.died_ms))}</td>'
        f'<td>{e(d.task)}</td><td class=num>{d.attempts}</td><td>{e(d.error[:200])}</td><td>'
        + ("" if read_only else form(f"/dlq/{quote(d.id, safe='')}/requeue", csrf, "Requeue", ident=f"requeue-{d.id}"))
        + "</td></tr>" for d in letters)
    purge = "" if read_only else ('<div class="actions">' + form(
        "/dlq/purge", csrf, "Purge", cls="danger", ident="purge",
        fields='<input type="number" name="older_than" min="0" placeholder="older than (s); empty: all">')
        + "</div>")
    pager = '<div class="pager">' + (f'<a href="/dlq?offset={max(0, offset - limit)}">previous</a>' if offset else "") \
        + (f'<a href="/dlq?offset={offset + limit}">next</a>' if offset + len(letters) < total else "") + "</div>"
    return (f'<p class="muted">{total} dead letter(s); showing {offset + 1 if letters else 0}-'
            f'{offset + len(letters)}</p>{purge}<table id="dead-letters"><tr><th>job id</th><th>died (UTC)</th>'
            f'<th>task</th><th class=num>attempts</th><th>error</th><th></th></tr>{trs}</table>{pager}')


def recurring(rows: Sequence[Any]) -> str:
    """The recurring schedules (``celery_delayed.schedules.list``): definition, next fire, last occurrences."""
    trs = "".join(
        f"<tr><td>{e(r.name)}</td><td>{e(r.task)}</td><td class=mono>{e(r.schedule)}</td><td>{e(r.timezone)}</td>"
        f"<td class=mono>{e(r.error) if r.error else 'paused' if r.paused else e(when(r.next_fire_ms))}</td>"
        f"<td>{e(r.misfire)}</td>"
        f"<td>{e(r.source)}</td><td class=mono>"
        + " ".join(f'<a href="{e(jpath(i))}">{e(when(f))}</a>' for i, f in r.occurrences[-3:])
        + "</td></tr>" for r in rows)
    if not rows:
        return '<p class="muted">No recurring schedule (<code>delayed_schedule</code>, ' \
               '<code>delayed schedules add</code>).</p>'
    return ('<table id="schedules"><tr><th>name</th><th>task</th><th>schedule</th><th>zone</th>'
            f'<th>next fire (UTC)</th><th>misfire</th><th>from</th><th>last occurrences</th></tr>{trs}</table>')
