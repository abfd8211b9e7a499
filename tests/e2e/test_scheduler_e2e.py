"""End to end: apply_later -> scheduler subprocesses -> real celery workers.

Exactly-once enqueue (the direct path) is counted where it is promised: the
messages on the queue, with no worker consuming them, each job id once; then
a worker runs them with a plain task (``e2e.plain``, no execution record that could
hide a duplicate) and logs one delivery per job.
"""

from __future__ import annotations

import collections

import pytest
from support import SchedulerProcess, WorkerProcess, make_app, ran, wait_for
from support.delivery import pending, queue_keys, queued_ids, received, record_fields, undelivered

from celery_delayed import apply_later_many, get_store
from celery_delayed.store import ShardStatus

pytestmark = pytest.mark.e2e

TASK = "e2e.plain"


def _schedule(app, n: int, spread_s: float) -> list[str]:
    calls = [{"args": (i,), "when": spread_s * i / n} for i in range(n)]
    return [h.id for h in apply_later_many(app, TASK, calls, strict=False)]


def _ran_once_and_nothing_left(app, client, worker: WorkerProcess, ids: list[str]) -> None:
    """Stop the worker (it gives back what it held), then nothing is left to deliver, and
    every job was delivered once and ran once."""
    worker.stop()
    assert pending(app) == 0, "jobs still scheduled or in flight"
    assert undelivered(client, ids, queue_keys(app.conf.task_default_queue)) == []
    counts = collections.Counter(ran(client, app.conf.delayed_key_prefix))
    assert set(counts) == set(ids) and max(counts.values()) == 1, "a job ran twice"
    deliveries = received(worker.output(), TASK)
    assert set(deliveries) == set(ids) and max(deliveries.values()) == 1, "a job was delivered twice"


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
    _ran_once_and_nothing_left(app, rclient, w, ids)
    counts = collections.Counter(ran(rclient, prefix))
    assert set(counts) == set(ids)
    assert max(counts.values()) == 1
    assert sum(r["pending"] for r in ShardStatus(get_store(app)).rows()) == 0


@pytest.mark.timeout(240)
@pytest.mark.parametrize("n_schedulers", [2, 4])
def test_racing_schedulers_release_each_job_once(redis_url, uid, workers, rclient, n_schedulers):
    """Several schedulers over one store, 10,000 jobs, no worker: every job's message is on the
    queue exactly once when nothing is left to release; then a worker runs each once."""
    app = make_app(redis_url, uid, delayed_lease_ms=2000)
    prefix, queue = app.conf.delayed_key_prefix, app.conf.task_default_queue
    n = 10_000
    ids = _schedule(app, n, 3.0)
    for _ in range(n_schedulers):
        workers.append(SchedulerProcess(redis_url, prefix, queue, conf={"delayed_lease_ms": 2000}))
    wait_for(lambda: pending(app) == 0, 120, interval=0.2, what=f"{n} jobs to be released")
    # Nothing is scheduled any more, so nothing more can be pushed: the count is final.
    on_queue = queued_ids(rclient, queue_keys(queue))
    assert sum(on_queue.values()) == n and set(on_queue) == set(ids), "jobs lost or pushed to another list"
    twice = [k for k, v in on_queue.items() if v > 1]
    assert not twice, f"{len(twice)} jobs enqueued more than once"
    states = collections.Counter(st for (st,) in record_fields(app, ids, "st").values())
    assert states == {"QUEUED": n}
    members = rclient.zrange(app.conf.delayed_key_prefix + ":schedulers", 0, -1)
    assert len(members) == n_schedulers

    w = WorkerProcess(redis_url, prefix, queue, concurrency=4, pool="threads")
    workers.append(w)
    wait_for(lambda: rclient.llen(f"{prefix}:ran") >= n, 180, interval=0.2, what=f"{n} runs")
    _ran_once_and_nothing_left(app, rclient, w, ids)
    counts = collections.Counter(ran(rclient, prefix))
    assert len(counts) == n and set(counts) == set(ids), "jobs lost"
    dup = {k: v for k, v in counts.items() if v > 1}
    assert not dup, f"{len(dup)} jobs ran more than once"
