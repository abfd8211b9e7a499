"""Release shaping in the store: rate limits set at run time, what they hold back, and tenants.

The release scripts enforce the limits and take tenants round-robin
(``lua/includes/shaping_release.lua``); this facet is the operators' side:
``set_limit.lua`` changes a limit on every shard without a restart, and the
reads sum each shard's wait sets and tenants' lanes (every key is kept per
shard, so every feature runs unchanged on Redis Cluster).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..rate_limits import check_key, parse_rate
from ..vocab import Field
from .facet import Facet
from .keys import ShardKeys
from .layout import ShardLayout
from .lookup import Lookup
from .paging import check_page
from .runner import Runner


@dataclass(frozen=True)
class Limit:
    """One rate limit in force (or lifted), fleet-wide."""

    key: str
    #: jobs per second the fleet releases at most; None: lifted at run time
    per_second: float | None
    #: "app" (``delayed_rate_limits``) or "runtime" (``delayed limits set``)
    source: str
    #: due jobs waiting for a token of it now, over every shard
    waiting: int


def busiest(counts: Mapping[str, int], n: int) -> tuple[list[tuple[str, int]], int, int]:
    """The ``n`` busiest tenants of :meth:`Shaping.tenants` (most jobs first, then by name), then how many
    tenants are left out and how many jobs they have: what a bounded listing or metric shows."""
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    rest = ranked[max(0, n):]
    return ranked[:max(0, n)], len(rest), sum(c for _, c in rest)


class Shaping(Facet):
    """Rate limits at run time, the jobs they hold back, and tenants' pending jobs."""

    SCRIPTS = ("set_limit",)

    def __init__(self, redis: Runner, layout: ShardLayout, lookup: Lookup) -> None:
        super().__init__(redis, layout)
        #: reads a compact record's task and queue from its template
        self.lookup = lookup

    def set_limit(self, key: str, rate: str | float | None, now_ms: int | None = None) -> None:
        """Set a rate limit on every shard at run time (``set_limit.lua``); it wins over the app's.

        ``rate``: Celery's rate string (``"50/s"``); ``0`` lifts the app's
        limit of that key; ``None`` forgets what was set at run time (the
        app's ``delayed_rate_limits`` applies again). The schedulers apply it
        on their next release, no restart needed.

        Raises:
            ConfigurationError: a bad key or rate (nothing is changed).
        """
        check_key(key, "rate limit")
        if rate is None:
            value = ""
        elif rate == 0 or rate == "0":
            value = "0"
        else:
            value = repr(parse_rate(rate, f"rate limit {key!r}"))
        self.layout.check()
        self.redis.run_many(self.redis.scripts.set_limit, [
            ([self.keys.shard(s).limits], [self.redis.now_arg(now_ms), key, value, self.keys.wake, s])
            for s in self.layout.shard_range()])

    def runtime_limits(self) -> dict[str, float]:
        """The limits set at run time (shard 0's, as every shard holds the same): key -> per second (0: lifted)."""
        raw: dict[Any, Any] = self.redis.client.hgetall(self.keys.shard(0).limits)
        return {str(k): float(v) for k, v in raw.items()}

    def limits(self) -> list[Limit]:
        """Every limit in force or lifted, with how many due jobs each holds back now."""
        runtime = self.runtime_limits()
        waiting = self.waiting()
        out: dict[str, Limit] = {}
        for key, per_s in self.config.rate_limits.items():
            out[key] = Limit(key, per_s, "app", 0)
        for key, per_s in runtime.items():
            out[key] = Limit(key, per_s if per_s > 0 else None, "runtime", 0)
        rows = []
        for key in sorted(set(out) | set(waiting)):
            base = out.get(key)
            if base is None:  # a tenant's own bucket under 'tenant:*', or a limit lifted with jobs still waiting
                star = out.get("tenant:*") if key.startswith("tenant:") else None
                base = Limit(key, star.per_second if star else None, star.source if star else "lifted", 0)
            rows.append(Limit(key, base.per_second, base.source, waiting.get(key, 0)))
        return rows

    def waiting(self) -> dict[str, int]:
        """Due jobs waiting for a token, by limit key, over every shard."""
        return self._summed(lambda k: k.limit_waits, lambda k, name: k.limit_wait(name), members="set")

    def tenants(self) -> dict[str, int]:
        """Tenants with scheduled jobs in the due index -> how many, over every shard."""
        return self._summed(lambda k: k.tenants, lambda k, name: k.tenant_lane(name), members="zset")

    def _summed(self, index: Callable[[ShardKeys], str], member_set: Callable[[ShardKeys, str], str],
                members: str) -> dict[str, int]:
        """Each name of every shard's ``index`` (a set, or a sorted set's members) -> the size of its
        ``member_set``, summed over the shards (two round trips)."""
        client = self.redis.client
        shards = [self.keys.shard(s) for s in self.layout.shard_range()]
        pipe = client.pipeline(transaction=False)
        for k in shards:
            if members == "set":
                pipe.smembers(index(k))
            else:
                pipe.zrange(index(k), 0, -1)
        per_shard = pipe.execute()
        pipe = client.pipeline(transaction=False)
        asked: list[str] = []
        for k, names in zip(shards, per_shard, strict=True):
            for name in names:
                asked.append(str(name))
                pipe.zcard(member_set(k, str(name)))
        out: dict[str, int] = {}
        for name, n in zip(asked, pipe.execute() if asked else [], strict=True):
            if int(n):
                out[name] = out.get(name, 0) + int(n)
        return out

    def tenant_job_ids(self, tenant: str, shard: int, start: int = 0, count: int = 1000) -> list[str]:
        """A page of one tenant's scheduled job ids in one shard, earliest due first."""
        ids: list[Any] = self.redis.client.zrange(
            self.keys.shard(shard).tenant_lane(tenant), start, start + count - 1)
        return [str(i) for i in ids]

    def tenant_jobs(self, tenant: str, offset: int = 0, limit: int = 50) -> list[dict[str, Any]]:
        """A page of one tenant's scheduled jobs, earliest due first over every shard.

        Each row as :meth:`Pending.page <celery_delayed.store.views.Pending.page>` gives it: ``id``,
        ``shard``, ``due`` (epoch ms), ``task``, ``queue``, ``st``. Reads at most ``offset + limit``
        entries of the tenant's lane in each shard, then the page's records: two round trips.

        Raises:
            InvalidOption: a bad page (``offset < 0``, ``limit < 1``).
        """
        check_page(offset, limit)
        client = self.redis.client
        shards = list(self.layout.shard_range())
        pipe = client.pipeline(transaction=False)
        for s in shards:
            pipe.zrange(self.keys.shard(s).tenant_lane(tenant), 0, offset + limit - 1, withscores=True)
        lanes = [[(int(due), s, str(jid)) for jid, due in lane] for s, lane in zip(shards, pipe.execute(), strict=True)]
        page = list(heapq.merge(*lanes))[offset:offset + limit]
        pipe = client.pipeline(transaction=False)
        for _, s, jid in page:
            pipe.hmget(self.keys.shard(s).job(jid), Field.TASK, Field.QUEUE, Field.STATE, Field.TEMPLATE)
        rows = []
        for (due, s, jid), (task, queue, st, tp) in zip(page, pipe.execute() if page else [], strict=True):
            task, queue = self.lookup.route_of(s, task, queue, tp)
            rows.append({"id": jid, "shard": s, "due": due, "task": task, "queue": queue, Field.STATE: st or ""})
        return rows
