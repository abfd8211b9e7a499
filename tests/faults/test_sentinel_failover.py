"""The store's master is SIGKILLed under load; Sentinel promotes a replica; everyone carries on.

A master, two replicas and three Sentinels (``down-after-milliseconds 500``);
the store is reached through the Sentinels. The broker is either the suite's
plain private Redis (the publish path: what is counted is the store's
failover alone) or the same Sentinels' master (kombu's Sentinel transport,
the direct path: the whole deployment fails over). Two producer threads schedule jobs due 0.3 s later (a call
the store could not take is retried with the same ``task_id`` until it is
acknowledged: ``DuplicateJob`` on a retry means the first attempt was
written); two schedulers (in-process, each with its own store client)
release them; a real Celery worker (a subprocess, its execution record on
the same Sentinel store) runs them. The master is killed while all are busy.

Counted: acknowledged jobs that never ran (lost: the master acknowledged
them and died before its replica had them), jobs delivered twice (a release
the old master made whose record had not reached the replica is made again
by the new one) and jobs run twice (the execution record turns a second delivery into
a no-op only if the first one's record survived). With
``delayed_wait_replicas = 1`` scheduling waits for a replica: nothing
acknowledged is lost.

How many run twice depends on what was in flight at the kill, so the test
checks the mechanism the README gives rather than a count: a job is lost only
if the old master acknowledged it in its last second; the worker runs a job
without its execution record only while there is no master (until the
Sentinels name the new one, and ``FOLLOW_S`` after); and a job runs twice
only if it was delivered twice and one of its runs went without the record.
"""

from __future__ import annotations

import collections
import os
import re
import shutil
import threading
import time
import uuid
from datetime import datetime
from typing import Any

import pytest
from support import WorkerProcess, make_app, need, ran, wait_for
from support.delivery import queue_keys, received

from celery_delayed import DuplicateJob, StoreUnavailable, apply_later, get_store
from celery_delayed.errors import ReplicationTimeout
from celery_delayed.scheduler import Scheduler
from celery_delayed.store import ShardStatus
from celery_delayed.testing.sentinel import SentinelGroup

pytestmark = pytest.mark.e2e

RUN_S = 4.0
KILL_AT_S = 1.5
DUE_S = 0.3
#: How long after the Sentinels name the new master a worker may still find no master (it asks them itself).
FOLLOW_S = 1.0

_STAMP = r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}): [^\]]*\] "
_UNTRACKED = re.compile(_STAMP + r"Store unavailable, running e2e\.mark\[([\w-]+)\] without the execution record")


def stamped(pattern: re.Pattern[str], output: str) -> dict[str, list[float]]:
    """Per task id, the times (epoch seconds, from the worker's log lines) of the lines ``pattern`` matches."""
    out: dict[str, list[float]] = collections.defaultdict(list)
    for stamp, task_id in pattern.findall(output):
        out[task_id].append(datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp())
    return out


