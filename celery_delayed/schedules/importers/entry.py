"""What an importer reads from the old scheduler, and where the imported schedule resumes: no Redis, no clock."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import tzinfo
from typing import Any

from ..rules import Every, Spec, fires_between, latest_at_or_before, next_after


@dataclass(frozen=True)
class OldEntry:
    """One entry of the old scheduler, as its own package reads it.

    Times are epoch milliseconds. ``problem`` says why it cannot be imported
    ('' when it can); ``dropped`` lists what of it has no equivalent and is
    left out of an import.
    """

    name: str
    task: str
    #: a Celery schedule (``crontab``, ``schedule``), or None for a one-off at ``at_ms``
    schedule: Any
    args: list[Any]
    kwargs: dict[str, Any]
    options: dict[str, Any]
    #: a crontab's zone (None: the app's ``timezone``)
    timezone: str | None
    enabled: bool
    #: the old scheduler's last run of it (None: never ran)
    last_run_ms: int | None
    #: how many times the old scheduler ran it (what it recorded)
    runs: int = 0
    #: it runs once: at ``at_ms`` (a clocked entry), or at its next fire time (a one-off entry)
    one_off: bool = False
    at_ms: int | None = None
    #: it runs only from then on
    start_ms: int | None = None
    #: it runs no more from then on
    expires_ms: int | None = None
    #: runs the old scheduler made since it was first read whose time it does not tell (counted only)
    unseen_runs: int = 0
    problem: str = ""
    dropped: tuple[str, ...] = ()
    #: the old package's own object (its model row, its entry)
    ref: Any = field(default=None, compare=False, repr=False)


def resume_point(spec: Spec, tz: tzinfo, last_run_ms: int | None, now_ms: int, start_ms: int | None = None) -> int:
    """The cursor (and an interval's origin) of a schedule taken over from an old scheduler.

    The imported schedule fires at its first fire time after the returned
    instant; one that fell due between it and now runs once, now (misfire
    ``latest``), as the old scheduler would have run it.

    - the old scheduler ran it at ``last_run_ms``: from there (an interval
      counts its periods from that run, as beat does);
    - it never ran: the old scheduler would run it at its next tick, so one
      occurrence runs now;
    - its start time is still ahead: from the start (an interval fires at the
      start, a cron at its first fire time at or after it).
    """
    if start_ms is not None and start_ms > now_ms:
        return start_ms - (spec.period_ms if isinstance(spec, Every) else 1)
    if last_run_ms is None:
        if isinstance(spec, Every):
            return now_ms - spec.period_ms
        prev = latest_at_or_before(spec, now_ms, now_ms, tz)
        return prev - 1 if prev is not None else now_ms
    return last_run_ms


def late_start(spec: Spec, cursor_ms: int, now_ms: int) -> int:
    """The cursor of an interval whose next fire time passed during the hand-over: one period before now.

    Beat counts an interval from each actual run, so it would run such an
    occurrence now and the next one a period later: so does the import
    (rather than run it now and the next one on the old grid, moments
    later). A cron keeps its fire times: the missed one runs once, now.
    """
    if isinstance(spec, Every):
        return max(cursor_ms, now_ms - spec.period_ms)
    return cursor_ms


def first_run(spec: Spec, tz: tzinfo, cursor_ms: int, now_ms: int) -> int:
    """When the schedule resumed at ``cursor_ms`` first runs: the missed fire time runs now, else the next one."""
    missed = latest_at_or_before(spec, now_ms, cursor_ms, tz) if cursor_ms < now_ms else None
    if missed is not None and missed > cursor_ms:
        return now_ms
    return next_after(spec, cursor_ms, cursor_ms, tz)


def after_runs(spec: Spec, tz: tzinfo, cursor_ms: int, runs: int, now_ms: int) -> int:
    """The cursor once the old scheduler ran ``runs`` more occurrences after ``cursor_ms`` (a hand-over's
    last moments, counted but not timed): its ``runs``-th fire time after it, at most now."""
    if runs <= 0:
        return cursor_ms
    fires = fires_between(spec, cursor_ms, now_ms, cursor_ms, tz, limit=runs)
    return fires[-1] if len(fires) == runs else now_ms
