"""Recurring schedules: ``delayed_schedule`` and the run-time API (list, get, add, remove, pause, resume, run_now).

A recurring schedule is a chain of ordinary delayed jobs. Each occurrence's
id derives from the schedule's name, its version (bumped by every change)
and its fire time (uuid5), and lives in the shard of the schedule's name, so
two schedulers can never create one occurrence twice. The scheduler holding
that shard keeps the next occurrences stored ahead of time
(:mod:`celery_delayed.scheduler.recurring`), so the next one exists before
the current one is released.

Entries are declared like Celery's ``beat_schedule``::

    app.conf.delayed_schedule = {
        "nightly-report": {"task": "reports.nightly", "schedule": crontab(hour=2, minute=30),
                           "timezone": "Europe/Berlin"},
        "poll": {"task": "feeds.poll", "schedule": 30.0, "args": ("main",)},
    }

with, beside beat's keys, ``timezone`` (an IANA name; default the app's
``timezone``, else UTC), ``misfire`` (what an outage's missed occurrences
do: ``"latest"`` runs the latest once, the default; ``"skip"`` runs none;
``"each"`` runs each, at most ``delayed_schedule_catch_up_max``).
Fire times follow :mod:`celery_delayed.recurrence` (DST rules).
"""

from __future__ import annotations

import builtins
import dataclasses
import hashlib
import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from celery import Celery

from .errors import DelayedError, InvalidOption, InvalidState, JobNotFound, ScheduleNotFound
from .producer.jobs import Prepared, check_str, lookup_task, prepare
from .producer.message import task_defaults
from .recurrence import (
    Every,
    Spec,
    fires_between,
    latest_at_or_before,
    next_after,
    parse_spec,
    period_ms,
    spec_digest,
    zone,
)
from .result import DelayedResult
from .store import Store, get_store
from .store.schedules import ScheduleRecords, StoredSchedule
from .vocab import JobState

__all__ = [
    "MISFIRE_POLICIES",
    "Schedule",
    "add",
    "cancel_occurrences",
    "config_entries",
    "definition",
    "get",
    "list",
    "occurrence_id",
    "occurrence_jobs",
    "pause",
    "plan",
    "remove",
    "resume",
    "run_now",
    "store_ahead",
]

#: What the occurrences an outage missed do: run the latest once, run none, run each (capped).
MISFIRE_POLICIES = ("latest", "skip", "each")
#: Namespace of occurrence ids (uuid5 of "<name>\\0<epoch>\\0<version>\\0<fire ms>").
OCCURRENCE_NAMESPACE = uuid.UUID("9d5c2a61-0b7e-4c3f-8a51-2f6e4b1d7c90")
#: Keys an entry may have (``relative`` is beat's; it has no meaning here and is ignored).
_ENTRY_KEYS = frozenset({"task", "schedule", "args", "kwargs", "options", "timezone", "misfire",
                         "skip_if_running", "relative"})
_MAX_NAME_BYTES = 200


@dataclass(frozen=True)
class Schedule:
    """A recurring schedule as listed: its definition and where it stands."""

    name: str
    task: str
    schedule: str  # ``every 30s`` or ``cron 30 2 * * *``
    timezone: str
    misfire: str
    skip_if_running: bool
    args: builtins.list[Any]
    kwargs: dict[str, Any]
    options: dict[str, Any]
    source: str  # "config" or "api"
    paused: bool
    version: int
    shard: int
    origin_ms: int
    #: the next fire time an occurrence is stored for, epoch ms (None: paused or none yet)
    next_fire_ms: int | None
    #: recent occurrences: (job id, fire time ms), the earliest first
    occurrences: builtins.list[tuple[str, int]]

    def as_dict(self) -> dict[str, Any]:
        """JSON-safe form (the CLI's ``--json``)."""
        return dataclasses.asdict(self)


# -- definitions ------------------------------------------------------------------------


