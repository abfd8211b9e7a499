"""The store on a three-master Redis Cluster (issue 13): one slot per script, shards over every
master, release on the publish path to a plain Redis broker, scans that visit every master.

The broker is the session's private plain redis-server; the store is the cluster.
"""

from __future__ import annotations

import collections
import json
import threading
import time

import pytest
import redis
from celery import Celery
from redis.cluster import RedisCluster
from support import SchedulerProcess, WorkerProcess, make_app, run_celery, wait_for

from celery_delayed import apply_later, apply_later_many, cancel, dlq, get_store, reschedule
from celery_delayed.errors import ConfigurationError, StoreFull, StoreUnavailable
from celery_delayed.scheduler import Scheduler
from celery_delayed.store import Store
from celery_delayed.store.health import ServerHealth

pytestmark = pytest.mark.e2e


def capp(broker: str, store: str, uid: str, **conf: object) -> Celery:
    return make_app(broker, uid, delayed_redis_url=store, delayed_redis_cluster=True, **conf)


def runs(client: RedisCluster, prefix: str) -> collections.Counter[str]:
    return collections.Counter(str(x).split("|")[0] for x in client.lrange(f"{prefix}:ran", 0, -1))


def start(broker: str, store: str, app: Celery, workers: list, schedulers: int = 1,
          conf: dict | None = None) -> WorkerProcess:
    prefix, queue = app.conf.delayed_key_prefix, app.conf.task_default_queue
    conf = {"delayed_redis_cluster": True, "delayed_lease_ms": 2000, **(conf or {})}
    w = WorkerProcess(broker, prefix, queue, store=store, conf=conf, concurrency=4, pool="threads")
    workers.append(w)
    for _ in range(schedulers):
        workers.append(SchedulerProcess(broker, prefix, queue, store=store, conf=conf))
    w.wait_ready()
    return w


@pytest.mark.timeout(30)
def test_settings(redis_url, cluster_url, uid):
    with pytest.raises(ConfigurationError, match="database 0 only"):
        get_store(capp(redis_url, cluster_url.replace("/0", "/2"), uid))
    with pytest.raises(ConfigurationError, match="Redis Cluster"):
        get_store(capp(redis_url, cluster_url, uid, delayed_release_mode="direct"))
    store = get_store(capp(redis_url, cluster_url, uid))
    assert store.layout.release_path[0] == "publish" and not store.broker.direct
    # A store URL without a database is fine too.
    assert get_store(capp(redis_url, cluster_url.removesuffix("/0"), uid + "b")).redis.now_ms() > 0


@pytest.mark.timeout(30)
def test_every_fleet_wide_key_pair_shares_a_slot_and_shards_spread_over_every_master(redis_url, cluster_url, uid,
                                                                                     cclient):
    store = get_store(capp(redis_url, cluster_url, uid, delayed_shards=16))
    k = store.keys
    assert cclient.keyslot(k.schedulers) == cclient.keyslot(k.scheduler_settings)
    masters = set()
    for s in range(16):
        sk = k.shard(s)
        slots = {cclient.keyslot(key) for key in (sk.due, sk.lease, sk.fence, sk.job("x"), sk.released,
                                                   sk.stats, sk.paused, sk.index("3:abc:q"), sk.template("t"))}
        assert len(slots) == 1, s
        masters.add(cclient.get_node_from_key(sk.due).name)
    assert len(masters) == 3, "16 shards should land on all three masters"


