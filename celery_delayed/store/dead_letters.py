"""Dead letters: the jobs whose attempts ran out, listed, shown, requeued and purged.

A dead letter is the job's record (state DEAD) indexed in its shard's
``{p}:{s}:dlq`` sorted set by time of death (``dead.lua``, run by the
worker's :meth:`~.executions.Executions.dead`, and by the scheduler's
misfire policy). :class:`DeadLetters` is the one place that reads and
changes them afterwards (``requeue.lua``, ``purge_dead.lua``).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidOption, InvalidState, raise_for
from ..vocab import Field, JobState, Reply
from .facet import Facet
from .layout import ShardLayout
from .lookup import Lookup
from .paging import PAGE, check_page
from .records import Outcome
from .runner import Runner

_PURGE_BATCH = 1000


@dataclass(frozen=True)
class DeadLetter:
    """One dead letter, as listed (``show`` gives the whole record)."""

    id: str
    shard: int
    died_ms: int
    task: str
    queue: str
    error: str  # "<exception type>: <message>", or the misfire reason
    attempts: int
    host: str

    def as_dict(self) -> dict[str, Any]:
        """The letter as a JSON-ready dict."""
        return {"id": self.id, "shard": self.shard, "died_ms": self.died_ms, "task": self.task,
                "queue": self.queue, "error": self.error, "attempts": self.attempts, "host": self.host}


_SUMMARY = (Field.TASK, Field.QUEUE, Field.ERROR_TYPE, Field.ERROR_MESSAGE, Field.REASON, Field.ATTEMPTS,
            Field.HOST, Field.STATE)


def _letter(job_id: str, shard: int, died: float, rec: list[Any]) -> DeadLetter:
    task, q, etype, emsg, reason, attempts, host = (rec[i] or "" for i in range(7))
    error = f"{etype}: {emsg}" if etype else reason
    try:
        n = int(attempts)
    except ValueError:
        n = 0
    return DeadLetter(job_id, shard, int(died), task, q, error, n, host)


class DeadLetters(Facet):
    """The dead-letter queue of one store: every shard's ``dlq`` set, merged by time of death.

    A dead letter is the job's record (state DEAD) indexed in its shard's
    ``{p}:{s}:dlq`` sorted set by time of death. It keeps the task name, the
    arguments (``args``/``kwargs`` as reprs, and a message ready to send), the
    exception type and message, the traceback, ``attempts``, the first and
    last attempt times, the worker hostname and when it died. A job
    dead-lettered by the misfire policy carries a ``reason`` instead of an
    exception. Each death trims letters older than ``delayed_dlq_max_age_s``
    and, per shard, beyond ``ceil(delayed_dlq_max_len / delayed_shards)``.
    """

    SCRIPTS = ("requeue", "purge_dead")

    def __init__(self, redis: Runner, layout: ShardLayout, lookup: Lookup) -> None:
        super().__init__(redis, layout)
        self.lookup = lookup

    def count(self) -> int:
        """The number of dead letters over all shards."""
        pipe = self.redis.client.pipeline(transaction=False)
        for s in self.layout.shard_range():
            pipe.zcard(self.keys.shard(s).dlq)
        return sum(int(n) for n in pipe.execute())

    def page(self, offset: int = 0, limit: int = 50, task: str | None = None) -> list[DeadLetter]:
        """Dead letters, most recent death first, optionally of one task name.

        Raises:
            InvalidOption: a negative offset or a limit below 1.
        """
        check_page(offset, limit)
        merged = heapq.merge(*(self._shard_stream(s) for s in self.layout.shard_range()), key=lambda e: -e[0])
        out: list[DeadLetter] = []
        skipped = 0
        batch: list[tuple[float, int, str]] = []

        def flush() -> bool:
            nonlocal skipped
            pipe = self.redis.client.pipeline(transaction=False)
            for _, s, jid in batch:
                pipe.hmget(self.keys.shard(s).job(jid), *_SUMMARY)
            for (died, s, jid), rec in zip(batch, pipe.execute(), strict=True):
                if rec[-1] != JobState.DEAD or (task and rec[0] != task):
                    continue
                if skipped < offset:
                    skipped += 1
                    continue
                out.append(_letter(jid, s, died, rec))
                if len(out) >= limit:
                    return True
            batch.clear()
            return False

        for entry in merged:
            batch.append(entry)
            if len(batch) >= min(PAGE, offset + limit) and flush():
                return out
        if batch:
            flush()
        return out

    def _shard_stream(self, shard: int) -> Iterator[tuple[float, int, str]]:
        """(died, shard, id) of one shard, most recent first, read a page at a time."""
        key = self.keys.shard(shard).dlq
        start = 0
        while True:
            page: list[Any] = list(self.redis.client.zrevrange(key, start, start + PAGE - 1, withscores=True))
            if not page:
                return
            for jid, died in page:
                yield (float(died), shard, str(jid))
            start += len(page)

    def show(self, job_id: str) -> dict[str, str]:
        """The whole record of a dead letter (traceback included, message left out).

        Raises:
            JobNotFound: no record with this id.
            InvalidState: the job exists but is not DEAD.
        """
        rec = self.lookup.get(job_id)
        if rec.get(Field.STATE) != JobState.DEAD:
            raise InvalidState(job_id, rec.get(Field.STATE, "?"), "show as a dead letter")
        return rec

    def requeue_job(self, job_id: str, due: str) -> int:
        """Schedule one dead letter again at ``due`` ('<ms>' or '+<ms>'); return its due time (epoch ms).

        Raises:
            JobNotFound: no record with this id.
            InvalidState: it is not DEAD, or it has no message to send.
        """
        due_ms, outcomes = self.requeue(self.lookup.locate(job_id), [job_id], due)
        raise_for(outcomes[0].code, job_id, outcomes[0].state, "requeue")
        return due_ms

    def requeue_all(self, due: str, task: str | None = None) -> int:
        """Schedule every dead letter (of one task name, if given) again; return how many."""
        total = 0
        for s in self.layout.shard_range():
            shard_keys = self.keys.shard(s)
            stuck = 0  # letters requeue cannot move (no message), or of another task: skip past them
            while True:
                ids = [str(i) for i in self.redis.client.zrange(shard_keys.dlq, stuck, stuck + PAGE - 1)]
                if not ids:
                    break
                if task:
                    pipe = self.redis.client.pipeline(transaction=False)
                    for jid in ids:
                        pipe.hget(shard_keys.job(jid), Field.TASK)
                    keep = [jid for jid, name in zip(ids, pipe.execute(), strict=True) if name == task]
                    stuck += len(ids) - len(keep)
                    ids = keep
                    if not ids:
                        continue
                _, outcomes = self.requeue(s, ids, due)
                total += sum(1 for o in outcomes if o.code == Reply.OK)
                stuck += sum(1 for o in outcomes if o.code == Reply.NO_MESSAGE)
        return total

    def purge(self, older_than_s: float | None = None) -> int:
        """Delete dead letters that died more than ``older_than_s`` seconds ago (None: all); return how many.

        Raises:
            InvalidOption: a negative or non-numeric ``older_than_s``.
        """
        age_ms = None
        if older_than_s is not None:
            if isinstance(older_than_s, bool) or not isinstance(older_than_s, (int, float)) \
                    or not older_than_s >= 0:
                raise InvalidOption(f"older_than must be a number of seconds >= 0, got {older_than_s!r}")
            age_ms = int(older_than_s * 1000)
        total = 0
        for s in self.layout.shard_range():
            while True:
                n = self.purge_dead(s, age_ms, _PURGE_BATCH)
                total += n
                if n < _PURGE_BATCH:
                    break
        return total

    def requeue(
        self, shard: int, ids: Sequence[str], due: str, now_ms: int | None = None,
    ) -> tuple[int, list[Outcome]]:
        """Schedule dead letters of one shard again at ``due`` (``requeue.lua``).

        Returns the due time (epoch ms) and one outcome per id: OK,
        NOT_FOUND, WRONG_STATE (not DEAD) or NO_MESSAGE.
        """
        shard_keys = self.keys.shard(shard)
        reply = self.redis.run(
            self.redis.scripts.requeue, [shard_keys.due, shard_keys.buckets, shard_keys.next, shard_keys.dlq,
                                         shard_keys.changes],
            [self.redis.now_arg(now_ms), shard_keys.job_prefix, due, self.config.bucket_ms, self.keys.wake, shard,
             self.redis.logs_changes, *ids],
        )
        rest = reply[1:]
        return int(reply[0]), [Outcome(Reply(int(rest[i])), str(rest[i + 1])) for i in range(0, len(rest), 2)]

    def purge_dead(self, shard: int, older_than_ms: int | None = None, limit: int = 1000) -> int:
        """Delete up to ``limit`` dead letters of one shard older than ``older_than_ms`` (``purge_dead.lua``).

        ``older_than_ms`` None deletes them regardless of age.
        """
        shard_keys = self.keys.shard(shard)
        return int(self.redis.run(
            self.redis.scripts.purge_dead, [shard_keys.dlq],
            ["", shard_keys.job_prefix, "" if older_than_ms is None else older_than_ms, limit],
        ))
