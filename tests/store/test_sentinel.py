"""The store behind Redis Sentinel: a master, a replica and three Sentinels on free ports.

The store's URL lists the Sentinels (``sentinel://a;sentinel://b;...``) with
``delayed_redis_options = {"master_name": ...}``; the broker is the suite's
plain private Redis (the publish path). Also ``delayed_wait_replicas``:
acknowledged writes wait for the replica, and say so when it does not answer.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from support import WorkerProcess, make_app, need, ran, run_celery, wait_for
from support.delivery import queue_keys, queued_ids

from celery_delayed import (
    ConfigurationError,
    DuplicateJob,
    StoreUnavailable,
    apply_later,
    apply_later_many,
    cancel,
    get_store,
)
from celery_delayed.doctor import store_findings
from celery_delayed.errors import ReplicationTimeout
from celery_delayed.scheduler import Scheduler
from celery_delayed.store import Store
from celery_delayed.testing.sentinel import SentinelGroup
from celery_delayed.vocab import Reply


@pytest.fixture(scope="module")
def group() -> Iterator[SentinelGroup]:
    need("redis-server", shutil.which("redis-server") is not None)
    with SentinelGroup() as g:
        yield g


@pytest.fixture
def fresh_group() -> Iterator[SentinelGroup]:
    """A group of its own, for a test that fails its master over."""
    need("redis-server", shutil.which("redis-server") is not None)
    with SentinelGroup() as g:
        yield g


def sentinel_app(group: SentinelGroup, broker: str, uid: str, **conf: Any) -> Any:
    return make_app(broker, uid, delayed_redis_url=group.url,
                    delayed_redis_options={"master_name": group.master_name}, **conf)


def run_scheduler(app: Any) -> tuple[Scheduler, threading.Thread]:
    sched = Scheduler(app)
    thread = threading.Thread(target=sched.run, daemon=True)
    thread.start()
    return sched, thread


@pytest.mark.timeout(60)
def test_schedule_and_release_through_sentinels(group, redis_url, uid, rclient):
    app = sentinel_app(group, redis_url, uid, delayed_shards=4)
    store = get_store(app)
    assert not store.broker.direct  # the broker is another server: the publish path
    assert int(store.redis.client.info("server")["tcp_port"]) == group.master_port()
    ids = [apply_later(app, "e2e.mark", args=(i,), when=0.2, strict=False).id for i in range(20)]
    far = apply_later(app, "e2e.mark", when=3600, strict=False)
    assert cancel(app, far.id) == "SCHEDULED"
    sched, thread = run_scheduler(app)
    try:
        keys = queue_keys(f"q{uid}")
        wait_for(lambda: set(queued_ids(rclient, keys)) >= set(ids), 20, what="every job on the broker")
        assert sorted(queued_ids(rclient, keys).values()) == [1] * 20
    finally:
        sched.stop()
        thread.join(10)
    # The replica has the store too (asynchronous replication: poll).
    replica = redis.Redis(port=group.replicas[0].port, decode_responses=True)
    try:
        wait_for(lambda: replica.exists(store.keys.layout) == 1, 5, what="the replica to have the store")
    finally:
        replica.close()


@pytest.mark.timeout(60)
def test_the_store_on_the_brokers_sentinels_releases_directly(group, redis_url, uid):
    """No delayed_redis_url: the store is the broker's master (kombu's master_name), the direct path."""
    app = make_app(group.url, uid, broker_transport_options={"master_name": group.master_name})
    store = get_store(app)
    assert store.config.redis_options == {"master_name": group.master_name}
    assert store.broker.direct
    ids = [apply_later(app, "e2e.mark", args=(i,), when=0, strict=False).id for i in range(5)]
    sched, thread = run_scheduler(app)
    master = redis.Redis(port=group.master_port(), decode_responses=True)
    try:
        keys = queue_keys(f"q{uid}")
        wait_for(lambda: set(queued_ids(master, keys)) >= set(ids), 20, what="every job on the master's list")
    finally:
        master.close()
        sched.stop()
        thread.join(10)
    # A real worker on the broker's Sentinels (kombu's SentinelChannel) runs them; its execution record is the same
    # store.
    conf = {"broker_transport_options": {"master_name": group.master_name}, "delayed_redis_url": None}
    worker = WorkerProcess(group.url, f"t{uid}", f"q{uid}", store=redis_url, conf=conf, concurrency=2,
                           pool="threads")
    try:
        worker.wait_ready()
        runs = redis.Redis.from_url(redis_url, decode_responses=True)
        try:
            wait_for(lambda: sorted(ran(runs, f"t{uid}")) == sorted(ids), 30, what="the worker to run every job")
        finally:
            runs.close()
        wait_for(lambda: all(store.lookup.get(i)["st"] == "SUCCEEDED" for i in ids), 10, what="the execution record")
    finally:
        worker.stop()
    # Another master name behind the same Sentinels is another server: the publish path.
    other = make_app(group.url, uid, broker_transport_options={"master_name": group.master_name},
                     delayed_redis_url=group.url, delayed_redis_options={"master_name": "elsewhere"})
    assert not get_store(other).broker.direct
    # Forced direct: refused for another master name, accepted for the broker's own.
    with pytest.raises(ConfigurationError, match=r"another Sentinel master"):
        Store(make_app(group.url, uid, broker_transport_options={"master_name": "elsewhere"},
                       delayed_redis_url=group.url, delayed_redis_options={"master_name": group.master_name},
                       delayed_release_mode="direct")).layout.check()
    Store(make_app(group.url, uid, broker_transport_options={"master_name": group.master_name},
                   delayed_release_mode="direct")).layout.check()


@pytest.mark.timeout(60)
def test_wait_replicas_waits_for_the_replica(group, redis_url, uid):
    app = sentinel_app(group, redis_url, uid, delayed_wait_replicas=1)
    store = get_store(app)
    h = apply_later(app, "e2e.mark", when=3600, strict=False)
    replica = redis.Redis(port=group.replicas[0].port, decode_responses=True)
    try:
        # WAIT returned: the replica has the record (no polling needed).
        assert replica.hget(store.keys.shard(h.shard).job(h.id), "st") == "SCHEDULED"
        store.jobs.reschedule(h.id, "+1000")
        assert cancel(app, h.id) == "SCHEDULED"
        assert replica.hget(store.keys.shard(h.shard).job(h.id), "st") == "CANCELLED"
        # A batch over several shards (one MULTI/EXEC, then WAIT): every record is on the replica.
        hs = apply_later_many(app, "e2e.mark", ({"args": (i,), "when": 3600} for i in range(40)), strict=False)
        assert len({x.shard for x in hs}) > 1
        assert [replica.hget(store.keys.shard(x.shard).job(x.id), "st") for x in hs] == ["SCHEDULED"] * 40
    finally:
        replica.close()


@pytest.mark.timeout(90)
def test_a_batch_longer_than_the_read_timeout_is_waited_for_and_on_the_replica(group, redis_url, uid):
    # Redis runs a batch over several shards as one MULTI/EXEC, then WAIT: the reply comes once the
    # whole batch ran and the replica has it, later than the client's socket_timeout. It is read on a
    # connection of the master the Sentinels name, whose timeout grows with the batch.
    n, limit = 30_000, 0.1
    # (a generous WAIT bound: on a loaded machine the replica takes its time over 30,000 jobs)
    app = make_app(redis_url, uid, delayed_redis_url=group.url, delayed_wait_replicas=1,
                   delayed_wait_replicas_timeout_ms=15_000,
                   delayed_redis_options={"master_name": group.master_name, "socket_timeout": limit})
    store = get_store(app)
    master = group.server_client(group.master.port)
    replica = redis.Redis(port=group.replicas[0].port, decode_responses=True)
    try:
        apply_later(app, "e2e.mark", when=3600, strict=False)  # the store and its scripts exist
        master.config_resetstat()
        hs = apply_later_many(app, "e2e.mark", ({"args": (i,), "when": 3600} for i in range(n)), strict=False)
        assert len(hs) == n and all(h.created for h in hs)
        busy = float(master.info("commandstats")["cmdstat_exec"]["usec"]) / 1e6
        assert busy > limit, f"the batch took Redis only {busy:.3f} s: nothing was tested"
        # WAIT returned: the replica has every job of the batch (no polling).
        assert sum(replica.zcard(store.keys.shard(s).due) for s in range(store.config.shards)) == n + 1
    finally:
        replica.close()
        master.close()


@pytest.mark.timeout(60)
def test_too_few_replicas_raise_replication_timeout_and_lose_nothing(group, redis_url, uid):
    app = sentinel_app(group, redis_url, uid, delayed_wait_replicas=2, delayed_wait_replicas_timeout_ms=100)
    t0 = time.monotonic()
    with pytest.raises(ReplicationTimeout) as err:
        apply_later(app, "e2e.mark", when=3600, task_id=f"job-{uid}", strict=False)
    assert time.monotonic() - t0 >= 0.09
    assert (err.value.acked, err.value.wanted) == (1, 2)
    assert "delayed_wait_replicas" in str(err.value) and "same task_id" in str(err.value)
    # Written on the master all the same: calling again finds it (not doubled).
    store = get_store(app)
    assert store.lookup.get(f"job-{uid}")["st"] == "SCHEDULED"
    with pytest.raises(ReplicationTimeout):
        cancel(app, f"job-{uid}")
    assert store.lookup.get(f"job-{uid}")["st"] == "CANCELLED"


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("wanted", "level"), [(0, "ok"), (1, "warning"), (2, "problem")])
def test_doctor_checks_the_replicas_against_wait_replicas(group, redis_url, uid, wanted, level):
    app = sentinel_app(group, redis_url, uid, delayed_wait_replicas=wanted)
    found = [f for f in store_findings(get_store(app)) if f.check == "replication"]
    assert [f.level for f in found] == [level], found
    assert "1 replica(s)" in found[0].message


@pytest.mark.timeout(60)
def test_status_says_where_the_store_is(group, redis_url, uid):
    conf = {"delayed_redis_url": group.url, "delayed_redis_options": {"master_name": group.master_name},
            "delayed_wait_replicas": 1}
    out = run_celery(redis_url, f"t{uid}", f"q{uid}", "delayed", "status", store=redis_url, conf=conf)
    assert out.returncode == 0, out.stderr
    assert (f"store: Sentinel master 'delayedmaster' at 127.0.0.1:{group.master_port()}, 1 replica(s) online; "
            "writes wait for 1") in out.stdout, out.stdout
    out = run_celery(redis_url, f"t{uid}", f"q{uid}", "delayed", "status", "--json", store=redis_url, conf=conf)
    assert json.loads(out.stdout)["replication"] == {
        "sentinel": "delayedmaster", "master": f"127.0.0.1:{group.master_port()}", "replicas": 1, "wait_replicas": 1}
    plain = run_celery(redis_url, f"t{uid}", f"q{uid}", "delayed", "status", store=redis_url)
    assert "store:" not in plain.stdout  # a lone server without Sentinel: nothing to say


@pytest.mark.timeout(60)
def test_with_a_database_an_unreplicated_index_is_not_an_error(group, redis_url, uid, tmp_path):
    """The row is the job: a ReplicationTimeout while indexing it is logged, the call succeeds."""
    from celery_delayed.sql.rows import get_rows

    app = sentinel_app(group, redis_url, uid, delayed_wait_replicas=2, delayed_wait_replicas_timeout_ms=50,
                       delayed_database_url=f"sqlite:///{tmp_path / 'delayed.db'}")
    rows = get_rows(app)
    assert rows is not None
    rows.init_schema()
    try:
        h = apply_later(app, "e2e.mark", when=3600, strict=False)
        assert h.indexed is True
        assert rows.get(h.id).state == "SCHEDULED"
        assert get_store(app).lookup.get(h.id)["st"] == "SCHEDULED"
    finally:
        rows.dispose()


@pytest.mark.timeout(90)
def test_every_connection_follows_a_failover(fresh_group, redis_url, uid):
    """The pool, the per-thread lane, the wake subscription and the scripts, after the master is killed."""
    group = fresh_group
    app = sentinel_app(group, redis_url, uid, delayed_shards=2, delayed_wait_replicas=1)
    store = get_store(app)
    before = apply_later(app, "e2e.mark", when=3600, strict=False)
    assert store.executions.start("no-such-job", 0, "w1").code == Reply.NOT_FOUND  # the lane is connected
    sub = store.fleet.subscribe_wake()
    wait_for(lambda: sub.get(0.1) == ("subscribed", ""), 5, what="the subscription")
    old = group.master_port()
    assert old is not None
    group.server_on(old).stop("kill")
    new = group.wait_failover(old)

    # The client's pool: the next command goes to the promoted replica (it may take
    # a retry while the Sentinels switch over: redis-py's own retries cover it).
    wait_for(lambda: _port(store) == new, 10, what="the store's client to reach the new master")
    assert store.lookup.get(before.id)["st"] == "SCHEDULED", "acknowledged with WAIT 1: the replica has it"
    # The new master has no replica yet: a write is made, but not acknowledged as replicated.
    with pytest.raises(ReplicationTimeout, match=r"only 0 of the 1 replicas"):
        apply_later(app, "e2e.mark", when=3600, task_id=f"lonely-{uid}", strict=False)
    assert store.lookup.get(f"lonely-{uid}")["st"] == "SCHEDULED"
    # The old master comes back: the Sentinels make it a replica of the new one, and writes are acknowledged again.
    group.server_on(old).start()
    wait_for(lambda: _replicas(store) >= 1, 30, what="the old master to come back as a replica")
    # Scripts: the new master may not hold them (NOSCRIPT is answered by loading them).
    after = apply_later(app, "e2e.mark", when=3600, strict=False)
    assert cancel(app, after.id) == "SCHEDULED"
    # The lane (its own connection, apart from the pool) reconnects to the new master.
    assert store.executions.start("no-such-job", 0, "w1").code == Reply.NOT_FOUND
    # The subscription made before the failover: redis-py resubscribes it through the
    # Sentinels (or it raises, and the scheduler's listener makes a new one): either way
    # it hears the new master's wake-ups.
    soon = apply_later(app, "e2e.mark", when=60, strict=False)
    # (a second job due sooner than the first, so the script publishes a wake-up)
    heard: list[Any] = []

    def hears() -> bool:
        nonlocal sub
        try:
            event = sub.get(0.1)
        except redis.ConnectionError:
            sub.close()
            sub = store.fleet.subscribe_wake()
            return False
        if event == ("subscribed", ""):
            sooner = apply_later(app, "e2e.mark", when=30, strict=False, shard_key=str(soon.shard))
            heard.append(sooner)
        return bool(heard) and event == ("due", f"{heard[-1].shard}:{heard[-1].due_ms}")

    try:
        wait_for(hears, 10, what="a wake-up from the new master")
    finally:
        sub.close()


def _replicas(store: Any) -> int:
    info = store.redis.client.info("replication")
    return sum(1 for k, v in info.items() if k.startswith("slave") and isinstance(v, dict)
               and v.get("state") == "online")


def _port(store: Any) -> int | None:
    try:
        return int(store.redis.client.info("server")["tcp_port"])
    except Exception:
        return None


@pytest.mark.timeout(90)
def test_a_switchover_is_followed(fresh_group, redis_url, uid):
    """SENTINEL FAILOVER: the old master stays up as a replica (READONLY): writes go to the new one."""
    group = fresh_group
    app = sentinel_app(group, redis_url, uid, delayed_shards=2)
    store = get_store(app)
    h = apply_later(app, "e2e.mark", when=3600, strict=False)
    assert store.executions.start("no-such-job", 0, "w1").code == Reply.NOT_FOUND  # the lane is connected
    old = group.master_port()
    assert old is not None
    sentinel = redis.Redis(port=group.sentinels[0].port)
    try:
        sentinel.execute_command("SENTINEL", "FAILOVER", group.master_name)
    finally:
        sentinel.close()
    new = group.wait_failover(old)
    # The old master becomes a replica: until then a write may still reach it.
    wait_for(lambda: _role(old) == "slave", 20, what="the old master to become a replica")

    def schedules() -> bool:
        try:
            apply_later(app, "e2e.mark", when=3600, task_id=f"after-{uid}", strict=False)
        except StoreUnavailable:  # a connection to the demoted master answered READONLY: dropped
            return False
        except DuplicateJob:
            pass
        return True

    wait_for(schedules, 10, what="a write to reach the new master")
    master = redis.Redis(port=new, decode_responses=True)
    try:
        assert master.exists(store.keys.shard(store.layout.shard_of(f"after-{uid}")).job(f"after-{uid}"))
    finally:
        master.close()
    assert cancel(app, h.id) == "SCHEDULED"
    # The lane moved too: its connection to the demoted master answered READONLY to a write
    # (or was dropped by the demotion) and was replaced by one to the new master.
    lane = store.redis.lane()
    wait_for(lambda: store.executions.start(f"after-{uid}", 0, "w1") is not None and lane.conn is not None
             and lane.conn.port == new, 10, what="the lane on the new master")


def _role(port: int) -> str | None:
    client = redis.Redis(port=port, decode_responses=True, socket_timeout=1)
    try:
        return str(client.info("replication")["role"])
    except redis.RedisError:
        return None
    finally:
        client.close()


@pytest.mark.timeout(60)
def test_auth_on_the_servers_and_on_the_sentinels(redis_url, uid):
    """The master's password in the URL, the Sentinels' own in sentinel_kwargs (kombu's convention)."""
    need("redis-server", shutil.which("redis-server") is not None)
    with SentinelGroup(password="m4ster-pw", sentinel_password="s3ntinel-pw") as group:
        assert group.url.startswith("sentinel://:m4ster-pw@127.0.0.1:")
        app = make_app(redis_url, uid, delayed_redis_url=group.url,
                       delayed_redis_options={"master_name": group.master_name,
                                              "sentinel_kwargs": {"password": "s3ntinel-pw"}})
        h = apply_later(app, "e2e.mark", when=3600, strict=False)
        assert cancel(app, h.id) == "SCHEDULED"
        assert get_store(app).executions.start("no-such-job", 0, "w1").code == Reply.NOT_FOUND  # the lane authenticates
        # Without the Sentinels' password no Sentinel answers: StoreUnavailable, the passwords not shown.
        bad = make_app(redis_url, f"{uid}b", delayed_redis_url=group.url,
                       delayed_redis_options={"master_name": group.master_name})
        with pytest.raises(StoreUnavailable) as err:
            Store(bad, fail_fast=True).redis.now_ms()
        msg = str(err.value)
        assert "m4ster-pw" not in msg and "sentinel://:***@" in msg, msg
        assert "no Sentinel named its master (AuthenticationError); nothing was written" in msg, msg
        assert len(msg) < 600, msg


@pytest.mark.timeout(90)
def test_tls_to_the_sentinels_and_the_master_through_a_failover(redis_url, uid):
    """TLS everywhere (``ssl`` for the master's connections, ``sentinel_kwargs`` for the Sentinels'), with AUTH."""
    need("redis-server", shutil.which("redis-server") is not None)
    need("openssl", shutil.which("openssl") is not None)
    with SentinelGroup(tls=True, password="m4ster-pw") as group:
        assert group.certs is not None
        tls = {"ssl": True, "ssl_ca_certs": group.certs["ca"], "ssl_cert_reqs": "required"}
        app = make_app(redis_url, uid, delayed_redis_url=group.url,
                       delayed_redis_options={"master_name": group.master_name, **tls, "sentinel_kwargs": tls})
        store = get_store(app)
        h = apply_later(app, "e2e.mark", when=3600, strict=False)
        assert store.executions.start("no-such-job", 0, "w1").code == Reply.NOT_FOUND
        lane = store.redis.lane().conn
        old = group.master_port()
        assert "SSL" in type(lane).__name__ and lane.port == old  # the master's TLS port, named by the Sentinels
        replica = group.server_client(group.replicas[0].port)
        try:  # replication runs over TLS too
            wait_for(lambda: replica.exists(store.keys.shard(h.shard).job(h.id)) == 1, 5, what="the replica")
        finally:
            replica.close()
        group.server_on(old).stop("kill")
        new = group.wait_failover(old)
        wait_for(lambda: _schedules(app), 10, what="a write to the new master")
        assert store.lookup.get(h.id)["st"] == "SCHEDULED"
        assert store.executions.start("no-such-job", 0, "w1").code == Reply.NOT_FOUND
        assert store.redis.lane().conn.port == new


def _schedules(app: Any) -> bool:
    try:
        apply_later(app, "e2e.mark", when=3600, strict=False)
    except StoreUnavailable:
        return False
    return True


@pytest.mark.timeout(60)
def test_a_runs_execution_records_reach_a_replica_before_the_worker_goes_on(group, redis_url, uid):
    # With delayed_wait_replicas the worker's records (start, end) are written then WAITed for, as a
    # producer's are: a failover right after cannot lose them, so the job cannot run a second time.
    app = sentinel_app(group, redis_url, uid, delayed_wait_replicas=1, delayed_wait_replicas_timeout_ms=5000)
    store = get_store(app)
    replica = redis.Redis(port=group.replicas[0].port, decode_responses=True)
    try:
        h = apply_later(app, "e2e.mark", when=0, strict=False)
        batch = store.release.release_due(h.shard)
        assert batch.ids == [h.id]
        key = store.keys.shard(h.shard).job(h.id)
        started = store.executions.start(h.id, h.shard, "w1")
        assert started.code == Reply.OK
        assert replica.hget(key, "st") == "RUNNING"  # no polling: WAIT returned
        done = store.executions.finish(h.id, h.shard, "w1", "SUCCEEDED")
        assert done.code == Reply.OK
        assert replica.hget(key, "st") == "SUCCEEDED"
    finally:
        replica.close()


@pytest.mark.timeout(60)
def test_a_record_the_replicas_do_not_acknowledge_in_time_stands_and_is_warned_about(group, redis_url, uid, caplog):
    app = sentinel_app(group, redis_url, uid, delayed_wait_replicas=1)
    store = get_store(app)
    h = apply_later(app, "e2e.mark", when=0, strict=False)
    store.release.release_due(h.shard)
    # the same store asking for more replicas than the group has (as when they lag past the bound)
    lagging = Store(app, dataclasses.replace(store.config, wait_replicas=3, wait_replicas_timeout_ms=100))
    with caplog.at_level("WARNING", logger="celery_delayed.worker"):
        started = lagging.executions.start(h.id, h.shard, "w1")
        outcome: list[Any] = []
        lagging.executions.finish_later(h.id, h.shard, "w1", "SUCCEEDED", on_outcome=outcome.append)
    assert started.code == Reply.OK  # the attempt goes on: the write stands on the master
    assert [o.code for o in outcome] == [Reply.OK]  # finished before finish_later returned
    warned = [r.getMessage() for r in caplog.records if "replicas of delayed_wait_replicas" in r.getMessage()]
    # one warning: after it the records are written without waiting for a while (a master left with no
    # replica must not slow every run by the WAIT bound)
    assert len(warned) == 1 and "start of job" in warned[0] and "without waiting" in warned[0], warned
    lagging.redis.close()
