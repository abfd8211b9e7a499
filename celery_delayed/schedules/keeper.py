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
``skip`` none (beyond a grace of a second), ``each`` every one (at most
``delayed_schedule_catch_up_max``, the latest). Occurrences stored before the
outage are released late and skipped by their max lateness (``latest``: they
missed the next fire time), so only the latest runs.

A stored schedule that cannot be computed (a record written by hand, or by
a version that accepted what is refused now) is skipped with one ERROR line
per version of it, and the other schedules go on (:func:`.definition.stored_problem`).

The config (``delayed_schedule``, ``beat_schedule`` with
``delayed_import_beat_schedule``) is written to the store when this scheduler
starts, and every ``delayed_schedule_sync_s`` for
entries of its config that changed since it last looked (see :func:`.definition.config_entries`). A
scheduler never overwrites or removes a config entry that a scheduler started
after it wrote: during a rolling deploy the old config never undoes the new.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from celery import Celery

from ..errors import LeaseLost, StoreUnavailable
from ..store import Store
from ..store.schedules import StoredSchedule
from ..threads import BackgroundThread
from ..vocab import JobState
from .definition import config_entries, config_hash, stored_problem
from .occurrences import cancel_occurrences, store_ahead

logger = logging.getLogger("celery_delayed.scheduler")

#: ``skip_if_running``: how many earlier occurrences are looked at.
OVERLAP_LOOKBACK = 20
#: States of an occurrence that was released and has not finished (``skip_if_running``).
_UNFINISHED = frozenset({JobState.QUEUED, JobState.CLAIMED, JobState.RUNNING})

#: Seconds between two looks at the held shards' schedules.
TICK_S = 0.5
#: Seconds between two reads of the schedules' index (new or removed schedules).
INDEX_S = 5.0
#: Occurrences are stored this far ahead of now (beside the look-ahead), ms.
HORIZON_MS = 2_000


