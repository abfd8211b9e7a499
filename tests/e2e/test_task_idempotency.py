"""Idempotency: one job per idempotency key, the run-time execution record (execution lease, done marker)."""

from __future__ import annotations

import threading

import pytest
from support import WorkerProcess, make_app, ran, wait_for

from celery_delayed import apply_later, get_store
from celery_delayed.store import Outcome, ShardStatus
from celery_delayed.vocab import Reply


def _release_all(app) -> int:
    store = get_store(app)
    return sum(store.release.release_due(s).count for s in range(store.config.shards))


def test_execution_lease_takeover_and_done_marker(redis_url, uid, rclient):
    app = make_app(redis_url, uid, delayed_exec_lease_ms=1000, delayed_done_ttl_s=60)
    h = apply_later(app, "e2e.mark", when=0, strict=False)
    assert _release_all(app) == 1
    store = get_store(app)
    t0 = store.redis.now_ms()

    first = store.executions.start(h.id, h.shard, "a", "host-a", now_ms=t0)
    assert (first.code, first.attempt, first.lease_until_ms) == (Reply.OK, 1, t0 + 1000)
    assert h.job_state == "RUNNING"
    busy = store.executions.start(h.id, h.shard, "b", "host-b", now_ms=t0 + 500)
    assert (busy.code, busy.lease_until_ms) == (Reply.BUSY, t0 + 1000)
    assert store.executions.extend_lease(h.id, h.shard, "a", now_ms=t0 + 900)  # the heartbeat: deadline t0 + 1900
    assert store.executions.start(h.id, h.shard, "b", "host-b", now_ms=t0 + 1800).code == Reply.BUSY
    assert not store.executions.extend_lease(h.id, h.shard, "b", now_ms=t0 + 1800)

    # a's worker died: once its lease passed, a redelivery takes over (attempt 2)
    took = store.executions.start(h.id, h.shard, "b", "host-b", now_ms=t0 + 1901)
    assert (took.code, took.attempt) == (Reply.OK, 2)
    # a, if it comes back, learns it lost the job
    assert not store.executions.extend_lease(h.id, h.shard, "a", now_ms=t0 + 1902)
    assert store.executions.finish(h.id, h.shard, "a", "SUCCEEDED") == Outcome(Reply.NOT_OWNER, "RUNNING")
    assert store.executions.finish(h.id, h.shard, "b", "SUCCEEDED") == Outcome(Reply.OK, "SUCCEEDED")

    rec = h.job()
    assert rec["st"] == "SUCCEEDED" and rec["att"] == "2" and rec["wk"] == "host-b"
    assert "lo" not in rec and "lu" not in rec
    assert 55_000 < rclient.pttl(store.keys.shard(h.shard).job(h.id)) <= 60_000
    done = store.executions.start(h.id, h.shard, "c", "host-c")
    assert (done.code, done.state) == (Reply.WRONG_STATE, "SUCCEEDED")


def test_start_without_record_runs_untracked(app):
    assert get_store(app).executions.start("never-scheduled", 0, "a").code == Reply.NOT_FOUND == 0


def test_duplicate_key_returns_the_existing_job(app, rclient):
    h1 = apply_later(app, "e2e.mark", (1,), when=3600, idempotency_key="order-42:reminder", strict=False)
    h2 = apply_later(app, "e2e.mark", (2,), when=60, idempotency_key="order-42:reminder", strict=False)
    assert h1.created and not h2.created
    assert h1.id == h2.id and h2.due_ms == h1.due_ms  # the first call's job, unchanged
    assert sum(r["pending"] for r in ShardStatus(get_store(app)).rows()) == 1


