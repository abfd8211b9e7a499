"""Scenario 19: ``delayed reshard`` of a store of pending jobs, 16 -> 64 shards.

N jobs pending (compact records, one in ten with a shard key, one in ten a
full record), then ``Resharder.run(64)`` with no scheduler running: jobs
moved per second, beside ``apply_later_many`` of the same jobs (scheduling
them once) as the reference; the pending count and each job's shard checked
after. The moves are two scripts per batch of 200 (one per shard touched)
plus reads, so moving a job should cost about as much as scheduling it.
"""

from __future__ import annotations

import time

from celery_delayed import apply_later, apply_later_many, get_store
from celery_delayed.store import shard_for
from celery_delayed.store.reshard import Resharder

from .celery_app import make_app
from .common import Ctx, delete_prefix, uid

S19 = "19 reshard 16 -> 64 shards (pending jobs, no scheduler)"


def reshard(ctx: Ctx) -> None:
    n = ctx.size(200_000, 20_000)
    print(f"[{S19}] {n} pending jobs", flush=True)
    u = uid()
    app = make_app(ctx.redis_url, f"b19{u}", f"q19{u}", delayed_shards=16)
    store = get_store(app)
    calls = [{"args": (float(i),), "when": 3600} for i in range(n * 8 // 10)]
    t0 = time.perf_counter()
    for i in range(0, len(calls), 10_000):
        apply_later_many(app, "bench.late_d", calls[i:i + 10_000])
    sched_s = time.perf_counter() - t0
    for i in range(n // 10):
        apply_later(app, "bench.late_d", (float(i),), None, 3600, shard_key=f"user-{i % 997}")
        apply_later(app, "bench.late_d", (float(i),), None, 3600, expires=7200)  # a full record
    t0 = time.perf_counter()
    report = Resharder(store).run(64, wait_s=60)
    spent = time.perf_counter() - t0
    ctx.add(S19, "apply_later_many (chunks of 10,000), the same jobs", "jobs/s", len(calls) / sched_s, "jobs/s")
    ctx.add(S19, "delayed reshard 16 -> 64", "jobs/s", report.moved_jobs / spent, "jobs/s",
            note=f"{report.moved_jobs} of {n} moved (3/4 expected) in {spent:.1f} s, {report.passes} pass(es); "
                 f"finished={report.finished}")
    ctx.relate(S19, "jobs/s", "apply_later_many (chunks of 10,000), the same jobs")
    client = ctx.client()
    prefix = app.conf.delayed_key_prefix
    pending = sum(client.zcard(f"{prefix}:{{{s}}}:due") for s in range(64))
    misplaced = 0
    for s in range(64):
        for job_id in client.zrange(f"{prefix}:{{{s}}}:due", 0, 999):
            skey = client.hget(f"{prefix}:{{{s}}}:job:{job_id.decode()}", "sk")
            misplaced += shard_for(skey.decode() if skey else job_id.decode(), 64) != s
    ctx.add(S19, "delayed reshard 16 -> 64", "pending after / before", pending / n, "ratio",
            note=f"{pending} pending after; {misplaced} of the first 1,000 per shard out of place")
    delete_prefix(client, f"*{u}*")