class Recurrer(BackgroundThread):
    """Keeps the next occurrences of the held shards' schedules stored (see the module docstring).

    A daemon thread: :meth:`start` it, :meth:`stop` it (after its current
    tick); or call :meth:`tick` yourself (the testing kit).

    Args:
        app: the Celery app.
        store: the scheduler's store.
        owner: the scheduler's token (the shards' lease owner).
        held: returns the held shards and their fences (shard -> fence).
    """

    tick_s = TICK_S
    backoff_s = 2 * TICK_S  # after a failed tick: 1, 2, 4 then 5 s
    max_backoff_s = 5.0
    stop_timeout_s = 5.0

    def __init__(self, app: Celery, store: Store, owner: str, held: Callable[[], dict[int, str]]) -> None:
        super().__init__(name="delayed-recurring")
        self.app = app
        self.store = store
        self.owner = owner
        self.held = held
        self.records = store.schedules
        cfg = store.config
        self.horizon_ms = HORIZON_MS + cfg.lookahead_ms + int(TICK_S * 1000)
        self.catch_up_max = cfg.schedule_catch_up_max
        self.sync_s = cfg.schedule_sync_s
        self.created = 0
        #: when this scheduler started, by the Redis clock (its config is that old): read at its first tick
        self.since_ms = 0
        self._seen_hashes: dict[str, str] | None = None  # the config entries' hashes at the last sync
        self._next_sync = 0.0
        self._next_index = 0.0
        self._names: list[str] = []
        #: the broken schedules logged: name -> (version, problem)
        self._broken: dict[str, tuple[int, str]] = {}

    # -- thread ----------------------------------------------------------------------

    def body(self) -> None:
        """One :meth:`tick`; the next in ``TICK_S``."""
        self.tick()

    def on_error(self, exc: Exception) -> float:
        """Log the first of failed ticks in a row (briefly for an outage: the loop logs it too); back off."""
        if isinstance(exc, StoreUnavailable):
            if self.failures == 1:
                logger.warning("recurring schedules: store unavailable (%s); trying again", exc)
        else:
            logger.warning("recurring schedules: tick failed; trying again", exc_info=self.failures == 1)
        return self.backoff(self.failures)

    # -- one tick ----------------------------------------------------------------------

    def tick(self, now_ms: int | None = None, fresh: bool = False) -> int:
        """Sync the config if it is time, then store the due-soon occurrences; return how many were stored.

        An idle fleet (no schedule) costs one read of the schedules' index
        every ``INDEX_S``. ``fresh``: sync the config and read the index now
        (the testing kit, whose clock is not the wall clock).
        """
        if fresh or time.monotonic() >= self._next_sync:  # even holding no shard: its config may be the newest
            self.sync_config()
        held = self.held()
        if not held:
            return 0
        if fresh or time.monotonic() >= self._next_index:
            self._next_index = time.monotonic() + INDEX_S
            self._names = self.records.index()
        mine: dict[int, list[str]] = {}
        for name in self._names:
            shard = self.records.shard_of(name)
            if shard in held:
                mine.setdefault(shard, []).append(name)
        if not mine:
            return 0
        now = self.store.redis.now_ms() if now_ms is None else now_ms
        n = 0
        for sched in self.records.read(mine):
            fence = held.get(sched.shard)
            if fence is None or sched.paused:
                continue
            problem = stored_problem(sched, now)
            if problem is not None:
                self._skip_broken(sched, problem)
                continue
            try:
                n += self._advance(sched, fence, now)
            except LeaseLost:
                logger.info("recurring schedules: lost the lease of shard %d", sched.shard)
                continue
            except (ValueError, TypeError, LookupError, ArithmeticError) as exc:
                # a definition the checks let through: this schedule only (a store error ends the tick)
                self._skip_broken(sched, f"{type(exc).__name__}: {exc}", exc)
                continue
            if self._broken.pop(sched.name, None) is not None:
                logger.info("recurring schedule %r: no longer broken, its occurrences are stored again", sched.name)
            if sched.definition.get("skip_if_running"):
                self.skip_overlaps(sched, now)
        self.created += n
        return n

    def _skip_broken(self, sched: StoredSchedule, problem: str, exc: Exception | None = None) -> None:
        """Log a broken schedule once per version and problem (it is skipped at every tick until changed)."""
        key = (sched.version, problem)
        if self._broken.get(sched.name) == key:
            return
        if len(self._broken) >= 10_000:
            self._broken.clear()
        self._broken[sched.name] = key
        logger.error("recurring schedule %r (version %d) is broken and skipped: %s; add it again with a valid "
                     "schedule (delayed schedules add) or remove it (delayed schedules remove %s)",
                     sched.name, sched.version, problem, sched.name, exc_info=exc)

    def skip_overlaps(self, sched: StoredSchedule, now: int) -> list[str]:
        """``skip_if_running``: cancel the occurrence about to be released while an earlier one has not finished.

        Looked at each tick for the occurrences due within the look-ahead and
        one second: when the record of one of the ``OVERLAP_LOOKBACK``
        occurrences before it (the execution record) says QUEUED, CLAIMED or
        RUNNING, it would overlap that one. Returns the ids cancelled.
        """
        occ = self.records.occurrences(sched.name)
        soon = now + self.store.config.lookahead_ms + 2 * int(TICK_S * 1000)
        due = [i for i, (_, fire) in enumerate(occ) if fire <= soon][-5:]  # the earlier ones were released
        if not due:
            return []
        lo = max(0, due[0] - OVERLAP_LOOKBACK)
        states = self.store.lookup.record_states(sched.shard, [job_id for job_id, _ in occ[lo:due[-1] + 1]])
        skipped = []
        for i in due:
            cur = occ[i][0]
            if i == 0 or states.get(cur) != JobState.SCHEDULED:
                continue
            earlier = occ[max(0, i - OVERLAP_LOOKBACK):i]
            if any(states.get(j) in _UNFINISHED for j, _ in earlier) and cancel_occurrences(
                    self.store, sched.shard, [cur]):
                skipped.append(cur)
                states[cur] = JobState.CANCELLED
        if skipped:
            logger.info("recurring schedule %r: skipped %d occurrence(s): an earlier one is still running",
                        sched.name, len(skipped))
        return skipped

    def _advance(self, sched: StoredSchedule, fence: str, now: int) -> int:
        return store_ahead(self.app, self.store, sched, self.owner, fence, now, self.horizon_ms,
                           self.catch_up_max)

    # -- the config ------------------------------------------------------------------------

    def sync_config(self, full: bool = False) -> None:
        """Write the config's entries to the store; remove the config's schedules it no longer has.

        The first sync of this scheduler (or ``full``) writes every entry that
        differs from the store's and removes every schedule that came from a
        config and is not in this one; later syncs only what changed in this
        scheduler's config since it last looked. Any shard's: the store keeps
        the writer's start time, so a scheduler started earlier never undoes
        this one's config (``put_schedule.lua``).
        """
        self._next_sync = time.monotonic() + self.sync_s
        try:
            entries = config_entries(self.app)
        except Exception:
            logger.exception("recurring schedules: the config has a bad entry; not synced")
            return
        if not self.since_ms:
            self.since_ms = self.store.redis.now_ms()
        first = full or self._seen_hashes is None
        seen = self._seen_hashes or {}
        hashes = {name: config_hash(defn) for name, defn in entries.items()}
        for name, defn in entries.items():
            if not first and seen.get(name) == hashes[name]:
                continue
            written, old = self.records.put_schedule(name, defn, "config", hashes[name], since_ms=self.since_ms)
            if written:
                logger.info("recurring schedule %r: config entry written", name)
                cancel_occurrences(self.store, self.records.shard_of(name), old)
        self._names = sorted(set(self.records.index()) | set(entries))
        self._next_index = time.monotonic() + INDEX_S
        for name in (self._names if first else sorted(seen)):
            if name in entries:
                continue
            code, old = self.records.drop_schedule(name, only_config=True, since_ms=self.since_ms)
            if code == 1:
                logger.info("recurring schedule %r: removed from the config, removed", name)
                cancel_occurrences(self.store, self.records.shard_of(name), old)
        self._seen_hashes = hashes
