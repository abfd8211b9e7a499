"""Fleet-wide figures read from the store: what the metrics, the dashboard, ``status`` and ``doctor`` show.

The scripts keep per-shard counters, gauges and lateness histograms in each
shard's ``stats`` hash (``lua/includes/ops.lua``); :class:`FleetStats` sums
them over the shards at read time, beside counts read from the shards' sets
(pending, overdue, held, claimed, dead letters) and the schedulers' leases.
Any one process that reads them tells the truth for the whole fleet.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .client import translate_errors
from .gateway import Store
from .keys import parse_index_part

#: Upper bounds of the lateness histogram buckets, ms (``LATE_MS`` in ``lua/includes/ops.lua``); then +Inf.
LATENESS_BOUNDS_MS = (5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000, 60000, 300000, 1800000)

#: The counters the scripts keep, with their meaning (the metrics' help texts).
COUNTERS = {
    "scheduled": "jobs stored by apply_later (not repeats of an existing id or key)",
    "released": "jobs sent to their queue (direct path: pushed; publish path: confirmed)",
    "cancelled": "jobs cancelled (one by one or in bulk)",
    "retried": "retries scheduled through the store",
    "dead": "jobs dead-lettered (out of attempts, misfire policy 'dead', refused by the broker)",
    "expired": "due jobs not sent because their expires had passed",
    "skipped": "due jobs not sent because of misfire policy 'skip'",
    "duplicates": "deliveries the worker-side execution record dropped (done already, superseded, finished)",
    "started": "executions begun by the worker side (takeovers included)",
    "succeeded": "executions that succeeded",
    "failed": "executions that failed for good (not retried, not dead-lettered)",
    "requeued": "dead letters scheduled again",
    "promoted": "scheduled jobs made due now (run now)",
}


@dataclass(frozen=True)
class Histogram:
    """A lateness histogram: per-bucket counts (not cumulative; the last is +Inf) and the sum, ms."""

    counts: tuple[int, ...]
    sum_ms: int

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound in seconds, cumulative count) per bucket, +Inf last (Prometheus' form)."""
        out, total = [], 0
        for bound, n in zip((*LATENESS_BOUNDS_MS, float("inf")), self.counts, strict=True):
            total += n
            out.append((bound / 1000.0, total))
        return out

    def quantile(self, q: float) -> float | None:
        """An upper estimate of the q-quantile, seconds (the bound of its bucket); None without samples."""
        n = self.count
        if n == 0:
            return None
        for bound, c in self.cumulative():
            if c >= q * n:
                return bound
        return float("inf")


@dataclass
class Snapshot:
    """The fleet's figures at one moment (Redis clock)."""

    now_ms: int
    shards: int
    counters: dict[str, int]
    queued: int  # released, not started
    running: int
    release_lateness: Histogram
    start_lateness: Histogram
    pending: int  # scheduled and not released, held jobs included
    pending_by: dict[tuple[str, str], int]  # (task, queue) -> pending
    overdue: int  # due, not released (held jobs not included)
    oldest_overdue_ms: int  # age of the oldest overdue job (0: none)
    held: int  # due jobs held back by a pause
    claimed: int  # publish path: claimed, not yet confirmed
    dead_letters: int
    schedulers: list[str]  # live members
    owners: dict[int, str | None]  # shard -> live scheduler holding its lease
    paused: dict[str, int]  # pause flag -> since (epoch ms)
    next_due_ms: int | None = None
    per_shard: list[dict[str, Any]] = field(default_factory=list)
    #: the shard count a reshard in progress moves jobs from (None: none in progress)
    moving_from: int | None = None
    #: due jobs waiting for a token, by rate limit key (counted in ``pending`` too)
    limited_by: dict[str, int] = field(default_factory=dict)

    @property
    def limited(self) -> int:
        """Due jobs a rate limit holds back, over every limit."""
        return sum(self.limited_by.values())

    @property
    def unowned_shards(self) -> list[int]:
        """Shards no live scheduler holds."""
        return [s for s, owner in self.owners.items() if owner is None]

    def shards_of(self) -> dict[str, list[int]]:
        """Each live scheduler and the shards it holds."""
        out: dict[str, list[int]] = {m: [] for m in self.schedulers}
        for s, owner in sorted(self.owners.items()):
            if owner is not None:
                out.setdefault(owner, []).append(s)
        return out


def _hist(stats: dict[str, int], name: str) -> Histogram:
    n = len(LATENESS_BOUNDS_MS) + 1
    return Histogram(tuple(stats.get(f"{name}:{i}", 0) for i in range(1, n + 1)), stats.get(f"{name}:sum", 0))


