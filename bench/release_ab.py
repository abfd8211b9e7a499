"""One release-rate measurement in a process of its own, for scenario 25 (``bench/s_shaping.py``).

Run as a file (``python bench/release_ab.py URL [--limit-other] [--tenant T]``)
with ``PYTHONPATH`` naming the checkout whose ``celery_delayed`` (and ``lua/``)
to measure: it imports nothing of ``bench`` (an older checkout's ``bench``
would differ), so the same file measures this code and the code before it.

It prints a JSON line naming the checkout it imported, then takes commands
on stdin, one a line, and answers each with a JSON line: ``fill N`` schedules
N jobs, all due, through ``store.jobs.schedule`` (one prepared job copied, as
scenarios 3 and 12 fill; answers the schedule rate); ``release`` releases
them in-process with ``store.release.release_due`` one batch per shard per
round, as a scheduler does, then deletes their keys (answers the release
rate and how many it released); ``quit``. The parent keeps one process per
variant, fills every variant of a round first and then releases them back to
back, so a pair's releases run seconds apart.
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


class Jobs:
    """One measurement's jobs: filled under a prefix of their own, then released and deleted."""

    def __init__(self, url: str, conf: dict[str, Any], tenant: str | None) -> None:
        from celery_delayed.store import get_store

        self.u = uuid.uuid4().hex[:8]
        self.prefix, self.queue = f"b25{self.u}", f"q25{self.u}"
        self.app = Celery(f"bench-{self.prefix}", broker=url, set_as_current=False)
        self.app.conf.update(delayed_key_prefix=self.prefix, task_default_queue=self.queue, **conf)

        @self.app.task(name="bench.late", shared=False)
        def late(due: float = 0.0) -> None:
            return None

        self.store = get_store(self.app)
        self.tenant = tenant

    def fill(self, n: int, chunk: int = 20_000) -> float:
        """Schedule n jobs, all due (2 threads, chunks of 20,000); the schedule rate."""
        from celery_delayed.producer.prepare import prepare
        from celery_delayed.store import NewJob

        store, u = self.store, self.u
        # the code before shaping has no tenant= (only this code is run with --tenant)
        extra: dict[str, Any] = {"tenant": self.tenant} if self.tenant else {}
        base = prepare(self.app, store, "bench.late", (0.0,), {}, 0, task_type=self.app.tasks["bench.late"],
                       **extra).job
        due = str(store.redis.now_ms() - 1000)

        def one(start: int) -> None:
            store.jobs.schedule([NewJob(f"{u}-{i}", store.layout.shard_of(f"{u}-{i}"), due, base.fields,
                                        base.common, base.template) for i in range(start, min(n, start + chunk))])

        t0 = time.perf_counter()
        with ThreadPoolExecutor(2) as pool:
            for f in [pool.submit(one, s) for s in range(0, n, chunk)]:
                f.result()
        return n / (time.perf_counter() - t0)

    def release(self) -> tuple[int, float]:
        """Release every due job as a scheduler does, then delete the keys; (released, release rate)."""
        store = self.store
        client = store.redis.client
        # Let Redis finish freeing what an earlier measurement unlinked (it would slow this one).
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
        rate = total / (time.perf_counter() - t0)
        for pattern in (f"{self.prefix}:*", self.queue):
            keys = list(client.scan_iter(match=pattern, count=5000))
            for i in range(0, len(keys), 5000):
                client.unlink(*keys[i:i + 5000])
        return total, rate


def say(obj: dict[str, Any]) -> None:
    print(json.dumps(obj), flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("--limit-other", action="store_true", help="a rate limit in force on another task")
    ap.add_argument("--tenant", default=None, help="every job of this tenant (this code only)")
    args = ap.parse_args(argv)

    import celery_delayed

    conf: dict[str, Any] = {"delayed_rate_limits": {"bench.other": "100/s"}} if args.limit_other else {}
    say({"tree": celery_delayed.__file__.rsplit("/celery_delayed/", 1)[0]})
    jobs: Jobs | None = None
    for line in sys.stdin:
        cmd = line.split()
        if cmd and cmd[0] == "fill":
            jobs = Jobs(args.url, conf, args.tenant)
            say({"schedule_rate": jobs.fill(int(cmd[1]))})
        elif cmd and cmd[0] == "release" and jobs is not None:
            released, rate = jobs.release()
            jobs = None
            say({"released": released, "release_rate": rate})
        elif cmd and cmd[0] == "quit":
            break
    return 0


if __name__ == "__main__":
    sys.exit(main())
