"""Edges of the worker-side ledger: a failing heartbeat, the publish path's late
ack, and record lifetimes while a job runs."""

from __future__ import annotations

import time

from conftest import make_app
from helpers import wait_for
from redis.exceptions import ResponseError

from celery_delayed import apply_later, get_store
from celery_delayed.ledger import RUN, Execution, LeaseKeeper, Ledger


class _FlakyLedger(Ledger):
    """A real ledger whose first extension fails with a server error (e.g. MISCONF)."""

    failed = 0

    def extend(self, ex: Execution, now_ms: int | None = None) -> bool:
        if not self.failed:
            self.failed += 1
            raise ResponseError("MISCONF Redis is configured to save RDB snapshots, but it cannot")
        return super().extend(ex, now_ms)


def test_heartbeat_survives_a_server_error(redis_url, uid):
    app = make_app(redis_url, uid, delayed_exec_lease_ms=600)
    store = get_store(app)
    ledger = _FlakyLedger(store)
    h = apply_later(app, "e2e.mark", when=0, strict=False)
    store.release_due(h.shard)
    assert ledger.start(h.id, h.shard, "me", "host").code == RUN
    keeper = LeaseKeeper(ledger, Execution(h.id, h.shard, "me", 1)).start()
    key = store.keys.shard(h.shard).job(h.id)
    try:
        wait_for(lambda: ledger.failed == 1, 2, what="the failing beat")
        first = int(store.client.hget(key, "lu"))
        # later beats still extend the lease: the one heartbeat thread lived on
        wait_for(lambda: int(store.client.hget(key, "lu")) > first, 2, what="a later beat")
        time.sleep(0.7)  # longer than the lease: it must still be live
        assert int(store.client.hget(key, "lu")) > store.now_ms()
    finally:
        keeper.stop()


def test_late_ack_keeps_the_done_markers_ttl(redis_url, uid):
    """Publish path: a fast task finished before its claim was acknowledged."""
    app = make_app(redis_url, uid, delayed_release_mode="publish", delayed_record_ttl_s=3600,
                   delayed_idempotency_ttl_s=30 * 86400)
    store = get_store(app)
    h = apply_later(app, "e2e.mark", when=0, idempotency_key=f"k-{uid}", strict=False)
    assert store.claim_due(h.shard).ids == [h.id]
    ledger = Ledger(store)
    assert ledger.start(h.id, h.shard, "me", "host").code == RUN
    assert ledger.finish(Execution(h.id, h.shard, "me", 1), "SUCCEEDED")[0] == 1
    key = store.keys.shard(h.shard).job(h.id)
    before = store.client.pttl(key)
    assert before > 3600 * 1000
    assert store.ack_claimed(h.shard, [h.id]) == 1
    assert store.client.hget(key, "st") == "SUCCEEDED"
    assert store.client.pttl(key) > 3600 * 1000  # not cut to delayed_record_ttl_s
    assert not store.client.zscore(store.keys.shard(h.shard).inflight, h.id)


def test_a_running_job_keeps_its_record_past_the_release_ttl(redis_url, uid):
    app = make_app(redis_url, uid, delayed_record_ttl_s=1)
    store = get_store(app)
    h = apply_later(app, "e2e.mark", when=0, strict=False)
    store.release_due(h.shard)
    key = store.keys.shard(h.shard).job(h.id)
    assert 0 < store.client.pttl(key) <= 1000  # a released record nobody starts expires
    assert Ledger(store).start(h.id, h.shard, "me", "host").code == RUN
    assert store.client.pttl(key) == -1  # running: no TTL until finish sets one
