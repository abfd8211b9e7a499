"""Release shaping on a three-master Redis Cluster: a rate limit and tenants' fairness with real schedulers and a
real worker (the store on the cluster, the broker a plain Redis: the publish path).

Every key of a limit or a tenant is kept per shard (one slot), so the release scripts run unchanged on a
cluster; what the fleet promises is checked as in ``tests/e2e/test_shaping_e2e.py`` (``support/shaping.py``).
"""

from __future__ import annotations

from typing import Any

import pytest
import redis
from celery import Celery
from redis.cluster import RedisCluster
from support import make_app, wait_for
from support.delivery import pending, queue_keys
from support.shaping import (
    FREE,
    LIMITED,
    assert_within_rate,
    balanced_ids,
    burst,
    check_tenants_fair,
    due_at,
    released_jobs,
    released_so_far,
    schedule,
    start_fleet,
    summary,
    wait_ran_once,
)

from celery_delayed import apply_later_many, get_store, pause, resume

pytestmark = pytest.mark.e2e


def capp(broker: str, store: str, uid: str, **conf: Any) -> Celery:
    app = make_app(broker, uid, delayed_redis_url=store, **conf)
    assert get_store(app).redis.cluster and get_store(app).layout.release_path[0] == "publish"
    return app


@pytest.mark.timeout(120)
def test_a_rate_limit_holds_across_schedulers_on_a_cluster(redis_url: str, cluster_url: str, uid: str,
                                                           cclient: RedisCluster, workers: list[Any]) -> None:
    rate, shards, n = 40.0, 8, 160
    conf = {"delayed_redis_cluster": True, "delayed_shards": shards, "delayed_lease_ms": 2000,
            "delayed_rate_limits": {LIMITED: f"{rate:g}/s"}}
    app = capp(redis_url, cluster_url, uid, **conf)
    fleet = start_fleet(workers, app, redis_url, cclient, conf, schedulers=2, store=cluster_url)
    ids = schedule(app, LIMITED, n, due_at(1.5), ids=balanced_ids(n, shards))
    wait_ran_once(cclient, fleet.prefix, ids, timeout=n / rate * 3 + 20)
    assert pending(app) == 0
    jobs = released_jobs(app, ids)
    took = (max(j.released for j in jobs) - min(j.due for j in jobs)) / 1000
    print(f"\ncluster: {summary(jobs, rate)}; the last {took:.2f} s after the due time")
    assert min(j.late for j in jobs) >= 0, "a limited job was released before it was due"
    assert_within_rate([j.released for j in jobs], rate, shards)
    ideal = (n - burst(rate, shards)) / rate
    assert ideal * 0.95 <= took <= ideal * 1.15 + 0.3, f"took {took:.2f} s, {ideal:.2f} s at the limit"


@pytest.mark.timeout(120)
def test_a_small_tenant_is_not_queued_behind_a_flood_on_a_cluster(redis_url: str, cluster_url: str, uid: str,
                                                                  cclient: RedisCluster, rclient: redis.Redis,
                                                                  workers: list[Any]) -> None:
    # (see the same test in tests/e2e/test_shaping_e2e.py for the shards and the batch size)
    shards, n, batch = 4, 3000, 100
    conf = {"delayed_redis_cluster": True, "delayed_shards": shards, "delayed_lease_ms": 2000,
            "delayed_lookahead_ms": 0, "delayed_batch_size": batch}
    app = capp(redis_url, cluster_url, uid, **conf)
    fleet = start_fleet(workers, app, redis_url, cclient, conf, schedulers=2, store=cluster_url)
    pause(app)  # everything due at one moment before the schedulers see any
    flood = [h.id for h in apply_later_many(app, FREE, [{"args": (i,)} for i in range(n)], tenant="big",
                                            strict=False)]
    small = [h.id for h in apply_later_many(app, FREE, [{"args": (i,)} for i in range(10)], tenant="small",
                                            strict=False)]
    resume(app)
    wait_for(lambda: len(released_so_far(app, flood)) == n, 60, interval=0.2, what="the flood to be released")
    # On the publish path a job counts as released when its publish is confirmed, and a scheduler publishes
    # one shard's batch after the other: a small tenant's job waits for the batches of the shards before its
    # own (in the first batch of its shard all the same), about a second on this machine.
    check_tenants_fair(app, flood, small, batch, "cluster tenants", max_late_ms=2000)
    wait_ran_once(cclient, fleet.prefix, small, timeout=60)
    fleet.worker.stop()
    rclient.delete(*queue_keys(str(app.conf.task_default_queue)))