def definition(app: Celery, name: str, entry: Mapping[str, Any], *, strict: bool = False) -> dict[str, Any]:
    """Validate a schedule entry and return its stored form (JSON-safe).

    Raises:
        InvalidOption: a bad name, key, task, schedule, zone, misfire policy
            or arguments that are not JSON-serializable; nothing is stored.
        UnknownTask: with ``strict``, a task this app does not define.
    """
    check_str("schedule name", name, _MAX_NAME_BYTES)
    if not isinstance(entry, Mapping):
        raise InvalidOption(f"schedule {name!r}: an entry is a dict (task, schedule, ...), got {entry!r}")
    unknown = set(entry) - _ENTRY_KEYS
    if unknown:
        raise InvalidOption(f"schedule {name!r}: unknown key(s) {sorted(unknown)}; "
                            f"an entry has {sorted(_ENTRY_KEYS - {'relative'})}")
    task = entry.get("task")
    if not isinstance(task, str) or not task:
        raise InvalidOption(f"schedule {name!r}: 'task' must be a task name, got {task!r}")
    lookup_task(app, task, strict)
    if "schedule" not in entry:
        raise InvalidOption(f"schedule {name!r}: 'schedule' is missing (a crontab, an interval or seconds)")
    try:
        spec = parse_spec(entry["schedule"])
        tz_name = entry.get("timezone") or _app_zone(app)
        zone(tz_name)
    except InvalidOption as exc:
        raise InvalidOption(f"schedule {name!r}: {exc}") from exc
    misfire = entry.get("misfire", "latest")
    if misfire not in MISFIRE_POLICIES:
        raise InvalidOption(f"schedule {name!r}: misfire must be one of {MISFIRE_POLICIES}, got {misfire!r}")
    args, kwargs, options = entry.get("args") or (), entry.get("kwargs") or {}, entry.get("options") or {}
    if not (isinstance(args, builtins.list | tuple) and isinstance(kwargs, Mapping) and isinstance(options, Mapping)):
        raise InvalidOption(f"schedule {name!r}: args must be a list, kwargs and options dicts")
    out = {"task": task, "spec": spec.to_json(), "args": builtins.list(args), "kwargs": dict(kwargs),
           "options": dict(options), "timezone": tz_name, "misfire": misfire,
           "skip_if_running": bool(entry.get("skip_if_running", False))}
    try:
        json.dumps(out)
    except (TypeError, ValueError) as exc:
        raise InvalidOption(f"schedule {name!r}: args, kwargs and options must be JSON-serializable: {exc}") from exc
    task_type = app.tasks.get(task)
    try:  # the occurrence's call, validated once now rather than at every fire time (writes nothing)
        prepare(app, task, out["args"], out["kwargs"], 0, shard_key=name, task_type=task_type,
                options=(task_defaults(task_type) if task_type is not None else {}) | out["options"])
    except DelayedError as exc:
        raise InvalidOption(f"schedule {name!r}: {exc}") from exc
    return out


def _app_zone(app: Celery) -> str:
    tz = app.conf.timezone
    return str(tz) if tz else "UTC"


def config_hash(defn: Mapping[str, Any]) -> str:
    """The hash of a config entry's stored form: a changed entry has another."""
    return hashlib.sha1(spec_digest(defn).encode("utf-8")).hexdigest()


def config_entries(app: Celery) -> dict[str, dict[str, Any]]:
    """The app's declared schedules, validated: ``delayed_schedule``, and ``beat_schedule``
    when ``delayed_import_beat_schedule`` is set (``delayed_schedule`` wins on a shared name).

    Raises:
        InvalidOption: an entry is wrong (the message names it).
    """
    entries: dict[str, Any] = {}
    if app.conf.get("delayed_import_beat_schedule"):
        entries.update(app.conf.beat_schedule or {})
    declared = app.conf.get("delayed_schedule") or {}
    if not isinstance(declared, Mapping):
        raise InvalidOption(f"delayed_schedule must be a dict of name -> entry, got {declared!r}")
    entries.update(declared)
    return {name: definition(app, name, entry) for name, entry in entries.items()}


# -- occurrences ---------------------------------------------------------------------------


def occurrence_id(sched: StoredSchedule, fire_ms: int) -> str:
    """The job id of a schedule's occurrence at ``fire_ms``: from its name, epoch, version and the fire
    time, so every scheduler derives the same one."""
    return str(uuid.uuid5(OCCURRENCE_NAMESPACE, f"{sched.name}\0{sched.epoch}\0{sched.version}\0{fire_ms}"))


def spec_of(defn: Mapping[str, Any]) -> Spec:
    """The parsed schedule of a stored definition."""
    return parse_spec(defn["spec"])


def occurrence_jobs(app: Celery, sched: StoredSchedule, fires: Sequence[int], grace_ms: int) -> builtins.list[Prepared]:
    """Prepared jobs for a schedule's occurrences at ``fires`` (ids derived; a stored one is kept).

    ``misfire="latest"``: an occurrence released after the next fire time is
    skipped (the next one runs); ``"skip"``: one released later than
    ``grace_ms`` (or the next fire) is skipped; ``"each"``: it runs however late.
    """
    d = sched.definition
    task = app.tasks.get(d["task"])
    spec, tz = spec_of(d), zone(d["timezone"])
    base = (task_defaults(task) if task is not None else {}) | d["options"]
    out = []
    for fire in fires:
        opts = dict(base)
        if d["misfire"] != "each":
            gap = period_ms(spec, fire, sched.origin_ms, tz)
            late = gap if d["misfire"] == "latest" else min(gap, grace_ms)
            opts |= {"max_lateness": max(late - 1, 1) / 1000, "misfire": "skip"}
        when = datetime.fromtimestamp(fire / 1000, timezone.utc)
        p = prepare(app, d["task"], d["args"], d["kwargs"], when,
                    task_id=occurrence_id(sched, fire), shard_key=sched.name,
                    task_type=task, options=opts)
        out.append(dataclasses.replace(p, idempotent=True))
    return out


