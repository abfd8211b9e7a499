"""Many schedulers: eight over 64 shards share them fairly, a SIGKILLed one's shards move within
one lease, and a paused scheduler cannot release from a shard it lost.

Each scheduler computes its share from the live members and takes each shard's own lease
(``shard_lease.lua``); there is no script over every shard (issue 13).
"""

from __future__ import annotations

import collections
import math
import signal
import threading
import time

import pytest
import redis
from support import SchedulerProcess, WorkerProcess, make_app, ran, wait_for
from support.delivery import pending, queue_keys, received, undelivered

from celery_delayed import apply_later_many, get_store
from celery_delayed.errors import LeaseLost
from celery_delayed.scheduler import DirectReleaser, Scheduler
from celery_delayed.store import Batch

pytestmark = pytest.mark.e2e

LEASE_MS = 2000
SHARDS = 64
SCHEDULERS = 8


def owners(client: redis.Redis, prefix: str, shards: int = SHARDS) -> list[str]:
    """The owner token holding each shard's lease ('' when none)."""
    values = client.mget([f"{prefix}:{{{s}}}:lease" for s in range(shards)])
    return [(v or "").rpartition("|")[0] for v in values]


def pid_of(owner: str) -> int:
    return int(owner.split(":")[-2])


def assert_each_ran_once(app, client: redis.Redis, worker: WorkerProcess, ids: list[str]) -> None:
    prefix = app.conf.delayed_key_prefix
    wait_for(lambda: client.llen(f"{prefix}:ran") >= len(ids), 60, interval=0.1, what=f"{len(ids)} runs")
    worker.stop()
    assert pending(app) == 0
    assert undelivered(client, ids, queue_keys(app.conf.task_default_queue)) == []
    counts = collections.Counter(ran(client, prefix))
    assert set(counts) == set(ids), f"{len(set(ids) - set(counts))} jobs lost"
    dup = {k: v for k, v in counts.items() if v > 1}
    assert not dup, f"{len(dup)} jobs ran more than once"
    deliveries = received(worker.output(), "e2e.plain")
    assert set(deliveries) == set(ids) and max(deliveries.values()) == 1, "a job was delivered twice"


def balanced(client: redis.Redis, prefix: str, pids: set[int]) -> bool:
    """Every shard held, by exactly ``pids``, none holding more than its fair share plus one."""
    held = owners(client, prefix)
    if not all(held):
        return False
    counts = collections.Counter(pid_of(o) for o in held)
    return set(counts) == pids and max(counts.values()) <= math.ceil(SHARDS / len(pids)) + 1