@pytest.mark.parametrize("n_threads", [16])
def test_duplicate_key_from_threads_at_once(app, n_threads):
    barrier = threading.Barrier(n_threads)
    results: list[object] = []

    def schedule(i: int) -> None:
        barrier.wait(5)
        results.append(apply_later(app, "e2e.mark", (i,), when=600, idempotency_key="same", strict=False))

    threads = [threading.Thread(target=schedule, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(results) == n_threads
    assert len({r.id for r in results}) == 1  # type: ignore[attr-defined]
    assert sum(r.created for r in results) == 1  # type: ignore[attr-defined]
    assert sum(r["pending"] for r in ShardStatus(get_store(app)).rows()) == 1


def test_key_stays_reserved_for_the_idempotency_ttl_after_the_job_finishes(redis_url, uid, rclient):
    app = make_app(redis_url, uid, delayed_done_ttl_s=1, delayed_idempotency_ttl_s=3)
    store = get_store(app)
    keyed = apply_later(app, "e2e.mark", when=0, idempotency_key="k1", strict=False)
    plain = apply_later(app, "e2e.mark", when=0, strict=False)
    assert _release_all(app) == 2
    for h in (keyed, plain):
        assert store.executions.start(h.id, h.shard, "w", "host").code == Reply.OK
        assert store.executions.finish(h.id, h.shard, "w", "SUCCEEDED").code == Reply.OK
    assert 2_000 < rclient.pttl(store.keys.shard(keyed.shard).job(keyed.id)) <= 3_000  # idempotency ttl
    assert 0 < rclient.pttl(store.keys.shard(plain.shard).job(plain.id)) <= 1_000  # done ttl

    again = apply_later(app, "e2e.mark", when=0, idempotency_key="k1", strict=False)
    assert not again.created and again.id == keyed.id and again.job_state == "SUCCEEDED"
    wait_for(lambda: not rclient.exists(store.keys.shard(keyed.shard).job(keyed.id)), 5, what="ttl")
    fresh = apply_later(app, "e2e.mark", when=0, idempotency_key="k1", strict=False)
    assert fresh.created and fresh.id == keyed.id and fresh.job_state == "SCHEDULED"


@pytest.mark.e2e
@pytest.mark.timeout(90)
def test_redelivered_completed_task_is_skipped(redis_url, uid, rclient, workers):
    """A copy of a completed job's message (as a redelivery would bring) does not run the body again."""
    app = make_app(redis_url, uid)
    prefix, queue = app.conf.delayed_key_prefix, app.conf.task_default_queue
    store = get_store(app)
    h = apply_later(app, "e2e.mark", when=0, strict=False)
    msg, lk = store.lookup.message(h.id, h.shard), store.lookup.get(h.id, h.shard)["lk"]
    assert _release_all(app) == 1
    w = WorkerProcess(redis_url, prefix, queue, concurrency=2)
    workers.append(w)
    wait_for(lambda: h.job_state == "SUCCEEDED", 30, what="the first run")
    rclient.lpush(lk, msg, msg)  # two more deliveries of the very same message
    wait_for(lambda: w.output().count("completed already") >= 2, 20, what="both copies skipped")
    assert ran(rclient, prefix) == [h.id]
    assert rclient.llen(lk) == 0
    # a task sent with plain apply_async (no record) just runs
    plain = app.send_task("e2e.mark", queue=queue)
    wait_for(lambda: plain.id in ran(rclient, prefix), 20, what="the plain task")
    assert not rclient.exists(store.keys.shard(store.layout.shard_of(plain.id)).job(plain.id))


@pytest.mark.e2e
@pytest.mark.timeout(90)
def test_a_key_freed_by_cancel_runs_its_new_job_once_never_the_old_message(redis_url, uid, rclient, workers):
    """Cancelled after release, its key used again: the worker runs the new generation and skips the old message."""
    app = make_app(redis_url, uid)
    prefix, queue = app.conf.delayed_key_prefix, app.conf.task_default_queue
    old = apply_later(app, "e2e.mark", args=("old",), when=0, idempotency_key=f"k-{uid}", strict=False)
    assert _release_all(app) == 1
    assert old.cancel()
    new = apply_later(app, "e2e.mark", args=("new",), when=0, idempotency_key=f"k-{uid}", strict=False)
    assert new.created and new.id == old.id
    assert _release_all(app) == 1
    assert rclient.llen(queue) == 2  # the cancelled generation's message is still there
    w = WorkerProcess(redis_url, prefix, queue, concurrency=2)
    workers.append(w)
    try:
        wait_for(lambda: new.job_state == "SUCCEEDED", 30, what="the new generation to run")
        # The old message is skipped: as superseded when it starts first, as completed when the new
        # generation finished before it started (two processes take both messages at once).
        wait_for(lambda: "superseded by a later generation" in w.output() or "completed already" in w.output(), 20,
                 what="the old message to be skipped")
    except AssertionError as exc:  # say what the worker did
        raise AssertionError(f"{exc}; record {new.job()}; worker log:\n{w.output()[-4000:]}") from exc
    wait_for(lambda: rclient.llen(queue) == 0, 10, what="the queue to drain")
    assert ran(rclient, prefix) == [new.id]  # once, and only the new generation


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_publish_path_duplicate_runs_once_on_rabbitmq(rabbitmq_url, redis_url, uid, rclient, workers):
    """A scheduler dies after publishing, before acknowledging its claim: the job is claimed and
    published again (at-least-once); the worker side runs the body once."""
    from celery_delayed.scheduler.releaser import PublishReleaser

    app = make_app(rabbitmq_url, uid, delayed_redis_url=redis_url, delayed_claim_lease_ms=500)
    prefix, queue = app.conf.delayed_key_prefix, app.conf.task_default_queue
    store = get_store(app)
    assert not store.broker.direct
    h = apply_later(app, "e2e.mark", when=0, strict=False)
    releaser = PublishReleaser(app, store)

    def crash(batch: object) -> None:
        raise RuntimeError("scheduler died between publish and ack")

    releaser.before_ack = crash
    with pytest.raises(RuntimeError):
        releaser.release(h.shard, "", "", 10)
    releaser.before_ack = None
    wait_for(lambda: releaser.release(h.shard, "", "", 10).ids == [h.id], 10, what="the claim to expire")
    releaser.close()
    try:
        w = WorkerProcess(rabbitmq_url, prefix, queue, store=redis_url, concurrency=2)
        workers.append(w)
        wait_for(lambda: h.job_state == "SUCCEEDED", 40, what="the job to succeed")
        wait_for(lambda: "completed already" in w.output(), 20, what="the second copy to be skipped")
        assert ran(rclient, prefix) == [h.id]
        assert h.job()["claims"] == "2"
    finally:
        with app.connection_for_write() as conn:
            conn.default_channel.queue_delete(queue)


@pytest.mark.e2e
@pytest.mark.timeout(90)
def test_store_down_at_start_requeues_then_runs_once_it_is_back(redis_url, uid, rclient, workers):
    """With acks_late, a delivery that cannot reach the store goes back to the queue unrun."""
    from support import RedisServer

    from celery_delayed.scheduler.releaser import PublishReleaser

    store_srv = RedisServer(appendonly=True).start()  # its data survives a restart
    try:
        conf = {"task_acks_late": True}
        app = make_app(redis_url, uid, delayed_redis_url=store_srv.url, **conf)
        prefix, queue = app.conf.delayed_key_prefix, app.conf.task_default_queue
        h = apply_later(app, "e2e.mark", when=0, strict=False)
        releaser = PublishReleaser(app, get_store(app))
        assert releaser.release(h.shard, "", "", 10).ids == [h.id]
        releaser.close()
        store_srv.stop()
        w = WorkerProcess(redis_url, prefix, queue, store=store_srv.url, conf=conf, concurrency=1)
        workers.append(w)
        wait_for(lambda: w.output().count("Store unavailable, requeueing") >= 2, 30, what="two requeues")
        out = w.output()  # the body never ran blind (it would have succeeded or raised)
        assert f"[{h.id}] succeeded" not in out and f"[{h.id}] raised" not in out
        store_srv.start()
        wait_for(lambda: h.job_state == "SUCCEEDED", 30, what="the job to run once the store is back")
        store_client = get_store(app).redis.client
        assert [x.split("|")[0] for x in store_client.lrange(f"{prefix}:ran", 0, -1)] == [h.id]
    finally:
        store_srv.__exit__()


@pytest.mark.e2e
@pytest.mark.timeout(60)
def test_a_worker_with_another_key_prefix_finds_the_jobs_store_and_says_so(redis_url, uid, rclient, workers):
    """The message names its store: a worker configured with another delayed_key_prefix still keeps the execution
    record."""
    producer = make_app(redis_url, uid)
    producer.conf.delayed_key_prefix = f"other{uid}"
    queue = producer.conf.task_default_queue
    h = apply_later(producer, "e2e.mark", when=0, strict=False)
    assert _release_all(producer) == 1
    w = WorkerProcess(redis_url, f"t{uid}", queue, concurrency=1)  # its app's prefix: t<uid>
    workers.append(w)
    wait_for(lambda: h.job_state == "SUCCEEDED", 30, what="the job to run under its own store's execution record")
    assert f"names the celery-delayed store with prefix 'other{uid}'" in w.output()
    assert ran(rclient, f"t{uid}") == [h.id]
