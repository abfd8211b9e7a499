"""The relational source of truth: rows first, Redis as the index; the outbox; the schema version."""

from __future__ import annotations

import json
from typing import Any

import pytest
from sqlalchemy import create_engine, insert, select, text, update
from sqlalchemy.orm import Session
from support import RedisServer, free_port, make_app

from celery_delayed import ConfigurationError, DuplicateJob, apply_later, apply_later_many, get_store
from celery_delayed.errors import DatabaseUnavailable, JobNotFound
from celery_delayed.reconciler import Reconciler
from celery_delayed.sql.rows import get_rows
from celery_delayed.sql.schema import SCHEMA_VERSION, jobs, schema

TASK = "t.sql"


@pytest.fixture
def dapp(redis_url: str, uid: str, database_url: str) -> Any:
    app = make_app(redis_url, uid, delayed_database_url=database_url)
    rows = get_rows(app)
    assert rows is not None
    rows.init_schema()
    yield app
    rows.dispose()


def row(app: Any, job_id: str) -> Any:
    rows = get_rows(app)
    assert rows is not None
    return rows.get(job_id)


def test_db_init_is_idempotent_and_the_version_is_checked(redis_url: str, uid: str, database_url: str) -> None:
    app = make_app(redis_url, uid, delayed_database_url=database_url)
    rows = get_rows(app)
    assert rows is not None
    with pytest.raises(ConfigurationError, match="run `celery -A <app> delayed db init`"):
        apply_later(app, TASK, when=60, strict=False)  # no tables yet: nothing written anywhere
    assert not list(get_store(app).redis.client.scan_iter(f"t{uid}:*"))
    assert rows.init_schema() == SCHEMA_VERSION
    assert rows.init_schema() == SCHEMA_VERSION  # again: nothing changes
    engine = create_engine(database_url)
    with engine.begin() as conn:
        conn.execute(update(schema).values(version=SCHEMA_VERSION + 1))
    fresh = make_app(redis_url, uid, delayed_database_url=database_url)
    with pytest.raises(ConfigurationError, match="newer than this celery-delayed"):
        apply_later(fresh, TASK, when=60, strict=False)
    with engine.begin() as conn:
        conn.execute(update(schema).values(version=0))
    older = make_app(redis_url, uid, delayed_database_url=database_url)
    with pytest.raises(ConfigurationError, match="to upgrade it"):
        apply_later(older, TASK, when=60, strict=False)
    engine.dispose()


def test_a_job_is_a_row_first_then_indexed(dapp: Any) -> None:
    h = apply_later(dapp, TASK, args=(1, "ü"), when=60, strict=False, idempotency_key="order-1")
    assert h.indexed is True and h.job_state == "SCHEDULED"
    r = row(dapp, h.id)
    assert (r.state, r.shard, r.task, r.due_ms, r.idempotency_key, r.generation) == (
        "SCHEDULED", h.shard, TASK, h.due_ms if abs(r.due_ms - h.due_ms) > 50 else r.due_ms, "order-1", 0)
    assert abs(r.due_ms - h.due_ms) < 1000  # the row's due from this host's clock, the record's from Redis's
    env = json.loads(r.record["msg"])  # the row holds everything to rebuild the job
    assert env["headers"]["id"] == h.id and r.record["q"] == dapp.conf.task_default_queue
    again = apply_later(dapp, TASK, args=(2,), when=5, strict=False, idempotency_key="order-1")
    assert (again.id, again.created) == (h.id, False)
    with pytest.raises(DuplicateJob):
        apply_later(dapp, TASK, when=60, task_id=h.id, strict=False)
    hs = apply_later_many(dapp, TASK, [{"args": (i,), "when": 60} for i in range(50)], strict=False)
    rows = get_rows(dapp)
    assert rows is not None and len(rows.existing([x.id for x in hs])) == 50


def test_an_idempotency_key_is_unique_in_the_database_across_a_redis_loss(uid: str, database_url: str) -> None:
    with RedisServer() as server:
        app = make_app(server.url, uid, delayed_database_url=database_url)
        rows = get_rows(app)
        assert rows is not None
        rows.init_schema()
        first = apply_later(app, TASK, when=60, strict=False, idempotency_key="pay-7")
        get_store(app).redis.client.flushall()  # a private server: Redis lost everything
        again = apply_later(app, TASK, when=60, strict=False, idempotency_key="pay-7")
        assert (again.id, again.created) == (first.id, False)  # the row remembers the key
        report = Reconciler(app).run_pass()
        assert report.reindexed == 1 and get_store(app).lookup.get(first.id)["st"] == "SCHEDULED"
        assert first.cancel()
        third = apply_later(app, TASK, when=60, strict=False, idempotency_key="pay-7")
        assert third.created and row(app, third.id).generation == 1  # a cancel freed the key
        rows.dispose()