@pytest.mark.timeout(180)
def test_eight_schedulers_share_64_shards_and_take_over_a_killed_ones(redis_url, uid, workers, rclient):
    conf = {"delayed_lease_ms": LEASE_MS, "delayed_shards": SHARDS}
    app = make_app(redis_url, uid, **conf)
    prefix, queue = app.conf.delayed_key_prefix, app.conf.task_default_queue
    w = WorkerProcess(redis_url, prefix, queue, concurrency=4, pool="threads")
    workers.append(w)
    scheds = [SchedulerProcess(redis_url, prefix, queue, conf=conf) for _ in range(SCHEDULERS)]
    workers.extend(scheds)
    pids = {s.pid for s in scheds}

    def all_in() -> bool:
        for s in scheds:
            if s.proc.poll() is not None:
                raise AssertionError(f"scheduler exited: {s.output()[-3000:]}")
        return balanced(rclient, prefix, pids)

    wait_for(all_in, 90, interval=0.05, what="eight schedulers to share the shards")
    counts = collections.Counter(pid_of(o) for o in owners(rclient, prefix))
    assert sorted(counts.values()) == [SHARDS // SCHEDULERS] * SCHEDULERS, counts  # 64 / 8: exactly 8 each
    n = 1500
    ids = [h.id for h in apply_later_many(
        app, "e2e.plain", [{"args": (i,), "when": 5.0 * i / n} for i in range(n)], strict=False)]
    time.sleep(1.0)
    before = owners(rclient, prefix)
    victim = scheds[3]
    victim.kill()
    killed = time.monotonic()
    survivors = pids - {victim.pid}
    wait_for(lambda: balanced(rclient, prefix, survivors), 10, interval=0.01, what="the take-over")
    took = time.monotonic() - killed
    after = owners(rclient, prefix)
    moved = [s for s in range(SHARDS) if pid_of(before[s]) == victim.pid]
    print(f"\nSIGKILL of 1 of {SCHEDULERS}: its {len(moved)} shards taken over in {took * 1000:.0f} ms "
          f"(lease {LEASE_MS} ms); shares now {sorted(collections.Counter(map(pid_of, after)).values())}")
    assert len(moved) == SHARDS // SCHEDULERS
    # (shard i goes to the (i mod 7)-th survivor: most shards change hands between survivors too,
    # each given up by its holder before the next takes it)
    assert took <= LEASE_MS / 1000 + 1.5, f"take-over took {took:.2f}s"
    assert_each_ran_once(app, rclient, w, ids)


class PausedReleaser(DirectReleaser):
    """Stops (as SIGSTOP would) right before its next release script, until ``go`` is set."""

    def __init__(self, app, store) -> None:
        super().__init__(app, store)
        self.pause = threading.Event()
        self.paused = threading.Event()
        self.go = threading.Event()
        self.outcomes: list[str] = []

    def release(self, shard: int, owner: str, fence: str, limit: int) -> Batch:
        if self.pause.is_set() and not self.go.is_set():
            self.paused.set()
            self.go.wait(30)
            try:
                batch = super().release(shard, owner, fence, limit)
            except LeaseLost:
                self.outcomes.append("lost")
                raise
            self.outcomes.append(f"released {batch.count}")
            return batch
        return super().release(shard, owner, fence, limit)


@pytest.mark.timeout(60)
def test_a_scheduler_paused_past_its_lease_cannot_release_from_the_shard_it_lost(redis_url, uid):
    app = make_app(redis_url, uid, delayed_shards=1, delayed_lease_ms=1000, delayed_lookahead_ms=0)
    store = get_store(app)
    a, b = Scheduler(app, owner="a-sched"), Scheduler(app, owner="b-sched")
    a.releaser = releaser = PausedReleaser(app, a.store)
    threads = []
    try:
        a._heartbeat()
        assert list(a.shards) == [0]
        releaser.pause.set()
        h = apply_later_many(app, "e2e.mark", [{"when": 0.0}], strict=False)[0]
        # a wakes for the job and stops right before releasing it.
        threads.append(threading.Thread(target=a.release_due, daemon=True))
        threads[-1].start()
        assert releaser.paused.wait(10)
        fence_a = a.shards[0]
        # b joins; a's heartbeats are stopped too: past a's lease, b takes the shard, a new fence.
        threads.append(threading.Thread(target=b.run, daemon=True))
        threads[-1].start()
        wait_for(lambda: list(b.shards) == [0], 10, interval=0.01, what="b to take the shard")
        assert store.redis.client.get(store.keys.shard(0).lease) == f"b-sched|{int(fence_a) + 1}"
        wait_for(lambda: store.lookup.get(h.id)["st"] != "SCHEDULED", 10, what="b to release the job")
        releaser.go.set()  # a resumes and runs the release it had started, under its old fence
        threads[0].join(10)
        assert releaser.outcomes == ["lost"], releaser.outcomes
        assert 0 not in a.shards
        queued = sum(int(store.redis.client.llen(k)) for k in queue_keys(app.conf.task_default_queue))
        assert queued == 1, f"{queued} messages for one job"
    finally:
        releaser.go.set()
        b.stop()
        for t in threads:
            t.join(10)
        a.store.fleet.heartbeat(a.owner, leave=True)
        a.releaser.close()


@pytest.mark.timeout(120)
def test_a_sigstopped_scheduler_comes_back_without_releasing_from_the_shards_it_lost(redis_url, uid, workers,
                                                                                    rclient):
    shards = 8
    conf = {"delayed_lease_ms": LEASE_MS, "delayed_shards": shards}
    app = make_app(redis_url, uid, **conf)
    prefix, queue = app.conf.delayed_key_prefix, app.conf.task_default_queue
    w = WorkerProcess(redis_url, prefix, queue, concurrency=4, pool="threads")
    workers.append(w)
    a, b = (SchedulerProcess(redis_url, prefix, queue, conf=conf) for _ in range(2))
    workers.extend([a, b])
    wait_for(lambda: {pid_of(o) for o in owners(rclient, prefix, shards) if o} == {a.pid, b.pid}
             and all(owners(rclient, prefix, shards)), 60, interval=0.05, what="two schedulers to share")
    before = {s: rclient.get(f"{prefix}:{{{s}}}:lease") for s in range(shards)}
    n = 600
    ids = [h.id for h in apply_later_many(
        app, "e2e.plain", [{"args": (i,), "when": 1.0 + 6.0 * i / n} for i in range(n)], strict=False)]
    a.proc.send_signal(signal.SIGSTOP)  # paused, mid-whatever: its leases run out while it sleeps
    try:
        wait_for(lambda: {pid_of(o) if o else 0 for o in owners(rclient, prefix, shards)} == {b.pid}, 15,
                 interval=0.02, what="b to take a's shards")
        time.sleep(1.0)  # jobs of a's old shards come due and are released by b
    finally:
        a.proc.send_signal(signal.SIGCONT)
    # a comes back: its next release under an old fence is refused, it rejoins and gets its share
    # back from b (each shard given up by b, taken with a new fence; 0: a shard between the two).
    wait_for(lambda: {pid_of(o) if o else 0 for o in owners(rclient, prefix, shards)} == {a.pid, b.pid}, 15,
             interval=0.05, what="a to take its share back")
    after = {s: rclient.get(f"{prefix}:{{{s}}}:lease") for s in range(shards)}
    for s in range(shards):
        if pid_of(before[s].rpartition("|")[0]) == a.pid:
            assert int(after[s].rpartition("|")[2]) >= int(before[s].rpartition("|")[2]) + 1, (before[s], after[s])
    assert_each_ran_once(app, rclient, w, ids)
