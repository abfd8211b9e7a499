"""One release-rate measurement in a process of its own, for scenario 25 (``bench/s_shaping.py``).

Run as a file (``python bench/release_ab.py URL N [--limit-other] [--tenant]``)
with ``PYTHONPATH`` naming the checkout whose ``celery_delayed`` (and ``lua/``)
to measure: it imports nothing of ``bench`` (an older checkout's ``bench``
would differ), so the same file measures this code and the code before it.

Fills N jobs, all due, through ``store.jobs.schedule`` (one prepared job
copied, as scenarios 3 and 12 fill), then releases them in-process with
``store.release.release_due`` one batch per shard per round, as a scheduler
does; prints one JSON line: the checkout it ran, the schedule and release
rates, and how many jobs it released. Deletes its keys after.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from celery import Celery


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("n", type=int)
    ap.add_argument("--limit-other", action="store_true", help="a rate limit in force on another task")
    ap.add_argument("--tenant", default=None, help="every job of this tenant (this code only)")
    args = ap.parse_args(argv)

    import celery_delayed
    from celery_delayed.producer.prepare import prepare
    from celery_delayed.store import NewJob, get_store

    u = uuid.uuid4().hex[:8]
    prefix, queue = f"b25{u}", f"q25{u}"
    conf: dict[str, Any] = {}
    if args.limit_other:
        conf["delayed_rate_limits"] = {"bench.other": "100/s"}
    app = Celery(f"bench-{prefix}", broker=args.url, set_as_current=False)
    app.conf.update(delayed_key_prefix=prefix, task_default_queue=queue, **conf)

    @app.task(name="bench.late", shared=False)
    def late(due: float = 0.0) -> None:
        return None

    store = get_store(app)
    # the code before shaping has no tenant= (only this code is run with --tenant)
    extra: dict[str, Any] = {"tenant": args.tenant} if args.tenant else {}
    base = prepare(app, store, "bench.late", (0.0,), {}, 0, task_type=app.tasks["bench.late"], **extra).job
    due = str(store.redis.now_ms() - 1000)
    n, chunk = args.n, 20_000

    def fill(start: int) -> None:
        jobs = [NewJob(f"{u}-{i}", store.layout.shard_of(f"{u}-{i}"), due, base.fields, base.common, base.template)
                for i in range(start, min(n, start + chunk))]
        store.jobs.schedule(jobs)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(2) as pool:
        for f in [pool.submit(fill, s) for s in range(0, n, chunk)]:
            f.result()
    fill_s = time.perf_counter() - t0

    client = store.redis.client
    # Let Redis finish freeing what the previous measurement unlinked (it would slow this one).
    deadline = time.monotonic() + 60
    while int(client.info("memory").get("lazyfree_pending_objects", 0)) and time.monotonic() < deadline:
        time.sleep(0.05)
    total, t0 = 0, time.perf_counter()
    live = set(range(store.config.shards))
    while live:
        for s in list(live):
            b = store.release.release_due(s)
            total += b.count
            if b.count + b.skipped < store.config.batch_size:
                live.discard(s)
    release_s = time.perf_counter() - t0
    print(json.dumps({"tree": celery_delayed.__file__.rsplit("/celery_delayed/", 1)[0], "released": total,
                      "schedule_rate": n / fill_s, "release_rate": total / release_s}), flush=True)
    for pattern in (f"{prefix}:*", queue):
        batch = list(client.scan_iter(match=pattern, count=5000))
        for i in range(0, len(batch), 5000):
            client.unlink(*batch[i:i + 5000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
