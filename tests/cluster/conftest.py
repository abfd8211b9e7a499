"""A private three-master Redis Cluster for the whole session (``redis-cli --cluster create``)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest
from redis.cluster import RedisCluster
from support import need

from celery_delayed.testing import RedisClusterServers


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisClusterServers]:
    """Three masters, no replicas, on free ports; stopped after the session."""
    need("redis-server and redis-cli (Redis Cluster)",
         shutil.which("redis-server") is not None and shutil.which("redis-cli") is not None)
    with RedisClusterServers(masters=3) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def cluster_url(redis_cluster: RedisClusterServers) -> str:
    return redis_cluster.url


@pytest.fixture
def cclient(cluster_url: str) -> Iterator[RedisCluster]:
    client = RedisCluster.from_url(cluster_url, decode_responses=True)
    yield client
    client.close()


@pytest.fixture
def replicated() -> Iterator[RedisClusterServers]:
    """Three masters with a replica each (``cluster-node-timeout`` 1 s), for one failover test."""
    need("redis-server and redis-cli (Redis Cluster)",
         shutil.which("redis-server") is not None and shutil.which("redis-cli") is not None)
    with RedisClusterServers(masters=3, replicas=1, node_timeout_ms=1000) as cluster:
        yield cluster