@pytest.mark.timeout(120)
def test_schedule_release_cancel_reschedule_on_the_publish_path(redis_url, cluster_url, uid, workers, cclient):
    app = capp(redis_url, cluster_url, uid, delayed_shards=16)
    prefix = app.conf.delayed_key_prefix
    w = start(redis_url, cluster_url, app, workers)
    n = 300
    ids = [h.id for h in apply_later_many(app, "e2e.plain", [{"args": (i,), "when": 3.0 + 2.0 * i / n}
                                                             for i in range(n)], strict=False)]
    marked = [apply_later(app, "e2e.mark", when=1.5, strict=False).id for _ in range(20)]
    store = get_store(app)
    keys = {store.layout.shard_of("", f"k{j}"): f"k{j}" for j in range(200)}
    far = [apply_later(app, "e2e.mark", when=3600, shard_key=keys[s], strict=False).id for s in range(16)]
    cancelled = ids[-20:]
    for i in cancelled:
        assert cancel(app, i) == "SCHEDULED"  # the state it had
    later = ids[n // 2:n // 2 + 10]
    for i in later:
        reschedule(app, i, 5.0)
    # status over every master: the jobs are counted from every shard; the release path is said
    res = run_celery(redis_url, prefix, app.conf.task_default_queue, "delayed", "status", "--json",
                     store=cluster_url, conf={"delayed_redis_cluster": True})
    assert res.returncode == 0, res.stderr
    status = json.loads(res.stdout)
    assert status["release_path"] == "publish" and status["cluster"] is True
    listed = run_celery(redis_url, prefix, app.conf.task_default_queue, "delayed", "list", "--json", "--limit",
                        "1000", store=cluster_url, conf={"delayed_redis_cluster": True})
    assert listed.returncode == 0, listed.stderr
    got = {json.loads(line)["id"] for line in listed.stdout.splitlines() if line.strip()}
    assert set(far) <= got, "delayed list missed a master's jobs"
    pending = {r["shard"]: r["pending"] for r in status["shards"]}
    assert set(pending) == set(range(16)) and all(v >= 1 for v in pending.values()), pending  # the far jobs
    for i in far:
        cancel(app, i)
    want = set(ids) - set(cancelled) | set(marked)
    wait_for(lambda: set(runs(cclient, prefix)) >= want, 60, interval=0.2, what=f"{len(want)} runs")
    time.sleep(0.5)
    counts = runs(cclient, prefix)
    assert set(counts) == want, "a cancelled job ran" if set(counts) - want else "a job was lost"
    assert max(counts.values()) == 1, [k for k, v in counts.items() if v > 1][:5]
    for i in later:  # rescheduled: released after the new time
        rec = store.lookup.get(i)
        assert int(rec["released"]) >= int(rec["due"]) - store.config.lookahead_ms
    w.stop()


@pytest.mark.timeout(120)
def test_retries_and_the_dead_letter_queue(redis_url, cluster_url, uid, workers, cclient):
    conf = {"imports": ["retry_tasks"], "delayed_backoff": "fixed", "delayed_backoff_base_s": 0.3}
    app = capp(redis_url, cluster_url, uid, **conf)
    prefix = app.conf.delayed_key_prefix
    start(redis_url, cluster_url, app, workers, conf=conf)
    flaky = [apply_later(app, "rt.flaky", args=(2,), when=0.2, strict=False).id for _ in range(6)]
    doomed = [apply_later(app, "rt.doomed", args=(i,), when=0.2, strict=False).id for i in range(6)]
    wait_for(lambda: dlq.count(app) == len(doomed), 60, interval=0.2, what="the dead letters")
    wait_for(lambda: all(runs(cclient, prefix)[i] == 3 for i in flaky), 60, interval=0.2, what="the retries")
    counts = runs(cclient, prefix)
    assert all(counts[i] == 2 for i in doomed), {i: counts[i] for i in doomed}  # max_attempts=2
    # The DLQ listing visits every master.
    assert {d.id for d in dlq.list_dead(app, limit=100)} == set(doomed)
    assert dlq.purge(app) == len(doomed)
    assert dlq.count(app) == 0


@pytest.mark.timeout(180)
def test_two_racing_schedulers_release_each_job_once(redis_url, cluster_url, uid, workers, cclient):
    app = capp(redis_url, cluster_url, uid, delayed_shards=16)
    prefix = app.conf.delayed_key_prefix
    w = start(redis_url, cluster_url, app, workers, schedulers=2)
    n = 3000
    ids: list[str] = []
    for k in range(0, n, 1000):
        ids += [h.id for h in apply_later_many(
            app, "e2e.plain", [{"args": (i,), "when": 1.0 + 4.0 * i / n} for i in range(k, k + 1000)],
            strict=False)]
    wait_for(lambda: len(runs(cclient, prefix)) >= n, 90, interval=0.2, what=f"{n} runs")
    time.sleep(1.0)
    w.stop()
    counts = runs(cclient, prefix)
    assert set(counts) == set(ids), f"{len(set(ids) - set(counts))} lost"
    dup = [k for k, v in counts.items() if v > 1]
    assert not dup, f"{len(dup)} ran twice"
    snap_owners = {get_store(app).redis.client.get(get_store(app).keys.shard(s).lease) for s in range(16)}
    assert len({o.rpartition("|")[0] for o in snap_owners if o}) == 2, "both schedulers held shards"


@pytest.mark.timeout(60)
def test_in_process_scheduler_and_a_cluster_that_is_down(redis_url, cluster_url, uid):
    app = capp(redis_url, cluster_url, uid, delayed_shards=4)
    store = get_store(app)
    h = apply_later(app, "e2e.mark", when=0.0, strict=False)
    sched = Scheduler(app)
    try:
        sched.preflight()
        sched._heartbeat()
        assert sorted(sched.shards) == [0, 1, 2, 3]
        assert sched.release_due() == 1
        assert store.lookup.get(h.id)["st"] == "QUEUED"
    finally:
        sched.on_exit()
    # Nothing listening there: the typed error, not a redis-py one (on first use: a scheduler
    # made while the cluster is down starts and retries).
    down = Store(capp(redis_url, "redis://127.0.0.1:1/0", uid + "x"))
    with pytest.raises(StoreUnavailable):
        down.redis.now_ms()
    with pytest.raises(StoreUnavailable):
        apply_later(capp(redis_url, "redis://127.0.0.1:1/0", uid + "y"), "e2e.mark", when=5, strict=False)


@pytest.mark.timeout(30)
def test_server_checks_ask_every_master(redis_url, cluster_url, uid, redis_cluster):
    store = get_store(capp(redis_url, cluster_url, uid))
    health = ServerHealth(store)
    assert len(health.per_master()) == 3
    assert health.warnings() == []
    last = redis.Redis(port=redis_cluster.nodes[2].port)
    old = last.config_get("maxmemory-policy")["maxmemory-policy"]
    last.config_set("maxmemory-policy", "allkeys-lru")
    try:
        assert any("allkeys-lru" in w for w in health.warnings())
    finally:
        last.config_set("maxmemory-policy", old)
        last.close()


@pytest.mark.timeout(60)
def test_a_batch_refused_by_one_full_node_says_which_jobs_the_other_nodes_stored(redis_url, cluster_url, uid,
                                                                                redis_cluster, cclient):
    # A batch's shards live on three masters, each with its own maxmemory: one full node refuses only
    # its own calls. The error must not say "nothing was written", and must say what was.
    app = capp(redis_url, cluster_url, uid)
    store = get_store(app)
    apply_later(app, "t.full", when=60, strict=False)  # the store exists

    def pending() -> set[str]:
        return {str(j) for i in range(store.layout.shards) for j in cclient.zrange(store.keys.shard(i).due, 0, -1)}

    before = pending()
    full = redis.Redis(port=redis_cluster.nodes[0].port)
    full.config_set("maxmemory", 1)
    calls = [{"args": (i,), "when": 60} for i in range(48)]
    try:
        with pytest.raises(StoreFull) as err:
            apply_later_many(app, "t.full", calls, strict=False)
        written = err.value.written
        assert 0 < len(written) < len(calls)
        assert f"{len(written)} of the 48 jobs were written" in str(err.value)
        assert "nothing was written" not in str(err.value) and "maxmemory" in str(err.value)
        assert pending() - before == {h.id for h in written.values()}  # exactly those, and stored
        assert all(cclient.get_node_from_key(store.keys.shard(h.shard).due).port != redis_cluster.nodes[0].port
                   for h in written.values())
    finally:
        full.config_set("maxmemory", 0)
        full.close()
    # Room again: the calls not written are scheduled, and every call has one job.
    rest = apply_later_many(app, "t.full", [c for i, c in enumerate(calls) if i not in written], strict=False)
    assert len(pending() - before) == len(calls) == len(rest) + len(written)


@pytest.mark.timeout(60)
def test_a_job_due_sooner_wakes_the_sleeping_scheduler_through_cluster_pubsub(redis_url, cluster_url, uid):
    app = capp(redis_url, cluster_url, uid, delayed_shards=4, delayed_lookahead_ms=0, delayed_lease_ms=40_000)
    store = get_store(app)
    apply_later(app, "e2e.mark", when=3600, strict=False)
    sched = Scheduler(app)  # asleep toward the far job: up to 10 s between heartbeats
    thread = threading.Thread(target=sched.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: sched.ready.is_set() and sched.listening, 15, what="the scheduler to listen")
        time.sleep(0.5)
        h = apply_later(app, "e2e.mark", when=1.0, strict=False)
        wait_for(lambda: store.lookup.get(h.id)["st"] == "QUEUED", 5, interval=0.02, what="the wake-up")
        rec = store.lookup.get(h.id)
        assert int(rec["released"]) - int(rec["due"]) < 1000
    finally:
        sched.stop()
        thread.join(10)


@pytest.mark.timeout(60)
def test_the_other_scripts_each_run_in_one_slot(redis_url, cluster_url, uid):
    """Scripts the end-to-end cases above do not reach, called once each on the cluster."""
    app = capp(redis_url, cluster_url, uid, delayed_shards=8)
    store = get_store(app)
    far = [apply_later(app, "e2e.mark", when=3600, strict=False) for _ in range(16)]
    # keyed jobs (schedule_keyed.lua)
    d1 = apply_later(app, "e2e.mark", when=600, debounce_key="k1", strict=False)
    d2 = apply_later(app, "e2e.mark", when=900, debounce_key="k1", strict=False)
    assert d1.id == d2.id
    t1 = apply_later(app, "e2e.mark", when=600, throttle_key="k2", window=60, strict=False)
    assert apply_later(app, "e2e.mark", when=600, throttle_key="k2", window=60, strict=False).id == t1.id
    # operators' controls (pause.lua, promote.lua, cancel_matching.lua)
    store.jobs.pause(["all"])
    assert "all" in store.jobs.pauses()
    assert store.jobs.resume(["all"]) == 0
    store.jobs.promote(far[0].id)
    rec = store.lookup.get(far[0].id)
    assert rec["st"] == "SCHEDULED" and int(rec["due"]) <= store.redis.now_ms() + 1000
    assert store.jobs.promote_matching(task="e2e.mark") >= 1
    assert store.jobs.note_fallback(3, "e2e.mark", "why") == 1
    # the worker side on a claimed, acknowledged job (start, extend_lease, retry, fail, dead,
    # requeue, rerelease, refuse_claimed)
    h = far[1]
    batch = store.release.claim_due(h.shard, "", "", limit=100)
    assert h.id in batch.ids
    store.release.refuse_claimed(h.shard, [(i, "refused", False) for i in batch.ids if i != h.id])
    store.release.ack_claimed(h.shard, [h.id])
    assert store.executions.start(h.id, h.shard, "w1").code == 1
    assert store.executions.extend_lease(h.id, h.shard, "w1")
    assert store.executions.dead(h.id, h.shard, {}, owner="w1").code == 1
    _due, outcomes = store.dead_letters.requeue(h.shard, [h.id], "+0")
    assert [int(o.code) for o in outcomes] == [-4]  # ran: NO_MESSAGE (the started job's message was dropped)
    assert isinstance(store.release.rerelease(h.shard, [h.id], 3), list)
    left = store.jobs.cancel_matching(task="e2e.mark")
    assert len(left) >= 10
