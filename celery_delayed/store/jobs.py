"""The producer's and operators' side: storing jobs and changing them while they wait.

One method per script: :meth:`Jobs.schedule` (``schedule.lua``),
:meth:`Jobs.schedule_keyed`, :meth:`Jobs.cancel`, :meth:`Jobs.reschedule`,
:meth:`Jobs.promote`, :meth:`Jobs.cancel_matching`, :meth:`Jobs.pause`
and :meth:`Jobs.note_fallback`; the others compose them.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from redis.exceptions import OutOfMemoryError

from ..errors import InvalidOption, InvalidState, JobNotFound, StoreFull, StoreUnavailable, raise_for
from ..redis_urls import redact
from ..vocab import ETA_FALLBACK_LAST, ETA_FALLBACKS, Field, JobState
from .compact import Template
from .facet import Facet
from .keys import index_part, parse_index_part, shard_for
from .layout import ShardLayout
from .loader import Arg
from .lookup import Lookup
from .moves import JobMover, Moves
from .records import NEW_JOB_FIELDS, NewJob, Scheduled, rehome
from .runner import PartlyWritten, Runner


class Jobs(Facet):
    """Store jobs, and change them while they wait: cancel, reschedule, promote, pause."""

    SCRIPTS = ("schedule", "schedule_keyed", "cancel", "reschedule", "promote", "cancel_matching", "pause",
               "note_fallback")

    def __init__(self, redis: Runner, layout: ShardLayout, lookup: Lookup, moves: Moves) -> None:
        super().__init__(redis, layout)
        self.lookup = lookup
        self.moves = moves
        #: (shard, template id) this store sent to the server (compact records)
        self._templates_sent: set[tuple[int, str]] = set()
        #: schedule.lua's keys and leading arguments, by what decides them (:meth:`_call_head`)
        self._heads: dict[tuple[Any, ...], tuple[Mapping[str, str], list[str], list[Arg]]] = {}

    def schedule(self, jobs: Sequence[NewJob], now_ms: int | None = None) -> list[Scheduled]:
        """Store jobs (``schedule.lua``): one script call per shard, all shards in one round trip.

        Several calls go in one ``MULTI``/``EXEC`` (not on a Redis Cluster):
        a store reaching ``maxmemory`` part way refuses them all.

        Returns one :class:`Scheduled` per job, in order. A job whose id is
        taken keeps the record that was there (``created`` is False).
        """
        self.layout.check()
        out: list[Scheduled | None] = [None] * len(jobs)
        todo = list(range(len(jobs)))
        for _attempt in range(4):
            if self.layout.shards != self.config.shards or self.layout.moving_from:  # a reshard was seen: place anew
                jobs = [j if j.shard == self.layout.home(j) else rehome(j, self.layout.home(j)) for j in jobs]
                if self.layout.moving_from:
                    todo = self._held_elsewhere(jobs, todo, out)
            try:
                moved = self._schedule(jobs, todo, out, now_ms)
            except OutOfMemoryError as exc:
                self._refused_part_way(out, exc)
                raise
            if not moved:
                return [s for s in out if s is not None]
            self.layout.reload()  # a reshard sealed their shards: read the new count and place them again
            todo = moved
        raise StoreUnavailable(f"{len(todo)} job(s) could not be placed: the store's layout keeps changing (a reshard)")

    def _refused_part_way(self, out: list[Scheduled | None], exc: OutOfMemoryError) -> None:
        """Raise :class:`StoreFull` naming the jobs stored before Redis refused the rest, if any were.

        A single Redis refuses a batch whole (one ``MULTI``/``EXEC``), unless a
        second round trip was needed: a shard whose template was lost, or jobs a
        reshard moved. A Redis Cluster writes each node's shards on their own.
        """
        written = {i: s for i, s in enumerate(out) if s is not None}
        if not written:
            return  # nothing was written: the caller raises the refusal itself
        where = ", on the other nodes of the Redis Cluster," if self.redis.cluster else ""
        raise StoreFull(
            f"the celery-delayed store at {redact(self.url)} is full (Redis maxmemory reached; {exc}): "
            f"{len(written)} of the {len(out)} jobs were written{where} before it refused the rest "
            "(StoreFull.written: their positions and handles). Release or purge jobs, or raise maxmemory, then "
            "schedule the calls not written (calling again with the same task_ids is safe: a job stored "
            "already is not doubled)", written) from exc

    def _held_elsewhere(self, jobs: Sequence[NewJob], todo: list[int], out: list[Scheduled | None]) -> list[int]:
        """While a reshard moves jobs: a job whose id is held in its old-layout shard is not stored again."""
        old = self.layout.moving_from or self.layout.shards
        where = {i: shard_for(jobs[i].fields.get(Field.SHARD_KEY) or jobs[i].id, old) for i in todo}
        look = [i for i in todo if where[i] != jobs[i].shard]
        if not look:
            return todo
        pipe = self.redis.client.pipeline(transaction=False)
        for i in look:
            pipe.hmget(self.keys.shard(where[i]).job(jobs[i].id), Field.STATE, Field.DUE, Field.GENERATION)
        held = set()
        for i, (state, due, gen) in zip(look, pipe.execute(), strict=True):
            if state is not None:
                held.add(i)
                out[i] = Scheduled(jobs[i].id, where[i], int(float(due or 0)), False, str(state), int(gen or 0))
        return [i for i in todo if i not in held]

    def _schedule(self, jobs: Sequence[NewJob], todo: Sequence[int], out: list[Scheduled | None],
                  now_ms: int | None) -> list[int]:
        """Store ``jobs[i]`` for i in ``todo`` into ``out``; return the indices a reshard's seal refused."""
        # One call per shard and set of shared fields; the shared fields go
        # once per call, the others once per job.
        groups: dict[tuple[int, int], list[int]] = defaultdict(list)
        for i in todo:
            groups[(jobs[i].shard, id(jobs[i].common))].append(i)
        calls: list[tuple[list[str], list[Arg]]] = []
        order: list[tuple[int, list[int]]] = []
        compact: list[Template | None] = []
        for (shard, _), idx in groups.items():
            first = jobs[idx[0]]
            common = first.common or {}
            tmpl = first.template
            compact.append(tmpl)
            if len(idx) == 1:
                fields = first.fields
                own = [f for f in NEW_JOB_FIELDS if f not in common and fields.get(f)]
            else:
                present = set().union(*(jobs[i].fields.keys() for i in idx))
                own = [f for f in NEW_JOB_FIELDS
                       if f in present and f not in common and any(jobs[i].fields.get(f) for i in idx)]
            keys, head = self._call_head(shard, common, tmpl, own)
            args: list[Arg] = [self.redis.now_arg(now_ms), *head]
            if own == ["msg"]:
                for i in idx:
                    args += (jobs[i].id, jobs[i].due, jobs[i].fields["msg"])
            else:
                for i in idx:
                    job = jobs[i]
                    args += [job.id, job.due, *(job.fields.get(f, "") for f in own)]
            calls.append((keys, args))
            order.append((shard, idx))
        what = f"scheduling {len(todo)} job{'s' if len(todo) != 1 else ''}"
        try:
            replies = self.redis.run_many(self.redis.scripts.schedule, calls, wait=what, lane=True, atomic=True,
                                     jobs=len(todo))
        except PartlyWritten as part:  # a Redis Cluster with one node full: keep what the others wrote
            _keep(jobs, order, part.results, out)
            raise part.error from None
        _keep(jobs, order, replies, out)
        moved: list[int] = []
        for n, reply in enumerate(replies):
            if reply == ["!moved"]:
                moved += order[n][1]
                continue
            tmpl = compact[n]
            if tmpl is None:
                continue
            shard = order[n][0]
            if reply == ["!tpl"]:  # the server has not got the template (first use, or it was lost): send it
                # (Lost: a week after its last job's due time, or with a restart that lost data. In a batch
                # over several shards, the other shards' jobs are written by now, in the same MULTI/EXEC.)
                keys, args = calls[n]
                at = 6 + 2 * int(args[5])
                args = [*args[:5], int(args[5]) + 1, *args[6:at], "~tpl", tmpl.text, *args[at:]]
                again = self.redis.run_acked(self.redis.scripts.schedule, keys, args, what, jobs=len(order[n][1]))
                _keep(jobs, [order[n]], [again], out)
            self._templates_sent.add((shard, tmpl.tid))
        return moved

    def _call_head(self, shard: int, common: Mapping[str, str], tmpl: Template | None,
                   own: list[str]) -> tuple[list[str], list[Arg]]:
        """schedule.lua's keys, and its arguments after ``now`` up to the jobs' own (see the script).

        Cached per shard, shared fields (one mapping for many jobs), template
        (and whether this store sent it there) and own field names.
        """
        sent = tmpl is not None and (shard, tmpl.tid) in self._templates_sent
        key = (shard, id(common), None if tmpl is None else tmpl.tid, sent, self.layout.shards, *own)
        hit = self._heads.get(key)
        if hit is not None and hit[0] is common:
            return hit[1], hit[2]
        shard_keys = self.keys.shard(shard)
        shared = [x for f in NEW_JOB_FIELDS if common.get(f) for x in (f, common[f])]
        keys = [shard_keys.due, shard_keys.buckets, shard_keys.next]
        if tmpl is not None:  # compact jobs: their template's key, and what the index needs
            keys.append(shard_keys.template(tmpl.tid))
            route = tmpl.fields
            shared += ["~task", route.get(Field.TASK, ""), "~q", route.get(Field.QUEUE, ""),
                       "~keep", str(self.config.record_ttl_ms)]
            if not sent:
                shared += ["~tpl", tmpl.text]
        head: list[Arg] = [shard_keys.job_prefix, self.config.bucket_ms, self.keys.wake,
                           f"{shard}/{self.layout.shards}",
                           len(shared) // 2, *shared, len(own), *own]
        if common and sent:  # (an empty mapping is a new one each time; an unsent template's call is sent once)
            if len(self._heads) >= 1024:
                self._heads.clear()
            self._heads[key] = (common, keys, head)
        return keys, head

    def schedule_keyed(
        self, job: NewJob, mode: str, key: str, limit_ms: int | None, now_ms: int | None = None,
    ) -> Scheduled:
        """Store ``job`` under a debounce or throttle key (``schedule_keyed.lua``), atomically.

        ``mode`` "debounce": a job of ``key`` still waiting is replaced by this
        one (its id kept), due no later than ``limit_ms`` (max_wait, None: no
        limit) after the key's first call. ``mode`` "throttle": a job of
        ``key`` created within the last ``limit_ms`` (the window) is returned
        as it is. Returns the key's job; ``created`` is True when a new one
        was created (then with ``job.id``).
        """
        self.layout.check()
        for _attempt in range(4):
            if job.shard != self.layout.home(job):  # placed before a reshard this process has seen
                job = rehome(job, self.layout.home(job))
            if self.layout.moving_from:  # the key's entry and job may still be in their old shard: move them first
                old = shard_for(job.fields.get(Field.SHARD_KEY) or job.id, self.layout.moving_from)
                if old != job.shard and self.redis.client.exists(self.keys.shard(old).keyed(mode, key)):
                    JobMover(self.redis, self.lookup, self.moves).move_entry(old, mode, key, self.layout.shards)
            reply = self._schedule_keyed(job, mode, key, limit_ms, now_ms)
            if isinstance(reply, Scheduled):
                return reply
            self.layout.reload()  # a reshard sealed its shard: place it again
        raise StoreUnavailable(f"job {job.id!r} could not be placed: the store's layout keeps changing (a reshard)")

    def _schedule_keyed(
        self, job: NewJob, mode: str, key: str, limit_ms: int | None, now_ms: int | None,
    ) -> Scheduled | None:
        shard = job.shard
        shard_keys = self.keys.shard(shard)
        keys = [shard_keys.due, shard_keys.buckets, shard_keys.next, shard_keys.keyed(mode, key)]
        pairs: list[str] = [x for f in NEW_JOB_FIELDS if job.fields.get(f) for x in (f, job.fields[f])]
        tmpl = job.template
        if tmpl is not None:
            keys.append(shard_keys.template(tmpl.tid))
        head: list[Arg] = [self.redis.now_arg(now_ms), shard_keys.job_prefix, self.config.bucket_ms, self.keys.wake,
                           f"{shard}/{self.layout.shards}", mode,
                           "" if limit_ms is None else limit_ms, self.config.record_ttl_ms, job.id, job.due]
        send_tpl = tmpl is not None and (shard, tmpl.tid) not in self._templates_sent
        for _ in range(2):
            extra = ["~tpl", tmpl.text] if send_tpl and tmpl is not None else []
            reply = self.redis.run_acked(self.redis.scripts.schedule_keyed, keys,
                                    [*head, (len(pairs) + len(extra)) // 2, *pairs, *extra],
                                    f"scheduling job {job.id!r} ({mode} key {key!r})")
            if reply == ["!moved"]:
                return None
            if reply != ["!tpl"]:
                break
            send_tpl = True  # the server has not got the template (first use, or it was lost)
        if tmpl is not None:
            self._templates_sent.add((shard, tmpl.tid))
        created, job_id, state, due = reply
        return Scheduled(str(job_id), shard, int(float(due)), bool(int(created)), str(state))

    def _moving_retry(self, operation: Callable[[int | None], Any], shard: int | None) -> Any:
        """Run ``operation(shard)``; while a reshard moves the job (MOVING: milliseconds), find it again and retry."""
        deadline = time.monotonic() + 10.0
        while True:
            try:
                return operation(shard)
            except InvalidState as exc:
                if exc.state != JobState.MOVING or time.monotonic() > deadline:
                    raise
            time.sleep(0.02)
            shard = None  # it is in its new shard now, or soon

    def cancel(
        self, job_id: str, shard: int | None = None, now_ms: int | None = None, running: bool = False,
    ) -> str:
        """Cancel a job (``cancel.lua``); return the state it had (SCHEDULED, CLAIMED or QUEUED).

        ``running=True`` cancels a RUNNING job too (returns "RUNNING"): for a
        caller that also terminates the execution.

        Raises:
            JobNotFound: no such job.
            InvalidState: it is running, finished or cancelled already.
        """
        return str(self._moving_retry(lambda at: self._cancel(job_id, at, now_ms, running), shard))

    def _cancel(self, job_id: str, shard: int | None, now_ms: int | None, running: bool) -> str:
        s = self.lookup.locate(job_id, shard)
        shard_keys = self.keys.shard(s)
        code, state = self.redis.run_acked(
            self.redis.scripts.cancel, [shard_keys.due, shard_keys.buckets, shard_keys.inflight,
                                        shard_keys.job(job_id), shard_keys.released, shard_keys.changes],
            [self.redis.now_arg(now_ms), job_id, self.config.bucket_ms, self.config.record_ttl_ms,
             "1" if running else "", self.redis.logs_changes], f"cancelling job {job_id!r}",
        )
        raise_for(code, job_id, state, "cancel")
        return str(state)

    def reschedule(self, job_id: str, due: str, shard: int | None = None, now_ms: int | None = None) -> int:
        """Move a scheduled job to ``due`` ('<ms>' or '+<ms>', ``reschedule.lua``); return the new due ms.

        Raises:
            JobNotFound: no such job.
            InvalidState: it is not SCHEDULED any more.
        """
        return int(self._moving_retry(lambda at: self._reschedule(job_id, due, at, now_ms), shard))

    def _reschedule(self, job_id: str, due: str, shard: int | None, now_ms: int | None) -> int:
        s = self.lookup.locate(job_id, shard)
        shard_keys = self.keys.shard(s)
        code, state, new_due = self.redis.run_acked(
            self.redis.scripts.reschedule, [shard_keys.due, shard_keys.buckets, shard_keys.next,
                                            shard_keys.job(job_id), shard_keys.changes],
            [self.redis.now_arg(now_ms), job_id, due, self.config.bucket_ms, self.keys.wake, s,
             self.redis.logs_changes, self.config.record_ttl_ms], f"rescheduling job {job_id!r}",
        )
        raise_for(code, job_id, state, "reschedule")
        return int(new_due)

    def drop(self, job_id: str, shard: int) -> None:
        """Take a job out of the schedule without reporting it (its transaction never committed): CANCELLED."""
        with contextlib.suppress(JobNotFound, InvalidState):
            self.cancel(job_id, shard)

    # -- interception --------------------------------------------------------------------

    def note_fallback(self, shard: int, task: str, reason: str, now_ms: int | None = None) -> int:
        """Count a delayed send that went to the broker as an ETA message (``note_fallback.lua``).

        Returns the shard's count; the fleet's is the sum over the shards
        (:func:`~celery_delayed.store.views.eta_fallbacks`).
        """
        what = f"{task}|{' '.join(reason.split())}"[:500]
        return int(self.redis.run(
            self.redis.scripts.note_fallback, [self.keys.shard(shard).stats],
            [self.redis.now_arg(now_ms), ETA_FALLBACKS, ETA_FALLBACK_LAST, what],
        ))

    # -- operators' controls (pause, resume, promote, cancel matching) ------------------------

    def pause(self, flags: Sequence[str], now_ms: int | None = None) -> None:
        """Set pause flags on every shard (``pause.lua``): ``all``, ``task:<name>``, ``queue:<name>``."""
        self.layout.check()
        self.redis.run_many(self.redis.scripts.pause, [self._pause_call(s, now_ms, ["pause", 0, 0, *flags])
                                                       for s in self.layout.shard_range()])

    def _pause(self, shard: int, now_ms: int | None, args: Sequence[Arg]) -> Any:
        """One shard's ``pause.lua`` call (``args`` from its mode on), and its reply."""
        return self.redis.run(self.redis.scripts.pause, *self._pause_call(shard, now_ms, args))

    def _pause_call(self, shard: int, now_ms: int | None, args: Sequence[Arg]) -> tuple[list[str], list[Arg]]:
        shard_keys = self.keys.shard(shard)
        return ([shard_keys.paused, shard_keys.held, shard_keys.due, shard_keys.buckets, shard_keys.next],
                [self.redis.now_arg(now_ms), shard_keys.job_prefix, self.config.bucket_ms, self.keys.wake, shard,
                 *args])

    def resume(self, flags: Sequence[str] = (), now_ms: int | None = None, batch: int = 1000) -> int:
        """Clear pause flags on every shard (none given: all of them) and put back the jobs they held (``pause.lua``).

        Returns how many held jobs went back to the due set (released at
        once, the misfire policy applying to them as to any late job).
        """
        self.layout.check()
        moved = 0
        for s in self.layout.shard_range():
            at = 0
            while at >= 0:
                n, at = self._pause(s, now_ms, ["resume", batch, at, *flags])
                moved += int(n)
        return moved

    def pauses(self) -> dict[str, int]:
        """The pause flags in force (any shard's), each with when it was set (epoch ms)."""
        pipe = self.redis.client.pipeline(transaction=False)
        for s in self.layout.shard_range():
            pipe.hgetall(self.keys.shard(s).paused)
        out: dict[str, int] = {}
        for flags in pipe.execute():
            for flag, since in flags.items():
                out[str(flag)] = min(int(float(since)), out.get(str(flag), 1 << 62))
        return out

    def index_parts(self, shard: int, task: str | None = None, queue: str | None = None) -> list[str]:
        """The pending-index parts of a shard (``<n>:<task>:<queue>``), of one task and/or queue if given."""
        parts = [str(p) for p in self.redis.client.smembers(self.keys.shard(shard).index_parts)]
        if task is not None and queue is not None:
            return [p for p in parts if p == index_part(task, queue)]
        return [p for p in parts if _part_matches(p, task, queue)]

    def promote(self, job_id: str, shard: int | None = None, now_ms: int | None = None) -> int:
        """Make a scheduled job due now ("run now", ``promote.lua``); return its due time (epoch ms).

        Raises:
            JobNotFound: no such job.
            InvalidState: it is not SCHEDULED any more.
        """
        def once(at: int | None) -> int:
            s = self.lookup.locate(job_id, at)
            _n, now, state = self._promote(s, now_ms, 1, "ids", [job_id])
            if not state:
                raise JobNotFound(job_id)
            if state != JobState.SCHEDULED:
                raise InvalidState(job_id, str(state), "promote")
            return int(now)

        return int(self._moving_retry(once, shard))

    def _promote(self, shard: int, now_ms: int | None, limit: int, mode: str, items: Sequence[str]) -> Any:
        """One shard's ``promote.lua`` call: ``items`` are job ids (``mode`` "ids") or index parts ("index")."""
        shard_keys = self.keys.shard(shard)
        return self.redis.run(
            self.redis.scripts.promote, [shard_keys.due, shard_keys.buckets, shard_keys.next,
                                         *self.redis.change_log(shard_keys)],
            [self.redis.now_arg(now_ms), shard_keys.job_prefix, self.config.bucket_ms, self.keys.wake, shard, limit,
             mode,
             *items],
        )

    def promote_matching(self, task: str | None = None, queue: str | None = None, now_ms: int | None = None,
                         batch: int = 1000) -> int:
        """Make every scheduled job of a task and/or queue due now, a batch per call (``promote.lua``); return how many.

        Raises:
            InvalidOption: neither a task nor a queue.
        """
        _need_match(task, queue)
        total = 0
        for s in self.layout.shard_range():
            parts = self.index_parts(s, task, queue)
            while parts:
                n = int(self._promote(s, now_ms, batch, "index", parts)[0])
                total += n
                if n < batch:
                    break
        return total

    def cancel_matching(self, task: str | None = None, queue: str | None = None, due_from_ms: int | None = None,
                        due_to_ms: int | None = None, now_ms: int | None = None, batch: int = 1000) -> list[str]:
        """Cancel the scheduled jobs of a task and/or queue due in a window (``cancel_matching.lua``).

        Bounded by what matches (read from the pending index), a batch per
        call, each call atomic on its shard. Returns the ids cancelled.

        Raises:
            InvalidOption: neither a task nor a queue.
        """
        _need_match(task, queue)
        lo = "-inf" if due_from_ms is None else str(int(due_from_ms))
        hi = "+inf" if due_to_ms is None else str(int(due_to_ms))
        out: list[str] = []
        for s in self.layout.shard_range():
            parts = self.index_parts(s, task, queue)
            shard_keys = self.keys.shard(s)
            while parts:
                ids = [str(i) for i in self.redis.run(
                    self.redis.scripts.cancel_matching, [shard_keys.due, shard_keys.buckets,
                                                         *self.redis.change_log(shard_keys)],
                    [self.redis.now_arg(now_ms), shard_keys.job_prefix, self.config.bucket_ms,
                     self.config.record_ttl_ms, lo,
                     hi, batch, *parts],
                )]
                out += ids
                if len(ids) < batch:
                    break
        return out


def _keep(jobs: Sequence[NewJob], order: Sequence[tuple[int, list[int]]], replies: Sequence[Any],
          out: list[Scheduled | None]) -> None:
    """Put the outcome of each job of the ``schedule.lua`` calls that stored their jobs into ``out``.

    ``order[n]``: call n's shard and the positions of its jobs; ``replies[n]``:
    its reply (None if it did not run; ``!moved`` and ``!tpl`` stored nothing).
    """
    for (shard, idx), reply in zip(order, replies, strict=True):
        if not isinstance(reply, list) or reply in (["!moved"], ["!tpl"]):
            continue
        for i, entry in zip(idx, reply, strict=True):
            if entry.startswith("="):
                out[i] = Scheduled(jobs[i].id, shard, int(entry[1:]), True, JobState.SCHEDULED)
            else:
                state, due, gen = [*entry.split("|"), "", ""][:3]
                out[i] = Scheduled(jobs[i].id, shard, int(float(due or 0)), False, state, int(gen or 0))



def _need_match(task: str | None, queue: str | None) -> None:
    if not task and not queue:
        raise InvalidOption("give a task name or a queue (or both) to match jobs by")


def _part_matches(part: str, task: str | None, queue: str | None) -> bool:
    t, q = parse_index_part(part)
    return (task is None or t == task) and (queue is None or q == queue)

