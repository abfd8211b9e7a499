"""The import itself: plan every old entry, hand the planned ones over, report what was and was not imported.

The hand-over keeps each occurrence to one run, with the old scheduler still
running while the import runs and stopped after it:

0. the old scheduler is asked to record the last runs it keeps in memory
   (django-celery-beat writes them to its rows when it syncs), and the
   import waits for that (``settle_s``);
1. every entry to import is disabled through the old package's own API, so
   its scheduler sends it no more once a tick in progress has ended;
2. the import waits for that (``settle_s``) and reads the entries again:
   their last run as the old scheduler recorded it, or how many runs it
   made meanwhile;
3. each schedule is stored to resume after that last run: its first
   occurrence is the first fire time after it, and one that fell due during
   the hand-over runs once, late (misfire ``latest``; an interval then
   counts its periods from that run, as beat does).

An entry that cannot be imported is listed with the reason and left as it
is in the old scheduler.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import Any, Protocol

from celery import Celery

from ...api import apply_later
from ...errors import DelayedError, InvalidOption
from ...producer.message import task_defaults
from ...producer.prepare import prepare
from ...store import get_store
from .. import api
from ..definition import definition, spec_of
from ..rules import Every, zone
from .entry import OldEntry, after_runs, first_run, late_start, resume_point


class Source(Protocol):
    """An old scheduler's entries, read and disabled with its own package."""

    label: str
    settle_s: float

    def describe_disable(self) -> str:
        """What the import does to an enabled old entry."""

    def sync(self) -> bool:
        """Ask the old scheduler to record what it ran; True: it does so within ``settle_s``."""

    def read(self) -> list[OldEntry]:
        """Every entry, sorted by name."""

    def disable(self, entry: OldEntry) -> None:
        """Stop the old scheduler from running it (kept, disabled: it can be enabled again)."""

    def reread(self, entry: OldEntry, now_ms: int) -> OldEntry:
        """The entry again, after the settle: what the old scheduler ran meanwhile."""


def sources() -> dict[str, Callable[[Celery], Source]]:
    """The sources by their ``--from`` name (each imports its package only when used)."""
    from .django_celery_beat import DjangoBeatSource
    from .redbeat import RedbeatSource

    return {"redbeat": RedbeatSource, "django-celery-beat": DjangoBeatSource}


@dataclass(frozen=True)
class Imported:
    """An entry imported (or, in a dry run, to be imported)."""

    name: str
    task: str
    #: ``every 30s``, ``cron 30 2 * * * (Europe/Berlin)`` or ``once``
    what: str
    #: its first run, epoch ms (None: imported paused)
    next_ms: int | None
    #: what happens to the old entry
    old: str
    #: what of it is left out (an option with no equivalent)
    dropped: tuple[str, ...] = ()
    #: a one-off's job id (after the import)
    job_id: str = ""

    @property
    def paused(self) -> bool:
        """Imported paused (it was disabled in the old scheduler)."""
        return self.next_ms is None


@dataclass(frozen=True)
class NotImported:
    """An entry left out, and why; ``failed``: it was disabled in the old scheduler and then not imported."""

    name: str
    reason: str
    failed: bool = False


@dataclass
class Report:
    """What an import did (or, with ``dry_run``, would do)."""

    source: str
    dry_run: bool
    imported: list[Imported] = field(default_factory=list)
    not_imported: list[NotImported] = field(default_factory=list)

    @property
    def failed(self) -> list[NotImported]:
        """Entries disabled in the old scheduler and not imported: enable them there again."""
        return [n for n in self.not_imported if n.failed]


def _dt(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, timezone.utc)


def _iso(ms: int) -> str:
    return _dt(ms).isoformat(timespec="seconds")


@dataclass(frozen=True)
class _Plan:
    entry: OldEntry
    item: Imported
    defn: dict[str, Any] | None  # a recurring schedule's stored form; None for a one-off


