"""The scheduler sleeps until work is due, is woken early by pub/sub, and costs Redis next to nothing idle."""

from __future__ import annotations

import shutil
import subprocess
import time

import pytest
import redis
from support import RedisServer, SchedulerProcess, WorkerProcess, make_app, need, wait_for

from celery_delayed import apply_later, get_store
from celery_delayed.store.loader import scripts

pytestmark = pytest.mark.e2e


def wait_scheduler_ready(client: redis.Redis, prefix: str, sched: SchedulerProcess, n: int = 1) -> None:
    """Until ``n`` schedulers are members and subscribed to the wake channel."""

    def ready() -> bool:
        if sched.proc.poll() is not None:
            raise AssertionError(f"scheduler exited: {sched.output()[-3000:]}")
        subs = dict(client.pubsub_numsub(f"{prefix}:wake"))
        return client.zcard(f"{prefix}:schedulers") >= n and int(subs.get(f"{prefix}:wake", 0)) >= n

    wait_for(ready, 30, what="the scheduler to join and subscribe")


@pytest.mark.timeout(90)
def test_wakeup_releases_an_earlier_job_on_time(redis_url, uid, workers, rclient):
    """The scheduler sleeps toward a job an hour away; jobs scheduled 50 ms ahead are released on time."""
    app = make_app(redis_url, uid)
    prefix, queue = app.conf.delayed_key_prefix, app.conf.task_default_queue
    store = get_store(app)
    w = WorkerProcess(redis_url, prefix, queue, concurrency=1, pool="solo")
    workers.append(w)
    far = apply_later(app, "e2e.mark", strict=False, when=3600)
    s = SchedulerProcess(redis_url, prefix, queue)
    workers.append(s)
    w.wait_ready()
    wait_scheduler_ready(rclient, prefix, s)
    time.sleep(0.3)  # let it finish its first pass and go to sleep toward the far job

    release_ms, start_ms = [], []
    for i in range(5):
        h = apply_later(app, "e2e.mark", strict=False, args=(i,), when=0.05)
        rec = wait_for(lambda h=h: "released" in (r := store.lookup.get(h.id)) and r, 5,
                       interval=0.01, what="the release")
        due = int(rec["due"])
        release_ms.append(int(rec["released"]) - due)
        entry = wait_for(lambda h=h: next((x for x in rclient.lrange(f"{prefix}:ran", 0, -1)
                                       if x.startswith(h.id)), None), 10, interval=0.01, what="the run")
        start_ms.append(float(entry.split("|")[3]) * 1000 - due)
        time.sleep(0.2)
    print(f"\nwake-up lateness, due -> LPUSH (ms): {release_ms}; due -> task start (ms): "
          f"{[round(x, 1) for x in start_ms]}")
    # Due in 50 ms, within the look-ahead window: released at once (before it is due), run on time.
    assert all(-60 <= x < 250 for x in release_ms), release_ms
    assert all(-5 <= x < 1000 for x in start_ms), start_ms
    assert store.lookup.get(far.id)["st"] == "SCHEDULED"


def client_commands(server: RedisServer, seconds: float) -> list[str]:
    """The commands clients send ``server`` during ``seconds`` (MONITOR, without the ones Lua runs)."""
    mon = subprocess.Popen(["redis-cli", "-p", str(server.port), "monitor"], stdout=subprocess.PIPE, text=True)
    try:
        time.sleep(seconds)
    finally:
        mon.terminate()
        out = mon.communicate(timeout=5)[0]
    return [line for line in out.splitlines() if line[:1].isdigit() and " lua] " not in line]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("jobs", [0, 1])
def test_idle_scheduler_sends_at_most_one_command_per_second(uid, workers, jobs):
    """An idle scheduler (no job, or one due in an hour) sends Redis about one command a second at most.

    Measured on a dedicated server with MONITOR, which shows each command a
    client sends (the commands Lua scripts run are marked and left out). A
    shard's lease has no deadline (it is the scheduler's while its membership
    lives), so an idle scheduler renews no shard lease: no ``shard_lease.lua``
    call once it holds its shards.
    """
    need("redis-cli", shutil.which("redis-cli") is not None)
    with RedisServer() as server:
        client = redis.Redis.from_url(server.url, decode_responses=True)
        app = make_app(server.url, uid)
        prefix, queue = app.conf.delayed_key_prefix, app.conf.task_default_queue
        if jobs:
            apply_later(app, "e2e.mark", strict=False, when=3600)
        s = SchedulerProcess(server.url, prefix, queue)
        workers.append(s)
        wait_scheduler_ready(client, prefix, s)
        time.sleep(1.0)  # the start-up pass: heartbeat, shard leases, one look at every shard
        window_s = 8.0  # longer than one heartbeat period (7.5 s at the default lease)
        seen = client_commands(server, window_s)
        shas = {scripts(flags).shard_lease.sha for flags in (True, False)}
        renewals = sum(any(sha in line for sha in shas) for line in seen)
        print(f"\nidle scheduler ({jobs} job): {len(seen)} commands in {window_s:.0f}s = "
              f"{len(seen) / window_s:.2f}/s, {renewals} shard lease calls")
        assert s.proc.poll() is None
        assert 1 <= len(seen) <= window_s, f"{len(seen)} commands in {window_s}s"  # >= 1: the heartbeat is seen
        assert renewals == 0, renewals
        s.stop()
        client.close()
