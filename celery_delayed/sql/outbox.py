"""Scheduling with a database: every job is a row first, indexed in Redis after the row is committed.

``apply_later`` / ``apply_later_many`` with ``delayed_database_url`` set:

1. idempotency keys are resolved against the rows (the unique index decides:
   a key's live job is returned, a cancelled one frees the key for the next
   generation);
2. the rows are written: committed here, or in the caller's transaction when
   ``connection=`` is given (a SQLAlchemy ``Session`` or ``Connection``, or a
   Django connection);
3. the jobs are indexed in Redis (``schedule.lua``) once the row is committed:
   at once without ``connection=``; after the ``Session``'s commit; at the
   Django transaction's ``on_commit``; with a Core ``Connection`` (which has no
   after-commit hook) by the scheduler's outbox sweep, within about a second.

A rolled-back transaction leaves no job anywhere. A process that dies
between the commit and the Redis write leaves a row the sweep (or the
reconciler) indexes. Redis down at step 3: the call still succeeds, the
handle says ``indexed`` False, and the job is indexed when Redis is back
(the handle's ``indexed`` turns True then). What a handle made inside the
caller's transaction means before the commit: see
:class:`~celery_delayed.result.DelayedResult`.
Database down: :class:`~celery_delayed.errors.DatabaseUnavailable`, nothing
written anywhere.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from celery import Celery

from ..errors import ConfigurationError, DelayedError, DuplicateJob, ReplicationTimeout, StoreUnavailable
from ..producer.prepare import Prepared
from ..result import DelayedResult
from ..store import NewJob, Store
from ..vocab import Field, JobState
from .binding import ensure_bound
from .rows import JobRows, Row, key_hash

logger = logging.getLogger("celery_delayed.outbox")


class _Raced(Exception):
    """Another producer used the same idempotency key's next generation first."""


def store_with_rows(app: Celery, store: Store, rows: JobRows, prepared: Sequence[Prepared],
                    connection: Any = None) -> list[DelayedResult]:
    """Write the jobs' rows, then index them in Redis (see the module docstring); return their handles."""
    rows.check_schema()
    ensure_bound(store, rows)  # the rows of a database bound to another store are not this store's to write
    for _ in range(3):
        try:
            return _store(store, rows, prepared, connection)
        except _Raced:
            continue
    raise DuplicateJob("(an idempotency key's job)", "replaced by other producers three times in a row")


def _store(store: Store, rows: JobRows, prepared: Sequence[Prepared], connection: Any) -> list[DelayedResult]:
    now = int(time.time() * 1000)
    latest = rows.latest_for_keys(key_hash(p.job.fields[Field.IDEMPOTENCY_KEY]) for p in prepared if p.idempotent)
    _cancelled_in_redis(store, latest)
    new: list[tuple[int, Prepared, int]] = []  # (position, job, generation)
    found: dict[int, Row] = {}
    taken: dict[str, int] = {}  # key hash -> position of this batch's job with that key
    for i, p in enumerate(prepared):
        if not p.idempotent:
            new.append((i, p, 0))
            continue
        h = key_hash(p.job.fields[Field.IDEMPOTENCY_KEY])
        if h in taken:
            found[i] = _pending_row(new[taken[h]][1].job, now)
            continue
        row = latest.get(h)
        if row is not None and row.state != JobState.CANCELLED:
            found[i] = row
            continue
        generation = 0 if row is None else row.generation + 1
        if generation and p.regenerate is not None:
            p = p.regenerate(generation)
        taken[h] = len(new)
        new.append((i, p, generation))
    values = [rows.values(p.job, now, gen) for _, p, gen in new]
    jobs = [p.job for _, p, _ in new]
    out: list[DelayedResult] = [None] * len(prepared)  # type: ignore[list-item]
    made: list[DelayedResult] = []
    for i, p, _ in new:
        due = p.job.due
        due_ms = int(due[1:]) + now if due.startswith("+") else int(due)
        out[i] = DelayedResult(p.job.id, store=store, shard=p.job.shard, due_ms=due_ms, created=True)
        out[i].in_transaction = connection is not None
        made.append(out[i])

    def index() -> None:
        indexed = _index(store, jobs)
        for h in made:
            h.indexed = indexed  # False: the handle asks the store when read (the sweep indexes the row)

    if connection is None:
        _write(rows, values, None)
        index()
    else:
        for h in made:
            h.indexed = False  # until the commit (see DelayedResult)
        _write_in(connection, rows, values, index)
    for i, row in found.items():
        out[i] = DelayedResult(row.id, store=store, shard=row.shard, due_ms=row.due_ms, created=False)
    return out


