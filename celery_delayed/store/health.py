"""What the store's Redis server says about itself that can silently break celery-delayed.

:func:`store_warnings` is read by the scheduler at start (it logs each one)
and by ``delayed status``; ``delayed doctor`` builds on it.
"""

from __future__ import annotations

from typing import Any

from redis.cluster import RedisCluster
from redis.exceptions import ResponseError

from .client import is_cluster, translate_errors
from .gateway import Store

#: The only maxmemory policy under which Redis never drops a job's keys.
SAFE_POLICY = "noeviction"
#: A store this close to maxmemory is reported full: its next writes are refused (a new client's
#: buffers alone cross the rest), and what is left moves with every connection.
FULL_AT = 0.99
#: How a warning that is only "could not check" begins.
UNCHECKED = "could not check the store's Redis"


@translate_errors
class ServerHealth:
    """Reads the store server's ``INFO`` once per call."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.url = store.url

    def info(self) -> dict[str, Any]:
        """``INFO memory`` and ``INFO persistence`` of the store's server.

        On Redis Cluster every master is asked and the worst answer kept: an
        evicting policy if any master has one, AOF off if it is off on any,
        and the memory figures of the fullest master.
        """
        client = self.store.redis.client
        if not is_cluster(client):
            info: dict[str, Any] = dict(client.info("memory"))
            info.update(client.info("persistence"))
            return info
        return _worst(self.per_master())

    def per_master(self) -> dict[str, dict[str, Any]]:
        """On Redis Cluster: ``INFO memory`` and ``INFO persistence`` of each master, by node name."""
        client: Any = self.store.redis.client
        mem = client.info("memory", target_nodes=RedisCluster.PRIMARIES)
        per = client.info("persistence", target_nodes=RedisCluster.PRIMARIES)
        return {str(n): {**mem[n], **per.get(n, {})} for n in mem}

    def replicas(self) -> int:
        """Replicas of the store's server online (``INFO replication``; on a cluster, the fewest of any master)."""
        if self.store.redis.cluster:
            cluster: Any = self.store.redis.client
            return min((_online(cluster.get_redis_connection(node).info("replication"))
                        for node in cluster.get_primaries()), default=0)
        return _online(self.store.redis.client.info("replication"))

    def replication(self) -> dict[str, Any]:
        """Where the store is: ``sentinel`` (the master name, or None), ``master`` ("host:port" for a
        Sentinel store: the one the Sentinels name now), ``replicas`` online, ``wait_replicas``."""
        pool: Any = getattr(self.store.redis.client, "connection_pool", None)  # (a cluster client has none)
        name = self.store.config.redis_options.get("master_name") if hasattr(pool, "get_master_address") else None
        master = None
        if name is not None:
            host, port = pool.get_master_address()
            master = f"{host}:{port}"
        return {"sentinel": name, "master": master, "replicas": self.replicas(),
                "wait_replicas": self.store.config.wait_replicas}

    def replication_line(self) -> str:
        """One line for ``delayed status`` ('' for a lone server without Sentinel or ``delayed_wait_replicas``)."""
        r = self.replication()
        if r["sentinel"] is None and not r["replicas"] and not r["wait_replicas"]:
            return ""
        where = f"Sentinel master {r['sentinel']!r} at {r['master']}" if r["sentinel"] else "the store's server"
        wait = f"; writes wait for {r['wait_replicas']}" if r["wait_replicas"] else "; replicated asynchronously"
        return f"store: {where}, {r['replicas']} replica(s) online{wait}"

    def warnings(self) -> list[str]:
        """One line per problem found, each saying what to do; empty when all is well.

        A server that refuses ``INFO`` (an ACL user without it) gives one line
        saying what could not be checked.
        """
        try:
            info = self.info()
        except ResponseError as exc:
            return [f"{UNCHECKED}: INFO was refused ({exc}); make sure the store's Redis has maxmemory-policy "
                    f"{SAFE_POLICY}"]
        out = []
        policy = str(info.get("maxmemory_policy", SAFE_POLICY))
        if policy != SAFE_POLICY:
            out.append(
                f"the store's Redis has maxmemory-policy {policy}: when it fills up it evicts keys, and jobs "
                f"are lost without a trace (records, index entries, the layout). Set maxmemory-policy "
                f"{SAFE_POLICY} on it (a full store then refuses new jobs with StoreFull instead)"
            )
        used, limit = int(info.get("used_memory", 0)), int(info.get("maxmemory", 0))
        if limit and used >= limit * FULL_AT:
            out.append(
                f"the store's Redis is full ({used} of maxmemory {limit} bytes, {100 * used / limit:.1f} %): "
                "new jobs are refused (StoreFull); release or purge jobs, or raise maxmemory"
            )
        return out


def _fill(info: dict[str, Any]) -> float:
    limit = int(info.get("maxmemory", 0))
    return int(info.get("used_memory", 0)) / limit if limit else 0.0


def _worst(per: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One INFO view of several masters: the worst of each figure the checks read."""
    infos = list(per.values())
    if not infos:
        return {}
    fullest = sorted(infos, key=_fill)[-1]
    out: dict[str, Any] = dict(fullest)
    evicting = [str(i.get("maxmemory_policy")) for i in infos if i.get("maxmemory_policy") != SAFE_POLICY]
    if evicting:
        out["maxmemory_policy"] = evicting[0]
    out["aof_enabled"] = min(int(i.get("aof_enabled", 0)) for i in infos)
    return out


def _online(info: dict[str, Any]) -> int:
    """Online replicas in an ``INFO replication`` reply."""
    return sum(1 for k, v in info.items()
               if k.startswith("slave") and isinstance(v, dict) and v.get("state") == "online")