def import_schedules(app: Celery, source: str, *, dry_run: bool = False, settle_s: float | None = None,
                     sleep: Callable[[float], None] = time.sleep) -> Report:
    """Import the old scheduler's entries as recurring schedules (a one-off as one delayed job).

    Args:
        source: ``"redbeat"`` or ``"django-celery-beat"``.
        dry_run: plan only; nothing changes anywhere.
        settle_s: how long the old scheduler may still send an entry once it is
            disabled (default: the source's; django-celery-beat's is
            ``beat_max_loop_interval`` + 2 s).

    Raises:
        ConfigurationError: the source's package is missing or not configured.
        InvalidOption: an unknown source.
        StoreUnavailable: the store cannot be reached.
    """
    makers = sources()
    if source not in makers:
        raise InvalidOption(f"unknown source {source!r}: one of {sorted(makers)}")
    src = makers[source](app)
    store = get_store(app)
    wait = src.settle_s if settle_s is None else settle_s
    entries = src.read()
    if not dry_run and any(e.enabled and not e.problem for e in entries) and src.sync():
        sleep(wait)  # the old scheduler writes the last runs it keeps in memory
        entries = src.read()
    now = store.redis.now_ms()
    report = Report(source=src.label, dry_run=dry_run)
    plans: list[_Plan] = []
    for entry in entries:
        planned = _plan(app, src, entry, now)
        if isinstance(planned, NotImported):
            report.not_imported.append(planned)
        else:
            plans.append(planned)
    if dry_run:
        report.imported = [p.item for p in plans]
        return report
    handed: list[_Plan] = []
    for p in plans:
        if not p.entry.enabled:
            handed.append(p)
            continue
        try:
            src.disable(p.entry)
        except Exception as exc:  # the old package's own error: this entry stays as it was
            report.not_imported.append(NotImported(p.entry.name, f"could not disable it in {src.label}: {exc}"))
            continue
        handed.append(p)
    if any(p.entry.enabled for p in handed):
        sleep(wait)
    for p in handed:
        done = _hand_over(app, src, p, now)
        if isinstance(done, NotImported):
            report.not_imported.append(done)
        else:
            report.imported.append(done)
    report.not_imported.sort(key=lambda n: n.name)
    return report


def _plan(app: Celery, src: Source, e: OldEntry, now: int) -> _Plan | NotImported:
    """The plan of one entry at ``now``, checked as ``schedules.add`` and ``apply_later`` check theirs."""
    if e.problem:
        return NotImported(e.name, e.problem)
    if e.expires_ms is not None and e.expires_ms <= now:
        return NotImported(e.name, f"it expired at {_iso(e.expires_ms)}")
    old = src.describe_disable() if e.enabled else f"left as it is (disabled in {src.label})"
    if e.one_off:
        if not e.enabled or e.runs > 0:
            return NotImported(e.name, "a one-off entry that ran already (or was disabled)")
        try:
            at = _one_off_at(app, e, now)
            opts = _one_off_options(e, at)
            task = app.tasks.get(e.task)
            prepare(app, get_store(app), e.task, e.args, e.kwargs, _dt(at), shard_key=e.name, task_type=task,
                    options=(task_defaults(task) if task is not None else {}) | opts)
        except DelayedError as exc:
            return NotImported(e.name, str(exc))
        if e.expires_ms is not None and at >= e.expires_ms:
            return NotImported(e.name, f"it expires ({_iso(e.expires_ms)}) before it would run ({_iso(at)})")
        return _Plan(e, Imported(e.name, e.task, "once", at, old, e.dropped), None)
    if e.expires_ms is not None:
        return NotImported(e.name, f"it ends at {_iso(e.expires_ms)}: a celery-delayed schedule has no end "
                                   "(add it with delayed schedules add, and remove it then)")
    if get_store(app).schedules.get(e.name) is not None:
        return NotImported(e.name, "a celery-delayed schedule of that name exists (imported before?); "
                                   "remove it first to import this entry again")
    try:
        defn = definition(app, e.name, {"task": e.task, "schedule": e.schedule, "args": e.args, "kwargs": e.kwargs,
                                        "options": e.options, "timezone": e.timezone})
    except DelayedError as exc:
        return NotImported(e.name, str(exc))
    spec, tz = spec_of(defn), zone(defn["timezone"])
    cursor = late_start(spec, resume_point(spec, tz, e.last_run_ms, now, e.start_ms), now)
    nxt = first_run(spec, tz, cursor, now) if e.enabled else None
    what = spec.describe() + ("" if isinstance(spec, Every) else f" ({defn['timezone']})")
    return _Plan(e, Imported(e.name, e.task, what, nxt, old, e.dropped), defn)


