"""Moving jobs between shards: the part of ``delayed reshard`` a producer also uses.

Each move is two scripts on one shard each (so it works on Redis Cluster):
``move_out.lua`` takes a job out of its old shard (MOVING, in the shard's
``moving`` set), ``move_in.lua`` writes it in its new shard; then the old
record is deleted. See :mod:`.reshard` for the whole procedure.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ..vocab import Field, JobState
from .facet import Facet
from .keys import shard_for
from .lookup import Lookup
from .records import rehome_message
from .runner import Runner

logger = logging.getLogger("celery_delayed.reshard")


@dataclass
class MoveCounts:
    """What the moves did."""

    moved_jobs: int = 0
    moved_entries: int = 0  # debounce and throttle entries
    by_state: dict[str, int] = field(default_factory=dict)


class Moves(Facet):
    """The two halves of moving jobs between shards (``delayed reshard``; a producer meeting a reshard)."""

    SCRIPTS = ("move_out", "move_in")

    def move_out(self, shard: int, take: list[tuple[str, str, str]]) -> list[Any]:
        """Take (job id, task, queue) of ``take`` out of ``shard`` (``move_out.lua``): MOVING, in its moving set.

        Returns (id, pttl, fields) per job; a pttl of -3: released or running, left where it is.
        """
        shard_keys = self.keys.shard(shard)
        reply: list[Any] = self.redis.run(
            self.redis.scripts.move_out, [shard_keys.due, shard_keys.buckets, shard_keys.dlq, shard_keys.held,
                                          shard_keys.moving],
            [self.redis.now_arg(None), shard_keys.job_prefix, self.config.bucket_ms,
             *(x for triple in take for x in triple)])
        return reply

    def move_in(self, calls: list[tuple[list[str], list[Any]]]) -> None:
        """Write moved records into their new shards (``move_in.lua``), every shard's call in one round trip."""
        self.redis.run_many(self.redis.scripts.move_in, calls)


