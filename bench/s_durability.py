"""Scenario 12: what the relational source of truth costs, and what the reconciler and the mirror cost.

1. ``apply_later`` with ``delayed_database_url`` (PostgreSQL) vs Redis only,
   one call at a time and in bulk (``apply_later_many``): jobs/s and ratio,
   the two taking turns in one run.
2. One reconciler pass over a store of N pending jobs (every one a row and
   indexed: the pass reads every row and checks its record), N = 100,000
   and 1,000,000 (10,000 and 50,000 with ``--quick``).
3. The mirror under a release burst: jobs due at one instant released at
   once, then the change log applied to the rows: entries, the oldest
   entry's age when the applier starts, and the time to catch up.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from celery_delayed import apply_later, apply_later_many, get_store
from celery_delayed.reconciler import Reconciler
from celery_delayed.scheduler.mirror import Mirror
from celery_delayed.sql.rows import get_rows

from .celery_app import make_app
from .common import Ctx, delete_prefix, uid

S14 = "14 durability: the database, the reconciler, the mirror"
PG_ADMIN = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"


@contextmanager
def _database() -> Iterator[str]:
    from sqlalchemy import create_engine, text

    name = f"bench_{uuid.uuid4().hex[:10]}"
    admin = create_engine(PG_ADMIN, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def durability(ctx: Ctx) -> None:
    try:
        import sqlalchemy  # noqa: F401
    except ImportError:
        ctx.notes.append("scenario 14 skipped: SQLAlchemy is not installed (pip install -e '.[sql]')")
        return
    try:
        with _database() as url:
            _costs(ctx, url)
            for n in (ctx.size(100_000, 10_000), ctx.size(1_000_000, 50_000)):
                _reconcile(ctx, url, n)
            _mirror(ctx, url)
    except Exception as exc:
        if "connect" in str(exc).lower():
            ctx.notes.append(f"scenario 14 skipped: PostgreSQL not reachable at 127.0.0.1:5432 ({exc})"[:300])
            return
        raise


def _apps(ctx: Ctx, url: str) -> tuple[Any, Any]:
    u = uid()
    plain = make_app(ctx.redis_url, f"d12r{u}", f"q12{u}")
    sql = make_app(ctx.redis_url, f"d12s{u}", f"q12{u}", delayed_database_url=url)
    rows = get_rows(sql)
    assert rows is not None
    rows.init_schema()
    return plain, sql


def _costs(ctx: Ctx, url: str) -> None:
    n = ctx.size(10_000, 1_000)
    plain, sql = _apps(ctx, url)
    print(f"[{S14}] apply_later with and without the database: {n} calls each, then bulk", flush=True)
    for app in (plain, sql):  # warm up (connections, scripts, templates)
        for _ in range(50):
            apply_later(app, "bench.late_d", (0.0,), None, 3600)
    spent = {"Redis only": 0.0, "PostgreSQL + Redis": 0.0}
    rounds = 5
    for _ in range(rounds):
        for name, app in (("Redis only", plain), ("PostgreSQL + Redis", sql)):
            t0 = time.perf_counter()
            for _ in range(n // rounds):
                apply_later(app, "bench.late_d", (0.0,), None, 3600)
            spent[name] += time.perf_counter() - t0
    for name, s in spent.items():
        ctx.add(S14, name, "apply_later, one call at a time", n / s, "jobs/s", note=f"{rounds} interleaved rounds")
    ctx.relate(S14, "apply_later, one call at a time", "Redis only")
    bulk = ctx.size(100_000, 10_000)
    for name, app in (("Redis only", plain), ("PostgreSQL + Redis", sql)):
        t0 = time.perf_counter()
        for lo in range(0, bulk, 10_000):
            apply_later_many(app, "bench.late_d", [{"args": (0.0,), "when": 3600}] * min(10_000, bulk - lo))
        ctx.add(S14, name, "apply_later_many", bulk / (time.perf_counter() - t0), "jobs/s",
                note=f"{bulk} jobs in batches of 10,000")
    ctx.relate(S14, "apply_later_many", "Redis only")


def _reconcile(ctx: Ctx, url: str, n: int) -> None:
    _, sql = _apps(ctx, url)
    print(f"[{S14}] a reconciler pass over {n:,} pending jobs (rows and records)", flush=True)
    t0 = time.perf_counter()
    for lo in range(0, n, 10_000):
        apply_later_many(sql, "bench.late_d", [{"args": (0.0,), "when": 86_400}] * min(10_000, n - lo))
    fill = time.perf_counter() - t0
    ctx.add(S14, "PostgreSQL + Redis", f"fill {n:,} jobs", n / fill, "jobs/s")
    t0 = time.perf_counter()
    report = Reconciler(sql, dry_run=True).run_pass()
    spent = time.perf_counter() - t0
    ctx.add(S14, "reconciler", f"one pass over {n:,} jobs", spent, "s",
            note=f"{report.scanned_rows:,} rows and {report.scanned_jobs:,} Redis jobs checked, "
                 f"{n / spent:,.0f} jobs/s, found {report.reindexed} to index and {report.adopted} to adopt")
    _drop(sql)


def _mirror(ctx: Ctx, url: str) -> None:
    n = ctx.size(20_000, 2_000)
    _, sql = _apps(ctx, url)
    store = get_store(sql)
    rows = get_rows(sql)
    assert rows is not None
    print(f"[{S14}] the mirror under a release burst of {n:,} jobs", flush=True)
    apply_later_many(sql, "bench.late_d", [{"args": (0.0,), "when": 0}] * n)
    t_release = time.perf_counter()
    for s in range(store.config.shards):
        while store.release.release_due(s).count:
            pass
    released = time.perf_counter() - t_release
    t0 = time.perf_counter()
    entries = Mirror(store, rows).apply(list(range(store.config.shards)))
    caught_up = time.perf_counter() - t0
    queued = rows.counts().get("QUEUED", 0)
    ctx.add(S14, "mirror", f"apply a burst of {n:,} releases", caught_up, "s",
            note=f"{entries} log entries; release took {released:.2f}s; {queued:,} rows QUEUED after; "
                 f"lag at most release time + this (the scheduler applies every second)")
    _drop(sql)


def _drop(app: Any) -> None:
    client = get_store(app).redis.client
    delete_prefix(client, f"{app.conf.delayed_key_prefix}:*")
    client.delete(app.conf.task_default_queue)