#: misfire "skip": a fire time at most this late still runs, ms.
GRACE_MS = 1_000
#: Most occurrences stored ahead for one schedule at once.
MAX_AHEAD = 1_000
#: How far ahead a run-time add or resume stores occurrences itself (until a scheduler looks), ms.
PRIME_MS = 12_000


def plan(sched: StoredSchedule, now_ms: int, horizon_ms: int,
         catch_up_max: int) -> tuple[builtins.list[int], int] | None:
    """The fire times to store at ``now_ms`` and the new cursor (None: the cursor is past the horizon).

    The cursor covers every fire time up to it. Behind now (an outage), the
    missed fire times follow the schedule's misfire policy; ahead, every fire
    time up to ``now + horizon_ms`` and the first one after it.
    """
    d = sched.definition
    spec, tz, origin = spec_of(d), zone(d["timezone"]), sched.origin_ms
    last, horizon = sched.last_ms, now_ms + horizon_ms
    if last > horizon:
        return None
    missed: builtins.list[int] = []
    if last < now_ms:
        policy = d["misfire"]
        if policy == "latest":
            p = latest_at_or_before(spec, now_ms, origin, tz)
            missed = [p] if p is not None and p > last else []
        elif policy == "each":
            # bounded: the latest catch_up_max intervals, or a cron's last 31 days
            back = catch_up_max * spec.period_ms if isinstance(spec, Every) else 31 * 86_400_000
            missed = fires_between(spec, max(last, now_ms - back), now_ms, origin, tz, limit=10**6)[-catch_up_max:]
        else:
            missed = fires_between(spec, max(last, now_ms - GRACE_MS), now_ms, origin, tz, limit=MAX_AHEAD)
    start = max(last, now_ms)
    ahead = fires_between(spec, start, horizon, origin, tz, limit=MAX_AHEAD)
    beyond = next_after(spec, max(start, horizon, ahead[-1] if ahead else start), origin, tz)
    return [*missed, *ahead, beyond], beyond


def store_ahead(app: Celery, store: Store, sched: StoredSchedule, owner: str, fence: str, now_ms: int,
                horizon_ms: int, catch_up_max: int) -> int:
    """Store a schedule's occurrences due up to the horizon and move its cursor; return how many were new.

    ``owner``/``fence``: the shard's lease the cursor moves under ('' for a
    run-time add, which moves it from the value it wrote itself).

    Raises:
        LeaseLost: ``owner`` does not hold the shard's lease.
    """
    from .api import store_prepared  # the API module imports the producer; this keeps the import graph flat

    todo = plan(sched, now_ms, horizon_ms, catch_up_max)
    if todo is None:
        return 0
    fires, cursor = todo
    results = store_prepared(app, occurrence_jobs(app, sched, fires, GRACE_MS))
    pairs = [(r.id, f) for r, f in zip(results, fires, strict=True)]
    rec = store.schedules
    if rec.advance_schedule(sched, owner, fence, cursor, pairs):
        return sum(1 for r in results if r.created)
    cur = rec.get(sched.name)
    if cur is None or cur.version != sched.version or cur.paused:
        # changed, paused or removed since read: what was just stored belongs to the old definition
        cancel_occurrences(store, sched.shard, [r.id for r in results if r.created])
    # else another scheduler moved the cursor first: it covers the same ids (derived from the version)
    return 0


def cancel_occurrences(store: Store, shard: int, ids: Sequence[str]) -> int:
    """Cancel the occurrences among ``ids`` not yet released (a change, pause or removal); return how many."""
    if not ids:
        return 0
    states = store.lookup.record_states(shard, ids)
    n = 0
    for job_id in ids:
        if states.get(job_id) == JobState.SCHEDULED:
            try:
                store.jobs.cancel(job_id, shard)
                n += 1
            except (InvalidState, JobNotFound):  # released or gone meanwhile
                pass
    return n


# -- the run-time API -------------------------------------------------------------------------


