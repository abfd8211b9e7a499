"""Occurrences: the delayed jobs a schedule's fire times become, planned and stored ahead of time."""

from __future__ import annotations

import builtins
import dataclasses
import uuid
from collections.abc import Sequence
from datetime import datetime, timezone

from celery import Celery

from ..errors import InvalidState, JobNotFound
from ..producer.message import task_defaults
from ..producer.prepare import Prepared, prepare
from ..store import Store, get_store
from ..store.schedules import StoredSchedule
from ..vocab import JobState
from .definition import spec_of
from .rules import (
    Every,
    fires_between,
    latest_at_or_before,
    next_after,
    period_ms,
    zone,
)

#: Namespace of occurrence ids (uuid5 of "<name>\\0<epoch>\\0<version>\\0<fire ms>").
OCCURRENCE_NAMESPACE = uuid.UUID("9d5c2a61-0b7e-4c3f-8a51-2f6e4b1d7c90")


def occurrence_id(sched: StoredSchedule, fire_ms: int) -> str:
    """The job id of a schedule's occurrence at ``fire_ms``: from its name, epoch, version and the fire
    time, so every scheduler derives the same one."""
    return str(uuid.uuid5(OCCURRENCE_NAMESPACE, f"{sched.name}\0{sched.epoch}\0{sched.version}\0{fire_ms}"))


def occurrence_jobs(app: Celery, store: Store, sched: StoredSchedule, fires: Sequence[int],
                    grace_ms: int, now_ms: int | None = None) -> builtins.list[Prepared]:
    """Jobs prepared for ``store``: a schedule's occurrences at ``fires`` (ids derived; a stored one is kept).

    ``misfire="latest"``: an occurrence released after the next fire time is
    skipped (the next one runs), except the missed one a catch-up stores
    (due at or before ``now_ms``): it has ``grace_ms`` from now, so that the
    moments its release takes cannot make it miss the next fire time and
    skip it after all; ``"skip"``: one released later than ``grace_ms`` (or
    the next fire) is skipped; ``"each"``: it runs however late.
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
            if d["misfire"] == "latest" and now_ms is not None and fire <= now_ms:
                late = max(late, now_ms - fire + grace_ms)
            opts |= {"max_lateness": max(late - 1, 1) / 1000, "misfire": "skip"}
        when = datetime.fromtimestamp(fire / 1000, timezone.utc)
        p = prepare(app, store, d["task"], d["args"], d["kwargs"], when,
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
    from ..api import store_prepared  # the API module imports the producer; this keeps the import graph flat

    todo = plan(sched, now_ms, horizon_ms, catch_up_max)
    if todo is None:
        return 0
    fires, cursor = todo
    app_store = get_store(app)  # the occurrences go through the app's store, as apply_later's jobs do
    results = store_prepared(app, app_store, occurrence_jobs(app, app_store, sched, fires, GRACE_MS, now_ms))
    pairs = [(r.id, f) for r, f in zip(results, fires, strict=True)]
    rec = store.schedules
    if rec.advance_schedule(sched, owner, fence, cursor, pairs):
        return sum(1 for r in results if r.created)
    cur = rec.get(sched.name)
    if cur is None or cur.version != sched.version or cur.paused:
        # changed, paused or removed since read: what was just stored belongs to the old definition, and
        # never runs (the release loop may have released one due within the look-ahead meanwhile)
        cancel_occurrences(store, sched.shard, [r.id for r in results if r.created], released=True)
    # else another scheduler moved the cursor first: it covers the same ids (derived from the version)
    return 0


#: States of an occurrence released and not started (``cancel_occurrences(released=True)`` cancels them too).
_RELEASED = frozenset({JobState.QUEUED, JobState.CLAIMED})


def cancel_occurrences(store: Store, shard: int, ids: Sequence[str], released: bool = False) -> int:
    """Cancel the occurrences among ``ids`` not yet released (a change, pause or removal); return how many.

    ``released``: those released and not started too (the worker skips them).
    """
    if not ids:
        return 0
    states = store.lookup.record_states(shard, ids)
    n = 0
    for job_id in ids:
        state = states.get(job_id)
        if state == JobState.SCHEDULED or (released and state in _RELEASED):
            try:
                store.jobs.cancel(job_id, shard)
                n += 1
            except (InvalidState, JobNotFound):  # released or gone meanwhile
                pass
    return n
