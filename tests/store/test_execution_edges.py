"""Edges of the worker-side execution record: a failing heartbeat, the publish path's late
ack, and record lifetimes while a job runs."""

from __future__ import annotations

import time

from redis.exceptions import ResponseError
from support import make_app, wait_for

from celery_delayed import apply_later, get_store
from celery_delayed.store import Store
from celery_delayed.store.executions import Executions
from celery_delayed.vocab import Reply
from celery_delayed.worker.execution import Execution, LeaseKeeper, _beater


class _FlakyExecutions(Executions):
    """A real store's executions whose first lease extension fails with a server error (e.g. MISCONF)."""

    failed = 0

    def extend_lease(self, job_id: str, shard: int, owner: str, delivery_tag: str = "",
                     now_ms: int | None = None) -> bool:
        if not self.failed:
            self.failed += 1
            raise ResponseError("MISCONF Redis is configured to save RDB snapshots, but it cannot")
        return super().extend_lease(job_id, shard, owner, delivery_tag, now_ms)


def test_heartbeat_survives_a_server_error(redis_url, uid):
    app = make_app(redis_url, uid, delayed_exec_lease_ms=600)
    store = Store(app)
    flaky = store.executions = _FlakyExecutions(store.redis, store.layout, store.lookup)
    h = apply_later(app, "e2e.mark", when=0, strict=False)
    store.release.release_due(h.shard)
    assert store.executions.start(h.id, h.shard, "me", "host").code == Reply.OK
    keeper = LeaseKeeper(store, Execution(h.id, h.shard, "me", 1)).start()
    key = store.keys.shard(h.shard).job(h.id)
    try:
        wait_for(lambda: flaky.failed == 1, 2, what="the failing beat")
        first = int(store.redis.client.hget(key, "lu"))
        # later beats still extend the lease: the one heartbeat thread lived on
        wait_for(lambda: int(store.redis.client.hget(key, "lu")) > first, 2, what="a later beat")
        time.sleep(0.7)  # longer than the lease: it must still be live
        assert int(store.redis.client.hget(key, "lu")) > store.redis.now_ms()
    finally:
        keeper.stop()


def test_late_ack_keeps_the_done_markers_ttl(redis_url, uid):
    """Publish path: a fast task finished before its claim was acknowledged."""
    app = make_app(redis_url, uid, delayed_release_mode="publish", delayed_record_ttl_s=3600,
                   delayed_idempotency_ttl_s=30 * 86400)
    store = get_store(app)
    h = apply_later(app, "e2e.mark", when=0, idempotency_key=f"k-{uid}", strict=False)
    assert store.release.claim_due(h.shard).ids == [h.id]
    assert store.executions.start(h.id, h.shard, "me", "host").code == Reply.OK
    assert store.executions.finish(h.id, h.shard, "me", "SUCCEEDED").code == Reply.OK
    key = store.keys.shard(h.shard).job(h.id)
    before = store.redis.client.pttl(key)
    assert before > 3600 * 1000
    assert store.release.ack_claimed(h.shard, [h.id]) == 1
    assert store.redis.client.hget(key, "st") == "SUCCEEDED"
    assert store.redis.client.pttl(key) > 3600 * 1000  # not cut to delayed_record_ttl_s
    assert not store.redis.client.zscore(store.keys.shard(h.shard).inflight, h.id)


def test_a_running_job_keeps_its_record_past_the_release_ttl(redis_url, uid):
    app = make_app(redis_url, uid, delayed_record_ttl_s=1)
    store = get_store(app)
    h = apply_later(app, "e2e.mark", when=0, strict=False)
    store.release.release_due(h.shard)
    key = store.keys.shard(h.shard).job(h.id)
    assert 0 < store.redis.client.pttl(key) <= 1000  # a released record nobody starts expires
    assert store.executions.start(h.id, h.shard, "me", "host").code == Reply.OK
    assert store.redis.client.pttl(key) == -1  # running: no TTL until finish sets one


def test_short_executions_do_not_wake_the_heartbeat_thread(redis_url, uid):
    """A keeper started and stopped within its first interval (a short task) is due after the
    idle heartbeat thread wakes by itself, so it does not wake it: no thread switch per task."""
    app = make_app(redis_url, uid, delayed_exec_lease_ms=1500)  # a beat every 500 ms
    store = get_store(app)
    beater = _beater()
    LeaseKeeper(store, Execution("warm-up", 0, "me", 1)).start().stop()  # may wake it once: it learns the interval
    time.sleep(0.8)  # longer than an interval: the thread is idle, asleep by itself
    wakes = []
    wake = beater.wake
    beater.wake = lambda: (wakes.append(1), wake())[-1]  # type: ignore[method-assign]
    try:
        for i in range(200):
            LeaseKeeper(store, Execution(f"job-{i}", 0, "me", 1)).start().stop()
    finally:
        del beater.wake
    assert wakes == []
    assert beater.is_alive()
