"""Shard leases: schedulers split the shards; a dead one's shards move within one lease period.

The jobs are a plain task (``e2e.plain``): each delivery runs the body, so a job
enqueued twice would show as two runs and two "received" lines.
"""

from __future__ import annotations

import collections
import signal
import time

import pytest
import redis
from support import SchedulerProcess, WorkerProcess, make_app, ran, wait_for
from support.delivery import pending, queue_keys, received, record_fields, undelivered

from celery_delayed import apply_later_many, get_store

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
    return [h.id for h in apply_later_many(app, "e2e.plain", calls, strict=False)]


def assert_each_ran_once(app, client: redis.Redis, worker: WorkerProcess, ids: list[str]) -> None:
    prefix = app.conf.delayed_key_prefix
    wait_for(lambda: client.llen(f"{prefix}:ran") >= len(ids), 60, interval=0.1, what=f"{len(ids)} runs")
    # Nothing left that could still arrive: the store has nothing to release, and the
    # stopped worker held nothing back (not on the queue, not in kombu's unacked hash).
    worker.stop()
    assert pending(app) == 0
    assert undelivered(client, ids, queue_keys(app.conf.task_default_queue)) == []
    counts = collections.Counter(ran(client, prefix))
    assert set(counts) == set(ids), f"{len(set(ids) - set(counts))} jobs lost"
    dup = {k: v for k, v in counts.items() if v > 1}
    assert not dup, f"{len(dup)} jobs ran more than once"
    deliveries = received(worker.output(), "e2e.plain")
    assert set(deliveries) == set(ids) and max(deliveries.values()) == 1, "a job was delivered twice"


def lateness_ms(app, ids: list[str]) -> list[int]:
    """Release time minus due time of each job (both by the Redis clock)."""
    return sorted(int(r) - int(d) for d, r in record_fields(app, ids, "due", "released").values())


def leases(client: redis.Redis, prefix: str) -> list[tuple[str, int]]:
    """(owner token, fence) of each shard's lease."""
    values = client.mget([f"{prefix}:{{{s}}}:lease" for s in range(SHARDS)])
    out = []
    for v in values:
        owner, _, fence = (v or "").rpartition("|")
        out.append((owner, int(fence or 0)))
    return out


def takeover(app, client: redis.Redis, survivor: SchedulerProcess, since: float) -> tuple[float, int]:
    """Wait until the survivor holds every shard: (seconds since ``since``, Redis clock ms when seen)."""
    prefix = app.conf.delayed_key_prefix
    wait_for(lambda: {pid_of(o) for o in lease_owners(client, prefix) if o} == {survivor.pid}
             and all(lease_owners(client, prefix)), 10, interval=0.01, what="the take-over")
    return time.monotonic() - since, get_store(app).redis.now_ms()


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
    before = leases(rclient, prefix)
    victim.kill()  # SIGKILL: no goodbye, its membership must expire
    killed = time.monotonic()
    victim_token = next(o for o, _ in before if pid_of(o) == victim.pid)
    survivor_token = next(o for o, _ in before if pid_of(o) == survivor.pid)
    deadline_ms = int(rclient.zscore(f"{prefix}:schedulers", victim_token) or 0)
    took, seen_ms = takeover(app, rclient, survivor, killed)
    after = leases(rclient, prefix)
    print(f"\nSIGKILL: shards taken over {took * 1000:.0f} ms after the kill, "
          f"{seen_ms - deadline_ms} ms after the victim's membership deadline (lease {LEASE_MS} ms)")
    # The mechanism: each of the victim's shards was handed over once, its fence raised by one
    # (so a late release by the victim would be refused), and not before the victim's membership
    # lease ran out; the survivor's own shards kept their lease and fence.
    assert deadline_ms > 0
    for s, ((owner, fence), now) in enumerate(zip(before, after, strict=True)):
        want = (survivor_token, fence + 1) if owner == victim_token else (owner, fence)
        assert now == want, (s, before[s], now)
    assert seen_ms >= deadline_ms, "the survivor took the shards while the victim's lease was alive"
    # The clock: the victim's deadline is at most one lease after the kill (its last heartbeat came
    # before it), and the survivor notices at its next heartbeat (a quarter lease); 1.5 s of slack
    # for a loaded 2-core machine.
    slack_s = 1.5
    assert took <= LEASE_MS / 1000 + 0.5 + slack_s, f"take-over took {took:.2f}s"
    assert seen_ms - deadline_ms <= LEASE_MS / 4 + slack_s * 1000
    assert_each_ran_once(app, rclient, w, ids)
    # Jobs that fell due while the victim's shards had nobody were released late, by at most
    # the time the take-over took (the lease plus a heartbeat period), not lost.
    late = lateness_ms(app, ids)
    print(f"lateness: p50 {late[len(late) // 2]} ms, max {late[-1]} ms")
    # (released at most delayed_lookahead_ms ahead of its due time, with Celery's eta set)
    assert late[0] >= -get_store(app).config.lookahead_ms, "a job was released before its look-ahead window"
    assert late[-1] <= LEASE_MS * 1.25 + slack_s * 1000, late[-10:]
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
    token = next(o for o in lease_owners(rclient, prefix) if pid_of(o) == leaving.pid)
    t0 = time.monotonic()
    leaving.proc.send_signal(signal.SIGTERM)
    leaving.proc.wait(10)
    stopped = time.monotonic() - t0
    members = rclient.zrange(f"{prefix}:schedulers", 0, -1)
    took, _seen_ms = takeover(app, rclient, survivor, t0)
    print(f"\nSIGTERM: exited in {stopped * 1000:.0f} ms (code {leaving.proc.returncode}); "
          f"shards taken over {took * 1000:.0f} ms after the signal")
    assert leaving.proc.returncode == 0, leaving.output()[-3000:]
    assert stopped < 3.0
    assert all(pid_of(m) != leaving.pid for m in members), "it did not leave the membership set"
    assert token not in members
    assert took < stopped + 0.5, "the survivor waited for the lease to expire"
    assert "stopped" in leaving.output()
    assert_each_ran_once(app, rclient, w, ids)