class Producer(threading.Thread):
    """Schedules jobs one at a time; a call that fails is retried with its task_id until acknowledged."""

    def __init__(self, app: Any, seconds: float) -> None:
        super().__init__(daemon=True)
        self.app, self.seconds = app, seconds
        self.acked: list[tuple[str, float]] = []  # (id, monotonic time of the acknowledgement)
        self.retries = 0
        self.unconfirmed = 0  # ReplicationTimeout answers (written on the master, not on a replica)
        self.other: list[BaseException] = []

    def run(self) -> None:
        end = time.monotonic() + self.seconds
        while time.monotonic() < end:
            job_id = uuid.uuid4().hex
            while True:
                try:
                    apply_later(self.app, "e2e.mark", when=DUE_S, task_id=job_id, strict=False)
                except DuplicateJob:  # an earlier attempt was written (and, with WAIT, replicated)
                    pass
                except (StoreUnavailable, ReplicationTimeout) as exc:
                    self.retries += 1
                    self.unconfirmed += isinstance(exc, ReplicationTimeout)
                    if time.monotonic() > end + 20:
                        break
                    time.sleep(0.05)
                    continue
                except Exception as exc:  # anything else is a bug: report it
                    self.other.append(exc)
                    return
                self.acked.append((job_id, time.monotonic()))
                break
            time.sleep(0.005)


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("wait_replicas", "broker"), [(0, "plain"), (1, "plain"), (1, "sentinel")])
def test_master_killed_under_load(redis_url, uid, rclient, wait_replicas, broker):
    """``broker``: "plain" (the suite's Redis: the publish path) or "sentinel" (the store's master: direct)."""
    need("redis-server", shutil.which("redis-server") is not None)
    conf = dict(delayed_shards=8, delayed_lease_ms=2000, delayed_claim_lease_ms=2000, delayed_lookahead_ms=0,
                delayed_wait_replicas=wait_replicas, delayed_reconcile_interval_s=2.0, delayed_requeue_after_s=3.0)
    with SentinelGroup(replicas=2) as group:
        if broker == "plain":
            broker_url = redis_url
            store_conf: dict[str, Any] = {"delayed_redis_url": group.url,
                                          "delayed_redis_options": {"master_name": group.master_name}}
        else:  # the store is the broker's master (kombu's own convention for its options)
            broker_url = group.url
            store_conf = {"delayed_redis_url": None,
                          "broker_transport_options": {"master_name": group.master_name}}

        def app() -> Any:
            return make_app(broker_url, uid, **store_conf, **conf)

        # The worker's run log is the suite's plain Redis (it survives the failover).
        worker = WorkerProcess(broker_url, f"t{uid}", f"q{uid}", store=redis_url, conf={**store_conf, **conf},
                               concurrency=4, pool="threads")
        schedulers = [Scheduler(app()) for _ in range(2)]
        threads = [threading.Thread(target=s.run, daemon=True) for s in schedulers]
        producers = [Producer(app(), RUN_S) for _ in range(2)]
        try:
            worker.wait_ready()
            for t in threads:
                t.start()
            wait_for(lambda: all(s.ready.is_set() for s in schedulers), 10, what="the schedulers")
            for p in producers:
                p.start()
            time.sleep(KILL_AT_S)
            released_before = sum(s.released for s in schedulers)
            old = group.master_port()
            assert old is not None
            killed_at = time.monotonic()
            group.server_on(old).stop("kill")
            group.wait_failover(old)
            promoted_s = time.monotonic() - killed_at
            promoted_at = time.time()
            for p in producers:
                p.join(RUN_S + 30)
            assert not any(p.other for p in producers), [p.other for p in producers]
            acked = [i for p in producers for i, _ in p.acked]
            after_kill = [i for p in producers for i, t in p.acked if t > killed_at + promoted_s]
            assert after_kill, "no producer was acknowledged after the failover"
            store = get_store(app())
            assert store.broker.direct == (broker == "sentinel")
            queues = store.redis.client if store.broker.direct else rclient
            seen: dict[str, Any] = {}

            def settled() -> bool:
                runs = collections.Counter(ran(rclient, f"t{uid}"))
                if set(acked) <= set(runs):
                    seen["runs"] = runs
                    return True
                left = sum(r["pending"] + r["inflight"] for r in ShardStatus(store).rows())
                queued = sum(queues.llen(k) for k in queue_keys(f"q{uid}"))
                if left or queued or runs != seen.get("runs"):
                    seen.update(runs=runs, since=time.monotonic())
                    return False
                return time.monotonic() - seen["since"] > 3.0  # nothing left anywhere, nothing running

            wait_for(settled, 60, interval=0.25, what="every job to run, or nothing left to run")
            time.sleep(0.5)  # a late duplicate
            runs = collections.Counter(ran(rclient, f"t{uid}"))
            output = worker.output()
            delivered = received(output, "e2e.mark")
            untracked = stamped(_UNTRACKED, output)  # runs without the execution record (no master)
            lost = [i for i in acked if runs[i] == 0]
            twice = [i for i in acked if runs[i] > 1]
            delivered_twice = [i for i in acked if delivered[i] > 1]
            # acknowledged by the old master in its last second (none is acknowledged with no master)
            window = [i for p in producers for i, t in p.acked if killed_at - 1.0 <= t < killed_at + promoted_s]
            released_after = sum(s.released for s in schedulers) - released_before
            line = (f"[faults] sentinel failover, broker {broker}, delayed_wait_replicas={wait_replicas}: "
                    f"{len(acked)} acknowledged, "
                    f"{len(lost)} lost, {len(twice)} ran twice, {len(delivered_twice)} delivered twice; "
                    f"promoted after {promoted_s:.1f} s; {sum(p.retries for p in producers)} producer retries "
                    f"({sum(p.unconfirmed for p in producers)} ReplicationTimeout); "
                    f"{len(window)} acknowledged in the last second before the kill; "
                    f"{released_after} released after the kill; "
                    f"{sum(map(len, untracked.values()))} run without the execution record (store unavailable)")
            print("\n" + line)
            if os.environ.get("FAULTS_REPORT"):
                with open(os.environ["FAULTS_REPORT"], "a") as f:
                    f.write(line + "\n")
            assert all(t.is_alive() for t in threads), "a scheduler died with the master"
            assert worker.proc.poll() is None, output[-3000:]
            assert released_after > 0
            if wait_replicas:
                assert lost == [], lost[:5]
            else:
                # Asynchronous replication: only what the master acknowledged just before it died.
                assert set(lost) <= set(window), sorted(set(lost) - set(window))[:5]
            # The worker runs a job without its execution record only while there is no master to record
            # it on: once the Sentinels name the new one, every start is recorded again.
            late = sorted(t - promoted_at for ts in untracked.values() for t in ts if t > promoted_at + FOLLOW_S)
            assert not late, f"{len(late)} run(s) without the execution record {late[:3]} s after the promotion"
            # A job is delivered twice when a release's acknowledgement is lost (with the old master, or a
            # connection the promotion closed); it runs twice only if a run went without the execution
            # record (it overlapped the outage): the record of any other run makes the second delivery a no-op.
            # Unless the promoted replica had not received that record: with delayed_wait_replicas the
            # worker waits for its records to reach a replica, but when the replicas lag past the WAIT bound
            # (a ReplicationTimeout to a producer, a warning in the worker's log) a run's record may still
            # be lost with the master, and its job run again (documented in guarantees.md).
            assert set(twice) <= set(delivered_twice), sorted(set(twice) - set(delivered_twice))[:5]
            lagged = sum(p.unconfirmed for p in producers) + output.count("replicas of delayed_wait_replicas")
            if not lagged:
                assert set(twice) <= set(untracked), sorted(set(twice) - set(untracked))[:5]
        finally:
            for s in schedulers:
                s.stop()
            for t in threads:
                t.join(10)
            worker.stop()
