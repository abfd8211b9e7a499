"""The scheduler loop in-process, on the real store: wake-up races, stopping, leaving."""

from __future__ import annotations

import threading
import time

import pytest
from support import make_app, wait_for

from celery_delayed import apply_later, get_store
from celery_delayed.scheduler import DirectReleaser, Scheduler
from celery_delayed.store import Batch


class WakeDuringMove(DirectReleaser):
    """Releases for real, then lets a job be scheduled earlier and its wake-up arrive before returning.

    The move's result (next due: the far job) predates the wake-up: the loop
    must not let the stale result overwrite it.
    """

    def __init__(self, sched: Scheduler, app) -> None:
        super().__init__(app, sched.store)
        self.sched, self.app = sched, app
        self.early: object = None

    def release(self, shard: int, owner: str, fence: str, limit: int) -> Batch:
        batch = super().release(shard, owner, fence, limit)
        if self.early is None and batch.next_due_ms is not None:
            h = apply_later(self.app, "e2e.mark", when=0.05, task_id=f"early-{shard}", strict=False,
                            shard_key=f"s{shard}")
            # The listener thread delivers the wake-up while this move is in flight.
            self.sched._on_due(h.shard, float(h.due_ms))
            self.early = h
        return batch


@pytest.mark.timeout(30)
def test_a_wakeup_during_a_move_is_not_overwritten(redis_url, uid):
    # No look-ahead: the early job (due in 50 ms) must wait for the next round, not go in this one.
    app = make_app(redis_url, uid, delayed_shards=1, delayed_lookahead_ms=0)
    far = apply_later(app, "e2e.mark", when=3600, strict=False)
    sched = Scheduler(app)
    sched.releaser = releaser = WakeDuringMove(sched, app)
    try:
        sched._heartbeat()
        assert list(sched.shards) == [0]
        sched.release_due()
        assert releaser.early is not None
        early = releaser.early
        assert sched.next_due[0] == float(early.due_ms), "the stale next-due overwrote the wake-up"
        assert sched._sleep_s() < 0.1
        time.sleep(0.06)
        assert sched.release_due() == 1
        assert get_store(app).lookup.get(early.id)["st"] != "SCHEDULED"
        assert get_store(app).lookup.get(far.id)["st"] == "SCHEDULED"
    finally:
        sched.store.fleet.heartbeat(sched.owner, leave=True)
        sched.releaser.close()


@pytest.mark.timeout(30)
def test_stop_is_prompt_and_leaves_the_membership(redis_url, uid, rclient):
    app = make_app(redis_url, uid, delayed_shards=4)
    apply_later(app, "e2e.mark", when=3600, strict=False)
    sched = Scheduler(app)
    thread = threading.Thread(target=sched.run, daemon=True)
    thread.start()
    wait_for(lambda: sched.ready.is_set() and sched.listening, 10, what="the scheduler to start")
    assert sorted(sched.shards) == [0, 1, 2, 3]
    assert rclient.zcard(f"{app.conf.delayed_key_prefix}:schedulers") == 1
    time.sleep(0.2)  # asleep toward the far job
    t0 = time.monotonic()
    sched.stop()
    thread.join(5)
    took = time.monotonic() - t0
    assert not thread.is_alive()
    assert took < 1.5, f"stop took {took:.2f}s"
    assert rclient.zcard(f"{app.conf.delayed_key_prefix}:schedulers") == 0


@pytest.mark.timeout(30)
def test_a_shard_is_visited_a_slice_before_the_lookahead_and_releases_the_whole_window(redis_url, uid):
    # delayed_lookahead_ms 2000: a shard is visited when its earliest job is 1.75 s from due (the
    # look-ahead less a 250 ms slice), and that visit releases every job due within 2 s; each job
    # scheduled further ahead goes 1.75-2 s before it is due.
    app = make_app(redis_url, uid, delayed_shards=1, delayed_lookahead_ms=2000)
    store = get_store(app)
    a = apply_later(app, "e2e.mark", when=1.0, strict=False)
    b = apply_later(app, "e2e.mark", when=3.5, strict=False)
    c = apply_later(app, "e2e.mark", when=3.7, strict=False)  # within the window of b's visit
    sched = Scheduler(app)
    try:
        sched._heartbeat()
        assert sched.release_due() == 1  # a (1 s ahead); b is 3.5 s away
        # asleep until b is 1.75 s from due (1.75 s): not until it enters the window (1.5 s),
        # nor until it is half the look-ahead from due (2.5 s)
        assert 1.6 < sched._sleep_s() < 1.9, sched._sleep_s()
        assert sched.release_due() == 0
        time.sleep(sched._sleep_s())
        assert sched.release_due() == 2  # b and c in one visit
        # b and c went at least 1.75 s ahead, less what the sleep above may overshoot on a
        # loaded machine (the timing itself is asserted on _sleep_s above)
        for h, least in ((a, 900), (b, 1500), (c, 1500)):
            rec = store.lookup.get(h.id)
            ahead = int(rec["due"]) - int(rec["released"])
            assert least <= ahead <= 2000, (h.id, ahead)
    finally:
        sched.store.fleet.heartbeat(sched.owner, leave=True)
        sched.releaser.close()


@pytest.mark.timeout(30)
def test_a_debounce_job_is_visited_when_due_not_a_lookahead_early(redis_url, uid):
    # A debounce key's job in the look-ahead stays in the store until due (a later call may still
    # replace it): the loop neither spins on it nor sleeps past it; other jobs still go early.
    app = make_app(redis_url, uid, delayed_shards=1, delayed_lookahead_ms=2000)
    store = get_store(app)
    d = apply_later(app, "e2e.mark", when=1.0, debounce_key="k", strict=False)
    plain = apply_later(app, "e2e.mark", when=1.5, strict=False)
    sched = Scheduler(app)
    try:
        sched._heartbeat()
        assert sched.release_due() == 1  # the plain job, 1.5 s early; not the debounce job
        assert store.lookup.get(plain.id)["st"] == "QUEUED"
        assert store.lookup.get(d.id)["st"] == "SCHEDULED"
        assert sched.batches <= 2, "the loop spun on the waiting job"
        assert 0.7 < sched._sleep_s() <= 1.0, sched._sleep_s()  # until the debounce job is due
        assert sched.release_due() == 0
        time.sleep(sched._sleep_s())
        wait_for(lambda: sched.release_due() == 1, 2, interval=0.005, what="the debounce job to go")
        rec = store.lookup.get(d.id)
        assert rec["st"] == "QUEUED" and 0 <= int(rec["released"]) - int(rec["due"]) < 100
    finally:
        sched.store.fleet.heartbeat(sched.owner, leave=True)
        sched.releaser.close()
