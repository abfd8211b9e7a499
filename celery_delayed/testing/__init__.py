"""Helpers for testing code that uses celery-delayed (nothing starts at import).

- :mod:`.kit`: :class:`DelayedTestKit`, a store with a controllable clock
  (:class:`DelayedClock`) whose due jobs run in-process, and assertions on
  what is scheduled; usable from ``unittest`` or any runner.
- :mod:`.plugin`: the pytest plugin (``delayed_*`` fixtures), registered with
  pytest's ``pytest11`` entry point.
- :mod:`.servers`: private ``redis-server`` processes on free ports.
"""

from __future__ import annotations

from .kit import DelayedClock, DelayedTestKit, RanJob, ScheduledJob
from .servers import RedisClusterServers, RedisServer, ensure_redis_server, free_port

__all__ = ["DelayedClock", "DelayedTestKit", "RanJob", "RedisClusterServers", "RedisServer", "ScheduledJob",
           "ensure_redis_server", "free_port"]
