"""``delayed reshard`` on a three-master Redis Cluster: each move is one script on one slot (the old
shard's, then the new one's), the scan visits every master, and jobs run once (issue 13)."""

from __future__ import annotations

import collections
import random

import pytest
from celery import Celery
from redis.cluster import RedisCluster
from support import SchedulerProcess, WorkerProcess, make_app, wait_for

from celery_delayed import apply_later, apply_later_many, get_store, schedules
from celery_delayed.store import shard_for
from celery_delayed.store.reshard import Resharder

pytestmark = pytest.mark.e2e


def capp(broker: str, store: str, uid: str, **conf: object) -> Celery:
    return make_app(broker, uid, delayed_redis_url=store, delayed_redis_cluster=True, **conf)


@pytest.mark.timeout(180)
def test_reshard_16_to_40_on_a_cluster_runs_every_job_once(redis_url, cluster_url, uid, workers, cclient: RedisCluster):
    conf = {"delayed_redis_cluster": True, "delayed_lease_ms": 2000, "delayed_shards": 16}
    app = capp(redis_url, cluster_url, uid, delayed_shards=16)
    prefix, queue = app.conf.delayed_key_prefix, app.conf.task_default_queue
    rnd = random.Random(3)
    ids = [h.id for h in apply_later_many(app, "e2e.plain", [{"args": (i,), "when": rnd.uniform(1, 6)}
                                                             for i in range(600)], strict=False)]
    ids += [apply_later(app, "e2e.plain", when=rnd.uniform(1, 6), shard_key=f"k{i % 7}", strict=False).id
            for i in range(60)]
    schedules.add(app, "cluster-nightly", "e2e.plain", 3600, strict=False)
    w = WorkerProcess(redis_url, prefix, queue, store=cluster_url, conf=conf, concurrency=4, pool="threads")
    workers.extend([w, SchedulerProcess(redis_url, prefix, queue, store=cluster_url, conf=conf)])
    w.wait_ready()
    # The scheduler must be running when the reshard starts (a scheduler started afterwards with
    # delayed_shards=16 refuses the store's 40, by design); the reshard itself takes well under a second.
    wait_for(lambda: cclient.zcard(f"{prefix}:schedulers") > 0, 30, what="the scheduler to join")

    report = Resharder(get_store(app)).run(40, wait_s=60)
    assert report.finished, report
    assert report.moved_jobs > 300 and report.moved_schedules in (0, 1)
    more = [apply_later(app, "e2e.plain", when=rnd.uniform(0, 2), strict=False).id for _ in range(50)]
    everything = ids + more

    def count() -> collections.Counter[str]:
        return collections.Counter(str(x).split("|")[0] for x in cclient.lrange(f"{prefix}:ran", 0, -1))

    try:
        wait_for(lambda: len(count()) >= len(everything), 90, interval=0.2, what=f"{len(everything)} runs")
    except AssertionError:  # say which jobs did not run, and where their records are
        missing = sorted(set(everything) - set(count()))
        store = get_store(capp(redis_url, cluster_url, uid, delayed_shards=40))
        states = collections.Counter()
        for job_id in missing:
            try:
                rec = store.lookup.get(job_id)
                states[(rec.get("st"), rec.get("shard"))] += 1
            except Exception as exc:  # a diagnosis: report whatever is wrong
                states[(type(exc).__name__, None)] += 1
        raise AssertionError(f"{len(missing)} of {len(everything)} jobs did not run: (state, shard) counts "
                             f"{dict(states.most_common(10))}; first {missing[:3]}") from None
    runs = count()
    assert set(everything) <= set(runs), f"{len(set(everything) - set(runs))} lost"
    assert max(runs[j] for j in everything) == 1, "a job ran twice"
    assert cclient.hgetall(f"{prefix}:layout") == {"shards": "40", "bucket_ms": "0"}
    store = get_store(capp(redis_url, cluster_url, uid, delayed_shards=40))
    for job_id in everything[::10]:
        rec = store.lookup.get(job_id)
        assert int(rec["shard"]) == shard_for(rec.get("sk") or job_id, 40)
    assert schedules.get(app, "cluster-nightly").name == "cluster-nightly"
