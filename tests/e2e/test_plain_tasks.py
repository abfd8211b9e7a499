"""A plain task (not a DelayedTask) released from the store is tracked too (CONTRACTS rule 5).

Its start and finish are recorded in the store, a cancel after release skips
it, a copy of a completed one is dropped, and the reconciler never sends a
started job again. The same task sent with plain apply_async is untouched.
"""

from __future__ import annotations

import pytest
from support import WorkerProcess, make_app, ran, wait_for

from celery_delayed import apply_later, get_store
from celery_delayed.reconciler import Reconciler

pytestmark = pytest.mark.e2e


def _release_all(app) -> int:  # type: ignore[no-untyped-def]
    store = get_store(app)
    return sum(store.release.release_due(s).count for s in range(store.config.shards))


@pytest.mark.timeout(90)
def test_a_plain_task_from_the_store_is_tracked(redis_url, uid, rclient, workers):
    app = make_app(redis_url, uid)
    prefix, queue = app.conf.delayed_key_prefix, app.conf.task_default_queue
    runs = apply_later(app, "e2e.plain", args=(1,), when=0, strict=False)
    cancelled = apply_later(app, "e2e.plain", args=(2,), when=0, strict=False)
    assert _release_all(app) == 2
    assert cancelled.cancel()  # after release: the worker must skip it
    copy_of = get_store(app).lookup.message(runs.id, runs.shard)
    plain = app.send_task("e2e.plain", args=(3,), queue=queue)  # not from the store: runs as ever
    w = WorkerProcess(redis_url, prefix, queue, concurrency=2)
    workers.append(w)
    wait_for(lambda: runs.job_state == "SUCCEEDED", 30, what="the plain task to run under the execution record")
    wait_for(lambda: plain.id in ran(rclient, prefix), 30, what="the apply_async task")
    wait_for(lambda: "Discarding cancelled job e2e.plain" in w.output(), 20, what="the cancelled one skipped")
    rec = runs.job()
    assert rec["att"] == "1" and rec["wk"] == w.name and "started" in rec and "finished" in rec
    rclient.lpush(queue, copy_of)  # a redelivered copy of the completed job
    wait_for(lambda: "completed already" in w.output(), 20, what="the copy to be dropped")
    assert sorted(ran(rclient, prefix)) == sorted([runs.id, plain.id])
    report = Reconciler(app).run_pass(now_ms=get_store(app).redis.now_ms() + 3_600_000)
    assert report.rereleased == 0  # it started: never a candidate
