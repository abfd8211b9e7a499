"""The overview's release-shaping panels: the rate limits (changed at run time from a small form) and tenants.

The form posts to ``/limits`` (:mod:`.server`) with the CSRF token, as every
action does: ``op`` is ``set`` (``key`` and ``rate``), ``lift`` or ``reset``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .. import describe
from ..store.shaping import Limit, busiest
from .pages import e, form, hidden

#: How many tenants the overview lists (the rest are summed on one line).
TOP_TENANTS = 20


def limits_panel(rows: Sequence[Limit], csrf: str, read_only: bool) -> str:
    """Every rate limit with its rate, source and the due jobs it holds back; lift / reset per row, and a
    form that sets, lifts or resets any key."""
    trs = []
    for row in rows:
        rate, source = describe.limit(row)
        acts = ""
        if not read_only:
            key = hidden("key", row.key)
            if row.per_second is not None:
                acts += form("/limits", csrf, "Lift", fields=key + hidden("op", "lift"))
            if source != "app":
                acts += " " + form("/limits", csrf, "Reset", fields=key + hidden("op", "reset"))
        warn = ' class="num warnline"' if row.waiting else " class=num"
        trs.append(f"<tr><td class=mono>{e(row.key)}</td><td class=mono>{e(rate)}</td><td>{e(source)}</td>"
                   f"<td{warn}>{row.waiting}</td><td class=nowrap>{acts}</td></tr>")
    held = sum(r.waiting for r in rows)
    body = (f'<p class="muted">{held} due job(s) held back, waiting for a token.</p>'
            "<table><tr><th>limit</th><th>rate</th><th>source</th><th class=num>waiting</th><th></th></tr>"
            + "".join(trs) + "</table>") if rows else \
        '<p class="muted">No rate limit (<code>delayed_rate_limits</code>, or set one here).</p>'
    change = "" if read_only else (
        '<form class="actions" method="post" action="/limits" id="limit-form">'
        f'{hidden("csrf", csrf)}'
        '<input type="text" id="limit-key" name="key" placeholder="task, queue:q or tenant:t" '
        'size="28" required aria-label="limit key">'
        '<input type="text" id="limit-rate" name="rate" placeholder="100/s, 10/m" size="9" '
        'aria-label="rate">'
        '<button type="submit" name="op" value="set" class="primary" id="limit-set">Set</button>'
        '<button type="submit" name="op" value="lift" id="limit-lift">Lift</button>'
        '<button type="submit" name="op" value="reset" id="limit-reset">Reset</button></form>'
        '<p class="muted">A limit set here applies to every scheduler from its next release and wins over '
        "the app's setting; Lift removes it (the app's too) and Reset returns to the app's setting.</p>")
    return f'<div class="panel" id="limits"><h2>Rate limits</h2>{body}{change}</div>'


def tenants_panel(counts: Mapping[str, int], top: int = TOP_TENANTS) -> str:
    """The tenants with the most scheduled jobs, and how many more there are."""
    rows, others, other_jobs = busiest(counts, top)
    if not rows:
        return ('<div class="panel" id="tenants"><h2>Tenants</h2><p class="muted">No scheduled job has a tenant '
                "(<code>apply_later(..., tenant=...)</code>).</p></div>")
    trs = "".join(f"<tr><td>{e(name)}</td><td class=num>{n}</td></tr>" for name, n in rows)
    more = f'<p class="muted">and {others} more tenant(s) with {other_jobs} job(s)</p>' if others else ""
    return (f'<div class="panel" id="tenants"><h2>Tenants ({len(counts)}, {sum(counts.values())} scheduled '
            f'job(s))</h2><table><tr><th>tenant</th><th class=num>scheduled</th></tr>{trs}</table>{more}</div>')


def panels(rows: Sequence[Limit], counts: Mapping[str, int], csrf: str, read_only: bool) -> str:
    """Both panels side by side."""
    return f'<div class="grid2">{limits_panel(rows, csrf, read_only)}{tenants_panel(counts)}</div>'
