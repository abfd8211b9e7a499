"""The run-time API of recurring schedules: list, get, add, remove, pause, resume, run_now."""

from __future__ import annotations

import builtins
import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from celery import Celery

from ..errors import InvalidOption, ScheduleNotFound
from ..producer.message import task_defaults
from ..producer.prepare import prepare
from ..result import DelayedResult
from ..store import Store, get_store
from ..store.schedules import ScheduleRecords, StoredSchedule
from .definition import definition, spec_of, stored_problem
from .occurrences import (
    PRIME_MS,
    cancel_occurrences,
    store_ahead,
)
from .rules import (
    Every,
    next_after,
    zone,
)


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
    #: what makes the stored schedule unusable ('' when nothing): it is skipped by the schedulers
    #: until it is added again or removed, and its other fields show what could be read
    error: str = ""

    def as_dict(self) -> dict[str, Any]:
        """JSON-safe form (the CLI's ``--json``)."""
        return dataclasses.asdict(self)


def _info(rec: ScheduleRecords, s: StoredSchedule, now_ms: int) -> Schedule:
    d = s.definition
    occ = rec.occurrences(s.name)
    problem = stored_problem(s, now_ms)
    if problem is not None:
        return _broken(s, occ, problem)
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


def _broken(s: StoredSchedule, occ: builtins.list[tuple[str, int]], problem: str) -> Schedule:
    """A schedule whose record cannot be computed: what can be read of it, and why."""
    d = s.definition

    def field(key: str, kind: type, default: Any) -> Any:
        value = d.get(key)
        return value if isinstance(value, kind) else default

    spec = d.get("spec")
    return Schedule(
        name=s.name, task=field("task", str, "?"), schedule=json.dumps(spec) if spec is not None else "?",
        timezone=field("timezone", str, "-"), misfire=field("misfire", str, "?"),
        skip_if_running=bool(d.get("skip_if_running")), args=field("args", builtins.list, []),
        kwargs=field("kwargs", dict, {}), options=field("options", dict, {}), source=s.source, paused=s.paused,
        version=s.version, shard=s.shard, origin_ms=s.origin_ms, next_fire_ms=None, occurrences=occ,
        error=f"broken: {problem}; add it again with a valid schedule, or remove it",
    )


def list(app: Celery) -> builtins.list[Schedule]:
    """Every recurring schedule of the store, sorted by name (a broken one too, with its :attr:`~Schedule.error`)."""
    store = get_store(app)
    rec = store.schedules
    now = store.redis.now_ms()
    return [_info(rec, s, now) for s in rec.all()]


def _stored(app: Celery, name: str) -> tuple[Store, StoredSchedule]:
    """The app's store and the schedule ``name`` in it; raise :class:`ScheduleNotFound`."""
    store = get_store(app)
    s = store.schedules.get(name)
    if s is None:
        raise ScheduleNotFound(name)
    return store, s


def get(app: Celery, name: str) -> Schedule:
    """One recurring schedule.

    Raises:
        ScheduleNotFound: there is none of that name.
    """
    store, s = _stored(app, name)
    return _info(store.schedules, s, store.redis.now_ms())


def add(app: Celery, name: str, task: str, schedule: object, args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None, options: Mapping[str, Any] | None = None, *,
        timezone: str | None = None, misfire: str = "latest", skip_if_running: bool = False,
        strict: bool = True, after: datetime | None = None, paused: bool = False) -> Schedule:
    """Add a recurring schedule, or replace the one of that name (a run-time change: it wins over
    ``delayed_schedule`` until that config entry itself changes).

    Its occurrences start with the first fire time after now; those stored
    for an old definition and not yet released are cancelled.

    Args:
        after: an aware datetime: the occurrences start with the first fire
            time after it instead, and an interval counts its periods from it
            (a schedule taken over from another scheduler that last ran it
            then). A fire time between it and now is a missed one: it runs
            by ``misfire`` (``"latest"``: once, now).
        paused: store it paused (:func:`resume` starts it from then on).

    Raises:
        InvalidOption, UnknownTask: a bad entry (or a naive ``after``); nothing is stored.
    """
    entry = {"task": task, "schedule": schedule, "args": args, "kwargs": kwargs or {}, "options": options or {},
             "timezone": timezone, "misfire": misfire, "skip_if_running": skip_if_running}
    defn = definition(app, name, entry, strict=strict)
    after_ms = None
    if after is not None:
        if not isinstance(after, datetime) or after.tzinfo is None or after.utcoffset() is None:
            raise InvalidOption(f"schedule {name!r}: after must be an aware datetime, got {after!r}")
        after_ms = round(after.timestamp() * 1000)
    store = get_store(app)
    _, old = store.schedules.put_schedule(name, defn, "api", after_ms=after_ms, paused=paused)
    cancel_occurrences(store, store.schedules.shard_of(name), old)
    _prime(app, store, name)
    return get(app, name)


def _prime(app: Celery, store: Store, name: str) -> None:
    """Store the first occurrences at once (a scheduler sees a new schedule within a few seconds)."""
    s = store.schedules.get(name)
    if s is not None and not s.paused and stored_problem(s, store.redis.now_ms()) is None:
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
        InvalidOption: the stored schedule is broken (:attr:`Schedule.error`).
    """
    from ..api import store_prepared  # the API module imports the producer; this keeps the import graph flat

    store, s = _stored(app, name)
    problem = stored_problem(s, store.redis.now_ms())
    if problem is not None:
        raise InvalidOption(f"schedule {name!r} is broken: {problem}; add it again with a valid schedule, "
                            "or remove it")
    d = s.definition
    task = app.tasks.get(d["task"])
    opts = (task_defaults(task) if task is not None else {}) | d["options"]
    p = prepare(app, store, d["task"], d["args"], d["kwargs"], 0, shard_key=name, task_type=task, options=opts)
    return store_prepared(app, store, [p])[0]
