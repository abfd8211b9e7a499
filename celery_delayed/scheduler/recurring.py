"""The scheduler's recurring-schedule keeper: store each schedule's next occurrences ahead of time.

A thread of the scheduler process (:class:`Recurrer`). Every ``TICK_S`` it
reads the schedules of the shards this scheduler holds and, for each one
whose cursor (the last fire time covered) is within ``horizon`` of now,
stores the occurrences up to the first fire time past the horizon as
ordinary delayed jobs, then moves the cursor with ``advance_schedule.lua``
under the shard's lease fence. The release loop then releases them like
any job, on time; the next occurrence is always stored before the current
one is released, so there is no gap and no singleton:

- an occurrence's id derives from (name, version, fire time): a scheduler
  that stores it again (it died before moving the cursor, or lost the lease
  meanwhile) finds it there and changes nothing;
- the cursor only moves from the value read, at the version read, under the
  lease: a definition changed meanwhile makes the move a no-op and the
  occurrences just stored are cancelled.

After an outage (the cursor is in the past) the missed fire times follow the
schedule's ``misfire``: ``latest`` stores the latest one (it runs once),
``skip`` none (beyond a grace of ``GRACE_MS``), ``each`` every one (at most
``delayed_schedule_catch_up_max``, the latest). Occurrences stored before the
outage are released late and skipped by their max lateness (``latest``: they
missed the next fire time), so only the latest runs.

The config (``delayed_schedule``, ``beat_schedule`` with
``delayed_import_beat_schedule``) is written to the store for the held shards
when this scheduler starts, when it gains a shard, and every
``delayed_schedule_sync_s`` for entries of its config that changed since it
last looked (see :func:`celery_delayed.schedules.config_entries`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from celery import Celery

from ..api import store_prepared
from ..errors import LeaseLost
from ..recurrence import Every, fires_between, latest_at_or_before, next_after, zone
from ..schedules import cancel_occurrences, config_entries, config_hash, occurrence_jobs, spec_of
from ..store import Store
from ..store.schedules import ScheduleRecords, StoredSchedule

logger = logging.getLogger("celery_delayed.scheduler")

#: Seconds between two looks at the held shards' schedules.
TICK_S = 0.5
#: Occurrences are stored this far ahead of now (beside the look-ahead), ms.
HORIZON_MS = 2_000
#: misfire "skip": a fire time at most this late still runs, ms.
GRACE_MS = 1_000
#: Most occurrences stored ahead for one schedule in one tick.
MAX_AHEAD = 1_000


class Recurrer:
    """Keeps the next occurrences of the held shards' schedules stored (see the module docstring).

    Args:
        app: the Celery app.
        store: the scheduler's store.
        owner: the scheduler's token (the shards' lease owner).
        held: returns the held shards and their fences (shard -> fence).
    """

    def __init__(self, app: Celery, store: Store, owner: str, held: Callable[[], dict[int, str]]) -> None:
        self.app = app
        self.store = store
        self.owner = owner
        self.held = held
        self.records = ScheduleRecords(store)
        cfg = store.config
        self.horizon_ms = HORIZON_MS + cfg.lookahead_ms + int(TICK_S * 1000)
        self.catch_up_max = cfg.schedule_catch_up_max
        self.sync_s = cfg.schedule_sync_s
        self.created = 0
        self._synced_shards: set[int] = set()
        self._seen_hashes: dict[str, str] = {}
        self._next_sync = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- thread ----------------------------------------------------------------------

    def start(self) -> None:
        """Start the thread (a daemon)."""
        self._thread = threading.Thread(target=self._run, name="delayed-recurring", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread after its current tick."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception:
                logger.warning("recurring schedules: tick failed; trying again", exc_info=True)
            self._stop.wait(TICK_S)

    # -- one tick ----------------------------------------------------------------------

    def tick(self, now_ms: int | None = None) -> int:
        """Sync the config if it is time, then store the due-soon occurrences; return how many were stored."""
        held = self.held()
        if not held:
            self._synced_shards.clear()
            return 0
        gained = set(held) - self._synced_shards
        if gained or time.monotonic() >= self._next_sync:
            self.sync_config(held, full=set(gained))
        now = self.store.now_ms() if now_ms is None else now_ms
        n = 0
        for sched in self.records.read(self.records.names(held)):
            fence = held.get(sched.shard)
            if fence is None or sched.paused:
                continue
            try:
                n += self._advance(sched, fence, now)
            except LeaseLost:
                logger.info("recurring schedules: lost the lease of shard %d", sched.shard)
        self.created += n
        return n

    def _fires(self, sched: StoredSchedule, now: int) -> tuple[list[int], int] | None:
        """The fire times to store now and the new cursor (None: nothing to do yet)."""
        d = sched.definition
        spec, tz, origin = spec_of(d), zone(d["timezone"]), sched.origin_ms
        last, horizon = sched.last_ms, now + self.horizon_ms
        if last > horizon:
            return None
        missed: list[int] = []
        if last < now:
            policy = d["misfire"]
            if policy == "latest":
                p = latest_at_or_before(spec, now, origin, tz)
                missed = [p] if p is not None and p > last else []
            elif policy == "each":
                # bounded: the latest catch_up_max intervals, or a cron's last 31 days
                back = self.catch_up_max * spec.period_ms if isinstance(spec, Every) else 31 * 86_400_000
                start = max(last, now - back)
                missed = fires_between(spec, start, now, origin, tz, limit=10**6)[-self.catch_up_max:]
            else:
                missed = fires_between(spec, max(last, now - GRACE_MS), now, origin, tz, limit=MAX_AHEAD)
        start = max(last, now)
        ahead = fires_between(spec, start, horizon, origin, tz, limit=MAX_AHEAD)
        beyond = next_after(spec, max(start, horizon, ahead[-1] if ahead else start), origin, tz)
        fires = [*missed, *ahead, beyond]
        return fires, beyond

    def _advance(self, sched: StoredSchedule, fence: str, now: int) -> int:
        plan = self._fires(sched, now)
        if plan is None:
            return 0
        fires, cursor = plan
        prepared = occurrence_jobs(self.app, sched, fires, GRACE_MS)
        results = store_prepared(self.app, prepared)
        pairs = [(r.id, f) for r, f in zip(results, fires, strict=True)]
        if not self.records.advance(sched, self.owner, fence, cursor, pairs):
            # changed, paused or removed since read: what was just stored belongs to the old definition
            cancel_occurrences(self.store, sched.shard, [r.id for r in results if r.created])
            return 0
        return sum(1 for r in results if r.created)

    # -- the config ------------------------------------------------------------------------

    def sync_config(self, held: dict[int, str], full: set[int] | None = None) -> None:
        """Write the config's entries of the held shards to the store; remove those it no longer has.

        ``full``: shards just gained (all their entries are written when they
        differ from the store's); in the others only entries that changed since
        this scheduler last looked.
        """
        self._next_sync = time.monotonic() + self.sync_s
        try:
            entries = config_entries(self.app)
        except Exception:
            logger.exception("recurring schedules: the config has a bad entry; not synced")
            return
        full = set(full or ())
        first = not self._synced_shards
        hashes = {name: config_hash(defn) for name, defn in entries.items()}
        for name, defn in entries.items():
            shard = self.records.shard_of(name)
            if shard not in held:
                continue
            if not first and shard not in full and self._seen_hashes.get(name) == hashes[name]:
                continue
            written, old = self.records.put(name, defn, "config", hashes[name])
            if written:
                logger.info("recurring schedule %r: config entry written (shard %d)", name, shard)
                cancel_occurrences(self.store, shard, old)
        for shard, names in self.records.names(held).items():
            for name in names:
                if name in entries:
                    continue
                code, old = self.records.drop(name, only_config=True)
                if code == 1:
                    logger.info("recurring schedule %r: removed from the config, removed", name)
                    cancel_occurrences(self.store, shard, old)
        self._seen_hashes = hashes
        self._synced_shards = set(held)

