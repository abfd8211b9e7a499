"""``delayed_redis_cluster = "auto"`` (the default): a plain ``redis://`` URL of any cluster node just works.

The store asks the server once, when its client is made (``INFO cluster``, or
``CLUSTER SLOTS`` for a user refused INFO), and keeps the answer: on a
single server the client stays the plain one, on a cluster node it becomes
redis-py's cluster client and release takes the publish path.
"""

from __future__ import annotations

import collections
import json
import logging
import time

import pytest
import redis
from redis.cluster import RedisCluster
from support import RedisServer, SchedulerProcess, WorkerProcess, free_port, make_app, run_celery, wait_for

from celery_delayed import apply_later, apply_later_many, cancel, get_store, reschedule
from celery_delayed.errors import ConfigurationError, StoreUnavailable
from celery_delayed.store import Store
from celery_delayed.store.client import is_cluster
from celery_delayed.testing import RedisClusterServers

pytestmark = pytest.mark.e2e


def runs(client: RedisCluster, prefix: str) -> collections.Counter[str]:
    return collections.Counter(str(x).split("|")[0] for x in client.lrange(f"{prefix}:ran", 0, -1))


def info_calls(ports: list[int]) -> int:
    """``INFO`` commands the servers on ``ports`` have served (each call here counts one too)."""
    total = 0
    for port in ports:
        c = redis.Redis(port=port)
        total += int(c.info("commandstats").get("cmdstat_info", {}).get("calls", 0))
        c.close()
    return total


def other_node_url(cluster: RedisClusterServers) -> str:
    """The URL of a node other than the one the fixtures name (any node will do)."""
    return cluster.nodes[-1].url


@pytest.mark.timeout(60)
def test_a_plain_url_of_any_node_is_found_to_be_a_cluster_with_one_question(redis_url, redis_cluster, uid):
    url = other_node_url(redis_cluster)
    app = make_app(redis_url, uid, delayed_redis_url=url, delayed_shards=8)  # nothing says "cluster"
    assert get_store(app).config.redis_cluster == "auto"
    ports = [n.port for n in redis_cluster.nodes]
    before = info_calls(ports)
    store = get_store(app)
    assert store.redis.cluster and is_cluster(store.redis.client)
    assert store.layout.release_path == ("publish", 'the store is a Redis Cluster (found by delayed_redis_cluster '
                                                    '"auto"): kombu cannot read queues from one')
    assert not store.broker.direct
    # Work on every master, then count the questions: one INFO, when the client was made.
    handles = [apply_later(app, "e2e.mark", when=3600, strict=False) for _ in range(40)]
    for h in handles[:20]:
        assert cancel(app, h.id) == "SCHEDULED"
    assert {store.lookup.get(h.id)["st"] for h in handles[20:]} == {"SCHEDULED"}
    assert len({store.layout.shard_of(h.id) for h in handles}) > 3
    assert info_calls(ports) - before == 1 + len(ports), "the detection asked more than once"
    # A second store of the app (another prefix, as a worker makes) asks again, once.
    other = get_store(app, prefix=f"o{uid}")
    assert other.redis.cluster and is_cluster(other.redis.client)


@pytest.mark.timeout(30)
def test_a_single_server_keeps_the_plain_client_and_its_direct_path(redis_url, uid):
    with RedisServer() as server:
        app = make_app(server.url, uid)  # the store is the broker's server: the direct path
        store = get_store(app)
        before = info_calls([server.port])
        assert store.redis.cluster is False and not is_cluster(store.redis.client)
        assert store.broker.direct and store.layout.release_path[0] == "direct"
        for _ in range(30):
            h = apply_later(app, "e2e.mark", when=3600, strict=False)
            assert store.lookup.get(h.id)["st"] == "SCHEDULED"
            reschedule(app, h.id, 1800)
        assert info_calls([server.port]) - before == 1 + 1, "one INFO (the detection) besides the count's own"
        # False: not even asked.
        app2 = make_app(server.url, uid + "f", delayed_redis_cluster=False)
        before = info_calls([server.port])
        assert get_store(app2).redis.now_ms() > 0 and get_store(app2).redis.cluster is False
        assert info_calls([server.port]) - before == 1


