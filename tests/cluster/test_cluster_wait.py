"""``delayed_wait_replicas`` on a Redis Cluster (issue 13): each master's writes go down one connection
of that master, followed by ``WAIT``, so an acknowledged write is on that master's replica.

Three masters with a replica each. Checked: every acknowledged job is on its replica the moment the
call returns; too few replicas raise ``ReplicationTimeout``; and a master SIGKILLed while producers
schedule with ``delayed_wait_replicas = 1`` loses no acknowledged job (with 0, only one acknowledged in
the master's last second); in both, a job runs twice only if a run of it went without the execution
record.
"""

from __future__ import annotations

import collections
import contextlib
import re
import threading
import time

import pytest
import redis
from redis.cluster import RedisCluster
from support import SchedulerProcess, WorkerProcess, make_app, wait_for

from celery_delayed import apply_later, apply_later_many, cancel, get_store, reschedule
from celery_delayed.errors import DelayedError, ReplicationTimeout, StoreFull

pytestmark = pytest.mark.e2e


def replica_of(cclient: RedisCluster, key: str) -> redis.Redis:
    """A READONLY connection to the replica of the master that holds ``key``."""
    master = cclient.get_node_from_key(key)
    for line in cclient.get_redis_connection(master).execute_command("CLUSTER", "NODES").splitlines():
        parts = line.split()
        if "slave" in parts[2] and parts[3] == line_id(cclient, master):
            host, port = parts[1].split("@")[0].rsplit(":", 1)
            r = redis.Redis(host=host, port=int(port), decode_responses=True)
            r.execute_command("READONLY")
            return r
    raise AssertionError(f"no replica of {master.name}")


def line_id(cclient: RedisCluster, node) -> str:
    return str(cclient.get_redis_connection(node).execute_command("CLUSTER", "MYID"))


@pytest.mark.timeout(120)
def test_an_acknowledged_write_is_on_the_replica_when_the_call_returns(redis_url, uid, replicated):
    app = make_app(redis_url, uid, delayed_redis_url=replicated.url, delayed_wait_replicas=1)
    store = get_store(app)
    cclient = RedisCluster.from_url(replicated.url, decode_responses=True)
    replicas: dict[str, redis.Redis] = {}

    def on_replica(h) -> dict[str, str]:
        key = store.keys.shard(h.shard).job(h.id)
        name = cclient.get_node_from_key(key).name
        if name not in replicas:
            replicas[name] = replica_of(cclient, key)
        return replicas[name].hgetall(key)

    many = apply_later_many(app, "e2e.plain", [{"args": (i,), "when": 3600} for i in range(300)], strict=False)
    assert all(on_replica(h).get("st") == "SCHEDULED" for h in many)  # read at once: no sleep, no poll
    for _ in range(20):
        h = apply_later(app, "e2e.plain", when=3600, strict=False)
        assert on_replica(h).get("st") == "SCHEDULED"
        due = reschedule(app, h.id, 7200)
        assert int(on_replica(h)["due"]) == due
        cancel(app, h.id)
        assert on_replica(h).get("st") == "CANCELLED"
    # more replicas than there are: every write says so (and is on the master)
    strict = make_app(redis_url, uid, delayed_redis_url=replicated.url, delayed_wait_replicas=2,
                      delayed_wait_replicas_timeout_ms=100)
    with pytest.raises(ReplicationTimeout, match="only 1 of the 2 replicas"):
        apply_later(strict, "e2e.plain", when=3600, strict=False)
    with pytest.raises(ReplicationTimeout):
        apply_later_many(strict, "e2e.plain", [{"args": (i,), "when": 3600} for i in range(50)], strict=False)
    # one master full: the other masters' jobs are written, replicated, and named in StoreFull.written
    first = replicated.nodes[0]
    full = redis.Redis(port=first.port)
    assert full.execute_command("ROLE")[0] == b"master"
    full.config_set("maxmemory", 1)
    try:
        with pytest.raises(StoreFull) as err:
            apply_later_many(app, "e2e.plain", [{"args": (i,), "when": 3600} for i in range(48)], strict=False)
    finally:
        full.config_set("maxmemory", 0)
        full.close()
    assert 0 < len(err.value.written) < 48 and "nothing was written" not in str(err.value)
    assert all(on_replica(h).get("st") == "SCHEDULED" for h in err.value.written.values())
    for r in replicas.values():
        r.close()
    cclient.close()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("wait", [1, 0])
