"""Scenario 4: the redis-server (store and broker) restarts under load, with ``appendonly yes``
and ``appendfsync everysec``. Schedulers and workers reconnect on their own. SIGTERM (a clean
shutdown writes the AOF): nothing lost, nothing run twice. SIGKILL: at most the last fsync
window (about a second) of writes is lost; we measure and report what that cost."""

from __future__ import annotations

import threading
import time

import pytest
from harness import FaultRun
from support import make_app

from celery_delayed import StoreUnavailable, apply_later

pytestmark = pytest.mark.e2e

BULK = 3000
SPREAD_S = 6.0
RESTART_AT_S = 3.0
DOWN_S = 1.0


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
        w = run.worker(concurrency=4, pool="prefork")
        run.wait_ready(w)
        ids = run.schedule(BULK, 0.5, SPREAD_S)
        producer = Producer(run, SPREAD_S)
        producer.start()
        time.sleep(RESTART_AT_S)
        killed_at = time.monotonic()
        run.restart_redis(sig, down_s=DOWN_S)
        back_at = time.monotonic()
        producer.join(SPREAD_S + 30)
        assert not producer.other, producer.other[:3]
        acked = [i for i, _ in producer.acked]
        everything = ids + acked
        complete = run.wait_executed(everything, 25, also=lambda: not run.supervise())
        time.sleep(1.0)
        out = run.outcome(f"redis restart ({sig.upper()}, appendfsync everysec)", everything, 1)
        # Acknowledged in the 1.5 s before the crash: what an fsync window can take.
        window = [i for i, t in producer.acked if killed_at - 1.5 <= t <= killed_at]
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
        if sig == "term":
            # The store loses nothing: every acknowledged job was released. What the Redis
            # broker itself may do in the same second (lose a message whose BRPOP reply was
            # cut off, redeliver one whose ack was cut off) is measured and reported.
            assert complete or out.lost == out.lost_in_broker, out.line()
            assert out.lost_in_store == 0, out.line()
        else:
            assert out.lost_in_store <= len(window), out.line()