@translate_errors
class FleetStats:
    """Reads a :class:`Snapshot` of one store in two or three pipelined round trips."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.url = store.url

    def snapshot(self) -> Snapshot:
        """Every figure, summed over the shards."""
        store = self.store
        store.layout.reload(2.0)
        n = store.layout.span
        bucketed = store.config.bucket_ms > 0
        now = store.redis.now_ms()
        pipe = store.redis.client.pipeline(transaction=False)
        for s in range(n):
            shard_keys = store.keys.shard(s)
            pipe.hgetall(shard_keys.stats)
            pipe.smembers(shard_keys.index_parts)
            pipe.zcard(shard_keys.held)
            pipe.zcard(shard_keys.inflight)
            pipe.zcard(shard_keys.dlq)
            pipe.get(shard_keys.lease)
            pipe.hgetall(shard_keys.paused)
            if bucketed:
                pipe.zrange(shard_keys.buckets, 0, -1)
            else:
                pipe.zcard(shard_keys.due)
                pipe.zcount(shard_keys.due, "-inf", now)
                pipe.zrange(shard_keys.due, 0, 0, withscores=True)
        pipe.zrangebyscore(store.keys.schedulers, now, "+inf")
        replies = pipe.execute()
        live = [str(m) for m in replies[-1]]
        width = 8 if bucketed else 10
        counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        totals: dict[str, int] = {}
        parts: list[tuple[int, str]] = []
        owners: dict[int, str | None] = {}
        paused: dict[str, int] = {}
        rows: list[dict[str, Any]] = []
        bucket_keys: dict[int, list[str]] = {}
        for s in range(n):
            r = replies[s * width:(s + 1) * width]
            stats = {str(k): int(v) for k, v in r[0].items()}
            for k, v in stats.items():
                totals[k] = totals.get(k, 0) + v
            parts += [(s, str(p)) for p in r[1]]
            owner = str(r[5]).split("|")[0] if r[5] else None
            owners[s] = owner if owner in live else None
            for flag, since in r[6].items():
                paused[str(flag)] = min(int(float(since)), paused.get(str(flag), 1 << 62))
            row: dict[str, Any] = {"shard": s, "held": int(r[2]), "claimed": int(r[3]), "dead_letters": int(r[4]),
                                   "owner": owners[s]}
            if bucketed:
                bucket_keys[s] = [str(k) for k in r[7]]
            else:
                first = r[9]
                row.update(pending=int(r[7]) + int(r[2]), overdue=int(r[8]),
                           next_due_ms=int(first[0][1]) if first else None)
            rows.append(row)
        # Second round trip: the pending index (and the time buckets' sets when bucketing is on).
        pipe = store.redis.client.pipeline(transaction=False)
        for s, p in parts:
            pipe.zcard(store.keys.shard(s).index(p))
        for s in range(n):
            for k in bucket_keys.get(s, []):
                pipe.zcard(k)
                pipe.zcount(k, "-inf", now)
                pipe.zrange(k, 0, 0, withscores=True)
        replies = pipe.execute()
        pending_by: dict[tuple[str, str], int] = {}
        for (_, p), c in zip(parts, replies, strict=False):
            if int(c):
                key = parse_index_part(p)
                pending_by[key] = pending_by.get(key, 0) + int(c)
        at = len(parts)
        for s in range(n):
            if s in bucket_keys:
                ks = bucket_keys[s]
                chunk = replies[at:at + 3 * len(ks)]
                at += 3 * len(ks)
                firsts = [int(x[0][1]) for x in chunk[2::3] if x]
                rows[s].update(pending=sum(int(x) for x in chunk[0::3]) + rows[s]["held"],
                               overdue=sum(int(x) for x in chunk[1::3]), next_due_ms=min(firsts) if firsts else None)
        for k in counters:
            counters[k] = totals.get(k, 0)
        limited_by = store.shaping.waiting()
        nexts = [r["next_due_ms"] for r in rows if r["next_due_ms"] is not None]
        oldest = min(nexts) if nexts else None
        return Snapshot(
            now_ms=now, shards=n, moving_from=store.layout.moving_from, counters=counters,
            queued=max(0, totals.get("queued", 0)), running=max(0, totals.get("running", 0)),
            release_lateness=_hist(totals, "rl"), start_lateness=_hist(totals, "sl"),
            pending=sum(r["pending"] for r in rows) + sum(limited_by.values()), pending_by=pending_by,
            overdue=sum(r["overdue"] for r in rows),
            oldest_overdue_ms=(now - oldest) if oldest is not None and oldest <= now else 0,
            held=sum(r["held"] for r in rows), claimed=sum(r["claimed"] for r in rows),
            dead_letters=sum(r["dead_letters"] for r in rows), schedulers=live, owners=owners, paused=paused,
            next_due_ms=oldest, per_shard=rows, limited_by=limited_by,
        )

    def coming_due(self, start_ms: int, step_ms: int, steps: int) -> list[int]:
        """How many scheduled jobs fall due in each of ``steps`` windows of ``step_ms`` from ``start_ms``."""
        store = self.store
        keys = [store.keys.shard(s).due for s in store.layout.shard_range()]
        if store.config.bucket_ms > 0:
            pipe = store.redis.client.pipeline(transaction=False)
            for s in store.layout.shard_range():
                pipe.zrangebyscore(store.keys.shard(s).buckets, start_ms - store.config.bucket_ms,
                                   start_ms + step_ms * steps)
            keys = [str(k) for ks in pipe.execute() for k in ks]
        pipe = store.redis.client.pipeline(transaction=False)
        for k in keys:
            for i in range(steps):
                lo = start_ms + i * step_ms
                pipe.zcount(k, lo, f"({lo + step_ms}")
        counts = [int(c) for c in pipe.execute()]
        return [sum(counts[j * steps + i] for j in range(len(keys))) for i in range(steps)]
