"""Look-ahead release (``delayed_lookahead_ms``): a job goes to its queue shortly before it is due,
with Celery's ``eta`` set to its due time, so the worker holds it and runs it on time, never early;
a cancel after the early release still wins (the execution record checks at start)."""

from __future__ import annotations

import json
from datetime import datetime

import pytest
from support import SchedulerProcess, WorkerProcess, make_app, wait_for

from celery_delayed import apply_later, apply_later_many, get_store

pytestmark = pytest.mark.e2e


def _runs(rclient, prefix):  # type: ignore[no-untyped-def]
    """task id -> time it started (worker clock, epoch s)."""
    out = {}
    for entry in rclient.lrange(f"{prefix}:ran", 0, -1):
        jid, _pid, _retries, at = str(entry).split("|")
        out[jid] = float(at)
    return out


@pytest.mark.timeout(60)
def test_store_releases_within_the_window_with_the_eta_set(redis_url, uid, rclient):
    app = make_app(redis_url, uid, delayed_shards=1)
    store = get_store(app)
    queue = app.conf.task_default_queue
    due_now = apply_later(app, "e2e.plain", when=0, strict=False)
    soon = apply_later(app, "e2e.plain", when=0.8, strict=False)
    later = apply_later(app, "e2e.plain", when=30, strict=False)
    batch = store.release.release_due(0, now_ms=store.redis.now_ms(), lookahead_ms=1000)
    assert batch.ids == [due_now.id, soon.id]  # the one due in 30 s stays
    assert batch.next_due_ms == later.due_ms
    messages = {json.loads(m)["headers"]["id"]: json.loads(m) for m in rclient.lrange(queue, 0, -1)}
    assert messages[due_now.id]["headers"]["eta"] is None  # due already: runs at once
    # held by the worker until due by the Redis clock; the task sees delayed_eta (Celery's own string)
    assert datetime.fromisoformat(messages[soon.id]["headers"]["eta"]).timestamp() * 1000 == soon.due_ms
    assert messages[soon.id]["headers"]["delayed_eta"] is not None
    rec = store.lookup.get(soon.id, soon.shard)
    assert rec["st"] == "QUEUED" and int(rec["released"]) < soon.due_ms
    # The lateness histogram counts an early release as on time, not as negative lateness.
    stats = rclient.hgetall(store.keys.shard(0).stats)
    assert int(stats.get("released", 0)) == 2


@pytest.mark.timeout(90)
def test_released_early_runs_on_time_never_early_and_a_cancel_still_wins(redis_url, uid, rclient, workers):
    app = make_app(redis_url, uid)
    prefix, queue = app.conf.delayed_key_prefix, app.conf.task_default_queue
    conf = {"delayed_lookahead_ms": 1500}
    w = WorkerProcess(redis_url, prefix, queue, concurrency=2, conf=conf)
    s = SchedulerProcess(redis_url, prefix, queue, conf=conf)
    workers += [w, s]
    wait_for(lambda: "ready." in w.output(), 30, what="the worker")
    wait_for(lambda: rclient.zcard(f"{prefix}:schedulers") > 0, 30, what="the scheduler to join")
    jobs = apply_later_many(app, "e2e.mark", [{"args": (i,), "when": 3.0} for i in range(20)], strict=False)
    victim = apply_later(app, "e2e.mark", args=("victim",), when=3.5, strict=False)
    store = get_store(app)
    # Released about 1.5 s before its due time, it is QUEUED (in a worker's hands) before it is due.
    wait_for(lambda: victim.job_state == "QUEUED", 10, what="the early release")
    assert store.redis.now_ms() < victim.due_ms
    assert victim.cancel()
    wait_for(lambda: len(_runs(rclient, prefix)) >= len(jobs), 20, what="the jobs to run")
    # A job marks its run in its body; its record says SUCCEEDED once the task has returned.
    wait_for(lambda: all(store.lookup.get(h.id, h.shard)["st"] == "SUCCEEDED" for h in jobs), 10,
             what="every job's record to say SUCCEEDED")
    runs = _runs(rclient, prefix)
    for h in jobs:
        rec = store.lookup.get(h.id, h.shard)
        assert int(rec["released"]) <= h.due_ms - 500, "not released ahead of its due time"
        # Never early (worker and Redis share this machine's clock; 5 ms for rounding).
        assert runs[h.id] * 1000 >= h.due_ms - 5, (runs[h.id] * 1000 - h.due_ms)
        assert runs[h.id] * 1000 - h.due_ms < 1500, "held past its due time"
    wait_for(lambda: "Discarding cancelled job" in w.output(), 10, what="the cancelled one skipped")
    assert victim.id not in runs


