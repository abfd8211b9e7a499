"""The scheduler's cost in a steady stream: ``python -m bench.stream_cost [jobs] [seconds]``.

Not a scenario of ``python -m bench`` (it has no alternative to compare
with): it measures what one ``celery -A bench.celery_app delayed run``
spends releasing a steady stream of ``DelayedTask`` jobs under the default
look-ahead, for comparing two versions of the scheduler on one machine (run
it at each commit, alternating). By default 6,000 jobs fall due over 10 s
(600/s) on a private redis-server; nothing consumes them but this script,
which pops each released message and notes how long before its ``eta`` it
arrived. It prints the scheduler's CPU seconds while the stream is released,
the ``EVALSHA`` calls and their Redis time (``INFO commandstats``), and the
spread of "released ahead".
"""

from __future__ import annotations

import json
import sys
import threading
import time
from datetime import datetime, timezone

import redis

from celery_delayed.testing import RedisServer

from .celery_app import make_app
from .common import delayed_scheduler, pct, procs, wait_scheduler


def main(argv: list[str]) -> int:
    n = int(argv[0]) if argv else 6_000
    span = float(argv[1]) if len(argv) > 1 else 10.0
    prefix, queue = "stream", "stream-q"
    with RedisServer() as server, procs() as ps:
        client = redis.Redis.from_url(server.url)
        sched = delayed_scheduler(server.url, prefix, queue)
        ps.append(sched)
        if not wait_scheduler(client, prefix, 60):
            print(sched.output()[-3000:], file=sys.stderr)
            return 1
        task = make_app(server.url, prefix, queue).tasks["bench.late_d"]
        first_due = time.time() + 3.0 + n / 10_000  # the look-ahead (2 s) and the time to schedule them all
        dues = [first_due + span * i / n for i in range(n)]
        task.apply_later_many({"when": datetime.fromtimestamp(due, tz=timezone.utc), "kwargs": {"due": due}}
                              for due in dues)
        aheads: list[float] = []

        def consume() -> None:
            c = redis.Redis.from_url(server.url)
            while len(aheads) < n and time.time() < first_due + span + 10:
                got = c.brpop([queue], timeout=1)  # as kombu's Redis transport takes messages
                if got is None:
                    continue
                now = time.time()
                eta = json.loads(got[1])["headers"].get("eta")
                aheads.append((datetime.fromisoformat(eta).timestamp() - now) * 1000 if eta else 0.0)

        consumer = threading.Thread(target=consume, daemon=True)
        consumer.start()
        time.sleep(max(first_due - 2.5 - time.time(), 0.0))  # before the look-ahead reaches the first
        client.config_resetstat()
        cpu0 = sched.cpu_s()
        consumer.join(first_due + span + 15 - time.time())
        cpu = sched.cpu_s() - cpu0
        stats = client.info("commandstats").get("cmdstat_evalsha", {})
    print(f"released {len(aheads)} of {n} jobs due over {span:g} s")
    print(f"scheduler CPU {cpu:.2f} s; EVALSHA calls {stats.get('calls', 0)}, "
          f"Redis time {int(stats.get('usec', 0)) / 1e6:.2f} s")
    if aheads:
        print(f"released ahead of eta: p1 {pct(aheads, 1):.0f} ms, p50 {pct(aheads, 50):.0f} ms, "
              f"p99 {pct(aheads, 99):.0f} ms")
    return 0 if len(aheads) == n else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
