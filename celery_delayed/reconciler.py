"""The reconciler: what Redis or the broker lost is found and released again, once.

One pass (``celery -A proj delayed reconcile``, or inside the scheduler every
``delayed_reconcile_interval_s``, in the scheduler that holds shard 0):

1. **Released, never started** (both modes). A job released (QUEUED) whose
   execution has not started ``delayed_requeue_after_s`` after its due time
   is released again, unless its message is still somewhere: held by a
   worker (kombu's unacked set, on the direct path) or waiting in its queue
   (the queue's oldest message was released no earlier than this job's, or,
   on the publish path, the queue reports messages). At most
   :data:`MAX_COPIES` copies per job; the execution record makes any
   surviving copy harmless. A lost message runs late, once.
2. **Rows Redis lost** (with a database). A row that is SCHEDULED, CLAIMED or
   QUEUED but has no record in Redis is indexed again from the row (a
   released one as SCHEDULED at its due time: it is released at once, late,
   under its misfire policy).
3. **Redis jobs without a row** (with a database). A scheduled job older
   than :data:`GRACE_MS` without a row is adopted (a row is written from its
   record), except a job indexed at a Core ``Connection``'s commit whose
   transaction did not commit (its record says so): that one is dropped.

Every step works in bounded batches (keyset pagination over the rows, pages
of the released sets), so a large store neither stalls Redis nor the
database.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from celery import Celery

from .config import get_config
from .store import Store, get_store
from .vocab import Field, JobState

if TYPE_CHECKING:  # SQLAlchemy is an optional extra: imported only with a database
    from .sql.rows import JobRows, Row

logger = logging.getLogger("celery_delayed.reconciler")

#: Copies of one job's message the reconciler sends at most.
MAX_COPIES = 3
#: How long a job may live in Redis without a row before it is adopted or dropped, ms.
GRACE_MS = 60_000
#: Rows or ids handled per batch.
BATCH = 1000


@dataclass
class Report:
    """What one pass found and did."""

    rereleased: int = 0  # released again: the message was lost
    waiting: int = 0  # released, not started, but still held by a worker or waiting in its queue
    exhausted: int = 0  # lost again after MAX_COPIES copies: left alone, reported
    reindexed: int = 0  # rows Redis had lost, indexed again
    adopted: int = 0  # Redis jobs without a row: rows written
    dropped: int = 0  # Redis jobs whose outbox transaction never committed: dropped
    drift: int = 0  # rows whose state differs from Redis's (the mirror will catch up)
    scanned_rows: int = 0
    scanned_jobs: int = 0
    seconds: float = 0.0
    details: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """The report as a JSON-ready dict."""
        return asdict(self)


class Reconciler:
    """One store's reconciliation (see the module docstring)."""

    def __init__(self, app: Celery, store: Store | None = None, rows: JobRows | None = None, *,
                 dry_run: bool = False, queue_depth: Callable[[str], int] | None = None) -> None:
        self.app = app
        self.store = store or get_store(app)
        if rows is None and self.store.config.database_url:
            from .sql.rows import get_rows

            rows = get_rows(app)
        self.rows = rows
        self.config = get_config(app)
        self.dry_run = dry_run
        #: publish path: messages waiting in a queue (None: ask the broker)
        self.queue_depth = queue_depth

    def run_pass(self, now_ms: int | None = None) -> Report:
        """One full pass (bounded batches inside); return what it found and did."""
        t0 = time.monotonic()
        report = Report()
        if self.rows is not None:
            self._check_bound()
        self.store.layout.reload(5.0)
        now = self.store.redis.now_ms() if now_ms is None else now_ms
        if self.store.release.any_released():  # an idle fleet: one command instead of a read per shard
            for shard in self.store.layout.shard_range():
                self._rerelease(shard, now, report)
        if self.rows is not None and self.store.layout.moving_from is None:  # not while a reshard moves records
            self.rows.refresh_statistics()  # its reads below are index lookups only with statistics
            self._reindex(now, report)
            self._adopt_or_drop(now, report)
        report.seconds = round(time.monotonic() - t0, 3)
        return report

    def sweep_outbox(self, since_ms: int) -> int:
        """Index rows created since ``since_ms`` that Redis does not have yet; return the newest created time seen.

        Cheap (the rows created since the last sweep, on an index), so the
        scheduler runs it every second: a job written in a Core
        ``Connection``'s transaction, or whose process died between the
        commit and the Redis write, is indexed within about a second.
        """
        assert self.rows is not None
        self._check_bound()
        self.store.layout.reload(5.0)
        after: tuple[int, str] = (0, "")
        newest = since_ms
        while True:
            page = self.rows.created_since(since_ms, after, BATCH)
            if not page:
                return newest
            after = (page[-1].created_ms, page[-1].id)
            newest = max(newest, page[-1].created_ms)
            by_shard: dict[int, list[Row]] = defaultdict(list)
            for row in page:
                by_shard[row.home(self.store.layout.shards)].append(row)
            for shard, rows in by_shard.items():
                states = self.store.lookup.record_states(shard, [r.id for r in rows])
                lost = [r for r in rows if states.get(r.id) is None]
                if lost and not self.dry_run:
                    self.store.jobs.schedule([r.as_new_job(self.store.layout.shards) for r in lost])
            if len(page) < BATCH:
                return newest

    def _check_bound(self) -> None:
        """Refuse to index into this Redis the rows of a database bound to another store (``sql/binding.py``)."""
        from .sql.binding import ensure_bound

        assert self.rows is not None
        ensure_bound(self.store, self.rows)

    # -- 1. released, never started -----------------------------------------------------

    def _rerelease(self, shard: int, now: int, report: Report) -> None:
        older_than = now - int(self.config.requeue_after_s * 1000)
        after = 0.0
        while True:
            page = self.store.release.release_candidates(shard, older_than, after, BATCH)
            if not page:
                return
            after = page[-1][1]
            ids = [jid for jid, _ in page]
            if not self.store.broker.direct:
                ids = self._not_waiting_in_queues(shard, ids, report)
            if ids and not self.dry_run:
                for job_id, outcome in self.store.release.rerelease(shard, ids, MAX_COPIES, now_ms=now):
                    if outcome == "rereleased":
                        report.rereleased += 1
                        report.details.append(f"released again: {job_id}")
                    elif outcome in ("held", "waiting"):
                        report.waiting += 1
                    elif outcome == "exhausted":
                        report.exhausted += 1
                        report.details.append(f"lost after {MAX_COPIES} copies: {job_id}")
            elif ids:
                report.rereleased += len(ids)  # would be considered
            if len(page) < BATCH:
                return

    def _not_waiting_in_queues(self, shard: int, ids: list[str], report: Report) -> list[str]:
        """Publish path: leave the jobs whose queue still has messages (they may be waiting there)."""
        queues = self.store.lookup.field_of(shard, ids, Field.QUEUE)
        depth: dict[str, int] = {}
        keep = []
        for job_id in ids:
            q = queues.get(job_id) or ""
            if q not in depth:
                depth[q] = self._depth(q)
            if depth[q] > 0:
                report.waiting += 1
            else:
                keep.append(job_id)
        return keep

    def _depth(self, queue: str) -> int:
        if self.queue_depth is not None:
            return self.queue_depth(queue)
        if not queue:
            return 0
        try:
            with self.app.connection_for_read() as conn:
                _, count, _ = conn.default_channel.queue_declare(queue=queue, passive=True)
                return int(count)
        except Exception as exc:  # cannot tell: treat as waiting (no copies on a guess)
            logger.warning("reconciler: could not read the depth of queue %r (%s)", queue, exc)
            return 1

    # -- 2. rows Redis lost ----------------------------------------------------------------

    def _reindex(self, now: int, report: Report) -> None:
        assert self.rows is not None
        for state in (JobState.SCHEDULED, JobState.CLAIMED, JobState.QUEUED):
            after = ""
            while True:
                page = self.rows.page([state], after, BATCH)
                if not page:
                    break
                after = page[-1].id
                report.scanned_rows += len(page)
                by_shard: dict[int, list[Row]] = defaultdict(list)
                for row in page:
                    by_shard[row.home(self.store.layout.shards)].append(row)
                for shard, rows in by_shard.items():
                    states = self.store.lookup.record_states(shard, [r.id for r in rows])
                    lost = [r for r in rows if states.get(r.id) is None]
                    report.drift += sum(1 for r in rows if states.get(r.id) not in (None, r.state))
                    if lost:
                        report.details += [f"indexed again: {r.id} (row {r.state})" for r in lost]
                        report.reindexed += len(lost)
                        if not self.dry_run:
                            self.store.jobs.schedule([r.as_new_job(self.store.layout.shards) for r in lost])
                if len(page) < BATCH:
                    break

    # -- 3. Redis jobs without a row ------------------------------------------------------------

    def _adopt_or_drop(self, now: int, report: Report) -> None:
        assert self.rows is not None
        for shard in self.store.layout.shard_range():
            for ids in self.store.lookup.scheduled_pages(shard, BATCH):
                report.scanned_jobs += len(ids)
                missing = set(ids) - self.rows.existing(ids)
                if not missing:
                    continue
                records = self.store.lookup.records(shard, sorted(missing))
                adopt: list[tuple[str, dict[str, str]]] = []
                drop: list[tuple[str, dict[str, str]]] = []
                for job_id, rec in records.items():
                    if not rec or int(float(rec.get(Field.CREATED, now))) > now - GRACE_MS:
                        continue  # gone meanwhile, or too young: its row may be on its way
                    (drop if rec.get(Field.OUTBOX) else adopt).append((job_id, rec))
                report.adopted += len(adopt)
                report.dropped += len(drop)
                report.details += [f"adopted: {j}" for j, _ in adopt] + [f"dropped (never committed): {j}"
                                                                        for j, _ in drop]
                if self.dry_run:
                    continue
                if adopt:
                    self.rows.adopt([self.rows.row_from_record(job_id, shard, rec, now) for job_id, rec in adopt])
                for job_id, _ in drop:
                    self.store.jobs.drop(job_id, shard)