def test_a_master_killed_while_producers_wait_for_replicas_loses_no_acknowledged_job(redis_url, uid, workers,
                                                                                       replicated, wait):
    """With ``delayed_wait_replicas = 1`` nothing acknowledged is lost; with 0 at most the replication
    window (what the master acknowledged in its last moments and had not passed on when it died)."""
    conf = {"delayed_redis_cluster": True, "delayed_lease_ms": 2000, "delayed_wait_replicas": wait}
    app = make_app(redis_url, uid, delayed_redis_url=replicated.url, **conf)
    prefix, queue = app.conf.delayed_key_prefix, app.conf.task_default_queue
    cclient = RedisCluster.from_url(replicated.url, decode_responses=True)
    w = WorkerProcess(redis_url, prefix, queue, store=replicated.url, conf=conf, concurrency=4, pool="threads")
    workers.extend([w, SchedulerProcess(redis_url, prefix, queue, store=replicated.url, conf=conf)])
    w.wait_ready()
    acked: list[tuple[str, float]] = []  # (job id, monotonic time of the acknowledgement)
    refused = collections.Counter()
    stop = threading.Event()

    def produce() -> None:
        while not stop.is_set():
            try:
                acked.append((apply_later(app, "e2e.plain", when=1.5, strict=False).id, time.monotonic()))
            except DelayedError as exc:  # not acknowledged: the caller would call again
                refused[type(exc).__name__] += 1
                time.sleep(0.05)

    threads = [threading.Thread(target=produce, daemon=True) for _ in range(3)]
    for t in threads:
        t.start()
    time.sleep(3.0)
    victim_name = cclient.get_node_from_key(get_store(app).keys.shard(0).due).name
    if victim_name == cclient.get_node_from_key(f"{prefix}:ran").name:
        victim_name = cclient.get_node_from_key(get_store(app).keys.shard(1).due).name
    victim = next(node for node in replicated.nodes if f"127.0.0.1:{node.port}" == victim_name)
    killed = time.monotonic()
    victim.stop("kill")
    time.sleep(6.0)  # the promotion (about 2 s), then more acknowledged writes on the new master
    stop.set()
    for t in threads:
        t.join(30)

    def ran() -> collections.Counter[str]:
        return collections.Counter(str(x).split("|")[0] for x in cclient.lrange(f"{prefix}:ran", 0, -1))

    ids = [i for i, _ in acked]
    # Without WAIT, the replication window: what the killed master acknowledged in its last second may be
    # lost (a promotion takes about 2 s: nothing acknowledged 1 s after the kill came from that master).
    window = {i for i, t in acked if killed - 1.0 <= t <= killed + 1.0} if not wait else set()
    try:
        wait_for(lambda: set(ids) - set(ran()) <= window, 90, interval=0.3,
                 what=f"{len(acked)} acknowledged jobs to run (all but the replication window's)")
        with contextlib.suppress(AssertionError):  # the window's, unless lost
            wait_for(lambda: set(ids) <= set(ran()), 10, interval=0.3)
    finally:
        time.sleep(1.0)  # a late duplicate
        counts = ran()
        lost = set(ids) - set(counts)
        twice = [i for i in ids if counts[i] > 1]
        untracked = set(_UNTRACKED.findall(w.output()))
        print(f"\nwait_replicas={wait}, master SIGKILLed: {len(acked)} acknowledged, {len(lost)} lost, "
              f"{len(twice)} ran twice, {len(untracked)} run without the execution record; "
              f"not acknowledged: {dict(refused)}")
    assert len(acked) > 300
    assert lost <= window, sorted(lost - window)[:5]
    # A release made again after the failover is dropped by the execution record of the first run, unless
    # that run went without it (the worker found no master for its shard).
    assert set(twice) <= untracked, (len(twice), sorted(set(twice) - untracked)[:5])
    cclient.close()


_UNTRACKED = re.compile(r"running e2e\.\w+\[([\w-]+)\] without the execution record")


@pytest.mark.timeout(60)
def test_doctor_and_status_count_the_replicas_of_each_master(redis_url, uid, replicated):
    from celery_delayed.store.health import ServerHealth

    app = make_app(redis_url, uid, delayed_redis_url=replicated.url, delayed_wait_replicas=1)
    health = ServerHealth(get_store(app))
    wait_for(lambda: health.replicas() == 1, 20, what="every master's replica online")
    assert "1 replica(s) online; writes wait for 1" in health.replication_line()