def test_redis_down_scheduling_still_succeeds_and_is_indexed_later(uid: str, database_url: str) -> None:
    port = free_port()
    app = make_app(f"redis://127.0.0.1:{port}/0", uid, delayed_database_url=database_url)
    rows = get_rows(app)
    assert rows is not None
    rows.init_schema()
    get_store(app)._layout_ok = True  # the layout check needs Redis; the test is about the write
    h = apply_later(app, TASK, when=0, strict=False)
    assert h.indexed is False and row(app, h.id).state == "SCHEDULED"  # the row is the job
    with RedisServer(port=port) as _server:
        assert h.indexed is False  # Redis is back, the job is not indexed yet
        Reconciler(app).sweep_outbox(0)
        assert get_store(app).lookup.get(h.id)["st"] == "SCHEDULED" and h.indexed is True
    rows.dispose()


def test_database_down_is_a_clear_error_and_writes_nothing(redis_url: str, uid: str, rclient: Any) -> None:
    url = f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/nothere"
    app = make_app(redis_url, uid, delayed_database_url=url)
    with pytest.raises(DatabaseUnavailable, match="cannot use the celery-delayed database") as info:
        apply_later(app, TASK, when=60, strict=False)
    assert "nothing was written" in str(info.value)
    assert not list(rclient.scan_iter(f"t{uid}:*:job:*"))


def test_session_outbox_commit_indexes_rollback_leaves_nothing(dapp: Any, database_url: str) -> None:
    engine = create_engine(database_url)
    store = get_store(dapp)
    with Session(engine) as session:
        session.execute(text("SELECT 1"))
        h = apply_later(dapp, TASK, when=60, strict=False, connection=session)
        assert store.lookup.record_states(h.shard, [h.id])[h.id] is None  # not before the commit
        # before the commit the handle names a job that does not exist yet: it says so (it was None, then
        # stayed None after the commit; job_state raised a bare JobNotFound)
        assert h.indexed is False and h.created
        with pytest.raises(JobNotFound, match="a row of the caller's transaction, indexed once that commits"):
            h.job_state  # noqa: B018
        session.commit()
    assert store.lookup.get(h.id)["st"] == "SCHEDULED" and row(dapp, h.id).state == "SCHEDULED"
    assert h.indexed is True and h.job_state == "SCHEDULED"
    with Session(engine) as session:
        gone = apply_later(dapp, TASK, when=60, strict=False, connection=session)
        session.rollback()
    assert store.lookup.record_states(gone.shard, [gone.id])[gone.id] is None and row(dapp, gone.id) is None
    Reconciler(dapp).sweep_outbox(0)
    assert store.lookup.record_states(gone.shard, [gone.id])[gone.id] is None  # the job never existed
    assert gone.indexed is False
    engine.dispose()


def test_core_connection_outbox_is_indexed_by_the_sweep(dapp: Any, database_url: str) -> None:
    engine = create_engine(database_url)
    store = get_store(dapp)
    with engine.connect() as conn:
        h = apply_later(dapp, TASK, when=60, strict=False, connection=conn)
        assert h.indexed is False
        conn.commit()
    assert h.indexed is False  # committed: the sweep indexes it (a Core Connection has no after-commit hook)
    with engine.connect() as conn:
        lost = apply_later(dapp, TASK, when=60, strict=False, connection=conn)
        conn.rollback()
    assert Reconciler(dapp).sweep_outbox(0) > 0
    assert store.lookup.get(h.id)["st"] == "SCHEDULED" and h.indexed is True
    assert store.lookup.record_states(lost.shard, [lost.id])[lost.id] is None and row(dapp, lost.id) is None
    engine.dispose()


def test_the_mirror_carries_state_changes_to_the_rows(dapp: Any) -> None:
    from celery_delayed.scheduler.mirror import Mirror

    store = get_store(dapp)
    rows = get_rows(dapp)
    assert rows is not None
    a = apply_later(dapp, TASK, when=0, strict=False)
    b = apply_later(dapp, TASK, when=0, strict=False)
    c = apply_later(dapp, TASK, when=60, strict=False)
    for s in {a.shard, b.shard}:
        store.release.release_due(s)
    assert store.executions.start(a.id, a.shard, "w").run
    store.executions.finish(a.id, a.shard, "w", "SUCCEEDED")
    assert c.cancel()
    pending, oldest = store.changes.lag(a.shard)
    assert pending >= 1 and oldest is not None
    # another store's rows (another prefix) in the same database, one with the same job id as a: untouched
    with rows.engine.begin() as conn:
        conn.execute(insert(jobs).values(**(rows.values(store_job(dapp), 0) | {"prefix": "other", "id": a.id})))
    mirror = Mirror(store, rows)
    mirror.apply(list(range(store.config.shards)))
    assert [row(dapp, x.id).state for x in (a, b, c)] == ["SUCCEEDED", "QUEUED", "CANCELLED"]
    done = row(dapp, a.id)
    assert done.attempts == 1 and done.finished_ms is not None and done.finished_ms >= done.created_ms - 1000
    assert all(store.changes.lag(s)[0] == 0 for s in range(store.config.shards))
    with rows.engine.connect() as conn:
        other = conn.execute(select(jobs).where(jobs.c.prefix == "other")).one()
    assert (other.id, other.state, other.attempts, other.finished_ms) == (a.id, "SCHEDULED", 0, None)