def _one_off_at(app: Celery, e: OldEntry, now: int) -> int:
    """When a one-off entry runs: its clocked time, or its schedule's first run after its last."""
    if e.at_ms is not None:
        return e.at_ms
    defn = definition(app, e.name, {"task": e.task, "schedule": e.schedule, "timezone": e.timezone})
    spec, tz = spec_of(defn), zone(defn["timezone"])
    cursor = after_runs(spec, tz, resume_point(spec, tz, e.last_run_ms, now, e.start_ms), e.unseen_runs, now)
    return first_run(spec, tz, cursor, now)


def _one_off_options(e: OldEntry, at: int) -> dict[str, Any]:
    """A one-off's message options: its expiry made absolute (from its run time, or its end)."""
    opts = {k: v for k, v in e.options.items() if k != "expire_seconds"}
    ends = [x for x in (e.expires_ms, at + round(float(e.options["expire_seconds"]) * 1000)
                        if "expire_seconds" in e.options else None) if x is not None]
    if ends:
        opts["expires"] = _dt(min(ends))
    return opts


def _hand_over(app: Celery, src: Source, p: _Plan, planned_at: int) -> Imported | NotImported:
    """Store one planned entry, from what the old scheduler ran until it was disabled."""
    failed = p.entry.enabled  # disabled by this import: a failure now leaves it to no scheduler
    hint = f"; it is disabled in {src.label}: enable it there again" if failed else ""
    try:
        e = src.reread(p.entry, planned_at) if p.entry.enabled else p.entry
    except Exception as exc:  # the old package's own error (the entry removed meanwhile, say)
        return NotImported(p.entry.name, f"could not read it again from {src.label}: {exc!r}{hint}", failed)
    now = get_store(app).redis.now_ms()
    try:
        if p.defn is None:
            if e.unseen_runs > 0:
                return NotImported(e.name, f"a one-off entry that {src.label} ran during the hand-over")
            at = _one_off_at(app, e, planned_at)
            key = f"schedules-import:{src.label}:{e.name}:{at}"
            h = apply_later(app, e.task, e.args, e.kwargs, _dt(at), idempotency_key=key, strict=False,
                            shard_key=e.name, **_one_off_options(e, at))
            return replace(p.item, next_ms=at, job_id=h.id)
        if get_store(app).schedules.get(e.name) is not None:
            return NotImported(e.name, "a celery-delayed schedule of that name was added meanwhile" + hint, failed)
        spec, tz = spec_of(p.defn), zone(p.defn["timezone"])
        cursor = after_runs(spec, tz, resume_point(spec, tz, e.last_run_ms, planned_at, e.start_ms),
                            e.unseen_runs, now)
        cursor = late_start(spec, cursor, now)
        api.add(app, e.name, e.task, e.schedule, e.args, e.kwargs, e.options, timezone=e.timezone,
                misfire="latest", strict=False, after=_dt(cursor), paused=not p.entry.enabled)
    except DelayedError as exc:
        if isinstance(exc, ConnectionError):
            raise
        return NotImported(e.name, f"{exc}{hint}", failed)
    return replace(p.item, next_ms=first_run(spec, tz, cursor, now) if p.entry.enabled else None)
