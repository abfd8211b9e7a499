"""Embedded mode: ``celery worker --delayed`` runs the scheduler in the worker and stops it with the worker."""

from __future__ import annotations

import collections
import signal
import time

import pytest
from support import WorkerProcess, make_app, ran, wait_for
from support.delivery import pending, queue_keys, received, undelivered

from celery_delayed import apply_later_many

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(90)
@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_worker_with_delayed_flag_releases_and_runs_jobs(redis_url, uid, workers, rclient, pool):
    app = make_app(redis_url, uid)
    prefix, queue = app.conf.delayed_key_prefix, app.conf.task_default_queue
    w = WorkerProcess(redis_url, prefix, queue, concurrency=2, pool=pool, extra=["--delayed"])
    workers.append(w)
    w.wait_ready()
    members = f"{prefix}:schedulers"
    wait_for(lambda: rclient.zcard(members) == 1, 15, what="the embedded scheduler to join")
    calls = [{"args": (i,), "when": 1.0 * i / 100} for i in range(100)]
    # A plain task: a job released twice would run (and be logged as received) twice.
    ids = [h.id for h in apply_later_many(app, "e2e.plain", calls, strict=False)]
    wait_for(lambda: set(ran(rclient, prefix)) >= set(ids), 30, interval=0.05, what="100 runs")

    t0 = time.monotonic()
    w.proc.send_signal(signal.SIGTERM)  # warm shutdown of the worker's main process
    w.proc.wait(20)
    took = time.monotonic() - t0
    print(f"\nembedded ({pool}): worker and its scheduler stopped in {took * 1000:.0f} ms")
    assert rclient.zcard(members) == 0, "the embedded scheduler did not leave"
    assert "celery-delayed scheduler" in w.output() and "stopped" in w.output(), w.output()[-3000:]
    assert took < 10
    # Counted once the worker has stopped: nothing left to release or to deliver, so a late
    # duplicate cannot arrive after the count.
    assert pending(app) == 0
    assert undelivered(rclient, ids, queue_keys(queue)) == []
    counts = collections.Counter(ran(rclient, prefix))
    assert set(counts) == set(ids) and max(counts.values()) == 1
    deliveries = received(w.output(), "e2e.plain")
    assert set(deliveries) == set(ids) and max(deliveries.values()) == 1


@pytest.mark.timeout(60)
def test_worker_without_flag_runs_no_scheduler(redis_url, uid, workers, rclient):
    app = make_app(redis_url, uid)
    prefix, queue = app.conf.delayed_key_prefix, app.conf.task_default_queue
    w = WorkerProcess(redis_url, prefix, queue, concurrency=1, pool="solo")
    workers.append(w)
    w.wait_ready()
    time.sleep(0.5)
    assert rclient.zcard(f"{prefix}:schedulers") == 0