def store_job(app: Any) -> Any:
    from celery_delayed.producer.prepare import prepare

    return prepare(app, get_store(app), TASK, when=60).job


@pytest.mark.timeout(120)
def test_a_pass_gives_the_planner_statistics_after_a_bulk_load(dapp: Any, database_url: str) -> None:
    """PostgreSQL without statistics (autovacuum off, or behind a bulk load) planned the reconciler's id
    lookups as a scan of every row of the prefix (1 s per batch of 500 at 1,000,000 rows): a pass first
    ANALYZEs a jobs table never analyzed, or changed by more than a fifth since."""
    rows = get_rows(dapp)
    assert rows is not None
    apply_later_many(dapp, TASK, [{"args": (i,), "when": 3600} for i in range(3000)], strict=False)
    if not database_url.startswith("postgresql"):
        assert rows.refresh_statistics() is False  # SQLite plans these lookups on its primary key anyway
    else:
        engine = create_engine(database_url)
        try:
            with engine.connect() as conn:
                before = conn.execute(text("SELECT last_analyze FROM pg_stat_user_tables "
                                           "WHERE relname = 'delayed_jobs'")).scalar()
            assert before is None
            assert rows.refresh_statistics() is True
            with engine.connect() as conn:
                after = conn.execute(text("SELECT last_analyze FROM pg_stat_user_tables "
                                          "WHERE relname = 'delayed_jobs'")).scalar()
            assert after is not None
            assert rows.refresh_statistics() is False  # fresh: not again
        finally:
            engine.dispose()
    report = Reconciler(dapp, dry_run=True).run_pass()
    assert report.scanned_rows == 3000 and report.reindexed == 0


def test_the_reconciler_adopts_drops_and_reports_drift(dapp: Any, redis_url: str, uid: str) -> None:
    """Redis jobs without a row: adopted (a row written from the record) once older than the grace period, or
    dropped when the outbox flagged them (indexed at a Core Connection's commit that never completed); a row
    whose state differs from Redis's is counted as drift and left to the mirror."""
    import dataclasses

    from celery_delayed.reconciler import GRACE_MS
    from celery_delayed.vocab import Field

    store = get_store(dapp)
    rows = get_rows(dapp)
    assert rows is not None
    plain = make_app(redis_url, uid)  # the same store without the database: its jobs have no row
    lone = apply_later(plain, TASK, args=(7, "ü"), when=3600, strict=False, idempotency_key="lone-1")
    flagged = dataclasses.replace(store_job(dapp), fields={**store_job(dapp).fields, Field.OUTBOX: "1"})
    flagged = dataclasses.replace(flagged, id=f"flagged-{uid}", shard=store.layout.shard_of(f"flagged-{uid}"))
    store.jobs.schedule([flagged])
    drifted = apply_later(dapp, TASK, when=0, strict=False)
    assert store.release.release_due(drifted.shard).count == 1  # QUEUED in Redis; the row says SCHEDULED
    now = store.redis.now_ms()

    young = Reconciler(dapp).run_pass(now_ms=now)  # within the grace period: their rows may be on their way
    assert (young.adopted, young.dropped, young.drift, young.reindexed) == (0, 0, 1, 0), young
    assert rows.get(lone.id) is None and store.lookup.get(flagged.id)["st"] == "SCHEDULED"

    dry = Reconciler(dapp, dry_run=True).run_pass(now_ms=now + GRACE_MS + 1_000)
    assert (dry.adopted, dry.dropped) == (1, 1) and rows.get(lone.id) is None  # said, not done

    report = Reconciler(dapp).run_pass(now_ms=now + GRACE_MS + 1_000)
    assert (report.adopted, report.dropped, report.drift, report.reindexed) == (1, 1, 1, 0), report
    assert {f"adopted: {lone.id}", f"dropped (never committed): {flagged.id}"} <= set(report.details)
    adopted = rows.get(lone.id)
    assert adopted is not None
    assert (adopted.state, adopted.shard, adopted.task, adopted.idempotency_key) == (
        "SCHEDULED", lone.shard, TASK, "lone-1")
    assert adopted.due_ms == int(float(store.lookup.get(lone.id)["due"]))
    assert json.loads(adopted.record["msg"])["headers"]["id"] == lone.id  # the row rebuilds the job alone
    assert store.lookup.get(flagged.id)["st"] == "CANCELLED"  # out of the schedule: it is never released
    assert flagged.id not in {j for ids in store.lookup.scheduled_pages(flagged.shard) for j in ids}
    assert rows.get(flagged.id) is None
    assert rows.get(drifted.id).state == "SCHEDULED"  # drift is reported; the mirror carries the change

    again = Reconciler(dapp).run_pass(now_ms=now + GRACE_MS + 2_000)
    assert (again.adopted, again.dropped) == (0, 0)  # once
