"""Shard leases: schedulers split the shards; a dead one's shards move within one lease period."""

from __future__ import annotations

import collections
import signal
import time

import pytest
import redis
from support import SchedulerProcess, WorkerProcess, make_app, ran, wait_for

from celery_delayed import apply_later_many

pytestmark = pytest.mark.e2e

LEASE_MS = 2000
SHARDS = 16


def lease_owners(client: redis.Redis, prefix: str) -> list[str]:
    """The owner token holding each shard's lease ('' when none)."""
    values = client.mget([f"{prefix}:{{{s}}}:lease" for s in range(SHARDS)])
    return [(v or "").rpartition("|")[0] for v in values]


def pid_of(owner: str) -> int:
    """The process id inside an owner token (host:pid:random)."""
    return int(owner.split(":")[-2])


def start_two(redis_url: str, prefix: str, queue: str, workers: list, client: redis.Redis) -> list[SchedulerProcess]:
    conf = {"delayed_lease_ms": LEASE_MS, "delayed_shards": SHARDS}
    scheds = [SchedulerProcess(redis_url, prefix, queue, conf=conf) for _ in range(2)]
    workers.extend(scheds)

    def split() -> bool:
        for s in scheds:
            if s.proc.poll() is not None:
                raise AssertionError(f"scheduler exited: {s.output()[-3000:]}")
        owners = lease_owners(client, prefix)
        return all(owners) and {pid_of(o) for o in owners} == {s.pid for s in scheds}

    wait_for(split, 30, what="two schedulers to split the shards")
    counts = collections.Counter(pid_of(o) for o in lease_owners(client, prefix))
    assert sorted(counts.values()) == [SHARDS // 2, SHARDS // 2], counts
    return scheds


def schedule(app, n: int, spread_s: float) -> list[str]:
    calls = [{"args": (i,), "when": spread_s * i / n} for i in range(n)]
    return [h.id for h in apply_later_many(app, "e2e.mark", calls, strict=False)]


def assert_each_ran_once(client: redis.Redis, prefix: str, ids: list[str]) -> None:
    wait_for(lambda: client.llen(f"{prefix}:ran") >= len(ids), 60, interval=0.1, what=f"{len(ids)} runs")
    time.sleep(0.3)  # a duplicate would show up now
    counts = collections.Counter(ran(client, prefix))
    assert set(counts) == set(ids), f"{len(set(ids) - set(counts))} jobs lost"
    dup = {k: v for k, v in counts.items() if v > 1}
    assert not dup, f"{len(dup)} jobs ran more than once"


def takeover_s(client: redis.Redis, prefix: str, survivor: SchedulerProcess, since: float) -> float:
    """Seconds from ``since`` until the survivor holds every shard."""
    wait_for(lambda: {pid_of(o) for o in lease_owners(client, prefix) if o} == {survivor.pid}
             and all(lease_owners(client, prefix)), 10, interval=0.01, what="the take-over")
    return time.monotonic() - since


@pytest.mark.timeout(120)
def test_sigkilled_schedulers_shards_are_taken_over_within_one_lease(redis_url, uid, workers, rclient):
    conf = {"delayed_lease_ms": LEASE_MS, "delayed_shards": SHARDS}
    app = make_app(redis_url, uid, **conf)
    prefix, queue = app.conf.delayed_key_prefix, app.conf.task_default_queue
    w = WorkerProcess(redis_url, prefix, queue, concurrency=4, pool="threads")
    workers.append(w)
    victim, survivor = start_two(redis_url, prefix, queue, workers, rclient)
    ids = schedule(app, 2000, 5.0)
    time.sleep(1.0)
    victim.kill()  # SIGKILL: no goodbye, its membership must expire
    killed = time.monotonic()
    took = takeover_s(rclient, prefix, survivor, killed)
    print(f"\nSIGKILL: shards taken over {took * 1000:.0f} ms after the kill (lease {LEASE_MS} ms)")
    # By design at most lease + 20 ms after the kill; the rest is slack for a loaded 2-core box.
    assert took <= LEASE_MS / 1000 + 0.5, f"take-over took {took:.2f}s"
    assert_each_ran_once(rclient, prefix, ids)
    assert rclient.zrange(f"{prefix}:schedulers", 0, -1) and all(
        pid_of(m) == survivor.pid for m in rclient.zrange(f"{prefix}:schedulers", 0, -1))


@pytest.mark.timeout(120)
def test_sigterm_stops_promptly_and_hands_over_at_once(redis_url, uid, workers, rclient):
    conf = {"delayed_lease_ms": LEASE_MS, "delayed_shards": SHARDS}
    app = make_app(redis_url, uid, **conf)
    prefix, queue = app.conf.delayed_key_prefix, app.conf.task_default_queue
    w = WorkerProcess(redis_url, prefix, queue, concurrency=4, pool="threads")
    workers.append(w)
    leaving, survivor = start_two(redis_url, prefix, queue, workers, rclient)
    ids = schedule(app, 2000, 4.0)
    time.sleep(1.0)
    t0 = time.monotonic()
    leaving.proc.send_signal(signal.SIGTERM)
    leaving.proc.wait(10)
    stopped = time.monotonic() - t0
    members = rclient.zrange(f"{prefix}:schedulers", 0, -1)
    took = takeover_s(rclient, prefix, survivor, t0)
    print(f"\nSIGTERM: exited in {stopped * 1000:.0f} ms (code {leaving.proc.returncode}); "
          f"shards taken over {took * 1000:.0f} ms after the signal")
    assert leaving.proc.returncode == 0, leaving.output()[-3000:]
    assert stopped < 3.0
    assert all(pid_of(m) != leaving.pid for m in members), "it did not leave the membership set"
    assert took < stopped + 0.5, "the survivor waited for the lease to expire"
    assert "stopped" in leaving.output()
    assert_each_ran_once(rclient, prefix, ids)
