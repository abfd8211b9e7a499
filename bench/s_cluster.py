"""Scenario 18: the store on one Redis server vs a three-master Redis Cluster (issue 13).

Both release on the publish path to the same plain Redis broker (a cluster can only use that
path, so the one-server figure here is the like-for-like reference; scenario 3 has the direct
path). N jobs, all due, ~1 KB messages: the schedule rate (``store.jobs.schedule``, 2 threads) and
the release rate of one ``celery delayed run`` process. For the cluster also the spread of keys
and of script calls over the masters. Every server shares this machine's cores, so the cluster's
extra masters add no CPU here: the figures show its overhead, not its scaling (see
``bench/README.md`` for the model).
"""

from __future__ import annotations

import time
from typing import Any

import redis
from redis.cluster import RedisCluster

from celery_delayed.store import get_store
from celery_delayed.testing import RedisClusterServers, RedisServer

from .celery_app import make_app
from .common import Ctx, delayed_scheduler, delete_prefix, procs, uid, wait_for
from .s_release import _fill

S18 = "18 one server vs a 3-master Redis Cluster (publish path)"


def _calls_per_master(client: RedisCluster) -> dict[str, int]:
    """EVALSHA calls each master has served so far."""
    stats = client.info("commandstats", target_nodes=RedisCluster.PRIMARIES)
    return {str(node): int(s.get("cmdstat_evalsha", {}).get("calls", 0)) for node, s in stats.items()}


def _keys_per_master(client: RedisCluster) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for node in client.get_primaries():
        sizes[node.name] = int(client.dbsize(target_nodes=node))  # type: ignore[arg-type]
    return sizes


def _spread(counts: dict[str, int]) -> str:
    total = sum(counts.values()) or 1
    return ", ".join(f"{100 * v / total:.0f}%" for v in sorted(counts.values(), reverse=True))


def cluster(ctx: Ctx) -> None:
    n = ctx.size(200_000, 20_000)
    print(f"[{S18}] {n} due jobs, ~1 KB messages", flush=True)
    with RedisServer("--maxmemory", "0") as broker, RedisClusterServers(masters=3) as servers:
        bclient = redis.Redis.from_url(broker.url)
        cclient = RedisCluster.from_url(servers.url)
        for label, store_url, extra in (("one Redis server", ctx.redis_url, {}),
                                        ("3-master Redis Cluster", servers.url, {"delayed_redis_cluster": True})):
            u = uid()
            prefix, queue = f"b18{u}", f"q18{u}"
            conf: dict[str, Any] = {"delayed_redis_url": store_url, "delayed_release_mode": "publish", **extra}
            app = make_app(broker.url, prefix, queue, **conf)
            store = get_store(app)
            now_ms = store.redis.now_ms()
            calls0 = _calls_per_master(cclient) if extra else {}
            fill_s = _fill(store, app, n, u, lambda i, t=now_ms: str(t - 1000))
            ctx.add(S18, label, "schedule rate", n / fill_s, "jobs/s", note="store.jobs.schedule, 2 threads, 16 shards")
            if extra:
                keys = _keys_per_master(cclient)
                ctx.add(S18, label, "keys per master", max(keys.values()), "keys (largest)",
                        note=f"spread {_spread(keys)} of {sum(keys.values()):,}")
            with procs() as ps:
                ps.append(delayed_scheduler(broker.url, prefix, queue, conf=conf))
                seen = wait_for(lambda q=queue: bclient.llen(q), 120, interval=0.002)
                t0 = time.perf_counter()
                first = int(seen or 0)
                done = wait_for(lambda q=queue: bclient.llen(q) >= n, 600, interval=0.01)
                t1 = time.perf_counter()
            if done:
                ctx.add(S18, label, "release rate", (n - first) / (t1 - t0), "jobs/s",
                        note="one `celery delayed run` process, publish path to a plain Redis broker")
            else:
                ctx.add(S18, label, "release rate", None, "jobs/s",
                        note=f"only {bclient.llen(queue)} of {n} released in time")
            if extra:
                after = _calls_per_master(cclient)
                calls = {k: after[k] - calls0.get(k, 0) for k in after}
                ctx.add(S18, label, "script calls per master", max(calls.values()), "calls (busiest)",
                        note=f"spread {_spread(calls)} of {sum(calls.values()):,} (schedule + release)")
            else:
                delete_prefix(ctx.client(), f"{prefix}:*")
            bclient.unlink(queue)
        ctx.relate(S18, "release rate", "one Redis server")
        ctx.relate(S18, "schedule rate", "one Redis server")
        cclient.close()
        bclient.close()
