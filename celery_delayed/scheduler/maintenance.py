"""The scheduler's background work beside releasing: the database mirror, the outbox sweep, the reconciler.

A thread of the scheduler process (:class:`Maintenance`), so that a long
reconciliation pass never holds up a release. Every second it:

- applies change logs to the database rows (with ``delayed_database_url``;
  :mod:`.mirror`): those of the shards this scheduler released from since
  the last round, and two more of its shards in turn (a worker's start and
  finish reach a row within a turn of the held shards, half as many seconds);
- in the scheduler that holds shard 0 (one scheduler of the fleet at a
  time, under that shard's fenced lease: no lease of its own to renew),
  indexes rows committed since the last look but not yet in Redis (the
  outbox sweep: a Core ``Connection``'s jobs, a process that died between
  commit and index, Redis down at the time) and runs a full
  :class:`~celery_delayed.reconciler.Reconciler` pass every
  ``delayed_reconcile_interval_s``.

An idle Redis-only scheduler sends nothing here but a pass's two commands once
an interval (the clock, and one look at whether any shard has a released job).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..errors import ConfigurationError
from ..reconciler import Reconciler
from ..store import Store
from ..threads import BackgroundThread

if TYPE_CHECKING:  # SQLAlchemy is an optional extra: imported only with a database
    from ..sql.rows import JobRows
from .mirror import Mirror

logger = logging.getLogger("celery_delayed.scheduler")

#: Seconds between two rounds of maintenance.
TICK_S = 1.0
#: The shard whose holder runs the reconciler and the outbox sweep.
RECONCILER_SHARD = 0
#: How far back the outbox sweep looks again (rows committed late by long transactions), ms.
SWEEP_OVERLAP_MS = 10_000
#: Held shards whose change log is applied in turn each round, beside those released from.
MIRROR_TURN = 2
#: Seconds between two rounds while a setting is wrong (said as an ERROR each time).
CONFIG_RETRY_S = 30.0


class Maintenance(BackgroundThread):
    """Runs the mirror, the outbox sweep and the reconciler for one scheduler (see the module docstring).

    A daemon thread: :meth:`start` it, :meth:`stop` it (after its current round).
    """

    tick_s = TICK_S

    def __init__(self, store: Store, rows: JobRows | None, owner: str, held_shards: Callable[[], list[int]]) -> None:
        super().__init__(name="delayed-maintenance")
        self.store = store
        self.rows = rows
        self.owner = owner
        self.held_shards = held_shards
        self.mirror = Mirror(store, rows) if rows is not None else None
        self.reconciler = Reconciler(store.app, store, rows)
        self.interval_s = store.config.reconcile_interval_s
        self.passes = 0
        self.last_report: dict[str, object] | None = None
        self._next_pass = time.monotonic() + self.interval_s
        self._sweep_from = int(time.time() * 1000) - SWEEP_OVERLAP_MS
        self._dirty: set[int] = set()
        self._turn = 0
        self._lock = threading.Lock()

    def released_from(self, shard: int) -> None:
        """The scheduler loop released (or held back) jobs of ``shard``: mirror its log next round."""
        if self.mirror is not None:
            with self._lock:
                self._dirty.add(shard)

    def _mirror_shards(self) -> list[int]:
        held = self.held_shards()
        with self._lock:
            dirty, self._dirty = self._dirty, set()
        turn = [held[(self._turn + i) % len(held)] for i in range(min(MIRROR_TURN, len(held)))] if held else []
        self._turn += MIRROR_TURN
        return sorted((dirty & set(held)) | set(turn))

    def body(self) -> None:
        """One round (:meth:`tick`); the next in ``TICK_S``."""
        self.tick()

    def on_error(self, exc: Exception) -> float:
        """Log a failed round; the next one, ``TICK_S`` later, tries again (the store's state is the truth).

        A wrong setting (the database bound to another store since this
        scheduler started) is an ERROR, said again every ``CONFIG_RETRY_S``
        until it is put right: the rows are left alone meanwhile.
        """
        if isinstance(exc, ConfigurationError):
            logger.error("scheduler maintenance stopped: %s", exc)
            return CONFIG_RETRY_S
        logger.warning("scheduler maintenance: %s", exc, exc_info=not isinstance(exc, ConnectionError))
        return TICK_S

    def tick(self) -> None:
        """One round: mirror the held shards; holding shard 0, sweep, and reconcile when it is time."""
        if self.rows is not None:
            from ..sql.binding import ensure_bound  # SQLAlchemy is an optional extra

            ensure_bound(self.store, self.rows)  # the rows of a database bound to another store: left alone
        if self.mirror is not None:
            self.mirror.apply(self._mirror_shards())
        if RECONCILER_SHARD not in self.held_shards():
            return
        if self.rows is not None:
            self._sweep_from = self.reconciler.sweep_outbox(self._sweep_from) - SWEEP_OVERLAP_MS
        if time.monotonic() >= self._next_pass:
            self._next_pass = time.monotonic() + self.interval_s
            report = self.reconciler.run_pass()
            self.passes += 1
            self.last_report = report.as_dict()
            if report.rereleased or report.reindexed or report.adopted or report.dropped or report.exhausted:
                logger.warning(
                    "reconciler: released again %d lost message(s), indexed again %d row(s), adopted %d, "
                    "dropped %d, %d lost after every copy (%.2fs)", report.rereleased, report.reindexed,
                    report.adopted, report.dropped, report.exhausted, report.seconds)
            else:
                logger.debug("reconciler: nothing to do (%.2fs)", report.seconds)
