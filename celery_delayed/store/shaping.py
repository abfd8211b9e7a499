"""Release shaping in the store: rate limits set at run time, what they hold back, and tenants.

The release scripts enforce the limits and take tenants round-robin
(``lua/includes/shaping_release.lua``); this facet is the operators' side:
``set_limit.lua`` changes a limit on every shard without a restart, and the
reads sum each shard's wait sets and tenants' lanes (every key is kept per
shard, so every feature runs unchanged on Redis Cluster).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..rate_limits import check_key, parse_rate
from .facet import Facet


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


class Shaping(Facet):
    """Rate limits at run time, the jobs they hold back, and tenants' pending jobs."""

    SCRIPTS = ("set_limit",)

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
        client = self.redis.client
        pipe = client.pipeline(transaction=False)
        shards = list(self.layout.shard_range())
        for s in shards:
            pipe.smembers(self.keys.shard(s).limit_waits)
        per_shard = pipe.execute()
        pipe = client.pipeline(transaction=False)
        asked: list[str] = []
        for s, keys in zip(shards, per_shard, strict=True):
            for k in keys:
                asked.append(str(k))
                pipe.zcard(self.keys.shard(s).limit_wait(str(k)))
        out: dict[str, int] = {}
        for k, n in zip(asked, pipe.execute() if asked else [], strict=True):
            if int(n):
                out[k] = out.get(k, 0) + int(n)
        return out

    def tenants(self) -> dict[str, int]:
        """Tenants with scheduled jobs in the due index -> how many, over every shard."""
        client = self.redis.client
        shards = list(self.layout.shard_range())
        pipe = client.pipeline(transaction=False)
        for s in shards:
            pipe.zrange(self.keys.shard(s).tenants, 0, -1)
        names = pipe.execute()
        pipe = client.pipeline(transaction=False)
        asked: list[str] = []
        for s, tns in zip(shards, names, strict=True):
            for tn in tns:
                asked.append(str(tn))
                pipe.zcard(self.keys.shard(s).tenant_lane(str(tn)))
        out: dict[str, int] = {}
        for tn, n in zip(asked, pipe.execute() if asked else [], strict=True):
            if int(n):
                out[tn] = out.get(tn, 0) + int(n)
        return out

    def tenant_job_ids(self, tenant: str, shard: int, start: int = 0, count: int = 1000) -> list[str]:
        """A page of one tenant's scheduled job ids in one shard, earliest due first."""
        ids: list[Any] = self.redis.client.zrange(
            self.keys.shard(shard).tenant_lane(tenant), start, start + count - 1)
        return [str(i) for i in ids]