def _cancelled_in_redis(store: Store, latest: dict[str, Row]) -> None:
    """Rows the mirror has not caught up with: a key whose job Redis says is CANCELLED is free."""
    live = [r for r in latest.values() if r.state != JobState.CANCELLED]
    if not live:
        return
    try:
        by_shard: dict[int, list[Row]] = {}
        for r in live:
            by_shard.setdefault(r.shard, []).append(r)
        for shard, rows in by_shard.items():
            states = store.lookup.record_states(shard, [r.id for r in rows])
            for r in rows:
                if states.get(r.id) == JobState.CANCELLED:
                    latest[key_hash(r.idempotency_key or "")] = dataclasses.replace(r, state=JobState.CANCELLED)
    except StoreUnavailable:
        return  # the rows decide


def _pending_row(job: NewJob, now: int) -> Row:
    due = int(job.due[1:]) + now if job.due.startswith("+") else int(job.due)
    fields = job.full_fields(due)  # a compact job with its message rendered: the row rebuilds it alone
    return Row(job.id, job.shard, fields.get(Field.TASK, ""), JobState.SCHEDULED, due, fields,
               job.fields.get(Field.IDEMPOTENCY_KEY), 0, now)


def _index(store: Store, jobs: Sequence[NewJob]) -> bool:
    """Index committed rows in Redis; False (logged) when Redis cannot be reached: the sweep does it later."""
    if not jobs:
        return True
    try:
        store.jobs.schedule(jobs)
        return True
    except ReplicationTimeout as exc:  # indexed on the master; the row is the job, the reconciler re-indexes
        logger.warning("%d job(s) indexed in Redis without the replicas' acknowledgement (%s): their rows "
                       "keep them, and the reconciler indexes them again if a failover loses them", len(jobs), exc)
        return True
    except StoreUnavailable as exc:
        logger.warning("%d job(s) are in the database but not yet in Redis (%s): the scheduler indexes them "
                       "when Redis is back", len(jobs), exc)
        return False


def _write(rows: JobRows, values: list[dict[str, Any]], connection: Any) -> None:
    """Insert new rows; a key's next generation replaces its cancelled row (one row per job id)."""
    fresh = [v for v in values if not v["generation"]]
    rows.insert(fresh, connection)
    for v in values:
        if v["generation"] and not rows.replace_cancelled(v, connection):
            raise _Raced(v["id"])


def _write_in(connection: Any, rows: JobRows, values: list[dict[str, Any]], after_commit: Callable[[], Any]) -> None:
    """Write the rows in the caller's transaction and index them after it commits."""
    from sqlalchemy import Connection, event
    from sqlalchemy.orm import Session

    if not values:
        return
    if isinstance(connection, Session):
        _write(rows, values, connection)
        event.listen(connection, "after_commit", lambda session: _run_after_commit(after_commit), once=True)
        return
    if isinstance(connection, Connection):
        _write(rows, values, connection)  # the scheduler's outbox sweep indexes it once committed
        return
    if hasattr(connection, "vendor") and hasattr(connection, "cursor"):  # a Django connection
        rows.insert_django(values, connection)
        from django.db import transaction

        transaction.on_commit(lambda: _run_after_commit(after_commit), using=connection.alias)
        return
    raise ConfigurationError(
        f"connection= takes a SQLAlchemy Session or Connection, or a Django connection; got "
        f"{type(connection).__name__}")


def _run_after_commit(index: Callable[[], Any]) -> None:
    try:
        index()
    except DelayedError as exc:  # the row is committed: the sweep indexes it
        logger.warning("indexing committed jobs failed (%s): the scheduler's sweep indexes them", exc)
