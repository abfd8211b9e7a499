"""The reconciler on a real Redis: a lost message is sent again, once; a waiting or held one is not copied."""

from __future__ import annotations

import json
from typing import Any

import pytest
from support import make_app

from celery_delayed import apply_later, get_store
from celery_delayed.reconciler import MAX_COPIES, Reconciler

TASK = "t.rec"
AFTER_MS = 300_000  # delayed_requeue_after_s default: 300 s


@pytest.fixture
def rapp(redis_url: str, uid: str) -> Any:
    return make_app(redis_url, uid, delayed_shards=1)


def _release(app: Any) -> None:
    get_store(app).release.release_due(0)


def _queue(app: Any, rclient: Any) -> list[str]:
    return [json.loads(m)["headers"]["id"] for m in rclient.lrange(app.conf.task_default_queue, 0, -1)]


def test_a_lost_message_is_sent_again_once(rapp: Any, rclient: Any) -> None:
    store = get_store(rapp)
    h = apply_later(rapp, TASK, when=0, strict=False)
    _release(rapp)
    assert _queue(rapp, rclient) == [h.id]
    rclient.delete(rapp.conf.task_default_queue)  # the broker lost it (kombu's BRPOP window, say)
    t = store.redis.now_ms()
    early = Reconciler(rapp).run_pass(now_ms=t + AFTER_MS - 5_000)  # not yet: within requeue_after of its due
    assert (early.rereleased, early.waiting) == (0, 0)
    report = Reconciler(rapp).run_pass(now_ms=t + AFTER_MS + 1_000)
    assert (report.rereleased, report.waiting, report.exhausted) == (1, 0, 0), report
    assert _queue(rapp, rclient) == [h.id]
    assert h.job()["rr"] == "1" and h.job_state == "QUEUED"
    # it is in its queue now (released again last): the next passes leave it waiting there
    again = Reconciler(rapp).run_pass(now_ms=t + 3 * AFTER_MS)
    assert (again.rereleased, again.waiting) == (0, 1)
    assert _queue(rapp, rclient) == [h.id]
    # once it starts, it is nobody's candidate any more
    assert store.executions.start(h.id, h.shard, "w").run
    assert store.release.release_candidates(0, t + 10 * AFTER_MS) == []


def test_jobs_waiting_in_a_long_queue_are_not_copied(rapp: Any, rclient: Any) -> None:
    hs = [apply_later(rapp, TASK, args=(i,), when=0, strict=False) for i in range(5)]
    _release(rapp)
    report = Reconciler(rapp).run_pass(now_ms=get_store(rapp).redis.now_ms() + 2 * AFTER_MS)
    assert (report.rereleased, report.waiting) == (0, 5)
    assert sorted(_queue(rapp, rclient)) == sorted(h.id for h in hs)


def test_a_message_held_by_a_worker_is_not_copied(rapp: Any, rclient: Any) -> None:
    store = get_store(rapp)
    h = apply_later(rapp, TASK, when=0, strict=False)
    _release(rapp)
    assert h.job_state == "QUEUED"
    msg = rclient.rpop(rapp.conf.task_default_queue)  # a worker took it (prefetched: not started)
    tag = json.loads(msg)["properties"]["delivery_tag"]
    rclient.hset(store.broker.unacked_hash, tag, msg)
    try:
        report = Reconciler(rapp).run_pass(now_ms=store.redis.now_ms() + 2 * AFTER_MS)
        assert (report.rereleased, report.waiting) == (0, 1)
        assert rclient.llen(rapp.conf.task_default_queue) == 0
    finally:
        rclient.hdel(store.broker.unacked_hash, tag)


def test_a_message_behind_one_that_cannot_be_dated_counts_as_waiting(rapp: Any, rclient: Any) -> None:
    h = apply_later(rapp, TASK, when=0, strict=False)
    _release(rapp)
    rclient.delete(rapp.conf.task_default_queue)
    rclient.lpush(rapp.conf.task_default_queue, json.dumps({"headers": {"id": "plain-apply-async"}}))
    report = Reconciler(rapp).run_pass(now_ms=get_store(rapp).redis.now_ms() + 2 * AFTER_MS)
    assert (report.rereleased, report.waiting) == (0, 1)
    assert h.job().get("rr") is None


def test_copies_are_bounded(rapp: Any, rclient: Any) -> None:
    store = get_store(rapp)
    h = apply_later(rapp, TASK, when=0, strict=False)
    _release(rapp)
    t = store.redis.now_ms()
    sent = 0
    for k in range(1, MAX_COPIES + 3):
        rclient.delete(rapp.conf.task_default_queue)  # lost, every time
        sent += Reconciler(rapp).run_pass(now_ms=t + k * 2 * AFTER_MS).rereleased
    assert sent == MAX_COPIES and h.job()["rr"] == str(MAX_COPIES)
    assert store.release.release_candidates(0, t + 100 * AFTER_MS) == []  # given up on, and reported


def test_publish_path_asks_the_queue_and_puts_the_job_back(redis_url: str, uid: str) -> None:
    app = make_app(redis_url, uid, delayed_shards=1, delayed_release_mode="publish")
    store = get_store(app)
    h = apply_later(app, TASK, when=0, strict=False)
    assert store.release.claim_due(0).ids == [h.id]
    assert store.release.ack_claimed(0, [h.id]) == 1
    t = store.redis.now_ms()
    busy = Reconciler(app, queue_depth=lambda q: 7).run_pass(now_ms=t + 2 * AFTER_MS)
    assert (busy.rereleased, busy.waiting) == (0, 1)  # messages wait in its queue: it may be one of them
    report = Reconciler(app, queue_depth=lambda q: 0).run_pass(now_ms=t + 2 * AFTER_MS)
    assert report.rereleased == 1
    rec = h.job()
    assert rec["st"] == "SCHEDULED" and rec["rr"] == "1"
    assert store.release.claim_due(0, now_ms=t + 2 * AFTER_MS + 1).ids == [h.id]  # published again as usual


def test_dry_run_changes_nothing(rapp: Any, rclient: Any) -> None:
    h = apply_later(rapp, TASK, when=0, strict=False)
    _release(rapp)
    rclient.delete(rapp.conf.task_default_queue)
    report = Reconciler(rapp, dry_run=True).run_pass(now_ms=get_store(rapp).redis.now_ms() + 2 * AFTER_MS)
    assert report.rereleased == 1 and rclient.llen(rapp.conf.task_default_queue) == 0
    assert h.job().get("rr") is None


def test_a_pass_over_a_fleet_with_nothing_released_reads_no_shard(redis_url: str, uid: str) -> None:
    """An idle scheduler runs a pass every delayed_reconcile_interval_s: one EXISTS over every shard's
    released set answers it (the scheduler's idle cost), while a released job is still found in any shard."""
    app = make_app(redis_url, uid, delayed_shards=16)
    store = get_store(app)
    assert not store.release.any_released()
    scanned: list[int] = []
    real = store.release.release_candidates
    store.release.release_candidates = lambda shard, *a, **k: scanned.append(shard) or real(shard, *a, **k)  # type: ignore
    Reconciler(app, store).run_pass()
    assert scanned == []
    h = apply_later(app, TASK, when=0, strict=False)
    store.release.release_due(h.shard)
    assert store.release.any_released()
    Reconciler(app, store).run_pass()
    assert scanned == list(range(16))