class JobMover:
    """Moves jobs, and debounce and throttle entries with their jobs, to their home under a shard count."""

    def __init__(self, redis: Runner, lookup: Lookup, moves: Moves) -> None:
        self.redis = redis
        self.lookup = lookup
        self.moves = moves
        self.client = redis.client
        self.keys = redis.keys
        self.config = redis.config
        self.counts = MoveCounts()
        self._templates: set[tuple[int, str]] = set()

    def move_batch(self, shard: int, ids: list[str], new: int) -> int:
        """Move the jobs of ``ids`` (records of ``shard``) whose home under ``new`` is elsewhere."""
        shard_keys = self.keys.shard(shard)
        pipe = self.client.pipeline(transaction=False)
        for job_id in ids:
            pipe.hmget(shard_keys.job(job_id), Field.SHARD_KEY, Field.TASK, Field.QUEUE, Field.TEMPLATE, Field.STATE)
        take: list[tuple[str, str, str]] = []
        homes: dict[str, int] = {}
        for job_id, (skey, task, queue, tid, state) in zip(ids, pipe.execute(), strict=True):
            if state is None:
                continue  # gone (expired) meanwhile
            home = shard_for(str(skey) if skey else job_id, new)
            if home == shard:
                if state == JobState.MOVING:  # cannot be: a move in progress only ever has one target
                    logger.warning("reshard: job %s is MOVING in its own shard %d; left as it is", job_id, shard)
                continue
            homes[job_id] = home
            t, q = self.lookup.route_of(shard, task, queue, tid)
            take.append((job_id, t, q))
        if not take:
            return 0
        reply = self.moves.move_out(shard, take)
        route = {job_id: (t, q) for job_id, t, q in take}
        left = 0
        by_home: dict[int, list[tuple[str, int, dict[str, str]]]] = defaultdict(list)
        for job_id, pttl, fields in reply:
            job_id = str(job_id)
            if int(pttl) == -3:
                left += 1  # released or running: it moves once done
                continue
            flat = [str(x) for x in fields]
            rec = dict(zip(flat[0::2], flat[1::2], strict=True))
            by_home[homes[job_id]].append((job_id, int(pttl), rec))
        moved: dict[int, list[str]] = defaultdict(list)
        calls = [self.move_in_call(shard, home, recs, route) for home, recs in by_home.items()]
        if calls:  # every new shard's move_in in one round trip
            self.moves.move_in(calls)
        for home, recs in by_home.items():
            moved[home] += [job_id for job_id, _, _ in recs]
            for _, _, rec in recs:
                st = rec.get(Field.MOVED_STATE, "")
                self.counts.by_state[st] = self.counts.by_state.get(st, 0) + 1
        done = [job_id for ids_ in moved.values() for job_id in ids_]
        pipe = self.client.pipeline(transaction=False)
        for job_id in done:
            pipe.delete(shard_keys.job(job_id))
        if done:
            pipe.srem(shard_keys.moving, *done)
        pipe.execute()
        self.counts.moved_jobs += len(done)
        for home, ids_ in moved.items():
            self.moved(home, ids_)
        return left

    def move_in_call(self, src: int, home: int, recs: list[tuple[str, int, dict[str, str]]],
                     route: dict[str, tuple[str, str]]) -> tuple[list[str], list[Any]]:
        """The keys and arguments of ``move_in.lua`` for ``recs`` (taken out of ``src``) into ``home``."""
        tk = self.keys.shard(home)
        tids = {rec[Field.TEMPLATE] for _, _, rec in recs if Field.TEMPLATE in rec}
        self.copy_templates(src, home, tids)
        args: list[Any] = [self.redis.now_arg(None), tk.job_prefix, self.config.bucket_ms, self.keys.wake, home]
        for job_id, pttl, rec in recs:
            rec = dict(rec)
            rec[Field.STATE] = rec.pop(Field.MOVED_STATE, rec.get(Field.STATE, ""))
            died = rec.pop(Field.MOVED_DIED, None)
            if rec.get(Field.MESSAGE):
                rec[Field.MESSAGE] = rehome_message(rec[Field.MESSAGE], home)
            pairs = [x for k, v in rec.items() for x in (k, v)]
            if died is not None:
                pairs += ["~dlq", died]
            task, queue = route.get(job_id, ("", ""))
            args += [job_id, pttl, task, queue, len(pairs) // 2, *pairs]
        return [tk.due, tk.buckets, tk.next, tk.dlq], args

    def copy_templates(self, src: int, home: int, tids: Iterable[str]) -> None:
        """Copy compact records' templates to the new shard (a template is the same text in every shard)."""
        todo = [t for t in tids if (home, t) not in self._templates]
        if not todo:
            return
        pipe = self.client.pipeline(transaction=False)
        for tid in todo:
            pipe.get(self.keys.shard(src).template(tid))
            pipe.pttl(self.keys.shard(src).template(tid))
            pipe.pttl(self.keys.shard(home).template(tid))
        got = pipe.execute()
        pipe = self.client.pipeline(transaction=False)
        for n, tid in enumerate(todo):
            text, ttl, theirs = got[3 * n], int(got[3 * n + 1]), int(got[3 * n + 2])
            if text is None:
                continue
            dest = self.keys.shard(home).template(tid)
            if theirs == -2:  # not there
                if ttl > 0:
                    pipe.set(dest, text, px=ttl)
                else:
                    pipe.set(dest, text)
            elif theirs >= 0 and (ttl < 0 or ttl > theirs):
                if ttl < 0:
                    pipe.persist(dest)
                else:
                    pipe.pexpire(dest, ttl)
            self._templates.add((home, tid))
        pipe.execute()

    # -- debounce / throttle entries and schedules ------------------------------------------

    def move_entry(self, shard: int, mode: str, key: str, new: int) -> None:
        """Move a debounce or throttle entry of ``shard`` to its home under ``new`` (if elsewhere), with its job.

        The job goes first (a key's job lives in the key's shard), so a call of
        the key in its new shard finds both.
        """
        src = self.keys.shard(shard).keyed(mode, key)
        job_id = self.client.hget(src, "id")
        skey = self.client.hget(self.keys.shard(shard).job(str(job_id)), Field.SHARD_KEY) if job_id else None
        home = shard_for(str(skey) if skey else key, new)  # the job's shard key (the key, unless one was given)
        if home == shard:
            return
        dest = self.keys.shard(home).keyed(mode, key)
        if job_id:
            self.move_batch(shard, [str(job_id)], new)
        pipe = self.client.pipeline(transaction=False)
        pipe.hgetall(src)
        pipe.pttl(src)
        fields, ttl = pipe.execute()
        if fields and not self.client.exists(dest):
            pipe = self.client.pipeline(transaction=False)
            pipe.hset(dest, mapping=fields)
            if int(ttl) > 0:
                pipe.pexpire(dest, int(ttl))
            pipe.execute()
        if fields:
            self.client.delete(src)
            self.counts.moved_entries += 1

    def moved(self, home: int, ids: list[str]) -> None:
        """Called with the jobs just moved to ``home`` (the reshard updates their rows)."""
