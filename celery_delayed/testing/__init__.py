"""Helpers for testing code that uses celery-delayed (nothing starts at import).

- :mod:`.servers`: private ``redis-server`` processes on free ports.
"""

from __future__ import annotations

from .servers import RedisClusterServers, RedisServer, ensure_redis_server, free_port

__all__ = ["RedisClusterServers", "RedisServer", "ensure_redis_server", "free_port"]
