"""Scenario 1: 4 schedulers on one store; SIGKILL one at random every ~0.5 s (and restart it)
while 20,000 jobs come due over 10 s. Direct path: 0 lost, 0 enqueued twice (counted from the
workers' "received" lines, before the execution record), and a job is released late by at most the time
its shard had no live holder: one membership lease plus a heartbeat period after a kill."""

from __future__ import annotations

import bisect
import time

import pytest
from harness import FaultRun
from support.delivery import queue_keys, undelivered

pytestmark = pytest.mark.e2e

SEED = 1
JOBS = 20_000
SPREAD_S = 10.0
KILL_EVERY_S = 0.5
LEASE_MS = 2000
#: Scheduling slack on a loaded 2-core machine (the worker and 4 schedulers share it).
SLACK_MS = 1500


@pytest.mark.timeout(300)
def test_sigkill_schedulers_while_jobs_come_due() -> None:
    conf = {"delayed_lease_ms": LEASE_MS}
    with FaultRun(seed=SEED, conf=conf) as run:
        # The worker and the schedulers start first: on a slow machine the worker's start-up
        # would otherwise eat into the seconds in which jobs come due (and schedulers are killed).
        scheds = [run.scheduler() for _ in range(4)]
        run.wait_ready(run.worker(concurrency=8, extra=["--prefetch-multiplier", "50"]))
        t = time.monotonic()
        ids = run.schedule(JOBS, start_s=3.0, spread_s=SPREAD_S)
        schedule_s = time.monotonic() - t
        kills = 0
        store = run.store()
        killed_ms: list[int] = []  # Redis clock
        deadline = time.monotonic() + SPREAD_S + 6
        while time.monotonic() < deadline and (run.pending() > 0 or kills == 0):
            time.sleep(KILL_EVERY_S * (0.5 + run.rng.random()))
            i = run.rng.randrange(len(scheds))
            run.kill(scheds[i])
            killed_ms.append(store.redis.now_ms())
            kills += 1
            scheds[i] = run.scheduler()
        released_s = time.monotonic() - t
        assert run.wait_executed(ids, 120), f"{len(set(ids) - set(run.counts()))} jobs never ran"
        executed_s = time.monotonic() - t
        # Nothing is left to release, and the stopped worker gave back what it held: nothing
        # is left to deliver, so the delivery counts are final.
        for p in run.procs:
            if p.kind == "worker":
                p.stop(timeout=10)
        assert run.pending() == 0
        assert undelivered(store.redis.client, ids, queue_keys(run.queue)) == []
        assert sum(run.deliveries().values()) == JOBS
        # Late by at most the lease: a job due while its shard's holder was dead is released
        # once the holder's membership lease passed and a survivor's heartbeat (a quarter lease)
        # took the shard, so at most that after the latest kill before its release.
        pipe = store.redis.client.pipeline(transaction=False)
        for i in ids:
            pipe.hmget(store.keys.shard(store.layout.shard_of(i)).job(i), "due", "released")
        over = []
        late = []
        for i, (due, released) in zip(ids, pipe.execute(), strict=True):
            due, released = int(due), int(released)
            late.append(released - due)
            k = bisect.bisect_right(killed_ms, released) - 1
            since = max(due, killed_ms[k]) if k >= 0 else due
            if released - since > LEASE_MS * 1.25 + SLACK_MS:
                over.append((i, due, released, killed_ms[k] if k >= 0 else None))
        late.sort()
        out = run.outcome("scheduler SIGKILL x4", ids, kills)
        out.notes.update(schedule_s=round(schedule_s, 1), released_s=round(released_s, 1),
                         executed_s=round(executed_s, 1), late_p50_ms=late[len(late) // 2],
                         late_max_ms=late[-1])
        out.report()
        # (no earlier than its look-ahead window, with Celery's eta set to its due time)
        assert late[0] >= -store.config.lookahead_ms, "a job was released before its look-ahead window"
        assert not over, f"{len(over)} jobs released later than a lease after the last kill: {over[:5]}"
        assert out.lost == 0 and out.duplicated == 0 and out.delivered_twice == 0, out.line()
        assert sum(run.deliveries().values()) == JOBS
        assert run.store_problems() == []
        assert run.pending() == 0
        assert kills >= 15
