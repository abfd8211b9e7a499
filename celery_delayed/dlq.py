"""The dead-letter queue: list, inspect, requeue and purge jobs that ran out of attempts.

A dead letter is the job's record (state DEAD) indexed in its shard's
``{p}:{s}:dlq`` sorted set by time of death. It keeps the task name, the
arguments (``args``/``kwargs`` as reprs, and a message ready to send), the
exception type (``etype``) and message (``emsg``), the traceback (``tb``),
``attempts``, the first and last attempt times (``first_at``, ``last_at``),
the worker hostname (``host``) and when it died (``died``). A job dead-lettered
by the misfire policy carries a ``reason`` instead of an exception.

The queue is bounded: each death trims letters older than
``delayed_dlq_max_age_s`` and, per shard, beyond ``ceil(delayed_dlq_max_len /
delayed_shards)``. Times are the Redis server's clock, epoch ms.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Any

from celery import Celery

from .errors import InvalidOption, InvalidState, JobNotFound
from .store import Store, get_store
from .timeutil import due_spec

_SUMMARY = ("task", "q", "etype", "emsg", "reason", "attempts", "host", "first_at", "last_at", "st")
_PAGE = 500
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


def _store(app: Celery | Store) -> Store:
    return app if isinstance(app, Store) else get_store(app)


def _letter(job_id: str, shard: int, died: float, rec: list[Any]) -> DeadLetter:
    task, q, etype, emsg, reason, attempts, host = (rec[i] or "" for i in range(7))
    error = f"{etype}: {emsg}" if etype else reason
    try:
        n = int(attempts)
    except ValueError:
        n = 0
    return DeadLetter(job_id, shard, int(died), task, q, error, n, host)


def count(app: Celery | Store) -> int:
    """The number of dead letters over all shards."""
    store = _store(app)
    pipe = store.client.pipeline(transaction=False)
    for s in range(store.config.shards):
        pipe.zcard(store.keys.shard(s).dlq)
    return sum(int(n) for n in pipe.execute())


def list_dead(
    app: Celery | Store, offset: int = 0, limit: int = 50, task: str | None = None
) -> list[DeadLetter]:
    """Dead letters, most recent death first, optionally of one task name.

    Raises:
        InvalidOption: a negative offset or a limit below 1.
    """
    if offset < 0 or limit < 1:
        raise InvalidOption(f"offset must be >= 0 and limit >= 1, got offset={offset}, limit={limit}")
    store = _store(app)
    streams = [_shard_stream(store, s) for s in range(store.config.shards)]
    merged = heapq.merge(*streams, key=lambda e: -e[0])
    out: list[DeadLetter] = []
    skipped = 0
    batch: list[tuple[float, int, str]] = []

    def flush() -> bool:
        pipe = store.client.pipeline(transaction=False)
        for _, s, jid in batch:
            pipe.hmget(store.keys.shard(s).job(jid), *_SUMMARY)
        nonlocal skipped
        for (died, s, jid), rec in zip(batch, pipe.execute(), strict=True):
            if rec[-1] != "DEAD" or (task and rec[0] != task):
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
        if len(batch) >= min(_PAGE, offset + limit) and flush():
            return out
    if batch:
        flush()
    return out


def _shard_stream(store: Store, shard: int) -> Any:
    """(died, shard, id) of one shard, most recent first, read a page at a time."""
    key = store.keys.shard(shard).dlq
    start = 0
    while True:
        page: list[Any] = list(store.client.zrevrange(key, start, start + _PAGE - 1, withscores=True))
        if not page:
            return
        for jid, died in page:
            yield (float(died), shard, str(jid))
        start += len(page)


def show(app: Celery | Store, job_id: str) -> dict[str, str]:
    """The whole record of a dead letter (traceback included, message left out).

    Raises:
        JobNotFound: no record with this id.
        InvalidState: the job exists but is not DEAD.
    """
    rec = _store(app).get(job_id)
    if rec.get("st") != "DEAD":
        raise InvalidState(job_id, rec.get("st", "?"), "show as a dead letter")
    return rec


def requeue(app: Celery | Store, job_id: str, when: object = 0) -> int:
    """Schedule a dead letter again at ``when`` (default now), attempt counter reset.

    Returns the due time, epoch ms.

    Raises:
        JobNotFound: no record with this id.
        InvalidState: it is not DEAD, or it has no message to send.
        InvalidWhen: a bad ``when``.
    """
    store = _store(app)
    due = due_spec(when, store.app.timezone)
    shard = store.locate(job_id)
    due_ms, codes = _requeue(store, shard, [job_id], due)
    code = codes[0]
    if code == 1:
        return due_ms
    if code == 0:
        raise JobNotFound(job_id)
    state = str(store.client.hget(store.keys.shard(shard).job(job_id), "st") or "gone")
    if code == -2:
        raise InvalidState(job_id, f"{state} without a stored message", "requeue")
    raise InvalidState(job_id, state, "requeue")


def requeue_all(app: Celery | Store, when: object = 0, task: str | None = None) -> int:
    """Schedule every dead letter (of one task name, if given) again; return how many."""
    store = _store(app)
    due = due_spec(when, store.app.timezone)
    total = 0
    for s in range(store.config.shards):
        sk = store.keys.shard(s)
        stuck = 0  # letters requeue cannot move (no message): skip past them
        while True:
            ids = [str(i) for i in store.client.zrange(sk.dlq, stuck, stuck + _PAGE - 1)]
            if not ids:
                break
            if task:
                pipe = store.client.pipeline(transaction=False)
                for jid in ids:
                    pipe.hget(sk.job(jid), "task")
                names = pipe.execute()
                keep = [jid for jid, name in zip(ids, names, strict=True) if name == task]
                stuck += len(ids) - len(keep)
                ids = keep
                if not ids:
                    continue
            _, codes = _requeue(store, s, ids, due)
            total += sum(1 for c in codes if c == 1)
            stuck += sum(1 for c in codes if c == -2)
    return total


def _requeue(store: Store, shard: int, ids: list[str], due: str) -> tuple[int, list[int]]:
    sk = store.keys.shard(shard)
    reply = store._run(
        store.scripts.requeue,
        [sk.due, sk.buckets, sk.next, sk.dlq],
        [sk.job_prefix, due, store.config.bucket_ms, store.keys.wake, shard, "", *ids],
    )
    return int(reply[0]), [int(c) for c in reply[1:]]


def purge(app: Celery | Store, older_than: float | None = None) -> int:
    """Delete dead letters that died more than ``older_than`` seconds ago (None: all); return how many.

    Raises:
        InvalidOption: a negative or non-numeric ``older_than``.
    """
    store = _store(app)
    cutoff = ""
    if older_than is not None:
        if isinstance(older_than, bool) or not isinstance(older_than, (int, float)) or not older_than >= 0:
            raise InvalidOption(f"older_than must be a number of seconds >= 0, got {older_than!r}")
        cutoff = str(store.now_ms() - int(older_than * 1000))
    total = 0
    for s in range(store.config.shards):
        sk = store.keys.shard(s)
        while True:
            n = int(store._run(store.scripts.purge_dead, [sk.dlq], [sk.job_prefix, cutoff, _PURGE_BATCH]))
            total += n
            if n < _PURGE_BATCH:
                break
    return total