@pytest.mark.timeout(120)
def test_a_burst_held_by_a_solo_worker_starts_promptly(redis_url, uid, rclient, workers):
    """300 jobs released ahead of one due instant, held by a ``-P solo`` worker: kombu's loop alone would
    fire ten held messages per second once the worker has nothing else to read (fixups/prompt_timers.py)."""
    app = make_app(redis_url, uid)
    prefix, queue = app.conf.delayed_key_prefix, app.conf.task_default_queue
    conf = {"delayed_lookahead_ms": 3000}
    w = WorkerProcess(redis_url, prefix, queue, concurrency=1, pool="solo", conf=conf)
    s = SchedulerProcess(redis_url, prefix, queue, conf=conf)
    workers += [w, s]
    wait_for(lambda: "ready." in w.output(), 30, what="the worker")
    wait_for(lambda: rclient.zcard(f"{prefix}:schedulers") > 0, 30, what="the scheduler to join")
    n = 300
    jobs = apply_later_many(app, "e2e.mark", [{"args": (i,), "when": 4.0} for i in range(n)], strict=False)
    due_s = max(h.due_ms for h in jobs) / 1000
    wait_for(lambda: len(_runs(rclient, prefix)) >= n, 60, what="the burst to run")
    runs = _runs(rclient, prefix)
    last = max(runs[h.id] for h in jobs) - due_s
    # Unpatched: ~10 per second, the last one ~30 s late. Patched: the solo pool's own pace.
    assert last < 8.0, f"the last of {n} started {last:.1f} s after the due time"


@pytest.mark.timeout(90)
def test_a_held_eta_request_is_freed_when_its_task_is_done(redis_url, uid, rclient, workers):
    """Celery 5.7 keeps each ETA request's timer entry on the request, and the entry holds the request:
    without fixups/eta_cycle.py every held message (Celery's own ETA tasks and jobs released ahead of
    their due time alike) stays in memory until a full garbage collection, whose pause delays every
    timer due meanwhile (55-76 ms with 3,000 held, bench scenario 16). With it, reference counting
    frees each one when its task is done: checked with the cycle collector off in a solo worker."""
    app = make_app(redis_url, uid)
    prefix, queue = app.conf.delayed_key_prefix, app.conf.task_default_queue
    conf = {"delayed_lookahead_ms": 3000, "e2e_gc_disabled": True}
    w = WorkerProcess(redis_url, prefix, queue, concurrency=1, pool="solo", conf=conf)
    s = SchedulerProcess(redis_url, prefix, queue, conf=conf)
    workers += [w, s]
    wait_for(lambda: "ready." in w.output(), 30, what="the worker")
    wait_for(lambda: rclient.zcard(f"{prefix}:schedulers") > 0, 30, what="the scheduler to join")
    plain = app.signature("e2e.plain")
    celery_eta = [plain.apply_async(args=(i,), countdown=1.5).id for i in range(20)]  # Celery's own ETA path
    released = [h.id for h in apply_later_many(app, "e2e.mark", [{"args": (i,), "when": 2.0} for i in range(20)],
                                               strict=False)]  # released ahead, held with their eta
    ids = celery_eta + released
    wait_for(lambda: set(_runs(rclient, prefix)) >= set(ids), 30, what="the held tasks to run")
    # kombu's timer keeps the entry it fired last (a local of its generator) until the next one fires
    after = plain.apply_async(args=(-1,), countdown=0.5).id
    wait_for(lambda: after in _runs(rclient, prefix), 30, what="a task after them")
    app.signature("e2e.live_requests").apply_async(args=(ids,))
    wait_for(lambda: rclient.llen(f"{prefix}:live") > 0, 30, what="the count of live requests")
    alive = int(rclient.lindex(f"{prefix}:live", 0))
    assert alive == 0, f"{alive} of {len(ids)} finished ETA requests are still in the worker's memory"