@pytest.mark.timeout(60)
def test_a_user_refused_info_falls_back_to_cluster_slots_or_to_a_single_server(redis_cluster, uid, caplog):
    # A single server: INFO refused, CLUSTER allowed -> "cluster support disabled" -> single, quietly.
    with RedisServer() as server:
        admin = redis.Redis(port=server.port)
        admin.acl_setuser("noinfo", enabled=True, passwords=["+pw"], keys=["*"], channels=["*"],
                          commands=["+@all", "-info"])
        admin.acl_setuser("neither", enabled=True, passwords=["+pw"], keys=["*"], channels=["*"],
                          commands=["+@all", "-info", "-cluster"])
        url = f"redis://noinfo:pw@127.0.0.1:{server.port}/0"
        with caplog.at_level(logging.WARNING, logger="celery_delayed.store"):
            app = make_app(url, uid)
            h = apply_later(app, "e2e.mark", when=3600, strict=False)
            assert get_store(app).redis.cluster is False and get_store(app).lookup.get(h.id)["st"] == "SCHEDULED"
        assert not [r for r in caplog.records if r.name == "celery_delayed.store"]
        # Both refused: a single server, said once in a warning that says what to set.
        url = f"redis://neither:pw@127.0.0.1:{server.port}/0"
        with caplog.at_level(logging.WARNING, logger="celery_delayed.store"):
            app = make_app(url, uid + "n")
            h = apply_later(app, "e2e.mark", when=3600, strict=False)
            assert get_store(app).redis.cluster is False and get_store(app).lookup.get(h.id)["st"] == "SCHEDULED"
        [record] = [r for r in caplog.records if "could not tell" in r.getMessage()]
        assert "delayed_redis_cluster = False" in record.getMessage() and ":***@" in record.getMessage()
        admin.close()
    # A cluster whose user may not run INFO: CLUSTER SLOTS answers, and the cluster is found.
    for node in redis_cluster.nodes:
        c = redis.Redis(port=node.port)
        c.acl_setuser(f"ni{uid}", enabled=True, passwords=["+pw"], keys=["*"], channels=["*"],
                      commands=["+@all", "-info"])
        c.close()
    try:
        url = f"redis://ni{uid}:pw@127.0.0.1:{redis_cluster.nodes[0].port}/0"
        app = make_app("amqp://", uid + "c", delayed_redis_url=url)
        h = apply_later(app, "e2e.mark", when=3600, strict=False)
        assert get_store(app).redis.cluster and get_store(app).lookup.get(h.id)["st"] == "SCHEDULED"
    finally:
        for node in redis_cluster.nodes:
            c = redis.Redis(port=node.port)
            c.acl_deluser(f"ni{uid}")
            c.close()


@pytest.mark.timeout(30)
def test_what_cannot_work_on_the_cluster_found_is_refused_at_first_use(redis_url, cluster_url, uid):
    db2 = cluster_url.removesuffix("/0") + "/2"
    with pytest.raises(ConfigurationError, match="database 0 only"):
        get_store(make_app(redis_url, uid, delayed_redis_url=db2)).redis.now_ms()
    with pytest.raises(ConfigurationError, match="delayed_release_mode is 'direct'"):
        get_store(make_app(redis_url, uid, delayed_redis_url=cluster_url, delayed_release_mode="direct")).redis.now_ms()
    # The broker on the cluster node too (the store defaults to it): kombu cannot use a cluster.
    with pytest.raises(ConfigurationError, match="kombu cannot use a cluster"):
        apply_later(make_app(cluster_url, uid), "e2e.mark", when=60, strict=False)
    # Sentinel URLs are never asked (a Sentinel master is not a cluster node): no connection made.
    sentinel = make_app("amqp://", uid, delayed_redis_url="sentinel://127.0.0.1:1",
                        delayed_redis_options={"master_name": "m"})
    assert get_store(sentinel).redis.cluster is False


@pytest.mark.timeout(30)
def test_a_server_down_at_first_use_is_asked_again_later(uid):
    port = free_port()
    app = make_app("amqp://", uid, delayed_redis_url=f"redis://127.0.0.1:{port}/0")
    store = Store(app)
    with pytest.raises(StoreUnavailable, match="nothing was written"):
        _ = store.redis.cluster
    with pytest.raises(StoreUnavailable):
        apply_later(app, "e2e.mark", when=60, strict=False)
    with RedisServer(port=port):
        assert store.redis.cluster is False and store.redis.now_ms() > 0


@pytest.mark.timeout(120)
def test_end_to_end_on_a_plain_node_url(redis_url, redis_cluster, uid, workers):
    """Worker, scheduler and CLI given a node's plain URL and no cluster setting: every job runs once."""
    url = other_node_url(redis_cluster)
    conf = {"delayed_lease_ms": 2000, "delayed_shards": 8}
    app = make_app(redis_url, uid, delayed_redis_url=url, **conf)
    prefix, queue = app.conf.delayed_key_prefix, app.conf.task_default_queue
    w = WorkerProcess(redis_url, prefix, queue, store=url, conf=conf, concurrency=4, pool="threads")
    workers.append(w)
    workers.append(SchedulerProcess(redis_url, prefix, queue, store=url, conf=conf))
    w.wait_ready()
    ids = [h.id for h in apply_later_many(app, "e2e.plain", [{"args": (i,), "when": 1.0 + 2.0 * i / 200}
                                                             for i in range(200)], strict=False)]
    far = [apply_later(app, "e2e.mark", when=3600, strict=False).id for _ in range(8)]
    for i in ids[-10:]:
        cancel(app, i)
    res = run_celery(redis_url, prefix, queue, "delayed", "status", "--json", store=url, conf=conf)
    assert res.returncode == 0, res.stderr
    status = json.loads(res.stdout)
    assert status["cluster"] is True and status["release_path"] == "publish", status
    assert "found by" in status["release_path_reason"]
    text = run_celery(redis_url, prefix, queue, "delayed", "status", store=url, conf=conf)
    assert 'release path: publish (the store is a Redis Cluster (found by delayed_redis_cluster "auto")' in text.stdout
    cclient = RedisCluster.from_url(url, decode_responses=True)
    want = set(ids[:-10])
    wait_for(lambda: set(runs(cclient, prefix)) >= want, 60, interval=0.2, what=f"{len(want)} runs")
    time.sleep(0.5)
    counts = runs(cclient, prefix)
    assert set(counts) == want, "a cancelled job ran" if set(counts) - want else "a job was lost"
    assert max(counts.values()) == 1
    assert {get_store(app).lookup.get(i)["st"] for i in far} == {"SCHEDULED"}
    cclient.close()
    w.stop()
