"""Views over many jobs: each owns its listing and paging (as RQ's registries do).

- :class:`Pending`: scheduled jobs, in due order.
- :class:`ShardStatus`: per shard, pending, overdue and in-flight counts; the
  delayed sends that interception sent to the broker (``eta_fallbacks``).

They only read, through the store's runner (the dead-letter queue has a
facet of its own, :mod:`.dead_letters`).
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidOption
from ..vocab import ETA_FALLBACK_LAST, ETA_FALLBACKS, Field, JobState
from .client import translate_errors
from .gateway import Store
from .keys import parse_index_part
from .paging import PAGE, check_page
from .records import arguments_of


def _due_keys(store: Store, shard: int) -> list[str]:
    """The sorted sets of a shard's scheduled jobs not held by a pause: its due index, and the jobs
    waiting for a rate limit's token (``store/shaping.py``)."""
    shard_keys = store.keys.shard(shard)
    waiting = [shard_keys.limit_wait(str(k)) for k in store.redis.client.smembers(shard_keys.limit_waits)]
    if store.config.bucket_ms <= 0:
        return [shard_keys.due, *waiting]
    return [str(k) for k in store.redis.client.zrange(shard_keys.buckets, 0, -1)] + waiting


@translate_errors
class ShardStatus:
    """Per-shard counts of one store."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.url = store.url

    def rows(self, now_ms: int | None = None) -> list[dict[str, Any]]:
        """Per shard: pending jobs, in-flight claims, next due time and oldest overdue (ms)."""
        store = self.store
        now = store.redis.now_ms() if now_ms is None else now_ms
        out = []
        for s in store.layout.shard_range():
            due_keys = _due_keys(store, s)
            pipe = store.redis.client.pipeline(transaction=False)
            for k in due_keys:
                pipe.zcard(k)
                pipe.zrange(k, 0, 0, withscores=True)
                pipe.zcount(k, "-inf", now)
            pipe.zcard(store.keys.shard(s).inflight)
            replies = pipe.execute()
            pending = sum(replies[i] for i in range(0, len(replies) - 1, 3))
            overdue = sum(replies[i + 2] for i in range(0, len(replies) - 1, 3))
            firsts = [int(r[0][1]) for r in replies[1:-1:3] if r]
            nxt = min(firsts) if firsts else None
            out.append({
                "shard": s, "pending": pending, "overdue": overdue, "inflight": replies[-1],
                "next_due_ms": nxt,
                "oldest_overdue_ms": (now - nxt) if nxt is not None and nxt <= now else 0,
            })
        return out

    def eta_fallbacks(self) -> EtaFallbacks:
        """The fleet's count of broker ETA fallbacks (every shard's, summed) and the latest one.

        One round trip. ``delayed status`` shows it; a metrics exporter reads
        ``count`` as a counter (it only grows).
        """
        return _eta_fallbacks(self.store)


@dataclass(frozen=True)
class EtaFallbacks:
    """Delayed sends that interception sent to the broker as ETA messages instead of the store."""

    count: int
    last_ms: int | None = None  # when the last one was sent (Redis clock), epoch ms
    last_task: str = ""
    last_reason: str = ""

    def as_dict(self) -> dict[str, Any]:
        """The figures as a JSON-ready dict."""
        return {"count": self.count, "last_ms": self.last_ms, "last_task": self.last_task,
                "last_reason": self.last_reason}


def _eta_fallbacks(store: Store) -> EtaFallbacks:
    pipe = store.redis.client.pipeline(transaction=False)
    for s in store.layout.shard_range():
        pipe.hmget(store.keys.shard(s).stats, ETA_FALLBACKS, ETA_FALLBACK_LAST)
    total, last = 0, ""
    for count, latest in pipe.execute():
        total += int(count or 0)
        if latest and (not last or int(latest.split("|", 1)[0]) > int(last.split("|", 1)[0])):
            last = latest
    if not last:
        return EtaFallbacks(total)
    at, task, reason = [*last.split("|", 2), "", ""][:3]
    return EtaFallbacks(total, int(at), task, reason)


#: In a set of the cursor's shard that does not hold the cursor's job, :meth:`Pending.window` reads past
#: at most this many jobs due at the cursor's millisecond (beyond, it starts at the next millisecond).
SAME_DUE_CAP = 10_000


@translate_errors
class Pending:
    """The scheduled jobs of one store, in due order over every shard."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.url = store.url

    def page(self, task: str | None = None, offset: int = 0, limit: int = 50) -> list[dict[str, Any]]:
        """Scheduled jobs, earliest due first over all shards, optionally of one task (read from the pending index).

        Each row: ``id``, ``shard``, ``due`` (epoch ms), ``task``, ``queue``, ``st``.
        """
        check_page(offset, limit)
        store = self.store
        keys = [(s, store.keys.shard(s).index(p)) for s in store.layout.shard_range()
                for p in store.jobs.index_parts(s, task)] if task else \
            [(s, k) for s in store.layout.shard_range() for k in [*_due_keys(store, s), store.keys.shard(s).held]]
        streams = [self._shard_stream(s, k) for s, k in keys]
        merged = heapq.merge(*streams)
        out: list[dict[str, Any]] = []
        skipped = 0
        batch: list[tuple[int, int, str]] = []
        for entry in merged:
            batch.append(entry)
            if len(batch) < min(PAGE, offset + limit):
                continue
            skipped = self._rows(batch, task, offset, skipped, limit, out)
            batch = []
            if len(out) >= limit:
                return out
        if batch:
            self._rows(batch, task, offset, skipped, limit, out)
        return out

    def messages(self, queues: Collection[str], limit: int = 100, max_scan: int = 1000) -> list[tuple[int, str]]:
        """The stored messages of scheduled jobs bound for ``queues``, earliest due first: (due ms, message).

        Bounded: at most ``limit`` jobs, found among the ``max_scan`` earliest
        scheduled jobs of the store (two round trips per 200 looked at, plus
        one per shard and due set to start the merge).
        """
        check_page(0, limit)
        store = self.store
        wanted = set(queues)
        streams = [self._shard_stream(s, k) for s in store.layout.shard_range() for k in _due_keys(store, s)]
        out: list[tuple[int, str]] = []
        batch: list[tuple[int, int, str]] = []
        for n, entry in enumerate(heapq.merge(*streams), 1):
            batch.append(entry)
            last = n >= max_scan
            if len(batch) >= 200 or last:
                self._messages(batch, wanted, limit, out)
                batch = []
            if last or len(out) >= limit:
                return out
        if batch:
            self._messages(batch, wanted, limit, out)
        return out

    def _messages(self, batch: list[tuple[int, int, str]], queues: set[str], limit: int,
                  out: list[tuple[int, str]]) -> None:
        keys = self.store.keys
        pipe = self.store.redis.client.pipeline(transaction=False)
        for _, s, jid in batch:
            pipe.hmget(keys.shard(s).job(jid), Field.TASK, Field.QUEUE, Field.STATE, Field.TEMPLATE)
        hits = [(due, s, jid) for (due, s, jid), (t, q, st, tp) in zip(batch, pipe.execute(), strict=True)
                if st == JobState.SCHEDULED
                and self.store.lookup.route_of(s, t, q, tp)[1] in queues][: limit - len(out)]
        if not hits:
            return
        msgs = self.store.lookup.messages([(s, jid) for _, s, jid in hits])
        out.extend((due, msg) for (due, _, _), msg in zip(hits, msgs, strict=True) if msg)

    def _rows(self, batch: list[tuple[int, int, str]], task: str | None, offset: int, skipped: int, limit: int,
              out: list[dict[str, Any]]) -> int:
        """Append the rows of ``batch`` (after ``offset`` matching ones) to ``out``; return the new skip count."""
        store = self.store
        pipe = store.redis.client.pipeline(transaction=False)
        for _, s, jid in batch:
            pipe.hmget(store.keys.shard(s).job(jid), Field.TASK, Field.QUEUE, Field.STATE, Field.TEMPLATE)
        for (due, s, jid), (tname, q, st, tp) in zip(batch, pipe.execute(), strict=True):
            tname, q = store.lookup.route_of(s, tname, q, tp)
            if task and tname != task:
                continue
            if skipped < offset:
                skipped += 1
                continue
            if len(out) < limit:
                out.append({"id": jid, "shard": s, "due": due, "task": tname or "", "queue": q or "",
                            Field.STATE: st or ""})
        return skipped

    def _shard_stream(self, shard: int, key: str) -> Iterator[tuple[int, int, str]]:
        """(due, shard, id) of one due set, earliest first, read a page at a time."""
        start = 0
        while True:
            page: list[Any] = list(self.store.redis.client.zrange(key, start, start + PAGE - 1, withscores=True))
            if not page:
                return
            for jid, due in page:
                yield (int(due), shard, str(jid))
            start += len(page)

    def _window_keys(self, task: str | None, queue: str | None, held: bool = False) -> list[tuple[int, str]]:
        """(shard, sorted set) of every set a window reads: the due sets and held jobs, the pending index of a
        task and/or queue, or (``held``) only the jobs a pause holds back."""
        store = self.store
        keys: list[tuple[int, str]] = []
        for s in store.layout.shard_range():
            shard_keys = store.keys.shard(s)
            if held:
                keys.append((s, shard_keys.held))
            elif task is not None or queue is not None:
                keys += [(s, shard_keys.index(p)) for p in store.jobs.index_parts(s, task, queue)]
            else:
                keys += [(s, k) for k in _due_keys(store, s)] + [(s, shard_keys.held)]
        return keys

    def count(self, task: str | None = None, queue: str | None = None, held: bool = False) -> int:
        """How many jobs :meth:`window` pages through (of a task and/or queue, if given); two round trips.

        With ``held``: every job a pause holds back (a task or queue given too is not counted apart).
        """
        keys = self._window_keys(task, queue, held)
        pipe = self.store.redis.client.pipeline(transaction=False)
        for _, k in keys:
            pipe.zcard(k)
        return sum(int(n) for n in pipe.execute())

    def routes(self) -> dict[tuple[str, str], int]:
        """(task, queue) -> how many scheduled jobs, for every pair that has any: two round trips.

        Read from the pending index (one set per shard, task and queue), never
        from the jobs: what an operator's filters offer.
        """
        store = self.store
        shards = list(store.layout.shard_range())
        pipe = store.redis.client.pipeline(transaction=False)
        for s in shards:
            pipe.smembers(store.keys.shard(s).index_parts)
        parts = [(s, str(p)) for s, members in zip(shards, pipe.execute(), strict=True) for p in members]
        pipe = store.redis.client.pipeline(transaction=False)
        for s, p in parts:
            pipe.zcard(store.keys.shard(s).index(p))
        out: dict[tuple[str, str], int] = {}
        for (_, p), n in zip(parts, pipe.execute(), strict=True):
            if int(n):
                route = parse_index_part(p)
                out[route] = out.get(route, 0) + int(n)
        return dict(sorted(out.items()))

    def window(self, after: tuple[int, int, str] | None = None, limit: int = 50, task: str | None = None,
               queue: str | None = None, held: bool = False,
               ) -> tuple[list[dict[str, Any]], tuple[int, int, str] | None]:
        """One page of scheduled jobs in due order, after a cursor; return the rows and the next cursor.

        Jobs are ordered by due time, then shard, then id. ``after`` is the
        cursor of the previous page: (due ms, shard, id) of its last job. It
        names no Redis key (a cursor comes from a URL): the cursor's job is
        looked up, as a member, in its shard's own sets, and where it has
        left them the page starts just past its place all the same. A task
        and/or queue reads the pending index; otherwise the due sets (and the
        jobs a pause holds). Each page costs three or four pipelined round
        trips of at most ``limit`` entries per set (plus, in a set of the
        cursor's shard that does not hold the cursor's job, the jobs due at
        the cursor's very millisecond, up to :data:`SAME_DUE_CAP`): no page
        scans the store. Rows as :meth:`page`, with ``ik`` (the idempotency
        key), ``created``, and ``args`` / ``kwargs`` (the arguments as the app
        shows them, :func:`~.records.arguments_of`). ``held``: only the jobs
        a pause holds back (due, not released until the pause is lifted); a
        task or queue given too filters that page's rows, so a page may hold
        fewer than ``limit`` rows and still have a next one.

        Raises:
            InvalidOption: a cursor whose shard is not one of the store's.
        """
        check_page(0, limit)
        store = self.store
        keys = self._window_keys(task, queue, held)
        ranks: dict[str, int] = {}  # a set of the cursor's shard that holds the cursor's job: the job's rank
        same: dict[str, int] = {}  # one that does not: how many of its jobs are due at the cursor's millisecond
        if after is not None:
            due, shard, jid = after
            if shard not in store.layout.shard_range():
                raise InvalidOption(f"the cursor names shard {shard}; the store has shards 0 to "
                                    f"{store.layout.shards - 1}")
            mine = [k for s, k in keys if s == shard]
            pipe = store.redis.client.pipeline(transaction=False)
            for k in mine:
                pipe.zscore(k, jid)
                pipe.zrank(k, jid)
                pipe.zcount(k, due, due)
            replies = pipe.execute()
            for i, k in enumerate(mine):
                score, rank, n = replies[3 * i: 3 * i + 3]
                if score is not None and rank is not None and int(score) == due:
                    ranks[k] = int(rank)
                else:
                    same[k] = int(n)
        pipe = store.redis.client.pipeline(transaction=False)
        for s, k in keys:
            if after is None:
                pipe.zrange(k, 0, limit - 1, withscores=True)
            elif k in ranks:
                pipe.zrange(k, ranks[k] + 1, ranks[k] + limit, withscores=True)
            elif s < after[1] or (s == after[1] and same[k] > SAME_DUE_CAP):  # strictly later due times
                pipe.zrangebyscore(k, f"({after[0]}", "+inf", start=0, num=limit, withscores=True)
            else:  # later shards from the cursor's due time; in its own shard, those past its id are kept below
                pipe.zrangebyscore(k, after[0], "+inf", start=0, num=limit + same.get(k, 0), withscores=True)
        entries: list[tuple[int, int, str]] = []
        for (s, k), page in zip(keys, pipe.execute(), strict=True):
            got = [(int(due), s, str(jid)) for jid, due in page]
            if after is not None and k in same:
                got = [e for e in got if e > after]
            entries += got
        entries.sort()
        entries = entries[:limit]
        pipe = store.redis.client.pipeline(transaction=False)
        for _, s, jid in entries:
            pipe.hmget(store.keys.shard(s).job(jid), Field.TASK, Field.QUEUE, Field.STATE, Field.IDEMPOTENCY_KEY,
                       Field.CREATED, Field.TEMPLATE, Field.MESSAGE, Field.C_ARGSREPR, Field.C_KWARGSREPR)
        rows = []
        for (due, s, jid), got in zip(entries, pipe.execute(), strict=True):
            tname, q, st, ik, created, tp, msg, a, k = got
            tname, q = store.lookup.route_of(s, tname, q, tp)
            if held and ((task is not None and tname != task) or (queue is not None and q != queue)):
                continue
            compact_args = {f: v for f, v in ((Field.C_ARGSREPR, a), (Field.C_KWARGSREPR, k)) if v is not None}
            args, kwargs = arguments_of(compact_args, msg)
            rows.append({"id": jid, "shard": s, "due": due, "task": tname or "", "queue": q or "",
                         Field.STATE: st or "", "ik": ik or "", "created": int(float(created)) if created else None,
                         "args": args, "kwargs": kwargs})
        nxt = entries[-1] if len(entries) == limit else None
        return rows, nxt
