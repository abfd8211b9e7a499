"""Durability: what Redis or the broker lost runs late, once (issue 10's scenarios).

Each scenario uses a private redis-server (store and broker), real
``delayed run`` schedulers and real workers, and counts executions from the
run log that every task body appends to (the ground truth when Redis itself
loses data). With a database: a private PostgreSQL database.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
from harness import FaultRun
from support import WORKER_APPS, wait_for
from support.databases import postgres_database

from celery_delayed import apply_later_many, get_store
from celery_delayed.sql.rows import get_rows

pytestmark = pytest.mark.e2e
TASK = "fault.run"
FAST = {"delayed_reconcile_interval_s": 1.0, "delayed_requeue_after_s": 1.0, "delayed_shards": 8}


@pytest.fixture
def pg_url() -> Iterator[str]:
    with postgres_database() as url:
        yield url


def _init_db(run: FaultRun) -> Any:
    assert run.app is not None
    rows = get_rows(run.app)
    assert rows is not None
    rows.init_schema()
    return rows


def _release_without_workers(run: FaultRun) -> int:
    store = run.store()
    return sum(store.release.release_due(s).count for s in range(store.config.shards))


@pytest.mark.timeout(180)
def test_redis_wiped_every_job_runs_once_and_finished_ones_stay_finished(pg_url: str) -> None:
    with FaultRun(seed=10, conf=FAST | {"delayed_database_url": pg_url}) as run:
        rows = _init_db(run)
        done_before = run.schedule(50, 0, 0)
        sched, worker = run.scheduler(), run.worker()
        assert run.wait_executed(done_before, 60)
        wait_for(lambda: rows.counts().get("SUCCEEDED", 0) == 50, 30, what="the mirror to record the 50 runs")
        worker.stop()  # the scheduler goes on, with no worker: what it releases is not started
        released_before = run.schedule(100, 0, 0)  # due now: released, not started, and so recorded in the rows
        wait_for(lambda: rows.counts().get("QUEUED", 0) == 100, 30,
                 what="the scheduler to release the 100 jobs and the mirror to record them QUEUED")
        sched.stop()
        assert run.client().llen(run.queue) == 100  # their messages wait in the queue: the wipe loses them too
        pending = run.schedule(2000, 2, 4)
        run.client().flushall()  # a private server: Redis (store and broker) lost everything
        run.scheduler()
        run.wait_ready(run.worker())
        ids = released_before + pending
        assert run.wait_executed(ids, 90)
        time.sleep(2)  # a late copy would show up here
        out = run.outcome("redis wiped (SQL mode)", ids + done_before, faults=1)
        out.report()
        counts = run.counts()
        assert (out.lost, out.duplicated) == (0, 0), out.line()
        assert all(counts[i] == 1 for i in done_before)  # finished before the wipe: not run again


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["redis", "sql"])
def test_messages_the_broker_lost_run_once_after_requeue_after(mode: str, request: pytest.FixtureRequest) -> None:
    conf = dict(FAST)
    if mode == "sql":
        conf["delayed_database_url"] = request.getfixturevalue("pg_url")
    with FaultRun(seed=11, conf=conf) as run:
        if mode == "sql":
            _init_db(run)
        ids = run.schedule(300, 0, 0)
        assert _release_without_workers(run) == 300
        client = run.client()
        lost = client.llen(run.queue)
        client.delete(run.queue)  # kombu's loss, simulated: every released message is gone
        assert lost == 300
        run.scheduler()
        run.wait_ready(run.worker())
        assert run.wait_executed(ids, 60)
        time.sleep(2.5)  # more than requeue_after + a reconcile interval: a needless copy would run now
        out = run.outcome(f"broker lost the messages ({mode})", ids, faults=1)
        out.report()
        assert (out.lost, out.duplicated) == (0, 0), out.line()
        copies = [int(store_rec.get("rr", 0)) for store_rec in _records(run, ids[:50])]
        assert max(copies) <= 1  # one copy each: sent again once


def _records(run: FaultRun, ids: list[str]) -> list[dict[str, str]]:
    """The jobs' records: every one ran, so every one has a record (a read error fails the test)."""
    store = run.store()
    return [store.lookup.get(i) for i in ids]


KILL_AFTER_COMMIT = """
import os, signal, sys
import fault_app
from celery_delayed import apply_later_many
from celery_delayed.sql import outbox

def die(store, jobs):
    os.kill(os.getpid(), signal.SIGKILL)  # the rows are committed; Redis never hears of them

outbox._index = die
hs = apply_later_many(fault_app.app, "fault.run", [{"args": (i,), "when": 0} for i in range(20)], strict=False)
print("not reached")
"""


@pytest.mark.timeout(120)
def test_producer_killed_between_commit_and_redis_write(pg_url: str) -> None:
    with FaultRun(seed=12, conf=FAST | {"delayed_database_url": pg_url}) as run:
        rows = _init_db(run)
        proc = subprocess.run([sys.executable, "-c", KILL_AFTER_COMMIT], env=run.env(), cwd=str(WORKER_APPS),
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
        assert "not reached" not in proc.stdout
        ids = [r.id for r in rows.page(["SCHEDULED"], "", 1000)]
        assert len(ids) == 20
        store = run.store()
        assert all(store.lookup.record_states(s, [i])[i] is None for i in ids for s in [store.layout.shard_of(i)])
        run.scheduler()
        run.wait_ready(run.worker())
        assert run.wait_executed(ids, 60)
        time.sleep(1)
        out = run.outcome("producer killed after the commit", ids, faults=1)
        out.report()
        assert (out.lost, out.duplicated) == (0, 0), out.line()


@pytest.mark.timeout(120)
def test_redis_down_while_scheduling_with_a_database(pg_url: str) -> None:
    with FaultRun(seed=13, conf=FAST | {"delayed_database_url": pg_url}) as run:
        _init_db(run)
        assert run.app is not None
        get_store(run.app).layout.check()
        run.redis.stop("term")
        handles = apply_later_many(run.app, TASK, [{"args": (i,), "when": 0} for i in range(200)], strict=False)
        assert [h.indexed for h in handles] == [False] * 200  # the calls succeed: the rows are the jobs
        ids = [h.id for h in handles]
        run.redis.start()
        run.scheduler()
        run.wait_ready(run.worker())
        assert run.wait_executed(ids, 60)
        time.sleep(1)
        out = run.outcome("Redis down while scheduling (SQL mode)", ids, faults=1)
        out.report()
        assert (out.lost, out.duplicated) == (0, 0), out.line()


def test_reconcile_command_reports_and_fixes(pg_url: str) -> None:
    with FaultRun(seed=14, conf=FAST | {"delayed_database_url": pg_url}) as run:
        _init_db(run)
        ids = run.schedule(30, 60, 0)
        run.client().flushall()
        env = run.env()
        dry = subprocess.run([sys.executable, "-m", "celery", "-A", "fault_app", "delayed", "reconcile", "--dry-run"],
                             env=env, cwd=str(WORKER_APPS), capture_output=True, text=True, timeout=60)
        assert dry.returncode == 0, dry.stderr
        assert "indexed again 30 row(s)" in dry.stdout
        fix = subprocess.run([sys.executable, "-m", "celery", "-A", "fault_app", "delayed", "reconcile", "--json"],
                             env=env, cwd=str(WORKER_APPS), capture_output=True, text=True, timeout=60)
        assert fix.returncode == 0, fix.stderr
        assert json.loads(fix.stdout)["reindexed"] == 30
        store = run.store()
        assert {store.lookup.get(i)["st"] for i in ids} == {"SCHEDULED"}
