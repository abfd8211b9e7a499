"""The dashboard's pages, rendered on the server as HTML (no JavaScript, no CDN).

Each function takes what it shows and returns the page's body; the layout is
``templates/base.html``. Every value is escaped (:func:`e`). Forms post to
the actions of :mod:`.server`, each with the CSRF token.
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Sequence
from typing import Any
from urllib.parse import quote, urlencode

from .. import describe
from ..describe import ago, when
from ..store.dead_letters import DeadLetter
from ..store.stats import LATENESS_BOUNDS_MS, Histogram, Snapshot
from ..vocab import Field, JobState


def e(value: Any) -> str:
    """HTML-escaped text of any value."""
    return html.escape("" if value is None else str(value), quote=True)


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


def overview(snap: Snapshot, due: list[int], due_labels: list[str], span: str, csrf: str, read_only: bool,
             shaping: str = "") -> str:
    """The overview page: counts by state, jobs coming due, lateness, schedulers, pauses, ``shaping`` (the rate
    limits' and tenants' panels, :mod:`.shaping`), pending by task."""
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
    out.append(shaping)
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


def _clip(text: str, n: int = 90) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def call_args(args: str, kwargs: str) -> str:
    """argsrepr and kwargsrepr as one line ("(1, 'x') {'k': 2}"; empty kwargs left out)."""
    return " ".join(x for x in (args, "" if kwargs in ("", "{}") else kwargs) if x)


def pending(rows: list[dict[str, Any]], total: int, now_ms: int, task: str | None, queue: str | None,
            next_link: str | None, first_link: str | None, note: str = "") -> str:
    """One page of pending jobs in due order, with how many match in all."""
    filt = " ".join(x for x in (f"task {e(task)}" if task else "", f"queue {e(queue)}" if queue else "") if x)
    head = (f'<form class="actions" method="get" action="/jobs">'
            f'<input type="text" name="task" placeholder="task name" value="{e(task or "")}">'
            f'<input type="text" name="queue" placeholder="queue" value="{e(queue or "")}">'
            '<button type="submit">Filter</button>'
            + (f'<a href="/jobs">clear ({filt})</a>' if filt else "") + "</form>")
    if note:
        head += f'<p class="flash error">{e(note)}</p>'
    head += (f'<p class="muted" id="pending-total"><b>{total}</b> pending job{"" if total == 1 else "s"}'
             + (f" ({filt})" if filt else "") + ", earliest due first"
             + (f"; {len(rows)} on this page" if total > len(rows) else "") + "</p>")
    trs = []
    for r in rows:
        shown = call_args(r.get("args", ""), r.get("kwargs", ""))
        trs.append(
            f'<tr><td class="mono id"><a href="{e(jpath(r["id"]))}">{e(r["id"])}</a></td>'
            f'<td class="mono nowrap">{e(when(r["due"]))}<div class=muted>{e(ago(r["due"], now_ms))}</div></td>'
            f'<td>{e(r["task"])}</td><td class="mono args" title="{e(shown)}">{e(_clip(shown)) or "-"}</td>'
            f'<td>{e(r["queue"])}</td><td>{state(r[Field.STATE])}</td><td class=mono>{e(r["ik"])}</td></tr>')
    pager = '<div class="pager">' + (f'<a href="{e(first_link)}">first page</a>' if first_link else "") \
        + (f'<a id="next-page" href="{e(next_link)}">next page</a>' if next_link else "") + "</div>"
    return (head + '<table id="pending"><tr><th>job id</th><th>due (UTC)</th><th>task</th><th>arguments</th>'
            f'<th>queue</th><th>state</th><th>idempotency key</th></tr>{"".join(trs)}</table>'
            + ("" if rows else '<p class="muted">No pending job.</p>') + pager)


_HISTORY = (
    (Field.CREATED, "scheduled"), (Field.REQUEUED_AT, "requeued from the dead-letter queue"),
    (Field.RELEASED, "released to its queue"), (Field.FIRST_AT, "first failed attempt began"),
    (Field.LAST_AT, "last failed attempt began"), (Field.STARTED, "started (latest execution)"),
    (Field.CANCELLED, "cancelled"), (Field.FINISHED, "finished"), (Field.DIED, "dead-lettered"),
)


def job(rec: dict[str, str], message: str | None, now_ms: int, csrf: str, read_only: bool) -> str:
    """One job: what an operator reads (labels in words), actions, history, error; the raw record folded."""
    jid, st = rec["id"], rec.get(Field.STATE, "")
    due = int(float(rec.get(Field.DUE, 0) or 0))
    out = []
    if not read_only:
        acts = []
        if st in (JobState.SCHEDULED, JobState.CLAIMED, JobState.QUEUED):
            acts.append(form(jpath(jid, "cancel"), csrf, "Cancel", cls="danger", ident="cancel"))
        if st == JobState.SCHEDULED:
            acts.append(form(jpath(jid, "promote"), csrf, "Run now", cls="primary", ident="run-now"))
            acts.append(form(jpath(jid, "reschedule"), csrf, "Reschedule", ident="reschedule",
                             fields='<input type="text" id="reschedule-when" name="when" '
                                    'placeholder="seconds from now, or ISO date" size="26" required>'))
        if st == JobState.DEAD:
            acts.append(form(f"/dlq/{quote(jid, safe='')}/requeue", csrf, "Requeue", cls="primary", ident="requeue"))
        if acts:
            out.append('<div class="actions">' + "".join(acts) + "</div>")
    items = []
    for lab, text in describe.summary(rec, message, now_ms):
        if lab == describe.LABELS[Field.STATE]:
            value = f'<span id="job-state" class="state {e(st)}">{e(st)}</span>'
        else:
            value = e(text)
        items.append(f"<dt>{e(lab)}</dt><dd class=mono>{value}</dd>")
    out.append('<dl class="kv panel" id="summary">' + "".join(items) + "</dl>")
    events = sorted((int(float(rec[f])), what) for f, what in _HISTORY if rec.get(f))
    if st == JobState.SCHEDULED and due:
        events.append((due, "due (the scheduler releases it then)"))
    if describe.error(rec):
        events.append((int(float(rec.get(Field.DIED) or rec.get(Field.FINISHED) or now_ms)),
                       f"error: {describe.error(rec)}"))
    out.append('<h2>History</h2><table id="history"><tr><th>when (UTC)</th><th>what</th></tr>'
               + "".join(f"<tr><td class=\"mono nowrap\">{e(when(t))}</td><td>{e(what)}</td></tr>"
                         for t, what in events)
               + "</table>")
    if rec.get(Field.TRACEBACK):
        out.append(f"<h2>Traceback</h2><pre id=\"traceback\">{e(rec[Field.TRACEBACK])}</pre>")
    rows = "".join(f"<tr><td class=mono>{e(field)}</td><td>{e(lab)}</td><td class=mono>{e(value)}</td></tr>"
                   for field, lab, value in describe.raw(rec) if field != Field.TRACEBACK)
    out.append(f'<details id="raw-record"><summary>Raw record ({len(rec)} fields, as kept in Redis)</summary>'
               f'<table><tr><th>field</th><th>meaning</th><th>value</th></tr>{rows}</table></details>')
    return "".join(out)


def dead_letters(letters: Iterable[DeadLetter], total: int, offset: int, limit: int, csrf: str,
                 read_only: bool) -> str:
    """The dead-letter queue, most recent first, with requeue and purge."""
    letters = list(letters)
    trs = "".join(
        f'<tr><td class="mono id"><a href="{e(jpath(d.id))}">{e(d.id)}</a></td>'
        f'<td class="mono nowrap">{e(when(d.died_ms))}</td>'
        f'<td>{e(d.task)}</td><td class=num>{d.attempts}</td><td>{e(d.error[:200])}</td><td>'
        + ("" if read_only else form(f"/dlq/{quote(d.id, safe='')}/requeue", csrf, "Requeue", ident=f"requeue-{d.id}"))
        + "</td></tr>" for d in letters)
    purge = "" if read_only or not total else ('<div class="actions">' + form(
        "/dlq/purge", csrf, "Purge", cls="danger", ident="purge",
        fields='<label for="older-than">Purge dead letters older than</label> <input type="number" '
               'id="older-than" name="older_than" min="0" step="any" placeholder="all ages" class="seconds"> '
               '<label for="older-than">seconds</label> ')
        + '<span class="muted">(left empty: every dead letter, after you confirm)</span></div>')
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


def purge_confirm(total: int, csrf: str) -> str:
    """Asks before purging every dead letter (``delayed dlq purge`` asks too, without ``--yes``)."""
    return (f'<div class="panel" id="purge-confirm"><p>Purge <b>every</b> dead letter ({total} now)? Their '
            "arguments, errors and tracebacks are deleted for good; a dead letter cannot be requeued after.</p>"
            '<div class="actions">'
            + form("/dlq/purge", csrf, f"Purge all {total} dead letter(s)", cls="danger", ident="purge-all",
                   fields=hidden("confirm", "all"))
            + '<a href="/dlq" id="keep">No, keep them</a></div></div>')


def message(text: str) -> str:
    """A page body that only says something (a 4xx page)."""
    return f'<p class="flash error" id="problem">{e(text)}</p><p><a href="/">Back to the overview</a></p>'
