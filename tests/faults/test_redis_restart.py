"""Scenario 4: the redis-server (store and broker) restarts under load, with ``appendonly yes``
and ``appendfsync everysec``. Schedulers and workers reconnect on their own.

What is promised (docs/guarantees-faults.md), and asserted:

- SIGTERM (a clean shutdown writes the AOF): the store loses nothing; every acknowledged job
  is released. SIGKILL: the store loses at most what was acknowledged in the last fsync
  window (about a second).
- The Redis broker (kombu) can lose the message a ``BRPOP`` took at the instant the server
  stopped: at most one per consuming worker (one here).
- A job runs twice only when its first run overlapped the outage, so that the execution record could
  not record its finish (or, SIGKILL, the record of it went with the fsync window).
- Every job that did not run is classified (lost by the store, lost by the broker); none is
  left deliverable once the wait is over.
"""

from __future__ import annotations

import threading
import time

import pytest
from harness import FaultRun
from support import make_app, wait_for
from support.delivery import queue_keys, undelivered

from celery_delayed import StoreUnavailable, apply_later

pytestmark = pytest.mark.e2e

BULK = 3000
SPREAD_S = 6.0
RESTART_AT_S = 3.0
DOWN_S = 1.0
#: The worker's prefetch: what it can hold (and run unrecorded) while Redis is away.
CONCURRENCY = 4
HELD = CONCURRENCY * 4
#: A run that ended this long before the crash may have its finish lost with the fsync window.
FSYNC_WINDOW_S = {"term": 0.5, "kill": 1.5}
#: Reconnecting after the restart: a run that ends this long after Redis is back may still fail to record.
RECONNECT_S = 5.0
#: A job that did not run is gone for good once nothing of it has been left anywhere for this long.
GONE_FOR_S = 3.0


class Producer(threading.Thread):
    """Calls apply_later in a loop; remembers which calls Redis acknowledged, and when."""

    def __init__(self, run: FaultRun, seconds: float) -> None:
        super().__init__(daemon=True)
        self.app = make_app(run.url, run.uid)
        self.seconds = seconds
        self.acked: list[tuple[str, float]] = []
        self.refused = 0
        self.other: list[BaseException] = []

    def run(self) -> None:
        end = time.monotonic() + self.seconds
        n = 0
        while time.monotonic() < end:
            n += 1
            try:
                h = apply_later(self.app, "fault.run", args=(n,), when=0.5, strict=False)
                self.acked.append((h.id, time.monotonic()))
            except StoreUnavailable:
                self.refused += 1
                time.sleep(0.05)
            except Exception as exc:  # anything else is a bug: report it
                self.other.append(exc)
            time.sleep(0.004)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("sig", ["term", "kill"])
def test_redis_restart_under_load(sig: str) -> None:
    conf = {"delayed_lease_ms": 2000,
            # A message whose ack was lost with Redis comes back after visibility_timeout.
            "broker_transport_options": {"visibility_timeout": 10, "unacked_restore_interval": 1,
                                         "unacked_restore_throttle": 1}}
    with FaultRun(seed=5, appendonly=True, conf=conf) as run:
        for _ in range(2):
            run.scheduler()
        # kombu 5.7's consumer can crash while it restores unacked messages during the
        # reconnect (AttributeError in _connparams): the worker exits, and supervise()
        # starts it again as a process manager would. Counted in crashed_and_restarted.
        w = run.worker(concurrency=CONCURRENCY, pool="prefork")
        run.wait_ready(w)
        ids = run.schedule(BULK, 0.5, SPREAD_S)
        producer = Producer(run, SPREAD_S)
        producer.start()
        time.sleep(RESTART_AT_S)
        killed_at, killed_wall = time.monotonic(), time.time()
        run.restart_redis(sig, down_s=DOWN_S)
        back_at, back_wall = time.monotonic(), time.time()
        producer.join(SPREAD_S + 30)
        assert not producer.other, producer.other[:3]
        acked = [i for i, _ in producer.acked]
        everything = ids + acked
        # Wait until every job ran, or until what did not run has been gone for good for a
        # while: nothing scheduled or in flight, no message on the queue or in kombu's unacked
        # hash (kombu restores a message whose ack was lost after visibility_timeout, and a
        # worker restarted by the supervisor picks up what its predecessor held).
        client = run.store().redis.client
        gone: dict[str, object] = {}

        def settled() -> bool:
            run.supervise()
            missing = frozenset(everything) - set(run.counts())
            if not missing:
                return True
            if run.pending() or undelivered(client, missing, queue_keys(run.queue)):
                gone.clear()
                return False
            if gone.get("ids") != missing:
                gone.update(ids=missing, since=time.monotonic())
            return time.monotonic() - gone["since"] >= GONE_FOR_S  # type: ignore[operator]

        wait_for(settled, 60, interval=0.25, what="every job to run or to be gone for good")
        complete = set(everything) <= set(run.counts())
        time.sleep(1.0)
        out = run.outcome(f"redis restart ({sig.upper()}, appendfsync everysec)", everything, 1)
        # Acknowledged in the 1.5 s before the crash: what an fsync window can take.
        window = [i for i, t in producer.acked if killed_at - 1.5 <= t <= killed_at]
        # Jobs that ran twice, and when their first run ended.
        firsts: dict[str, float] = {}
        for i, _pid, _retries, t in run.runs("done"):
            firsts.setdefault(i, t)
        counts = run.counts()
        dups = [i for i in everything if counts[i] > 1]
        outage = (killed_wall - FSYNC_WINDOW_S[sig], back_wall + RECONNECT_S)
        unexplained = [i for i in dups if not outage[0] <= firsts[i] <= outage[1]]
        out.notes.update(refused_while_down=producer.refused, acked_in_last_1_5s=len(window),
                         crashed_and_restarted=run.crashes)
        out.report()
        # Both processes kinds reconnected by themselves and carried on.
        after = [t for _, _, _, t in run.runs("done") if t > time.time() - (time.monotonic() - back_at)]
        assert after, "no job ran after Redis came back"
        sched_logs = [p.output() for p in run.procs if p.kind == "scheduler"]
        assert all(p.alive() for p in run.procs if p.kind == "scheduler"), "a scheduler died with Redis"
        assert any("unavailable" in log or "Error" in log for log in sched_logs)
        assert run.store_problems() == []
        # Every job that did not run is accounted for, and none is merely late.
        assert out.lost == out.lost_in_store + out.lost_in_broker + out.deliverable, out.line()
        assert out.deliverable == 0, out.line()
        # The broker's own window: the message one BRPOP took as the server stopped.
        assert out.lost_in_broker <= 1, out.line()
        # Ran twice: only jobs whose first run overlapped the outage, at most what the worker held.
        assert unexplained == [], (out.line(), outage, [(i, firsts[i]) for i in unexplained])
        assert out.duplicated <= HELD, out.line()
        if sig == "term":
            # The store loses nothing: every acknowledged job was released. What the Redis
            # broker itself may do in the same second (lose a message whose BRPOP reply was
            # cut off, redeliver one whose ack was cut off) is measured and reported.
            assert complete or out.lost == out.lost_in_broker, out.line()
            assert out.lost_in_store == 0, out.line()
        else:
            assert out.lost_in_store <= len(window), out.line()
