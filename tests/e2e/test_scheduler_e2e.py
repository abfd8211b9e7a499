"""End to end: apply_later -> scheduler subprocesses -> real celery workers."""

from __future__ import annotations

import collections
import time

import pytest
from support import SchedulerProcess, WorkerProcess, make_app, ran, wait_for

from celery_delayed import apply_later_many, get_store
from celery_delayed.store import ShardStatus

pytestmark = pytest.mark.e2e


def _schedule(app, n: int, spread_s: float) -> list[str]:
    calls = [{"args": (i,), "when": spread_s * i / n} for i in range(n)]
    return [h.id for h in apply_later_many(app, "e2e.mark", calls, strict=False)]


@pytest.mark.timeout(120)
def test_one_scheduler_releases_everything_once(redis_url, uid, workers, rclient):
    app = make_app(redis_url, uid)
    prefix, queue = app.conf.delayed_key_prefix, app.conf.task_default_queue
    w = WorkerProcess(redis_url, prefix, queue, concurrency=2)
    workers.append(w)
    s = SchedulerProcess(redis_url, prefix, queue)
    workers.append(s)
    ids = _schedule(app, 300, 2.0)
    w.wait_ready()
    wait_for(lambda: len(ran(rclient, prefix)) >= 300, 60, what="300 runs")
    time.sleep(0.3)
    counts = collections.Counter(ran(rclient, prefix))
    assert set(counts) == set(ids)
    assert max(counts.values()) == 1
    assert sum(r["pending"] for r in ShardStatus(get_store(app)).rows()) == 0


@pytest.mark.timeout(240)
@pytest.mark.parametrize("n_schedulers", [2, 4])
def test_racing_schedulers_release_each_job_once(redis_url, uid, workers, rclient, n_schedulers):
    """Several schedulers over one store, 10,000 jobs: every job runs once, none twice, none lost."""
    app = make_app(redis_url, uid, delayed_lease_ms=2000)
    prefix, queue = app.conf.delayed_key_prefix, app.conf.task_default_queue
    n = 10_000
    ids = _schedule(app, n, 3.0)
    for _ in range(n_schedulers):
        workers.append(SchedulerProcess(redis_url, prefix, queue, conf={"delayed_lease_ms": 2000}))
    w = WorkerProcess(redis_url, prefix, queue, concurrency=4, pool="threads")
    workers.append(w)
    wait_for(lambda: rclient.llen(f"{prefix}:ran") >= n, 180, interval=0.2, what=f"{n} runs")
    time.sleep(0.5)
    counts = collections.Counter(ran(rclient, prefix))
    assert len(counts) == n and set(counts) == set(ids), "jobs lost"
    dup = {k: v for k, v in counts.items() if v > 1}
    assert not dup, f"{len(dup)} jobs ran more than once"
    members = rclient.zrange(app.conf.delayed_key_prefix + ":schedulers", 0, -1)
    assert len(members) == n_schedulers