def _info(rec: ScheduleRecords, s: StoredSchedule, now_ms: int) -> Schedule:
    d = s.definition
    occ = rec.occurrences(s.name)
    upcoming = [f for _, f in occ if f > now_ms]
    nxt = None if s.paused else (min(upcoming) if upcoming else None)
    if nxt is None and not s.paused:  # none stored yet (no scheduler holds its shard): computed
        nxt = next_after(spec_of(d), max(now_ms, s.last_ms), s.origin_ms, zone(d["timezone"]))
    spec = spec_of(d)
    return Schedule(
        name=s.name, task=d["task"], schedule=spec.describe(), timezone=d["timezone"] if not isinstance(
            spec, Every) else "-", misfire=d["misfire"],
        skip_if_running=bool(d.get("skip_if_running")), args=d["args"], kwargs=d["kwargs"], options=d["options"],
        source=s.source, paused=s.paused, version=s.version, shard=s.shard, origin_ms=s.origin_ms,
        next_fire_ms=nxt, occurrences=occ,
    )


def list(app: Celery) -> builtins.list[Schedule]:
    """Every recurring schedule of the store, sorted by name."""
    store = get_store(app)
    rec = store.schedules
    now = store.redis.now_ms()
    return [_info(rec, s, now) for s in rec.all()]


def get(app: Celery, name: str) -> Schedule:
    """One recurring schedule.

    Raises:
        ScheduleNotFound: there is none of that name.
    """
    store = get_store(app)
    rec = store.schedules
    s = rec.get(name)
    if s is None:
        raise ScheduleNotFound(name)
    return _info(rec, s, store.redis.now_ms())


def add(app: Celery, name: str, task: str, schedule: object, args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None, options: Mapping[str, Any] | None = None, *,
        timezone: str | None = None, misfire: str = "latest", skip_if_running: bool = False,
        strict: bool = True) -> Schedule:
    """Add a recurring schedule, or replace the one of that name (a run-time change: it wins over
    ``delayed_schedule`` until that config entry itself changes).

    Its occurrences start with the first fire time after now; those stored
    for an old definition and not yet released are cancelled.

    Raises:
        InvalidOption, UnknownTask: a bad entry; nothing is stored.
    """
    entry = {"task": task, "schedule": schedule, "args": args, "kwargs": kwargs or {}, "options": options or {},
             "timezone": timezone, "misfire": misfire, "skip_if_running": skip_if_running}
    defn = definition(app, name, entry, strict=strict)
    store = get_store(app)
    _, old = store.schedules.put_schedule(name, defn, "api")
    cancel_occurrences(store, store.schedules.shard_of(name), old)
    _prime(app, store, name)
    return get(app, name)


def _prime(app: Celery, store: Store, name: str) -> None:
    """Store the first occurrences at once (a scheduler sees a new schedule within a few seconds)."""
    s = store.schedules.get(name)
    if s is not None and not s.paused:
        store_ahead(app, store, s, "", "", store.redis.now_ms(), PRIME_MS, 1)


def remove(app: Celery, name: str) -> int:
    """Remove a recurring schedule; return how many pending occurrences were cancelled.

    A schedule declared in ``delayed_schedule`` comes back when a scheduler
    syncs the config unless the entry is removed there too.

    Raises:
        ScheduleNotFound: there is none of that name.
    """
    store = get_store(app)
    code, ids = store.schedules.drop_schedule(name)
    if code == 0:
        raise ScheduleNotFound(name)
    return cancel_occurrences(store, store.schedules.shard_of(name), ids)


def pause(app: Celery, name: str) -> bool:
    """Pause a schedule: its pending occurrences are cancelled, none are created; False if it was paused.

    Raises:
        ScheduleNotFound: there is none of that name.
    """
    return _set_paused(app, name, True)


def resume(app: Celery, name: str) -> bool:
    """Resume a paused schedule from now on (what fell due while paused does not run); False if it ran.

    Raises:
        ScheduleNotFound: there is none of that name.
    """
    return _set_paused(app, name, False)


def _set_paused(app: Celery, name: str, paused: bool) -> bool:
    store = get_store(app)
    code, ids = store.schedules.pause_schedule(name, paused)
    if code == 0:
        raise ScheduleNotFound(name)
    cancel_occurrences(store, store.schedules.shard_of(name), ids)
    if not paused:
        _prime(app, store, name)
    return code == 1


def run_now(app: Celery, name: str) -> DelayedResult:
    """Run one extra occurrence now (the schedule's own occurrences are unchanged).

    Raises:
        ScheduleNotFound: there is none of that name.
    """
    from .api import store_prepared  # the API module imports the producer; this keeps the import graph flat

    store = get_store(app)
    rec = store.schedules
    s = rec.get(name)
    if s is None:
        raise ScheduleNotFound(name)
    d = s.definition
    task = app.tasks.get(d["task"])
    opts = (task_defaults(task) if task is not None else {}) | d["options"]
    p = prepare(app, d["task"], d["args"], d["kwargs"], 0, shard_key=name, task_type=task, options=opts)
    return store_prepared(app, [p])[0]
